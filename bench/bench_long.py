"""Long responses on small cards' memory: each row is a real edgerl run (GRPO with the reference KL, 2 prompts
x 8 samples, EOS ignored, random weights at a real model's widths with the SmolLM2 vocabulary) under a card's
memory as the allocator's cap (--profile p40: 22919 MiB, the fp32 plan; --profile t4: 15109 MiB, the fp16
plan; v100-32gb and rtx4090: full fine-tuning in fp16 and in bf16), and the plan's estimate beside the
measured peak of every phase.

    python bench/bench_long.py [--only ROW ...] [--steps 3] [--parallel] [--budget-s 480] [--out FILE]
    python bench/bench_long.py --offload-cost      # the activation offload's cost: 8 layers at the 1.5B widths
    python bench/bench_long.py --smoke             # tiny shape, 2 steps of 64 tokens, on the CPU: the plumbing
    python bench/bench_long.py --only 1.5b-p40-8k --steps 3 --resumable   # again: on from its last checkpoint

--parallel runs the rows at once, each in its own process under its own cap (the H200 holds six capped runs):
memory figures are each process's own, but the GPU's time is shared, so s/step is not one run's speed.
Measured = the allocator's peak allocated bytes over the step's phases (each phase's peak is read and
reset at its end, and written to a file as it goes, so a row stopped by its time limit keeps the phases it
finished) + the process's memory outside the allocator (NVML's figure for the process less its reserved
bytes, else the plan's constant). Reserved = the allocator's peak reserved bytes, its cache included: with
expandable segments the cache is handed back when an allocation needs it under the cap, so it is reported,
not compared.
Error = estimate / measured - 1: never below 0 (the plan must be an upper bound), at most +15%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

# name -> (shape, profile, new tokens, extra --set)
NF4 = ["lora.enabled=true", "lora.rank=16", 'plan.base_dtype="nf4"']
ROWS: dict[str, tuple[str, str, int, list[str]]] = {
    "1.5b-p40-512": ("1.5b", "p40", 512, ["lora.enabled=false"]),
    "1.5b-p40-2k": ("1.5b", "p40", 2048, ["lora.enabled=false"]),
    "1.5b-p40-4k": ("1.5b", "p40", 4096, ["lora.enabled=false"]),
    "1.5b-p40-8k": ("1.5b", "p40", 8192, ["lora.enabled=false"]),
    "qwen7b-nf4-p40-2k": ("qwen7b", "p40", 2048, NF4),
    "qwen7b-nf4-p40-4k": ("qwen7b", "p40", 4096, NF4),
    "qwen7b-nf4-p40-8k": ("qwen7b", "p40", 8192, NF4),   # the stretch length: run it with --resumable
    "llama8b-nf4-t4-2k": ("llama8b", "t4", 2048, NF4),
    "llama8b-nf4-t4-4k": ("llama8b", "t4", 4096, NF4),
    # the 16-bit paths at the same lengths: LoRA on the 16-bit base in fp16 (T4), full fine-tuning in fp16
    # mixed precision (V100 32 GB) and in bf16 (RTX 4090)
    "1.5b-lora-t4-2k": ("1.5b", "t4", 2048, ["lora.enabled=true"]),
    "1.5b-lora-t4-8k": ("1.5b", "t4", 8192, ["lora.enabled=true"]),
    "1.5b-v100-fp16-2k": ("1.5b", "v100-32gb", 2048, ["lora.enabled=false"]),
    "1.5b-v100-fp16-8k": ("1.5b", "v100-32gb", 8192, ["lora.enabled=false"]),
    "1.5b-4090-bf16-2k": ("1.5b", "rtx4090", 2048, ["lora.enabled=false"]),
    "1.5b-4090-bf16-8k": ("1.5b", "rtx4090", 8192, ["lora.enabled=false"]),
    # the cells of the length x plan x dtype grid no row above covers: 16K where it fits (full, fp32), LoRA on a
    # 16-bit base under fp32 compute, and LoRA and NF4 QLoRA in bf16
    # the plans the fixed order of the memory search picks (what those rows ran before the search weighed every
    # setting that fits by its estimated step time; the P40's KV cache in fp32, as before plan.kv_cache_dtype),
    # beside the rows above: one call, one after the other
    "1.5b-p40-8k-first-fit": ("1.5b", "p40", 8192, ["lora.enabled=false", 'plan.optimizer="adamw8bit"',
                                                    "plan.optimizer_offload=false", "train.micro_batch=2",
                                                    "plan.rollout_batch=8", "plan.score_micro_batch=4",
                                                    'plan.kv_cache_dtype="fp32"']),
    "llama8b-nf4-t4-4k-first-fit": ("llama8b", "t4", 4096, NF4 + ["plan.optimizer_offload=false", "train.micro_batch=4",
                                                                  "plan.rollout_batch=8", "plan.score_micro_batch=8"]),
    "1.5b-p40-16k": ("1.5b", "p40", 16384, ["lora.enabled=false"]),
    "1.5b-lora-p40-8k": ("1.5b", "p40", 8192, ["lora.enabled=true"]),
    "1.5b-lora-4090-8k": ("1.5b", "rtx4090", 8192, ["lora.enabled=true"]),
    "qwen7b-nf4-4090-8k": ("qwen7b", "rtx4090", 8192, NF4),
    # fp16 rows again through torch's ops (plan.decode_backend=torch, the fp16 plans' decode before 2026-12-05),
    # against the same rows through the CUDA C kernels the plan now picks
    "1.5b-lora-t4-8k-torch": ("1.5b", "t4", 8192, ["lora.enabled=true", 'plan.decode_backend="torch"']),
    "llama8b-nf4-t4-4k-torch": ("llama8b", "t4", 4096, NF4 + ['plan.decode_backend="torch"']),
}
SMOKE = {"smoke": ("tiny-q", "cpu", 64, ["lora.enabled=false"])}
# --check: the code paths of the rows on the GPU in a minute (the 1.5B full plan at 256 tokens, an NF4 base)
CHECK = {"check-1.5b-p40": ("1.5b", "p40", 256, ["lora.enabled=false"]),
         "check-nf4-t4": ("tiny-q", "t4", 128, NF4)}


def row_sets(name: str, work: Path, steps: int, resumable: bool = False) -> list[str]:
    """The row's `edgerl train` settings (--set strings; the model folder's path comes on top)."""
    shape, profile, n, extra = {**ROWS, **CHECK, **SMOKE}[name]
    sets = bl.task_sets(work, steps, n) + [f'run.profile="{profile}"', *extra]
    return sets + (["run.save_every=1", "run.keep_last=1"] if resumable else [])


def card_bytes(profile: str) -> int:
    """The memory a row's run may take: its card's, the allocator's cap (the CPU profile: none)."""
    from edgerl.device.profiles import get_profile
    p = get_profile(profile)
    return p.memory_bytes if p.kind == "cuda" else 0


