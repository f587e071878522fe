"""The recipes in examples/recipes on the GPU, each in emulation of its card: the recipe's own TOML (its
algorithm, LoRA and base storage, batch shape, lengths, profile) with a random-weight model at the real
model's widths and vocabulary (from edgerl's catalogue), GSM8K's training prompts, and these changes:
3 steps; EOS ignored (every response runs to rollout.max_new_tokens: the length the plan is sized for); a
reward that varies between samples (random weights never answer a GSM8K problem, and groups that all score
0 cost no update); algo.overlong "none" (with EOS ignored every response is cut, and "mask" would leave the
update no token); no evaluation, checkpoints or export (the training step is what is timed). The
allocator is capped at the card's memory (the profile's), as `edgerl train --profile` does off the card.

    python bench/bench_recipes.py [--only NAME ...] [--parallel] [--steps 3] [--out FILE]
    python bench/bench_recipes.py --smoke      # the tiny widths of the recipes' families on the CPU, 1 step

Measured = the allocator's peak allocated bytes over the step's phases + the process's memory outside the
allocator (NVML's figure for the process less its reserved bytes, else the plan's constant); reserved = its
peak reserved bytes (its cache included) + the context; estimate = the plan's figure. A recipe for several
GPUs runs under torchrun where this machine has that many, and is reported as not run otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def hf_config(spec, smoke: bool):
    """A transformers config of the catalogue spec's family at its widths (the tiny widths with --smoke)."""
    import transformers as tf
    if smoke:
        dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=spec.vocab_size)
        hd = 16
    else:
        dims = dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                    num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                    num_key_value_heads=spec.num_kv_heads, vocab_size=spec.vocab_size)
        hd = spec.head_dim
    common = dict(tie_word_embeddings=spec.tie_embeddings, max_position_embeddings=spec.max_position or 32768,
                  initializer_range=bl.STD, **dims)
    if spec.model_type == "qwen3":
        return tf.Qwen3Config(head_dim=hd, **common)
    if spec.model_type == "qwen2":
        return tf.Qwen2Config(**common)
    raise SystemExit(f"bench_recipes: no builder for the model type {spec.model_type!r}: add one to hf_config()")


def gsm8k_parquet(work: Path, n: int = 512) -> Path:
    """The first `n` GSM8K training rows in verl's layout, from $EDGERL_SHARED/data/gsm8k/train.jsonl."""
    import os
    import pyarrow as pa
    import pyarrow.parquet as pq
    from edgerl.data.builtin import gsm8k_row
    src = Path(os.environ.get("EDGERL_SHARED", ROOT.parent / "shared")) / "data" / "gsm8k" / "train.jsonl"
    if not src.exists():
        raise SystemExit(f"bench_recipes: {src} not found: set EDGERL_SHARED to the folder holding data/gsm8k")
    out = work / "gsm8k-train.parquet"
    rows = []
    for i, line in enumerate(src.read_text().splitlines()[:n]):
        r = json.loads(line)
        rows.append(gsm8k_row(r["question"], r["answer"], "train", i))
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def command(name: str, steps: int) -> str:
    return (f"edgerl train --config examples/recipes/{name} --set model.path=<random weights, real widths> "
            f"--set train.steps={steps} --set rollout.stop_at_eos=false --set algo.overlong=none "
            f"(bench/bench_recipes.py --only {name})")


