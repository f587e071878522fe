"""What `edgerl --version` reports: the release (edgerl.core.VERSION, pyproject.toml reads it), the commit
when known, and the torch build with its CUDA version.

The commit comes from git where edgerl runs from a clone (an editable install), else from the file
BUILD_COMMIT that setup.py writes into a wheel built from a clone; a wheel built elsewhere has none.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Optional

PACKAGE = Path(__file__).resolve().parents[1]   # the edgerl package folder
BAKED = "BUILD_COMMIT"


def git_commit(root: Path) -> Optional[str]:
    """The short commit of the clone at `root`, with '+changes' when tracked files differ from it; None
    where `root` is no clone of edgerl or git is missing."""
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def commit() -> Optional[str]:
    found = git_commit(PACKAGE.parent)
    if found:
        return found
    try:
        return (PACKAGE / BAKED).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def describe() -> list[str]:
    """The lines of `edgerl --version`."""
    from edgerl.core import VERSION
    c = commit()
    lines = [f"edgerl {VERSION}" + (f" (commit {c})" if c else " (commit unknown: not built from a clone)")]
    try:
        import torch
    except ImportError:
        lines.append("torch: not installed")
    else:
        cuda = getattr(torch.version, "cuda", None)
        lines.append(f"torch {torch.__version__}, " + (f"CUDA {cuda}" if cuda else "no CUDA (a CPU build)"))
    lines.append(f"Python {platform.python_version()} on {platform.system()} {platform.machine()}")
    return lines
