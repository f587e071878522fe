"""The README states what the code does: its decisions table is plan()'s, and CI runs its test command."""

import re
from pathlib import Path

from edgerl.plan.explain import decision_table

ROOT = Path(__file__).resolve().parents[1]


def test_decisions_table_is_generated_by_plan():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- decisions:start -->\n(.*?)\n<!-- decisions:end -->", readme, re.S)
    assert block, "README lacks the decisions block"
    assert block.group(1).strip() == decision_table().strip(), \
        "README's decisions table is stale: paste the output of `python -m edgerl.plan.explain`"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup, tests = "bash scripts/setup.sh", ".venv/bin/python -m pytest -q"
    assert f"{setup} && {tests}" in readme and f"{setup} && .venv/bin/edgerl train --config examples/demo-cpu.toml" in readme
    assert setup in ci and tests in ci
    assert (ROOT / "examples" / "demo-cpu.toml").exists()
