"""Which checkpoints a run keeps, and what they cost on disk.

While training: the newest `run.keep_last`, and with `run.keep_best` the one whose step scored best on the
held-out prompts (its score is in its meta.json as `eval_score`), however old. A new checkpoint is complete
(renamed into place) before any old one goes, and the newest is never removed: a resume always finds it.

When a run with `run.final_only` finishes and final/ is written: its checkpoints go, except the best (when
it is not the last step, whose weights final/ holds), which keeps its weights and loses its optimizer
state; its meta.json then says `weights_only`, and a resume from it is refused with that reason
(checkpoint.damage).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.core.files import json_text, remove_folder, write_atomically
from edgerl.plan.memory import fmt_bytes

# the optimizer state in a checkpoint folder (train/state.py's names): what final_only drops from the best
OPTIMIZER_FILES = ("optim.pt", "critic_optim.pt")


def score_of(metrics: dict[str, Any]) -> Optional[float]:
    """The held-out score a checkpoint is ranked by: accuracy where the rewards have one, else the mean
    held-out reward; None for a step that was not evaluated."""
    for key in ("eval/accuracy", "eval/reward"):
        v = metrics.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


def kept(found: list[tuple[int, Optional[float]]], keep_last: int, keep_best: bool) -> set[int]:
    """The steps kept among checkpoints given as (step, score or None), in any order: the newest
    `keep_last`, and with `keep_best` the best scored one (the later of equal scores)."""
    steps = sorted(s for s, _ in found)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if steps:
        keep.add(steps[-1])   # the newest always stays: a resume continues from it
    best = best_step(found)
    if keep_best and best is not None:
        keep.add(best)
    return keep


def best_step(found: list[tuple[int, Optional[float]]]) -> Optional[int]:
    scored = [(score, step) for step, score in found if score is not None]
    return max(scored)[1] if scored else None


def read_score(folder: Path) -> Optional[float]:
    try:
        v = json.loads((folder / "meta.json").read_text(encoding="utf-8")).get("eval_score")
    except (OSError, ValueError, AttributeError):
        return None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def doomed(folders: list[Path], keep_last: int, keep_best: bool) -> list[Path]:
    """The checkpoint folders (RUN/checkpoints/step-N) that `kept` lets go."""
    keep = kept([(step_of(f), read_score(f)) for f in folders], keep_last, keep_best)
    return [f for f in folders if step_of(f) not in keep]


def plan_line(weights: int, optimizer: int, save_every: int, keep_last: int, keep_best: bool, evaluated: bool,
              final_only: bool, final_bytes: Optional[int]) -> str:
    """The line a run prints at its start: what one checkpoint costs, how many are kept, what stays at
    the end."""
    most = keep_last + (1 if keep_best and evaluated else 0)
    which = f"the newest {keep_last}" + (" and the best by held-out score" if keep_best and evaluated else "")
    every = (f"every {save_every} steps" if save_every > 1 else "every step") if save_every else "only on a stop signal or failure (run.save_every = 0)"
    line = (f"checkpoints: {every}, each about {fmt_bytes(weights + optimizer)} (weights {fmt_bytes(weights)}, "
            f"optimizer state {fmt_bytes(optimizer)}); at most {most} kept ({which}; run.keep_last, "
            f"run.keep_best)")
    final = f"final/ (about {fmt_bytes(final_bytes)})" if final_bytes else "final/"
    if final_only:
        line += (f"; at the end only {final} stays" + (", with the best checkpoint's weights if that is not the last "
                                                       "step" if keep_best and evaluated else "") + " (run.final_only)")
    else:
        line += f"; at the end they stay beside {final} (--final-only removes them)"
    return line


def finish(run_dir: Path, folders: list[Path], last_step: int, keep_best: bool, log: Callable[[str], None]) -> None:
    """run.final_only, once final/ holds step `last_step`: remove the checkpoints `folders`, keeping only
    the best one's weights (when it is not `last_step`)."""
    best = best_step([(step_of(f), read_score(f)) for f in folders]) if keep_best else None
    freed = 0
    for folder in folders:
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        if step_of(folder) == best and best != last_step:
            freed += drop_optimizer(folder)
            log(f"kept {folder} (the best held-out score) without its optimizer state")
        else:
            remove_folder(folder)
            freed += size
    if folders:
        log(f"run.final_only: {len(folders)} checkpoint(s) reduced to the final model; {fmt_bytes(freed)} freed")


def drop_optimizer(folder: Path) -> int:
    """Remove a checkpoint's optimizer state, its meta.json first rewritten (atomically) to say so and to
    list only the files that stay. Returns the bytes freed."""
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    files = {k: v for k, v in (meta.get("files") or {}).items() if k not in OPTIMIZER_FILES}
    write_atomically(folder / "meta.json", json_text({**meta, "files": files, "weights_only": True}, indent=2,
                                                     default=str))
    freed = 0
    for name in OPTIMIZER_FILES:
        path = folder / name
        if path.exists():
            freed += path.stat().st_size
            path.unlink()
    return freed
