"""The reward worker's replies are data (edgerl.rewards.wire): a reply cannot run code in the trainer,
a false or forged message is one error within the time limit, a fork cannot answer for the worker,
the processes a function starts die with its worker, tensors and arrays are read as the docs say,
and the +-1e6 bound holds for every component and for the weighted total."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgerl.core.errors import ConfigError, RewardError
from edgerl.rewards import wire
from edgerl.rewards.builtins import RewardRow
from edgerl.rewards.functions import load_functions, score

HERE = Path(__file__).parent
HOSTILE = '''
import os, struct, subprocess, sys, time

class ExitsOnUnpickle:
    def __reduce__(self):
        return (os._exit, (7,))

class SleepsOnUnpickle:
    def __reduce__(self):
        return (time.sleep, (1000,))

class SlowRepr:
    def __repr__(self):
        time.sleep(1000)
        return "x"

def exits_on_unpickle(data_source, solution_str, ground_truth, extra_info=None):
    return ExitsOnUnpickle()

def sleeps_on_unpickle(data_source, solution_str, ground_truth, extra_info=None):
    return SleepsOnUnpickle()

def slow_repr(data_source, solution_str, ground_truth, extra_info=None):
    return SlowRepr()

def false_length(data_source, solution_str, ground_truth, extra_info=None):
    # a header promising a body that never comes, on the reply pipe (the worker's second argument)
    os.write(int(sys.argv[2]), b"ERW1" + struct.pack(">QI", 1, 1000))
    time.sleep(1000)

def huge_length(data_source, solution_str, ground_truth, extra_info=None):
    os.write(int(sys.argv[2]), b"ERW1" + struct.pack(">QI", 1, 2 ** 32 - 1))
    return 1.0

def forged(data_source, solution_str, ground_truth, extra_info=None):
    body = b'[\"ok\",123.0]'
    os.write(int(sys.argv[2]), b"ERW1" + struct.pack(">QI", 99, len(body)) + body)
    return 1.0

def forks(data_source, solution_str, ground_truth, extra_info=None):
    os.fork()   # the child returns too, into the worker's loop
    return float(len(solution_str))

def starts_children(data_source, solution_str, ground_truth, extra_info=None):
    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(5)]
    with open(PIDS, "w") as f:
        f.write(" ".join(str(k.pid) for k in kids))
    return 1.0
'''

SCORE = '''
import sys, time
from edgerl.rewards.rules import RewardError, RewardItem, load_reward_function, score_batch
spec, timeout = sys.argv[1], float(sys.argv[2])
items = [RewardItem("s", "x" * (i + 1), "g", {"i": i}, row=i) for i in range(int(sys.argv[3]))]
fn = load_reward_function(spec, timeout_s=timeout)
start = time.monotonic()
try:
    print("scores", score_batch(fn, items)[0])
except RewardError as e:
    print("error:", e)
print("seconds", round(time.monotonic() - start, 1))
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    path = folder / "hostile.py"
    path.write_text(f"PIDS = {str(folder / 'pids')!r}\n" + HOSTILE)
    return path


def scored(hostile: Path, name: str, timeout_s: float = 2.0, n: int = 2, wait: float = 40.0
           ) -> tuple[int, str, float]:
    """(exit status, output, seconds) of a process that scores n samples with `name` and prints the
    scores or the error: a reply that ran code in it could end it, or hang it (then `wait` ends it)."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    try:
        r = subprocess.run([sys.executable, "-c", SCORE, f"{hostile}:{name}", str(timeout_s), str(n)],
                           capture_output=True, text=True, timeout=wait, env=env)
    except subprocess.TimeoutExpired:
        return -1, "(still running)", time.monotonic() - start
    return r.returncode, r.stdout + r.stderr, time.monotonic() - start


def _error_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out, out
    return lines[0]


@pytest.mark.parametrize("name", ["exits_on_unpickle", "sleeps_on_unpickle"])
def test_a_reply_cannot_run_code_in_the_trainer(hostile, name):
    code, out, _ = scored(hostile, name)
    assert code == 0, out
    line = _error_line(out)
    assert f"reward function {name} in {hostile} failed on sample 0 of the batch" in line
    cls = "ExitsOnUnpickle" if name == "exits_on_unpickle" else "SleepsOnUnpickle"
    assert f"returned {cls} <" in line and line.endswith(", not a number")


def test_the_time_limit_covers_reading_the_value(hostile):
    code, out, seconds = scored(hostile, "slow_repr")   # its repr runs in the worker, within the limit
    assert code == 0 and "did not return within reward.timeout_s=2 s on sample 0" in _error_line(out)
    assert seconds < 20


def test_a_false_length_does_not_block_past_the_time_limit(hostile):
    code, out, seconds = scored(hostile, "false_length")
    assert code == 0, out
    assert "reward function false_length" in _error_line(out) and "did not return within reward.timeout_s=2 s" in out
    assert seconds < 20


