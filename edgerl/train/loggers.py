"""Where metrics go besides metrics.jsonl (`run.loggers`): TensorBoard, Weights & Biases, MLflow. Rank 0
alone logs. Each is an optional package, imported only when named:

    tensorboard   pip install 'edgerl[tensorboard]'   <run>/tensorboard (scalars; samples in the text tab)
    wandb         pip install 'edgerl[wandb]'         project run.project or $WANDB_PROJECT or 'edgerl'
    mlflow        pip install 'edgerl[mlflow]'        experiment run.project or $MLFLOW_EXPERIMENT_NAME or 'edgerl'

A resumed run logs into the same wandb / MLflow run: their ids are kept in <run>/loggers.json.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from edgerl.core.errors import ConfigError, TrainingError
from edgerl.core.files import json_text, write_atomically
from edgerl.train.manifest import own

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}   # logger -> its module
IDS_FILE = "loggers.json"


def check_installed(names: Sequence[str]) -> None:
    """A ConfigError naming the extra to install for the first logger whose package is missing (checked
    before the run folder is written). TensorBoard is the exception: a run without it logs on and says so."""
    for name in names:
        module = EXTRAS.get(name)
        if name != "tensorboard" and module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"run.loggers names {name!r}, but {module} is not installed: pip install "
                              f"'edgerl[{name}]' (or remove it from run.loggers)")


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _markdown(rows: list[dict[str, Any]]) -> str:
    """Sample rows as a markdown table for TensorBoard's text tab."""
    def cell(v: Any) -> str:
        s = f"{v:.4g}" if isinstance(v, float) else str(v)
        return s.replace("|", "\\|").replace("\n", "<br>")
    cols = ["prompt", "response", "reward", "ground_truth"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.folder = Path(run_dir) / "tensorboard"
        own(run_dir, self.folder.name)
        self.writer = SummaryWriter(str(self.folder))

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        for k, v in _numbers(values).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text(f"samples/{kind}", _markdown(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, project: str, run_id: Optional[str]) -> None:
        import wandb
        self.wandb = wandb
        own(run_dir, "wandb")   # wandb writes its files in RUN/wandb/
        self.run = wandb.init(project=project, name=Path(run_dir).name, id=run_id, resume="allow", config=config,
                              dir=str(run_dir))
        self.id = getattr(self.run, "id", run_id)

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        self.run.log(_numbers(values), step=step)

    def samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        cols = ["step", "prompt", "response", "reward", "ground_truth"]
        table = self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
        self.run.log({f"samples/{kind}": table}, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_KEY = re.compile(r"[^0-9A-Za-z_\-. /]")


class MLflow:
    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict, project: str, run_id: Optional[str]) -> None:
        import mlflow
        self.mlflow = mlflow
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else Path(run_dir).name)
        self.id = self.run.info.run_id
        if run_id is None:
            mlflow.log_params({k: str(v)[:500] for k, v in _flat(config).items()})

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        # MLflow's keys allow letters, digits, _ - . / and spaces: eval/pass@4 becomes eval/pass_at_4
        self.mlflow.log_metrics({_MLFLOW_KEY.sub("_", k.replace("@", "_at_")): v
                                 for k, v in _numbers(values).items()}, step=step)

    def samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        self.mlflow.log_text(json_text(rows, indent=1), f"samples/{kind}-step-{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _said(e: BaseException) -> str:
    """A package's exception as a clause: its type and its first 200 characters, one line."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _close(lg: Any, log: Callable[[str], None]) -> None:
    try:
        lg.close()
    except Exception as e:   # the run is over: a logger that cannot finish is said, not raised
        log(f"{lg.name} did not close cleanly ({_said(e)}); metrics.jsonl holds every step")


def log_step(loggers: Sequence[Any], what: str, step: int, *args: Any) -> None:
    """Each logger's `what` ('metrics' or 'samples') for `step`. A logger's own failure (a dropped
    connection) is a TrainingError naming it: the run saves its last step and stops in one line."""
    for lg in loggers:
        try:
            getattr(lg, what)(step, *args)
        except Exception as e:
            raise TrainingError(f"run.loggers: {lg.name} failed to log step {step} ({_said(e)}); metrics.jsonl "
                                f"holds every step: fix it or remove {lg.name} from run.loggers, then resume") from None


def close_loggers(loggers: Sequence[Any], log: Callable[[str], None]) -> None:
    for lg in loggers:
        _close(lg, log)


def _project(configured: Optional[str], env: str) -> str:
    return configured or os.environ.get(env) or "edgerl"


def open_loggers(names: Sequence[str], run_dir: Path, config: dict, project: Optional[str], resume: bool,
                 log: Callable[[str], None]) -> tuple[list[Any], str]:
    """The loggers of `names` (besides 'jsonl', which metrics.jsonl is), and one line saying where they log."""
    run_dir = Path(run_dir)
    ids_path = run_dir / IDS_FILE
    ids: dict[str, str] = {}
    if resume and ids_path.exists():
        try:
            ids = json.loads(ids_path.read_text())
        except (OSError, ValueError):
            ids = None
        if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
            log(f"{ids_path} is unreadable (not an object of run ids); wandb / MLflow start new runs")
            ids = {}
    out: list[Any] = []
    notes: list[str] = []
    for name in names:
        if name == "tensorboard":
            try:
                tb = TensorBoard(run_dir)
            except ImportError:
                notes.append("TensorBoard not installed (pip install 'edgerl[tensorboard]')")
                continue
            out.append(tb)
            notes.append(f"TensorBoard logs in {tb.folder}")
        elif name in ("wandb", "mlflow"):
            cls, env = (Wandb, "WANDB_PROJECT") if name == "wandb" else (MLflow, "MLFLOW_EXPERIMENT_NAME")
            where = _project(project, env)
            try:
                lg = cls(run_dir, config, where, ids.get(name))
            except Exception as e:   # the package's own errors (no network, a project name it refuses)
                for started in out:
                    _close(started, log)
                fix = ("check the network, or log offline (WANDB_MODE=offline)" if name == "wandb" else
                       "check MLFLOW_TRACKING_URI and the network")
                raise ConfigError(f"run.loggers: {name} could not start a run in project {where!r} ({_said(e)}); "
                                  f"{fix}, or remove {name} from run.loggers") from None
            ids[name] = lg.id
            out.append(lg)
            notes.append(f"{'wandb' if name == 'wandb' else 'MLflow'} run {lg.id}")
    if any(k in ids for k in ("wandb", "mlflow")):
        own(run_dir, IDS_FILE)
        write_atomically(ids_path, lambda tmp: tmp.write_text(json_text(ids) + "\n"))
    return out, "; ".join(notes) or "metrics in metrics.jsonl only"
