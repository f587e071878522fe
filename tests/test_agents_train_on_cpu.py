"""Episodes trained end to end on the CPU: a tiny model steered to call the calculator (agent_helpers)
runs two GRPO steps of three-turn episodes; the tool runs in its worker, the loss mask covers only the
model's own tokens (checked against the conversation's roles), the engine's log-probs match the trainer's
full forward over the whole conversation, and samples.jsonl shows the turns."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from agent_helpers import CALCULATOR, CLOSE, DIGIT_REWARD, OPEN, make_tool_model
from conftest import make_tiny_model, need_tokenizer, prepare_trainer
from edgerl.agents.calls import Continuations
from edgerl.core.errors import ToolError
from edgerl.train.experience import pad_batch
from edgerl.train.metrics import read_metrics


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    folder = make_tool_model(tmp_path_factory.mktemp("tool-model"), need_tokenizer())
    rows = [{"prompt": q, "data_source": "calc", "reward_model": {"ground_truth": "0"}}
            for q in ("What is 2 + 3?", "What is 7 * 6?", "What is 9 - 4?", "What is 8 / 2?")]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tools.py").write_text(CALCULATOR)
    (folder / "reward.py").write_text(DIGIT_REWARD)
    return folder


def sets(folder, *more):
    return ['run.profile="cpu"', f'data.path="{folder / "prompts.jsonl"}"', "train.steps=2",
            "train.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=6", "rollout.max_turns=3",
            "rollout.max_episode_tokens=128",
            f'rollout.tools=["{folder / "tools.py"}:calculator"]', "rollout.tool_workers=1",
            f'reward.functions=["{folder / "reward.py"}:score"]', "algo.kl_coef=0", "run.log_samples=4",
            "run.tensorboard=false", "run.export_final=false", "run.save_every=0", "train.lr=1e-4", *more]


def check_roles(batch, tokenizer):
    """Every episode's tokens are the model's turns and, between them, the template's rendering of the tool
    messages; the loss mask is 1 exactly on the turns."""
    cont = Continuations(tokenizer)
    exp = pad_batch(batch, tokenizer.pad_token_id, [0.0] * len(batch))
    for i, ep in enumerate(batch.episodes):
        roles = [m["role"] for m in ep.messages]
        assert roles == ["assistant", "tool", "assistant", "tool", "assistant"], roles
        expected_ids, expected_mask = [], []
        for j, m in enumerate(ep.messages):
            if m["role"] == "assistant":
                ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                expected_ids += ids
                expected_mask += [1] * len(ids)
            elif j == 0 or ep.messages[j - 1]["role"] != "tool":   # the tool messages after one turn
                group = [m]
                for k in range(j + 1, len(ep.messages)):
                    if ep.messages[k]["role"] != "tool":
                        break
                    group.append(ep.messages[k])
                ids = cont.tokens(group)
                expected_ids += ids
                expected_mask += [0] * len(ids)
        assert ep.tokens == expected_ids and ep.mask == expected_mask
        mask = exp.response_mask[i]
        assert mask[:len(ep.mask)].tolist() == [float(x) for x in ep.mask] and not mask[len(ep.mask):].any()
        assert exp.attention_mask[i, exp.start + 1:exp.start + 1 + len(ep.tokens)].all()   # the context is read


def greedy_equals_full_forward(t, prompts):
    """Greedy episodes on the engine (its KV cache, the tools' results prefilled into it) against the model's
    forward over each whole conversation in fp32: the same token at every model position, the same
    log-probs."""
    batch = t.episodes.generate(prompts, 1, dataclasses.replace(t.sampling, greedy=True), None)
    model = t.engine.model
    assert next(model.parameters()).dtype == torch.float32
    for ep in batch.episodes:
        assert ep.turns == 3 and 0 in ep.mask
        with torch.no_grad():
            logits = model(torch.tensor([ep.prompt_ids + ep.tokens])).logits[0].float()
        P = len(ep.prompt_ids)
        for j, (tok, own) in enumerate(zip(ep.tokens, ep.mask)):
            if own:
                assert int(logits[P + j - 1].argmax()) == tok
                assert ep.logprobs[j] == pytest.approx(float(logits[P + j - 1].log_softmax(-1)[tok]), abs=1e-4)


def test_two_grpo_steps_on_three_turn_episodes(tool_model, tmp_path):
    # the rollout correction (off on the CPU's plan) weighs the model's tokens only, against the engine's log-probs
    t = prepare_trainer(tool_model, tmp_path / "run", sets(tool_model, 'algo.rollout_correction="mis"'))
    assert t.engine.name == "static" and hasattr(t.engine, "generate_turns")   # the KV cache kept between turns
    longest = max(len(p.input_ids) for p in t.prompts)   # the cache: prompt, budget and one turn (6) more
    assert t.engine.engine.dec.cache_len == -(-(longest + 128 + 6) // 16) * 16
    batches = []
    real = t.rollout

    def rollout(prompts):
        batches.append(real(prompts))
        if len(batches) == 1:
            greedy_equals_full_forward(t, prompts)
        return batches[-1]
    t.rollout = rollout
    t.run()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/turns_mean"] == 3 and r["rollout/tool_calls_mean"] == 2 and r["rollout/tool_errors"] == 0
        assert r["rollout/ended_max_turns"] == 1 and r["rollout/context_tokens_mean"] > r["rollout/model_tokens_mean"]
        # the engine's log-probs of every model token equal the trainer's forward over the whole conversation
        assert r["rollout/logprob_diff"] < 1e-4, r["rollout/logprob_diff"]
        assert r["rollout/k3_kl"] < 1e-6 and r["rollout_corr/masked"] == 0
        assert r["rollout_corr/weight_mean"] == pytest.approx(1, abs=1e-3), r["rollout_corr/weight_mean"]
        assert "actor/pg_loss" in r and r["batch/uniform_groups"] < 2   # the digits differ: there is a gradient
    for batch in batches:
        check_roles(batch, t.tokenizer)
        assert batch.info["rounds"] == 3 and batch.info["extend_s"] > 0   # results prefilled into the cache
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    for s in samples:
        conv = s["conversation"]
        assert [m["role"] for m in conv] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert conv[0]["content"].startswith(OPEN) and conv[0]["content"].endswith(CLOSE)
        digit = int(conv[0]["content"][len(OPEN)])
        result, pid = conv[1]["content"].split(" (process ")
        assert result == str(11 * digit) and int(pid.rstrip(")")) != os.getpid()   # ran in the worker
        assert s["turns"] == 3 and s["tool_calls"] == 2 and s["ended_by"] == "max_turns"
        assert s["reward"] == pytest.approx(digit / 9)


def test_a_model_whose_template_has_no_tool_support_is_refused_before_the_run(tmp_path, tool_model):
    plain = make_tiny_model(tmp_path / "smollm2")   # SmolLM2's chat template never reads `tools`
    with pytest.raises(ToolError, match="has no tool support") as e:
        prepare_trainer(plain, tmp_path / "run", sets(tool_model))
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


ODD_DIGITS = '''
import re


class OddDigits:
    """Two turns: each turn's first digit scores 1 when odd; the first observation asks for a digit."""

    def reset(self, row):
        self.turn = 0
        return "Pick a digit, " + row["interaction_kwargs"]["who"]

    def step(self, text):
        self.turn += 1
        digit = int(re.search(r"\\d", text).group(0))
        return f"you said {digit}", float(digit % 2), self.turn == 2
'''


def test_an_environment_rewards_each_turn(tool_model, tmp_path):
    (tmp_path / "env.py").write_text(ODD_DIGITS)
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "data_source": "game", "reward_model": {"ground_truth": "0"},
             "extra_info": {"interaction_kwargs": {"who": "please"}}}] * 2
    (tmp_path / "game.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = prepare_trainer(tool_model, tmp_path / "run", [
        s for s in sets(tool_model, f'rollout.environment="{tmp_path / "env.py"}:OddDigits"', "reward.functions=[]",
                        "rollout.turn_discount=0.5", "train.steps=1", f'data.path="{tmp_path / "game.jsonl"}"')
        if not s.startswith(("rollout.tools", "reward.functions=[\"", "data.path=\"" + str(tool_model)))])
    batches = []
    real = t.rollout
    t.rollout = lambda prompts: batches.append(real(prompts)) or batches[-1]
    t.run()
    for ids in batches[0].prompt_ids:   # the first observation joined the prompt's user message
        assert "Play.\n\nPick a digit, please<|im_end|>" in t.tokenizer.decode(ids)
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        conv = s["conversation"]
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
        assert conv[0]["content"] == "Pick a digit, please" and conv[0]["first_observation"]
        digits = [int(m["content"][len(OPEN)]) for m in conv if m["role"] == "assistant"]
        assert conv[2]["content"] == f"you said {digits[0]}" and s["ended_by"] == "environment"
        assert s["turn_rewards"] == [float(d % 2) for d in digits]
        assert s["reward"] == pytest.approx(digits[0] % 2 + 0.5 * (digits[1] % 2))
    row = read_metrics(tmp_path / "run")[-1]
    assert row["rollout/turns_mean"] == 2 and "reward/environment_mean" in row and "reward/turn_mean" in row


def test_edgerl_eval_runs_the_same_episodes_greedily(tool_model):
    from edgerl.train.eval_run import load_eval_config, run_eval
    cfg, ckpt = load_eval_config(str(tool_model), [x for x in sets(tool_model) if not x.startswith("run.")] + [
        f'eval.data="{tool_model / "prompts.jsonl"}"', 'run.profile="cpu"'])
    res = run_eval(cfg, ckpt, log=lambda s: None)
    assert res["metrics"]["eval/prompts"] == 4 and len(res["samples"]) == 4
    for s in res["samples"]:
        assert [m["role"] for m in s["conversation"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
        digit = int(s["conversation"][0]["content"][len(OPEN)])
        assert s["turns"] == 3 and s["tool_calls"] == 2 and s["reward"] == pytest.approx(digit / 9)


def _episode_stats_by_hand(episodes, infos) -> dict:
    """The whole batch's episode statistics, one loop over every episode and every rank's report."""
    n = len(episodes)
    rewards = []
    for e in episodes:
        rewards.extend(e.turn_rewards)
    out = {"rollout/turns_mean": sum(e.turns for e in episodes) / n,
           "rollout/turns_max": max(e.turns for e in episodes),
           "rollout/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
           "rollout/tool_errors": sum(e.tool_errors for e in episodes),
           "rollout/tool_timeouts": sum(i["timeouts"] for i in infos),
           "rollout/tool_restarts": sum(i["restarts"] for i in infos),
           "rollout/model_tokens_mean": sum(e.model_tokens for e in episodes) / n,
           "rollout/context_tokens_mean": sum(e.context_tokens for e in episodes) / n,
           "rollout/tool_s": sum(i["seconds"] for i in infos),
           "time/tool_wait_s": max(i["tool_wait_s"] for i in infos),
           "rollout/rounds": max(i["rounds"] for i in infos), "rollout/extend_s": max(i["extend_s"] for i in infos),
           "reward/turn_mean": sum(rewards) / len(rewards)}
    for why in ("answer", "environment", "max_turns", "truncated", "budget"):
        out[f"rollout/ended_{why}"] = sum(e.ended_by == why for e in episodes) / n
    return out


@pytest.mark.slow
def test_episode_statistics_under_torchrun_are_the_whole_batchs(tmp_path):
    """Two ranks holding different episodes (5 and 3) log what one loop over all 8 gives: means over every
    episode, counts and tool seconds summed, the longest wait and turn loop of either rank."""
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    import two_ranks_episode_metrics as m
    want = _episode_stats_by_hand([m.episode(i) for r in (0, 1) for i in m.EPISODES[r]], [m.INFO[0], m.INFO[1]])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(here / "two_ranks_episode_metrics.py"), str(tmp_path / "got.json")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "got.json").read_text())
    assert got == pytest.approx(want)
    alone = m.episode_metrics(m.batch(0))       # one process: its own episodes only
    assert alone["rollout/turns_mean"] == pytest.approx(sum(1 + i % 4 for i in m.EPISODES[0]) / 5)
    assert alone["rollout/tool_timeouts"] == 1 and got["rollout/tool_timeouts"] == 3
