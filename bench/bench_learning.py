"""Learning against TRL: edgerl and TRL 1.16's GRPOTrainer train SmolLM2-135M-Instruct's real weights on the same
task, and both are scored on the same held-out prompts at the same steps. Time-to-accuracy, not seconds per step.

    python bench/bench_learning.py --task arithmetic [--seeds 0 1 2] [--tools edgerl trl] [--model HF_FOLDER|FILE.gguf]
                                   [--device cpu|cuda] [--budget-s S] [--out DIR] [--work DIR] [--gsm8k PATH]
    python bench/bench_learning.py --summary DIR_OR_JSON... [--plot DIR]   # the docs' table, and the curves
    python bench/bench_learning.py --smoke --out DIR                      # a tiny random model, 2 steps each
    python bench/bench_learning.py --tools edgerl --variant NAME --edgerl-set KEY=VALUE... [as above]
                                   # edgerl with other settings (e.g. plan.rollout_engine="hf-generate"), a row
                                   # of its own in the summary: which setting moves the learning

Each run is its own process (one at a time: on a GPU each has it alone) and writes DIR/<task>_<tool>_seed<k>.json
atomically when it ends; TRL's run also writes it after every step. A later invocation with the same --out skips
the runs there already (status ok). `edgerl plot WORK/runs/<task>_edgerl_seed0 WORK/runs/<task>_trl_seed0` draws
both runs' curves on one figure (TRL's run folder holds an edgerl-style metrics.jsonl).

The tasks (bench/learning_tasks.py): `arithmetic` is examples/demo-cpu.toml's run (8 prompts x 4 samples, 40 new
tokens, lr 1e-5, 24 steps, 64 held-out problems scored before step 1, after 12 and after 24); `gsm8k` poses
problems in GSM8K's format with verl's instruction and strict '#### <number>' scoring (after one worked example,
at temperature 0.7, 96 new tokens: the form in which SmolLM2-135M gets any reward at all).

The settings, side by side (edgerl's --set / TRL's GRPOConfig; learning_trl.trl_config is TRL's side):

| setting | edgerl | TRL |
|---|---|---|
| prompts, order, chat template | data.path = the task's JSONL, data.shuffle=false | the same rows, shuffle_dataset=False; the token ids are checked equal (prompt_ids_match) |
| reward | the data_source's rule (reward.functions default 'answer') | learning_tasks.reward: the same rule |
| group size, batch | 8 prompts x rollout.n_samples=4 | num_generations=4, generation_batch_size=32 |
| updates per step | train.mini_batch = all 32, ppo_epochs=1: one optimizer step | per_device_train_batch_size=32, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1 |
| lr, schedule | train.lr=1e-5, lr_schedule="constant", warmup_ratio=0 | learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0 |
| optimizer | AdamW, betas [0.9, 0.999], weight_decay 0, eps 1e-8 | AdamW (adamw_torch_fused), the same |
| grad clipping | train.max_grad_norm=1.0 | max_grad_norm=1.0 |
| KL | algo.kl_coef=0 (no reference model) | beta=0.0 (its default) |
| clip range | algo.clip_low = clip_high = 0.2 | epsilon = epsilon_high = 0.2 |
| loss aggregation | algo.loss_agg="token-mean" (over the step's tokens) | loss_type="dapo" (its default: over the batch's tokens) |
| advantages | grpo, norm_adv_by_std=true: (r - mean) / (std + 1e-6), unbiased std | scale_rewards="group": (r - mean) / (std + 1e-4), unbiased std |
| sampling | rollout.temperature = the task's (1; gsm8k 0.7), top_p 1, top_k 0 | temperature = the same, top_p=1.0, top_k=0 |
| length, EOS | rollout.max_new_tokens, stop_at_eos (EOS kept in the loss) | max_completion_length, stops at EOS (kept in the loss); mask_truncated_completions=False |
| rollout correction | algo.rollout_correction at its default: none on the CPU (the engine decodes in fp32 through torch's ops), tis (per token, cap 2) on a GPU's bf16 plan | none (TRL corrects vLLM's samples only; its HF generate samples from the trained model itself) |
| dtype | the plan's: fp32 on the CPU; on a GPU the card's (bf16 on an H100) | fp32 on the CPU; on a GPU its default, bf16=True (autocast over fp32 weights) |
| held-out evaluation | eval.data = the held-out JSONL, greedy, the rollout engine | HF generate, greedy, on the same token ids, edgerl's scorer |
| seed | train.seed=k (sampling; the prompt order is drawn for k) | seed=k |

Wall time per step leaves out evaluation on both sides (edgerl's perf/step_s; TRL's step timed before the
callback evaluates) and setup (model loading). The time to reach TRL's final accuracy is the first evaluation
point where a tool's mean over seeds reaches TRL's mean at the last step, and the mean training seconds to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import learning_tasks as lt  # noqa: E402
from learning_trl import write_json  # noqa: E402

TOOLS = ("edgerl", "trl")


def label(rec: dict[str, Any]) -> str:
    """A result's row: its tool, or "edgerl:VARIANT" for a run with --variant (its --edgerl-set settings)."""
    return f"{rec['tool']}:{rec['variant']}" if rec.get("variant") else rec["tool"]


