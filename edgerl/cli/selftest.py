"""`edgerl doctor --selftest`: run the self-test for the plan this machine's task gets, print a verdict per
check and the text for a bug report, write selftest.json."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from .app import console, err

STYLE = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}


def run(cfg, target, as_json: bool, out: Optional[Path], force: bool) -> None:
    """Raises typer.Exit: 0 when no check failed, 1 otherwise (2 for bad input, through `friendly`)."""
    from edgerl.core.errors import ConfigError
    from edgerl.core.files import json_text, output_file
    from edgerl.doctor.selftest import run_selftest, write_report
    from edgerl.config.target import plan_for
    from edgerl.train import session
    from edgerl.train.selftest_model import model_checks
    # checked before the run: a bad path fails at once, and an existing report is kept unless --force
    path = output_file(out if out is not None else Path("."), (".json",), option="--out",
                       default_name="selftest.json", overwrite=force)
    if target.simulated and target.device.is_cuda and not target.real.is_cuda:
        raise ConfigError(f"--selftest --profile {target.profile.name if target.profile else ''} runs the profile's "
                          f"code path on this machine's GPU, and there is none ({target.real.note}); drop --profile")
    device, emulation = session.device_for(target, cfg)
    plan = plan_for(cfg, target)
    session.apply_env(plan, device)
    session.apply_switches(plan, device)
    if not as_json:
        if emulation:
            console.print(f"[bold yellow]{escape(emulation)}[/]")
        console.print(f"Self-test of the plan for {escape(plan.model.name)} on {escape(plan.device.describe())}: "
                      f"{plan.dtype.compute}, log-probs {plan.kernel_backend}, decode backend "
                      f"{plan.decode_backend or plan.rollout_engine}, optimizer {plan.optimizer}", highlight=False)

    def show(v) -> None:
        if as_json:
            return
        line = f"{STYLE[v.status]}  [bold]{escape(v.name)}[/]: {escape(v.detail)}"
        if v.status == "fail":
            line += f"; avoid it with [bold]--set {escape(v.avoid)}[/]" if v.avoid else "; no setting avoids it"
        console.print(line, highlight=False, soft_wrap=True)

    st = run_selftest(plan, device, model_checks, emulation=emulation, log=show)
    write_report(st, path)
    code = 0 if st.ok else 1
    if as_json:   # the JSON on stdout, where the report went on stderr: both stay readable
        typer.echo(json_text(st.to_dict(), indent=2, default=str))
        err.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code)
    c = st.counts()
    console.print(f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped in {st.seconds:.0f} s",
                  style="bold red" if c["fail"] else "bold green", highlight=False)
    console.print(f"\nFor a bug report, paste this or send {escape(str(path))}:", highlight=False, soft_wrap=True)
    typer.echo("```\n" + st.report_text() + "\n```")
    err.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
