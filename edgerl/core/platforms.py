"""Where edgerl trains: Linux, and on Windows inside WSL2. Native Windows plans (`doctor`, `recommend`,
`profiles`, `config`, `data`) but does not train: a run relies on POSIX facilities Windows lacks
(interval timers, SIGALRM, that stop a reward function or a tool that overruns; a reward worker that
dies with the trainer) and has never run there, so `train` stops at its start with one line instead of
failing, or running without those limits, halfway through a run. (The run folder's lock is portable:
edgerl/train/lock.py.)
"""

from __future__ import annotations

import sys

from edgerl.core.errors import PlatformError


def native_windows() -> bool:
    return sys.platform == "win32"


def check_can_train(what: str = "training") -> None:
    """Raise PlatformError on native Windows, naming WSL2; nothing elsewhere."""
    if native_windows():
        raise PlatformError(f"{what} needs Linux; on Windows, run edgerl inside WSL2 (`wsl --install` in an "
                            "administrator PowerShell, then install edgerl and torch in the Linux shell; WSL2 "
                            "reaches the NVIDIA GPU through the Windows driver). doctor and recommend also work "
                            "natively")
