"""Benchmark token log-probs + entropy, forward + backward: naive, torch chunked, Triton, Liger.

On the GPU (H200), from the repository root:
    python bench/bench_logprobs.py --out $OUT/bench_logprobs.json
(all 8 shapes x 6 variants; expected a few minutes, most of it the fp32 rows, whose "highest"
precision runs the GEMMs without tensor cores. To stay well inside a 10-minute command, run
`--dtypes bf16 --out $OUT/bench_bf16.json` and `--dtypes fp32 --out $OUT/bench_fp32.json` apart.)
Liger is not on the H200 image: carry its pure-Python wheel (pip download --no-deps liger-kernel)
and install it first, or its rows say "not run". The exit status is 1 if any variant failed its
float64 check or raised. End-to-end check on a CPU, tiny sizes, torch paths only:
    python bench/bench_logprobs.py --smoke

Loss backpropagated: sum(a * logp) + sum(b * entropy) with random per-token a, b (an entropy bonus
sends both gradients). Liger gives -logp only (LigerFusedLinearCrossEntropyLoss(reduction="none")),
so it is compared with "triton-logp" (compute_entropy=False) as well as with the full "triton".
Time: median of --iters forward+backward runs after --warmup, CUDA events. Memory: peak of
torch.cuda.max_memory_allocated during one forward+backward minus what was allocated before (the
inputs), so gradients count. Before timing, every variant is checked on --check-tokens tokens
against a float64 reference, with torch.empty poisoned to NaN so that unwritten output shows.

Expected peak extra memory (N tokens, V vocabulary, H hidden, e bytes per input element):
- naive: logits N*V*e, their fp32 copy, log-softmax and its exp kept for the backward, then as
  many again in the backward: about 16-20 N*V bytes (N=8192, V=151936: ~20-25 GB).
- torch chunked: chunk*V*8 (chunk from a 256 MiB budget; a 16-bit W is upcast a vocabulary tile at a time
  within it) + an fp32 copy of h for 16-bit inputs (N*H*4) + fp32 gradient sums + gradients (until
  2026-12-05 it also held a whole fp32 copy of a 16-bit W, V*H*4: the figures in docs/benchmarks.md
  predate that).
- triton: forward O(N); backward one grad-logits slab (256 MiB) + fp32 grad_h sum N*H*4 + one
  N*H*e partial + gradients N*H*e + V*H*e: ~0.4-1 GB, i.e. 1/20 or less of naive at V=151936.
- liger (0.8.5, reduction="none"): recomputes in the backward like us, with chunks of
  next_pow2(N / ceil(V/H)) tokens (64 at V=151936, H=896): chunk*V*(e+4) + grad_input + grad_weight
  in the input dtype: close to triton's, a little under it. Its grad_weight is summed in the
  input dtype over N/chunk chunks, each a GEMM with K=chunk that reads and writes all of V x H.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.core.files import write_atomically  # noqa: E402

try:
    from edgerl.kernels import choose_tiles, make_tiles, naive_logprobs_and_entropy, token_logprobs_and_entropy
except ImportError:  # a checkout that is not pip-installed (the GPU machine): load edgerl/kernels/ by path
    import importlib.util
    _dir = Path(__file__).resolve().parents[1] / "edgerl" / "kernels"
    _spec = importlib.util.spec_from_file_location("edgerl_kernels", _dir / "__init__.py",
                                                   submodule_search_locations=[str(_dir)])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["edgerl_kernels"] = _mod
    _spec.loader.exec_module(_mod)
    choose_tiles, make_tiles = _mod.choose_tiles, _mod.make_tiles
    naive_logprobs_and_entropy, token_logprobs_and_entropy = _mod.naive_logprobs_and_entropy, _mod.token_logprobs_and_entropy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# correctness bounds for ||out - ref|| / ||ref|| against float64 (outputs and both gradients)
TOL = {"bf16": 1e-2, "fp16": 5e-3, "fp32": 1e-4, "tf32": 3e-3}


def liger_loss_cls():
    """The Liger loss class, or a string saying why it is not available."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        return LigerFusedLinearCrossEntropyLoss
    except ImportError as e:  # not installed, or fails to import on this setup: the row says why
        return f"liger-kernel does not import ({e})"


