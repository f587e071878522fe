"""The run folder: chosen, checked and locked before anything is written, so that no run a user had
is overwritten, mixed with another, or lost.

    new run      --out DIR must be new, empty, or hold no edgerl run (an existing run is refused with
                 the command that continues it)
    resume       --resume RUN (its latest checkpoint) or --resume RUN/checkpoints/step-N
                 in place: only from the latest checkpoint; metrics of steps after it (a crash
                 between checkpoints) are moved to a side file, not deleted
                 from an older checkpoint: refused in place (it would replace later history);
                 `--out NEW` branches into a new folder and leaves the old run untouched
    finished     resuming a run that reached train.steps and exported says so and does nothing

One process trains in a folder at a time (an exclusive lock); temporary files of writes that were
killed are removed once the lock is held.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import checkpoint
from .errors import CheckpointError, RunDirError

RUN_FILES = ("config.toml", "metrics.jsonl", "checkpoints", "final", "plan.json")
LOCK = ".edgerl.lock"


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Path          # the checkpoint folder
    run_dir: Path             # the run it belongs to
    step: int


def resume_point(path: Path) -> ResumePoint:
    """A run folder (its latest checkpoint) or one checkpoint folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"--resume {path}: no such folder")
    if not path.is_dir():
        raise CheckpointError(f"--resume {path} is a file; give a run folder or a checkpoint folder (step-NNNNNN)")
    if (path / "meta.json").exists():
        ckpt = path
    else:
        ckpt = checkpoint.latest(path)
        if ckpt is None:
            raise CheckpointError(f"--resume {path}: no checkpoint in {path / 'checkpoints'} (a run writes one every "
                                  "run.save_every steps and when it stops)")
    step = _ckpt_step(ckpt)
    return ResumePoint(ckpt, ckpt.parent.parent, step)


def _ckpt_step(ckpt: Path) -> int:
    try:
        return int(json.loads((ckpt / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt}/meta.json is unreadable ({e}); resume from another checkpoint") from None


def _describe_run(run: Path) -> str:
    parts = []
    ckpts = checkpoint.checkpoints(run)
    if ckpts:
        parts.append(f"checkpoints up to {ckpts[-1].name}")
    steps = _metric_steps(run)
    if steps:
        parts.append(f"metrics of steps {min(steps)}-{max(steps)}")
    if (run / "final").exists():
        parts.append("a final model")
    return ", ".join(parts) or "a run's config"


def _metric_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r'\{"step": (\d+)', line)
        if m:
            out.append(int(m.group(1)))
    return out


def check_new(out: Path) -> None:
    """`out` can receive a new run: absent, an empty folder, or a folder holding no edgerl run."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file; give a folder for the run (it is created if missing)")
    if out.is_dir() and any((out / f).exists() for f in RUN_FILES):
        raise RunDirError(f"{out} already holds a run ({_describe_run(out)}); continue it with "
                          f"--resume {out}, or choose another --out for a new run")


def check_resume(point: ResumePoint, out: Optional[Path]) -> Path:
    """The folder a resumed run writes to: its own, or `out` for a branch. Refuses to replace history."""
    if out is not None and out.resolve() != point.run_dir.resolve():
        check_new(out)
        return out
    latest = checkpoint.latest(point.run_dir)
    if latest is not None and latest.resolve() != point.checkpoint.resolve():
        raise RunDirError(
            f"--resume {point.checkpoint} goes back to step {point.step}, but {point.run_dir} went on to "
            f"{latest.name}: continuing there would replace that history. Branch into a new folder with "
            f"--resume {point.checkpoint} --out NEW_FOLDER, or continue the latest with --resume {point.run_dir}")
    return point.run_dir


class RunLock:
    """An exclusive lock on a run folder for the life of a training process."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self.fh = open(self.path, "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.seek(0)
            pid = self.fh.read().strip() or "?"
            self.fh.close()
            raise RunDirError(f"another edgerl process (pid {pid}) is training in {run_dir}; wait for it to "
                              "finish or stop it, or choose another --out") from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()

    def release(self) -> None:
        if not self.fh.closed:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()


def open_run(run_dir: Path, log: Callable[[str], None]) -> RunLock:
    """Create (if needed) and lock the run folder, check it is writable, clean interrupted writes."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
    except PermissionError as e:
        raise RunDirError(f"cannot write to the run folder {run_dir} ({e.strerror}); choose another --out "
                          "or fix its permissions") from None
    except OSError as e:
        if isinstance(e, RunDirError):
            raise
        raise RunDirError(f"cannot use {run_dir} as a run folder: {e}") from None
    for tmp in checkpoint.stale_temporaries(run_dir):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        log(f"removed {tmp.name}: left by a write that was interrupted")
    return lock


def aside_name(target: Path, step: Optional[int]) -> Path:
    """Where an earlier `final/` goes when a run that continued past it exports again."""
    base = f"{target.name}-step-{step:06d}" if step is not None else f"{target.name}-earlier"
    candidate, n = target.with_name(base), 1
    while candidate.exists():
        n += 1
        candidate = target.with_name(f"{base}-{n}")
    return candidate
