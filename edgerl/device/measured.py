"""Measured speed of one device, as data: `Measurements`, its JSON cache file, and what the planner
can read from it (speedups, offload seconds, a summary for people).

Pure: no torch, no hardware. `edgerl.device.measure` produces these; the planner and `Device` only read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from edgerl.core.files import cache_root

FORMAT_VERSION = 1   # bump when fields change meaning: older cache files are then ignored
STATUSES = ("ok", "emulated", "wrong", "failed", "skipped")
ITEMS = ("fp32_matmul", "fp16_matmul", "bf16_matmul", "memory_copy",
         "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")
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

    # The numbers the planner may use: None unless measured, checked and native (status "ok").
    fp32_tflops = property(lambda self: self.fp32_matmul.usable)
    fp16_tflops = property(lambda self: self.fp16_matmul.usable)
    bf16_tflops = property(lambda self: self.bf16_matmul.usable)
    memory_gbs = property(lambda self: self.memory_copy.usable)
    h2d_gbs = property(lambda self: self.h2d_pinned.usable)
    d2h_gbs = property(lambda self: self.d2h_pinned.usable)

    def fp16_speedup(self) -> Optional[float]:
        """fp16-input, fp32-accumulate matmul TFLOP/s over strict fp32 (TF32 off) TFLOP/s; None if
        either is missing. Well above 1 (datasheets: P100 2, V100/T4 ~8 with tensor cores), fp16
        compute pays off for matmuls; about 1 or below, fp16 is worth it as storage only. sm_61 is
        the case to measure: its fp16 arithmetic is 1/64 rate, but torch's cuBLAS call computes in
        fp32 (docs/hardware.md, fp16 on Pascal), and no datasheet says which one a real P40 runs at."""
        return _ratio(self.fp16_tflops, self.fp32_tflops)

    def bf16_speedup(self) -> Optional[float]:
        """Native bf16 matmul TFLOP/s over strict fp32; None if bf16 is emulated or either is missing."""
        return _ratio(self.bf16_tflops, self.fp32_tflops)

    def offload_seconds(self, nbytes: float, direction: str = "h2d") -> Optional[float]:
        """Predicted seconds to move `nbytes` between pinned host memory and the GPU at the measured
        rate: "h2d", "d2h", or "round_trip" (out and back). The rate comes from one large copy (256 MiB
        unless the card was short of memory); transfers of a few MiB or less also pay a fixed latency
        each, which this leaves out. None if not measured."""
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
            if not isinstance(d["cc"], list) or len(d["cc"]) != 2:
                raise ValueError(f"cc: {d['cc']!r} is not [major, minor]")
            kw["cc"] = (int(d["cc"][0]), int(d["cc"][1]))
        datetime.fromisoformat(d["date"])  # raises ValueError on a malformed date
        return cls(**kw)


def _item_from_dict(name: str, d: Any) -> Item:
    keys = {f.name for f in dataclasses.fields(Item)}
    if not isinstance(d, dict) or set(d) != keys or d["status"] not in STATUSES:
        raise ValueError(f"{name}: not an item ({d!r:.80})")
    for k in ("value", "seconds"):
        if d[k] is not None and not isinstance(d[k], (int, float)):
            raise ValueError(f"{name}.{k}: {d[k]!r} is not a number")
    if d["status"] in ("ok", "emulated") and d["value"] is None:
        raise ValueError(f"{name}: status {d['status']} without a value")
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


# --- for people ---------------------------------------------------------------------------------

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
