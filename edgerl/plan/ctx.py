"""`Ctx`: one plan being made, which every step of the table reads; `NoFit`: the search found no setting.

Apart from plan.py so that the steps, which take a Ctx, and plan.py, which makes one, do not import each other.
"""

from __future__ import annotations

from typing import Any

from edgerl.core.errors import PlanError
from edgerl.device.device import Device
from edgerl.plan.memory import Calibration
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.task import Task


class NoFit(PlanError):
    """No setting fits `limit` bytes; `attempts` are the search's tries. plan() turns it into the message
    that says what would fit (it plans the alternatives, which a step cannot do without importing plan)."""

    def __init__(self, limit: int, attempts: list) -> None:
        super().__init__("does not fit")
        self.limit, self.attempts = limit, attempts


class Ctx:
    """One plan being made: the inputs, the overrides, the decisions made so far (`c["name"]`, made on
    first use by the table's step, so a step may read any decision it depends on) and the facts the
    steps share (`steps.fact`)."""

    def __init__(self, device: Device, model: ModelSpec, task: Task, overrides: dict[str, Any],
                 calibration: Calibration, explain: bool, rows: dict[str, Any]) -> None:
        self.device, self.model, self.task, self.o = device, model, task, overrides
        self.calibration, self.explain = calibration, explain
        self.rows = rows   # the table's rows (plan/table.py), by decision name
        self.values: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}
        self.facts: dict[str, Any] = {}
        self._making: list[str] = []

    def forced(self, name: str) -> Any:
        """What the user forced for decision `name` (its [plan] key), or None."""
        row = self.rows.get(name)
        return self.o.get(row.config_key if row else name)

    def __getitem__(self, name: str) -> Any:
        if name not in self.values:
            if name in self._making:
                raise RuntimeError(f"the plan's steps depend on each other in a circle: {' -> '.join(self._making)} "
                                   f"-> {name}")
            self._making.append(name)
            try:
                value, reason = self.rows[name].step(self)
            finally:
                self._making.pop()
            self.values[name], self.reasons[name] = value, reason
        return self.values[name]
