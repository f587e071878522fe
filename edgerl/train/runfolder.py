"""The run folder: chosen, checked and locked before anything is written, so that no run a user had
is overwritten, mixed with another, or lost.

    new run      --out DIR must be new, empty, or hold no edgerl run (an existing run is refused with
                 the command that continues it); a run that stopped before its first step (a model
                 that did not load, say) left only its config: a new run may start there. The user's
                 files stay beside the run's, but one named as a run's file (manifest.RUN_NAMES) and
                 not in DIR's manifest refuses the run: edgerl never writes over it
    resume       --resume RUN (its latest checkpoint) or --resume RUN/checkpoints/step-N
                 in place: only from the latest checkpoint; metrics of steps after it (a crash
                 between checkpoints) are moved to a side file, not deleted
                 from an older checkpoint: refused in place (it would replace later history);
                 `--out NEW` branches into a new folder and leaves the old run untouched
    finished     resuming a run that reached train.steps and exported that step says so and writes
                 nothing

    restart      --out DIR --restart: DIR's run (metrics without a checkpoint, say), exactly what its
                 manifest lists, is moved into DIR/earlier-run-N/, nothing deleted, and a new run
                 starts there

One process trains in a folder at a time (an exclusive lock, edgerl.train.lock). The folder is checked again once the lock
is held, so the check and the lock are one step: of two runs started together on one new folder, one
trains and the other is refused before it writes anything. Temporary files of writes that were killed
are removed once the lock is held and the checks have passed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.train import checkpoint
from edgerl.core.errors import CheckpointError, RunDirError
from edgerl.core.files import json_text
from edgerl.train.lock import LOCK, RunLock
from edgerl.train.manifest import MANIFEST, RUN_NAMES, forget, own, owned

RUN_FILES = ("config.toml", "metrics.jsonl", "checkpoints", "final", "final-adapter", "plan.json")


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Path          # the checkpoint folder
    run_dir: Path             # the run it belongs to (RUN of RUN/checkpoints/step-N)
    step: int
    in_run: bool = True       # False: a checkpoint copied out of its run; it can only start a new one (--out)


def resume_point(path: Path) -> ResumePoint:
    """A run folder (its latest checkpoint), its checkpoints/ folder, or one checkpoint folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"--resume {path}: no such folder")
    if not path.is_dir():
        raise CheckpointError(f"--resume {path} is a file; give a run folder or a checkpoint folder (step-NNNNNN)")
    if (path / "meta.json").exists() or (path.parent.name == "checkpoints" and checkpoint.is_step_folder(path)):
        ckpt = path
    else:
        ckpt = checkpoint.latest(path.parent if path.name == "checkpoints" else path)
        if ckpt is None and (path / "config.json").exists():
            raise CheckpointError(f"--resume {path} is a model folder (an export, or an HF model), not a run: "
                                  f"train from it with --model {path}")
        if ckpt is None:
            raise CheckpointError(f"--resume {path}: no checkpoint in {path / 'checkpoints'} (a run writes one every "
                                  "run.save_every steps and when it stops)")
    step = _ckpt_step(ckpt)
    return ResumePoint(ckpt, ckpt.parent.parent, step, in_run=ckpt.parent.name == "checkpoints")


def checkpoint_config(point: ResumePoint) -> Optional[dict]:
    """The config a checkpoint was written with (its meta.json), for a run whose config.toml is gone."""
    try:
        config = json.loads((point.checkpoint / "meta.json").read_text()).get("config")
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _ckpt_step(ckpt: Path) -> int:
    try:
        step = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"its step is {step!r}, not a number")
        return step
    except FileNotFoundError:
        why = f"{ckpt / 'meta.json'} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{ckpt / 'meta.json'} is damaged ({getattr(e, 'strerror', None) or e})"
    raise CheckpointError(f"{why}; {_other_checkpoint(ckpt)}") from None


def _other_checkpoint(ckpt: Path) -> str:
    """The way on from the damaged checkpoint `ckpt`: a branch from an earlier one of its run (in
    place, going back is refused, so the advice cannot lead back here), or a fresh start."""
    run = ckpt.parent.parent
    found = checkpoint.checkpoints(run) if ckpt.parent.name == "checkpoints" else []
    earlier = found[:found.index(ckpt)] if ckpt in found else []
    if earlier:
        return (f"continue from the checkpoint before it in a new folder: edgerl train --resume {earlier[-1]} "
                "--out NEW_FOLDER")
    if ckpt.parent.name == "checkpoints":
        return (f"no earlier checkpoint is left: start over with edgerl train --out {run} --restart (the run's files "
                "are moved aside, nothing is deleted) or with another --out")
    return "resume from another checkpoint, or start a new run"


