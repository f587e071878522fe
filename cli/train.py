"""`edgerl train` and `edgerl plot`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import ConfigError, load_config, to_toml
from .main import ConfigOpt, SetOpt, app, console, friendly


def _device_for(target, cfg) -> tuple[Any, str]:
    """The torch device to train on, and how a profile is emulated on it."""
    import torch
    from ..memory import DEFAULT_CALIBRATION
    real = target.probe.primary
    if not target.simulated:
        return (torch.device("cuda", real.index) if real.is_cuda else torch.device("cpu")), ""
    dev = target.device
    if not dev.is_cuda:
        return torch.device("cpu"), "profile cpu: training on the CPU"
    if not real.is_cuda:
        raise ConfigError(f"--profile {cfg.run.profile} plans for a {dev.name}, but this machine has no usable GPU "
                          f"({real.note}); use --profile cpu, or run edgerl recommend --gpu {cfg.run.profile} to "
                          "see the plan")
    if dev.total_memory > real.total_memory:
        raise ConfigError(f"--profile {cfg.run.profile} has {dev.total_memory / 2**30:.0f} GiB, more than this "
                          f"{real.name} ({real.total_memory / 2**30:.0f} GiB): a bigger GPU cannot be emulated")
    # The cap covers torch's allocator; the CUDA context lives outside it, as on the real card.
    share = max(0.01, (dev.total_memory - DEFAULT_CALIBRATION.cuda_context) / real.total_memory)
    torch.cuda.set_per_process_memory_fraction(min(1.0, share), real.index)
    return torch.device("cuda", real.index), (
        f"emulating {dev.describe()} on {real.describe()}: memory capped at {share:.1%} of this GPU, the "
        f"profile's dtype, attention and kernel limits apply; speed is NOT emulated")


@app.command()
@friendly
def train(profile: Optional[str] = typer.Option(None, "--profile", "--gpu", help="plan for (and emulate) this GPU profile"),
          model: Optional[str] = typer.Option(None, "--model", "-m", help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)"),
          data: Optional[str] = typer.Option(None, "--data", "-d", help="parquet/jsonl/csv file, HF dataset name, or builtin:arithmetic"),
          reward: Optional[str] = typer.Option(None, "--reward", help="custom reward function: path/to/file.py:fn"),
          steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps"),
          out: Optional[Path] = typer.Option(None, "--out", "-o", help="run folder"),
          resume: Optional[Path] = typer.Option(None, "--resume", help="continue a run folder (or one checkpoint folder)"),
          config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt) -> None:
    """Train with PPO/GRPO on the plan for this GPU (or an emulated one). No arguments: the embedded demo."""
    import torch
    from .. import checkpoint
    from ..checkpoint import CheckpointError
    from ..target import model_spec, plan_for, resolve_target
    from ..trainer import Trainer
    from .render import print_plan
    extra = list(sets or [])
    for key, value in (("model.path", model), ("data.path", data), ("reward.function", reward),
                       ("run.out_dir", str(out) if out else None), ("run.profile", profile)):
        if value is not None:
            extra.append(f"{key}={json.dumps(value)}")
    if steps is not None:
        extra.append(f"train.steps={steps}")
    ckpt = None
    if resume is not None:
        ckpt = resume if (resume / "meta.json").exists() else checkpoint.latest(resume)
        if ckpt is None:
            raise CheckpointError(f"--resume {resume}: no checkpoint in {resume / 'checkpoints'}")
        run_dir = ckpt.parent.parent
        if config is None and (run_dir / "config.toml").exists():
            config = run_dir / "config.toml"  # resume with the run's own config; --set still applies
        extra.append(f"run.out_dir={json.dumps(str(run_dir))}")
    cfg = load_config(config, extra)
    target = resolve_target(cfg.run.profile)
    device, emulation = _device_for(target, cfg)
    plan = plan_for(cfg, target, model_spec(cfg))
    for k, v in plan.env:
        if k == "PYTORCH_CUDA_ALLOC_CONF" and device.type == "cuda":
            import os
            if not os.environ.get(k):
                torch.cuda.memory._set_allocator_settings(v)  # the probe already started CUDA
    run_dir = Path(cfg.run.out_dir or f"runs/{Path(cfg.model.path).name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        (run_dir / "config.toml").write_text(to_toml(cfg))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2, default=str))
    if emulation:
        console.print(f"[bold yellow]{emulation}[/]")
    print_plan(console, plan)
    console.print(f"[bold]Effective batch[/]: {cfg.effective_batch().replace('chosen by the plan', f'{plan.micro_batch} (plan)')}")
    console.print(f"[bold]Run folder[/]: {run_dir}  (config.toml, plan.json, metrics.jsonl, checkpoints/)")
    trainer = Trainer(cfg, plan, device, run_dir, log=lambda s: console.print(f"[dim]{s}[/]", highlight=False),
                      resume=ckpt)
    console.print(f"[dim]rollout: {trainer.engine.describe()}; {trainer.metrics.tb_note}[/]")
    from ..metrics import summary_line
    with Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[line]}"), console=console, transient=False) as bar:
        task = bar.add_task("train", total=cfg.train.steps, completed=trainer.step, line="")

        def on_step(step: int, stats: dict) -> None:
            bar.update(task, completed=step, line=summary_line(stats))
            console.print(f"step {step:>4}  {summary_line(stats)}", highlight=False)
        trainer.run(on_step)
    if trainer.stop_signal:
        console.print(f"[yellow]stopped by {trainer.stop_signal} after step {trainer.step}; resume with "
                      f"edgerl train --resume {run_dir}[/]")
        raise typer.Exit(130)
    from ..metrics import read_metrics
    rewards = [r["reward/mean"] for r in read_metrics(run_dir) if isinstance(r.get("reward/mean"), float)]
    if len(rewards) >= 10:
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        console.print(f"reward: mean {first:.3f} over the first 5 steps, {last:.3f} over the last 5")
    console.print(f"[bold green]done[/]: {trainer.step} steps; run folder {run_dir}; plot with edgerl plot {run_dir}")


@app.command()
@friendly
def plot(run_dir: Path = typer.Argument(..., help="a run folder with metrics.jsonl"),
         out: Optional[Path] = typer.Option(None, "--out", "-o", help="PNG path (default RUN_DIR/curves.png)")) -> None:
    """Write a PNG of a run's curves (reward, length, KL, entropy, losses, speed, memory)."""
    from ..metrics import plot as plot_run
    try:
        path = plot_run(run_dir, out)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    console.print(f"wrote {path}")
