"""rich rendering shared by the commands: plans, memory breakdowns, doctor checks."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from edgerl.doctor.doctor import Check
from edgerl.plan import table
from edgerl.plan.memory import fmt_bytes
from edgerl.plan.plan import Plan

STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}


def plan_table(p: Plan, title: str = "") -> Table:
    t = Table(title=title or f"Plan for {p.model.name} on {p.device.describe()}", show_lines=False,
              title_justify="left")
    t.add_column("decision", style="bold")
    t.add_column("value")
    t.add_column("why", style="dim", overflow="fold")
    rows = table.rows()
    for key, value in p.decisions().items():
        row = rows[key]
        t.add_row(row.label, row.render(value), p.reasons.get(key, ""))
    return t


def memory_table(p: Plan) -> Table:
    m = p.memory
    phases = m.phase_totals()
    t = Table(title=f"Memory by phase (peak: {m.peak_phase})", title_justify="left")
    t.add_column("component")
    for ph in phases:
        t.add_column(ph + (" *" if ph == m.peak_phase else ""), justify="right")
    names: list[str] = []
    for comps in m.phases.values():
        names += [n for n in comps if n not in names]
    for n in names:
        t.add_row(n, *[fmt_bytes(m.phases[ph].get(n)) if m.phases[ph].get(n) else "-" for ph in phases])
    t.add_row("[bold]total", *[f"[bold]{fmt_bytes(v)}" for v in phases.values()])
    return t


def budget_line(p: Plan) -> str:
    """The budget under the memory table (a line of its own: a caption would wrap at the table's width)."""
    m = p.memory
    verdict = "[green]fits[/]" if m.fits else "[red]does not fit[/]"
    return (f"budget {fmt_bytes(m.budget)} = device {fmt_bytes(m.budget + p.headroom)} - headroom "
            f"{fmt_bytes(p.headroom)}: {verdict}" + (f"; host RAM for offload {fmt_bytes(m.host_needed)}"
                                                     if m.host_needed else ""))


def print_plan(console: Console, p: Plan) -> None:
    console.print(f"[bold]Device[/]: {p.device.describe()}" + (f"  [dim]({p.device.note})[/]" if p.device.note else ""))
    console.print(f"[bold]Model[/]: {p.model.describe()}")
    console.print(f"[bold]Batch[/]: {p.task.effective_batch()}; micro-batch {p.micro_batch}; prompt "
                  f"{p.task.prompt_len} + response {p.task.response_len} tokens")
    console.print(plan_table(p))
    console.print(memory_table(p))
    console.print(budget_line(p), soft_wrap=True)


def checks_table(checks: list[Check]) -> Table:
    t = Table(title="edgerl doctor", title_justify="left")
    t.add_column("check", style="bold")
    t.add_column("status")
    t.add_column("found", overflow="fold")
    t.add_column("fix", style="cyan", overflow="fold")
    for c in checks:
        t.add_row(c.name, STATUS_STYLE[c.status], c.detail, c.fix)
    return t
