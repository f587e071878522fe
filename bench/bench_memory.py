"""The memory model against measured peaks: the plan's estimate (plan.json) beside the device memory
each run really used, on uncapped runs.

    python bench/bench_memory.py [--only NAME ...] [--steps 2] [--budget-s 400] [--out FILE]
    python bench/bench_memory.py --smoke          # tiny shape, 8 tokens, on the CPU: the plumbing only

Uncapped, because a capped allocator frees its cache and retries when it reaches the cap: a capped
run's reserved peak is bounded by the cap, not by what the step needs. Budgets below the GPU's
(`plan.memory_gib`) change the plan; the cap a training run puts on its allocator at such a budget
is lifted again here (the spec's "uncapped"). Measured = peak reserved (torch's allocator)
+ the memory the process holds outside it (CUDA context, library handles: NVML's used bytes for the
GPU now, less those before the process touched CUDA, less torch's reserved bytes; where NVML is
missing, the constant edgerl.plan.memory.DEFAULT_CALIBRATION.cuda_context is used and the JSON says so).
The plan's estimate counts the same things (its CUDA context term is that constant). Error =
estimate / measured - 1: positive means the plan over-estimated (safe), negative under (an OOM risk).

Each phase's peak is read too (a Trainer subclass resets the peak counters at each phase boundary:
rollout, score, update, and "other" for what lies between them), beside the plan's estimate of that
phase less its CUDA context term.

Task: GRPO with reference KL (PPO with a critic where named), 2 prompts x 8 samples x 256 new tokens,
prompts up to 64 tokens, random-weight llama shapes with the SmolLM2 vocabulary, 2 steps (step 1
creates the optimizer state; step 2 runs with it resident). Each run is its own process.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

# In priority order (a budget drops the last ones first). The whole-GPU bf16 runs and a 4 GiB budget come
# after the rest: bench_vs_trl's whole-GPU edgerl runs (no budget, so no cap) measure those totals as well.
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "1.7b-fp32-22gib": ("1.7b", ['plan.dtype="fp32"', "plan.memory_gib=21.88"]),   # a P40's plan, uncapped
    "362m-bf16-ppo": ("362m", ['algo.advantage="gae"']),
    "1.7b-bf16-lora": ("1.7b", ["lora.enabled=true"]),
    "1.7b-bf16-nf4": ("1.7b", ["lora.enabled=true", 'plan.base_dtype="nf4"']),
    "1.7b-bf16-optoffload": ("1.7b", ["plan.optimizer_offload=true"]),
    "1.7b-bf16-paramoffload": ("1.7b", ["plan.param_offload=true"]),
    "362m-fp32-grpo": ("362m", ['plan.dtype="fp32"']),
    "362m-bf16-grpo": ("362m", []),
    "1.7b-bf16-grpo": ("1.7b", []),
    "1.7b-bf16-adamw-bf16": ("1.7b", ['plan.optimizer="adamw-bf16"']),
    "362m-bf16-4gib": ("362m", ["plan.memory_gib=4"]),
    "1.7b-fp32-grpo": ("1.7b", ['plan.dtype="fp32"']),
}
SMOKE_DEFAULT = ["362m-bf16-grpo", "362m-bf16-ppo", "1.7b-bf16-lora", "1.7b-bf16-paramoffload"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help=f"runs, in order (default all: {', '.join(CONFIGS)})")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    bl.add_run_args(ap, 400, 40, "tiny shape, 8 tokens; on the CPU, no memory figures")
    args = ap.parse_args()
    out, work = bl.out_and_work(args, "bench_memory", 40)
    only = args.only or (SMOKE_DEFAULT if args.smoke else list(CONFIGS))
    unknown = [n for n in only if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {', '.join(CONFIGS)}")
    bl.catalogue_check()
    clock = bl.Clock(args.budget_s)
    steps, new_tokens = (2, 8) if args.smoke else (args.steps, args.new_tokens)
    results = bl.Results(out, {"script": "bench_memory", "smoke": args.smoke, "argv": sys.argv[1:],
                               "steps": steps, "new_tokens": new_tokens, "device": bl.device_name(),
                               "versions": bl.versions()})

    def log(s: str) -> None:
        print(f"[{clock.elapsed():5.0f} s] {s}", flush=True)
    for name in only:
        if args.skip_done and results.runs.get(name, {}).get("status") == "ok":
            continue
        shape, extra = CONFIGS[name]
        shape = "tiny-q" if args.smoke else shape
        if clock.left() < args.min_run_s:
            results.put(name, {"status": f"skipped: {clock.elapsed():.0f} s of the budget used"})
            log(f"{name}: skipped (budget)")
            continue
        try:
            model = bl.ensure_model(work, shape, args.tokenizer, timeout=max(60, min(300, clock.left() - 20)), log=log)
        except Exception as e:  # noqa: BLE001
            results.put(name, {"status": "error: model not built", "error": str(e)[-1500:]})
            continue
        run_dir = work / "runs" / f"memory-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        sets = bl.task_sets(work, steps, new_tokens) + extra
        spec = bl.edgerl_spec(model, sets, run_dir, work / f"memory-{name}.json", phase_peaks=True, uncapped=True)
        res = bl.run_edgerl(f"memory-{name}", spec, work, min(args.timeout, clock.left() - 5))
        res.update(shape=shape, sets=extra, model=bl.model_info(model))
        res["phases"] = phase_table(res)
        results.put(name, res)
        log(f"{name}: {res['status']} in {res.get('wall_s', 0):.0f} s; estimate {bl.fmt(res.get('estimate_gib'))} GiB "
            f"({res.get('estimate_peak_phase', '-')}), measured {bl.fmt(res.get('measured_gib'))} GiB, error "
            f"{bl.fmt(res.get('estimate_error'), '{:+.1%}')}" + (f"; {res.get('error', '')[:300]}"
                                                                if res["status"] != "ok" else ""))
    runs = {k: results.runs[k] for k in only if k in results.runs}
    text = report(runs)
    errs = [abs(r["estimate_error"]) for r in runs.values() if r.get("estimate_error") is not None]
    under = [f"{k} ({r['estimate_error']:+.1%})" for k, r in runs.items() if (r.get("estimate_error") or 0) < 0]
    summary = (f"{len(errs)} runs measured; |error| median {bl.med(errs):.1%}, max {max(errs):.1%}; under-estimates "
               f"(an out-of-memory risk on a full card): {', '.join(under) or 'none'}" if errs
               else "no run measured (no CUDA device, or every run failed)")
    bad = [f"{k}: {r.get('steps_done')} of {steps} steps" for k, r in runs.items()
           if r.get("status") == "ok" and r.get("steps_done") != steps]
    bad += [f"{k}: no estimate (plan.json missing)" for k, r in runs.items()
            if r.get("status") == "ok" and r.get("estimate_gib") is None]
    bad += [f"{k}: the outside-allocator memory came from mem_get_info without a baseline" for k, r in runs.items()
            if "no baseline" in str((r.get("memory_end") or {}).get("method", ""))]
    results.data["table"], results.data["summary"], results.data["check_failures"] = text, summary, bad
    results.save()
    from edgerl.plan.memory import DEFAULT_CALIBRATION
    print(f"\nplan estimate vs measured device memory (peak reserved + outside the allocator), uncapped, "
          f"{steps} steps of 2 prompts x 8 samples x {new_tokens} tokens; the plan's CUDA context constant is "
          f"{DEFAULT_CALIBRATION.cuda_context / bl.GiB:.2f} GiB\n")
    print(text)
    print(f"\n{summary}")
    print("checks: " + ("all passed" if not bad else f"{len(bad)} FAILED\n  " + "\n  ".join(bad)))
    print(f"wrote {out} ({clock.elapsed():.0f} s)")


def phase_table(r: dict) -> dict:
    """Per phase: the plan's estimate less its CUDA context term, and the measured allocated peak."""
    ctx = r.get("estimate_context_gib") or 0.0
    est, alloc = r.get("estimate_phases_gib") or {}, r.get("phase_alloc_gib") or {}
    return {p: {"estimate_without_context_gib": est[p] - ctx if p in est else None,
                "measured_allocated_gib": alloc.get(p)} for p in ("rollout", "score", "update", "other")
            if p in est or p in alloc}


