"""Out of memory in a run the plan said would fit: a bug in the memory model, reported as one.

The message names the phase the step was in, the plan's estimate for that phase and the allocator's
measured peak; `oom.json` in the run folder keeps the same figures with the plan and torch's own
error, written atomically, for the user to attach to a report.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from edgerl.core.files import json_text, write_atomically
from edgerl.train.manifest import own
from edgerl.plan.memory import fmt_bytes

OOM_FILE = "oom.json"


def tried_to_allocate(error: str) -> Optional[str]:
    """'2.00 GiB' from torch's 'Tried to allocate 2.00 GiB', when the message has it."""
    m = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", error)
    return m.group(1) if m else None


def oom_record(plan: Any, step: int, phase: str, measured: dict[str, int], error: str) -> dict[str, Any]:
    """What oom.json holds: where the step failed, the plan's estimate (the phase's and the peak), what the
    allocator measured, torch's message, and the plan's decisions."""
    phases = plan.memory.phase_totals()
    return {"step": step, "phase": phase,
            "estimate_phase_bytes": phases.get(phase), "estimate_phase_components": plan.memory.phases.get(phase),
            "estimate_total_bytes": plan.memory.total, "estimate_peak_phase": plan.memory.peak_phase,
            "budget_bytes": plan.memory.budget, "measured": measured, "tried_to_allocate": tried_to_allocate(error),
            "torch_error": error[:2000], "device": plan.device.describe(), "model": plan.model.describe(),
            "task": plan.task.effective_batch() + f"; prompt {plan.task.prompt_len} + {plan.task.length_word} "
                                                   f"{plan.task.response_len} tokens",
            "plan": plan.decisions()}


def oom_message(record: dict[str, Any], run_dir: Path) -> str:
    """The first sentences of the error: the phase, the estimate against the measurement, and that this is
    a bug (the plan said it fits)."""
    est = record["estimate_phase_bytes"]
    m = record["measured"]
    asked = f"; torch tried to allocate {record['tried_to_allocate']} more" if record["tried_to_allocate"] else ""
    named = record["phase"] in ("rollout", "reward", "score", "update", "sync")
    where = f"the {record['phase']} phase" if named else record["phase"]
    est_text = (f"the plan estimated {fmt_bytes(est)} for it ({fmt_bytes(record['estimate_total_bytes'])} at the "
                f"step's peak, in {record['estimate_peak_phase']})" if est is not None else
                f"the plan estimated {fmt_bytes(record['estimate_total_bytes'])} at the step's peak (in "
                f"{record['estimate_peak_phase']})")
    return (f"CUDA out of memory in step {record['step']}, in {where}: {est_text}; the allocator had reserved "
            f"{fmt_bytes(m.get('reserved_peak'))} at its peak (allocated {fmt_bytes(m.get('allocated_peak'))}; "
            f"the CUDA context lies outside both){asked}. The plan said this fits in a {fmt_bytes(record['budget_bytes'])} "
            f"budget, so its memory model is wrong here: that is a bug, and {run_dir / OOM_FILE} holds these figures "
            "for a report")


def write_oom(run_dir: Path, record: dict[str, Any], rank: int = 0) -> Path:
    """oom.json (oom.rankN.json for ranks other than 0), written atomically."""
    path = Path(run_dir) / (OOM_FILE if rank == 0 else f"oom.rank{rank}.json")
    own(run_dir, path.name)
    write_atomically(path, json_text(record, indent=2, default=str) + "\n")
    return path