@pytest.mark.parametrize("name, why", [
    ("huge_length", "a length of 4294967295 bytes, more than the 64 MiB a message may hold"),
    ("forged", "an answer to request 99 while request 2 waited"),
])
def test_a_message_outside_the_protocol_is_one_error(hostile, name, why):
    code, out, _ = scored(hostile, name)
    line = _error_line(out)
    assert code == 0 and f"reward function {name} in {hostile} failed on sample 0 of the batch" in line
    assert why in line and "which is not a reply the protocol allows" in line


def test_a_fork_cannot_answer_for_the_worker(hostile):
    code, out, _ = scored(hostile, "forks", timeout_s=10.0, n=12)
    assert code == 0 and f"scores {[float(i + 1) for i in range(12)]}" in out, out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")   # exited; its new parent has yet to reap it


def test_children_of_a_reward_die_with_its_worker(hostile):
    """The worker leads a process group of its own: what the function started is stopped with it, so
    a command whose output a shell captures (`$(edgerl train ...)`, `| tee`) ends with the trainer."""
    pids = hostile.parent / "pids"
    code, out, seconds = scored(hostile, "starts_children", wait=25.0)   # exits without closing: atexit
    assert code == 0 and "scores [1.0, 1.0]" in out, out
    assert seconds < 20   # the output pipe closed: no sleep 30 held it
    kids = [int(p) for p in pids.read_text().split()]
    deadline = time.monotonic() + 5
    while not all(map(_gone, kids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, kids)), kids

    from edgerl.rewards.rules import RewardItem, load_reward_function, score_batch
    fn = load_reward_function(f"{hostile}:starts_children", timeout_s=10.0)   # close(), as a run's end does
    assert score_batch(fn, [RewardItem("s", "x", "g")])[0] == [1.0]
    kids = [int(p) for p in pids.read_text().split()]
    assert not any(map(_gone, kids))
    fn.close()
    time.sleep(0.2)
    assert all(map(_gone, kids))


# --- what a reply may hold ---------------------------------------------------------------------------

VALUES = '''
import numpy as np
import torch

def per_sample(data_source, solution_str, ground_truth, extra_info=None):
    return {"tensor": torch.tensor(0.5), "float32": np.float32(0.25), "dict": {"score": torch.tensor(2.0),
            "part": np.float64(1.5)}, "array0": np.array(3.0), "int64": np.int64(4)}[solution_str]

def batched(prompts, completions, **kw):
    return {"tensor": lambda: torch.tensor([1.0, 2.0]), "array": lambda: np.array([0.5, -0.5]),
            "zero_d": lambda: torch.tensor(1.0), "none": lambda: None, "nones": lambda: [None, 1.0],
            "two_d": lambda: torch.ones(2, 1), "bf16": lambda: torch.tensor([0.5, 0.25], dtype=torch.bfloat16),
            }[completions[0]]()
'''

