"""Two processes under torchrun on the CPU (gloo): the same update as one process on the same rollouts,
and `edgerl train` with one log, split prompts, and checkpoints that resume on the same number of ranks or
another (tests/test_reshard_on_cpu.py checks that the result is the same)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONPATH": str(HERE.parent)}


def torchrun(*args: str, n: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.slow
@pytest.mark.parametrize("advantage, correction, level", [   # reinforce++ whitens over the whole batch
    ("grpo", "tis", "token"), ("reinforce++", "mis", "sequence")])
def test_two_ranks_update_equals_one_process(tiny_llama, tmp_path, advantage, correction, level):
    script = str(HERE / "two_ranks_update.py")
    one = subprocess.run([sys.executable, script, str(tiny_llama), str(tmp_path / "one.pt"), str(tmp_path / "r1"),
                          advantage, correction, level], capture_output=True, text=True, timeout=600, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(script, str(tiny_llama), str(tmp_path / "two.pt"), str(tmp_path / "r2"), advantage, correction,
                   level)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    torch.testing.assert_close(torch.cat(b["advantages"]), a["advantages"][0], rtol=1e-5, atol=1e-6)
    moved = 0
    for name, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        moved += int(not torch.equal(w, b["weights"][name]) or True)
    share = f"rollout_corr/{'truncated' if correction == 'tis' else 'masked'}"
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/k3_kl", "rollout_corr/weight_mean",
                "rollout_corr/weight_max", share):
        assert b["stats"][key] == pytest.approx(a["stats"][key], rel=1e-4, abs=1e-6), key
    assert 0 < a["stats"][share] < 1   # global means and maxima over ranks that hold different rows


def _train(model: Path, run: Path, *extra: str, n: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    sets = ["run.profile=\"cpu\"", "train.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=6",
            "data.num_examples=32", "run.tensorboard=false", "run.export_final=false", "run.save_every=1"]
    args = ["-m", "edgerl.cli", "train", "--model", str(model), *sum((["--set", s] for s in sets), []), *extra]
    if n == 1:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV)
    return torchrun(*args, n=n, timeout=timeout)


@pytest.mark.slow
def test_torchrun_train_logs_once_splits_prompts_and_resumes(tiny_llama, tmp_path):
    run = tmp_path / "run"
    first = _train(tiny_llama, run, "--steps", "2", "--out", str(run))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    steps = [m.group(1) for m in map(re.compile(r"step\s+(\d+)\s+reward").match, first.stdout.splitlines()) if m]
    assert steps == ["1", "2"], first.stdout   # rank 0 alone prints
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["dist/world_size"] == 2 and r["batch/sequences"] == 4 for r in rows)
    _, state, _ = __import__("edgerl.train.checkpoint", fromlist=["load"]).load(run / "checkpoints" / "step-000002")
    assert state["train"]["world_size"] == 2 and len(state["train"]["rng_by_rank"]) == 2
    assert state["train"]["rng_by_rank"][0]["generator"].ne(state["train"]["rng_by_rank"][1]["generator"]).any()

    again = _train(tiny_llama, run, "--steps", "3", "--resume", str(run))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]

    alone = _train(tiny_llama, run, "--steps", "4", "--resume", str(run), n=1)   # one GPU fewer: re-sharded
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-3000:]
    assert "resumed on 1 process(es) from a checkpoint written by 2" in alone.stdout
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["dist/world_size"] == 1


@pytest.mark.slow
def test_a_batch_that_does_not_split_is_refused_before_training(tiny_llama, tmp_path):
    res = _train(tiny_llama, tmp_path / "odd", "--steps", "1", "--set", "train.prompts_per_step=3",
                 "--out", str(tmp_path / "odd"))
    assert res.returncode != 0
    assert "train.prompts_per_step=3 does not split over 2 GPUs" in res.stderr
    assert res.stderr.count("does not split") == 1          # one line, from rank 0
    assert not (tmp_path / "odd").exists()                  # nothing written


def _no_edgerl_traceback(stderr: str) -> None:
    """torchrun prints its own summary (and a traceback of its own) when a rank exits non-zero; no rank
    of edgerl's may print one."""
    assert "/edgerl/" not in stderr, stderr[-3000:]   # the package, its command line included


@pytest.mark.slow
def test_a_reward_failing_on_rank_1_alone_is_printed_once_with_its_message(tiny_llama, tmp_path):
    reward = tmp_path / "rank_reward.py"
    reward.write_text("import os\ndef f(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if os.environ['RANK'] == '1':\n        raise ValueError('only rank 1 sees this')\n"
                      "    return 1.0\n")
    res = _train(tiny_llama, tmp_path / "run", "--steps", "1", "--out", str(tmp_path / "run"), "--reward",
                 f"{reward}:f")
    assert res.returncode != 0
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("rank 0: error: reward function f in "), res.stderr[-3000:]
    assert "ValueError: only rank 1 sees this (at rank_reward.py:4) (on rank 1 of 2)" in errors[0]
    _no_edgerl_traceback(res.stderr)


@pytest.mark.slow
def test_sigterm_to_one_rank_during_a_reward_saves_on_every_rank(tiny_llama, tmp_path):
    """Rank 1 is signalled while its reward runs; rank 0's reward never returns (no time limit): it
    learns of the signal through torchrun's store, and both stop, with step 1 saved once."""
    reward = tmp_path / "signal_reward.py"
    reward.write_text("import os, signal, time\nCALLS = 0\n"
                      "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    global CALLS\n    CALLS += 1\n    if CALLS > 2:   # step 2 (2 samples per rank and step)\n"
                      "        if os.environ['RANK'] == '1':\n            os.kill(os.getppid(), signal.SIGTERM)\n"
                      "        time.sleep(1000)\n    return 0.5\n")
    run = tmp_path / "run"
    res = _train(tiny_llama, run, "--steps", "3", "--out", str(run), "--reward", f"{reward}:f", "--set",
                 "run.save_every=0", "--set", "reward.timeout_s=0", timeout=300)
    assert "stopped by SIGTERM (to rank 1) after step 1; resume with" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
    assert "step 2 abandoned; saved the last good state (step 1)" in res.stdout
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000001"]
    assert "error:" not in res.stderr
    _no_edgerl_traceback(res.stderr)
