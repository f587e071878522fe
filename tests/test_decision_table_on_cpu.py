"""The plan's decision table (edgerl/plan/table.py) is the one place a decision is declared: a row added
in a test shows up in the plan, the [plan] config section, `recommend`'s table and its pinned config."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import edgerl.config.target
from edgerl.cli.main import app
from edgerl.config import schema
from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError, PlanError
from edgerl.plan import table
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import Task, plan
from edgerl.plan.table import Decision
from fakes import fake_probe

runner = CliRunner()


def fake_step(c):
    """Depends on another decision (read on first use) and on its own override."""
    forced = c.forced("tile_rows")
    if forced is not None:
        return forced, f"asked for with plan.tile_rows={forced}"
    rows = 8 if c["dtype"].compute == "fp32" else 16
    return rows, f"{rows} rows: the fake rule for {c['dtype'].compute}"


@pytest.fixture
def fake_decision(monkeypatch):
    row = Decision("tile_rows", "tile rows", fake_step, "rows per fake tile", int,
                   range=("[1, 64]", "a fake tile holds 1 to 64 rows"), pin=True)
    monkeypatch.setattr(table, "TABLE", table.TABLE + (row,))
    monkeypatch.setattr(schema, "PlanOverrides", schema.plan_overrides(table.TABLE))
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None))
    return row


def run(*args):
    return runner.invoke(app, list(args))


def test_a_row_is_a_decision_of_the_plan(fake_decision):
    p = plan(fake_probe("T4").primary, CATALOGUE["qwen2.5-0.5b"], Task())
    assert p.tile_rows == 16 and p.decisions()["tile_rows"] == 16
    assert p.to_dict()["reasons"]["tile_rows"] == "16 rows: the fake rule for fp16"
    forced = plan(fake_probe("T4").primary, CATALOGUE["qwen2.5-0.5b"], Task(), {"tile_rows": 4})
    assert forced.tile_rows == 4 and "asked for" in forced.reasons["tile_rows"]


def test_a_row_is_a_config_key_with_its_type_and_range(fake_decision):
    assert load_config(sets=["plan.tile_rows=4"]).plan.tile_rows == 4
    with pytest.raises(ConfigError, match=r"--set plan.tile_rows=abc: expected int \| none"):
        load_config(sets=["plan.tile_rows=abc"])
    with pytest.raises(ConfigError, match=r"plan.tile_rows must be 1 to 64, got 99; a fake tile holds 1 to 64 rows"):
        load_config(sets=["plan.tile_rows=99"])
    field = {f.name: f for f in dataclasses.fields(schema.PlanOverrides)}["tile_rows"]
    assert field.metadata["doc"] == "rows per fake tile"


def test_a_row_is_in_recommend_and_its_pinned_config(fake_decision, tmp_path):
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if "tile rows" in ln)
    assert "16" in line and "fake rule" in line
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--set", "plan.tile_rows=32", "--format", "json")
    assert json.loads(r.stdout)["plan"]["tile_rows"] == 32
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--format", "toml", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    text = (tmp_path / "run.toml").read_text()
    assert "tile_rows = 16  # 16 rows: the fake rule for fp16" in text
    assert load_config(tmp_path / "run.toml").plan.tile_rows == 16


def test_a_bad_value_for_a_row_is_one_line(fake_decision):
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--set", "plan.tile_rows=0")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip().splitlines() == ["error: plan.tile_rows must be 1 to 64, got 0; a fake tile holds 1 to "
                                             "64 rows (plan.tile_rows from --set plan.tile_rows=0)"]


def test_every_row_is_made_once_and_in_the_table_order():
    p = plan(fake_probe("P40").primary, CATALOGUE["qwen2.5-0.5b"], Task())
    assert p.DECISIONS == tuple(d.name for d in table.TABLE)
    assert all(p.reasons[d.name] for d in table.TABLE), "every decision carries a reason"
    keys = [d.config_key for d in table.TABLE if d.override is not None]
    assert [f.name for f in dataclasses.fields(schema.PlanOverrides)] == keys


def test_an_unknown_override_is_refused():
    with pytest.raises(PlanError, match="unknown plan override tile_rows"):
        plan(fake_probe("P40").primary, CATALOGUE["qwen2.5-0.5b"], Task(), {"tile_rows": 4})


def test_steps_that_depend_on_each_other_in_a_circle_are_a_clear_error(monkeypatch):
    a = Decision("first", "first", lambda c: (c["second"], "reads second"))
    b = Decision("second", "second", lambda c: (c["first"], "reads first"))
    monkeypatch.setattr(table, "TABLE", table.TABLE + (a, b))
    with pytest.raises(RuntimeError, match="in a circle: first -> second -> first"):
        plan(fake_probe("P40").primary, CATALOGUE["qwen2.5-0.5b"], Task())


@pytest.mark.parametrize("old,new", [("plan.rollout_compile=true", "plan.decode_backend=triton-layers"),
                                     ("plan.decode_attention=cuda", "cuda-c (was cuda)"),
                                     ("plan.rollout_engine=hf", "set plan.rollout_engine=static")])
def test_a_retired_key_or_value_is_one_line_naming_the_new_one(monkeypatch, old, new):
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None))
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--set", old)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --set {old}: "), r.output
    assert new in lines[0]
