"""The fused NF4 kernel per projection of a real shape, against bitsandbytes and the copy bound.

For each projection of a decoder layer (Llama-3.1-8B's and Qwen2.5-7B's widths; q/k/v and gate/up both fused, as
one weight, and apart, as a plan that calls peft's layers one by one runs them), a random weight quantized by
bitsandbytes (NF4, block 64, nested scales: what edgerl's `quantize_linear` makes) and `--rows` rows of x, each timed
in a CUDA graph of 50 calls:

- `tensor_cores_us`: `nf4_matmul` on tensor cores (`nf4_mma`, fp16 x from CC 7.5), and `..._lora_us` with a LoRA
  adapter of rank 16 inside the same launches;
- `fp32_kernel_us`: the same call with `mma=False` (the kernel a P40 runs, here on fp16 x);
- `bitsandbytes_us`: `bitsandbytes.matmul_4bit` (dequantize to fp16, then cuBLAS);
- `of_copy_bound`: the bytes the kernel must read (the 4-bit codes and their scales) over the copy bandwidth
  measured in the run, over the tensor-core kernel's time;
- `max_error`: the tensor-core kernel against `nf4.reference` with the code table in fp16, over the reference's
  largest value.

    python bench/bench_nf4_projections.py [--shapes llama8b,qwen7b] [--rows 16] [--out F]

Random weights; speed only (the kernel's agreement is checked in tests/test_nf4_kernel_cuda.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgerl.core.files import write_atomically  # noqa: E402

SHAPES = {   # hidden, heads, kv heads, head dim, intermediate
    "llama8b": (4096, 32, 8, 128, 14336),
    "qwen7b": (3584, 28, 4, 128, 18944),
}
RANK = 16


def projections(shape: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of a layer's products: the fused ones first, then those a plan of peft layers calls apart."""
    hidden, heads, kv, d, inter = SHAPES[shape]
    return [("q/k/v fused", (heads + 2 * kv) * d, hidden), ("o", hidden, heads * d),
            ("gate/up fused", 2 * inter, hidden), ("down", hidden, inter),
            ("q", heads * d, hidden), ("k or v", kv * d, hidden), ("gate or up", inter, hidden)]


def graph_us(fn, reps: int = 50) -> float:
    """GPU time of one call of `fn` in microseconds, from a CUDA graph of `reps` calls."""
    from bench_nf4_decode import graph_ms
    return 1e3 * graph_ms(fn, reps)


def weight_bytes(packed: torch.Tensor, state) -> int:
    """The bytes one product reads of the weight: its codes and its block scales (nested: the 8-bit scales and
    the fp32 scales of those)."""
    n = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
    if state.nested:
        n += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return n


def measure(name: str, n: int, k: int, rows: int, bandwidth: float, baselines: bool = True) -> dict:
    import bitsandbytes as bnb
    from edgerl.kernels import nf4
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    del w
    x = torch.randn(rows, k, device="cuda", generator=g).half()
    lora = (torch.randn(RANK, k, device="cuda", generator=g) / k ** 0.5,
            torch.randn(n, RANK, device="cuda", generator=g) / RANK ** 0.5, 2.0)
    rec: dict = {"projection": name, "n": n, "k": k, "rows": rows}
    nbytes = weight_bytes(packed, state)
    rec["weight_mb"] = round(nbytes / 1e6, 2)
    cc = torch.cuda.get_device_capability()
    if nf4.tensor_cores(torch.float16, cc):
        got = nf4.nf4_matmul(x, packed, state, mma=True).float()
        want = nf4.reference(x, packed, state, fp16_codes=True).float()
        rec["max_error"] = float(((got - want).abs().max() / want.abs().max()).item())
        rec["tensor_cores_us"] = round(graph_us(lambda: nf4.nf4_matmul(x, packed, state, mma=True)), 2)
        rec["tensor_cores_lora_us"] = round(graph_us(lambda: nf4.nf4_matmul(x, packed, state, lora=lora, mma=True)),
                                            2)
        if bandwidth:
            rec["of_copy_bound"] = round(1e6 * nbytes / bandwidth / rec["tensor_cores_us"], 4)
    if baselines:
        rec["fp32_kernel_us"] = round(graph_us(lambda: nf4.nf4_matmul(x, packed, state, mma=False)), 2)
        rec["bitsandbytes_us"] = round(graph_us(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state)), 2)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama8b,qwen7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--no-baselines", action="store_true", help="time only the tensor-core kernel")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        print(f"--shapes: unknown {', '.join(bad)}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_nf4_projections needs a CUDA GPU (the kernels and bitsandbytes run there)", file=sys.stderr)
        return 2
    from bench_rollout import measure_bandwidth   # a device-to-device copy's bytes per second
    bw = measure_bandwidth(torch.device("cuda"))
    result = {"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_tb_s": round(bw / 1e12, 3), "rows": []}
    for shape in shapes:
        for name, n, k in projections(shape):
            rec = measure(name, n, k, args.rows, bw, not args.no_baselines)
            rec["shape"] = shape
            result["rows"].append(rec)
            print(json.dumps(rec), flush=True)
    text = json.dumps(result, indent=1)
    if args.out:
        write_atomically(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
