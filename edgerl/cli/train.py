"""`edgerl train` and `edgerl plot`: parse, call the library, render."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgerl.config.load import quoted
from .app import ConfigOpt, SetOpt, console, friendly


@friendly
def train(profile: Optional[str] = typer.Option(None, "--profile", "--gpu", help="plan for (and emulate) this GPU profile"),
          model: Optional[str] = typer.Option(None, "--model", "-m", help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)"),
          data: Optional[str] = typer.Option(None, "--data", "-d", help="parquet/jsonl/csv file, HF dataset name, or builtin:arithmetic"),
          reward: Optional[str] = typer.Option(None, "--reward", help="custom reward function: path/to/file.py:fn"),
          steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps"),
          out: Optional[Path] = typer.Option(None, "--out", "-o", help="run folder (a new one; with --resume: branch "
                                             "into it from the checkpoint)"),
          resume: Optional[Path] = typer.Option(None, "--resume", help="continue a run folder (or one checkpoint folder)"),
          restart: bool = typer.Option(False, "--restart", help="start a new run in --out even though it holds "
                                       "one: that run's files are moved into OUT/earlier-run-N/, nothing is deleted"),
          final_only: bool = typer.Option(False, "--final-only", help="once the run finishes and final/ is "
                                          "written, remove its checkpoints (the best keeps its weights): less "
                                          "disk, but the run cannot be extended (run.final_only)"),
          config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt) -> None:
    """Train with PPO/GRPO on the plan for this GPU (or an emulated one). No arguments: the embedded demo."""
    extra = _options(model, data, profile, steps, final_only)
    if reward is not None:   # the run's reward from now on: it replaces reward.functions (a resumed run's too)
        extra += [(f"reward.functions=[{quoted(reward)}]", f"--reward {reward}"),
                  ("reward.weights=none", f"--reward {reward}")]
    _train(extra + list(sets or []), config, resume, out, restart)


@friendly
def sft(profile: Optional[str] = typer.Option(None, "--profile", "--gpu", help="plan for (and emulate) this GPU profile"),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)"),
        data: Optional[str] = typer.Option(None, "--data", "-d", help="chat rows ('messages') or prompt/response "
                                           "pairs: a parquet/jsonl/json/csv file or an HF dataset name"),
        steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps"),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="run folder (a new one; with --resume: branch "
                                           "into it from the checkpoint)"),
        resume: Optional[Path] = typer.Option(None, "--resume", help="continue a run folder (or one checkpoint folder)"),
        restart: bool = typer.Option(False, "--restart", help="start a new run in --out even though it holds "
                                     "one: that run's files are moved into OUT/earlier-run-N/, nothing is deleted"),
        final_only: bool = typer.Option(False, "--final-only", help="once final/ is written, remove the "
                                        "checkpoints (run.final_only)"),
        config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt) -> None:
    """Supervised fine-tuning on written answers (assistant tokens only), on the same plan, LoRA and run folder
    as train; then continue with RL: edgerl train --model RUN/final."""
    extra = [("sft.enabled=true", "edgerl sft"), *_options(model, data, profile, steps, final_only)]
    _train(extra + list(sets or []), config, resume, out, restart, "edgerl sft")


def _options(model: Optional[str], data: Optional[str], profile: Optional[str], steps: Optional[int],
             final_only: bool) -> list:
    """The options train and sft share as (key=value, the option as typed): an error names the option, not a
    --set."""
    extra = [(f"{key}={quoted(value)}", f"{opt} {value}") for key, value, opt in
             (("model.path", model, "--model"), ("data.path", data, "--data"), ("run.profile", profile, "--profile"))
             if value is not None]
    if steps is not None:
        extra.append((f"train.steps={steps}", f"--steps {steps}"))
    if final_only:
        extra.append(("run.final_only=true", "--final-only"))
    return extra


def _train(extra: list, config: Optional[Path], resume: Optional[Path], out: Optional[Path], restart: bool,
           command: str = "edgerl train") -> None:
    from edgerl.core.platforms import check_can_train
    check_can_train(command)   # native Windows: one line naming WSL2, before anything is imported or read
    from edgerl.core.errors import RunDirError
    from edgerl.rewards.contain import Interrupted
    from edgerl.train import session
    from edgerl.train.metrics import read_metrics, summary_line
    from edgerl.train.sft import trainer_for
    from .render import print_plan
    cfg, point = session.load(config, extra, resume, out)

    def log(s: str) -> None:
        console.print(f"[dim]{escape(s)}[/]", highlight=False, soft_wrap=True)  # paths stay whole for copying
    s = session.prepare(cfg, point, log=log, restart=restart)
    try:
        if s.finished:
            run = escape(str(s.run_dir))
            exported = any((s.run_dir / f).exists() for f in ("final", "final-adapter"))
            has = " and has its final model" if exported else ""
            console.print(f"nothing to do: {run} finished at step {point.step} (train.steps={cfg.train.steps}){has}; "
                          f"to train further, --resume {run} --steps N with N > {point.step}", highlight=False,
                          soft_wrap=True)
            return
        if s.emulation:
            console.print(f"[bold yellow]{escape(s.emulation)}[/]")
        log(s.data_report.lines()[0])
        print_plan(console, s.plan)
        console.print(f"[bold]Effective batch[/]: {cfg.effective_batch(s.plan.micro_batch)}")
        console.print(f"[bold]Run folder[/]: {escape(str(s.run_dir))}  (config.toml, plan.json, metrics.jsonl, "
                      "checkpoints/)", soft_wrap=True)
        try:
            trainer = trainer_for(s)
        except Interrupted as e:  # a signal while the reward file was imported
            console.print(f"[yellow]stopped: {escape(str(e))}; no step was trained[/]", soft_wrap=True)
            raise typer.Exit(130) from None
        log(f"rollout: {trainer.engine.describe()}; {trainer.metrics.note}" if trainer.engine is not None else
            f"sft: the assistant tokens' cross-entropy, no rollout; {trainer.metrics.note}")
        # the bar lives on a terminal only, and goes when training ends: each step's line is printed anyway (a log
        # file or a pipe would otherwise keep the bar's last frame)
        with Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[line]}"), console=console, transient=True,
                      disable=not console.is_terminal) as bar:
            task = bar.add_task("train", total=cfg.train.steps, completed=trainer.step, line="")

            def on_step(step: int, stats: dict) -> None:
                bar.update(task, completed=step, line=summary_line(stats))
                console.print(f"step {step:>4}  {summary_line(stats)}", highlight=False)
            trainer.run(on_step)
    finally:
        s.close()
    if trainer.stop_signal:
        from edgerl.train.checkpoint import latest
        run = escape(str(s.run_dir))
        way = (f"resume with edgerl train --resume {run}" if latest(s.run_dir) is not None else
               "no step was saved: run the same command again to start")
        console.print(f"[yellow]stopped by {trainer.stop_signal} after step {trainer.step}; {way}[/]", soft_wrap=True)
        from edgerl.train.ranks import leave_together
        leave_together()   # every rank stopped after the same step: they leave once rank 0 said so
        raise typer.Exit(130)
    from edgerl.train.ranks import shutdown
    shutdown()
    if not s.rank.main:
        return
    try:
        rows = read_metrics(s.run_dir, log=None)
    except RunDirError as e:   # the run finished: a file deleted or damaged since costs the summary only
        console.print(f"[yellow]no summary: {escape(str(e))}[/]", soft_wrap=True)
        rows = []
    rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), float)]
    if len(rewards) >= 10:
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        console.print(f"reward: mean {first:.3f} over the first 5 steps, {last:.3f} over the last 5")
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if isinstance(r.get("eval/accuracy"), (int, float))]
    if len(evals) >= 2:
        console.print(f"held-out accuracy: {evals[0][1]:.3f} at step {evals[0][0]}, {evals[-1][1]:.3f} at step "
                      f"{evals[-1][0]}")
    if trainer.state.loop.skipped_total:
        console.print(f"[yellow]{trainer.state.loop.skipped_total} update(s) were skipped for a NaN or infinite "
                      "loss or gradient norm (metrics: actor/skipped_updates)[/]")
    console.print(f"[bold green]done[/]: {trainer.step} steps; run folder {escape(str(s.run_dir))}; plot with "
                  f"edgerl plot {escape(str(s.run_dir))}", soft_wrap=True)
    if cfg.sft.enabled and (s.run_dir / "final").exists():
        console.print(f"continue with RL from it: edgerl train --model {escape(str(s.run_dir / 'final'))} --out NEW_RUN",
                      soft_wrap=True, highlight=False)


@friendly
def plot(run_dirs: list[Path] = typer.Argument(..., help="a run folder with metrics.jsonl, or several to compare"),
         out: Optional[Path] = typer.Option(None, "--out", "-o", help=".png (default RUN_DIR/curves.png, or the first "
                                            "folder's compare.png for several runs, replaced each time), .pdf or "
                                            ".svg; a folder gets curves.png or compare.png"),
         force: bool = typer.Option(False, "--force", help="replace an existing --out file")) -> None:
    """Write a PNG of a run's curves (reward, length, KL, entropy, losses, speed, memory); several runs on one
    figure, one line each, with held-out accuracy against training seconds too."""
    from edgerl.train.metrics import plot as plot_run
    path = plot_run(run_dirs, out, overwrite=force)
    console.print(f"wrote {escape(str(path))}", soft_wrap=True)
