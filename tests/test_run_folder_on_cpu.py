"""Run folders through `edgerl train` (typer's CliRunner; a subprocess where a second process
matters): what is refused, with which message and exit status, and that nothing a user had changes
(file bytes compared before and after). Tiny random models, a few steps each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgerl.core.errors import RunDirError
from edgerl.core.files import write_atomically
from typer.testing import CliRunner

from edgerl.train import checkpoint
from edgerl.cli.main import app
from edgerl.train.metrics import read_metrics

runner = CliRunner()
FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=64", "train.lr=1e-4"]
LOCK = ".edgerl.lock"   # holds the pid of the process training there: rewritten by every run that locks


def train(*args, model: Path | None = None, sets: list[str] = FAST):
    cmd = ["train", *(["--model", str(model)] if model else []), *[str(a) for a in args]]
    return runner.invoke(app, cmd + [x for s in sets for x in ("--set", s)])


def files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder` (but the lock) by relative path, with its bytes and inode: a file
    rewritten with the same bytes (an atomic write is a new file renamed over the old) shows too."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_ino) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK}


def refused(r, *texts: str) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    for text in texts:
        assert text in r.output, r.output
    return r.output


@pytest.fixture(scope="module")
def finished_run(tiny_llama, tmp_path_factory) -> Path:
    """A run that went to step 4: checkpoints of steps 2 and 4, metrics of steps 1-4, final/."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = train("--steps", 4, "--out", run, "--set", "run.save_every=2", model=tiny_llama)
    assert r.exit_code == 0, r.output
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def test_out_on_a_finished_run_is_refused_and_nothing_changes(tiny_llama, run_copy):
    before = files(run_copy)
    refused(train("--steps", 2, "--out", run_copy, model=tiny_llama),
            f"{run_copy} already holds a run (checkpoints up to step-000004, metrics of steps 1-4, a final model); "
            f"continue it with --resume {run_copy}")
    assert files(run_copy) == before


def test_resume_of_an_older_checkpoint_in_place_is_refused_with_the_advice_to_branch(run_copy):
    before = files(run_copy)
    ckpt = run_copy / "checkpoints" / "step-000002"
    refused(train("--resume", ckpt), f"--resume {ckpt} goes back to step 2, but {run_copy} went on to step-000004",
            f"Branch into a new folder with --resume {ckpt} --out NEW_FOLDER")
    assert files(run_copy) == before


def test_resume_of_an_older_checkpoint_with_out_branches(run_copy, tmp_path):
    before = files(run_copy)
    branch = tmp_path / "branch"
    r = train("--resume", run_copy / "checkpoints" / "step-000002", "--out", branch, "--steps", 3)
    assert r.exit_code == 0, r.output
    assert files(run_copy) == before   # the trunk is untouched
    old, new = read_metrics(run_copy), read_metrics(branch)
    assert [row["step"] for row in new] == [1, 2, 3]
    assert new[:2] == old[:2]          # the branch starts with the trunk's history up to its checkpoint
    assert checkpoint.latest(branch).name == "step-000003" and (branch / "final" / "config.json").exists()


REWARD = '''
calls = 0


def fails_at_step_4(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on the first sample of step 4 (2 prompts x 4 samples = 8 calls a step)."""
    global calls
    calls += 1
    if calls > 24:
        raise KeyError("expected_field")
    return 0.5


def fine(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
'''


def test_a_reward_that_raises_keeps_the_last_good_step_and_says_how_to_resume(tiny_llama, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARD)
    run = tmp_path / "run"
    out = refused(train("--steps", 6, "--out", run, "--reward", f"{rewards}:fails_at_step_4", "--set",
                        "run.save_every=5", model=tiny_llama),
                  "sample 0 of the batch", "KeyError: 'expected_field'", "saved the last good state (step 3)",
                  f"then resume with --resume {run}")
    assert out.count("error:") == 1
    assert [c.name for c in checkpoint.checkpoints(run)] == ["step-000003"]
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3]
    # the advice works: with the reward fixed, the run continues from step 3 to the end
    r = train("--resume", run, "--reward", f"{rewards}:fine")
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3, 4, 5, 6]


