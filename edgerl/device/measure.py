"""Measure this machine: matmul TFLOP/s per dtype, device memory and host<->device GB/s.

`measure()` takes a few seconds on a GPU; `save()` caches the result per GPU UUID so that the planner
can read real numbers instead of the datasheet rows of docs/hardware.md, Datasheet rates. Each number is the median of
warmed-up, repeated runs on random data, and each matmul's result is compared with a float64
reference on a slice, so a broken fp16 path is reported as wrong, not as fast.

Importing this module does not import torch; `measure()` does. Time comes from a `Clock`, which
tests replace with a fake one. `python -m edgerl.device.measure --json` measures and prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from edgerl.core.files import cache_root
from edgerl.device.measured import (ITEMS, Item, Measurements, cache_path, load_cached,  # noqa: F401
                           normalize_uuid, read_cached, save, summary)

MiB = 1024**2
# Largest max|C - ref| / rms(ref) a correct path gives, ref = float64 product of the same inputs,
# on 16 x 16 entries. Seen on the CPU for n = 64..8192: fp32 ~1e-6, fp32 with TF32 inputs ~1e-3 (so
# TF32 left on fails), fp16 in/out with fp32 accumulate ~9e-4, bf16 ~7e-3; a plain fp16-accumulated
# sum reaches 2e-2..5e-2 at n >= 1024 and fails too.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}


# --- timing ---------------------------------------------------------------------------------------

class Clock(Protocol):
    """`now()`: seconds on a monotonic clock, for the overall budget. `time(fn, host)`: run `fn` once
    and return the seconds it took on the device, or with `host` as the host waits for it (host<->
    device copies, where the driver's staging on the host is part of the cost)."""
    def now(self) -> float: ...
    def time(self, fn: Callable[[], Any], host: bool = False) -> float: ...


class HostClock:
    """perf_counter around a synchronized call; on the CPU `sync` does nothing."""
    def __init__(self, sync: Callable[[], Any] = lambda: None):
        self.sync = sync

    def now(self) -> float:
        return time.perf_counter()

    def time(self, fn: Callable[[], Any], host: bool = False) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t


class CudaClock(HostClock):
    """CUDA events time device work on the GPU's own clock, without host launch and sync overhead."""
    def __init__(self, torch: Any):
        super().__init__(torch.cuda.synchronize)
        self.torch = torch

    def time(self, fn: Callable[[], Any], host: bool = False) -> float:
        if host:
            return super().time(fn)
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def time_call(clock: Clock, fn: Callable[[], Any], budget_s: float, host: bool = False, warmup_s: float = 0.1,
              min_repeats: int = 3, max_repeats: int = 30) -> tuple[float, int]:
    """(median seconds of one call, number of calls behind it). Warmup calls come first and are not
    counted: at least one, and more until `warmup_s` is spent (an idle GPU takes some milliseconds to
    raise its clocks). The last of them sizes the repeats to fit what is left of `budget_s`, clamped
    to [min_repeats, max_repeats]."""
    est, spent, calls = 0.0, 0.0, 0
    while calls < 1 or (spent < warmup_s and calls < 50):
        est = clock.time(fn, host)
        spent, calls = spent + est, calls + 1
    repeats = max(min_repeats, min(max_repeats, int((budget_s - spent) / max(est, 1e-9))))
    return statistics.median(clock.time(fn, host) for _ in range(repeats)), repeats


# --- the items ------------------------------------------------------------------------------------

@dataclass
class _Run:
    torch: Any
    device: str                  # "cpu" or "cuda:N"
    cc: Optional[tuple[int, int]]
    clock: Clock
    matmul: Callable[[Any, Any, Any], Any]
    mem_cap: int                 # bytes one item may allocate on the device
    sizes: tuple[int, ...]
    copy_bytes: int
    transfer_bytes: int
    integrated: bool = False
    l2_bytes: int = 0


def _matmul_item(r: _Run, dt: str, budget_s: float) -> dict[str, Item]:
    torch = r.torch
    dtype, elt = {"fp32": (torch.float32, 4), "fp16": (torch.float16, 2), "bf16": (torch.bfloat16, 2)}[dt]
    sizes = [n for n in r.sizes if 3 * n * n * elt <= r.mem_cap]
    if not sizes:
        return {f"{dt}_matmul": Item(note=f"n={r.sizes[0]} does not fit in {r.mem_cap / MiB:.0f} MiB")}
    start, gen = r.clock.now(), torch.Generator(device=r.device).manual_seed(0)
    for n in sizes:
        a, b = (torch.randn(n, n, dtype=dtype, device=r.device, generator=gen) for _ in range(2))
        c = torch.empty(n, n, dtype=dtype, device=r.device)
        run = lambda: r.matmul(a, b, c)  # noqa: E731
        run()  # first call: cuBLAS handle and heuristics, clocks ramping up
        one = r.clock.time(run)
        # Larger matrices use the GPU better; stop growing when the next size (8x the work, timed
        # about 6 times with its warmup and minimum repeats) would not fit in what is left.
        if one * 8 * 6 > budget_s - (r.clock.now() - start):
            break
    sec, reps = time_call(r.clock, run, budget_s - (r.clock.now() - start))
    tflops = 2 * n**3 / sec / 1e12
    # float64 reference on the CPU (independent of the path timed) for k rows x k columns spread over
    # the whole matrix, first and last included, so that every band of output tiles is sampled.
    idx = torch.linspace(0, n - 1, min(16, n), device=r.device).long()
    ref = a.index_select(0, idx).cpu().double() @ b.index_select(1, idx).cpu().double()
    got = c.index_select(0, idx).index_select(1, idx).cpu().double()
    rms = ref.pow(2).mean().sqrt().item()
    err = (got - ref).abs().max().item() / rms if rms > 0 else math.inf
    base = dict(size=f"n={n}", seconds=sec, repeats=reps)
    if not math.isfinite(err) or err > TOLERANCE[dt]:
        return {f"{dt}_matmul": Item(status="wrong", **base, note=(
            f"result off by {err:.2g} x rms (a correct {dt} path stays under {TOLERANCE[dt]:g}); "
            f"its {tflops:.3g} TFLOP/s is not counted"))}
    split_k = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction  # torch's default: True
    notes = {"fp32": "IEEE fp32, TF32 off", "bf16": "", "fp16": "fp16 inputs and output, fp32 accumulate"
             + ("; reduced-precision split-K allowed" if split_k else "")}
    if dt == "bf16" and r.cc is not None and r.cc < (8, 0):
        return {"bf16_matmul": Item(tflops, "emulated", f"sm_{r.cc[0]}{r.cc[1]}: no bf16 hardware below "
                                    "CC 8.0; emulated speed, never chosen", **base)}
    return {f"{dt}_matmul": Item(tflops, "ok", notes[dt], **base)}


def _copy_item(r: _Run, budget_s: float) -> dict[str, Item]:
    torch = r.torch
    nbytes = min(r.copy_bytes, r.mem_cap // 2) // MiB * MiB
    src = torch.randn(nbytes // 4, device=r.device)
    dst = torch.empty_like(src)
    sec, reps = time_call(r.clock, lambda: dst.copy_(src), budget_s)
    note = "device-to-device copy, bytes read + written"
    if r.l2_bytes and nbytes < 4 * r.l2_bytes:  # a buffer near the L2 size measures the cache, not DRAM
        note += f"; buffer only {nbytes / r.l2_bytes:.1f}x the L2 cache, may overstate DRAM bandwidth"
    return {"memory_copy": Item(2 * nbytes / sec / 1e9, "ok", note, f"{nbytes / MiB:.0f} MiB", sec, reps)}


def _transfer_items(r: _Run, pinned: bool, budget_s: float) -> dict[str, Item]:
    torch, kind = r.torch, "pinned" if pinned else "pageable"
    if not r.device.startswith("cuda"):
        return {f"{d}_{kind}": Item(note="no CUDA device: host-device copies not measured") for d in ("h2d", "d2h")}
    nbytes = min(r.transfer_bytes, r.mem_cap // 2) // MiB * MiB
    dev = torch.randn(nbytes // 4, device=r.device)
    host = torch.empty(nbytes // 4, pin_memory=pinned)
    host.copy_(dev)  # random host data without a slow CPU random generator
    note = ("page-locked host memory" if pinned else "pageable host memory, staged by the driver")
    if r.integrated:
        note += "; integrated GPU: host and device share DRAM, no PCIe link"
    out = {}
    for d, run in (("h2d", lambda: dev.copy_(host, non_blocking=pinned)),
                   ("d2h", lambda: host.copy_(dev, non_blocking=pinned))):
        sec, reps = time_call(r.clock, run, budget_s / 2, host=True)
        out[f"{d}_{kind}"] = Item(nbytes / sec / 1e9, "ok", note, f"{nbytes / MiB:.0f} MiB", sec, reps)
    return out


@contextlib.contextmanager
def strict_fp32(torch: Any):
    """IEEE fp32 matmuls while timing fp32: Ampere and newer use TF32 where allowed, and oneDNN may use
    bf16 on a CPU. torch >= 2.9 keeps a `fp32_precision` per backend, and reading the legacy flags
    after it was set raises; so set it where it exists, else the legacy pair, and restore exactly."""
    mkldnn = getattr(torch.backends, "mkldnn", None)
    mods = [m for m in (torch.backends.cuda.matmul, getattr(mkldnn, "matmul", None))
            if m is not None and hasattr(m, "fp32_precision")]
    old = [m.fp32_precision for m in mods] or torch.get_float32_matmul_precision()
    for m in mods:
        m.fp32_precision = "ieee"
    if not mods:  # torch < 2.9: allow_tf32 only mirrors the one global precision, restored with it
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        for m, v in zip(mods, old):
            m.fp32_precision = v
        if not mods:
            torch.set_float32_matmul_precision(old)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def device_uuid(device: Optional[str] = None) -> str:
    """The cache key of `device` ("cuda:N" or "cpu"; default: the first GPU, else the CPU), in
    `normalize_uuid` form, so it equals `normalize_uuid` of NVML's "GPU-..." UUID for the same GPU."""
    import torch
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return "cpu-" + platform.node().lower()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    return normalize_uuid(str(getattr(p, "uuid", "")) or f"{p.name}-cuda{index}")


def cached_or_measured(device: Optional[str] = None, refresh: bool = False, max_age_days: Optional[float] = None,
                       **measure_kw: Any) -> tuple[Measurements, str]:
    """(measurements, where they came from) for `edgerl doctor --bench`: the cache file when it is
    fresh for this GPU and this torch, else a new `measure()`, saved. `refresh` always measures."""
    import torch
    if not refresh:
        m, note = read_cached(device_uuid(device), torch.__version__, max_age_days)
        if m is not None:
            return m, f"cached in {cache_path(m.uuid)}"
    m = measure(device, **measure_kw)
    return m, (f"{note}; " if not refresh and note else "") + f"measured now, saved to {save(m)}"


def measure(device: Optional[str] = None, budget_s: float = 30.0, item_s: float = 3.0, pageable: bool = False,
            sizes: Optional[tuple[int, ...]] = None, copy_bytes: Optional[int] = None,
            transfer_bytes: int = 256 * MiB, clock: Optional[Clock] = None,
            matmul: Optional[Callable[[Any, Any, Any], Any]] = None, date: Optional[str] = None) -> Measurements:
    """Measure `device` ("cuda", "cuda:1", "cpu"; default: the first GPU, else the CPU).

    Each item gets at most `item_s` seconds and a fair share of what is left of `budget_s`; items
    the budget does not reach are skipped with a note. `sizes` are the square matmul sizes tried
    in order (default 1024..8192 on a GPU, 256..2048 on the CPU); buffers shrink to a quarter of
    the free device memory. `clock` and `matmul(a, b, out)` exist so that tests can replace them."""
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"measure({device!r}): this torch build sees no CUDA device; use device='cpu'")
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(index)
        free, _ = torch.cuda.mem_get_info(index)
        meta = dict(kind="cuda", name=p.name, cc=(p.major, p.minor), cuda=torch.version.cuda,
                    uuid=device_uuid(f"cuda:{index}"))
        r = _Run(torch, f"cuda:{index}", (p.major, p.minor), clock or CudaClock(torch), matmul, free // 4,
                 sizes or (1024, 2048, 4096, 8192), copy_bytes or 512 * MiB, transfer_bytes,
                 bool(getattr(p, "is_integrated", False)), int(getattr(p, "L2_cache_size", 0)))
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not every OS has these names
            avail = 4 << 30
        meta = dict(kind="cpu", name=_cpu_name(), cc=None, cuda=None, uuid=device_uuid("cpu"))
        r = _Run(torch, "cpu", None, clock or HostClock(), matmul, avail // 4, sizes or (256, 512, 1024, 2048),
                 copy_bytes or 256 * MiB, transfer_bytes)
    r.matmul = matmul or (lambda a, b, out: torch.matmul(a, b, out=out))

    def fp32(share: float) -> dict[str, Item]:
        with strict_fp32(torch):
            return _matmul_item(r, "fp32", share)

    steps: list[tuple[tuple[str, ...], Callable[[float], dict[str, Item]]]] = [
        (("fp32_matmul",), fp32),
        (("fp16_matmul",), lambda s: {"fp16_matmul": Item(note="CPU: edgerl never computes in fp16 on the CPU")}
         if r.device == "cpu" else _matmul_item(r, "fp16", s)),
        (("bf16_matmul",), lambda s: _matmul_item(r, "bf16", s)),
        (("memory_copy",), lambda s: _copy_item(r, s)),
        (("h2d_pinned", "d2h_pinned"), lambda s: _transfer_items(r, True, s))]
    if pageable:
        steps.append((("h2d_pageable", "d2h_pageable"), lambda s: _transfer_items(r, False, s)))
    items = {k: Item(note="not asked for (pageable=False)") for k in ("h2d_pageable", "d2h_pageable")}
    start = r.clock.now()
    with torch.cuda.device(r.device) if r.device != "cpu" else contextlib.nullcontext():
        _run_steps(r, steps, items, budget_s, item_s, start)
    return Measurements(**meta, torch=torch.__version__, **items, budget_s=budget_s,
                        elapsed_s=round(r.clock.now() - start, 3),
                        date=date or datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _run_steps(r: _Run, steps: list, items: dict[str, Item], budget_s: float, item_s: float, start: float) -> None:
    torch = r.torch
    for i, (names, step) in enumerate(steps):
        left = budget_s - (r.clock.now() - start)
        if left <= 0:
            items.update({k: Item(note=f"time budget of {budget_s:g} s spent") for k in names})
            continue
        try:
            items.update(step(min(item_s * len(names), left / (len(steps) - i))))
        except Exception as e:  # no kernel image, out of memory, no pinned memory: say so, go on
            first = (str(e).splitlines() or [""])[0][:200]
            items.update({k: Item(status="failed", note=f"{type(e).__name__}: {first}") for k in names})
        finally:
            if r.device != "cpu":  # give the buffers back: the caller goes on to train. A sticky CUDA
                with contextlib.suppress(RuntimeError):  # error raises here again; it is noted above
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgerl.device.measure", description="Measure matmul TFLOP/s and "
                                 "memory/PCIe GB/s on this GPU (or the CPU) and cache them per GPU UUID.")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON")
    ap.add_argument("--device", help="cuda, cuda:1 or cpu (default: the first GPU, else the CPU)")
    ap.add_argument("--budget", type=float, default=30.0, help="seconds for the whole run (default 30)")
    ap.add_argument("--pageable", action="store_true", help="also time pageable host<->device copies")
    ap.add_argument("--no-save", action="store_true", help=f"do not write {cache_root() / 'bench'}")
    ap.add_argument("--cached", action="store_true", help="print the cached result if it is fresh, else measure")
    args = ap.parse_args(argv)
    if args.cached:
        m, where = cached_or_measured(args.device, budget_s=args.budget, pageable=args.pageable)
        print(where, file=sys.stderr)
    else:
        m = measure(args.device, budget_s=args.budget, pageable=args.pageable)
        if not args.no_save:
            print(f"saved {save(m)}", file=sys.stderr)
    print(json.dumps(m.to_dict(), indent=2) if args.json else "\n".join(summary(m)))
    return 1 if any(getattr(m, k).status == "wrong" for k in ITEMS) else 0


if __name__ == "__main__":
    sys.exit(main())
