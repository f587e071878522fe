"""A run folder owns only what it wrote: the manifest (edgerl-run.jsonl) lists it, a new run never writes
over a user's file of a name a run writes, `--restart` moves exactly the listed files, and the lock
holds while the run lives even if `.edgerl.lock` is deleted; a deleted metrics.jsonl is written again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_run_folder_integrity_on_cpu import FAST, files, refused, train

import edgerl
from edgerl.core.errors import RunDirError
from edgerl.train.lock import LOCK, RunLock
from edgerl.train.manifest import MANIFEST, owned
from edgerl.train.metrics import read_metrics

ONE = ["--steps", 1, "--set", "run.export_final=false"]


def test_a_users_config_and_plan_in_out_are_never_replaced(tiny_llama, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.toml").write_text('# my notes\n[train]\nsteps = 1\n[run]\nprofile = "cpu"\n')
    (proj / "plan.json").write_text('{"mine": true}\n')
    (proj / "notes.txt").write_text("x")
    before = files(proj)
    refused(train("-c", proj / "config.toml", "--out", proj, *ONE, model=tiny_llama),
            f"--out {proj} holds config.toml, plan.json, which edgerl did not write", "Choose another --out")
    refused(train("-c", proj / "config.toml", "--out", proj, "--restart", *ONE, model=tiny_llama), "config.toml, "
            "plan.json, which edgerl did not write")   # no run there: --restart moves nothing
    assert files(proj) == before


def test_restart_moves_exactly_the_runs_files(tiny_llama, tmp_path):
    run = tmp_path / "R"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    (run / "curves.pdf").write_text("my own plot")
    r = train("--out", run, *ONE, "--set", "run.log_samples=2", "--set", "run.save_every=1", model=tiny_llama)
    assert r.exit_code == 0, r.output
    listed = owned(run)
    assert {"config.toml", "plan.json", "metrics.jsonl", "samples.jsonl", "checkpoints"} <= listed
    assert {"notes.txt", "curves.pdf"}.isdisjoint(listed)
    (run / "loggers.json").write_text('{"wandb": "old-id"}\n')   # as a wandb run leaves it ...
    with open(run / MANIFEST, "a") as f:                           # ... listed as edgerl writes it
        f.write(json.dumps({"wrote": "loggers.json"}) + "\n")
    ours = sorted(n for n in os.listdir(run) if n in owned(run)) + [MANIFEST]
    r = train("--out", run, "--restart", *ONE, model=tiny_llama)
    assert r.exit_code == 0, r.output
    aside = run / "earlier-run-1"
    assert sorted(os.listdir(aside)) == sorted(ours)
    assert (run / "notes.txt").read_text() == "mine" and (run / "curves.pdf").read_text() == "my own plot"
    assert not (run / "samples.jsonl").exists() and not (run / "loggers.json").exists()
    assert [row["step"] for row in read_metrics(run)] == [1]


def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    first = RunLock(tmp_path)
    first.claim()
    try:
        (tmp_path / LOCK).unlink()
        with pytest.raises(RunDirError, match=rf"another edgerl process \(its {LOCK} was deleted, but it holds the "
                                              "folder's lock\\) is training in"):
            RunLock(tmp_path)
        assert first.keep() == f"{tmp_path / LOCK} was deleted during the run; written again (the folder stayed locked)"
        assert (tmp_path / LOCK).read_text() == str(os.getpid()) and first.keep() is None
        with pytest.raises(RunDirError, match=rf"another edgerl process \(pid {os.getpid()}\) is training in"):
            RunLock(tmp_path)
    finally:
        first.release()
    RunLock(tmp_path).release()   # released: the folder is free again


def test_a_closed_run_does_not_train(tiny_llama, tmp_path):
    run = edgerl.prepare(None, out=tmp_path / "r", log=None, **{"model.path": str(tiny_llama), "run.profile": "cpu",
                                                               "data.num_examples": 8})
    run.close()
    with pytest.raises(RunDirError, match="is no longer locked by this process"):
        run.train()
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_reward_deleting_the_lock_and_the_metrics_costs_neither(tiny_llama, tmp_path):
    run = tmp_path / "R"
    reward = tmp_path / "deleting.py"
    reward.write_text("import os\n"
                      f"RUN = {str(run)!r}\n"
                      "def fn(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    for name in ('metrics.jsonl', {LOCK!r}):\n"
                      "        try:\n"
                      "            os.remove(os.path.join(RUN, name))\n"
                      "        except FileNotFoundError:\n"
                      "            pass\n"
                      "    return 0.0\n")
    r = train("--out", run, "--steps", 2, "--reward", f"{reward}:fn", "--set", "run.export_final=false",
              model=tiny_llama)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert f"{run / 'metrics.jsonl'} was deleted during the run; written again with every row it held" in said
    assert f"{run / LOCK} was deleted during the run; written again" in said
    assert [row["step"] for row in read_metrics(run)] == [1, 2]


def test_plot_replaces_its_own_curves_but_not_the_users(tmp_path):
    pytest.importorskip("matplotlib")
    from edgerl.core.errors import ConfigError
    from edgerl.train.metrics import plot
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (tmp_path / "curves.png").write_bytes(b"my picture")
    with pytest.raises(ConfigError, match=r"curves.png is not one edgerl wrote .*: pass --force"):
        plot(tmp_path, log=None)
    assert (tmp_path / "curves.png").read_bytes() == b"my picture"
    (tmp_path / "curves.png").unlink()
    for _ in range(2):   # edgerl's own is listed, and replaced
        assert plot(tmp_path, log=None) == tmp_path / "curves.png"
    assert "curves.png" in owned(Path(tmp_path))