def make_variants(args, dtype_name: str, hidden: int, vocab: int, on_cuda: bool):
    """name -> (fn(h, w, t) -> (logp, entropy or None), or None with the reason it is not run)."""
    v = {"naive": lambda h, w, t: naive_logprobs_and_entropy(h, w, t),
         "torch": lambda h, w, t: token_logprobs_and_entropy(h, w, t, backend="torch", chunk=args.chunk)}
    tiles = None
    if args.tiles:
        bn, bv, bk, warps, stages = map(int, args.tiles.split(","))
        tiles = make_tiles(bn, bv, bk, dtype_name, num_warps=warps, num_stages=stages)
    if on_cuda:
        v["triton"] = lambda h, w, t: token_logprobs_and_entropy(h, w, t, backend="triton", chunk=args.chunk,
                                                                 tiles=tiles)
        t48 = choose_tiles(49152, dtype_name, hidden, vocab)
        v["triton-48KB"] = lambda h, w, t: token_logprobs_and_entropy(h, w, t, backend="triton", chunk=args.chunk,
                                                                      tiles=t48)
        v["triton-logp"] = lambda h, w, t: token_logprobs_and_entropy(h, w, t, backend="triton", chunk=args.chunk,
                                                                      tiles=tiles, compute_entropy=False)
    else:
        for name in ("triton", "triton-48KB", "triton-logp"):
            v[name] = "needs CUDA"
    cls = liger_loss_cls()
    if isinstance(cls, str):
        v["liger"] = cls
    elif not on_cuda:
        v["liger"] = "Liger runs on CUDA only"
    else:
        loss = cls(reduction="none")
        v["liger"] = lambda h, w, t: (-loss(w, h, t), None)
    return v


def loss_of(logp, ent, a, b):
    out = (logp * a).sum()
    return out if ent is None else out + (ent * b).sum()


def check(fn, h, w, t, a, b, tol):
    """Max relative error of logp, entropy, grad_h, grad_w against float64; NaN-poisoned torch.empty."""
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    torch.empty = poisoned
    try:
        glp, gent = fn(hh, ww, t)
        loss_of(glp, gent, a, b).backward()
    finally:
        torch.empty = empty
    # the reference loss has an entropy term only where the variant returns entropy (logp-only rows do not)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp, ent = naive_logprobs_and_entropy(hd, wd, t, dtype=torch.float64)
    loss_of(lp, ent if gent is not None else None, a.double(), b.double()).backward()
    pairs = [(glp, lp), (hh.grad, hd.grad), (ww.grad, wd.grad)] + ([] if gent is None else [(gent, ent)])
    errs = []
    for got, ref in pairs:
        if got is None or not torch.isfinite(got).all():
            return float("inf")
        errs.append(((got.double() - ref).norm() / ref.norm()).item())
    return max(errs)


