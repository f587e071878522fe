"""Which checkpoints a run keeps (run.keep_last, run.keep_best), what it says they cost, and run.final_only."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import torch

from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError
from edgerl.train import checkpoint, retention


def slow_kept(found, keep_last, keep_best):
    """The rule written out: the newest keep_last by step (the newest at least), plus the step with the
    highest score, the later step on a tie."""
    by_step = sorted(found)
    keep = []
    for i in range(len(by_step)):
        if i >= len(by_step) - max(keep_last, 1):
            keep.append(by_step[i][0])
    if keep_best:
        best = None
        for step, score in by_step:
            if score is not None and (best is None or score >= best[1]):
                best = (step, score)
        if best is not None and best[0] not in keep:
            keep.append(best[0])
    return set(keep)


def test_kept_matches_the_rule_written_out():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 7)
        steps = rng.sample(range(1, 40), n)
        found = [(s, rng.choice([None, 0.25, 0.5, 0.75, 1.0])) for s in steps]
        for keep_last, keep_best in itertools.product((1, 2, 3), (False, True)):
            assert retention.kept(found, keep_last, keep_best) == slow_kept(found, keep_last, keep_best), \
                (found, keep_last, keep_best)


def test_hand_picked_cases():
    assert retention.kept([(12, 0.86), (24, 0.98)], 2, True) == {12, 24}
    assert retention.kept([(10, 0.9), (20, 0.5), (30, 0.6), (40, None)], 2, True) == {10, 30, 40}
    assert retention.kept([(10, 0.9), (20, 0.5), (30, 0.6), (40, None)], 2, False) == {30, 40}
    assert retention.kept([(10, 0.5), (20, 0.5), (30, None)], 1, True) == {20, 30}    # a tie: the later


def save(run, step, score=None, keep_last=2, keep_best=True):
    sd = {"actor": {"w": torch.full((64,), float(step))}}
    state = {"optim": {"m": torch.zeros(128)}, "sched": {}, "train": {"step": step}}
    meta = {"step": step, **({"eval_score": score} if score is not None else {})}
    return checkpoint.save(run, step, sd, state, meta, keep_last=keep_last, keep_best=keep_best)


def names(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_saving_keeps_the_newest_and_the_best_and_never_removes_the_newest(tmp_path):
    save(tmp_path, 1, 0.3)
    save(tmp_path, 2, 0.9)    # the best
    save(tmp_path, 3)         # not evaluated
    save(tmp_path, 4, 0.4)
    assert names(tmp_path) == ["step-000002", "step-000003", "step-000004"]
    save(tmp_path, 5, 0.95)   # a new best: step 2 goes
    assert names(tmp_path) == ["step-000004", "step-000005"]
    assert json.loads((tmp_path / "checkpoints" / "step-000005" / "meta.json").read_text())["eval_score"] == 0.95
    save(tmp_path, 6, 0.1, keep_last=1, keep_best=False)
    assert names(tmp_path) == ["step-000006"]


def test_a_failed_write_removes_no_older_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, 1, 0.5)
    save(tmp_path, 2, 0.6)
    import safetensors.torch

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError):
        save(tmp_path, 3, 0.7, keep_last=1, keep_best=False)
    assert names(tmp_path) == ["step-000001", "step-000002"]


def test_final_only_keeps_the_best_weights_without_optimizer_state(tmp_path):
    for step, score in ((1, 0.9), (2, 0.5), (3, 0.6)):
        save(tmp_path, step, score, keep_last=3)
    said = []
    retention.finish(tmp_path, checkpoint.checkpoints(tmp_path), 3, keep_best=True, log=said.append)
    assert names(tmp_path) == ["step-000001"]
    best = tmp_path / "checkpoints" / "step-000001"
    assert sorted(p.name for p in best.iterdir()) == ["actor.safetensors", "meta.json", "sched.pt", "train.pt"]
    why = checkpoint.damage(best)
    assert why is not None and "holds weights only" in why and "run.final_only" in why
    assert "without its optimizer state" in said[0] and re.search(r"3 checkpoint\(s\) .*freed$", said[-1])


def test_final_only_removes_every_checkpoint_when_the_last_step_is_the_best(tmp_path):
    for step, score in ((1, 0.5), (2, 0.9)):
        save(tmp_path, step, score)
    retention.finish(tmp_path, checkpoint.checkpoints(tmp_path), 2, keep_best=True, log=lambda s: None)
    assert names(tmp_path) == []


def test_final_only_needs_the_final_export():
    with pytest.raises(ConfigError, match="run.final_only .* run.export_final = false writes no final/"):
        load_config(None, ["run.final_only=true", "run.export_final=false"])


def test_the_start_line_says_the_size_the_count_and_what_stays():
    line = retention.plan_line(538 * 2**20, 1076 * 2**20, 12, 2, True, True, False, 538 * 2**20)
    assert line == ("checkpoints: every 12 steps, each about 1.58 GiB (weights 538 MiB, optimizer state 1.05 GiB); "
                    "at most 3 kept (the newest 2 and the best by held-out score; run.keep_last, run.keep_best); "
                    "at the end they stay beside final/ (about 538 MiB) (--final-only removes them)")
    line = retention.plan_line(100 * 2**20, 200 * 2**20, 0, 1, True, False, True, None)
    assert "only on a stop signal" in line and "at most 1 kept (the newest 1;" in line
    assert line.endswith("at the end only final/ stays (run.final_only)")


def test_a_run_says_what_a_checkpoint_costs_and_final_only_leaves_the_final_model(tiny_llama, tmp_path):
    from conftest import prepare_trainer
    from edgerl.train.state import checkpoint_bytes
    run = tmp_path / "run"
    said = []
    t = prepare_trainer(tiny_llama, run, ['run.profile="cpu"', "rollout.max_new_tokens=4", "train.prompts_per_step=2",
                                          "rollout.n_samples=2", "run.tensorboard=false", "data.num_examples=16",
                                          "train.steps=2", "run.save_every=1", "run.final_only=true"], log=said.append)
    start = [s for s in said if s.startswith("checkpoints: every step, each about ")]
    assert len(start) == 1 and re.search(r"at the end only final/ \(about \d+ MiB\) stays \(run.final_only\)$", start[0]), said
    weights, optim = checkpoint_bytes(t.state, t.plan.optimizer)
    t.save()   # step 0's checkpoint, to weigh one against the estimate
    folder = run / "checkpoints" / "step-000000"
    real = {f.name: f.stat().st_size for f in folder.iterdir()}
    assert abs(real["actor.safetensors"] - weights) < 0.01 * weights
    assert abs(real["optim.pt"] - optim) < 0.02 * optim + 50_000
    assert re.search(rf"checkpoint: {re.escape(str(folder))} \(\d+ MiB\)", said[-1]), said
    t.run()
    assert (run / "final" / "config.json").exists()
    from edgerl.train.state import export_bytes
    written = sum(f.stat().st_size for f in (run / "final").glob("*.safetensors"))
    assert abs(written - export_bytes(t.actor.lm)) < 0.01 * written   # the start line's final/ size
    assert not list((run / "checkpoints").iterdir()), "run.final_only leaves the final model alone"
    assert any("run.final_only: 2 checkpoint(s) reduced to the final model" in s for s in said), said  # steps 1, 2
    from edgerl.train.eval_run import load_eval_config
    cfg, folder = load_eval_config(str(run), [])   # `edgerl eval RUN` evaluates final/ with the run's config
    assert folder is None and cfg.model.path == str(run / "final") and cfg.rollout.max_new_tokens == 4
