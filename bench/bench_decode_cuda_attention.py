"""The decode step's attention at long lengths, in fp32 or fp16 (--dtype): edgerl/kernels/decode_cuda.py's
rope_attend, one block per row and KV head against split into slices of columns (split-K, merged by a second
kernel): the engine's default grid (`decode_cuda.slices`) and fixed slices of --splits columns, beside the
`torch` decode backend's ops over the masked cache (fp32: baddbmm, softmax and bmm; fp16: SDPA, as a Volta or
Turing plan decodes), and beside the layer's four matmuls at the same rows, so that the attention's share of a
decode step shows.

For each head layout (Qwen2.5-1.5B: 2 KV heads of 6 queries; Qwen2.5-7B: 4 of 7; Llama-3.1-8B: 8 of 4; head
size 128), 16 rows, a cache of --cache columns (what a rollout of that many tokens allocates), the new column
written at each of --cols: microseconds per call (a CUDA graph over --copies copies of the cache, so L2 holds
none of them), the share of the bound (the K and V columns each row sees, read once, over the copy bandwidth
measured in this run), and the largest difference from the float64 reference.

    python bench/bench_decode_cuda_attention.py [--cols 512,2048,4096,8192] [--splits 256,512,1024] [--dtype fp16]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_gemm import require_cuda, timed  # noqa: E402  (timed: us per call of fn / n, in a CUDA graph)
from bench_rollout import measure_bandwidth  # noqa: E402
from benchlib import SHAPES  # noqa: E402  (the bench shapes' widths, checked against edgerl's catalogue)
from edgerl.core.files import write_atomically  # noqa: E402


def layout(name):
    """(hidden, KV heads, query heads per KV head, head size, MLP width) of a bench shape."""
    hidden, _, heads, kv, mlp, _ = SHAPES[name]
    return hidden, kv, heads // kv, hidden // heads, mlp


def torch_mask(B, KVH, S, col, device, dtype=torch.float32):
    """The torch backend's additive mask, built once per step for every layer (start 0 here): (B KVH, 1, S) for
    fp32's baddbmm, (B, 1, 1, S) for the 16-bit SDPA (edgerl/rollout/decode_torch.py)."""
    hidden = torch.arange(S, device=device) > col
    bias = torch.where(hidden, -torch.inf, torch.zeros((), device=device, dtype=dtype))[None, None, None, :]
    return bias.expand(B, 1, 1, S).contiguous() if dtype != torch.float32 else \
        bias.expand(B * KVH, 1, S).contiguous()


