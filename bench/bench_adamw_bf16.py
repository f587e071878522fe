"""One optimizer step over the parameters of a model shape: edgerl's bf16 AdamW (stochastic rounding and
Kahan; on CUDA fused and eager) against torch's own AdamW on fp32 parameters (foreach and fused), in the
same process. On CUDA also the step of parameters held in (pinned) host memory, as FSDP2's parameter
offload holds them: streamed through the GPU (step_device) against stepped by the host's cores.

    python bench/bench_adamw_bf16.py [--device cpu|cuda] [--params 100] [--host-params 362] [--reps 3] [--out FILE]
    python bench/bench_adamw_bf16.py --smoke        # 1M parameters, one repetition: the plumbing only
    python bench/bench_adamw_bf16.py --baseline OLD/edgerl/adamw_bf16.py   # also: that file's AdamWBF16,
        stepped in turn with this one (same process, alternating steps: a noisy machine slows both alike)

On the host CPU this is the step of a plan whose optimizer lives in host memory (FSDP2 parameter offload
runs it there). Parameters: SmolLM2-360M-shaped matrices (2560 x 960) up to --params million, random
bf16 weights and gradients; each variant is stepped once untimed (state allocation), then --reps timed
steps (median; CUDA synchronised). torch's AdamW runs on fp32 copies of the same weights: the peer for
"what a step costs" on this device, with 16 bytes of state per parameter against edgerl's 4 or 6.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.core.files import write_atomically  # noqa: E402


def load_baseline(path: str):
    """Another version of edgerl/adamw_bf16.py (e.g. from `git worktree add`), imported beside this one."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("edgerl.adamw_bf16_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "edgerl"   # its relative imports (errors, memory) resolve to this edgerl
    spec.loader.exec_module(mod)
    return mod


def alternate(opts: dict, device: str, reps: int) -> dict:
    """Median seconds per step of each optimizer, stepping them in turn (each stepped once untimed first:
    that step allocates the state)."""
    import torch
    times: dict = {k: [] for k in opts}
    for opt in opts.values():
        opt.step()
    for _ in range(reps):
        for k, opt in opts.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--params", type=float, default=100.0, help="million parameters")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-params", type=float, default=362.0,
                    help="million parameters for the host-memory variants (CUDA only; 0 leaves them out)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--baseline", default=None, help="another adamw_bf16.py to time against this one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from edgerl.train.adamw_bf16 import AdamWBF16
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.params, args.reps = 1.0, 1
    rows, cols = (2560, 960) if not args.smoke else (256, 96)
    count = max(1, int(args.params * 1e6) // (rows * cols))
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [(torch.randn(rows, cols, generator=gen) * 0.02).to(device, torch.bfloat16) for _ in range(count)]
    grads = [(torch.randn(rows, cols, generator=gen) * 1e-3).to(device, torch.bfloat16) for _ in range(count)]
    n = count * rows * cols
    results = []

    def run(name: str, make, dtype, host: int = 0) -> None:
        """host: step that many of the matrices held in pinned host memory (the times are per parameter)."""
        src_w, src_g = (weights, grads) if not host else (weights[:host], grads[:host])
        where = (lambda t: t.cpu().pin_memory()) if host else (lambda t: t)
        ps = [torch.nn.Parameter(where(w.clone().to(dtype))) for w in src_w]
        for p, g in zip(ps, src_g):
            p.grad = where(g.clone().to(dtype))
        count_n = len(ps) * rows * cols
        try:
            s = alternate({"one": make(ps)}, device, args.reps)["one"]
            results.append({"variant": name, "status": "ok", "step_s": s, "ns_per_param": s / count_n * 1e9,
                            "params": count_n})
        except Exception as e:  # noqa: BLE001 - a variant this torch lacks is reported, the rest still run
            results.append({"variant": name, "status": f"error: {type(e).__name__}: {e}"[:300]})
        del ps

    hp = dict(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    cuda = device == "cuda"
    for kahan, label in ((False, "adamw-bf16-sr (bf16, stochastic rounding)"), (True, "adamw-bf16 (bf16, Kahan)")):
        for fused in ((True, False) if cuda else (False,)):
            how = (", fused Triton kernel" if fused else ", eager") if cuda else ""
            run(f"edgerl {label}{how}", lambda ps, k=kahan, f=fused: AdamWBF16(ps, kahan=k, fused=f, **hp),
                torch.bfloat16)
    run("torch AdamW fp32, foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **hp), torch.float32)
    run("torch AdamW fp32, fused", lambda ps: torch.optim.AdamW(ps, fused=True, **hp), torch.float32)
    host = min(count, max(1, int(args.host_params * 1e6) // (rows * cols))) if cuda and args.host_params > 0 else 0
    if host:
        run("host memory: edgerl adamw-bf16-sr streamed through the GPU",
            lambda ps: AdamWBF16(ps, kahan=False, step_device="cuda", **hp), torch.bfloat16, host)
        run("host memory: edgerl adamw-bf16-sr on the host's cores",
            lambda ps: AdamWBF16(ps, kahan=False, **hp), torch.bfloat16, host)
        run("host memory: torch AdamW fp32 fused on the host's cores",
            lambda ps: torch.optim.AdamW(ps, fused=True, **hp), torch.float32, host)
    if args.baseline:
        base = load_baseline(args.baseline)
        for kahan in (False, True):
            pair = {}
            for k, mod in (("baseline", base), ("this", sys.modules["edgerl.train.adamw_bf16"])):
                ps = [torch.nn.Parameter(w.clone()) for w in weights]
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                pair[k] = mod.AdamWBF16(ps, kahan=kahan, **hp)
            t = alternate(pair, device, args.reps)
            label = "Kahan" if kahan else "stochastic rounding"
            results.append({"variant": f"baseline {label} (steps alternated)", "status": "ok",
                            "step_s": t["baseline"], "ns_per_param": t["baseline"] / n * 1e9})
            results.append({"variant": f"this {label} (steps alternated)", "status": "ok", "step_s": t["this"],
                            "ns_per_param": t["this"] / n * 1e9, "speedup_vs_baseline": t["baseline"] / t["this"]})
    ref = next((r["ns_per_param"] for r in results if r["variant"].endswith("foreach") and r["status"] == "ok"), None)
    machine = torch.cuda.get_device_name() if device == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    if cuda:
        machine += f", host {torch.get_num_threads()} torch threads"
    print(f"one AdamW step over {n / 1e6:.0f}M parameters on {device} ({machine}), torch {torch.__version__}, "
          f"median of {args.reps}")
    print("| variant | params | s/step | ns/param | vs torch foreach (ns/param) |\n|---|---|---|---|---|")
    for r in results:
        if r["status"] != "ok":
            print(f"| {r['variant']} | | {r['status']} | | |")
            continue
        print(f"| {r['variant']} | {r.get('params', n) / 1e6:.0f}M | {r['step_s']:.3f} | {r['ns_per_param']:.1f} | "
              f"{(ref / r['ns_per_param']) if ref else float('nan'):.2f}x |"
              + (f" {r['speedup_vs_baseline']:.2f}x the baseline |" if "speedup_vs_baseline" in r else ""))
    if args.out:
        write_atomically(Path(args.out), json.dumps({"device": device, "machine": machine, "params": n,
                                                      "torch": torch.__version__, "results": results}, indent=1))
    sys.exit(1 if any(r["status"] != "ok" for r in results) else 0)


if __name__ == "__main__":
    main()
