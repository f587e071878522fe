"""Per-step metrics: `metrics.jsonl` in the run folder (one JSON object per step), TensorBoard when
installed, and a rich progress line with the key numbers.

Only the last line of metrics.jsonl can be cut short (a run killed mid-write); readers drop it and
say so. A bad line anywhere else is an error naming it. Rows are never deleted: a resume from an
older checkpoint moves the later rows to a side file (`archive_after`), and a fresh run in a
folder with metrics moves them to `metrics.previous.jsonl`; both rewrite atomically.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.core.errors import ConfigError, RunDirError
from edgerl.core.files import finite, output_file, write_atomically
from edgerl.train.loggers import close_loggers, log_step, open_loggers
from edgerl.train.manifest import MANIFEST, own, owned

Log = Optional[Callable[[str], None]]

# shown live in the progress bar, in this order
KEY_METRICS = (("reward/mean", "reward", "{:.3f}"), ("sft/loss", "loss", "{:.3f}"), ("response/length_mean", "len", "{:.0f}"),
               ("actor/kl", "kl", "{:.4f}"), ("actor/entropy", "ent", "{:.2f}"),
               ("perf/step_s", "s/step", "{:.1f}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"),
               ("eval/accuracy", "eval acc", "{:.3f}"))


def _line(row: dict[str, Any]) -> str:
    """`row` as one line of valid JSON. JSON has no NaN nor infinity: such a value is written as null (for a
    metric, "not defined this step"), and the row counts them in 'non_finite'."""
    clean, n = finite(row)
    if n:
        clean["non_finite"] = n
    return json.dumps(clean, allow_nan=False) + "\n"


def _row(line: str) -> Optional[dict[str, Any]]:
    """The metrics row on `line`, or None when it is not one (not JSON, not an object, no step)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) else None