def command(name: str, steps: int) -> str:
    shape, profile, n, extra = {**ROWS, **CHECK}[name]
    sets = " ".join(f"--set {s}" for s in [f"rollout.max_new_tokens={n}", *extra])
    return (f"edgerl train --profile {profile} --model <{shape} random weights> {sets} (bench/bench_long.py "
            f"--only {name} --steps {steps})")


def summary(name: str, res: dict, steps: int) -> dict:
    plan = res.get("plan") or {}
    return {"row": name, "status": res.get("status"), "steps": f"{res.get('steps_done', 0)}/{steps}",
            "median_step_s": res.get("median_step_s"), "step_s": res.get("step_s"),
            "tokens_per_s": res.get("tokens_per_s"), "peak_reserved_gib": res.get("peak_reserved_gib"),
            "peak_allocated_gib": res.get("peak_allocated_gib"), **bl.memory_columns(res),
            "process_used_gib": res.get("process_used_end_gib"),
            "estimate_peak_phase": res.get("estimate_peak_phase"),
            "estimate_phases_gib": res.get("estimate_phases_gib"), "phase_alloc_gib": res.get("phase_alloc_gib"),
            "phase_start_gib": res.get("phase_start_gib"),
            "phase_reserved_gib": res.get("phase_reserved_gib"),
            "plan": {k: plan.get(k) for k in ("micro_batch", "score_micro_batch", "rollout_batch",
                                                "grad_checkpointing", "optimizer", "base_dtype")},
            "command": command(name, steps) if name in ROWS or name in CHECK else name, "message": res.get("error", "")[:600],
            **({"note": ONE_STEP} if res.get("steps_done") == 1 else {})}


