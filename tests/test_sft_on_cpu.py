"""`edgerl sft`: the assistant-only loss against a plain loop, bad rows, the plan's memory for the step, a tiny
run that RL then starts from, and the embedded SmolLM2 learning the "#### <n>" answer format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import need_tokenizer, prepare_trainer

CHAT = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2 + 3 = 5\n#### 5"},
        {"role": "user", "content": "and 1+1?"}, {"role": "assistant", "content": "#### 2"}]


def _rows(path: Path, n: int = 12) -> Path:
    rows = []
    for i in range(n):
        a, b = i % 7 + 1, (3 * i) % 5 + 2
        q, ans = f"What is {a} + {b}?", f"{a} + {b} = {a + b}\n#### {a + b}"
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]} if i % 2
                    else {"prompt": q, "response": ans})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_loss_covers_each_assistant_turn_and_its_end_token():
    from transformers import AutoTokenizer
    from edgerl.data.sft import tokenize_row
    tok = AutoTokenizer.from_pretrained(need_tokenizer())
    row = tokenize_row(tok, CHAT)
    assert tok.decode(list(row.input_ids)) == tok.apply_chat_template(CHAT, tokenize=False)
    learned = "".join(tok.decode([i]) for i, m in zip(row.input_ids, row.loss_mask) if m)
    assert learned == "2 + 3 = 5\n#### 5<|im_end|>\n#### 2<|im_end|>\n"


def test_sft_loss_equals_a_plain_loop_over_the_rows(tiny_llama, tmp_path):
    """The trainer's loss on a batch (rows of different lengths, right-padded) = the mean over every assistant
    token of -log p(token | the tokens before it), computed row by row with the HF model."""
    from transformers import AutoModelForCausalLM
    from edgerl import algos
    from edgerl.train.sft import sft_batch
    from edgerl.train.sft import SftTrainer
    t = prepare_trainer(tiny_llama, tmp_path / "run", ['run.profile="cpu"', "sft.enabled=true", "run.tensorboard=false",
                                                       f'data.path="{_rows(tmp_path / "rows.jsonl")}"', "sft.max_len=64"])
    assert isinstance(t, SftTrainer) and t.engine is None   # trainer_for(session) is the supervised loop under sft
    rows = t.prompts[:3]
    exp = sft_batch(rows, t.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = t.actor(exp.input_ids, exp.attention_mask, exp.response_ids, exp.start, 1.0)
        got = float(algos.aggregate(-logp, exp.response_mask, "token-mean"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    total, count = 0.0, 0
    for r in rows:
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([r.input_ids])).logits[0].double(), -1)
        for pos in range(1, len(r.input_ids)):
            if r.loss_mask[pos]:
                total -= float(lp[pos - 1, r.input_ids[pos]])
                count += 1
    t.session.close()
    assert count == sum(sum(r.loss_mask[1:]) for r in rows) and got == pytest.approx(total / count, rel=1e-5)


def test_bad_rows_are_one_line_errors_naming_file_row_and_field(tmp_path):
    from transformers import AutoTokenizer
    from edgerl.core.errors import DataError
    from edgerl.data.sft import load_sft_rows
    tok = AutoTokenizer.from_pretrained(need_tokenizer())
    good = {"prompt": "hi", "response": "hello"}
    cases = [({"messages": [{"role": "bot", "content": "x"}]}, "field 'messages'[0]"),
             ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
             ({"question": "x"}, "has neither field 'messages'"),
             ({"prompt": "x", "response": 3}, "field 'response' is"),
             ({"prompt": 5, "response": "x"}, "field 'prompt' is")]
    for bad, words in cases:
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(DataError) as e:
            load_sft_rows(str(path), "train", "messages", "prompt", "response", None, tok, 512, "error", log=None)
        msg = str(e.value)
        assert "rows.jsonl" in msg and "row 1" in msg and "line 2" in msg and words in msg and "\n" not in msg, msg
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "long " * 80, "response": "x"}) + "\n")
    with pytest.raises(DataError, match=r"1 row\(s\) are longer than sft.max_len=64 tokens \(rows 1\)"):
        load_sft_rows(str(path), "train", "messages", "prompt", "response", None, tok, 64, "error", log=None)
    seen: list[str] = []
    rows = load_sft_rows(str(path), "train", "messages", "prompt", "response", None, tok, 64, "filter", log=seen.append)
    assert len(rows) == 1 and any("1 of 2 rows dropped" in s for s in seen)


def test_the_example_rows_load():
    from transformers import AutoTokenizer
    from edgerl.data.sft import load_sft_rows
    tok = AutoTokenizer.from_pretrained(need_tokenizer())
    path = Path(__file__).resolve().parents[1] / "examples" / "sft" / "arithmetic-format.jsonl"
    rows = load_sft_rows(str(path), "train", "messages", "prompt", "response", None, tok, 256, "error", log=None)
    assert len(rows) == 64 and all("####" in tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m])
                                   for r in rows)


def test_the_plan_of_an_sft_step_counts_the_update_alone():
    from edgerl.config.load import load_config
    from edgerl.config.target import plan_for, resolve_target
    sft = plan_for(load_config(None, ['model.path="qwen2.5-0.5b"', "sft.enabled=true", 'data.path="x.jsonl"',
                                      "sft.max_len=1024"]), resolve_target("t4"))
    rl = plan_for(load_config(None, ['model.path="qwen2.5-0.5b"', "data.max_prompt_len=256",
                                     "rollout.max_new_tokens=768"]), resolve_target("t4"))
    assert list(sft.memory.phases) == ["update"] and sft.task.sft and not sft.task.kl
    assert "generation weights" not in sft.memory.components and "reference weights" not in sft.memory.components
    assert sft.task.prompt_len + sft.task.response_len == 1024 and sft.memory.fits
    assert "rows per step (sft)" in sft.task.effective_batch()
    assert set(rl.memory.phases) == {"rollout", "score", "update"}


def test_a_tiny_sft_run_saves_final_and_rl_starts_from_it(tiny_llama, tmp_path):
    from edgerl.cli.main import app
    from edgerl.train.metrics import read_metrics
    run = tmp_path / "sft"
    res = CliRunner().invoke(app, ["sft", "--model", str(tiny_llama), "--data", str(_rows(tmp_path / "rows.jsonl")),
                                   "--steps", "2", "--out", str(run), "--profile", "cpu", "--set", "sft.max_len=64",
                                   "--set", "train.lr=1e-3", "--set", "run.tensorboard=false"])
    assert res.exit_code == 0, res.output
    assert "edgerl train --model" in " ".join(res.output.split())
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["sft/loss"] < rows[0]["sft/loss"]
    assert (run / "final" / "config.json").exists() and "enabled = true" in (run / "config.toml").read_text()
    t = prepare_trainer(run / "final", tmp_path / "rl", ['run.profile="cpu"', "rollout.max_new_tokens=4",
                                                         "train.prompts_per_step=2", "rollout.n_samples=2",
                                                         "run.tensorboard=false", "data.num_examples=8",
                                                         "train.steps=1", "run.export_final=false"])
    assert t.engine is not None and not t.cfg.sft.enabled
    t.run()
    assert [r["step"] for r in read_metrics(tmp_path / "rl")] == [1] and "reward/mean" in read_metrics(tmp_path / "rl")[0]


def test_sft_refuses_the_builtin_prompts_and_eval_in_one_line(tiny_llama, tmp_path):
    from edgerl.cli.main import app
    for extra, words in (([], "sft learns from written answers"),
                         (["--data", str(_rows(tmp_path / "r.jsonl")), "--set", 'eval.data="builtin:arithmetic"'],
                          "an sft run does not evaluate")):
        res = CliRunner().invoke(app, ["sft", "--model", str(tiny_llama), "--out", str(tmp_path / "x"), *extra])
        assert res.exit_code == 2 and words in " ".join(res.output.split()), res.output


@pytest.mark.slow
def test_sft_teaches_the_embedded_model_the_answer_format(tmp_path):
    """SmolLM2-135M-Instruct (real weights) marks few answers with "#### <n>" when asked (none of these 8); after 3
    LoRA SFT steps of 4 formatted answers to other problems, most of its greedy answers to held-out problems are
    marked (all 12 of 12 after 4 steps when this was written)."""
    from edgerl.data.builtin import arithmetic_prompt, generate_arithmetic
    from edgerl.rewards.rules import arithmetic_extract
    from edgerl.train.metrics import read_metrics

    def marked(model_dir: str, rows: list) -> float:
        from edgerl.models.load import load_causal_lm, load_tokenizer
        tok = load_tokenizer(model_dir)
        tok.padding_side = "left"
        lm = load_causal_lm(model_dir, torch.float32, "sdpa")
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = lm.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        answers = tok.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        return sum(arithmetic_extract(a)[1] for a in answers) / len(answers)

    problems = generate_arithmetic(40, difficulty=1, seed=3)
    train, held_out = problems[:24], problems[24:32]
    rows = [{"prompt": arithmetic_prompt(p["extra_info"]["question"]),
             "response": f"The answer is {p['reward_model']['ground_truth']}.\n#### {p['reward_model']['ground_truth']}"}
            for p in train]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = marked("smollm2-135m-instruct", held_out)
    run = tmp_path / "run"
    prepare_trainer("smollm2-135m-instruct", run, ['run.profile="cpu"', "sft.enabled=true", "train.steps=3",
                                                   f'data.path="{tmp_path / "rows.jsonl"}"', "sft.max_len=96",
                                                   "train.prompts_per_step=4", "train.lr=1e-3", "lora.enabled=true",
                                                   "run.save_every=0", "run.tensorboard=false"]).run()
    after = marked(str(run / "final"), held_out)
    losses = [r["sft/loss"] for r in read_metrics(run)]
    assert losses[-1] < losses[0]
    assert after >= before + 0.5, (before, after)