def _poison(ckpt: Path) -> None:
    """A NaN in the actor's weights, as a run that diverged writes it (its checksum recorded with it)."""
    from safetensors.torch import load_file, save_file
    path = ckpt / "actor.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, str(path))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][path.name] = {"bytes": path.stat().st_size, "sha256": checkpoint.sha256(path)}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_resume_from_a_checkpoint_with_nan_weights_is_refused_before_anything_is_written(run_copy, tmp_path):
    ckpt = run_copy / "checkpoints" / "step-000004"
    _poison(ckpt)
    before = files(run_copy)
    refused(train("--resume", run_copy, "--steps", 6), f"{ckpt} holds NaN or infinite weights (actor/",
            f"branch from an earlier one: edgerl train --resume {run_copy / 'checkpoints' / 'step-000002'} "
            "--out NEW_FOLDER")
    assert files(run_copy) == before   # not even plan.json was rewritten
    refused(train("--resume", ckpt, "--out", tmp_path / "branch"), "holds NaN or infinite weights")
    assert not (tmp_path / "branch").exists()


def test_interrupted_writes_are_removed_by_the_next_run_in_the_folder(run_copy):
    leftovers = [run_copy / "checkpoints" / ".step-000005-x1y2z3ab", run_copy / ".final-tmp-x1y2z3ab",
                 run_copy / "checkpoints" / ".step-000002-old-0a1b2c3d"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    (run_copy / ".metrics.0a1b2c3d.tmp.jsonl").write_text('{"step": 1')
    r = train("--resume", run_copy, "--steps", 5)
    assert r.exit_code == 0, r.output
    for name in (".step-000005-x1y2z3ab", ".final-tmp-x1y2z3ab", ".metrics.0a1b2c3d.tmp.jsonl"):
        assert f"removed {name}: left by a write that was interrupted" in r.output
    assert not any(p.exists() for p in leftovers) and not (run_copy / ".metrics.0a1b2c3d.tmp.jsonl").exists()
    assert [c.name for c in checkpoint.checkpoints(run_copy)] == ["step-000004", "step-000005"]


def test_a_failed_export_leaves_no_half_final_and_the_earlier_one_whole(tiny_llama, run_copy, monkeypatch):
    import edgerl.train.trainer as trainer_mod
    from conftest import prepare_trainer
    before = files(run_copy / "final")

    def half_written(weights, source, tokenizer, folder, trust_remote_code=False):
        (Path(folder) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(trainer_mod, "save_hf", half_written)
    t = prepare_trainer(tiny_llama, run_copy, FAST + ["train.steps=5"], resume=run_copy)
    with pytest.raises(RunDirError, match=r"No space left on device.*last complete checkpoint and export are intact"):
        t.run()
    assert files(run_copy / "final") == before
    assert not list(run_copy.glob(".final*")) and not list(run_copy.glob("final-step-*"))
    assert checkpoint.latest(run_copy).name == "step-000005"   # the step itself was saved before the export
    # exported again, the earlier final/ is kept beside the new one under the step it was written at
    monkeypatch.undo()
    t = prepare_trainer(tiny_llama, run_copy, FAST + ["train.steps=5"], resume=run_copy)
    t.run()
    assert files(run_copy / "final-step-000004") == before
    assert json.loads((run_copy / "final" / "edgerl-export.json").read_text()) == {"step": 5}


def test_out_dir_with_a_tilde_is_in_the_home_folder(tiny_llama, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('[run]\nout_dir = "~/x"\n')
    r = train("--config", cfg, "--steps", 1, "--set", "run.export_final=false", model=tiny_llama)
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in read_metrics(home / "x")] == [1]
    assert not (tmp_path / "~").exists()
    r = train("--out", "~/y", "--steps", 1, "--set", "run.export_final=false", model=tiny_llama)
    assert r.exit_code == 0, r.output
    assert (home / "y" / "metrics.jsonl").exists() and not (tmp_path / "~").exists()


def test_out_that_is_a_file_or_under_a_file_is_one_line(tiny_llama, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    out = refused(train("--out", f, model=tiny_llama), f"--out {f} is a file; give a folder for the run")
    assert out.strip().count("\n") == 0
    out = refused(train("--out", f / "run", model=tiny_llama),
                  f"--out {f / 'run'}: {f} is a file, so no folder can be made there; choose another --out")
    assert out.strip().count("\n") == 0
    assert f.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_second_process_training_in_the_folder_is_refused(run_copy):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from edgerl.train.runfolder import RunLock; "
         f"lock = RunLock(Path({str(run_copy)!r})); lock.claim(); print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = files(run_copy)
        refused(train("--resume", run_copy, "--steps", 6),
                f"another edgerl process (pid {holder.pid}) is training in {run_copy}")
        assert files(run_copy) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    r = train("--resume", run_copy, "--steps", 5)   # the lock goes with the process that held it
    assert r.exit_code == 0, r.output


def test_resume_of_a_finished_run_has_nothing_to_do_and_writes_nothing(run_copy):
    before = files(run_copy)
    r = train("--resume", run_copy)
    assert r.exit_code == 0, r.output
    assert f"nothing to do: {run_copy} finished at step 4" in r.output
    assert f"--resume {run_copy} --steps N with N > 4" in r.output
    assert files(run_copy) == before


def test_resume_in_place_with_more_steps_is_remembered_by_config_toml(run_copy):
    r = train("--resume", run_copy, "--steps", 5)
    assert r.exit_code == 0, r.output
    # (run.out_dir too: this copy of the run lives in another folder than the one it was started in)
    assert "config.toml updated with this run's settings (train.steps, run.out_dir)" in r.output
    before = files(run_copy)
    r = train("--resume", run_copy)   # a plain resume now knows the run goes to step 5
    assert r.exit_code == 0 and f"nothing to do: {run_copy} finished at step 5 (train.steps=5)" in r.output
    assert files(run_copy) == before


def test_a_torn_last_metrics_line_is_dropped_on_resume_with_a_note(run_copy):
    metrics = run_copy / "metrics.jsonl"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole + b'{"step": 5, "reward/me')
    r = train("--resume", run_copy, "--steps", 5)
    assert r.exit_code == 0, r.output
    assert f"metrics: ignored line 5 of {metrics}, cut short when the run stopped" in r.output
    assert "dropped it" in r.output
    assert metrics.read_bytes().startswith(whole)
    assert [row["step"] for row in read_metrics(run_copy)] == [1, 2, 3, 4, 5]


def test_a_damaged_model_file_is_one_error_naming_it_and_nothing_is_written(tiny_llama, tmp_path):
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    weights = model / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    run = tmp_path / "run"
    out = refused(train("--out", run, model=model), f"{weights} is damaged or cut short",
                  "download the model again, or re-save it with save_pretrained")
    assert out.strip().count("\n") == 0
    assert not run.exists()


def test_loading_a_damaged_model_names_the_file(tiny_llama, tmp_path):
    import torch
    from edgerl.core.errors import ModelError
    from edgerl.models.load import load_causal_lm
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    weights = model / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size - 100)
    with pytest.raises(ModelError, match=rf"^cannot load model '{model}': {weights} is damaged or cut short"):
        load_causal_lm(str(model), torch.float32, "sdpa")


def test_a_run_that_stopped_before_its_first_step_can_be_started_again(tiny_llama, run_copy, tmp_path,
                                                                      monkeypatch):
    """A failure after the run folder was set up (here: restoring the checkpoint) leaves its config and
    the branch's copied history; the same command again must not be refused as 'holds a run'."""
    import edgerl.train.state
    from edgerl.core.errors import CheckpointError

    def fail(*args, **kwargs):
        raise CheckpointError("simulated failure while restoring")
    ckpt, branch = run_copy / "checkpoints" / "step-000002", tmp_path / "branch"
    with monkeypatch.context() as m:
        m.setattr(edgerl.train.state, "restore", fail)
        refused(train("--resume", ckpt, "--out", branch, "--steps", 3), "simulated failure")
    assert (branch / "config.toml").exists()
    r = train("--resume", ckpt, "--out", branch, "--steps", 3)
    assert r.exit_code == 0, r.output
    assert f"{branch} held a run that stopped before its first step" in r.output
    assert [row["step"] for row in read_metrics(branch)] == [1, 2, 3]
    # a folder with history of its own is still refused
    refused(train("--resume", ckpt, "--out", branch, "--steps", 3), f"{branch} already holds a run")
    # a new run where one stopped before its first step (config and plan only, listed in its manifest;
    # without the manifest they would be the user's files, and refused)
    from edgerl.train.manifest import own
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for name in ("config.toml", "plan.json"):
        shutil.copy(run_copy / name, fresh / name)
    own(fresh, "config.toml", "plan.json")
    r = train("--out", fresh, "--steps", 1, "--set", "run.export_final=false", "--set", "run.save_every=0",
              model=tiny_llama)
    assert r.exit_code == 0, r.output
    # but not where metrics were written and no checkpoint is left to continue from
    refused(train("--out", fresh, "--steps", 1, model=tiny_llama),
            f"{fresh} already holds a run (metrics of steps 1-1) without a checkpoint to continue from")


def test_checkpoints_replace_and_prune_through_temporary_names(tmp_path):
    import torch
    sd = {"actor": {"w": torch.ones(2)}}
    for step in (1, 2, 2, 3):
        checkpoint.save(tmp_path, step, sd, {}, {"step": step}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
    umask = os.umask(0)
    os.umask(umask)
    assert (root / "step-000003").stat().st_mode & 0o777 == 0o777 & ~umask
    write_atomically(tmp_path / "config.toml", "x = 1\n")
    assert (tmp_path / "config.toml").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_checkpoint_copied_out_of_its_run_starts_a_new_run_only(run_copy, tmp_path):
    """Its grandparent folder is no run (here it holds the user's notes): resuming 'in place' would
    write plan.json, metrics and checkpoints there. With --out it starts a run, with the config the
    checkpoint was saved with (no --model needed)."""
    elsewhere = tmp_path / "elsewhere"
    lone = Path(shutil.copytree(run_copy / "checkpoints" / "step-000004", elsewhere / "kept" / "step-000004"))
    (elsewhere / "notes.txt").write_text("mine")
    before = files(elsewhere)
    refused(train("--resume", lone, "--steps", 5), f"--resume {lone} is a checkpoint outside a run folder",
            f"--resume {lone} --out NEW_FOLDER")
    assert files(elsewhere) == before
    new = tmp_path / "new"
    r = train("--resume", lone, "--out", new, "--steps", 5, sets=[])
    assert r.exit_code == 0, r.output
    assert files(elsewhere) == before
    assert [row["step"] for row in read_metrics(new)] == [5]   # no history: the checkpoint came without its run
    assert checkpoint.latest(new).name == "step-000005"


def test_resume_names_what_was_given_when_it_is_not_a_run(run_copy):
    r = train("--resume", run_copy / "checkpoints", "--steps", 4)   # the checkpoints folder means its run
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output
    refused(train("--resume", run_copy / "final"), f"--resume {run_copy / 'final'} is a model folder",
            f"train from it with --model {run_copy / 'final'}")


def test_a_folder_whose_metrics_name_no_step_is_described_by_what_it_holds(tmp_path):
    """A run folder whose metrics.jsonl does not parse is still a run a new one would mix with: the refusal says
    which file holds it, not "a config"."""
    from edgerl.train.runfolder import check_new
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("[model]\n")
    (out / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(RunDirError, match=r"already holds a run \(a metrics.jsonl in which no line names a step\) "
                                          r"without a checkpoint to continue from; start over there with --out"):
        check_new(out)
    assert (out / "metrics.jsonl").read_text() == "not json\n"
