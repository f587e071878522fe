"""Episodes with tools on the GPU (docs/agents.md): the tool recipes under their cards' memory, and the
multi-turn rollout against TRL's tool loop, on a scripted stand-in for a tool-calling model.

Random weights never call a tool, so the model is a stand-in: random weights at the real model's widths
and vocabulary (edgerl's catalogue), with a few weights set so that sampling writes, in every turn, some
"thinking" (an added token that repeats with probability `--think`: a geometric number of tokens, mean
1 / (1 - think)), then a calculator call `<tool_call>{"name": "calculator", "arguments": {"expression":
"D"}}</tool_call>` for a digit D, then the end of the turn. The steer sits in the embedding rows of those
tokens, in one MLP unit per token of the last layer (a one-hot slot in, its successors' slot out) and in
the output rows of the successors, and the random layers' output projections are scaled down (DAMP) so that
their random writes do not drown the steered slots: the same parameter count, tied embeddings stay tied. The tokenizer is
SmolLM2's with the three pieces added as tokens and, where TRL is installed, TRL's own Qwen3 chat template
(so that TRL parses the calls with its Qwen3 schema), else a Qwen2.5-style one. The calculator is a
stand-in too: it returns a text of `--result-tokens` words, so that episodes reach their budget.

    python bench/bench_agents.py [--only recipes trl] [--steps 3] [--out FILE]
    python bench/bench_agents.py --smoke          # tiny widths on the CPU, 1 step, TRL where installed

recipes   each examples/recipes file with rollout.tools, 3 steps under its card's memory (its profile
          emulated: the allocator capped), GSM8K's prompts, the stand-in at the recipe model's widths; the
          memory measured against the plan's estimate (bench_recipes.py's columns) and the episodes' turns
          and tool calls
trl       the same GRPO step at Qwen3-1.7B widths on the whole GPU, bf16, 2 prompts x 8 episodes of up to 4
          turns of 256 tokens within 1024: edgerl's static engine (the KV cache kept between turns), edgerl
          on HF generate (each turn from the whole conversation: TRL's loop) and TRL's GRPOTrainer with
          tools=[calculator] (HF generate), in one invocation, the same reward on both sides; the rollout's
          seconds per step and the model's tokens per second of rollout (TRL: its generation's wall time, read
          around its _generate), at step 1 (the same weights on every side) and the median of the later steps
          (each side's update changes its policy, and so its episodes' lengths)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import bench_recipes as br  # noqa: E402

OPEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
CLOSE = '"}}\n</tool_call>'
THINK = " hmm"
SYSTEM = "Use the calculator tool for every computation. End with the final answer after ####."
QWEN25_LIKE = (  # Qwen2.5's tool turns (its tokenizer_config.json on the Hugging Face Hub), shortened
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- endif %}{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
DAMP = 0.01   # the random layers' output projections are scaled by this (steer)
TOOL = '''
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression
    """
    return "The value is " + str(expression) + "." + " ok" * {words}
