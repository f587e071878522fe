"""The Python entry, for notebooks and scripts: what `edgerl train` does, as two calls.

    import edgerl
    run = edgerl.prepare("examples/demo-cpu.toml", train={"steps": 4}, **{"eval.every": 2})
    print(run.plan.reasons["micro_batch"], run.run_dir)
    run.train()                      # returns the run folder; run.metrics() reads metrics.jsonl

`prepare` reads the config (a TOML path, a Config, a dict of sections, or None for the defaults), applies
the overrides (a section name with a dict of keys, or a dotted key), plans for the GPU and writes the run
folder: errors in anything the user gave are raised there, as edgerl.core.errors exceptions, before
anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Union

from edgerl.config.schema import Config, ConfigError, _toml_value, to_dict
from edgerl.train import session as sessions


def _sets(overrides: dict[str, Any]) -> list[tuple[str, str]]:
    """--set items ('key=value', how the error names it) from prepare's keyword arguments."""
    out: list[tuple[str, str]] = []

    def add(key: str, value: Any) -> None:
        try:
            text = "none" if value is None else _toml_value(list(value) if isinstance(value, tuple) else value)
        except TypeError:
            raise ConfigError(f"prepare({key}={value!r}): a config value is a number, a string, a bool, a list of "
                              f"those or None (got {type(value).__name__})") from None
        out.append((f"{key}={text}", f"prepare({key}={value!r})"))
    for key, value in overrides.items():
        if "." in key:
            add(key, value)
        elif isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}.{k}", v)
        else:
            raise ConfigError(f"prepare({key}={value!r}): give a section with a dict of its keys, e.g. "
                              f"train={{'steps': 4}}, or a dotted key, e.g. **{{'train.steps': 4}}")
    return out


class Run:
    """A prepared run: its config, plan and folder (locked until `train` ends or `close`)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.trainer: Any = None

    @property
    def config(self) -> Config:
        return self.session.cfg

    @property
    def plan(self) -> Any:
        return self.session.plan

    @property
    def run_dir(self) -> Path:
        return self.session.run_dir

    def train(self, on_step: Optional[Callable[[int, dict], None]] = None) -> Path:
        """Train to train.steps (evaluating where eval.* says); `on_step(step, metrics)` after each step
        (and after the evaluation before the first). Returns the run folder."""
        from edgerl.train.sft import trainer_for
        if self.session.finished:
            self.close()
            return self.run_dir
        if self.trainer is None:
            self.trainer = trainer_for(self.session)   # refuses a run whose folder is no longer locked (closed)
        return self.trainer.run(on_step)

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl so far."""
        from edgerl.train.metrics import read_metrics
        return read_metrics(self.run_dir, log=None)

    def close(self) -> None:
        """Release the run folder without training (train() releases it when it ends)."""
        self.session.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _quiet(_: str) -> None:
    """prepare(log=None): no messages."""


def prepare(config: Union[str, Path, Config, dict, None] = None, *, resume: Union[str, Path, None] = None,
            out: Union[str, Path, None] = None, log: Optional[Callable[[str], None]] = print,
            **overrides: Any) -> Run:
    """A run ready to train: the config (a TOML file, a Config, a dict of sections or None) with
    `overrides` (train={'steps': 4} or **{'train.steps': 4}); `resume` a run folder or checkpoint to
    continue, `out` the run folder (with `resume`: branch into it); `log` receives each message (None:
    none). Raises edgerl's user errors (edgerl.core.errors), with the messages the CLI prints."""
    if log is None:
        log = _quiet
    elif not callable(log):
        raise ConfigError(f"prepare(log={log!r}): give a function that takes one line of text (print, say), or "
                          "None for no messages")
    if not isinstance(config, (str, Path, Config, dict, type(None))):
        raise ConfigError(f"prepare({config!r}): the config is a TOML file's path, a Config, a dict of sections "
                          f"({{'train': {{'steps': 4}}}}) or None for the defaults (got {type(config).__name__})")
    for name, value in (("resume", resume), ("out", out)):
        if not isinstance(value, (str, Path, type(None))):
            raise ConfigError(f"prepare({name}={value!r}): give a folder's path (a str or a Path; got "
                              f"{type(value).__name__})")
    sets = _sets(overrides)
    if isinstance(config, Config):
        base, path = to_dict(config), None
    elif isinstance(config, dict):
        base, path = json.loads(json.dumps(config)), None   # a copy the loader may change
    else:
        base, path = None, Path(config) if config is not None else None
    if base is not None:
        base = {sec: {k: v for k, v in keys.items() if v is not None} if isinstance(keys, dict) else keys
                for sec, keys in base.items()}
        from edgerl.config.load import load_config
        cfg = load_config(None, sets, base=base)
        point = None
        if resume is not None:
            raise ConfigError("prepare(resume=...) continues a run with its own config: give the run folder "
                              "and overrides only, not a config")
        if out is not None:
            cfg.run.out_dir = str(out)
    else:
        cfg, point = sessions.load(path, sets, Path(resume) if resume is not None else None,
                                   Path(out) if out is not None else None)
    return Run(sessions.prepare(cfg, point, log=log))
