"""Run-folder integrity: the lock and the folder check as one step, a resume that writes nothing before
every check has passed, each kind of change a resume accepts (applied to the restored state, or refused),
a way on from a folder with metrics and no checkpoint, checkpoints verified by their checksums, and
non-finite gradients and weights that never reach a checkpoint or an export. Tiny random models; the
CLI through typer's CliRunner, the library where a state must be looked at."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from edgerl.cli.main import app
from edgerl.core.errors import RunDirError, TrainingError
from edgerl.train import checkpoint, resume
from edgerl.train.metrics import read_metrics

runner = CliRunner()
FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=64", "train.lr=1e-4"]
LOCK = ".edgerl.lock"


def train(*args, model: Path | None = None, sets: list[str] = FAST):
    cmd = ["train", *(["--model", str(model)] if model else []), *[str(a) for a in args]]
    return runner.invoke(app, cmd + [x for s in sets for x in ("--set", s)])


def files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder` but the lock, with its bytes and inode (an atomic rewrite shows too)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_ino) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK}


def refused(r, *texts: str) -> str:
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    out = r.output.strip()
    assert out.count("error:") == 1 and "Traceback" not in out, out
    for text in texts:
        assert text in " ".join(out.split()), out
    return out


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


# --- the lock and the check are one step -------------------------------------------------------------

def _during_data_load(monkeypatch, action) -> None:
    """Run `action` while `edgerl train` loads its data: after its first check of the folder, before it
    locks the folder (the window in which a second run used to slip in)."""
    import edgerl.train.session as session
    real = session.load_prompts

    def slow_load(*args, **kwargs):
        action()
        return real(*args, **kwargs)
    monkeypatch.setattr(session, "load_prompts", slow_load)


def test_a_run_that_finished_in_the_folder_while_this_one_loaded_is_not_touched(tiny_llama, finished_run,
                                                                                 tmp_path, monkeypatch):
    out = tmp_path / "R"
    _during_data_load(monkeypatch, lambda: shutil.copytree(finished_run, out))   # the first run, done meanwhile
    r = train("--steps", 2, "--out", out, model=tiny_llama)
    refused(r, f"{out} already holds a run (checkpoints up to step-000004")
    assert {k: v[0] for k, v in files(out).items()} == {k: v[0] for k, v in files(finished_run).items()}  # as left


def test_a_run_training_in_the_folder_while_this_one_loaded_keeps_it(tiny_llama, tmp_path, monkeypatch):
    from edgerl.train.runfolder import RunLock
    out, held = tmp_path / "R", []

    def first_run_starts():   # what the first run does once it holds the lock
        out.mkdir()
        lock = RunLock(out)
        lock.claim()
        (out / "config.toml").write_text("# the first run's\n")
        held.append(lock)
    _during_data_load(monkeypatch, first_run_starts)
    try:
        refused(train("--steps", 2, "--out", out, model=tiny_llama), "another edgerl process (pid ",
                f"is training in {out}")
        assert sorted(p.name for p in out.iterdir()) == [LOCK, "config.toml"]
        assert (out / "config.toml").read_text() == "# the first run's\n"
    finally:
        held[0].release()


def test_a_refused_check_under_the_lock_leaves_no_folder_it_created(tmp_path):
    from edgerl.train.runfolder import open_run

    def fail():
        raise RunDirError("refused")
    with pytest.raises(RunDirError):
        open_run(tmp_path / "new", print, fail)
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(RunDirError):
        open_run(tmp_path / "mine", print, fail)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "x"   # a folder it did not create stays


# --- what a resume changes: refused before anything is written, or applied -------------------------

@pytest.mark.parametrize("change,texts", [
    (["--set", "train.seed=7"], ["train.seed changed from 0 to 7", "resume with train.seed=0 (the run's value)"]),
    (["--set", "data.shuffle=false"], ["data.shuffle changed from true to false"]),
    (["--set", "lora.enabled=true"], ["the checkpoint holds full weights, but this run trains LoRA",
                                      "resume with the lora.enabled the run had (false)"]),
    (["--set", "algo.advantage=gae"], ["the checkpoint holds no critic, but this run trains one"]),
    (["--set", "data.num_examples=32"], ["the data now gives 32 prompts, but the checkpoint's prompt order is "
                                         "over 64"]),
    (["--set", "plan.optimizer=adamw-bf16"], ["the checkpoint's optimizer state is adamw's, but this run's plan "
                                              "uses adamw-bf16", "--set plan.optimizer=adamw"]),
])
def test_a_change_the_checkpoint_cannot_follow_is_refused_before_anything_is_written(run_copy, change, texts):
    before = files(run_copy)
    refused(train("--resume", run_copy, "--steps", 6, *change, sets=[]), *texts)   # config.toml has FAST
    assert files(run_copy) == before   # config.toml and plan.json not rewritten (same bytes, same inode)


def test_a_refused_resume_leaves_a_plain_resume_working(run_copy):
    refused(train("--resume", run_copy, "--steps", 5, "--set", "lora.enabled=true", sets=[]), "trains LoRA")
    r = train("--resume", run_copy, "--steps", 5)
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in read_metrics(run_copy)] == [1, 2, 3, 4, 5]


def test_a_checkpoint_that_fails_to_load_in_place_has_changed_nothing(run_copy, monkeypatch):
    """Writes of a run resumed in place wait for its checkpoint to load: a failure there (a model of
    other shapes, say) leaves config.toml as it was, so a plain --resume is not sent to a changed file."""
    import edgerl.train.state
    from edgerl.core.errors import CheckpointError

    def fail(*args, **kwargs):
        raise CheckpointError("does not match this run's model")
    monkeypatch.setattr(edgerl.train.state, "restore", fail)
    before = files(run_copy)
    refused(train("--resume", run_copy, "--steps", 6, "--set", "rollout.max_new_tokens=4"), "does not match")
    assert files(run_copy) == before


def test_changes_resume_restores_from_the_checkpoint_are_applied_and_said(run_copy):
    """train.lr, algo.kl_coef: the checkpoint holds them too (the optimizer, the schedule, the KL
    controller); a changed value is written into the restored state, printed, and seen in the metrics.
    rollout.max_new_tokens is read from the config (the class nothing in a checkpoint overrides)."""
    r = train("--resume", run_copy, "--steps", 6, "--set", "train.lr=0.05", "--set", "algo.kl_coef=0.01",
              "--set", "rollout.max_new_tokens=4", sets=[])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "changed since the checkpoint of step 4, in effect from step 5:" in said
    assert "train.lr 0.0001 -> 0.05 (set in the optimizer's and the schedule's learning rate)" in said
    assert "algo.kl_coef 0.001 -> 0.01 (set in the KL controller's coefficient)" in said
    assert "rollout.max_new_tokens 8 -> 4" in said
    rows = read_metrics(run_copy)
    assert [row["actor/lr"] for row in rows] == [1e-4] * 4 + [0.05, 0.05]
    assert [row["actor/kl_coef"] for row in rows] == [0.001] * 4 + [0.01, 0.01]
    assert all(row["response/length_max"] <= 4 for row in rows[4:])
    assert "\nlr = 0.05  #" in (run_copy / "config.toml").read_text()   # a plain --resume keeps them


def test_optimizer_settings_changed_on_resume_reach_the_restored_optimizer(tiny_llama, run_copy):
    from conftest import prepare_trainer
    t = prepare_trainer(tiny_llama, run_copy, FAST + ["train.steps=6", "train.lr=0.02", "train.betas=[0.5, 0.9]",
                                                      "train.weight_decay=0.1"], resume=run_copy)
    try:
        g = t.state.actor.optim.param_groups[0]
        assert (g["lr"], tuple(g["betas"]), g["weight_decay"]) == (0.02, (0.5, 0.9), 0.1)
        assert t.state.actor.sched.base_lrs == [0.02]
    finally:
        t.session.close()


def test_every_key_resume_treats_apart_is_a_config_key_and_restore_is_covered():
    import dataclasses
    from edgerl.config.schema import Config
    keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(s.type
            if isinstance(s.type, type) else type(getattr(Config(), s.name)))}
    for table in (resume.RESTORED, resume.REFUSED, dict.fromkeys(resume.SCHEDULE), dict.fromkeys(resume.IGNORED)):
        assert set(table) <= keys, set(table) - keys
    # what of the config an optimizer's param_groups hold (a checkpoint restores them) is a restored key
    from edgerl.train.optim import make_optimizer
    for name, dtype in (("adamw", torch.float32), ("adamw-bf16", torch.bfloat16)):
        a, b = (make_optimizer([torch.nn.Parameter(torch.ones(2, dtype=dtype))], name, lr, betas, wd).param_groups[0]
                for lr, betas, wd in ((1e-3, (0.9, 0.99), 0.0), (2e-3, (0.5, 0.6), 0.3)))
        assert {k for k in a if k != "params" and a[k] != b[k]} == {"lr", "betas", "weight_decay"}, name
    assert {"train.lr", "train.betas", "train.weight_decay"} <= set(resume.RESTORED)


def test_changes_lists_every_differing_key_but_the_folder():
    from edgerl.config.load import load_config
    old = load_config(sets=["train.lr=1e-4", 'run.out_dir="a"'])
    new = load_config(sets=["train.lr=0.05", 'run.out_dir="b"', "rollout.top_k=5"])
    from edgerl.config.schema import to_dict
    assert resume.changes(to_dict(old), new) == {"train.lr": (1e-4, 0.05), "rollout.top_k": (0, 5)}
    assert resume.changes(None, new) == {}


# --- a folder with metrics and no checkpoint is not stuck ------------------------------------------------

def test_a_folder_with_metrics_and_no_checkpoint_restarts_with_the_old_files_kept(tiny_llama, finished_run,
                                                                                 tmp_path):
    run = tmp_path / "R"
    run.mkdir()
    for name in ("config.toml", "plan.json", "metrics.jsonl"):
        shutil.copy(finished_run / name, run / name)
    (run / "notes.txt").write_text("mine")
    old = files(run)
    refused(train("--out", run, "--steps", 1, model=tiny_llama),
            "without a checkpoint to continue from; start over there with --out", "--restart")
    refused(train("--resume", run), "no checkpoint in")
    assert files(run) == old
    r = train("--out", run, "--restart", "--steps", 1, "--set", "run.export_final=false", model=tiny_llama)
    assert r.exit_code == 0, r.output
    assert "--restart: moved the earlier run's config.toml, metrics.jsonl, plan.json into" in " ".join(r.output.split())
    aside = run / "earlier-run-1"
    assert {k: v[0] for k, v in files(aside).items()} == {k: v[0] for k, v in old.items() if k != "notes.txt"}
    assert (run / "notes.txt").read_text() == "mine"   # the user's own file stays where it was
    assert [row["step"] for row in read_metrics(run)] == [1]
    refused(train("--resume", run, "--restart"), "--restart starts a new run in --out")


# --- checkpoints verified by their checksums ---------------------------------------------------------------

def test_a_checkpoint_records_the_size_and_sha256_of_every_file(finished_run):
    ckpt = checkpoint.latest(finished_run)
    sums = json.loads((ckpt / "meta.json").read_text())["files"]
    assert set(sums) == {p.name for p in ckpt.iterdir()} - {"meta.json"}
    for name, want in sums.items():
        assert want == {"bytes": (ckpt / name).stat().st_size, "sha256": checkpoint.sha256(ckpt / name)}


def _flip(path: Path, at: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[min(at, len(data) - 1)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,named", [
    (lambda c: _flip(c / "optim.pt"), "optim.pt is damaged: its bytes differ from those written (sha256 mismatch)"),
    (lambda c: _flip(c / "actor.safetensors", 5000), "actor.safetensors is damaged: its bytes differ"),
    (lambda c: (c / "train.pt").unlink(), "train.pt is missing"),
    (lambda c: (c / "optim.pt").unlink(), "optim.pt is missing"),
    (lambda c: (c / "sched.pt").write_bytes(b"x"), "sched.pt is damaged: 1 bytes, but"),
])
def test_a_damaged_or_missing_checkpoint_file_is_named_and_nothing_is_written(run_copy, damage, named):
    ckpt = run_copy / "checkpoints" / "step-000004"
    damage(ckpt)
    before = files(run_copy)
    out = refused(train("--resume", run_copy, "--steps", 6), f"checkpoint step-000004 cannot be resumed: {ckpt}/",
                  named, f"edgerl train --resume {run_copy / 'checkpoints' / 'step-000002'} --out NEW_FOLDER")
    assert out.count("\n") == 0
    assert files(run_copy) == before


def test_a_damaged_meta_json_names_it_and_the_advice_leads_on(run_copy, tmp_path):
    ckpt = run_copy / "checkpoints" / "step-000004"
    (ckpt / "meta.json").write_text('{"step": 4, "conf')
    earlier = run_copy / "checkpoints" / "step-000002"
    for given in (run_copy, ckpt):
        refused(train("--resume", given, "--steps", 6), f"{ckpt / 'meta.json'} is damaged",
                f"edgerl train --resume {earlier} --out NEW_FOLDER")
    r = train("--resume", earlier, "--out", tmp_path / "branch", "--steps", 3)   # the advice works
    assert r.exit_code == 0, r.output
    (earlier / "meta.json").unlink()   # with no good checkpoint left, the way on is a restart, not a loop
    refused(train("--resume", earlier, "--out", tmp_path / "b2", "--steps", 3), f"{earlier / 'meta.json'} is missing",
            f"start over with edgerl train --out {run_copy} --restart")


def test_a_checkpoint_from_before_checksums_still_needs_its_files(run_copy):
    ckpt = run_copy / "checkpoints" / "step-000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "train.pt").unlink()
    refused(train("--resume", run_copy, "--steps", 6), f"{ckpt / 'train.pt'} is missing")


def test_checkpoints_that_is_a_file_is_one_line(tiny_llama, tmp_path):
    run = tmp_path / "R"
    run.mkdir()
    (run / "checkpoints").write_text("mine")
    refused(train("--out", run, "--steps", 1, model=tiny_llama), f"{run / 'checkpoints'} is a file")
    refused(train("--resume", run), f"{run / 'checkpoints'} is a file")
    assert (run / "checkpoints").read_text() == "mine"


# --- non-finite gradients and weights -----------------------------------------------------------------------

def _learner(model: torch.nn.Module):
    from edgerl.train.optim import StateOffload
    from edgerl.train.update import Learner
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Learner("actor", model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                   StateOffload(opt, False, False))


def _experience(n: int = 4):
    from edgerl.train.experience import Experience
    return Experience(input_ids=torch.zeros(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3, dtype=torch.long),
                      response_ids=torch.zeros(n, 2, dtype=torch.long), response_mask=torch.ones(n, 2), start=0,
                      scores=torch.zeros(n))


@pytest.mark.parametrize("scale,skipped", [(1e38, 1), (1.0, 0)])
def test_a_non_finite_gradient_norm_skips_the_update(scale, skipped):
    """A finite loss (0: the weights are 0) whose gradient is `scale` per weight: at 1e38 the fp32 norm
    of 64 of them is inf, and clipping would multiply by 0 and write NaN into the weights. That update
    is skipped, weights and optimizer state untouched; a finite norm steps as before."""
    from edgerl.train.update import run_update
    model = torch.nn.Linear(64, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ln = _learner(model)

    def loss_fn(part, epoch):
        return (model.weight * scale).sum(), {}
    res = run_update(ln, _experience(), loss_fn, mini=4, epochs=1, micro=4, agg="token-mean",
                     gen=torch.Generator(), device=torch.device("cpu"), max_grad_norm=1.0, scaler=None)
    assert (res.skipped, res.skipped_norm) == (0, skipped)
    if skipped:
        assert res.grad_norms == [] and not ln.optim.state and torch.count_nonzero(model.weight) == 0
    else:
        assert res.grad_norms == [pytest.approx(8.0)] and torch.isfinite(model.weight).all()
        assert torch.count_nonzero(model.weight) == 64


def test_steps_whose_gradient_norm_is_not_finite_are_counted_reported_and_stop_the_run(tiny_llama, tmp_path,
                                                                                       monkeypatch):
    from conftest import prepare_trainer
    import edgerl.train.update as update
    from edgerl.train.metrics import summary_line
    monkeypatch.setattr(update.torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(float("inf")))
    run = tmp_path / "run"
    t = prepare_trainer(tiny_llama, run, FAST + ["train.steps=5", "train.max_bad_steps=2", "run.save_every=1"])
    before = {k: v.detach().clone() for k, v in t.actor.state_dict().items()}
    lines = []
    with pytest.raises(TrainingError, match=r"^the gradient norm was NaN or infinite in 2 steps in a row \(updates "
                                            r"skipped\)"):
        t.run(lambda step, stats: lines.append(summary_line(stats)))
    rows = read_metrics(run)
    assert [r["actor/skipped_updates"] for r in rows] == [1.0]   # step 2 raised before its row was written
    assert "skipped 1" in lines[0]
    assert all(torch.equal(v, before[k]) for k, v in t.actor.state_dict().items())   # no update reached a weight


def test_non_finite_weights_are_neither_saved_nor_exported_and_the_last_good_checkpoint_stays(tiny_llama, tmp_path):
    from conftest import prepare_trainer
    run = tmp_path / "run"
    t = prepare_trainer(tiny_llama, run, FAST + ["train.steps=1", "run.save_every=1", "run.keep_last=1",
                                                 "run.export_final=false"])
    t.run()
    good = files(run / "checkpoints")
    with torch.no_grad():
        next(t.actor.parameters()).view(-1)[0] = float("inf")
    t.state.loop.step = 2
    with pytest.raises(TrainingError, match=r"the weights after step 2 hold NaN or infinite values .*not saved, so "
                                            rf"the last good checkpoint stays: {run / 'checkpoints' / 'step-000001'}"):
        t.save()
    with pytest.raises(TrainingError, match=r"^the final weights \(step 2\) hold NaN or infinite values .*: not "
                                            r"exported; the last good checkpoint stays"):
        t.export(run / "final")
    assert files(run / "checkpoints") == good and not (run / "final").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".")  and p.name != LOCK]


# --- a full disk while writing a checkpoint or the export -------------------------------------------------

def test_a_full_disk_under_torch_save_or_safetensors_is_one_line_and_the_last_checkpoint_stays(tiny_llama,
                                                                                            tmp_path, monkeypatch):
    """torch.save raises RuntimeError and safetensors SafetensorError when the disk fills up under
    them, not OSError: both end in one line naming the file, the earlier checkpoint intact."""
    from conftest import prepare_trainer
    import transformers
    from safetensors import SafetensorError
    run = tmp_path / "run"
    t = prepare_trainer(tiny_llama, run, FAST + ["train.steps=1", "run.save_every=1", "run.export_final=false"])
    t.run()
    good = files(run / "checkpoints")

    def full_torch_save(obj, path, *a, **k):
        Path(path).write_bytes(b"part")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
    monkeypatch.setattr(checkpoint.torch, "save", full_torch_save)
    t.state.loop.step = 2
    with pytest.raises(RunDirError, match=r"cannot write to .* \(writing optim.pt failed \(\[enforce fail.*unexpected "
                                          r"pos 64 vs 0\).*the last complete checkpoint and export are intact"):
        t._write(t.save)
    monkeypatch.undo()
    assert files(run / "checkpoints") == good and not list((run / "checkpoints").glob(".*"))

    def full_safetensors(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full_safetensors)
    with pytest.raises(RunDirError, match=r"writing final failed \(Error while serializing: .*StorageFull"):
        t._write(lambda: t.export(run / "final"))
    assert not (run / "final").exists() and not list(run.glob(".final*"))


def test_a_log_file_gets_one_line_per_step_and_no_progress_bar(tiny_llama, tmp_path):
    """Written to a file or a pipe (not a terminal), `edgerl train` prints each step's line once; the live
    progress bar, which only a terminal can redraw, would leave its last frame in the log."""
    r = train("--steps", 2, "--out", tmp_path / "run", model=tiny_llama)
    assert r.exit_code == 0, r.output
    steps = [ln for ln in r.output.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1", "2"], r.output   # the bar's frame reads "step 2/2 ━━━" or "step …"


def test_a_log_file_gets_no_library_progress_bars(tiny_llama, tmp_path, monkeypatch):
    """transformers' own bars ("Loading weights", "Writing model shards") would leave every frame in a log
    file; off where stderr is not a terminal (CliRunner's is not)."""
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    from transformers.utils import logging as hf_logging
    hf_logging.enable_progress_bar()
    try:
        r = train("--steps", 1, "--out", tmp_path / "run", model=tiny_llama)
        assert r.exit_code == 0, r.output
        assert "Loading weights" not in r.output and "it/s]" not in r.output, r.output
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
