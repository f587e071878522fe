"""metrics.jsonl: a torn last line is dropped with a note, a bad line elsewhere is an error, a resume
moves later rows aside instead of deleting them, rewrites are atomic; plot writes where it says."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgerl.core.errors import USER_ERRORS, ConfigError, RunDirError
from edgerl.train.metrics import MetricsWriter, plot, read_metrics


def lines(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in steps)


def run_with(tmp_path: Path, text: str) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text(text)
    return run


def writer(run: Path, notes: list[str], resume: bool = True) -> MetricsWriter:
    return MetricsWriter(run, tensorboard=False, resume=resume, log=notes.append)


TORN = '{"step": 4, "reward/me'


def test_resume_drops_a_torn_last_line_with_a_note(tmp_path):
    run = run_with(tmp_path, lines(1, 2, 3) + TORN)
    notes: list[str] = []
    w = writer(run, notes)
    assert notes == [f"metrics: ignored line 4 of {run / 'metrics.jsonl'}, cut short when the run stopped "
                     f"('{TORN}'...); dropped it"]
    w.write(4, {"reward/mean": 0.4})
    w.close()
    assert (run / "metrics.jsonl").read_text() == lines(1, 2, 3) + '{"step": 4, "reward/mean": 0.4}\n'


def test_resume_after_a_last_line_without_newline_does_not_glue_rows(tmp_path):
    run = run_with(tmp_path, lines(1, 2).rstrip("\n"))
    w = writer(run, [])
    w.write(3, {"reward/mean": 0.3})
    w.close()
    assert [r["step"] for r in read_metrics(run, log=None)] == [1, 2, 3]


@pytest.mark.parametrize("bad", ["not json", "[1, 2]", '{"reward/mean": 1}', '{"step": "3"}', '{"step": true}'])
def test_a_bad_line_in_the_middle_is_an_error_and_nothing_changes(tmp_path, bad):
    text = lines(1) + bad + "\n" + lines(3)
    run = run_with(tmp_path, text)
    with pytest.raises(RunDirError) as e:
        writer(run, [])
    assert str(e.value).startswith(f"{run / 'metrics.jsonl'}: line 2 is not a metrics row")
    assert "repair or delete line 2, then run again" in str(e.value)
    assert (run / "metrics.jsonl").read_text() == text
    with pytest.raises(RunDirError, match="line 2 is not a metrics row"):
        read_metrics(run)
    assert RunDirError in USER_ERRORS


def test_read_metrics_leaves_out_a_torn_last_line_and_says_so(tmp_path):
    run = run_with(tmp_path, lines(1, 2) + TORN)
    notes: list[str] = []
    assert [r["step"] for r in read_metrics(run, log=notes.append)] == [1, 2]
    assert len(notes) == 1 and "ignored line 3" in notes[0]
    with pytest.raises(RunDirError, match="is not an edgerl run folder"):
        read_metrics(tmp_path / "elsewhere")


def test_archive_after_moves_later_rows_aside(tmp_path):
    run = run_with(tmp_path, lines(1, 2, 3, 4, 5))
    notes: list[str] = []
    w = writer(run, notes)
    side = w.archive_after(2)
    assert side == run / "metrics.after-step-2.jsonl"
    assert side.read_text() == lines(3, 4, 5)
    assert notes == [f"metrics: moved 3 row(s) of steps 3-5, after the checkpoint of step 2, to {side}"]
    w.write(3, {"reward/mean": 9.0})
    w.close()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    # a second branch from the same step keeps the first one's rows
    w = writer(run, [])
    second = w.archive_after(2)
    w.close()
    assert second == run / "metrics.after-step-2-2.jsonl"
    assert second.read_text() == '{"step": 3, "reward/mean": 9.0}\n' and side.read_text() == lines(3, 4, 5)
    w = writer(run, [])
    assert w.archive_after(2) is None
    w.close()
    assert sorted(p.name for p in run.iterdir()) == ["edgerl-run.jsonl", "metrics.after-step-2-2.jsonl",
                                                     "metrics.after-step-2.jsonl", "metrics.jsonl"]


def test_a_crash_while_archiving_loses_nothing(tmp_path, monkeypatch):
    """The side file is complete before the log is shortened; a failure in between leaves the rows
    in both files, and the log as it was."""
    run = run_with(tmp_path, lines(1, 2, 3, 4))
    w = writer(run, [])
    real_replace, calls = os.replace, []

    def fails_second_time(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", fails_second_time)
    with pytest.raises(ConfigError, match="cannot write .*metrics.jsonl: Input/output error; the file there is "
                                          "unchanged"):
        w.archive_after(2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert (run / "metrics.jsonl").read_text() == lines(1, 2, 3, 4)
    assert (run / "metrics.after-step-2.jsonl").read_text() == lines(3, 4)
    assert sorted(p.name for p in run.iterdir()) == ["edgerl-run.jsonl", "metrics.after-step-2.jsonl", "metrics.jsonl"]
    w.write(5, {})  # the writer still appends to the log
    w.close()
    assert read_metrics(run)[-1] == {"step": 5}


def test_a_fresh_run_keeps_the_earlier_runs_rows(tmp_path):
    run = run_with(tmp_path, lines(1, 2))
    notes: list[str] = []
    w = writer(run, notes, resume=False)
    w.write(1, {"reward/mean": 0.0})
    w.close()
    assert (run / "metrics.previous.jsonl").read_text() == lines(1, 2)
    assert notes == [f"metrics: {run / 'metrics.jsonl'} held the steps of an earlier run; moved them to "
                     f"{run / 'metrics.previous.jsonl'}"]
    assert read_metrics(run) == [{"step": 1, "reward/mean": 0.0}]


# --- plot ------------------------------------------------------------------------------------------------

def test_plot_returns_the_path_it_wrote(tmp_path, monkeypatch):
    run = run_with(tmp_path, lines(1, 2, 3) + TORN)
    monkeypatch.chdir(tmp_path)
    assert plot(run, Path("mycurves"), log=None) == Path("mycurves.png")
    assert (tmp_path / "mycurves.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "mycurves").exists()
    assert plot(run, log=None) == run / "curves.png" and (run / "curves.png").is_file()
    (tmp_path / "pics").mkdir()
    assert plot(run, tmp_path / "pics", log=None) == tmp_path / "pics" / "curves.png"
    assert plot(run, tmp_path / "c.pdf", log=None).read_bytes()[:4] == b"%PDF"
    assert not [p for p in tmp_path.rglob(".*tmp*")]  # no temporary file left behind


def test_plot_bad_paths(tmp_path):
    run = run_with(tmp_path, lines(1, 2))
    with pytest.raises(ConfigError, match=r"--out .*nowhere/c.png: the folder .*nowhere does not exist; create "
                                          r"it \(mkdir -p"):
        plot(run, tmp_path / "nowhere" / "c.png", log=None)
    with pytest.raises(ConfigError, match=r"a '.txt' file cannot be written here; name it c.png \(.png or .pdf "
                                          r"or .svg\)"):
        plot(run, tmp_path / "c.txt", log=None)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        plot(run, tmp_path / "afile" / "c.png", log=None)
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(RunDirError, match="has no steps yet"):
        plot(run_with(tmp_path, ""), log=None)


def test_plot_command_prints_the_real_path(tmp_path, monkeypatch):
    from edgerl.cli.main import app
    run = run_with(tmp_path, lines(1, 2))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["plot", str(run), "--out", "mycurves"])
    assert r.exit_code == 0 and "wrote mycurves.png" in r.output, r.output
    r = CliRunner().invoke(app, ["plot", str(run), "--out", str(tmp_path / "nowhere" / "c.png")])
    assert r.exit_code == 2 and "does not exist; create it" in r.output.replace("\n", "")
