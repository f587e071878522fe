"""The training step's attention: PyTorch SDPA's backends on the batches a GRPO step scores and trains on.

HF's SDPA path passes a boolean mask (causal, left padding hidden) whenever a batch has padding, so
the flash backend (no arbitrary masks) cannot take it, and PyTorch chooses among the others. A GRPO
batch's length changes from step to step (prompts and responses end where they end), so each step
may bring shapes the backend has not seen. Per backend: a forward and backward over `--lengths`
distinct lengths no other backend has run, the first call at each length ("first", any per-shape setup
included) and a second pass over the same lengths ("again"), median milliseconds; and the kernels the
default choice runs.

    python bench/bench_attention.py --out bench_attention.json      # H200: ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.core.files import write_atomically  # noqa: E402

BACKENDS = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "default": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION],
            "flash+efficient+math": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            "math": [SDPBackend.MATH]}


def batch(rows: int, heads: int, length: int, head_dim: int, device, dtype):
    """q, k, v (rows, heads, length, head_dim) needing grads, and HF's boolean mask (rows, 1, L, L):
    causal, with row r's first r % 7 * 3 columns padding (a padding query sees itself, as HF keeps it finite)."""
    g = torch.Generator(device=device).manual_seed(length)
    q, k, v = (torch.randn(rows, heads, length, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
               for _ in range(3))
    cols = torch.arange(length, device=device)
    start = torch.tensor([r % 7 * 3 for r in range(rows)], device=device)
    mask = (cols[None, :] <= cols[:, None])[None] & ((cols[None, None, :] >= start[:, None, None])
                                                     | torch.eye(length, dtype=torch.bool, device=device)[None])
    return q, k, v, mask[:, None]


def fwd_bwd(q, k, v, mask) -> None:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.float().square().mean().backward()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def run(args, device, dtype) -> dict:
    out = {}
    for i, (name, backends) in enumerate(BACKENDS.items()):
        # lengths no other backend has run: a backend that caches per shape starts cold
        lengths = [args.length + i + len(BACKENDS) * j for j in range(args.lengths)]
        rec = out[name] = {"lengths": lengths}
        try:
            with sdpa_kernel(backends) if backends else nullcontext():
                fwd_bwd(*batch(args.rows, args.heads, 64, args.head_dim, device, dtype))   # handles, kernel loads
                inputs = {n: batch(args.rows, args.heads, n, args.head_dim, device, dtype) for n in lengths}
                rec["first_ms"] = [round(timed(lambda: fwd_bwd(*inputs[n])), 3) for n in lengths]
                rec["again_ms"] = [round(timed(lambda: fwd_bwd(*inputs[n])), 3) for n in lengths]
                rec["first_median_ms"] = statistics.median(rec["first_ms"])
                rec["again_median_ms"] = statistics.median(rec["again_ms"])
        except Exception as e:   # a backend that cannot take this input says so
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        print(name, json.dumps(rec), flush=True)
    from torch.profiler import ProfilerActivity, profile
    q, k, v, mask = batch(args.rows, args.heads, args.length, args.head_dim, device, dtype)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd(q, k, v, mask)
        torch.cuda.synchronize()
    words = ("attention", "sdpa", "fmha", "flash", "cudnn")
    out["default_kernels"] = sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                                     and any(w in e.name.lower() for w in words)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--length", type=int, default=300, help="the shortest length; the others step by the number of backends")
    ap.add_argument("--lengths", type=int, default=6)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device")
        return 1
    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    res = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "args": vars(args), "results": run(args, device, dtype)}
    out = args.out or (os.path.join(os.environ["OUT"], "bench_attention.json") if os.environ.get("OUT") else None)
    if out:
        write_atomically(Path(out), json.dumps(res, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