def torch_attention(q, kc, vc, mask, scale, G):
    """The torch backend's attention (edgerl/rollout/decode_torch.py): every cache column scored, masked. fp32:
    the mask added by baddbmm, softmax, bmm; 16 bits: SDPA, each KV head attending for its G query heads."""
    B, KVH, S, D = kc.shape
    if kc.dtype != torch.float32:
        from edgerl.rollout.decoder import sdpa
        return sdpa(q.view(B, KVH, G, D), kc, vc, mask, scale, False).reshape(B, -1)
    s = torch.baddbmm(mask, q.view(B * KVH, G, D), kc.view(B * KVH, S, D).transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(s, -1), vc.view(B * KVH, S, D)).view(B, -1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1.5b,qwen7b,llama8b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--cache", type=int, default=8256, help="cache columns (prompt + new tokens)")
    ap.add_argument("--cols", default="256,1024,2048,4096,6144,8192", help="new columns to time at")
    ap.add_argument("--splits", default="256,512,1024,2048", help="columns per slice of the split kernel")
    ap.add_argument("--copies", type=int, default=6, help="cache copies cycled through (L2 holds none)")
    ap.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="the cache's and the inputs' dtype")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    unknown = [n for n in a.layouts.split(",") if n not in SHAPES]
    if unknown:
        ap.error(f"--layouts: {', '.join(unknown)} not among the bench shapes ({', '.join(SHAPES)})")
    from edgerl.kernels.tiles import decode_cuda_shape_reason
    for n in a.layouts.split(","):
        if why := decode_cuda_shape_reason(layout(n)[3], layout(n)[2]):
            ap.error(f"--layouts: {n}: the kernel does not take its heads ({why})")
    try:
        cols = [int(c) for c in a.cols.split(",")]
        splits = [int(c) for c in a.splits.split(",")]
    except ValueError:
        ap.error("--cols and --splits take comma-separated integers")
    if a.rows < 1 or a.copies < 1 or a.cache < 1:
        ap.error("--rows, --copies and --cache need at least 1")
    if any(not 0 <= c < a.cache for c in cols) or any(s < 1 for s in splits):
        ap.error(f"--cols must lie in [0, {a.cache}) and --splits be positive")
    if a.out and not Path(a.out).resolve().parent.is_dir():
        ap.error(f"--out: the folder of {a.out} does not exist")
    require_cuda("bench_decode_cuda_attention.py times CUDA kernels")
    from edgerl.kernels import decode_cuda as k
    dev = torch.device("cuda")
    dt = {"fp32": torch.float32, "fp16": torch.float16}[a.dtype]
    elt = torch.tensor([], dtype=dt).element_size()
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"{torch.cuda.get_device_properties(dev).multi_processor_count} SMs; {a.rows} rows, cache {a.cache}, "
          f"{a.dtype}")
    results = []
    for name in a.layouts.split(","):
        Hd, KVH, G, D, I = layout(name)
        B, S, H = a.rows, a.cache, KVH * G
        g = torch.Generator(device=dev).manual_seed(0)
        caches = [(torch.randn(B, KVH, S, D, device=dev, generator=g).to(dt),
                   torch.randn(B, KVH, S, D, device=dev, generator=g).to(dt)) for _ in range(a.copies)]
        qkv = torch.randn(B, (H + 2 * KVH) * D, device=dev, generator=g).to(dt)
        q, kk, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        ang = torch.rand(B, D // 2, device=dev, generator=g) * 6
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((-ang.sin(), ang.sin()), -1).to(dt)
        start = torch.zeros(B, dtype=torch.long, device=dev)
        scale = D ** -0.5
        mats = [(torch.randn(B, i, device=dev, generator=g).to(dt), torch.randn(o, i, device=dev, generator=g).to(dt))
                for o, i in (((H + 2 * KVH) * D, Hd), (Hd, H * D), (2 * I, Hd), (Hd, I))]   # qkv, o, gate_up, down
        mm_us = timed(lambda: [torch.nn.functional.linear(xi, wi) for xi, wi in mats], 1)
        print(f"\n{name}: {KVH} KV heads x {G} queries, head {D}; the layer's four {a.dtype} matmuls at {B} rows: "
              f"{mm_us:.1f} us")
        for col in cols:
            colt = torch.tensor([col], device=dev)
            bound = 2 * B * KVH * (col + 1) * D * elt / bw * 1e6
            kc, vc = caches[0]
            want, _ = k.reference_rope_attend(q, kk, v, cos, sin, kc.clone(), vc.clone(), start, colt, scale)
            row = {"layout": name, "dtype": a.dtype, "col": col, "bound_us": bound, "matmuls_us": mm_us}
            # "default": the grid the engine launches (decode_cuda.slices: two blocks a SM, each row's columns
            # spread over them); "split N": fixed slices of N columns
            variants = [("whole", S), ("default", None)] + [(f"split {s}", s) for s in splits if s < S]
            for label, split in variants:
                err = (k.rope_attend(q, kk, v, cos, sin, kc, vc, start, colt, scale, split_columns=split).double()
                       - want).abs().max().item()
                us = timed(lambda: [k.rope_attend(q, kk, v, cos, sin, c[0], c[1], start, colt, scale,
                                                  split_columns=split) for c in caches], len(caches))
                row[label] = {"us": us, "max_err": err}
            qr = q.contiguous()   # the torch ops on an unrotated q: the same reads and arithmetic
            mask = torch_mask(B, KVH, S, col, dev, dt)
            row["torch"] = {"us": timed(lambda: [torch_attention(qr, c[0], c[1], mask, scale, G) for c in caches],
                                        len(caches))}
            results.append(row)
            best = min((lab for lab, _ in variants), key=lambda lab: row[lab]["us"])
            print(f"| {name} | col {col} | bound {bound:.1f} us | torch {row['torch']['us']:.1f} | "
                  + " | ".join(f"{lab} {row[lab]['us']:.1f} us ({100 * bound / row[lab]['us']:.0f}%, err "
                               f"{row[lab]['max_err']:.1e})" for lab, _ in variants)
                  + f" | fastest: {best}, {row['whole']['us'] / row[best]['us']:.2f}x the whole kernel |")
            if a.out:
                write_atomically(Path(a.out), json.dumps({"bandwidth_tbs": bw / 1e12, "results": results}, indent=1))


if __name__ == "__main__":
    main()
