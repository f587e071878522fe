"""Input a user could type or point at that once reached them as a traceback or a wrong message: each
class ends in one line and exit status 2 (or 130 for a signal), checked over every option it can come
through, not only the case first seen. Nothing here trains; most cases stop before a model loads."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgerl.cli.main import app
from edgerl.core.errors import ConfigError, DataError, ModelError
from edgerl.core.files import check_path

runner = CliRunner()
LONG = "a" * 300                      # a name longer than any file system takes (255 bytes)
UNDECODABLE = "run\udcff"             # how Python hands over a file name holding the byte 0xff


def run(*args, env: dict | None = None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def one_line(r, *texts: str, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    out = r.output.strip()
    assert "\n" not in out and "Traceback" not in out, out
    for text in texts:
        assert text in out, out
    return out


@pytest.fixture
def loop(tmp_path) -> Path:
    a, b = tmp_path / "loop-a", tmp_path / "loop-b"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


# every path option of every command, as (command line before the path, option name shown, the name
# the message gives, what follows the path); a path given to --model, --data and --reward is a config key
PATH_OPTIONS = [
    (["config", "--config"], "--config", ""),
    (["doctor", "--config"], "--config", ""),
    (["recommend", "--gpu", "p40", "--format", "toml", "--config"], "--config", ""),
    (["recommend", "--gpu", "p40", "--format", "toml", "--out"], "--out", ""),
    (["train", "--config"], "--config", ""),
    (["train", "--out"], "--out", ""),
    (["train", "--resume"], "--resume", ""),
    (["train", "--model"], "model.path", ""),
    (["train", "--data"], "data.path", ""),
    (["train", "--reward"], "reward.functions", ":fn"),
    (["train", "--set", "model.tokenizer="], "model.tokenizer", ""),
    (["train", "--set", "run.out_dir="], "run.out_dir", ""),
    (["plot"], "RUN_DIRS", ""),
    (["plot", "runs/x", "--out"], "--out", ""),
    (["data", "check"], "data.path", ""),
    (["data", "check", "x.jsonl", "--tokenizer"], "--tokenizer", ""),
    (["data", "prepare", "gsm8k", "--out"], "--out", ""),
]


def _given(before: list[str], path: str, after: str) -> list[str]:
    if before[-1].endswith("="):   # --set key=value: the value is TOML, a string in quotes
        return before[:-1] + [before[-1] + json.dumps(path + after)]
    return before + [path + after]


@pytest.mark.parametrize("before,name,after", PATH_OPTIONS, ids=[" ".join(p[0]) for p in PATH_OPTIONS])
def test_every_path_option_refuses_a_name_too_long_for_any_file_system(before, name, after, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line(run(*_given(before, LONG + ".x", after)), f"{name} ", "is 302 bytes long, and a file or folder name "
             "has at most 255")


@pytest.mark.parametrize("before,name,after", PATH_OPTIONS, ids=[" ".join(p[0]) for p in PATH_OPTIONS])
def test_every_path_option_refuses_bytes_that_are_not_utf8(before, name, after, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if before[-1].endswith("="):
        pytest.skip("a TOML string cannot hold the byte; the key is reached through --model etc.")
    one_line(run(*_given(before, UNDECODABLE, after)), f"{name} run\\udcff", "bytes that are not UTF-8")


@pytest.mark.parametrize("before,name,after", PATH_OPTIONS, ids=[" ".join(p[0]) for p in PATH_OPTIONS])
def test_every_path_option_refuses_a_symlink_loop(before, name, after, loop, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line(run(*_given(before, str(loop), after)), f"{name} ", "a loop of symbolic links")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop-a", "loop-b"]   # nothing written


def test_the_path_validator_on_its_own(tmp_path):
    check_path(tmp_path / "missing" / "file.jsonl", "--data")   # a missing file is the caller's to report
    check_path("builtin:arithmetic", "data.path")
    deep = "/".join(["d" * 200] * 25)
    with pytest.raises(ConfigError, match=r"^--out .*: the path is 5024 bytes long, and paths have at most 4096"):
        check_path(deep, "--out")
    with pytest.raises(ConfigError, match="cannot hold a NUL character"):
        check_path("a\0b", "--out")


# --- input nested too deeply, lone surrogates, huge numbers, FIFOs: named at their file and row ----------

def _deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("name,text,where", [
    ("deep.jsonl", '{"prompt": ' + _deep() + "}\n", "deep.jsonl: line 1 nests arrays or objects too deeply"),
    ("deep.json", "[" + _deep() + "]", "deep.json: row 0 (0-based; line 1) nests arrays or objects too deeply"),
    ("obj.json", '{"a": ' + _deep() + "}", "obj.json nests arrays or objects too deeply"),
    ("digits.jsonl", '{"prompt": "x", "answer": ' + "7" * 5000 + "}\n",
     "digits.jsonl: line 1 holds a number of more than 4300 digits, which Python does not read as a number; "
     "write it as a string (in quotes)"),
    ("surrogate.jsonl", '{"prompt": "a \\ud800 b"}\n',
     "surrogate.jsonl: line 1: the field 'prompt' holds \\ud800, half of a UTF-16 surrogate pair"),
    ("surrogate.json", '[{"prompt": {"content": ["x", "\\udfff"]}}]',
     "surrogate.json: row 0 (0-based; line 1): the field 'prompt.content[1]' holds \\udfff"),
])
def test_data_python_cannot_take_is_named_at_its_row(tmp_path, name, text, where):
    from edgerl.data.files import read_table
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError) as e:
        read_table(str(tmp_path / name))
    assert where in str(e.value)
    assert "set_int_max_str_digits" not in str(e.value)


def test_a_fifo_or_a_device_as_data_or_config_is_named_as_such_not_empty(tmp_path):
    from edgerl.config.load import read_toml
    from edgerl.data.files import read_table
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO (named pipe)"), (zero, "a character device")):
        with pytest.raises(DataError, match=rf"^data file {re.escape(str(path))} is {re.escape(kind)}, not a regular "
                                            "file"):
            read_table(str(path))
    with pytest.raises(ConfigError, match=r"^config file /dev/zero is a character device"):
        read_toml("/dev/zero")


def test_nesting_in_a_config_file_or_a_set_value_is_one_line(tmp_path):
    from edgerl.config.load import load_config
    f = tmp_path / "run.toml"
    f.write_text("[train]\nbetas = " + _deep(5000) + "\n")
    with pytest.raises(ConfigError, match=rf"^config file {f} nests arrays or tables too deeply"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"^--set train.betas=...: the value nests arrays too deeply"):
        load_config(sets=["train.betas=" + _deep(5000)])


def test_text_settings_that_are_not_utf8_are_refused(tmp_path):
    one_line(run("config", "--set", "data.system_prompt=ab\udcffc"),
             "data.system_prompt holds bytes that are not UTF-8 text (ab\\udcffc)")


def test_a_scalar_section_in_a_file_is_blamed_on_the_file_not_on_an_option(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("train = 3\n")
    out = one_line(run("train", "--config", f, "--steps", 2), f"'train' in {f} is a section; write it as [train]")
    assert "--steps" not in out


def test_a_damaged_tokenizer_json_is_one_line_naming_it(tmp_path):
    from conftest import make_char_tokenizer
    from edgerl.models.load import load_tokenizer
    folder = tmp_path / "model"
    make_char_tokenizer(folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(ModelError, match=rf"^cannot load the tokenizer of '{folder}' \({folder / 'tokenizer.json'}"):
        load_tokenizer(str(folder))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "x"}\n')
    one_line(run("data", "check", rows, "--tokenizer", folder), "cannot load the tokenizer")


# --- the environment: torchrun's variables, the output, signals -----------------------------------------

@pytest.mark.parametrize("env,text", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole number"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "a rank must be in 0..WORLD_SIZE-1"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE set without RANK"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "are set, but not MASTER_ADDR and MASTER_PORT: not set by torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "99999999999999999999999999", "MASTER_ADDR": "h"}, "not MASTER_PORT"),
])
def test_torchrun_variables_edgerl_cannot_use_are_one_line(env, text):
    from edgerl.train.ranks import from_env
    with pytest.raises(ConfigError, match="unset them") as e:
        from_env(env)
    assert text in str(e.value)


def test_torchrun_variables_are_checked_by_train_and_ignored_by_the_rest(tmp_path):
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": None, "MASTER_PORT": None}
    one_line(run("train", "--out", tmp_path / "r", "--set", 'run.profile="cpu"', env=env),
             "RANK=1 and WORLD_SIZE=2 are set, but not MASTER_ADDR and MASTER_PORT")
    assert not (tmp_path / "r").exists()
    from edgerl.train.ranks import Rank, from_env
    assert from_env({"LOCAL_RANK": "1"}) == Rank()   # alone it names a GPU for other launchers
    assert from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}) == Rank(1, 2, 1)


@pytest.mark.parametrize("command", [["config"], ["profiles"]])
def test_output_to_a_full_device_is_one_line_on_stderr(command):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux)")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "edgerl.cli", *command], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=900)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("error: cannot write the output: No space left on device; nothing else failed, but "
                                "what was printed is incomplete"), p.stderr


def test_an_os_error_or_deep_recursion_no_check_foresaw_is_one_line(monkeypatch):
    import edgerl.cli.main as main
    for error, text in ((OSError(28, "No space left on device", "/data/x"),
                         "No space left on device: /data/x; free disk space, then run the command again"),
                        (RecursionError("maximum recursion depth exceeded"), "nested too deeply to be read"),
                        (PermissionError(13, "Permission denied", "/etc/x"), "Permission denied: /etc/x; check the "
                                                                             "permissions")):
        def fail(*args, e=error, **kwargs):
            raise e
        monkeypatch.setattr(main, "load_config", fail)
        one_line(run("config"), text)


def test_sigterm_while_loading_exits_130_with_a_line(tmp_path, monkeypatch):
    import edgerl.train.session as session

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)   # as `kill PID` while the tokenizer loads
        raise AssertionError("the signal did not stop the command")
    monkeypatch.setattr(session, "resolve_target", terminated)
    before = signal.getsignal(signal.SIGTERM)
    r = run("train", "--out", tmp_path / "r", "--set", 'run.profile="cpu"')
    one_line(r, "stopped by SIGTERM before training began; nothing was trained: run the same command again",
             code=130)
    assert signal.getsignal(signal.SIGTERM) == before   # the handler is the command's only


# --- sizes with no natural bound, and plot --out ----------------------------------------------------------

@pytest.mark.parametrize("args,text", [
    (["recommend", "--gpu", "p40", "--prompts", "100000000"], "train.prompts_per_step must be 1 to 65536"),
    (["recommend", "--gpu", "p40", "--prompts", "30000"], "more than the 65536 edgerl plans for"),
    (["train", "--set", "train.seed=99999999999999999999999"], "train.seed must be 0 to 4294967295"),
    (["train", "--steps", "99999999999999999999"], "train.steps must be 0 to 1000000000"),
    (["recommend", "--gpu", "p40", "--response-len", "99999999999"], "rollout.max_new_tokens must be 1 to 1048576"),
])
def test_sizes_past_their_limit_are_refused_at_once_with_the_limit(args, text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line(run(*args), text)
    assert list(tmp_path.iterdir()) == []   # nothing written


def test_plot_out_over_an_existing_file_needs_force(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": i / 10}) + "\n"
                                                   for i in (1, 2)))
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"my picture")
    one_line(run("plot", run_dir, "--out", mine), f"--out {mine}: {mine} exists; pass --force to replace it")
    assert mine.read_bytes() == b"my picture"
    r = run("plot", run_dir, "--out", mine, "--force")
    assert r.exit_code == 0 and mine.read_bytes()[:4] == b"\x89PNG", r.output
    assert run("plot", run_dir).exit_code == 0
    r = run("plot", run_dir)   # the default curves.png in the run folder is edgerl's own, replaced each time
    assert r.exit_code == 0 and (run_dir / "curves.png").exists(), r.output