def report(runs: dict[str, dict]) -> str:
    rows = []
    for name, r in runs.items():
        p = r.get("plan") or {}
        plan = (f"{(p.get('dtype') or {}).get('compute', '?')} {p.get('optimizer')}"
                + (" lora" if p.get("lora") else "") + (f" base {p.get('base_dtype')}" if p.get("base_dtype") else "")
                + (" ckpt" if p.get("grad_checkpointing") else "") + f" mb{p.get('micro_batch')}"
                + (" swap" if p.get("swap_models") else "") + (" opt-off" if p.get("optimizer_offload") else "")
                + (" param-off" if p.get("param_offload") else "")) if p else "-"
        ph = r.get("phases") or {}
        per_phase = " / ".join(f"{bl.fmt((ph.get(k) or {}).get('estimate_without_context_gib'), '{:.1f}')}:"
                               f"{bl.fmt((ph.get(k) or {}).get('measured_allocated_gib'), '{:.1f}')}"
                               for k in ("rollout", "score", "update"))
        rows.append([name, r.get("status", "-")[:40], plan, bl.fmt(r.get("estimate_gib")),
                     r.get("estimate_peak_phase", "-"), bl.fmt(r.get("peak_allocated_gib")),
                     bl.fmt(r.get("peak_reserved_gib")), bl.fmt(r.get("outside_allocator_gib")),
                     bl.fmt(r.get("measured_gib")), bl.fmt(r.get("estimate_error"), "{:+.1%}"), per_phase,
                     bl.fmt(r.get("median_step_s"))])
    return bl.table(["run", "status", "plan", "estimate GiB", "est. peak phase", "peak alloc GiB",
                     "peak reserved GiB", "outside alloc GiB", "measured GiB", "error",
                     "est:alloc GiB rollout / score / update", "s/step"], rows)


if __name__ == "__main__":
    main()
