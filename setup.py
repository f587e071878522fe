"""The build's one addition to pyproject.toml: a wheel built from a clone records its commit in
edgerl/BUILD_COMMIT, so that `edgerl --version` names it after installation (edgerl/core/version.py)."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithCommit(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):   # an editable install asks git at run time
            return
        sys.path.insert(0, str(ROOT / "edgerl" / "core"))
        try:
            from version import git_commit   # the same rule as at run time, without importing edgerl
        finally:
            sys.path.pop(0)
        found = git_commit(ROOT)
        if found:
            target = Path(self.build_lib) / "edgerl" / "BUILD_COMMIT"
            target.write_text(found + "\n", encoding="utf-8")


setup(cmdclass={"build_py": BuildWithCommit})
