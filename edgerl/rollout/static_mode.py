"""What the static engine's captured decode step bakes in, shared by the engine (engine_static.py) and its episodes
of several turns (turns_static.py), which would otherwise import each other."""

from __future__ import annotations

from dataclasses import dataclass

CHECK_EVERY = 16   # CUDA decode steps between looks at "all rows done" (each look is a device-to-host copy)


@dataclass(frozen=True)
class Mode:
    """What a captured step bakes in (shapes and branches); temperature and top-p are tensors instead."""
    rows: int
    full: int          # rows the chunk started with: a smaller `rows` means finished rows were dropped
    greedy: bool
    top_k: int
    top_p: bool
    eos: tuple[int, ...]
    pad: int
    span: int          # cache columns the step's attention reads (`span_for`)
