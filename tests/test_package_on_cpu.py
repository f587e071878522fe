"""The package around the code: `edgerl --version`, where the version and commit come from, and tests
that need nothing outside the repository. (scripts/check_wheel.sh builds and installs the wheel in CI.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from edgerl.cli.main import app
from edgerl.core import VERSION, version

ROOT = Path(__file__).resolve().parents[1]


def test_version_names_the_release_the_commit_torch_and_cuda():
    import torch
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert re.fullmatch(rf"edgerl {re.escape(VERSION)} \(commit {head}(\+changes)?\)", lines[0]), lines
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
    assert lines[1] == f"torch {torch.__version__}, {cuda}"
    assert lines[2].startswith(f"Python {sys.version_info.major}.{sys.version_info.minor}")


def test_an_installed_wheel_reads_the_commit_baked_into_it(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "edgerl"
    package.mkdir(parents=True)
    monkeypatch.setattr(version, "PACKAGE", package)
    assert version.commit() is None            # no clone above it, nothing baked in
    (package / version.BAKED).write_text("0123456789\n")
    assert version.commit() == "0123456789"
    assert version.describe()[0] == f"edgerl {VERSION} (commit 0123456789)"
    assert version.git_commit(tmp_path) is None   # a folder that is no clone of edgerl


def test_the_release_has_one_home():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = {attr = "edgerl.core.VERSION"}' in text
    assert not re.search(r'^version = "', text, re.M)


def test_no_test_reads_data_from_outside_the_repository():
    """A CPU test's data is in tests/data or comes from the packages setup installs (tests/conftest.py): no
    test file, conftest.py included, names the shared folder beside the clone, which a lone clone lacks."""
    offenders = [p.name for p in (ROOT / "tests").glob("*.py")
                 if re.search(r"(SHARED|[\"']shared[\"']) / [\"']data|/ [\"']shared[\"']", p.read_text())]
    assert not offenders, offenders


def test_every_subpackage_is_in_the_wheel():
    """pyproject.toml lists the packages by name: a new subpackage left out of the list installs nowhere, and only
    an installed wheel would notice. Each listed package is the folder its name spells from the clone's root, the
    layout for which setuptools' editable install is a plain path entry (with folders mapped elsewhere it installs
    an import hook and warns about it)."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"edgerl." + ".".join(p.parent.relative_to(root / "edgerl").parts)
             for p in (root / "edgerl").rglob("__init__.py") if p.parent != root / "edgerl"} | {"edgerl"}
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"listed in pyproject.toml but not a folder under edgerl/: {sorted(listed - found)}"
    assert tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"] == {"": "."}
