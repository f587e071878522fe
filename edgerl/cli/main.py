"""The `edgerl` command. Each command is a few lines: call the library, render with rich."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from edgerl.config.schema import ConfigError
from edgerl.config.load import load_config, quoted
from edgerl.plan.modelspec import ModelSpecError
from edgerl.core.files import json_text, output_file, write_atomically
from edgerl.plan.plan import PlanError
from edgerl.device.profiles import list_profiles
from . import data as data_cmd
from . import evaluate as eval_cmd
from . import export as export_cmd
from . import train as train_cmd
from rich.markup import escape

from .app import RANK, ConfigOpt, GpuOpt, SetOpt, SpecOpt, app, console, err, friendly


def _version(value: bool) -> None:
    if value:
        from edgerl.core.version import describe
        typer.echo("\n".join(describe()))
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                          help="print edgerl's version and commit, torch's and CUDA's, and exit")
             ) -> None:
    quiet_library_bars()


def quiet_library_bars() -> None:
    """transformers' and the Hub's progress bars (loading weights, writing shards) redraw one line on a
    terminal; in a log file or a pipe every frame would stay. Off there unless HF_HUB_DISABLE_PROGRESS_BARS
    says otherwise."""
    if sys.stderr.isatty() or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is not None:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"   # read when the Hub's library is first imported
    if "transformers" in sys.modules:                  # already imported (the Python entry, tests)
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()


@app.command()
@friendly
def doctor(gpu: Optional[str] = GpuOpt, gpu_spec: Optional[str] = SpecOpt,
           model: Optional[str] = typer.Option(None, "--model", "-m", help="model for the plan summary"),
           config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt,
           as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
           bench: bool = typer.Option(False, "--bench", help="measure this GPU's matmul, memory and PCIe speed "
                                      "(a few seconds; cached per GPU and used by the plan)"),
           refresh: bool = typer.Option(False, "--refresh-bench", help="measure again even if a cached result exists"),
           nodes: int = typer.Option(1, "--nodes", min=1, max=1024, help="also check what a run over this many "
                                     "machines needs (NCCL, the network interface; the ranks' clocks under "
                                     "torchrun)"),
           selftest: bool = typer.Option(False, "--selftest", help="check every kernel the plan launches against its "
                                         "reference on this GPU, a small model's rollout and training steps, speed "
                                         "and memory (about two minutes); writes selftest.json"),
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="--selftest: where selftest.json goes "
                                              "(a file or a folder; default the current folder)"),
           force: bool = typer.Option(False, "--force", help="--selftest: replace an existing selftest.json")) -> None:
    """Is this machine ready to train, and if not, exactly what to fix. --selftest: is edgerl right on it."""
    import dataclasses
    from edgerl.doctor.doctor import Environment, exit_code, run_checks
    from edgerl.config.target import plan_for, resolve_target
    from .render import checks_table, print_plan
    cfg = load_config(config, list(sets or []) + ([(f"model.path={quoted(model)}", f"--model {model}")]
                                                  if model else []))
    target = resolve_target(gpu, gpu_spec)
    if selftest:
        from .selftest import run as run_selftest
        run_selftest(cfg, target, as_json, out, force)
    elif out is not None or force:
        raise ConfigError("--out and --force go with --selftest (the doctor's report is printed)")
    where = ""
    if bench or refresh:
        if target.simulated:
            raise ConfigError("--bench measures this machine's GPU; it cannot measure a GPU given by --gpu or "
                              "--gpu-spec (drop those, or drop --bench)")
        from edgerl.device.measure import cached_or_measured
        dev = target.device
        m, where = cached_or_measured(f"cuda:{dev.index}" if dev.is_cuda else "cpu", refresh=refresh)
        target = dataclasses.replace(target, device=dataclasses.replace(dev, measured=m))
    plan, plan_error = None, None
    try:
        plan = plan_for(cfg, target)
    except (PlanError, ModelSpecError) as e:
        plan_error = str(e)
    checks = run_checks(target.device, target.probe, plan, Environment(run_dir=cfg.run.out_dir or "runs"),
                        simulated=target.simulated)
    if nodes > 1 or RANK.world > 1:
        from edgerl.doctor.multinode import gathered_clocks, multinode_checks
        checks += multinode_checks(target.device.is_cuda, times=gathered_clocks())
    code = exit_code(checks)
    if as_json:
        m = target.device.measured
        out = {"device": target.device.describe(), "simulated": target.simulated,
               "checks": [c.to_dict() for c in checks], "plan": plan.to_dict() if plan else None,
               "plan_error": plan_error, "measured": m.to_dict() if m is not None else None, "ok": code == 0}
        typer.echo(json_text(out, indent=2, default=str))
        raise typer.Exit(code)
    if target.simulated:
        console.print(f"[bold]Simulating[/] {target.device.describe()} with this machine's software.")
    console.print(checks_table(checks))
    if where:
        console.print(f"[dim]measurements {escape(where)}[/]")
    if plan:
        print_plan(console, plan)
    else:
        console.print(f"[red]No plan:[/] {plan_error}")
    fails = sum(c.status == "fail" for c in checks)
    console.print(f"[bold red]{fails} check(s) failed.[/]" if fails else "[bold green]Ready.[/]")
    raise typer.Exit(code)


@app.command()
@friendly
def recommend(gpu: Optional[str] = GpuOpt, gpu_spec: Optional[str] = SpecOpt,
              model: Optional[str] = typer.Option(None, "--model", "-m", help="catalogue name, HF folder or cached HF id"),
              prompt_len: Optional[int] = typer.Option(None, help="prompt length in tokens"),
              response_len: Optional[int] = typer.Option(None, help="response length in tokens"),
              samples: Optional[int] = typer.Option(None, help="samples per prompt"),
              prompts: Optional[int] = typer.Option(None, help="prompts per step"),
              algo: Optional[str] = typer.Option(None, help="gae (PPO with a critic) | grpo | rloo | reinforce++"),
              lora: Optional[bool] = typer.Option(None, "--lora/--no-lora", help="force LoRA on or off "
                                                  "(default: the config's lora.enabled)"),
              gpus: int = typer.Option(1, "--gpus", min=1, max=4096, help="plan for N such GPUs per machine under "
                                       "torchrun (FSDP2 shards the training state over all of them); the plan is "
                                       "for one of them"),
              nodes: int = typer.Option(1, "--nodes", min=1, max=1024, help="machines, each with --gpus GPUs "
                                        "(torchrun --nnodes); the collectives' traffic is shown for --link-gbps"),
              link_gbps: Optional[float] = typer.Option(None, "--link-gbps", min=0.001, max=1e5,
                                                        help="the slowest link between the GPUs, in Gbit/s "
                                                        "(default: 1 between machines, consumer Ethernet; "
                                                        "PCIe 3.0 x16, 126, within one)"),
              config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt,
              fmt: str = typer.Option("text", "--format", "-f", help="text | toml | json | verl"),
              out: Optional[Path] = typer.Option(None, "--out", "-o", help="write to this file instead of stdout "
                                                 "(toml, json, verl); a folder gets run.toml, plan.json or verl.sh"),
              force: bool = typer.Option(False, "--force", help="replace an existing --out file")) -> None:
    """The plan for a GPU (yours or one you may not have): each decision with its reason, and the memory.
    Without --gpu, the config's run.profile names the GPU; without either, the plan is for this machine."""
    from edgerl.config.export import plan_toml, verl_overrides
    from edgerl.config.target import plan_for, resolve_target
    from .render import print_plan
    if fmt not in ("text", "toml", "json", "verl"):
        raise ConfigError(f"--format {fmt!r}: choose text, toml, json or verl")
    path = None
    if out is not None:  # checked before planning: a bad path fails at once, and nothing is half-written
        if fmt == "text":
            raise ConfigError("--out writes --format toml, json or verl; the text format is only printed")
        suffix, name = {"toml": (".toml", "run.toml"), "json": (".json", "plan.json"), "verl": (".sh", "verl.sh")}[fmt]
        path = output_file(out, (suffix,), option="--out", default_name=name, overwrite=force)
    extra: list = list(sets or [])
    # (key=value, the option as typed): an error names the option the user gave, not a --set
    for key, value, opt in (("model.path", quoted(model) if model else None, f"--model {model}"),
                            ("data.max_prompt_len", prompt_len, f"--prompt-len {prompt_len}"),
                            ("rollout.max_new_tokens", response_len, f"--response-len {response_len}"),
                            ("rollout.n_samples", samples, f"--samples {samples}"),
                            ("train.prompts_per_step", prompts, f"--prompts {prompts}"),
                            ("algo.advantage", quoted(algo) if algo else None, f"--algo {algo}"),
                            ("lora.enabled", str(lora).lower() if lora is not None else None,
                             "--lora" if lora else "--no-lora")):
        if value is not None:
            extra.append((f"{key}={value}", opt))
    cfg = load_config(config, extra)
    # the GPU named here, else the config's run.profile (a recipe's card), else this machine's
    target = resolve_target(gpu or (None if gpu_spec else cfg.run.profile), gpu_spec)
    p = plan_for(cfg, target, world_size=gpus * nodes)
    traffic = None
    if gpus * nodes > 1:
        from edgerl.plan.traffic import plan_traffic
        traffic = plan_traffic(p, nodes, link_gbps or (1.0 if nodes > 1 else 126.0))
    if fmt == "text":
        from edgerl.plan.plan import longest_line
        from edgerl.config.target import overrides_from_config
        print_plan(console, p)
        if traffic is not None:
            console.print(traffic.line(), soft_wrap=True, highlight=False)
        console.print(longest_line(p.device, p.model, p.task, overrides_from_config(cfg, target.profile)),
                      soft_wrap=True, highlight=False)
        from edgerl.plan import timing
        console.print(timing.line(p), soft_wrap=True, highlight=False)
        return
    if fmt == "toml":
        text = plan_toml(cfg, p, target.profile.name if target.simulated and target.profile else None)
    elif fmt == "json":
        from edgerl.config.target import overrides_from_config
        from edgerl.plan.plan import longest_response
        longest, _ = longest_response(p.device, p.model, p.task, overrides_from_config(cfg, target.profile))
        from edgerl.plan import timing
        est = timing.for_plan(p)
        doc = p.to_dict() | {"longest_response": longest, "step_time": est.to_dict() if est else None}
        if traffic is not None:
            doc["traffic"] = dataclasses.asdict(traffic) | {"total_bytes": traffic.total_bytes, "nodes": nodes}
        text = json_text(doc, indent=2, default=str)
    else:
        lines, caveats = verl_overrides(cfg, p)
        text = "\n".join([f"# {c}" for c in caveats] + ["python -m verl.trainer.main_ppo \\"]
                         + [f"    {line} \\" for line in lines[:-1]] + [f"    {lines[-1]}"])
    if path is not None:
        write_atomically(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
        err.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    else:
        typer.echo(text)


@app.command()
@friendly
def profiles() -> None:
    """The GPU profiles edgerl can plan for."""
    from rich.table import Table
    t = Table(title="GPU profiles (edgerl recommend --gpu NAME)", title_justify="left")
    t.add_column("name", no_wrap=True, style="bold")
    for col in ("GPU", "CC", "memory", "bandwidth", "tensor cores", "provenance"):
        t.add_column(col)
    for p in list_profiles():
        cc = f"{p.cc[0]}.{p.cc[1]}" if p.cc else "-"
        mem = f"{p.memory_bytes / 2**30:.0f} GiB" if p.memory_bytes else "host RAM"
        bw = f"{p.memory_bandwidth_gbs:g} GB/s" if p.memory_bandwidth_gbs else "-"
        tc = "-" if p.tensor_cores is None else ("yes" if p.tensor_cores else "no")
        t.add_row(p.name, p.display, cc, mem, bw, tc, f"{len(p.measured)} measured" if p.measured else "datasheet")
    console.print(t)


@app.command("config")
@friendly
def config_cmd(config: Optional[Path] = ConfigOpt, sets: Optional[List[str]] = SetOpt) -> None:
    """Print a run config with every key, its value and what it does (the defaults, or your file with
    --set applied): a starting point for `edgerl train --config`."""
    from edgerl.config.schema import to_toml
    typer.echo(to_toml(load_config(config, list(sets or []))))


app.command()(train_cmd.train)
app.command()(train_cmd.sft)
app.command()(train_cmd.plot)
app.command("eval")(eval_cmd.evaluate)
app.command("export")(export_cmd.export)
app.add_typer(data_cmd.app, name="data")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
