"""Per-step metrics: `metrics.jsonl` in the run folder (one JSON object per step), TensorBoard when
installed, and a rich progress line with the key numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

# shown live in the progress bar, in this order
KEY_METRICS = (("reward/mean", "reward", "{:.3f}"), ("response/length_mean", "len", "{:.0f}"),
               ("actor/kl", "kl", "{:.4f}"), ("actor/entropy", "ent", "{:.2f}"),
               ("perf/step_s", "s/step", "{:.1f}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"))


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null says "not defined this step"
    return v


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True, resume: bool = False) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        self._fh = open(self.path, "a")
        self.tb = None
        self.tb_note = "off"
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
                self.tb_note = f"TensorBoard logs in {Path(run_dir) / 'tensorboard'}"
            except ImportError:
                self.tb_note = "TensorBoard not installed (pip install tensorboard)"

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint (they will be redone)."""
        self._fh.close()
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))
        self._fh = open(self.path, "a")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def summary_line(metrics: dict[str, Any]) -> str:
    parts = []
    for key, label, fmt in KEY_METRICS:
        v = metrics.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            parts.append(f"{label} {fmt.format(v)}")
    return "  ".join(parts)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} an edgerl run folder?")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return rows


PLOTS = (("reward/mean", "reward (mean)"), ("response/length_mean", "response length"),
         ("actor/kl", "KL to reference"), ("actor/entropy", "entropy"), ("actor/pg_loss", "policy loss"),
         ("actor/clip_frac", "clip fraction"), ("actor/grad_norm", "grad norm"),
         ("perf/tokens_per_s", "tokens / s"), ("memory/peak_allocated_gib", "peak GPU memory (GiB)"))


def plot(run_dir: Path, out: Optional[Path] = None) -> Path:
    """A PNG of the main curves of a run; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no steps yet")
    shown = [(k, t) for k, t in PLOTS if any(isinstance(r.get(k), (int, float)) for r in rows)]
    cols = 3
    nrows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, shown):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
