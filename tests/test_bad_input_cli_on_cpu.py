"""Bad input through the CLI (typer's CliRunner): one line, exit status 2, no traceback, and nothing
the user had is changed. Run folders have their own file (test_run_folder_on_cpu.py)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

import edgerl.config.target
from edgerl.cli.main import app
from fakes import fake_probe

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None))


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(r, *texts: str) -> str:
    """The error line of a refused command, after checking the exit status and that it is alone."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for text in texts:
        assert text in lines[0], lines[0]
    return lines[0]


def test_a_section_given_a_value_renders_its_brackets():
    """The message holds `[train]`: printed through rich, it must not be taken for markup."""
    one_line_error(run("recommend", "--set", "train=5"),
                   "--set train=5: 'train' is a section ([train] in a config file), not a value")


def test_a_bad_option_value_is_named_as_typed():
    one_line_error(run("recommend", "--gpu", "cpu", "--samples", "1"), "(rollout.n_samples from --samples 1)")
    one_line_error(run("recommend", "--gpu", "cpu", "--set", "train.lr=-1"), "train.lr must be > 0",
                   "(train.lr from --set train.lr=-1)")


def test_config_files_that_cannot_be_read(tmp_path):
    one_line_error(run("recommend", "--config", tmp_path), f"config file {tmp_path} is a folder")
    f = tmp_path / "cfg.toml"
    f.write_bytes(b"[train]\n# \xff\n")
    one_line_error(run("config", "--config", f), f"config file {f}, line 2, column 3: byte 0xff is not UTF-8")


@pytest.mark.parametrize("spec,text", [
    ("cc=6.1,memory=100MiB", "memory=100MiB is below 1 GiB"),
    ("cc=9.9,memory=24GiB", "compute capability 9.9 is not in edgerl's table"),
    ("cc=9.9", "needs at least cc and memory"),
])
def test_gpu_specs_edgerl_refuses(spec, text):
    one_line_error(run("recommend", "--gpu-spec", spec), text)


def test_recommend_out_is_written_atomically_and_never_over_a_file(tmp_path):
    existing = tmp_path / "run.toml"
    existing.write_text("# mine\n")
    one_line_error(run("recommend", "--gpu", "cpu", "--format", "toml", "--out", existing),
                   f"--out {existing}: {existing} exists; pass --force to replace it")
    assert existing.read_text() == "# mine\n"
    r = run("recommend", "--gpu", "cpu", "--format", "toml", "--out", existing, "--force")
    assert r.exit_code == 0, r.output
    assert existing.read_text().startswith("# edgerl run config") and f"wrote {existing}" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]   # no temporary file left


def test_recommend_out_a_folder_gets_a_named_file(tmp_path):
    r = run("recommend", "--gpu", "cpu", "--format", "json", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    assert f"wrote {tmp_path / 'plan.json'}" in r.output
    assert "plan" in json.loads((tmp_path / "plan.json").read_text())


def test_recommend_out_in_a_missing_folder_or_as_text(tmp_path):
    one_line_error(run("recommend", "--gpu", "cpu", "--format", "toml", "--out", tmp_path / "no" / "run.toml"),
                   f"the folder {tmp_path / 'no'} does not exist")
    assert not (tmp_path / "no").exists()
    one_line_error(run("recommend", "--gpu", "cpu", "--out", tmp_path / "plan.txt"),
                   "--out writes --format toml, json or verl")
    one_line_error(run("recommend", "--gpu", "cpu", "--format", "toml", "--out", tmp_path / "run.json"),
                   "a '.json' file cannot be written here; name it run.toml")
    assert list(tmp_path.iterdir()) == []


def test_plot_prints_the_path_it_wrote(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": i / 10}) + "\n"
                                                   for i in (1, 2, 3)))
    r = run("plot", run_dir, "--out", tmp_path / "curves")   # no suffix: .png is added
    assert r.exit_code == 0, r.output
    assert re.search(rf"wrote {re.escape(str(tmp_path / 'curves.png'))}$", r.output.strip())
    assert (tmp_path / "curves.png").stat().st_size > 0
    one_line_error(run("plot", tmp_path / "none"), "metrics.jsonl does not exist")


def test_plot_of_several_runs_draws_each_beside_the_others(tmp_path):
    """Two run folders: one figure (the first folder's compare.png), one line per run labelled with its folder,
    held-out accuracy against steps and against the training seconds summed; a missing folder is one line."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for name, secs in (("edgerl-run", 1.0), ("trl-run", 3.0)):
        (tmp_path / name).mkdir()
        rows = [{"step": 0, "eval/accuracy": 0.5}] + [{"step": i, "perf/step_s": secs, "reward/mean": i / 10,
                                                        **({"eval/accuracy": 0.5 + i / 10} if i == 2 else {})}
                                                       for i in (1, 2)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    real = plt.subplots
    plt.subplots = lambda *a, **k: figures.append(real(*a, **k)) or figures[-1]
    try:
        r = run("plot", tmp_path / "edgerl-run", tmp_path / "trl-run")
    finally:
        plt.subplots = real
    assert r.exit_code == 0, r.output
    assert r.output.strip().endswith(str(tmp_path / "edgerl-run" / "compare.png"))
    panels = {ax.get_title(): ax for ax in figures[0][1].flat}
    by_seconds = panels["held-out vs training seconds"]
    assert [ln.get_label() for ln in by_seconds.get_lines()] == ["edgerl-run", "trl-run"]
    assert [list(ln.get_xdata()) for ln in by_seconds.get_lines()] == [[0.0, 2.0], [0.0, 6.0]]
    assert [ln.get_label() for ln in panels["reward (mean)"].get_lines()] == ["edgerl-run", "trl-run"]
    one_line_error(run("plot", tmp_path / "edgerl-run", tmp_path / "none"), "metrics.jsonl does not exist")


def test_cpu_plan_keeps_state_in_memory_not_on_a_gpu():
    r = run("recommend", "--gpu", "cpu", "--format", "json")
    reasons = json.loads(r.stdout)["reasons"]
    for key in ("swap_models", "optimizer_offload", "param_offload"):
        assert "GPU" not in reasons[key] and "in memory" in reasons[key], reasons[key]
    gpu = json.loads(run("recommend", "--gpu", "t4", "--format", "json").stdout)["reasons"]
    assert (gpu["swap_models"], gpu["optimizer_offload"], gpu["param_offload"]) == (
        "the reference model stays on the GPU", "optimizer state stays on the GPU", "weights stay on the GPU")
    assert [reasons[k] for k in ("swap_models", "optimizer_offload", "param_offload")] == [
        "the reference model stays in memory", "optimizer state stays in memory", "weights stay in memory"]