RESUME_GRACE_S = 90.0   # SIGTERM to SIGKILL for a resumable row (10 s once stopped the 8K row mid-checkpoint)

# the optimizers allocate their state at their first step, after step 1's forward and backward: a run's first
# step peaks without it (measured: each 1.5B row's step-2 peak was its step-1 peak plus the 8-bit state)
ONE_STEP = ("one step measured: the optimizer's state is allocated at the end of its first update, so later "
            "steps hold it through every phase (the plan counts it in every phase)")


def offload_cost(out: Path, tokens: int = 8192, layers: int = 8, reps: int = 3) -> dict:
    """Forward + backward of `layers` checkpointed decoder layers at the Qwen2.5-1.5B widths in fp32, one row of
    `tokens` tokens, with the layer inputs kept on the GPU and offloaded to pinned host memory: median time,
    what the forward leaves allocated for the backward, and the peak. (The gradients are freed between
    iterations, so the peak falls at the end of the backward, when every layer input has been used: there the
    two agree; in training the gradients live through every micro-step and the inputs add to them.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from edgerl.models import offload
    from edgerl.models.attention import install
    from edgerl.models.load import enable_checkpointing
    dev = torch.device("cuda")
    install()
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    res = {"tokens": tokens, "layers": layers, "widths": "Qwen2.5-1.5B (fp32)"}
    for mode in ("on GPU", "offloaded"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dev)
        enable_checkpointing(model)
        off = offload.enable(model.model.layers, dev) if mode == "offloaded" else None
        model.train()
        ids = torch.randint(0, 1024, (1, tokens), device=dev)
        times = []
        for i in range(reps + 1):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            h = model.model(input_ids=ids, use_cache=False, edgerl_attention_chunk=0).last_hidden_state
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - base   # what the forward left for the backward
            h.float().square().mean().backward()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() - base
            model.zero_grad(set_to_none=True)
        res[mode] = {"median_s": sorted(times)[len(times) // 2], "peak_above_weights_gib": peak / bl.GiB,
                     "kept_after_forward_gib": kept / bl.GiB,
                     "moved_gib_per_step": (off.bytes_moved / (reps + 1) / bl.GiB) if off else 0.0}
        del model
        torch.cuda.empty_cache()
    res["slowdown"] = res["offloaded"]["median_s"] / res["on GPU"]["median_s"] - 1
    bl.Results(out, {"script": "bench_long --offload-cost"}).put("offload_cost", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help=f"rows (default all: {', '.join(ROWS)})")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=470, help="seconds per run")
    ap.add_argument("--parallel", action="store_true", help="all rows at once, each under its own cap")
    ap.add_argument("--resumable", action="store_true",
                    help="a checkpoint after every step; a row whose run folder in --work holds one continues it "
                         "up to --steps steps in all, and a row there already is not run again (a row slower than "
                         "one call: the same command over several calls on the same machine, the per-call figures "
                         "in each call's --out)")
    ap.add_argument("--offload-cost", action="store_true", help="time the activation offload, then stop")
    ap.add_argument("--check", action="store_true", help=f"the rows {', '.join(CHECK)} instead (2 steps)")
    ap.add_argument("--tf32", action="store_true",
                    help="fp32 matmuls on TF32 tensor cores (Ampere and newer): the same memory, a faster update; "
                         "an emulated P40's plan computes in fp32, which a P40 has no tensor cores for")
    bl.add_run_args(ap, 520, 30, "a tiny shape, 2 steps of 64 tokens on the CPU")
    args = ap.parse_args()
    out, work = bl.out_and_work(args, "bench_long", 30)
    if args.offload_cost:
        print(offload_cost(out.with_name(out.stem + "_offload.json")))
        return
    rows = SMOKE if args.smoke else CHECK if args.check else {k: ROWS[k] for k in (args.only or list(ROWS))}
    steps = 2 if (args.smoke or args.check) and not args.resumable else args.steps
    clock = bl.Clock(args.budget_s)
    results = bl.Results(out, {"script": "bench_long", "argv": sys.argv[1:], "device": bl.device_name(),
                               "versions": bl.versions(), "steps": steps, "parallel": args.parallel,
                               "tf32": args.tf32})

    def log(s: str) -> None:
        print(f"[{clock.elapsed():5.0f} s] {s}", flush=True)

    shapes = sorted({r[0] for r in rows.values()})
    models: dict[str, Path] = {}

    def build(shape: str) -> None:
        try:
            models[shape] = bl.ensure_model(work, shape, args.tokenizer, timeout=max(60, int(clock.left()) - 60), log=log)
        except Exception as e:  # noqa: BLE001
            log(f"{shape}: model not built: {str(e)[-500:]}")
    for shape in shapes:   # one after another: each is bound by the disk
        build(shape)

    def run(name: str) -> None:
        shape = rows[name][0]
        if shape not in models:
            results.put(name, summary(name, {"status": "error: model not built"}, steps))
            return
        run_dir = work / "runs" / name
        done = max((r.get("step", 0) for r in bl.read_run_folder(run_dir)["rows"]), default=0) \
            if args.resumable and (run_dir / "checkpoints").is_dir() else 0
        if not done:
            import shutil
            shutil.rmtree(run_dir, ignore_errors=True)
        total = steps if args.resumable else done + steps
        if done >= total:
            results.put(name, {"row": name, "status": f"done: its run folder holds {done} of {total} steps",
                               "steps": f"{done}/{total}",
                               "command": command(name, total) if name in ROWS else name})
            log(f"{name}: {done} of {total} steps done in an earlier call")
            return
        sets = row_sets(name, work, total, args.resumable)
        spec = bl.edgerl_spec(models[shape], sets, run_dir, work / f"{name}.json", phase_peaks=True, tf32=args.tf32,
                              **({"resume": str(run_dir), "resumed_after": done} if done else {}))
        if done:
            log(f"{name}: continues its run after step {done}, to step {total}")
        # a resumable row is stopped early enough that the checkpoint it is writing (9 GB at the 1.5B widths in
        # fp32 with its optimizer) can finish before the SIGKILL: the next call continues from it
        grace = RESUME_GRACE_S if args.resumable else 10.0
        res = bl.run_edgerl(name, spec, work, max(10, min(args.timeout, clock.left() - 5) - grace + 10), grace=grace)
        row = summary(name, res, total - done) | ({"resumed_after_step": done} if done else {})
        results.put(name, row | {"raw": {k: v for k, v in res.items() if k not in ("trace",)}})
        log(bl.memory_line(name, row))

    # parallel rows start while their cards' memory fits the device's together (nine rows' caps add up to more
    # than an H200's 139 GiB); the others wait for a run to end
    caps, device = {k: card_bytes(rows[k][1]) for k in rows}, bl.device_bytes()
    bl.run_each(list(rows), run, args.parallel, caps, device)
    bl.finish_memory_runs(results, list(rows), "row", out, clock)


if __name__ == "__main__":
    main()
