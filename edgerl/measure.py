"""Measured speed of this machine: matmul TFLOP/s per dtype, device memory and host<->device GB/s.

`measure()` takes a few seconds on a GPU; the result is cached per GPU UUID so that the planner can
read real numbers instead of the datasheet rows of hardware.md §10. Each number is the median of
warmed-up, repeated runs on random data, and each matmul's result is compared with a float64
reference on a slice, so a broken fp16 path is reported as wrong, not as fast.

Importing this module does not import torch; `measure()` does. Time comes from a `Clock`, which
tests replace with a fake one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from .embedded import cache_root

FORMAT_VERSION = 1   # bump when fields change meaning: older cache files are then ignored
MiB = 1024**2
STATUSES = ("ok", "emulated", "wrong", "failed", "skipped")
ITEMS = ("fp32_matmul", "fp16_matmul", "bf16_matmul", "memory_copy",
         "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")
# Largest max|C - ref| / rms(ref) a correct path gives, ref = float64 product of the same inputs.
# fp32 without TF32 stays near 1e-6; TF32 (10-bit mantissa) lands near 1e-3, so 1e-4 also catches
# TF32 left on. fp16 and bf16 outputs are rounded to 11 and 8 significant bits: at most ~1e-3 and
# ~8e-3 of the rms for entries up to 4 rms.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One measured number: TFLOP/s (1e12 flop/s) for a matmul, GB/s (1e9 bytes/s) for a copy."""
    value: Optional[float] = None      # None when not measured, failed, or the result was wrong
    status: str = "skipped"            # ok | emulated | wrong | failed | skipped
    note: str = ""                     # why it is missing, or what the number is exactly
    size: str = ""                     # the problem timed, e.g. "n=8192" or "512 MiB"
    seconds: Optional[float] = None    # median seconds of one call
    repeats: int = 0                   # timed calls behind the median

    @property
    def usable(self) -> Optional[float]:
        """`value` if the planner may rely on it: measured, checked, and not emulated."""
        return self.value if self.status == "ok" else None


@dataclass(frozen=True)
class Measurements:
    """What `measure()` found on one device, at one time, with one torch build."""
    kind: str                              # "cuda" or "cpu"
    name: str
    uuid: str                              # `normalize_uuid` form; "cpu-<hostname>" for the CPU
    cc: Optional[tuple[int, int]]
    torch: str
    cuda: Optional[str]                    # torch.version.cuda (the wheel's CUDA, which brings cuBLAS)
    date: str                              # ISO 8601, UTC
    fp32_matmul: Item = field(default_factory=Item)   # fp32 in and out, TF32 off
    fp16_matmul: Item = field(default_factory=Item)   # fp16 in and out, fp32 accumulate (cuBLAS)
    bf16_matmul: Item = field(default_factory=Item)   # status "emulated" below CC 8.0
    memory_copy: Item = field(default_factory=Item)   # device-to-device copy, bytes read + written
    h2d_pinned: Item = field(default_factory=Item)    # host to device, page-locked host buffer
    d2h_pinned: Item = field(default_factory=Item)
    h2d_pageable: Item = field(default_factory=Item)  # ordinary host memory, staged by the driver
    d2h_pageable: Item = field(default_factory=Item)
    budget_s: float = 0.0
    elapsed_s: float = 0.0                 # seconds measuring, after CUDA initialisation
    version: int = FORMAT_VERSION

    fp32_tflops = property(lambda self: self.fp32_matmul.usable)
    fp16_tflops = property(lambda self: self.fp16_matmul.usable)
    bf16_tflops = property(lambda self: self.bf16_matmul.usable)
    memory_gbs = property(lambda self: self.memory_copy.usable)
    h2d_gbs = property(lambda self: self.h2d_pinned.usable)
    d2h_gbs = property(lambda self: self.d2h_pinned.usable)

    def fp16_speedup(self) -> Optional[float]:
        """fp16-input, fp32-accumulate matmul TFLOP/s over strict fp32 (TF32 off) TFLOP/s.

        Well above 1 (P100 ~2 without tensor cores, V100/T4 ~8 with them): fp16 compute pays off for
        matmuls. About 1 or below (sm_61): fp16 is worth it as storage only. None if either is missing."""
        return _ratio(self.fp16_tflops, self.fp32_tflops)

    def bf16_speedup(self) -> Optional[float]:
        """Native bf16 matmul TFLOP/s over strict fp32; None if bf16 is emulated or either is missing."""
        return _ratio(self.bf16_tflops, self.fp32_tflops)

    def offload_seconds(self, nbytes: float, direction: str = "h2d") -> Optional[float]:
        """Predicted seconds to move `nbytes` between pinned host memory and the GPU at the measured
        rate: "h2d", "d2h", or "round_trip" (out and back). The rate is from 256 MiB copies; transfers
        of a few MiB or less also pay ~10 us latency each, not counted. None if not measured."""
        rates = {"h2d": [self.h2d_gbs], "d2h": [self.d2h_gbs], "round_trip": [self.h2d_gbs, self.d2h_gbs]}
        if direction not in rates:
            raise ValueError(f"direction={direction!r}: use h2d, d2h or round_trip")
        if any(r is None or r <= 0 for r in rates[direction]):
            return None
        return sum(nbytes / (r * 1e9) for r in rates[direction])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurements":
        """The inverse of `to_dict`; ValueError names what is wrong with `d`."""
        if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {d.get('version') if isinstance(d, dict) else None!r}, "
                             f"this edgerl reads version {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ValueError(f"fields missing {sorted(names - set(d))}, unknown {sorted(set(d) - names)}")
        kw = dict(d)
        for k in ITEMS:
            kw[k] = _item_from_dict(k, d[k])
        if d["cc"] is not None:
            kw["cc"] = tuple(int(x) for x in d["cc"])
        datetime.fromisoformat(d["date"])  # raises ValueError on a malformed date
        return cls(**kw)


