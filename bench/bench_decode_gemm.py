"""The decode step's projections at 16 rows, bf16, on the GPU: cuBLAS through F.linear (what the engine
calls) against the same product with the operands swapped (W x^T, the result read transposed) and with
the weight stored transposed, and split-K as a batched product with fp32 partials, each over as many weight copies as the model has layers (so L2 holds none),
timed in a CUDA graph. Prints microseconds per call and the share of the bandwidth bound.
`--triton` adds edgerl/kernels/decode_linear.py's fused projections as the Triton decode layer calls them (q/k/v and
gate/up with the RMS norm as prologue, gate/up with SiLU * up as epilogue, o and down with the residual add)
with their default tiles, and `--sweep` times a grid of tiles around them."""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.core.files import write_atomically  # noqa: E402
from edgerl.plan.modelspec import CATALOGUE  # noqa: E402


def shapes(name):
    c = CATALOGUE[f"smollm2-{name}"].llama_config_fields()
    h, i, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = h // heads
    return c["num_hidden_layers"], {"qkv": (h, (heads + 2 * kv) * hd), "o": (h, h), "gate_up": (h, 2 * i),
                                    "down": (i, h)}


def timed(fn, n, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / n


def triton_variants(variants, proj, x, W, res_in, sweep):
    """The fused kernel as the Triton layer calls it for this projection, default tiles and (sweep) a grid."""
    from edgerl.kernels.decode_linear import decode_linear
    from edgerl.kernels.tiles import decode_linear_smem
    K, dt = x.shape[1], x.dtype
    ln = torch.ones(K, device=x.device, dtype=dt)
    glu = proj == "gate_up"
    # the norm's sums of squares as the Triton layer passes them: partials from the product before, one per
    # program along its 32-column blocks; the residual products write theirs
    ssq = torch.rand(K // 32, x.shape[0], device=x.device) * K
    kw = (dict(norm=ln, eps=1e-5, glu=glu, sumsq=ssq) if proj in ("qkv", "gate_up")
          else dict(residual=res_in, return_sumsq=True))
    variants["triton_fused"] = lambda: [decode_linear(x, w, **kw) for w in W]
    if not sweep:
        return
    smem = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    for t in sweep_tiles(proj, sweep == "all"):
        if decode_linear_smem(16, t[1], t[2], 2, glu, t[4]) <= smem * 3 // 4:
            variants[tile_name(t)] = lambda t=t: [decode_linear(x, w, tiles=t, **kw) for w in W]


# The sweep's grid per product (BM 16, 4 warps): output columns per program, inner block, pipeline depth (up to
# the depth that has every inner block of a 360M product in flight at once), the inner dimension split over 1, 2
# or 4 programs, and W x^T or x W^T. It leaves out what measured slower (docs/benchmarks.md, Decode projections;
# docs/lab-log.md, 2026-12-02): q/k/v and gate/up split, q/k/v as x W^T, gate/up and o as W x^T, down at 16 columns; --sweep-all
# puts the splits and both operand orders back.
SWEEP = {"qkv": dict(bn=(16, 32, 64), bk=(128, 256, 512), stages=(3, 4, 5, 6), split=(1,), swap=(1,)),
         "gate_up": dict(bn=(16, 32), bk=(128, 256, 512), stages=(2, 3, 4, 5), split=(1,), swap=(0,)),
         "o": dict(bn=(16, 32), bk=(128, 256, 512), stages=(3, 4, 5, 6), split=(1, 2), swap=(0,)),
         "down": dict(bn=(32, 64), bk=(128, 256, 512), stages=(4, 5, 6), split=(1, 2, 4), swap=(0, 1))}
SWEEP_ALL = dict(split=(1, 2, 4), swap=(0, 1))


def sweep_tiles(proj, everything=False):
    g = dict(SWEEP[proj], **(SWEEP_ALL if everything else {}))
    return [(16, bn, bk, 4, st, split, swap) for bn in g["bn"] for bk in g["bk"] for st in g["stages"]
            for split in g["split"] for swap in g["swap"]]


def tile_name(t):
    return f"triton_{t[1]}x{t[2]}_s{t[4]}_k{t[5]}{'_swap' if t[6] else ''}"


def best_tiles(rec):
    """The fastest swept tiles of one product's record (a tuple), or None if the record has no sweep."""
    swept = {tile_name(t): t for t in sweep_tiles(rec["proj"], True)}
    timed_ = [(rec[k + "_us"], t) for k, t in swept.items() if k + "_us" in rec]
    return min(timed_)[1] if timed_ else None


def refuse_unknown_models_and_out(ap, models, out):
    """--models not among the SmolLM2 shapes, or an --out whose folder is missing: one line (ap.error, exit 2)."""
    unknown = [m for m in models.split(",") if f"smollm2-{m}" not in CATALOGUE]
    if unknown:
        known = ", ".join(n.removeprefix("smollm2-") for n in CATALOGUE if n.startswith("smollm2-"))
        ap.error(f"--models: {', '.join(unknown)} not among the SmolLM2 shapes ({known})")
    if out and not Path(out).resolve().parent.is_dir():
        ap.error(f"--out: the folder of {out} does not exist; create it first")


def require_cuda(what):
    """Without a CUDA GPU: '<what>: it needs a CUDA GPU' on stderr, exit 2."""
    if not torch.cuda.is_available():
        print(f"{what}: it needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="360m,1.7b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--triton", action="store_true", help="add the fused Triton projections")
    ap.add_argument("--sweep", action="store_true", help="with --triton: time a grid of tiles too")
    ap.add_argument("--sweep-all", action="store_true", help="with --sweep: also the splits and operand orders that "
                    "measured slower (docs/lab-log.md, 2026-12-02)")
    args = ap.parse_args()
    refuse_unknown_models_and_out(ap, args.models, args.out)
    if args.rows < 1:
        ap.error("--rows needs at least 1")
    require_cuda("bench_decode_gemm.py times the decode step's CUDA products")
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = 4.2e12
    res = []
    for name in args.models.split(","):
        L, sh = shapes(name)
        for proj, (K, N) in sh.items():
            x = torch.randn(args.rows, K, device=dev, dtype=dt)
            W = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(L)]
            Wt = [w.t().contiguous() for w in W]
            res_in = torch.randn(args.rows, N, device=dev, dtype=dt)
            variants = {
                "linear": lambda: [F.linear(x, w) for w in W],
                "swapped": lambda: [torch.mm(w, x.t()) for w in W],
                "w_transposed": lambda: [torch.mm(x, wt) for wt in Wt],
                "addmm_residual": lambda: [torch.addmm(res_in, x, w.t()) for w in W],
            }
            for S in (2, 4, 8):   # split-K as a batched product with fp32 partials (their sum is left to the consumer)
                if K % (8 * S):
                    continue
                xs = x.view(args.rows, S, K // S).transpose(0, 1)                      # (S, rows, K/S)
                Ws = [w.view(N, S, K // S).permute(1, 2, 0) for w in W]                # (S, K/S, N), no copy
                variants[f"splitk{S}_fp32"] = (lambda xs=xs, Ws=Ws: [torch.bmm(xs, ws, out_dtype=torch.float32)
                                                                     for ws in Ws])
                variants[f"splitk{S}_fp32_sum"] = (lambda xs=xs, Ws=Ws: [
                    torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(dt) for ws in Ws])
            if args.triton:
                triton_variants(variants, proj, x, W, res_in, "all" if args.sweep and args.sweep_all else args.sweep)
            rec = dict(model=name, proj=proj, K=K, N=N, bound_us=round(K * N * 2 / bw * 1e6, 2))
            for v, fn in variants.items():
                rec[v + "_us"] = round(timed(fn, L), 2)
            print(json.dumps(rec), flush=True)
            res.append(rec)
            if args.out:   # after each product: a run cut short keeps what it measured
                write_atomically(Path(args.out), json.dumps(res, indent=1))
            W = Wt = variants = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