def _describe_run(run: Path) -> str:
    parts = []
    ckpts = checkpoint.checkpoints(run)
    if ckpts:
        parts.append(f"checkpoints up to {ckpts[-1].name}")
    steps = _metric_steps(run)
    if steps:
        parts.append(f"metrics of steps {min(steps)}-{max(steps)}")
    elif (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size:
        parts.append("a metrics.jsonl in which no line names a step")
    if (run / "final").exists() or (run / "final-adapter").exists():
        parts.append("a final model")
    if not parts:
        parts = [f"its {n}" for n in RUN_FILES if (run / n).exists()]
    return ", ".join(parts) or "a run's files"


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


def branch_history(point: ResumePoint, name: str = "metrics.jsonl") -> Optional[str]:
    """The metrics (or samples.jsonl's rows) a branch from `point` starts with: its run's rows up to
    the checkpoint's step."""
    if not point.in_run or not (point.run_dir / name).exists():
        return None
    from edgerl.train.metrics import read_metrics, read_samples
    read = read_metrics if name == "metrics.jsonl" else read_samples
    rows = [r for r in read(point.run_dir, log=None) if r.get("step", 0) <= point.step]
    return "".join(json_text(r) + "\n" for r in rows)


def never_stepped(run: Path, history: Optional[str] = None) -> bool:
    """`run` holds only what a run writes before its first step: config.toml, plan.json, an empty
    metrics.jsonl, or (a branch) `history`, the metrics it was given. A run whose model failed to
    load leaves this; starting there again loses nothing."""
    if checkpoint.checkpoints(run) or any((run / f).exists() for f in ("final", "final-adapter")):
        return False
    if any(p.name != "metrics.jsonl" for p in run.glob("metrics*.jsonl")):   # rows moved aside are history
        return False
    metrics = run / "metrics.jsonl"
    if not metrics.exists() or metrics.stat().st_size == 0 or set(_metric_steps(run)) == {0}:
        return True   # step 0: only the evaluation before the first step (moved aside, not lost)
    return history is not None and metrics.read_bytes() == history.encode("utf-8")


def _file_above(out: Path) -> Optional[Path]:
    """The nearest existing ancestor of `out` when it is a file (no folder can be made under it)."""
    for parent in out.parents:
        if parent.exists():
            return parent if not parent.is_dir() else None
    return None


def check_new(out: Path, history: Optional[str] = None, restart: bool = False) -> None:
    """`out` can receive a new run: absent, an empty folder, a folder holding no edgerl run, or one
    where a run stopped before its first step (`never_stepped`; `history` for a branch), and none of
    the user's files there has a name a run writes (`foreign`). With `restart`, a run there is no
    obstacle: its files are moved aside (`move_aside`) before writing."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file; give a folder for the run (it is created if missing)")
    above = _file_above(out)
    if above is not None:
        raise RunDirError(f"--out {out}: {above} is a file, so no folder can be made there; choose another --out")
    if not restart and holds_run(out, history):
        _refuse_run(out)
    theirs = foreign(out)
    if theirs:
        names = ", ".join(theirs)
        raise RunDirError(f"--out {out} holds {names}, which edgerl did not write (they are not in its "
                          f"{MANIFEST}), and a run writes files of those names: edgerl never replaces your files. "
                          f"Choose another --out (a new folder such as {out / 'run'}), or move {names} away")


def _refuse_run(out: Path) -> None:
    if checkpoint.latest(out) is None:
        raise RunDirError(f"{out} already holds a run ({_describe_run(out)}) without a checkpoint to continue "
                          f"from; start over there with --out {out} --restart (its files are moved into "
                          f"{_aside_folder(out).name}/ inside it, nothing is deleted), or choose another --out")
    raise RunDirError(f"{out} already holds a run ({_describe_run(out)}); continue it with "
                      f"--resume {out}, or choose another --out for a new run")


def holds_run(out: Path, history: Optional[str] = None) -> bool:
    """`out` holds files of a run that took a step (what a new run there would mix with)."""
    return out.is_dir() and any((out / f).exists() for f in RUN_FILES) and not never_stepped(out, history)


# A run written before edgerl kept a manifest: what a run writes besides RUN_FILES, found by name (a
# restart moves them aside with the rest). A run with a manifest owns exactly what it lists.
_LEGACY_PATTERNS = ("metrics.*.jsonl", "samples*.jsonl", "loggers.json", "wandb", "oom*.json", "final-step-*",
                    "final-earlier*", "final-adapter-step-*", "final-adapter-earlier*", "tensorboard", "profile",
                    "rollout-model", "curves.png", "curves.pdf", "curves.svg")


def run_files(run: Path) -> list[Path]:
    """The files and folders of the run in `run`: those its manifest lists (and the manifest), or, in a
    folder without one that holds a run, those a run writes, by name. [] when `run` holds no run."""
    names = owned(run)
    if names is not None:
        listed = [run / n for n in sorted(names) + [MANIFEST]]
        return [p for p in listed if p.exists() or p.is_symlink()]
    if not holds_run(run):
        return []
    found = [run / f for f in RUN_FILES if (run / f).exists() or (run / f).is_symlink()]
    return found + [p for pattern in _LEGACY_PATTERNS for p in sorted(run.glob(pattern)) if p not in found]


def adopt(run: Path) -> None:
    """A run resumed in place lists its files in a manifest, if it was written before edgerl kept one."""
    if owned(run) is None:
        own(run, *[p.name for p in run_files(run)])


def foreign(run: Path) -> list[str]:
    """The names in `run` a run writes (manifest.RUN_NAMES) that belong to no run there: the user's."""
    if not run.is_dir():
        return []
    ours = {p.name for p in run_files(run)}
    return [n for n in RUN_NAMES if ((run / n).exists() or (run / n).is_symlink()) and n not in ours]


def _aside_folder(run: Path) -> Path:
    n = 1
    while (run / f"earlier-run-{n}").exists():
        n += 1
    return run / f"earlier-run-{n}"


def move_aside(run: Path, log: Callable[[str], None]) -> Optional[Path]:
    """Move the files of the run in `run` (`run_files`: what its manifest lists) into run/earlier-run-N/ (a
    new N), each by one rename; the user's own files stay. Returns that folder, or None when there was
    nothing to move."""
    found = run_files(run)
    if not found:
        return None
    aside = _aside_folder(run)
    aside.mkdir()
    for p in found:
        os.replace(p, aside / p.name)
    forget(run)
    log(f"--restart: moved the earlier run's {', '.join(p.name for p in found)} into {aside} (nothing was "
        "deleted); starting a new run in " + str(run))
    return aside


def enclosing_run(path: Path) -> Optional[Path]:
    """The run folder `path` lies in, at any depth (RUN/final/config.json is in RUN), or None: a folder
    with a manifest or a lock file, or with checkpoints/ and metrics.jsonl (a run older than manifests)."""
    for folder in Path(path).expanduser().resolve().parents:
        if (folder / MANIFEST).exists() or (folder / LOCK).exists() or \
                ((folder / "checkpoints").is_dir() and (folder / "metrics.jsonl").is_file()):
            return folder
    return None


def check_resume(point: ResumePoint, out: Optional[Path], verify: bool = True) -> Path:
    """The folder a resumed run writes to: its own, or `out` for a branch. Refuses to replace history.
    `verify`: also read the checkpoint's files (checksums, finite weights); the check repeated under
    the run folder's lock leaves that out (the files are the same ones)."""
    branch = out is not None and out.resolve() != point.run_dir.resolve()
    if not point.in_run and not branch:  # its grandparent folder is no run: it must not be written as one
        raise RunDirError(f"--resume {point.checkpoint} is a checkpoint outside a run folder (runs keep them in "
                          f"RUN/checkpoints/); start a run from it with --resume {point.checkpoint} --out NEW_FOLDER")
    if branch:
        check_new(out, branch_history(point))
    else:
        latest = checkpoint.latest(point.run_dir)
        if latest is not None and latest.resolve() != point.checkpoint.resolve():
            raise RunDirError(
                f"--resume {point.checkpoint} goes back to step {point.step}, but {point.run_dir} went on to "
                f"{latest.name}: continuing there would replace that history. Branch into a new folder with "
                f"--resume {point.checkpoint} --out NEW_FOLDER, or continue the latest with --resume {point.run_dir}")
    if verify:
        _check_files(point)
        _check_weights(point)
    return out if branch else point.run_dir


def _check_files(point: ResumePoint) -> None:
    """Refuse a checkpoint whose files are missing or not as written (checksums in its meta.json),
    naming the file, before anything is written."""
    why = checkpoint.damage(point.checkpoint)
    if why is not None:
        raise CheckpointError(f"checkpoint {point.checkpoint.name} cannot be resumed: {why}; "
                              f"{_other_checkpoint(point.checkpoint)}")


def _check_weights(point: ResumePoint) -> None:
    """Refuse a checkpoint whose weights are not finite before anything is written: every update from
    it would be skipped. The way back is a branch from an earlier checkpoint (in place, going back
    is refused)."""
    bad = checkpoint.non_finite(point.checkpoint)
    if not bad:
        return
    earlier = [c for c in checkpoint.checkpoints(point.run_dir) if int(c.name.split("-")[1]) < point.step
               and point.in_run]
    fix = (f"branch from an earlier one: edgerl train --resume {earlier[-1]} --out NEW_FOLDER" if earlier else
           "no earlier checkpoint is left: start a new run (a lower train.lr, or plan.dtype=fp32 if fp16 overflowed)")
    raise CheckpointError(f"{point.checkpoint} holds NaN or infinite weights ({', '.join(bad[:3])}"
                          f"{', ...' if len(bad) > 3 else ''}): training from it would skip every update; {fix}")


EXPORT_MARK = "edgerl-export.json"   # in an export folder: the step it was written at


def mark_export(folder: Path, step: int) -> None:
    """Record in an export folder being written (final/, final-adapter/) the step it holds."""
    (Path(folder) / EXPORT_MARK).write_text(json.dumps({"step": step}) + "\n")


def export_step(folder: Path) -> Optional[int]:
    """The step an export folder (final/, final-adapter/) was written at, or None."""
    try:
        return int(json.loads((Path(folder) / EXPORT_MARK).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished(point: Optional[ResumePoint], run_dir: Path, steps: int, exports: list[str]) -> bool:
    """Resuming `point` in place has nothing left to do: it reached `steps`, and every export folder
    the run writes (`exports`, e.g. ["final"]) holds that very step."""
    return (point is not None and run_dir.resolve() == point.run_dir.resolve() and point.step >= steps
            and all(export_step(run_dir / name) == point.step for name in exports))


def open_run(run_dir: Path, log: Callable[[str], None], check: Callable[[], Any] = lambda: None,
             clean: bool = True) -> RunLock:
    """Create (if needed) and lock the run folder, then `check` it again while holding the lock: the
    check and the lock are one step, so a run that another process started (or finished) there while
    this one was loading its data is seen, and this one stops before writing anything. A folder this
    call created is removed again when the check fails. `clean`: remove temporary files of interrupted
    writes now (only with the lock held: then no other process is writing there); `clean_up` later."""
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
    except PermissionError as e:
        raise RunDirError(f"cannot write to the run folder {run_dir} ({e.strerror}); choose another --out "
                          "or fix its permissions") from None
    except OSError as e:
        if isinstance(e, RunDirError):
            raise
        raise RunDirError(f"cannot use {run_dir} as a run folder: {e.strerror or e}") from None
    try:
        check()
    except BaseException:
        lock.release()
        if created and [p.name for p in run_dir.iterdir()] == [LOCK]:
            lock.path.unlink(missing_ok=True)
            run_dir.rmdir()
        raise
    lock.claim()
    if clean:
        clean_up(run_dir, log)
    return lock


def clean_up(run_dir: Path, log: Callable[[str], None]) -> None:
    """Remove temporary files and folders of writes that were killed (the run folder's lock is held)."""
    for tmp in checkpoint.stale_temporaries(run_dir):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        log(f"removed {tmp.name}: left by a write that was interrupted")


def aside_name(target: Path, step: Optional[int]) -> Path:
    """Where an earlier `final/` goes when a run that continued past it exports again."""
    base = f"{target.name}-step-{step:06d}" if step is not None else f"{target.name}-earlier"
    candidate, n = target.with_name(base), 1
    while candidate.exists():
        n += 1
        candidate = target.with_name(f"{base}-{n}")
    return candidate