def _parse(path: Path, label: str = "metrics") -> tuple[list[tuple[str, dict[str, Any]]], Optional[tuple[int, str]]]:
    """([(line text, row)], the torn last line as (1-based number, text) or None).

    Each row is written as one line ending in a newline, flushed at once, so a crash can leave
    only the last line short; any other bad line means the file was edited or damaged."""
    text = path.read_bytes().decode("utf-8", errors="replace")  # a damaged byte fails as JSON below
    numbered = [(i, ln) for i, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    rows: list[tuple[str, dict[str, Any]]] = []
    for k, (i, line) in enumerate(numbered):
        row = _row(line)
        if row is not None:
            rows.append((line, row))
        elif k == len(numbered) - 1:
            return rows, (i, line)
        else:
            raise RunDirError(f"{path}: line {i} is not a {label} row (a JSON object with an integer 'step'): "
                              f"{line[:60]!r}; only the last line can be cut short by a crash, so the file was "
                              f"edited or damaged: repair or delete line {i}, then run again")
    return rows, None


def _torn_note(path: Path, torn: tuple[int, str], label: str = "metrics") -> str:
    return (f"{label}: ignored line {torn[0]} of {path}, cut short when the run stopped "
            f"({torn[1][:40]!r}...)")


def _free_name(path: Path, tag: str) -> Path:
    """metrics.<tag>.jsonl beside `path`, or metrics.<tag>-2.jsonl ... if taken: never over a file."""
    k = 1
    while True:
        candidate = path.with_name(f"{path.stem}.{tag}{'' if k == 1 else f'-{k}'}{path.suffix}")
        if not candidate.exists():
            return candidate
        k += 1


def _lines(rows: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(line + "\n" for line, _ in rows)


class StepLog:
    """Appends rows keyed by 'step' to a JSON-lines file in the run folder. `resume` continues the file
    (a torn last line is dropped with a note through `log`); otherwise rows already there, from an
    earlier run in the same folder, are moved to <name>.previous.jsonl first. The rows of one call are
    one write, flushed at once, so a crash can cut only the last line short."""

    def __init__(self, path: Path, label: str, resume: bool = False, log: Log = print) -> None:
        self.path, self.label = Path(path), label
        self.log = log or (lambda s: None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        own(self.path.parent, self.path.name)
        if self.path.exists() and self.path.stat().st_size > 0:
            if resume:
                self._repair()
            else:
                moved = _free_name(self.path, "previous")
                own(self.path.parent, moved.name)
                os.replace(self.path, moved)
                self.log(f"{label}: {self.path} held the steps of an earlier run; moved them to {moved}")
        self._fh = open(self.path, "a+", encoding="utf-8")

    def _repair(self) -> None:
        """Drop a torn last line, and end the file with a newline: the next row appended to a line
        without one would be glued to it, making a bad line in the middle."""
        rows, torn = _parse(self.path, self.label)
        if torn is not None:
            self.log(_torn_note(self.path, torn, self.label) + "; dropped it")
        if torn is not None or not self.path.read_bytes().endswith(b"\n"):
            write_atomically(self.path, lambda tmp: tmp.write_text(_lines(rows), encoding="utf-8"))

    def archive_after(self, step: int) -> Optional[Path]:
        """Move the rows of steps after `step` (those a resume from the checkpoint of `step` redoes)
        to <name>.after-step-<step>.jsonl beside the log; return that file, or None when there were
        none. The side file is written before the log is shortened, each atomically, so a crash in
        between leaves the rows in both files, never in neither."""
        self._fh.close()
        try:
            rows, torn = _parse(self.path, self.label)
            if torn is not None:
                self.log(_torn_note(self.path, torn, self.label) + "; dropped it")
            later = [r for r in rows if r[1]["step"] > step]
            if not later and torn is None:
                return None
            keep = [r for r in rows if r[1]["step"] <= step]
            side = None
            if later:
                side = _free_name(self.path, f"after-step-{step}")
                own(self.path.parent, side.name)
                write_atomically(side, lambda tmp: tmp.write_text(_lines(later), encoding="utf-8"))
            write_atomically(self.path, lambda tmp: tmp.write_text(_lines(keep), encoding="utf-8"))
            if side is not None:
                steps = [r["step"] for _, r in later]
                self.log(f"{self.label}: moved {len(later)} row(s) of steps {min(steps)}-{max(steps)}, after the "
                         f"checkpoint of step {step}, to {side}")
            return side
        finally:
            self._fh = open(self.path, "a+", encoding="utf-8")

    def _still_there(self) -> None:
        """The file this log appends to is still at its path. Deleted during the run (by a reward, say):
        written again from the open descriptor, which still holds every row, with a line saying so.
        Replaced by another file: a RunDirError, since rows appended to either would be lost to a reader."""
        try:
            if os.path.samestat(os.stat(self.path), os.fstat(self._fh.fileno())):
                return
        except FileNotFoundError:
            self._fh.seek(0)
            text = self._fh.read()
            write_atomically(self.path, text)
            self._fh.close()
            self._fh = open(self.path, "a+", encoding="utf-8")
            self.log(f"{self.label}: {self.path} was deleted during the run; written again with every row it held")
            return
        raise RunDirError(f"{self.path} was replaced by another file during the run; this run appends its "
                          f"{self.label} there, so it stops: put the run's file back, or resume in a new folder")

    def append(self, rows: list[dict[str, Any]]) -> None:
        self._still_there()
        self._fh.write("".join(_line(r) for r in rows))
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


SAMPLES = "samples.jsonl"


class MetricsWriter:
    """Appends one row per step to RUN/metrics.jsonl, sample rows to RUN/samples.jsonl (`samples`), and
    passes both to the loggers of run.loggers (TensorBoard, wandb, MLflow: edgerl.train.loggers).
    `resume` continues the files; otherwise rows already there are moved aside (StepLog)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume: bool = False, log: Log = print,
                 loggers: Optional[list[str]] = None, samples: bool = False, config: Optional[dict] = None,
                 project: Optional[str] = None) -> None:
        self.log = log or (lambda s: None)
        self.last_step: Optional[int] = None   # the step of the last row written
        self.jsonl = StepLog(Path(run_dir) / "metrics.jsonl", "metrics", resume, self.log)
        self.path = self.jsonl.path
        self.samples_log = StepLog(Path(run_dir) / SAMPLES, "samples", resume, self.log) if samples else None
        names = list(loggers) if loggers is not None else (["tensorboard"] if tensorboard else [])
        self.loggers: list[Any] = []
        try:
            self.loggers, self.note = open_loggers([n for n in names if n != "jsonl"], Path(run_dir), config or {},
                                                   project, resume, self.log)
        except BaseException:
            self.close()
            raise

    @property
    def tb_note(self) -> str:
        return self.note

    def archive_after(self, step: int) -> Optional[Path]:
        """metrics.jsonl's rows after `step` moved aside (StepLog.archive_after); samples.jsonl's too."""
        if self.samples_log is not None:
            self.samples_log.archive_after(step)
        return self.jsonl.archive_after(step)

    def write_row(self, step: int, metrics: dict[str, Any]) -> None:
        """The row of `step` in metrics.jsonl alone (`write` passes it on to the loggers too)."""
        self.jsonl.append([{"step": step, **metrics}])
        self.last_step = step

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.write_row(step, metrics)
        log_step(self.loggers, "metrics", step, metrics)

    def write_samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        """Sample rows ({'prompt', 'response', 'reward', ...}) of a step ('train') or an evaluation ('eval')."""
        if not rows or self.samples_log is None:
            return
        full = [finite({"step": step, "kind": kind, **r})[0] for r in rows]
        self.samples_log.append([{"step": step, "kind": kind, **r} for r in rows])
        log_step(self.loggers, "samples", step, kind, full)

    def close(self) -> None:
        self.jsonl.close()
        if self.samples_log is not None:
            self.samples_log.close()
        close_loggers(self.loggers, self.log)


def _eval_keys(keys: Any) -> list[str]:
    """The evaluation's headline keys present: accuracy (or the reward where there is no rule to say
    what is correct), then mean@k and pass@k."""
    keys = list(keys)
    head = ["eval/accuracy"] if "eval/accuracy" in keys else ["eval/reward"] if "eval/reward" in keys else []
    return head + sorted(k for k in keys if k.startswith(("eval/mean@", "eval/pass@")))


def summary_line(metrics: dict[str, Any]) -> str:
    parts = []
    for key, label, fmt in KEY_METRICS:
        v = metrics.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and not key.startswith("eval/"):
            parts.append(f"{label} {fmt.format(v)}")
    skipped = sum(metrics.get(k) or 0 for k in ("actor/skipped_updates", "critic/skipped_updates"))
    if skipped:  # shown only when it happens: a NaN/inf loss or gradient norm skipped an update
        parts.append(f"skipped {skipped:.0f}")
    for key in _eval_keys(metrics):   # on the steps that evaluated
        v = metrics[key]
        if isinstance(v, (int, float)) and math.isfinite(v):
            parts.append(f"{key.replace('/accuracy', ' acc').replace('/', ' ')} {v:.3f}")
    return "  ".join(parts)


def read_metrics(run_dir: Path, log: Log = print) -> list[dict[str, Any]]:
    """The rows of RUN/metrics.jsonl; a torn last line (a run still writing, or killed) is left
    out with a note through `log`; any other bad line is a RunDirError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RunDirError(f"{path} does not exist, so {run_dir} is not an edgerl run folder; give the folder "
                          "that edgerl train wrote (its --out)")
    rows, torn = _parse(path)
    if torn is not None and log is not None:
        log(_torn_note(path, torn))
    return [row for _, row in rows]


def read_samples(run_dir: Path, log: Log = print) -> list[dict[str, Any]]:
    """The rows of RUN/samples.jsonl (run.log_samples), read as read_metrics reads metrics.jsonl."""
    path = Path(run_dir) / SAMPLES
    if not path.is_file():
        raise RunDirError(f"{path} does not exist: the run wrote no samples (set run.log_samples)")
    rows, torn = _parse(path, "samples")
    if torn is not None and log is not None:
        log(_torn_note(path, torn, "samples"))
    return [row for _, row in rows]


PLOTS = (("reward/mean", "reward (mean)"), ("response/length_mean", "response length"),
         ("actor/kl", "KL to reference"), ("actor/entropy", "entropy"), ("actor/pg_loss", "policy loss"),
         ("actor/clip_frac", "clip fraction"), ("actor/grad_norm", "grad norm"),
         ("rollout/k3_kl", "KL rollout engine to trainer (k3)"),
         ("rollout_corr/weight_mean", "rollout correction weight (mean)"),
         ("perf/tokens_per_s", "tokens / s"), ("memory/peak_allocated_gib", "peak GPU memory (GiB)"))


IMAGE_TYPES = (".png", ".pdf", ".svg")


def _cumulative_seconds(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> training seconds up to and including it (perf/step_s summed; evaluation and setup left out)."""
    total, out = 0.0, {}
    for r in rows:
        v = r.get("perf/step_s")
        total += v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0
        out[r["step"]] = total
    return out


def plot(run_dirs: Path | list[Path], out: Optional[Path] = None, log: Log = print, overwrite: bool = False) -> Path:
    """An image of the main curves of one run, or of several side by side (one line per run, labelled with its
    folder's name, and a panel of held-out accuracy against training seconds); returns the path really written.

    `out` None or a folder: curves.png in it (one run; the run folder by default) or compare.png (several; the
    first run's folder by default); a name without a suffix gets '.png'; .pdf and .svg are written as such. A
    missing folder or another suffix is a ConfigError, and so is an existing file unless `overwrite`, but for
    the run folder's own default image (listed in its manifest: edgerl wrote it); no metrics is a RunDirError.
    The image is replaced atomically."""
    dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]
    several = len(dirs) > 1
    name = "compare.png" if several else "curves.png"

    def target() -> Path:
        if out is None:   # the run's own image: replaced each time, but never the user's file of that name
            path = output_file(dirs[0], IMAGE_TYPES, option="RUN_DIR", default_name=name)
            if path.exists() and not overwrite and path.name not in (owned(dirs[0]) or ()):
                raise ConfigError(f"{path} is not one edgerl wrote (the run folder's {MANIFEST} does not list "
                                  "it): pass --force to replace it, or --out to write the curves elsewhere")
            own(dirs[0], path.name)
            return path
        return output_file(out, IMAGE_TYPES, option="--out", default_name=name, overwrite=overwrite)
    path = target() if out is not None else None   # a bad --out fails before the metrics are read
    runs = []
    for d in dirs:
        rows = read_metrics(d, log)
        if not rows:
            raise RunDirError(f"{d / 'metrics.jsonl'} has no steps yet; plot once a step has finished")
        runs.append((d.resolve().name, rows))
    path = path or target()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    every = [r for _, rows in runs for r in rows]
    shown: list[tuple[Any, str]] = [(k, t) for k, t in PLOTS if any(isinstance(r.get(k), (int, float)) for r in every)]
    evals = _eval_keys({k for r in every for k, v in r.items() if isinstance(v, (int, float))})
    if evals:   # the held-out curves first: they say whether the run learns what it should
        if several:   # the headline key, one line per run, against steps and against training seconds
            shown[:0] = [(evals[:1], "held-out evaluation"), (("seconds", evals[0]), "held-out vs training seconds")]
        else:
            shown.insert(0, (evals, "held-out evaluation"))
    cols = 3
    nrows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, shown):
        for name, rows in runs:
            x_of = _cumulative_seconds(rows) if isinstance(key, tuple) else {r["step"]: r["step"] for r in rows}
            for k in ([key[1]] if isinstance(key, tuple) else key if isinstance(key, list) else [key]):
                pts = [(x_of[r["step"]], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
                label = name if several else k.removeprefix("eval/")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None, label=label)
        if isinstance(key, list) or several:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("training seconds" if isinstance(key, tuple) else "step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    try:  # the format from the final name: the temporary file's name is not the one written
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format=path.suffix[1:].lower()))
    finally:
        plt.close(fig)
    return path
