"""Where edgerl trains: Linux, and on Windows inside WSL2. Native Windows plans (`doctor`, `recommend`,
`profiles`, `config`, `data`) but does not train: a run relies on POSIX facilities Windows lacks (the
run folder's lock through fcntl, interval timers that stop a reward function that overruns, a reward
worker that dies with the trainer) and has never run there, so `train` stops at its start with one
line instead of failing halfway through a run.
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
