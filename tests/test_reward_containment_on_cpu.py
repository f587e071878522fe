"""A user's reward function cannot take the run down: every way out of it (an exception, an exit, a
hang, a crash, a bad value, a signal while it runs) ends in one RewardError naming the function and
the sample, or in Interrupted for a signal, with the last completed step saved."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from edgerl.rewards import contain
from edgerl.rewards.contain import Interrupted, UserFunction, call_user, check_result
from edgerl.rewards.rules import RewardError, RewardItem, load_reward_function, score_batch

USER_FILE = '''
import ctypes, os, sys, time

def good(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str)), "row": float(extra_info["i"])}

def exit0(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(0)

def exit3(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(3)

def ctrl_c(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyboardInterrupt

class Odd(BaseException):
    pass

def odd(data_source, solution_str, ground_truth, extra_info=None):
    raise Odd("not an Exception")

def raises(data_source, solution_str, ground_truth, extra_info=None):
    return {}["missing"]

def reads_stdin(data_source, solution_str, ground_truth, extra_info=None):
    return float(input())

def os_exit(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(3)

def crash(data_source, solution_str, ground_truth, extra_info=None):
    ctypes.string_at(0)

def sleeps(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(1000)

def in_c(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(range(10 ** 15)))   # one C call: no Python handler can run until it returns

def swallows(data_source, solution_str, ground_truth, extra_info=None):
    while True:
        try:
            time.sleep(1000)
        except BaseException:
            pass

def huge_int(data_source, solution_str, ground_truth, extra_info=None):
    return 10 ** 400

def huge_float(data_source, solution_str, ground_truth, extra_info=None):
    return 1e308

def infinite(data_source, solution_str, ground_truth, extra_info=None):
    return float("-inf")

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float("nan")}

def huge_component(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "bonus": 10 ** 400}

def a_lambda(data_source, solution_str, ground_truth, extra_info=None):
    return lambda: 1.0

def an_object(data_source, solution_str, ground_truth, extra_info=None):
    return object()

class Score(float):
    pass

def own_class(data_source, solution_str, ground_truth, extra_info=None):
    return Score(1.0)
'''

ITEMS = [RewardItem("s", "first", "g", {"i": 0}, row=4), RewardItem("s", "second", "g", {"i": 1}, row=7)]


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def load(user_file, name, timeout_s=5.0):
    return load_reward_function(f"{user_file}:{name}", timeout_s=timeout_s)


def test_a_good_function_runs_in_its_own_process(user_file):
    fn = load(user_file, "good")
    assert isinstance(fn, UserFunction) and fn._proc.pid != os.getpid()
    assert score_batch(fn, ITEMS) == ([5.0, 6.0], {"row": [0.0, 1.0]})
    assert fn(data_source="s", solution_str="abc", ground_truth="g", extra_info={"i": 2})["score"] == 3.0
    fn.close()


@pytest.mark.parametrize("name, why", [
    ("exit0", r"exited with sys.exit\(0\) \(at my_rewards.py:8\)"),
    ("exit3", r"exited with sys.exit\(3\)"),
    ("ctrl_c", "raised KeyboardInterrupt itself"),
    ("odd", "Odd: not an Exception"),
    ("raises", "KeyError: 'missing' \\(at my_rewards.py:23\\)"),
    ("reads_stdin", "EOFError"),
    ("os_exit", r"ended its process on sample 0 .*\(exit status 3\)"),
    ("crash", r"ended its process on sample 0 .*\(killed by signal SIGSEGV\)"),
    ("huge_int", "returned an integer of 1329 bits, too large for a float"),
    ("huge_float", r"returned 1e\+308, outside \+-1e\+06"),
    ("infinite", "returned a non-finite score -inf"),
    ("nan", "returned a non-finite score nan"),
    ("huge_component", "returned component 'bonus' = an integer of 1329 bits"),
    ("a_lambda", r"returned function <function a_lambda.<locals>.<lambda> at 0x\w+>, not a number"),
    ("an_object", "returned object <object object at"),
])
def test_every_way_out_is_one_error_naming_function_and_sample(user_file, name, why):
    fn = load(user_file, name)
    with pytest.raises(RewardError) as e:
        score_batch(fn, ITEMS)
    msg = str(e.value)
    assert msg.startswith(f"reward function {name} in {user_file} ")
    assert "sample 0 of the batch (prompt row 4 of the data, data_source 's', response 'first'" in msg
    assert "\n" not in msg and len(msg) < 500
    assert __import__("re").search(why, msg), msg
    fn.close()


def test_a_float_of_the_users_own_class_is_its_value(user_file):
    fn = load(user_file, "own_class")   # the reply carries the number, not the class (edgerl.rewards.wire)
    assert score_batch(fn, ITEMS) == ([1.0, 1.0], {})
    fn.close()


def test_other_signatures_and_callers_names(tmp_path):
    """A batched function (TRL's signature) loads with its own keyword check, and call_user's caller
    names it and the sample in every error, the process's own included."""
    path = tmp_path / "batched.py"
    path.write_text("import sys\ndef lengths(prompts, completions, **kw):\n"
                    "    if 'stop' in completions:\n        sys.exit(1)\n    return [float(len(c)) for c in completions]\n")
    with pytest.raises(RewardError, match="cannot be called with verl's keyword arguments"):
        load_reward_function(f"{path}:lengths")
    fn = load_reward_function(f"{path}:lengths", 5.0, call_with={"prompts": [], "completions": []},
                              signature="fn(prompts, completions, **kwargs) -> list[float]")
    who = "reward function 2 of reward.functions (lengths)"
    assert call_user(fn, who, "batch 0", prompts=["p", "q"], completions=["ab", "c"]) == [2.0, 1.0]
    with pytest.raises(RewardError, match=r"^reward function 2 of reward.functions \(lengths\) failed on batch 1: "
                                          r"exited with sys.exit\(1\)"):
        call_user(fn, who, "batch 1", prompts=["p"], completions=["stop"])
    fn.close()


def test_an_exception_keeps_the_process_and_chains_builtin_causes(user_file):
    fn = load(user_file, "raises")
    with pytest.raises(RewardError) as e:
        score_batch(fn, ITEMS)
    assert isinstance(e.value.__cause__, KeyError)
    assert fn._proc is not None and fn._proc.poll() is None  # still serving


@pytest.mark.parametrize("name", ["sleeps", "in_c", "swallows"])
def test_a_hung_function_is_stopped_at_its_timeout(user_file, name):
    fn = load(user_file, name, timeout_s=1.0)
    proc = fn._proc
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"reward function {name} in .* did not return within "
                                          r"reward.timeout_s=1 s on sample 0 of the batch .*its process was stopped"):
        score_batch(fn, ITEMS)
    assert time.monotonic() - start < 20
    assert proc.poll() is not None  # the process is gone, not left running
    with pytest.raises(RewardError, match="its process was stopped earlier"):
        score_batch(fn, ITEMS)


