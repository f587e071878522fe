"""The run folder's lock: one process trains in a folder at a time, for as long as it runs.

It is an OS lock held on open descriptors, released by the OS when the process ends (a kill -9 leaves no
stale lock). On POSIX: flock on RUN/.edgerl.lock and on the folder itself, so that deleting the lock file
(a reward, a cleanup script) cannot let a second process in: the folder's own lock stays. On a file
system that cannot lock a folder (NFS), the lock file's alone, and the holder writes it again if it goes
(`keep`). On Windows: msvcrt.locking on the lock file, which cannot be deleted while it is open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from edgerl.core.errors import RunDirError

try:
    import fcntl
except ImportError:   # Windows
    fcntl = None   # type: ignore[assignment]
try:
    import msvcrt
except ImportError:   # POSIX
    msvcrt = None   # type: ignore[assignment]

LOCK = ".edgerl.lock"
_WINDOWS_OFFSET = 1 << 20   # msvcrt locks a byte range: one past the pid, which stays readable


def _lock_file(fh) -> bool:
    """Take the exclusive lock on the open file `fh` without waiting; False when another process holds it."""
    try:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fh.seek(_WINDOWS_OFFSET)
            msvcrt.locking(fh.fileno(), msvcrt.LK_NBLCK, 1)
        return True
    except OSError:
        return False


def _unlock_file(fh) -> None:
    if fcntl is not None:
        fcntl.flock(fh, fcntl.LOCK_UN)
    else:
        fh.seek(_WINDOWS_OFFSET)
        msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)


def _lock_folder(run_dir: Path) -> Optional[int]:
    """The folder's descriptor, locked; None where folders cannot be locked (Windows, NFS). RunDirError
    when another process holds it."""
    if fcntl is None:
        return None
    try:
        fd = os.open(run_dir, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        try:
            with open(run_dir / LOCK) as fh:
                pid: Optional[str] = _pid(fh)
        except OSError:
            pid = None   # its lock file was deleted; the folder's lock stays
        raise _busy(run_dir, pid) from None
    except OSError:   # no flock on folders here (NFS emulates it with write locks): the lock file's alone
        os.close(fd)
        return None


def _busy(run_dir: Path, pid: Optional[str]) -> RunDirError:
    who = f"(pid {pid})" if pid is not None else f"(its {LOCK} was deleted, but it holds the folder's lock)"
    return RunDirError(f"another edgerl process {who} is training in {run_dir}; wait for it to finish or stop it, "
                       "or choose another --out")


def _pid(fh) -> str:
    try:
        fh.seek(0)
        return fh.read(32).strip() or "?"
    except OSError:
        return "?"


class RunLock:
    """An exclusive lock on a run folder for the life of a training process. Taking it writes
    nothing; `claim` writes this process's id into the lock file once the run may go ahead."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.folder_fd = _lock_folder(self.run_dir)
        try:
            self.fh = open(self.path, "a+")
        except BaseException:
            self._close_folder()
            raise
        if not _lock_file(self.fh):
            pid = _pid(self.fh)
            self.fh.close()
            self._close_folder()
            raise _busy(self.run_dir, pid)

    @property
    def held(self) -> bool:
        return not self.fh.closed

    def claim(self) -> None:
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()

    def keep(self) -> Optional[str]:
        """The lock file is still this process's: if it was deleted or replaced, write it again and lock
        it. Returns a line saying so, or None. Where folders cannot be locked and another process took the
        new file meanwhile, RunDirError."""
        try:
            same = os.path.samestat(os.stat(self.path), os.fstat(self.fh.fileno()))
        except OSError:
            same = False
        if same:
            return None
        fh = open(self.path, "a+")
        if not _lock_file(fh):
            fh.close()
            raise RunDirError(f"{self.path} was deleted during the run and another process locked {self.run_dir} "
                              "since: two runs must not write one folder; this one stops here")
        old, self.fh = self.fh, fh
        _unlock_file(old)
        old.close()
        self.claim()
        return f"{self.path} was deleted during the run; written again (the folder stayed locked)"

    def _close_folder(self) -> None:
        if self.folder_fd is not None:
            os.close(self.folder_fd)   # closing the descriptor releases its lock
            self.folder_fd = None

    def release(self) -> None:
        if not self.fh.closed:
            _unlock_file(self.fh)
            self.fh.close()
        self._close_folder()