def labels_in_order(names) -> list[str]:
    """edgerl first, then its variants (sorted), then TRL."""
    names = set(names)
    return [n for n in ("edgerl",) if n in names] + sorted(n for n in names if n.startswith("edgerl:")) + \
        [n for n in ("trl",) if n in names]


def run_name(task: str, tool: str, variant: Optional[str], seed: int) -> str:
    """A run's name: its work folder's and, with .json, its result file's."""
    return f"{task}_{tool}{'-' + variant if variant else ''}_seed{seed}"


def commit() -> Optional[str]:
    """The checkout's commit, '+changes' after it where tracked files differ from it (the code that ran is not that
    commit's), or $EDGERL_COMMIT where the code is a copy without its git folder."""
    from edgerl.core.version import git_commit
    return git_commit(bl.REPO) or os.environ.get("EDGERL_COMMIT") or None


def model_folder(arg: Optional[str], smoke: bool, work: Path, tokenizer: str) -> Path:
    """--model: an HF folder, a .gguf file (converted once, edgerl.models.embedded), or the embedded model's
    folder; under --smoke a tiny random llama with the SmolLM2 tokenizer."""
    if smoke:
        return tiny_model(work / "models" / "tiny-smollm2-tok", tokenizer)
    from edgerl.models.embedded import convert_gguf, embedded_folder
    if arg is None:
        return embedded_folder("smollm2-135m-instruct")
    path = Path(arg)
    if path.suffix == ".gguf":
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {arg}: no config.json there; give an HF model folder or a .gguf file")
    return path


def tiny_model(out: Path, tokenizer: str) -> Path:
    """A 2-layer random llama with the SmolLM2 tokenizer (as tests/conftest.make_tiny_model builds it)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, max_position_embeddings=1024)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def edgerl_sets(task: lt.Task, train: Path, heldout: Path, seed: int, device: str) -> list[str]:
    """The demo's settings (examples/demo-cpu.toml) on the task's files, every learning setting explicit."""
    sets = [f'data.path="{train}"', "data.shuffle=false", "data.max_prompt_len=256",
            f"rollout.n_samples={task.samples}", f"rollout.max_new_tokens={task.new_tokens}",
            f"rollout.temperature={task.temperature}", "rollout.top_p=1.0", "rollout.top_k=0", "rollout.stop_at_eos=true",
            'algo.advantage="grpo"', "algo.norm_adv_by_std=true", "algo.kl_coef=0.0", 'algo.policy_loss="ppo"',
            "algo.clip_low=0.2", "algo.clip_high=0.2", 'algo.loss_agg="token-mean"', 'algo.overlong="none"',
            "algo.dynamic_sampling=false", "algo.entropy_coef=0.0",
            f"train.steps={task.steps}", f"train.prompts_per_step={task.prompts_per_step}", f"train.lr={task.lr}",
            "train.ppo_epochs=1", 'train.lr_schedule="constant"', "train.warmup_ratio=0.0", "train.weight_decay=0.0",
            "train.betas=[0.9, 0.999]", "train.max_grad_norm=1.0", f"train.seed={seed}",
            f'eval.data="{heldout}"', f"eval.every={task.every}", f"eval.max_prompts={task.eval_prompts}",
            "run.save_every=0", "run.export_final=false", "run.tensorboard=false"]
    if device == "cpu":
        sets.append('run.profile="cpu"')
    return sets


def edgerl_record(res: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Per step and per evaluation, from the run folder's metrics.jsonl (what is there, even after a timeout)."""
    folder = bl.read_run_folder(run_dir)
    rows = folder["rows"]
    plan = (folder.get("plan_json") or {}).get("plan", {})
    steps = [{"step": r["step"], "wall_s": r["perf/step_s"], "reward_mean": r.get("reward/mean"),
              "length_mean": r.get("response/length_mean")} for r in rows if r.get("step", 0) > 0 and "perf/step_s" in r]
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"], "eval_s": r.get("time/eval_s"),
              "response_length": r.get("eval/response_length")} for r in rows if "eval/accuracy" in r]
    keep = ("status", "error", "engine", "setup_s", "plan", "effective_batch")
    return {**{k: res[k] for k in keep if k in res}, "steps": steps, "evals": evals,
            "rollout_correction": plan.get("rollout_correction")}