def _item_from_dict(name: str, d: Any) -> Item:
    keys = {f.name for f in dataclasses.fields(Item)}
    if not isinstance(d, dict) or set(d) != keys or d["status"] not in STATUSES:
        raise ValueError(f"{name}: not an item ({d!r:.80})")
    for k in ("value", "seconds"):
        if d[k] is not None and not isinstance(d[k], (int, float)):
            raise ValueError(f"{name}.{k}: {d[k]!r} is not a number")
    return Item(**d)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# --- the cache: one JSON file per GPU --------------------------------------------------------------

def normalize_uuid(uuid: str) -> str:
    """One key for both spellings: NVML says 'GPU-58b3fdb6-...', torch's properties '58b3fdb6-...'."""
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def cache_path(uuid: str) -> Path:
    """$EDGERL_CACHE/bench/<uuid>.json (EDGERL_CACHE defaults to ~/.cache/edgerl)."""
    return cache_root() / "bench" / (re.sub(r"[^a-z0-9._-]", "_", normalize_uuid(uuid)) + ".json")


def save(m: Measurements) -> Path:
    """Write `m` to its cache file atomically: readers see the old file or the new one, never half."""
    path = cache_path(m.uuid)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(m.to_dict(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_cached(uuid: str, torch_version: Optional[str] = None,
                max_age_days: Optional[float] = None) -> tuple[Optional[Measurements], str]:
    """(measurements, "") from the cache; (None, note) when the file is unreadable or stale, the note
    saying why; (None, "") when there is no file. Stale: another format version, another torch than
    `torch_version` (cuBLAS comes with the torch wheel), or older than `max_age_days`."""
    path = cache_path(uuid)
    if not path.exists():
        return None, ""
    again = "; `edgerl doctor --bench` measures again"
    try:
        m = Measurements.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:  # json's decode error is a ValueError
        return None, f"ignored {path}: unreadable ({str(e)[:160]}){again}"
    when = datetime.fromisoformat(m.date)
    when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    age = (datetime.now(timezone.utc) - when).total_seconds() / 86400
    why = ""
    if normalize_uuid(m.uuid) != normalize_uuid(uuid):
        why = f"it holds GPU {m.uuid}"
    elif torch_version and m.torch != torch_version:
        why = f"measured with torch {m.torch}, this is torch {torch_version}"
    elif max_age_days is not None and age > max_age_days:
        why = f"measured {age:.0f} days ago (limit {max_age_days:g})"
    return (None, f"ignored {path}: {why}{again}") if why else (m, "")


def load_cached(uuid: str, torch_version: Optional[str] = None,
                max_age_days: Optional[float] = None) -> Optional[Measurements]:
    """`read_cached` that logs its note as a warning instead of returning it."""
    m, note = read_cached(uuid, torch_version, max_age_days)
    if note:
        log.warning(note)
    return m


# --- timing ---------------------------------------------------------------------------------------

class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock; the overall budget is counted with it."""
    def time(self, fn: Callable[[], Any], host: bool = False) -> float:
        """Run `fn` once and return the seconds it took: on the device, or with `host` as the host
        waits for it (host<->device copies, where the host's staging is part of the cost)."""


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
    """(median seconds of one call, timed calls). Untimed warmup first, at least one call and up to
    `warmup_s` (an idle GPU takes some milliseconds to raise its clocks); the last warmup call sizes
    the repeats to fit what is left of `budget_s`, clamped to [min_repeats, max_repeats]."""
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
    sizes = [n for n in r.sizes if 3 * n * n * elt <= r.mem_cap] or [None]
    if sizes[0] is None:
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
    notes = {"fp32": "TF32 off, float32 matmul precision 'highest'",
             "fp16": "fp16 inputs and output, fp32 accumulate (torch.matmul)", "bf16": ""}
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
def _strict_fp32(torch: Any):
    """True fp32 matmuls while timing fp32: Ampere+ would otherwise use TF32 where allowed."""
    old_tf32, old_prec = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old_prec)
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


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
                    uuid=normalize_uuid(str(getattr(p, "uuid", f"cuda{index}-{p.name}"))))
        r = _Run(torch, f"cuda:{index}", (p.major, p.minor), clock or CudaClock(torch), matmul, free // 4,
                 sizes or (1024, 2048, 4096, 8192), copy_bytes or 512 * MiB, transfer_bytes,
                 bool(getattr(p, "is_integrated", False)), int(getattr(p, "L2_cache_size", 0)))
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not every OS has these names
            avail = 4 << 30
        meta = dict(kind="cpu", name=_cpu_name(), cc=None, cuda=None, uuid="cpu-" + platform.node().lower())
        r = _Run(torch, "cpu", None, clock or HostClock(), matmul, avail // 4, sizes or (256, 512, 1024, 2048),
                 copy_bytes or 256 * MiB, transfer_bytes)
    r.matmul = matmul or (lambda a, b, out: torch.matmul(a, b, out=out))
    fp16_reduced = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction

    def fp32(share):
        with _strict_fp32(torch):
            return _matmul_item(r, "fp32", share)

    def fp16(share):
        if r.device == "cpu":
            return {"fp16_matmul": Item(note="CPU: edgerl never computes in fp16 on the CPU")}
        out = _matmul_item(r, "fp16", share)
        it = out["fp16_matmul"]
        if it.status == "ok" and fp16_reduced:
            out["fp16_matmul"] = dataclasses.replace(it, note=it.note + "; reduced-precision split-K allowed "
                                                     "(torch default)")
        return out

    steps: list[tuple[tuple[str, ...], Callable[[float], dict[str, Item]]]] = [
        (("fp32_matmul",), fp32), (("fp16_matmul",), fp16),
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


# --- reading it -----------------------------------------------------------------------------------

def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


LABELS = {"fp32_matmul": "fp32 matmul", "fp16_matmul": "fp16 (fp32 accumulate)", "bf16_matmul": "bf16",
          "memory_copy": "device memory", "h2d_pinned": "host to device", "d2h_pinned": "device to host",
          "h2d_pageable": "host to device (pageable)", "d2h_pageable": "device to host (pageable)"}


def summary(m: Measurements) -> list[str]:
    """Lines for people, e.g. 'fp32 matmul 51.2 TFLOP/s, fp16 (fp32 accumulate) 712 TFLOP/s, bf16 ...'."""
    def show(k: str, unit: str) -> str:
        it: Item = getattr(m, k)
        if it.status == "ok":
            return f"{LABELS[k]} {_num(it.value)} {unit}"
        if it.status == "emulated":
            return f"{LABELS[k]} {_num(it.value)} {unit} (emulated, not used)"
        return f"{LABELS[k]} {'WRONG RESULTS' if it.status == 'wrong' else it.status}"
    where = f"sm_{m.cc[0]}{m.cc[1]}" if m.cc else "CPU"
    lines = [f"{m.name} ({where}), torch {m.torch}" + (f", CUDA {m.cuda}" if m.cuda else "") +
             f", measured {m.date[:10]} in {m.elapsed_s:.1f} s",
             ", ".join(show(k, "TFLOP/s") for k in ITEMS[:3]),
             show("memory_copy", "GB/s") + " (copy: read + write)",
             ", ".join(show(k, "GB/s") for k in ITEMS[4:6]) + " (pinned)"]
    if m.h2d_pageable.status != "skipped" or m.d2h_pageable.status != "skipped":
        lines.append(", ".join(show(k, "GB/s") for k in ITEMS[6:]))
    lines += [f"  {LABELS[k]}: {getattr(m, k).note}" for k in ITEMS
              if getattr(m, k).status != "ok" and getattr(m, k).note]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgerl.measure", description="Measure matmul TFLOP/s and "
                                 "memory/PCIe GB/s on this GPU (or the CPU) and cache them per GPU UUID.")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON")
    ap.add_argument("--device", help="cuda, cuda:1 or cpu (default: the first GPU, else the CPU)")
    ap.add_argument("--budget", type=float, default=30.0, help="seconds for the whole run (default 30)")
    ap.add_argument("--pageable", action="store_true", help="also time pageable host<->device copies")
    ap.add_argument("--no-save", action="store_true", help=f"do not write {cache_root() / 'bench'}")
    args = ap.parse_args(argv)
    m = measure(args.device, budget_s=args.budget, pageable=args.pageable)
    if not args.no_save:
        print(f"saved {save(m)}", file=sys.stderr)
    print(json.dumps(m.to_dict(), indent=2) if args.json else "\n".join(summary(m)))
    return 1 if any(getattr(m, k).status == "wrong" for k in ITEMS) else 0


if __name__ == "__main__":
    sys.exit(main())
