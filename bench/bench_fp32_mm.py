"""The fp32 decode step's matmuls at a few rows: edgerl's few-row kernel (edgerl/kernels/fp32_mm.py) against cuBLAS.

An fp32 plan (a P40, P100 or GTX 10-series card) multiplies each decode step's rows by every weight of the model;
those products are most of the step's bytes. For each projection of a model's widths (q/k/v fused, o, gate/up
fused, down, and the LM head), at 16, 8 and 1 rows, this times `fp32_matmul` and `F.linear` (cuBLAS), each over as
many copies of the weight as the model has layers (so the GPU's L2 holds none of them), in a CUDA graph, and
reports microseconds per product, the weight's bytes over that time, and its share of the measured copy bandwidth.
Each product is also checked against float64 (its largest error over the largest |value|). `--sweep` times each
16-row product at every slice of K the kernel takes.

    python bench/bench_fp32_mm.py [--widths 1.5b] [--rows 16,8,1] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from edgerl.core.files import write_atomically  # noqa: E402

VOCAB = 49152   # SmolLM2's, as the step benchmarks use


def products(widths: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, {name: (N, K)}) for a benchlib shape."""
    from benchlib import SHAPES
    h, layers, heads, kv, inter = SHAPES[widths][:5]
    hd = h // heads
    return layers, {"qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h),
                    "down": (h, inter), "lm_head": (VOCAB, h)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="1.5b", help="a benchlib shape (default Qwen2.5-1.5B widths)")
    ap.add_argument("--rows", default="16,8,1")
    ap.add_argument("--sweep", action="store_true", help="every slice of K at 16 rows")
    ap.add_argument("--out", default=None, help="JSON output (default $OUT/bench_fp32_mm.json when OUT is set)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp32_mm needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchlib import SHAPES
    if args.widths not in SHAPES:
        ap.error(f"--widths: unknown shape {args.widths!r}; choose from {', '.join(SHAPES)}")
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        ap.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    from bench_decode_gemm import timed   # microseconds per product, replayed from a CUDA graph
    from bench_rollout import measure_bandwidth
    from edgerl.device.measure import strict_fp32
    from edgerl.kernels import fp32_mm
    if any(not 1 <= r <= fp32_mm.MAX_ROWS for r in rows_list):
        ap.error(f"--rows: each from 1 to {fp32_mm.MAX_ROWS}")
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    layers, prods = products(args.widths)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = args.out or (os.path.join(os.environ["OUT"], "bench_fp32_mm.json") if os.environ.get("OUT") else None)
    records = []
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e12:.2f} TB/s, {sms} SMs; {args.widths} widths, "
          f"{layers} copies of each weight", flush=True)
    with strict_fp32(torch):   # cuBLAS in IEEE fp32 (a P40 has no TF32), whatever a script allowed
        for name, (n, k) in prods.items():
            copies = 1 if name == "lm_head" else layers
            W = [torch.randn(n, k, device=dev, generator=g) * k ** -0.5 for _ in range(copies)]
            for rows in rows_list:
                x = torch.randn(rows, k, device=dev, generator=g)
                want = fp32_mm.reference(x, W[0])
                err = float((fp32_mm.fp32_matmul(x, W[0]).double() - want).abs().max() / want.abs().max())
                ks = fp32_mm.chosen_slice(n, k, rows, dev)
                t_k = timed(lambda: [fp32_mm.fp32_matmul(x, w) for w in W], copies)
                t_c = timed(lambda: [F.linear(x, w) for w in W], copies)
                nbytes = n * k * 4
                rec = {"product": name, "n": n, "k": k, "rows": rows, "ks": ks, "slices": -(-k // ks),
                       "kernel_us": round(t_k, 2), "cublas_us": round(t_c, 2),
                       "kernel_share": round(nbytes / (t_k * 1e-6) / bw, 3),
                       "cublas_share": round(nbytes / (t_c * 1e-6) / bw, 3), "rel_err": err}
                if args.sweep and rows == max(rows_list):
                    rec["sweep_us"] = {s: round(timed(lambda s=s: [fp32_mm.fp32_matmul(x, w, ks=s) for w in W],
                                                      copies), 2)
                                       for s in fp32_mm.slice_choices(k, rows)}
                records.append(rec)
                print(json.dumps(rec), flush=True)
            del W
            torch.cuda.empty_cache()
    total_k = sum(r["kernel_us"] * (1 if r["product"] == "lm_head" else layers) for r in records if r["rows"] == 16)
    total_c = sum(r["cublas_us"] * (1 if r["product"] == "lm_head" else layers) for r in records if r["rows"] == 16)
    summary = {"device": torch.cuda.get_device_name(dev), "bandwidth_bytes_s": bw, "widths": args.widths,
               "step_matmuls_16_rows_us": {"kernel": round(total_k, 1), "cublas": round(total_c, 1)}}
    print(json.dumps(summary))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(out), json.dumps({**summary, "records": records}, indent=1))
    bad = [r for r in records if not r["rel_err"] < 1e-5]
    if bad:
        print(f"kernel disagrees with float64: {[(r['product'], r['rows'], r['rel_err']) for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