@pytest.mark.parametrize("top, why", [
    ("import sys\nsys.exit(0)\n", r"importing .* failed: exited with sys.exit\(0\) \(at bad.py:2\)"),
    ("raise KeyboardInterrupt\n", "importing .* failed: raised KeyboardInterrupt itself"),
    ("import os\nos._exit(0)\n", r"ended its process on the import of bad.py \(exit status 0\)"),
    ("import time\ntime.sleep(1000)\n", r"importing .*bad.py took longer than 5 s, so its process was stopped"),
])
def test_import_time_exits_and_hangs(tmp_path, monkeypatch, top, why):
    monkeypatch.setattr(contain, "IMPORT_TIMEOUT_S", 5.0)  # the process's own start counts in it
    bad = tmp_path / "bad.py"
    bad.write_text(top + "def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RewardError, match=why):
        load_reward_function(f"{bad}:f", timeout_s=1.0)


def _signal_me_when(sig, ready: Path | None = None, after_s: float = 0.5):
    """Send `sig` to this process once `ready` exists (or after after_s), from a thread."""
    def go():
        deadline = time.monotonic() + 60
        while ready is not None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(after_s)
        os.kill(os.getpid(), sig)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_stop_a_hung_function_at_once(user_file, sig):
    fn = load(user_file, "swallows", timeout_s=None)  # no timeout: only the signal can end it
    proc = fn._proc
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _signal_me_when(sig)
    start = time.monotonic()
    with pytest.raises(Interrupted) as e:
        score_batch(fn, ITEMS)
    assert e.value.signal == sig.name and "reward function swallows" in str(e.value)
    assert time.monotonic() - start < 20 and proc.poll() is not None
    assert {s: signal.getsignal(s) for s in before} == before  # the caller's handlers are back


def test_in_process_callables_are_contained_too():
    """Code in this process (a reward model's forward) is stopped by raising in it: the timer and the
    signals work on code that lets an exception through (code that swallows every BaseException
    forever can be stopped only in a process of its own, as reward functions run)."""
    def sleeps(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(1000)

    def swallows_once(data_source, solution_str, ground_truth, extra_info=None):
        try:
            time.sleep(1000)
        except BaseException:
            return 1.0

    def exits(data_source, solution_str, ground_truth, extra_info=None):
        raise SystemExit(3)

    with pytest.raises(RewardError, match=r"did not return within reward.timeout_s=0.5 s on sample 0"):
        score_batch(sleeps, ITEMS, timeout_s=0.5)
    with pytest.raises(RewardError, match=r"did not return within .* it swallowed the stop and returned late"):
        score_batch(swallows_once, ITEMS, timeout_s=0.5)
    with pytest.raises(RewardError, match=r"exits failed on sample 0 .*exited with sys.exit\(3\)"):
        score_batch(exits, ITEMS)
    for fn in (sleeps, swallows_once):
        _signal_me_when(signal.SIGINT)
        with pytest.raises(Interrupted):
            score_batch(fn, ITEMS)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(ZeroDivisionError):  # passthrough: raised as it is
        call_user(lambda: 1 / 0, "f", "x", passthrough=(ZeroDivisionError,))


@pytest.mark.parametrize("res, score", [(True, 1.0), (3, 3.0), (-1e6, -1e6), ({"score": 2, "a": float("nan")}, 2.0)])
def test_values_in_range_pass(res, score):
    assert check_result(res)[0] == score


# --- in a run: the last completed step is saved ---------------------------------------------------

RUN_FILE = '''
import sys, time
CALLS = 0

def later(data_source, solution_str, ground_truth, extra_info=None):
    global CALLS
    CALLS += 1
    if CALLS > 8:   # the second step: 2 prompts x 4 samples per step
        open(MARKER, "w").close()
        HOW()
    return 0.1 * (CALLS % 3)

def exit0():
    sys.exit(0)

def hang():
    while True:
        try:
            time.sleep(1000)
        except BaseException:
            pass
'''
FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=64", "train.lr=1e-4", "train.steps=3", "run.save_every=0"]


def run_file(tmp_path: Path, how: str) -> tuple[Path, Path]:
    marker = tmp_path / "second-step-reached"
    path = tmp_path / "run_rewards.py"
    path.write_text(f"MARKER = {str(marker)!r}\n" + RUN_FILE + f"\nHOW = {how}\n")
    return path, marker


def step_folders(run: Path) -> list[str]:
    from edgerl.train import checkpoint
    return [p.name for p in checkpoint.checkpoints(run)]


@pytest.mark.parametrize("how, sets, match", [
    ("exit0", [], r"reward function later in .* failed on sample 0 of the batch \(data_source .*exited with "
                      r"sys.exit\(0\)"),
        ("hang", ["reward.timeout_s=1"], r"reward function later in .* did not return within reward.timeout_s=1 s"),
])
def test_a_run_saves_the_last_completed_step(tiny_llama, tmp_path, how, sets, match):
    from conftest import prepare_trainer
    path, _ = run_file(tmp_path, how)
    t = prepare_trainer(tiny_llama, tmp_path / "run", FAST + sets + [f'reward.function="{path}:later"'])
    proc = t.functions[0].fn._proc
    with pytest.raises(RewardError, match=match) as e:
        t.run()
    assert "saved the last good state (step 1)" in str(e.value)
    assert step_folders(tmp_path / "run") == ["step-000001"]
    assert proc.poll() is not None  # no process left behind


def test_ctrl_c_while_the_reward_hangs_stops_the_run_with_step_saved(tiny_llama, tmp_path):
    from conftest import prepare_trainer
    path, marker = run_file(tmp_path, "hang")
    t = prepare_trainer(tiny_llama, tmp_path / "run", FAST + ["reward.timeout_s=0",
                                                               f'reward.function="{path}:later"'])
    _signal_me_when(signal.SIGINT, ready=marker, after_s=0.2)
    t.run()  # returns: the CLI turns stop_signal into exit status 130
    assert t.stop_signal == "SIGINT" and t.step == 1
    assert step_folders(tmp_path / "run") == ["step-000001"]


def test_cli_exit_in_the_reward_is_exit_2_with_one_line(tiny_llama, tmp_path):
    from typer.testing import CliRunner
    from edgerl.cli.main import app
    path, _ = run_file(tmp_path, "exit0")
    args = ["train", "--model", str(tiny_llama), "--out", str(tmp_path / "run"), "--reward", f"{path}:later"]
    for s in FAST:
        args += ["--set", s]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "reward function later" in errors[0] and "exited with sys.exit(0)" in errors[0]
    assert step_folders(tmp_path / "run") == ["step-000001"]
