"""Confine the process a tool runs in: writes only beneath its scratch folder, a memory limit, a file-size
limit. Runs inside the worker (host.py) and in the child interpreter of the `python` tool.

Two fences, each applied where it can be:
- Landlock (Linux 5.13 and later, where the kernel enables it): the kernel refuses every write, file
  creation, removal and rename outside the scratch folder, for this process and every process it starts,
  whatever the code (Python, a C extension, a shell command). It cannot be lifted once applied.
- Python's audit hooks (PEP 578): `open` for writing and the `os` calls that create, remove, rename or
  change files are refused outside the folder, in this interpreter only. Code that reaches the system
  without Python's audited calls (a C extension, ctypes) or a child process is not stopped by this fence.

`confine` applies both and returns a phrase naming those in force, which the run log shows.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# files a tool may write outside its folder: the null device (subprocess's DEVNULL opens it for writing)
ALSO_WRITABLE = ("/dev/null",)

# Landlock (linux/landlock.h): the three syscalls have the same numbers on every architecture (asm-generic)
_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR, _MAKE_REG = 1 << 1, 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
_MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM, _REFER, _TRUNCATE = 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14
_PR_SET_NO_NEW_PRIVS = 38


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(folder: str) -> str:
    """Refuse writes outside `folder` through the kernel. Returns '' when in force, else why not."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:
        return f"libc not loadable ({e})"
    sc = libc.syscall
    sc.restype = ctypes.c_long
    abi = sc(ctypes.c_long(_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(1))   # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return "the kernel has no Landlock (Linux 5.13 or later with Landlock enabled)"
    dirs = (_WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG | _MAKE_SOCK | _MAKE_FIFO
            | _MAKE_BLOCK | _MAKE_SYM | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0))
    files = _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(dirs)
    ruleset = sc(ctypes.c_long(_CREATE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"landlock_create_ruleset failed ({os.strerror(ctypes.get_errno())})"
    try:
        for path, access in [(folder, dirs)] + [(f, files) for f in ALSO_WRITABLE if os.path.exists(f)]:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(access, fd)
                if sc(ctypes.c_long(_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule),
                      ctypes.c_uint32(0)) < 0:
                    return f"landlock_add_rule failed on {path} ({os.strerror(ctypes.get_errno())})"
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_NO_NEW_PRIVS) failed ({os.strerror(ctypes.get_errno())})"
        if sc(ctypes.c_long(_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            return f"landlock_restrict_self failed ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    return ""


def audit_writes(folder: str) -> None:
    """Refuse, in this interpreter, writes outside `folder` made through Python's audited calls."""
    root = os.path.realpath(folder)

    def inside(path) -> bool:
        if isinstance(path, int):   # an open descriptor: what opened it was checked
            return True
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == root or real.startswith(root + os.sep) or real in ALSO_WRITABLE

    def refuse(event: str, path) -> None:
        raise PermissionError(f"a tool may write only beneath its folder {root}; refused: {event} {path!r}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & WRITE_FLAGS)
            if writes and not inside(path):
                refuse("open for writing", path)
        elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.utime",
                       "os.chflags", "os.setxattr", "os.removexattr", "shutil.rmtree", "os.mkfifo", "os.mknod"):
            if args and not inside(args[0]):
                refuse(event, args[0])
        elif event in ("os.rename", "os.link"):
            for p in args[:2]:
                if not inside(p):
                    refuse(event, p)
        elif event == "os.symlink":
            if not inside(args[1]):
                refuse(event, args[1])

    sys.addaudithook(hook)


def limit_memory(megabytes: int) -> None:
    """The process's data (heap and private mappings) may grow by at most `megabytes` from now (RLIMIT_DATA,
    kept by the processes it starts): an allocation past it fails (MemoryError) instead of taking the
    machine's memory. Unlike the address-space limit it does not count shared libraries mapped by an import."""
    import resource
    now = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    now = int(line.split()[1]) * 1024
    except OSError:
        pass
    cap = now + megabytes * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))


def limit_file_size(megabytes: int) -> None:
    """A file may grow to `megabytes` at most (RLIMIT_FSIZE): a larger write fails with EFBIG (SIGXFSZ is
    ignored, so the process is not killed for it)."""
    import resource
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    cap = megabytes * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))


def confine(folder: str, memory_mb: int, file_mb: int) -> str:
    """Apply every fence to this process; returns what is in force, in words."""
    limit_file_size(file_mb)
    why_not = landlock(folder)
    audit_writes(folder)
    limit_memory(memory_mb)
    fences = "the kernel (Landlock) and Python's audit hooks" if not why_not else \
        f"Python's audit hooks only (Landlock: {why_not}; a C extension or a child process can still write elsewhere)"
    return f"writes only beneath {folder}, enforced by {fences}; memory +{memory_mb} MiB, files up to {file_mb} MiB"