PLAIN = '''
def huge_component(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "bonus": 10 ** 400}

def big_component(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "bonus": 2e6, "missing": float("nan")}

def one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''


@pytest.fixture(scope="module")
def values_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("values") / "values.py"
    path.write_text(VALUES)
    return path


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory) -> Path:   # no torch to import: its workers start in a fraction of a second
    path = tmp_path_factory.mktemp("plain") / "plain.py"
    path.write_text(PLAIN)
    return path


def rows(*responses: str) -> list[RewardRow]:
    return [RewardRow("s", "p", "p", r, (1, 2), "g", {"when": 1}) for r in responses]


def test_tensors_and_arrays_are_read_as_the_docs_say(values_file):
    (f,) = load_functions([f"{values_file}:per_sample"], None)
    for text, value in [("tensor", 0.5), ("float32", 0.25), ("dict", 2.0), ("array0", 3.0), ("int64", 4.0)]:
        res = score([f], rows(text))
        assert res.total == [value], text
    assert score([f], rows("dict")).components == {"part": [1.5]}
    (b,) = load_functions([f"{values_file}:batched"], None)
    assert score([b], rows("tensor", "x")).by_function["batched"] == [1.0, 2.0]
    assert score([b], rows("array", "x")).by_function["batched"] == [0.5, -0.5]
    assert score([b], rows("bf16", "x")).by_function["batched"] == [0.5, 0.25]
    res = score([b], rows("nones", "x"))   # TRL's None: does not apply, adds nothing
    assert math.isnan(res.by_function["batched"][0]) and res.total == [0.0, 1.0]
    for text, why in [("zero_d", "returned one number, 1.0 (a 0-d array or tensor is one number), on a batch of 2 completions; a "
                                 "batched function (fn(prompts, "
                                 "completions, **kwargs) -> list[float]) returns one float per completion: a list, "
                                 "or a 1-d array or tensor"),
                      ("none", "returned NoneType 'None' on a batch of 2 completions"),
                      ("two_d", "returned list '[1.0]' for completion 0 of a batch of 2; it must return a number")]:
        with pytest.raises(RewardError) as e:
            score([b], rows(text, "x"))
        assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
    b.fn.close()
    f.fn.close()


def test_every_component_and_the_weighted_total_are_bounded(plain_file):
    for name, why in [("huge_component", "returned component 'bonus' = an integer of 1329 bits on sample 0"),
                      ("big_component", "returned component 'bonus' = 2e+06 on sample 0")]:
        (f,) = load_functions([f"{plain_file}:{name}"], None)
        with pytest.raises(RewardError) as e:
            score([f], rows("a"))
        assert str(e.value).startswith(f"reward function {name} {why}") and "\n" not in str(e.value), str(e.value)
        f.fn.close()
    fns = load_functions([f"{plain_file}:one", f"{plain_file}:one"], [6e5, 6e5])
    with pytest.raises(RewardError, match=r"^the weighted reward 1\.2e\+06 = 600000 x 1 \(one\) \+ 600000 x 1 "
                                          r"\(one_2\) on sample 0 of the batch .* is outside \+-1e\+06, .*; lower "
                                          r"reward.weights$"):
        score(fns, rows("a"))
    for f in fns:
        f.fn.close()


@pytest.mark.parametrize("sets, why", [
    (['reward.functions=["answer", "format"]', "reward.weights=[1e308, 1e308]"],
     "reward.weights[0] = 1e+308 is beyond +-1e+06"),
    (['reward.functions=["answer", "format"]', "reward.weights=[1.0, -1e30]"], "reward.weights[1] = -1e+30 is beyond"),
    (["algo.overlong_penalty=1e300"], "algo.overlong_penalty must be in [0, 1e+06], got 1e+300"),
    (["reward.model_coef=1e30"], "reward.model_coef must be in [-1e+06, 1e+06]"),
])
def test_weights_and_penalties_that_overflow_the_total_are_refused(sets, why):
    from edgerl.config.load import load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert why in str(e.value)


def test_arguments_that_are_not_data_are_one_error(plain_file):
    (f,) = load_functions([f"{plain_file}:one"], None)
    bad = [RewardRow("s", "p", "p", "r", (1,), "g", {"when": object()})]
    with pytest.raises(RewardError, match=r"the arguments for sample 0 of the batch .* cannot be sent to its process "
                                          r"\(they hold a value of type object, which is not data"):
        score([f], bad)
    f.fn.close()


def test_the_wire_format_round_trips_and_refuses_the_rest():
    value = {"score": 1.0, "n": [1, -2, None, True, "x", b"\x00"], 3: {"nan": float("nan"), "inf": float("-inf")}}
    back = wire.decode(wire.encode(value))
    assert back["n"] == [1, -2, None, True, "x", b"\x00"] and math.isnan(back[3]["nan"]) and back[3]["inf"] == -math.inf
    assert isinstance(wire.decode(wire.encode(10 ** 400, user=True)), wire.BigInt)
    for body, why in [(b'{"score": 1}', "no tag of the protocol"), (b"NaN", "the JSON literal NaN"),
                      (b"[" * 100 + b"]" * 100, "nested deeper than 64"), (b"\xff", "not JSON"),
                      (json.dumps({"object": 1, "repr": 2}).encode(), "no tag")]:
        with pytest.raises(wire.ProtocolError, match=why):
            wire.decode(body)
    with pytest.raises(wire.ProtocolError, match="not data"):
        wire.encode({"when": object()})


# --- in a run ------------------------------------------------------------------------------------------

RUN_FILE = '''
import subprocess

def half_none(prompts, completions, **kw):
    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    with open(PIDS, "a") as f:
        f.write(" ".join(str(k.pid) for k in kids) + " ")
    return [None if i % 2 else 1.0 for i in range(len(completions))]
'''


def test_a_run_writes_null_for_none_and_leaves_no_child(tiny_llama, tmp_path):
    from conftest import prepare_trainer
    pids = tmp_path / "pids"
    path = tmp_path / "run_rewards.py"
    path.write_text(f"PIDS = {str(pids)!r}\n" + RUN_FILE)
    sets = ['run.profile="cpu"', "rollout.max_new_tokens=4", "train.prompts_per_step=1", "rollout.n_samples=4",
            "run.tensorboard=false", "data.num_examples=8", "train.steps=1", "run.save_every=0",
            "run.export_final=false", "run.log_samples=4", f'reward.functions=["{path}:half_none"]']
    t = prepare_trainer(tiny_llama, tmp_path / "run", sets)
    t.run()
    rows = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"{c} in samples.jsonl"))
            for ln in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["rewards"]["half_none"] for r in rows] == [1.0, None, 1.0, None]
    time.sleep(0.2)
    assert all(_gone(int(p)) for p in pids.read_text().split())
