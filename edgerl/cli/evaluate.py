"""`edgerl eval`: a held-out evaluation of a run, a checkpoint or a model, on its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .app import ConfigOpt, SetOpt, console, err, friendly


@friendly
def evaluate(target: str = typer.Argument(..., help="a run folder (its latest checkpoint), a checkpoint folder, or a "
                                          "model (HF folder or id, catalogue name, an export such as RUN/final)"),
             data: Optional[str] = typer.Option(None, "--data", "-d", help="held-out prompts: a file, an HF dataset or "
                                                "builtin:arithmetic (default: the config's eval.data)"),
             split: Optional[str] = typer.Option(None, "--split", help="split of an HF dataset (default: test, else "
                                                 "validation)"),
             samples: Optional[int] = typer.Option(None, "--samples", "-k", help="k sampled answers per prompt for "
                                                   "mean@k and pass@k (0: greedy only)"),
             max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="evaluate the first N prompts"),
             profile: Optional[str] = typer.Option(None, "--profile", "--gpu", help="plan for (and emulate) this GPU"),
             out: Optional[Path] = typer.Option(None, "--out", "-o", help="write the metrics and every answer as JSON "
                                               "(a new file outside any run folder)"),
             force: bool = typer.Option(False, "--force", help="replace an existing --out file"),
             config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt) -> None:
    """Greedy accuracy (and mean@k / pass@k) of a run, checkpoint or model on held-out prompts."""
    from edgerl.core.errors import ConfigError
    from edgerl.core.files import json_text, output_file, write_atomically
    from edgerl.train.eval_run import load_eval_config, run_eval
    from edgerl.train.runfolder import enclosing_run
    path = None
    if out is not None:   # checked before the work
        path = output_file(out, (".json",), option="--out")
        run = enclosing_run(path)
        if run is not None:
            raise ConfigError(f"--out {out} is inside the run folder {run}: edgerl eval never writes into a run "
                              "(its files are the run's); choose a path outside it")
        output_file(out, (".json",), option="--out", overwrite=force)   # an existing file needs --force
    extra: list = []
    for key, value, opt in (("eval.data", data, "--data"), ("eval.split", split, "--split"),
                            ("run.profile", profile, "--profile")):
        if value is not None:
            extra.append((f"{key}={json.dumps(value)}", f"{opt} {value}"))
    for key, num, opt in (("eval.samples", samples, "--samples"), ("eval.max_prompts", max_prompts, "--max-prompts")):
        if num is not None:
            extra.append((f"{key}={num}", f"{opt} {num}"))
    cfg, ckpt = load_eval_config(target, extra + list(sets or []), config)

    def log(s: str) -> None:
        console.print(f"[dim]{escape(s)}[/]", highlight=False, soft_wrap=True)
    result = run_eval(cfg, ckpt, log)
    t = Table(title=f"{escape(target)} on {escape(str(cfg.eval.data))}", title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    for k, v in result["metrics"].items():
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(t)
    if path is not None:
        text = json_text(result, indent=1, default=str)
        write_atomically(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
        err.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
