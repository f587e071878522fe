"""One handler for the whole run: a signal or an error anywhere (the evaluation before the first step or after
a step, `on_step`, the reward file's import, `edgerl eval`) keeps the last completed step saved and ends in
one line, exit 130 for a signal and 2 for a user error. User code stopped by a signal raises Interrupted
(edgerl.rewards.contain); the tests raise it where a reward would."""

from __future__ import annotations

import os
import signal

import pytest
from test_hostile_input_on_cpu import one_line
from test_run_folder_integrity_on_cpu import FAST, train

from edgerl.rewards.contain import Interrupted
from edgerl.train import checkpoint, runfolder
from edgerl.train.metrics import read_metrics
from edgerl.train.trainer import Trainer

EVAL = ['eval.data="builtin:arithmetic"', "eval.max_prompts=2", "eval.every=1", "run.export_final=false",
        "run.save_every=0"]


def _interrupt_evaluation_at(monkeypatch, at_step: int) -> None:
    real = Trainer.evaluate

    def evaluate(self):
        if self.step == at_step:   # as a reward scoring a held-out answer when SIGTERM arrives
            raise Interrupted("SIGTERM", "reward function fn")
        return real(self)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)


def test_a_signal_in_the_evaluation_after_a_step_saves_that_step(tiny_llama, tmp_path, monkeypatch):
    _interrupt_evaluation_at(monkeypatch, 1)
    run = tmp_path / "run"
    r = train("--out", run, "--steps", 3, model=tiny_llama, sets=FAST + EVAL)
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output
    said = " ".join(r.output.split())
    assert "SIGTERM received while reward function fn ran: after step 1 stopped; step 1 completed and is saved" in said
    assert f"stopped by SIGTERM after step 1; resume with edgerl train --resume {run}" in said
    assert checkpoint.latest(run).name == "step-000001"
    assert [row["step"] for row in read_metrics(run)] == [0, 1]
    assert runfolder.check_resume(runfolder.resume_point(run), None) == run   # --resume takes it


def test_a_signal_in_the_evaluation_before_the_first_step_says_nothing_was_saved(tiny_llama, tmp_path,
                                                                                 monkeypatch):
    _interrupt_evaluation_at(monkeypatch, 0)
    run = tmp_path / "run"
    r = train("--out", run, "--steps", 3, model=tiny_llama, sets=FAST + EVAL)
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output
    assert "stopped by SIGTERM after step 0; no step was saved: run the same command again to start" in \
        " ".join(r.output.split())
    assert checkpoint.latest(run) is None
    runfolder.check_new(run)   # the same command again may start there


def test_an_on_step_callback_that_raises_keeps_the_step_it_saw(tiny_llama, tmp_path):
    from conftest import prepare_trainer
    run = tmp_path / "run"
    t = prepare_trainer(tiny_llama, run, FAST + ["train.steps=3", "run.save_every=0", "run.export_final=false"])

    def on_step(step, stats):
        raise ValueError(f"my callback failed at step {step}")
    with pytest.raises(ValueError, match="my callback failed at step 1"):
        t.run(on_step)
    assert checkpoint.latest(run).name == "step-000001"
    assert [row["step"] for row in read_metrics(run)] == [1]


def test_a_signal_while_the_reward_file_imports_is_one_line(tiny_llama, tmp_path):
    reward = tmp_path / "slow_import.py"
    reward.write_text(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)\n"
                      "def fn(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    before = signal.getsignal(signal.SIGTERM)
    r = train("--out", tmp_path / "run", "--steps", 1, "--reward", f"{reward}:fn", model=tiny_llama)
    one_line(r, "stopped by SIGTERM before training began; nothing was trained", code=130)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_in_edgerl_eval_is_one_line(tiny_llama, monkeypatch):
    import edgerl.train.eval_run as eval_run
    from edgerl.cli.main import app
    from typer.testing import CliRunner

    def interrupted(*args, **kwargs):
        raise Interrupted("SIGINT", "reward function fn")
    monkeypatch.setattr(eval_run, "run_eval", interrupted)
    one_line(CliRunner().invoke(app, ["eval", str(tiny_llama), "--data", "builtin:arithmetic", "--set",
                                      'run.profile="cpu"']), "stopped by SIGINT; run the command again", code=130)
