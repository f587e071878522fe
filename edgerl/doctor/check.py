"""A doctor check: its name, status (ok / warn / fail / skip), what was found and the fix."""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def _c(name: str, status: str, detail: str, fix: str = "") -> Check:
    assert status in STATUSES
    return Check(name, status, detail, fix)