def main() -> None:
    from edgerl.config import recipes
    from edgerl.config.load import load_config
    from edgerl.plan.modelspec import resolve
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the recipes of episodes with tools run in bench_agents.py (a steered stand-in: random weights call no tool)
    names = sorted(p.name for p in recipes.FOLDER.glob("*.toml") if not load_config(p, []).rollout.episodes)
    ap.add_argument("--only", nargs="*", default=None, help=f"recipes (default all: {', '.join(names)})")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=500, help="seconds per recipe")
    ap.add_argument("--parallel", action="store_true", help="all recipes at once, each under its own card's cap")
    ap.add_argument("--tf32", action="store_true", help="fp32 matmuls on TF32 tensor cores (the same memory)")
    bl.add_run_args(ap, 540, 30, "the recipes' families at tiny widths on the CPU, 1 step of 8 tokens")
    args = ap.parse_args()
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        ap.error(f"unknown recipe(s) {', '.join(unknown)} in --only; choose from {', '.join(names)}")
    out, work = bl.out_and_work(args, "bench_recipes", 30)
    steps = 1 if args.smoke else args.steps
    clock = bl.Clock(args.budget_s)
    results = bl.Results(out, {"script": "bench_recipes", "argv": sys.argv[1:], "device": bl.device_name(),
                               "versions": bl.versions(), "steps": steps, "parallel": args.parallel,
                               "tf32": args.tf32})

    def log(s: str) -> None:
        print(f"[{clock.elapsed():5.0f} s] {s}", flush=True)

    data = gsm8k_parquet(work)
    chosen = args.only or names
    import torch
    gpus = torch.cuda.device_count()
    specs = {name: resolve(load_config(recipes.FOLDER / name, []).model.path) for name in chosen}
    models: dict[str, Path] = {}
    for name in chosen:   # one after another: each is bound by the disk
        if recipes.GPUS.get(name, 1) > max(gpus, 1) and not args.smoke:
            continue   # not run here (run() reports it)
        spec = specs[name]
        key = f"{spec.name}{'-smoke' if args.smoke else ''}"
        if key in models:
            continue
        folder = work / "models" / key
        if not (folder / "bench-model.json").exists():
            t0 = time.time()
            bl.build_model_from_config(hf_config(spec, args.smoke), args.tokenizer, folder)
            log(f"built {folder.name} ({spec.model_type}) in {time.time() - t0:.0f} s")
        models[key] = folder

    def run(name: str) -> None:
        spec = specs[name]
        nproc = recipes.GPUS.get(name, 1)
        if nproc > max(gpus, 1) and not args.smoke:
            results.put(name, {"recipe": name, "status": f"not run: needs {nproc} GPUs, this machine has {gpus}",
                               "command": command(name, steps)})
            log(f"{name}: not run ({nproc} GPUs needed)")
            return
        run_dir = work / "runs" / name
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
        sets = [f'data.path="{data}"', f'reward.function="{Path(bl.__file__).resolve()}:reward"',
                f"train.steps={steps}", "rollout.stop_at_eos=false", 'algo.overlong="none"', "eval.data=none",
                "eval.every=0", "eval.max_prompts=none", "run.save_every=0", "run.export_final=false",
                "run.tensorboard=false"]
        if args.smoke:
            sets += ['run.profile="cpu"', "rollout.max_new_tokens=8"]
        model = models[f"{spec.name}{'-smoke' if args.smoke else ''}"]
        es = bl.edgerl_spec(model, sets, run_dir, work / f"{name}.json", phase_peaks=True, tf32=args.tf32,
                            config=str(recipes.FOLDER / name))
        if args.smoke and nproc > 1:
            es["cpu_ranks_on_device_0"] = True
        res = bl.run_edgerl(name, es, work, max(10, min(args.timeout, clock.left() - 5)), nproc=nproc)
        mem = bl.memory_columns(res)
        row = {"recipe": name, "status": res.get("status"), "steps": f"{res.get('steps_done', 0)}/{steps}",
               "model": f"{spec.name} ({spec.model_type}, random weights)", "gpus": nproc,
               "median_step_s": res.get("median_step_s"), "step_s": res.get("step_s"),
               "tokens_per_s": res.get("tokens_per_s"), **mem,
               "estimate_peak_phase": res.get("estimate_peak_phase"), "budget_gib": res.get("budget_gib"),
               "plan": res.get("plan"),
               "phase_alloc_gib": res.get("phase_alloc_gib"), "estimate_phases_gib": res.get("estimate_phases_gib"),
               "command": command(name, steps), "message": str(res.get("error", ""))[:600],
               "raw": {k: v for k, v in res.items() if k != "trace"}}
        results.put(name, row)
        log(bl.memory_line(name, row))

    bl.run_each(chosen, run, args.parallel)
    bl.finish_memory_runs(results, chosen, "recipe", out, clock)


if __name__ == "__main__":
    main()