def run_one(tool: str, task: lt.Task, seed: int, args, model: Path, work: Path, timeout: float) -> dict[str, Any]:
    name = run_name(task.name, tool, args.variant, seed)
    train, heldout = lt.rows_of(task, seed, Path(args.gsm8k) if args.gsm8k_questions == "real" else None)
    data = work / "data"
    train_p = lt.write_jsonl(data / f"{task.name}_seed{seed}_train.jsonl", train)
    heldout_p = lt.write_jsonl(data / f"{task.name}_heldout.jsonl", heldout)
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    if tool == "edgerl":
        sets = edgerl_sets(task, train_p, heldout_p, seed, args.device) + list(args.edgerl_set)
        spec = bl.edgerl_spec(model, sets, run_dir, work / f"{name}.child.json")
        res = bl.run_edgerl(name, spec, work, timeout)
        rec = {**edgerl_record(res, run_dir), "settings": sets}
    else:
        out = work / f"{name}.child.json"
        out.unlink(missing_ok=True)
        spec = {"model": str(model), "train": str(train_p), "heldout": str(heldout_p), "run_dir": str(run_dir),
                "out": str(out), "device": args.device, "seed": seed, "steps": task.steps, "every": task.every,
                "prompts_per_step": task.prompts_per_step, "samples": task.samples, "new_tokens": task.new_tokens,
                "lr": task.lr, "temperature": task.temperature}
        spec_path = work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        status, _, tail = bl.run_logged([sys.executable, str(Path(__file__).with_name("learning_trl.py")),
                                         str(spec_path)], work / f"{name}.log", timeout)
        rec = json.loads(out.read_text()) if out.exists() else {"status": status, "error": tail[-1500:]}
        if status != "ok" and rec.get("status") in (None, "ok", "running"):
            rec["status"] = f"{status} after {len(rec.get('steps', []))} step(s)"
    rec.update(task=task.name, tool=tool, variant=args.variant, seed=seed, device=args.device, machine=bl.device_name(),
               model=str(model), run_dir=str(run_dir), total_s=time.time() - t0, commit=commit(),
               versions=bl.versions(), date=time.strftime("%Y-%m-%d"), task_settings=task.__dict__,
               train_s=sum(s["wall_s"] for s in rec.get("steps", [])))
    return rec


# ------------------------------------------------------------------------------------- summary

def load_records(paths: list[str]) -> list[dict[str, Any]]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*_seed*.json")) if p.is_dir() else [p]
    recs = []
    for f in files:
        r = json.loads(f.read_text())
        if isinstance(r, dict) and r.get("tool") in TOOLS and r.get("status") == "ok":
            recs.append(r)
    return recs


