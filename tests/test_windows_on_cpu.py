"""Native Windows, simulated where edgerl's code meets the platform: planning works without the POSIX-only
modules (fcntl, resource) and timers (SIGALRM, setitimer); training stops at its start with one line that
points to WSL2 (edgerl.core.platforms)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from edgerl.cli.main import app

# what Windows' Python lacks, taken away before edgerl is imported
WITHOUT_POSIX = """
import signal, sys
sys.modules["fcntl"] = None
sys.modules["resource"] = None
for name in ("SIGALRM", "setitimer", "ITIMER_REAL", "alarm"):
    if hasattr(signal, name):
        delattr(signal, name)
from edgerl.cli.main import main
sys.argv = ["edgerl"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("args", [["recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b"], ["doctor", "--gpu", "t4"]])
def test_planning_needs_no_posix_only_module(args):
    out = subprocess.run([sys.executable, "-c", WITHOUT_POSIX, *args], capture_output=True, text=True, timeout=300,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode in (0, 1), out.stderr[-3000:]   # doctor: 1 when a check fails (no GPU here)


def windows(monkeypatch):
    """sys.platform as Windows' Python has it, where edgerl branches on it (setting it for the whole process
    would send the standard library's sysconfig looking for Windows' files)."""
    from types import SimpleNamespace

    from edgerl.core import platforms
    monkeypatch.setattr(platforms, "sys", SimpleNamespace(platform="win32"))


def test_training_on_native_windows_stops_at_once_pointing_to_wsl2(tmp_path, monkeypatch):
    windows(monkeypatch)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["train", "--steps", "1", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    line = " ".join(r.output.split())
    assert "edgerl train needs Linux; on Windows, run edgerl inside WSL2" in line and "wsl --install" in line
    assert not (tmp_path / "run").exists() and not list(tmp_path.iterdir())   # nothing written


def test_the_python_entry_stops_the_same_way(monkeypatch):
    import edgerl
    from edgerl.core.errors import PlatformError
    windows(monkeypatch)
    with pytest.raises(PlatformError, match="needs Linux; on Windows, run edgerl inside WSL2"):
        edgerl.prepare(None)
    monkeypatch.undo()
    from edgerl.core.platforms import check_can_train
    check_can_train()   # on Linux: nothing
