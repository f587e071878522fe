"""Everything edgerl writes as TOML or JSON reads back: strings with control characters are escaped in
config.toml (a resume reads it), and NaN or infinity never reaches a JSON file as a literal (null, counted
in the row)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgerl.cli.main import app
from edgerl.config.load import load_config
from edgerl.config.schema import to_toml

runner = CliRunner()
FAST = ['run.profile="cpu"', "rollout.max_new_tokens=4", "train.prompts_per_step=2", "rollout.n_samples=2",
        "run.loggers=[]", "data.num_examples=16", "run.export_final=false"]
HOSTILE = ["a\rb", "del\x7fx", "c\x01d", 'q"\\', "tab\tnl\n", "\x00\x1b\x08\x0c"]


def _strict_json(text: str):
    def no_constant(name):
        raise AssertionError(f"{name} is not JSON")
    return json.loads(text, parse_constant=no_constant)


@pytest.mark.parametrize("text", HOSTILE)
def test_a_config_string_with_control_characters_reads_back_equal(text):
    cfg = load_config(sets=[f"run.project={json.dumps(text)}"])
    assert cfg.run.project == text
    assert tomllib.loads(to_toml(cfg))["run"]["project"] == text


def test_a_run_with_a_control_character_in_a_string_and_a_path_resumes(tiny_llama, tmp_path):
    folder = tmp_path / "re\x01wards"   # a reward file under a folder whose name holds \x01
    folder.mkdir()
    (folder / "r.py").write_text("def fn(data_source, solution_str, ground_truth, extra_info=None):\n"
                                 "    return float(len(solution_str) % 2)\n")
    run = tmp_path / "run"
    sets = FAST + ['run.project="a\\rb"', "run.save_every=1"]
    r = runner.invoke(app, ["train", "--model", str(tiny_llama), "--out", str(run), "--steps", "1",
                            "--reward", f"{folder / 'r.py'}:fn", *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 0, r.output
    saved = tomllib.loads((run / "config.toml").read_text(encoding="utf-8"))
    assert saved["run"]["project"] == "a\rb" and saved["reward"]["functions"] == [f"{folder / 'r.py'}:fn"]
    r = runner.invoke(app, ["train", "--resume", str(run), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_nan_and_infinity_are_written_as_null_and_counted(tmp_path):
    from edgerl.train.metrics import MetricsWriter, read_metrics, read_samples
    w = MetricsWriter(tmp_path, loggers=[], samples=True, log=None)
    w.write(1, {"reward/mean": float("nan"), "reward/max": float("inf"), "ok": 1.5})
    w.write_samples(1, "train", [{"prompt": "p", "reward": float("-inf"), "rewards": {"f": float("nan"), "g": 0.5}}])
    w.close()
    for name in ("metrics.jsonl", "samples.jsonl"):
        for line in (tmp_path / name).read_text().splitlines():
            _strict_json(line)
    assert read_metrics(tmp_path, log=None) == [{"step": 1, "reward/mean": None, "reward/max": None, "ok": 1.5,
                                                 "non_finite": 2}]
    row = read_samples(tmp_path, log=None)[0]
    assert row["reward"] is None and row["rewards"] == {"f": None, "g": 0.5} and row["non_finite"] == 2


def test_json_text_is_valid_json_for_any_float():
    from edgerl.core.files import finite, json_text
    doc = {"a": [1.0, float("nan"), (float("inf"), 2)], "b": {"c": -float("inf")}, "d": "NaN"}
    assert _strict_json(json_text(doc)) == {"a": [1.0, None, [None, 2]], "b": {"c": None}, "d": "NaN"}
    assert finite(doc)[1] == 3