def _last_quarter(rec: dict[str, Any]) -> float:
    """The training reward's mean over the run's last quarter of steps (the samples' reward, temperature on)."""
    steps = sorted(rec["steps"], key=lambda s: s["step"])
    last = steps[len(steps) - max(1, len(steps) // 4):]
    return sum(s["reward_mean"] or 0 for s in last) / len(last)


def _cum(rec: dict[str, Any], step: int) -> float:
    return sum(s["wall_s"] for s in rec["steps"] if s["step"] <= step)


def summarise(recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per task and tool: accuracy at each eval step (mean, min, max over seeds), seconds per step and to each
    eval step, and when TRL's final mean accuracy is first reached."""
    out: dict[str, dict[str, Any]] = {}
    for task in sorted({r["task"] for r in recs}):
        by_tool: dict[str, Any] = {}
        for tool in labels_in_order(label(r) for r in recs if r["task"] == task):
            rs = [r for r in recs if r["task"] == task and label(r) == tool]
            steps = sorted(set.intersection(*[{e["step"] for e in r["evals"]} for r in rs]))
            acc = {s: [next(e["accuracy"] for e in r["evals"] if e["step"] == s) for r in rs] for s in steps}
            per_step = [s["wall_s"] for r in rs for s in r["steps"]]
            by_tool[tool] = {"seeds": sorted(r["seed"] for r in rs), "device": rs[0]["device"],
                             "machine": rs[0]["machine"],
                             "acc": {s: (sum(v) / len(v), min(v), max(v)) for s, v in acc.items()},
                             "step_s": sum(per_step) / len(per_step),
                             "to_step_s": {s: sum(_cum(r, s) for r in rs) / len(rs) for s in steps},
                             "reward": [sum(s["reward_mean"] or 0 for s in r["steps"]) / len(r["steps"]) for r in rs],
                             "reward_last": [_last_quarter(r) for r in rs]}
        if "trl" in by_tool:
            target = by_tool["trl"]["acc"][max(by_tool["trl"]["acc"])][0]
            for tool, t in by_tool.items():
                hit = [s for s, (m, _, _) in t["acc"].items() if m >= target - 1e-9]
                t["reach"] = (hit[0], t["to_step_s"][hit[0]]) if hit else None
            by_tool["target"] = target
        out[task] = by_tool
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = []
    for task, by_tool in summary.items():
        tools = [t for t in by_tool if t != "target"]
        steps = sorted({s for t in tools for s in by_tool[t]["acc"]})
        head = ["tool", "seeds"] + [f"acc @ {s}" for s in steps] + ["train reward, last quarter", "s / step",
                                                                   "train s (all steps)", "reaches TRL's final acc"]
        rows = []
        for tool in tools:
            t = by_tool[tool]
            cells = [tool, str(len(t["seeds"]))]
            for s in steps:
                m = t["acc"].get(s)
                cells.append(f"{m[0]:.3f} ({m[1]:.3f}-{m[2]:.3f})" if m else "-")
            reach = t.get("reach")
            last = t["reward_last"]
            cells += [f"{sum(last) / len(last):.3f} ({min(last):.3f}-{max(last):.3f})", f"{t['step_s']:.2f}", f"{t['to_step_s'][max(t['to_step_s'])]:.0f}",
                      (f"step {reach[0]}, {reach[1]:.0f} s" if reach else "not reached") if "target" in by_tool
                      else "-"]
            rows.append(cells)
        machine = by_tool[tools[0]]["machine"]
        lines.append(f"**{task}** ({machine}; accuracy: mean over seeds (min-max); TRL's final mean "
                     f"{by_tool.get('target', float('nan')):.3f})\n\n" + bl.table(head, rows))
    return "\n\n".join(lines)


def plot(recs: list[dict[str, Any]], folder: Path) -> list[Path]:
    """learning_<task>.png: held-out accuracy against step and against training seconds, every seed's run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from edgerl.core.files import write_atomically
    written = []
    for task in sorted({r["task"] for r in recs}):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        names = labels_in_order(label(r) for r in recs if r["task"] == task)
        colours = {n: c for n, c in zip(names, ("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"))}
        colours["trl"] = "tab:orange"
        for tool in names:
            colour = colours.get(tool, "tab:gray")
            for i, r in enumerate(rr for rr in recs if rr["task"] == task and label(rr) == tool):
                ev = sorted(r["evals"], key=lambda e: e["step"])
                legend = tool if i == 0 else None
                axes[0].plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", color=colour, alpha=.7,
                             label=legend)
                axes[1].plot([_cum(r, e["step"]) for e in ev], [e["accuracy"] for e in ev], "o-", color=colour,
                             alpha=.7, label=legend)
        for ax, xl in zip(axes, ("step", "training seconds (evaluation and setup left out)")):
            ax.set_xlabel(xl)
            ax.set_ylabel("held-out accuracy (greedy)")
            ax.grid(alpha=.3)
            ax.legend()
        fig.suptitle(f"{task}: edgerl vs TRL {recs[0]['versions'].get('trl', '')}, one line per seed")
        fig.tight_layout()
        path = folder / f"learning_{task}.png"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
        written.append(path)
    return written


# ------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(lt.TASKS), default="arithmetic")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--model", default=None, help="an HF folder or a .gguf file (default: the embedded model)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is one")
    ap.add_argument("--gsm8k", default=os.path.join(os.environ.get("EDGERL_SHARED", ".cache/shared"), "data", "gsm8k"),
                    help="a folder with GSM8K's train.jsonl and test.jsonl (--gsm8k-questions real)")
    ap.add_argument("--gsm8k-questions", choices=("arithmetic", "real"), default="arithmetic",
                    help="the gsm8k task's questions: level-2 arithmetic problems (default) or GSM8K's own")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    ap.add_argument("--edgerl-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="more settings for edgerl's runs (after the bench's own); needs --variant")
    ap.add_argument("--variant", default=None, help="a name for those settings: the results are "
                    "TASK_edgerl-VARIANT_seedN.json, a row of their own in the summary (edgerl's runs only)")
    ap.add_argument("--summary", nargs="+", default=None, help="result JSONs or folders: print the table")
    ap.add_argument("--plot", default=None, help="with --summary: write learning_<task>.png here")
    bl.add_run_args(ap, budget_s=1e9, min_run_s=60, smoke="a tiny random model, 2 steps of each tool (CPU)",
                    skip_done=False)
    args = ap.parse_args()
    if args.edgerl_set and not args.variant:
        ap.error("--edgerl-set needs --variant NAME: the results of other settings need a name of their own")
    if args.variant:
        if not re.fullmatch(r"[A-Za-z0-9.-]+", args.variant):
            ap.error(f"--variant {args.variant!r}: use letters, digits, '.' and '-' (it names the result files)")
        if args.tools != ["edgerl"]:
            ap.error("--variant applies to edgerl's runs: add --tools edgerl")
    if args.summary:
        recs = load_records(args.summary)
        if not recs:
            raise SystemExit(f"no finished run in {' '.join(args.summary)}")
        print(table(summarise(recs)))
        if args.plot:
            for p in plot(recs, Path(args.plot)):
                print(f"wrote {p}")
        return
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(args.out or os.path.join(os.environ.get("OUT", "."), "bench_learning" + ("_smoke" if args.smoke else "")))
    args.min_run_s = args.min_run_s if args.min_run_s is not None else (5 if args.smoke else 60)
    work = Path(args.work or ("/tmp/edgerl-learning-smoke" if args.smoke else "/tmp/edgerl-learning"))
    task = lt.smoke(lt.TASKS[args.task]) if args.smoke else lt.TASKS[args.task]
    clock = bl.Clock(args.budget_s)
    model = model_folder(args.model, args.smoke, work, args.tokenizer)
    for seed in args.seeds:           # seed by seed: a budget that runs out leaves both tools with equal seeds
        for tool in args.tools:
            path = out_dir / f"{run_name(task.name, tool, args.variant, seed)}.json"
            if path.exists() and json.loads(path.read_text()).get("status") == "ok":
                print(f"{path.name}: there already", flush=True)
                continue
            if clock.left() < args.min_run_s:
                print(f"{path.name}: skipped, {clock.left():.0f} s of the budget left", flush=True)
                continue
            rec = run_one(tool, task, seed, args, model, work, min(args.timeout, clock.left()))
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json(path, rec)
            accs = " ".join(f"{e['step']}:{e['accuracy']:.3f}" for e in rec.get("evals", []))
            print(f"{path.name}: {rec['status']} in {rec['total_s']:.0f} s; train {rec['train_s']:.0f} s; "
                  f"accuracy {accs}", flush=True)


if __name__ == "__main__":
    main()