'''


def chat_template() -> tuple[str, str]:
    try:
        from trl.chat_template_utils import qwen3_chat_template
        return qwen3_chat_template, "TRL's Qwen3 template"
    except Exception:   # TRL absent, or a version without its templates
        return QWEN25_LIKE, "a Qwen2.5-style template (TRL not installed)"


def steer(model, tok, think: float) -> dict[str, Any]:
    """Set the stand-in's scripted weights (the module docstring); returns what it set. Slot k of the hidden
    state is source token k itself (its embedding row); each set of successors has a slot of its own: MLP
    unit k of the last layer reads slot k and writes its successors' slot 30 times larger, and each
    successor's output row reads that slot. After the final norm the successors' slot is about sqrt(hidden),
    the token's own a thirtieth of it: a successor's logit (3 sqrt(hidden)) leads the token's own (a tied
    embedding reads its own slot: 10 / 30 sqrt(hidden))."""
    import math
    import torch
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    newline, eos = ids("\n")[-1], tok.eos_token_id
    opn, close, hmm = (tok.convert_tokens_to_ids(t) for t in (OPEN, CLOSE, THINK))
    digits = [ids(str(d))[0] for d in range(1, 10)]
    succ = {newline: [hmm], hmm: [hmm, opn], opn: digits, close: [eos], **{d: [close] for d in digits}}
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    mlp = model.model.layers[-1].mlp
    h = emb.shape[1]
    # tokens with the same successors share their out slot: a tied row then holds one successor slot, not nine
    groups = list(dict.fromkeys(tuple(v) for v in succ.values()))
    n = len(succ)
    assert n + len(groups) <= h and n <= mlp.gate_proj.weight.shape[0], "the model is too narrow to steer"
    s = math.sqrt(h)
    alpha, beta = 10.0, 3.0
    gate, down = 4.0 / s, 30.0 * alpha / (torch.nn.functional.silu(torch.tensor(4.0)).item() * s)
    slot = {src: k for k, src in enumerate(succ)}
    out_slot = {src: n + groups.index(tuple(succ[src])) for src in succ}
    with torch.no_grad():
        # the random layers' writes into the residual stream, made small: through 28 random layers at their
        # initial scale the stream grows to about 20 times the steered token's slot, which then no longer leads
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(DAMP)
            layer.mlp.down_proj.weight.mul_(DAMP)
        for src, k in slot.items():
            emb[src] = 0
            emb[src, k] = alpha
            for w in (mlp.gate_proj.weight, mlp.up_proj.weight):
                w[k] = 0
            mlp.gate_proj.weight[k, k] = gate
            mlp.up_proj.weight[k, k] = 1.0
            mlp.down_proj.weight[:, k] = 0
            mlp.down_proj.weight[out_slot[src], k] = down
        for src in succ:
            for t in succ[src]:
                out[t, out_slot[src]] = beta
    # after the thinking token: itself with probability `think`, else the call. Its own logit holds what its
    # tied embedding reads too, so the gap is measured and set, not computed
    want = math.log(think / (1 - think))
    x = torch.tensor([ids("<|im_start|>assistant\n") + [hmm] * 3])

    def gap() -> float:
        with torch.no_grad():
            logits = model(x).logits[0, -1].float()
        return float(logits[hmm] - logits[opn])
    col = out_slot[hmm]
    for _ in range(4):
        g = gap()
        with torch.no_grad():
            out[opn, col] += 0.5
        slope = (g - gap()) / 0.5
        with torch.no_grad():
            out[opn, col] += (g - want) / max(slope, 1e-3) - 0.5
    return {"tokens": {"open": opn, "close": close, "think": hmm, "eos": eos}, "think": think,
            "think_gap": gap(), "think_gap_wanted": want}


def stand_in(spec, tokenizer: str, out: Path, smoke: bool, think: float) -> dict[str, Any]:
    """The stand-in model folder (built once per shape and --think), and a check that it calls the tool."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer
    info_file = out / "stand-in.json"
    if info_file.exists():
        return json.loads(info_file.read_text())
    raw = out.with_name(out.name + "-random")
    if not (raw / "bench-model.json").exists():
        bl.build_model_from_config(br.hf_config(spec, smoke), tokenizer, raw)
    model = AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32 if smoke else torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in (OPEN, CLOSE, THINK)])
    tok.chat_template, template = chat_template()
    assert len(tok) <= model.config.vocab_size
    info = steer(model, tok, think)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # the check: sampled turns of the stand-in call the calculator
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     tokenize=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    torch.manual_seed(0)
    gen = model.to(device).generate(x.repeat(4, 1), max_new_tokens=48 if smoke else 512, do_sample=True, top_k=0,
                                    temperature=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
    model.cpu()
    texts = [tok.decode(g[x.shape[1]:], skip_special_tokens=False) for g in gen]
    info.update(template=template, check=texts, calls=sum(OPEN in t and CLOSE in t for t in texts))
    info_file.write_text(json.dumps(info))
    return info


def tool_file(work: Path, words: int) -> Path:
    path = work / f"calculator_{words}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOOL.format(words=words))
    return path


def episode_columns(res: dict[str, Any]) -> dict[str, Any]:
    rows = res.get("metrics") or []
    keys = ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors", "rollout/model_tokens_mean",
            "rollout/context_tokens_mean", "rollout/ended_budget", "rollout/ended_max_turns", "rollout/rounds",
            "rollout/extend_s", "time/tool_wait_s")
    return {k.split("/")[-1]: bl.med([r.get(k) for r in rows[1:] or rows]) for k in keys}


def run_recipe(name: str, args, work: Path, data: Path, tokenizer: str, clock, results, log) -> None:
    from edgerl.config import recipes
    from edgerl.config.load import load_config
    from edgerl.plan.modelspec import resolve
    cfg = load_config(recipes.FOLDER / name, [])
    spec = resolve(cfg.model.path)
    model = work / "models" / f"{spec.name}{'-smoke' if args.smoke else ''}-think{args.think}"
    info = stand_in(spec, tokenizer, model, args.smoke, args.think)
    r = cfg.rollout
    turn_room = (r.response_tokens() - r.turns() / (1 - args.think)) // max(1, r.turns() - 1)
    words = 8 if args.smoke else max(8, int(turn_room))   # results that bring an episode to its budget
    sets = [f'data.path="{data}"', f'reward.function="{Path(bl.__file__).resolve()}:reward"',
            f'rollout.tools=["{tool_file(work, words)}:calculator"]', f"train.steps={1 if args.smoke else args.steps}",
            "eval.data=none", "eval.every=0", "eval.max_prompts=none", "run.save_every=0", "run.export_final=false",
            "run.tensorboard=false"]
    if args.smoke:
        sets += ['run.profile="cpu"', "rollout.max_new_tokens=12", "rollout.max_episode_tokens=96", "rollout.n_samples=2",
                 "train.prompts_per_step=2"]
    run_dir = work / "runs" / name
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)
    es = bl.edgerl_spec(model, sets, run_dir, work / f"{name}.json", phase_peaks=True, config=str(recipes.FOLDER / name))
    res = bl.run_edgerl(name, es, work, max(10, min(args.timeout, clock.left() - 5)))
    row = {"run": name, "status": res.get("status"), "steps": f"{res.get('steps_done', 0)}/{1 if args.smoke else args.steps}",
           "stand_in_calls": info["calls"],
           "median_step_s": res.get("median_step_s"), "median_rollout_s": res.get("median_rollout_s"),
           **bl.memory_columns(res), "estimate_peak_phase": res.get("estimate_peak_phase"),
           "plan": res.get("plan"), **episode_columns(res), "result_words": words,
           "command": f"edgerl train --config examples/recipes/{name} (bench/bench_agents.py --only recipes)",
           "message": str(res.get("error", ""))[:600], "raw": {k: v for k, v in res.items() if k != "trace"}}
    results.put(name, row)
    log(bl.memory_line(name, row) + f"; turns {bl.fmt(row.get('turns_mean'))}, calls {bl.fmt(row.get('tool_calls_mean'))}")


TRL_TASK = dict(prompts=2, samples=8, turns=4, turn=256, budget=1024)


def episode_reward(completions, **_) -> list[float]:
    """TRL's side of the reward: benchlib's vowel share, on the episode's text after the prompt (the model's
    turns, their tool calls and the tool results), as edgerl scores the decoded episode: both sides optimise the
    same reward (on the stand-in, fewer thinking tokens). Their updates still differ, so only step 1 samples
    from the same weights on both sides."""
    texts = []
    for c in completions:
        if isinstance(c, str):
            texts.append(c)
            continue
        parts = []
        for m in c:
            parts.append(str(m.get("content") or ""))
            parts += [json.dumps(call.get("function", call)) for call in m.get("tool_calls") or []]
        texts.append("".join(parts))
    return [bl.reward(solution_str=t) for t in texts]


def trl_child(spec_path: str) -> None:
    """TRL's GRPOTrainer with tools on the stand-in; writes the result JSON: per step its wall time and its
    generation's (the tool loop included)."""
    spec = json.loads(Path(spec_path).read_text())
    out, res, steps = Path(spec["out"]), {}, []
    start = time.time()
    try:
        import importlib.util
        import torch
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
        cuda = torch.cuda.is_available()
        spec_t = importlib.util.spec_from_file_location("bench_tool", spec["tool"])
        mod = importlib.util.module_from_spec(spec_t)
        spec_t.loader.exec_module(mod)
        tok = AutoTokenizer.from_pretrained(spec["model"])
        t = spec["task"]
        prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in spec["questions"]]
        ds = Dataset.from_list([{"prompt": p} for p in prompts])
        args = GRPOConfig(output_dir=str(out.parent / (out.stem + "-trl")), per_device_train_batch_size=t["prompts"] * t["samples"],
                          num_generations=t["samples"], max_completion_length=t["budget"],
                          max_tool_calling_iterations=t["turns"] - 1, beta=0.001, learning_rate=1e-6,
                          max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to=[], bf16=cuda,
                          temperature=1.0, use_cpu=not cuda, use_vllm=False, seed=0,
                          model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32})
        gen_s: list[float] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                if cuda:
                    torch.cuda.synchronize()
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                if cuda:
                    torch.cuda.synchronize()
                steps.append({"step_s": time.perf_counter() - self.t, "generate_s": sum(gen_s)})
                gen_s.clear()

        trainer = GRPOTrainer(model=spec["model"], reward_funcs=[episode_reward],
                              args=args, train_dataset=ds, processing_class=tok, tools=[mod.calculator],
                              callbacks=[Clock()])
        inner = trainer._generate   # the rollout: the first turn, then the tool loop (HF generate each turn)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                gen_s.append(time.perf_counter() - t0)
        trainer._generate = timed
        trainer.train()
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
        for row, h in zip(steps, logs):
            row.update({k: h.get(k) for k in h if k.startswith(("completions/", "tools/"))})
        res["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback
        res.update(status=bl.failure_status(f"{type(e).__name__}: {e}", "error"), error=f"{type(e).__name__}: {e}"[:1500],
                   trace=traceback.format_exc()[-3000:])
    res.update(step_rows=steps, wall_s=time.time() - start)
    out.write_text(json.dumps(res, default=str))


def tokens_per_s(per_step: list[dict[str, Any]], episodes: int) -> dict[str, Any]:
    """The model's tokens a second of rollout: step 1's, and the median over the later steps (all steps where
    there is one)."""
    rates = [r["model_tokens_mean"] * episodes / r["rollout_s"] if r.get("rollout_s") and
             r.get("model_tokens_mean") is not None else None for r in per_step]
    first = per_step[0] if per_step else {}
    return {"model_tokens_per_s": bl.med(rates[1:] or rates), "step1_rollout_s": first.get("rollout_s"),
            "step1_model_tokens": first.get("model_tokens_mean"), "step1_model_tokens_per_s": rates[0] if rates else None}


def run_trl_group(args, work: Path, data: Path, tokenizer: str, clock, results, log) -> None:
    from edgerl.plan.modelspec import CATALOGUE
    spec = CATALOGUE["qwen3-1.7b"]
    model = work / "models" / f"qwen3-1.7b{'-smoke' if args.smoke else ''}-think{args.think}"
    info = stand_in(spec, tokenizer, model, args.smoke, args.think)
    t = dict(TRL_TASK, turn=12, budget=96, samples=2) if args.smoke else TRL_TASK
    steps = 1 if args.smoke else args.steps
    tool = tool_file(work, 8 if args.smoke else 64)
    common = [f'data.path="{data}"', f'data.system_prompt="{SYSTEM}"', "data.max_prompt_len=512",
              f'reward.function="{Path(bl.__file__).resolve()}:reward"', f'rollout.tools=["{tool}:calculator"]',
              f"rollout.max_turns={t['turns']}", f"rollout.max_new_tokens={t['turn']}",
              f"rollout.max_episode_tokens={t['budget']}", f"rollout.n_samples={t['samples']}",
              f"train.prompts_per_step={t['prompts']}", f"train.steps={steps}", "algo.kl_coef=0.001", "train.lr=1e-6",
              "run.save_every=0", "run.export_final=false", "run.tensorboard=false"]
    if args.smoke:
        common.append('run.profile="cpu"')
    rows = {}
    for engine in ("static", "hf-generate"):
        name = f"edgerl-{engine}"
        if clock.left() < args.min_run_s:
            break
        run_dir = work / "runs" / name
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
        sets = common + [f'plan.rollout_engine="{engine}"']
        res = bl.run_edgerl(name, bl.edgerl_spec(model, sets, run_dir, work / f"{name}.json"), work,
                            max(10, min(args.timeout, clock.left() - 5)))
        ep = episode_columns(res)
        per_step = [{"rollout_s": s, "model_tokens_mean": r.get("rollout/model_tokens_mean")}
                    for s, r in zip(res.get("rollout_s_steps") or [], res.get("metrics") or [])]
        rows[name] = {"run": name, "status": res.get("status"), "steps": res.get("steps_done"),
                      "rollout_s": res.get("median_rollout_s"), "step_s": res.get("median_step_s"),
                      **tokens_per_s(per_step, t["prompts"] * t["samples"]), "per_step": per_step,
                      **ep, "plan": res.get("plan"), "message": str(res.get("error", ""))[:600]}
        results.put(name, rows[name])
        log(f"{name}: {rows[name]['status']}, rollout {bl.fmt(rows[name]['rollout_s'])} s/step, turns "
            f"{bl.fmt(ep.get('turns_mean'))}, model tokens {bl.fmt(ep.get('model_tokens_mean'), '{:.0f}')}")
    try:
        import trl
        version = trl.__version__
    except ImportError:
        results.put("trl", {"run": "trl", "status": "not run: TRL is not installed"})
        log("trl: not installed")
        version = None
    if version and clock.left() >= args.min_run_s:
        import pyarrow.parquet as pq
        questions = [r["prompt"][0]["content"] for r in pq.read_table(data).to_pylist()[:t["prompts"] * (steps + 1)]]
        out = work / "trl.json"
        out.unlink(missing_ok=True)
        spec_path = work / "trl.spec.json"
        spec_path.write_text(json.dumps({"model": str(model), "tool": str(tool), "out": str(out), "task": t,
                                         "steps": steps, "questions": questions}))
        status, _, tail = bl.run_logged([sys.executable, __file__, "trl", str(spec_path)], work / "trl.log",
                                        max(10, min(args.timeout, clock.left() - 5)))
        res = json.loads(out.read_text()) if out.exists() else {"status": bl.failure_status(tail, status), "error": tail[-1500:]}
        srows = res.get("step_rows") or []
        timed = srows[1:] or srows
        gen = bl.med([r.get("generate_s") for r in timed])
        length = bl.med([r.get("completions/mean_length") for r in timed])
        # with tools, TRL's completions/mean_length counts the model's tokens only (its tool_mask)
        per_step = [{"rollout_s": r.get("generate_s"), "model_tokens_mean": r.get("completions/mean_length")} for r in srows]
        rows["trl"] = {"run": f"trl {version}", "status": res.get("status"), "steps": len(srows), "rollout_s": gen,
                       "step_s": bl.med([r.get("step_s") for r in timed]), "completion_length_mean": length,
                       "model_tokens_mean": length, **tokens_per_s(per_step, t["prompts"] * t["samples"]),
                       "step_rows": srows, "message": str(res.get("error", ""))[:600]}
        results.put("trl", rows["trl"])
        log(f"trl: {res.get('status')}, generation {bl.fmt(gen)} s/step, completion length {bl.fmt(length)}")
    # > 1: edgerl's rollout makes the model's tokens faster. Step 1 samples from the same weights on both sides;
    # later steps from what each side's update made of them (their episodes' lengths can part)
    ours, theirs = rows.get("edgerl-static", {}), rows.get("trl", {})
    for key in ("model_tokens_per_s", "step1_model_tokens_per_s"):
        if ours.get(key) and theirs.get(key):
            results.data["trl_ratio" + ("_step1" if key.startswith("step1") else "")] = ours[key] / theirs[key]
    results.data["trl_table"] = bl.table(
        ["run", "status", "rollout s/step", "step s", "turns", "model tokens/episode", "context tokens/episode",
         "model tokens/s", "step 1: rollout s, model tokens/episode, tokens/s"],
        [[r["run"], str(r["status"])[:40], bl.fmt(r.get("rollout_s")), bl.fmt(r.get("step_s")), bl.fmt(r.get("turns_mean")),
          bl.fmt(r.get("model_tokens_mean"), "{:.0f}"), bl.fmt(r.get("context_tokens_mean"), "{:.0f}"),
          bl.fmt(r.get("model_tokens_per_s"), "{:.0f}"),
          f"{bl.fmt(r.get('step1_rollout_s'))}, {bl.fmt(r.get('step1_model_tokens'), '{:.0f}')}, "
          f"{bl.fmt(r.get('step1_model_tokens_per_s'), '{:.0f}')}"]
         for r in rows.values()])
    results.data["stand_in"] = info
    results.save()
    print(results.data["trl_table"])


def main() -> None:
    from edgerl.config import recipes
    from edgerl.config.load import load_config
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=["recipes", "trl"], choices=["recipes", "trl"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=500, help="seconds per run")
    ap.add_argument("--think", type=float, default=None,
                    help="the stand-in's chance to think on: a turn thinks 1/(1-think) tokens on average (default 0.99; "
                         "0.5 with --smoke)")
    bl.add_run_args(ap, 540, 30, "tiny widths on the CPU: one tool recipe and the TRL group, 1 step")
    args = ap.parse_args()
    args.think = args.think if args.think is not None else (0.5 if args.smoke else 0.99)
    if not 0 < args.think < 1:
        ap.error("--think must lie in (0, 1)")
    out, work = bl.out_and_work(args, "bench_agents", 30)
    clock = bl.Clock(args.budget_s)
    results = bl.Results(out, {"script": "bench_agents", "argv": sys.argv[1:], "device": bl.device_name(),
                               "versions": bl.versions(), "think": args.think})

    def log(s: str) -> None:
        print(f"[{clock.elapsed():5.0f} s] {s}", flush=True)

    data = br.gsm8k_parquet(work)
    if "recipes" in args.only:
        names = sorted(p.name for p in recipes.FOLDER.glob("*.toml") if load_config(p, []).rollout.tools)
        for name in names[:1] if args.smoke else names:
            if clock.left() < args.min_run_s:
                results.put(name, {"run": name, "status": "not run: out of time"})
                continue
            run_recipe(name, args, work, data, args.tokenizer, clock, results, log)
        bl.finish_memory_runs(results, [n for n in names if n in results.runs], "run", out, clock)
    if "trl" in args.only:
        run_trl_group(args, work, data, args.tokenizer, clock, results, log)
    print(f"wrote {out} ({clock.elapsed():.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "trl":
        trl_child(sys.argv[2])
    else:
        main()
