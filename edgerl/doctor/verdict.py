"""A self-test verdict: one check's status (pass / fail / skip), what it measured, and the setting that
avoids the part that failed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

VERDICTS = ("pass", "fail", "skip")


@dataclass
class Verdict:
    name: str                 # what was checked, as the user reads it
    status: str               # pass | fail | skip
    detail: str               # the figures in words, or why it was skipped
    figures: dict[str, Any] = field(default_factory=dict)   # the numbers behind it, for the JSON
    avoid: str = ""           # the --set that runs without the failing part ('' when no setting does)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        assert self.status in VERDICTS, self.status

    def line(self) -> str:
        """One line for the terminal and the bug report."""
        text = f"{self.status.upper():4}  {self.name}: {self.detail}"
        if self.status == "fail":
            text += f"; avoid it with --set {self.avoid}" if self.avoid else "; no setting avoids it"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "avoid": self.avoid,
                "figures": {k: _plain(v) for k, v in self.figures.items()}, "seconds": round(self.seconds, 3)}


def _plain(v: Any) -> Any:
    """JSON-safe numbers: floats rounded to 4 significant digits, inf/NaN as strings."""
    if isinstance(v, float):
        return v if v == 0 else (f"{v}" if not math.isfinite(v) else float(f"{v:.4g}"))
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def within(err: float, tol: float) -> bool:
    """err <= tol for a finite err (NaN or inf never passes)."""
    return math.isfinite(err) and err <= tol