def measure(fn, h, w, t, a, b, args, on_cuda):
    """(median ms, peak extra bytes or None) of forward + backward."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()

    def step():
        h.grad = w.grad = None
        lp, ent = fn(h, w, t)
        loss_of(lp, ent, a, b).backward()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = None
    if on_cuda:
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        h.grad = w.grad = None
    return statistics.median(times), peak


def run(args):
    on_cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if on_cuda else "cpu")
    torch.set_float32_matmul_precision(args.fp32_precision)
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        tol = TOL["tf32" if dtype_name == "fp32" and args.fp32_precision != "highest" else dtype_name]
        for hidden in args.hidden:
            for vocab in args.vocab:
                g = torch.Generator(device=device).manual_seed(hidden * 7 + vocab)
                n = args.tokens
                h = torch.randn(n, hidden, device=device, generator=g).to(dtype)
                w = (torch.randn(vocab, hidden, device=device, generator=g) / hidden ** 0.5).to(dtype)
                t = torch.randint(0, vocab, (n,), device=device, generator=g)
                a = torch.randn(n, device=device, generator=g)
                b = torch.randn(n, device=device, generator=g)
                nc = min(n, args.check_tokens)
                for name, fn in make_variants(args, dtype_name, hidden, vocab, on_cuda).items():
                    if args.variants and name not in args.variants:
                        continue
                    row = dict(dtype=dtype_name, hidden=hidden, vocab=vocab, tokens=n, variant=name)
                    if isinstance(fn, str):
                        rows.append(dict(row, status="not run", reason=fn))
                        continue
                    try:
                        err = check(fn, h[:nc], w, t[:nc], a[:nc], b[:nc], tol)
                        ms, peak = measure(fn, h, w, t, a, b, args, on_cuda)
                        rows.append(dict(row, status="ok" if err < tol else "WRONG", ms=ms, peak_extra_bytes=peak,
                                         max_rel_err=err, tol=tol))
                    except torch.cuda.OutOfMemoryError as e:
                        rows.append(dict(row, status="oom", reason=str(e).splitlines()[0]))
                    except Exception as e:  # keep the other rows; the table and JSON say what broke
                        rows.append(dict(row, status="error", reason=f"{type(e).__name__}: {str(e)[:300]}"))
                    if on_cuda:
                        torch.cuda.empty_cache()
                    print(f"{dtype_name} H={hidden} V={vocab} {name}: {rows[-1].get('status')} "
                          f"{rows[-1].get('ms', float('nan')):.2f} ms", file=sys.stderr, flush=True)
                del h, w, t, a, b
    return rows


def ratio(x, y):
    return None if x is None or y is None or y == 0 else x / y


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows):
    base = {(r["dtype"], r["hidden"], r["vocab"], r["variant"]): r for r in rows}
    lines = ["| dtype | H | V | variant | status | ms | peak extra MiB | time/naive | mem/naive | time/liger | "
             "mem/liger | max rel err |", "|" + "---|" * 12]
    for r in rows:
        key = (r["dtype"], r["hidden"], r["vocab"])
        naive, liger = base.get(key + ("naive",), {}), base.get(key + ("liger",), {})
        mib = None if r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / 2**20
        lines.append("| " + " | ".join([
            r["dtype"], str(r["hidden"]), str(r["vocab"]), r["variant"],
            r["status"] if "reason" not in r else f"{r['status']}: {r['reason'][:80]}", fmt(r.get("ms"), ".2f"), fmt(mib, ".0f"),
            fmt(ratio(r.get("ms"), naive.get("ms")), ".2f"),
            fmt(ratio(r.get("peak_extra_bytes"), naive.get("peak_extra_bytes")), ".3f"),
            fmt(ratio(r.get("ms"), liger.get("ms")), ".2f"),
            fmt(ratio(r.get("peak_extra_bytes"), liger.get("peak_extra_bytes")), ".2f"),
            fmt(r.get("max_rel_err"), ".1e")]) + " |")
    return "\n".join(lines)


def targets(rows):
    """The issue's targets, checked on the rows that ran (informative, not an exit status)."""
    base = {(r["dtype"], r["hidden"], r["vocab"], r["variant"]): r for r in rows}
    out = []
    for (dt, hid, voc, var), r in base.items():
        if var != "triton" or r.get("ms") is None:
            continue
        naive, liger = base.get((dt, hid, voc, "naive"), {}), base.get((dt, hid, voc, "liger"), {})
        logp_only = base.get((dt, hid, voc, "triton-logp"), {})
        checks = [("time <= naive", ratio(r["ms"], naive.get("ms")), 1.0)]
        if voc >= 151936:
            checks.append(("mem <= naive/8", ratio(r.get("peak_extra_bytes"), naive.get("peak_extra_bytes")), 0.125))
        checks += [("logp-only time <= liger", ratio(logp_only.get("ms"), liger.get("ms")), 1.0),
                   ("logp-only mem <= liger", ratio(logp_only.get("peak_extra_bytes"), liger.get("peak_extra_bytes")), 1.0)]
        for name, value, limit in checks:
            verdict = "n/a" if value is None else ("PASS" if value <= limit else "MISS")
            out.append(f"{dt} H={hid} V={voc} {name}: {verdict} ({fmt(value, '.3f')})")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, torch paths only")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/bench_logprobs.json when OUT is set)")
    p.add_argument("--tokens", type=int, default=16 * 512)
    p.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[896, 2048])
    p.add_argument("--vocab", type=lambda s: [int(x) for x in s.split(",")], default=[49152, 151936])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp32"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", type=lambda s: s.split(","), default=None,
                   help="only these, e.g. naive,triton,liger (default: all)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: choose_chunk, 256 MiB)")
    p.add_argument("--tiles", default=None, help="force Triton tiles BLOCK_N,BLOCK_V,BLOCK_K,WARPS,STAGES")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens in the float64 correctness check")
    p.add_argument("--fp32-precision", default="highest", choices=["highest", "high"],
                   help="torch.set_float32_matmul_precision for every variant ('high' = tf32)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.iters, args.warmup = 64, [32, 48], [300, 1000], 3, 1
        args.check_tokens = 64
    rows = run(args)
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
                torch=torch.__version__, fp32_precision=args.fp32_precision, tiles=args.tiles, chunk=args.chunk,
                iters=args.iters, warmup=args.warmup)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    try:
        from importlib.metadata import version
        meta["liger_kernel"] = version("liger-kernel")
    except Exception:
        meta["liger_kernel"] = None
    print(f"\n{meta}\n")
    print(table(rows))
    print()
    print(targets(rows))
    out = args.out or (os.path.join(os.environ["OUT"], "bench_logprobs.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(out), json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"\nwrote {out}")
    return 1 if any(r["status"] in ("WRONG", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
