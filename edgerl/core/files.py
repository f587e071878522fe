"""Files edgerl writes for the user (prepared data, plots, run configs, plans, metrics logs): never
seen half-written, never written over something the user had unless asked. Every file a user relies
on goes through `write_atomically`, the one atomic writer (checkpoint and export folders have their
own atomic rename in train/checkpoint.py).

    path = output_file(out, (".parquet",), option="--out", overwrite=force)   # checks, no I/O
    write_atomically(path, lambda tmp: pq.write_table(table, tmp))
    write_atomically(run_dir / "plan.json", text)                          # text: written as UTF-8

Both raise ConfigError: the path is something the user chose, and the message says what to do.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Optional, Union

from edgerl.core.errors import ConfigError


def output_file(out: Union[str, Path], suffixes: tuple[str, ...], *, option: str = "--out",
                default_name: Optional[str] = None, overwrite: bool = True) -> Path:
    """The file to write for `out`, or ConfigError saying why it cannot be.

    An existing folder means `default_name` inside it (an error without one). A name without a
    suffix gets `suffixes[0]` appended: the caller prints the returned path, so the user sees the
    name really written. Another suffix than those in `suffixes` is an error (the file would hold
    something other than its name says). The folder must exist: a typo in it is more likely than
    a wish for a new folder. An existing file is replaced only when `overwrite` is set.
    """
    p = Path(out).expanduser()
    regular_input(p, option)   # /dev/full, a FIFO: not a file to write a report into (nor beside, as full.json)
    if p.is_dir():
        if default_name is None:
            raise ConfigError(f"{option} {out} is a folder; give a file path such as "
                              f"{p / ('data' + suffixes[0])}")
        p = p / default_name
    if not p.suffix:
        p = p.with_name(p.name + suffixes[0])
    elif p.suffix.lower() not in suffixes:
        raise ConfigError(f"{option} {out}: a '{p.suffix}' file cannot be written here; name it "
                          f"{p.with_suffix(suffixes[0]).name} ({' or '.join(suffixes)})")
    folder = p.parent
    if not folder.is_dir():
        if folder.exists():
            raise ConfigError(f"{option} {out}: {folder} is a file, not a folder; choose another {option}")
        raise ConfigError(f"{option} {out}: the folder {folder} does not exist; create it (mkdir -p {folder}) "
                          f"or choose another {option}")
    if p.is_dir():
        raise ConfigError(f"{option} {out}: {p} is a folder; give a file path")
    if p.exists() and not overwrite:
        raise ConfigError(f"{option} {out}: {p} exists; pass --force to replace it, or choose another {option}")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{option} {out}: cannot write in {folder} (permission denied); choose another {option}")
    return p


def write_atomically(path: Union[str, Path], write: Union[str, Callable[[Path], None]]) -> None:
    """Call `write(tmp)` on a new file beside `path` (or write the text `write` to it, UTF-8), flush it
    to disk, then rename it onto `path`. The file gets the permissions any new file gets (the umask).

    A crash leaves either the old file or the new one under `path`, never a part of either (the
    rename is atomic within one folder, hence the temporary file beside it, not in /tmp). The
    temporary name ends with `path`'s suffix, for writers that pick the format from the name. An
    OSError (a full disk, a read-only folder) becomes a ConfigError saying nothing was changed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        if isinstance(write, str):
            tmp.write_text(write, encoding="utf-8")
        else:
            write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            kept = "the file there is unchanged" if path.exists() else "nothing was written"
            raise ConfigError(f"cannot write {path}: {e.strerror or e}; {kept}") from e
        raise
    try:  # the rename itself reaches the disk with the folder's entry
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)


def finite(obj: Any) -> tuple[Any, int]:
    """`obj` (dicts, lists and tuples of plain values) with every float that is NaN or infinite replaced
    by None, and how many were: JSON has no NaN nor infinity, and Python's json would write them as
    literals no other reader takes."""
    if isinstance(obj, float):
        return (obj, 0) if math.isfinite(obj) else (None, 1)
    if isinstance(obj, dict):
        items = [(k, finite(v)) for k, v in obj.items()]
        return {k: v for k, (v, _) in items}, sum(n for _, (_, n) in items)
    if isinstance(obj, (list, tuple)):
        items = [finite(v) for v in obj]
        return [v for v, _ in items], sum(n for _, n in items)
    return obj, 0


def json_text(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `obj` as valid JSON: a NaN or infinite float is written as null (`finite`); a
    caller that must say how many were uses `finite` first."""
    return json.dumps(finite(obj)[0], allow_nan=False, **kwargs)


_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp(\.[^.]*)?$")


def remove_folder(folder: Path) -> None:
    """Delete a folder by first renaming it to a temporary name: a kill during the deletion leaves a
    temporary folder (removed by the next run) and never half a folder."""
    doomed = folder.with_name(f".{folder.name}-old-{secrets.token_hex(4)}")
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def temporaries(folder: Path) -> list[Path]:
    """The temporary files `write_atomically` left in `folder` when it was killed mid-write."""
    return sorted(p for p in Path(folder).glob(".*") if _TEMPORARY.match(p.name))
NAME_MAX, PATH_MAX = 255, 4096   # bytes in one file name and in a whole path (Linux, every common file system)


def shown(text: str) -> str:
    """`text` as it can be printed: bytes that were not UTF-8 (lone surrogates, as Python decodes
    such file names) shown as escapes instead of failing the print."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(text: str) -> str:
    return shown(text if len(text) <= 60 else text[:40] + "..." + text[-12:])


def check_path(path: Union[str, Path], what: str) -> None:
    """ConfigError, in one line naming `what` (the option or key), for a path no file can have or that
    cannot be followed: a name over NAME_MAX bytes or a path over PATH_MAX, bytes that are not UTF-8
    (they cannot be shown in a message or a config file), or a loop of symbolic links. Anything else
    (a missing file, say) is for the caller, which knows whether it must exist."""
    text = str(path)
    if any("\ud800" <= c <= "\udfff" for c in text):   # how Python decodes bytes that are not UTF-8
        raise ConfigError(f"{what} {shown(text)}: the path holds bytes that are not UTF-8 text (shown as \\udc.. "
                          "escapes); rename the file or folder with UTF-8 characters")
    raw = os.fsencode(text)
    if len(raw) > PATH_MAX:
        raise ConfigError(f"{what} {_short(text)}: the path is {len(raw)} bytes long, and paths have at most "
                          f"{PATH_MAX}; choose a shorter one")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise ConfigError(f"{what} {_short(text)}: the name {_short(part)} is {len(os.fsencode(part))} bytes "
                              f"long, and a file or folder name has at most {NAME_MAX}; choose a shorter one")
    try:
        os.stat(Path(text).expanduser())
    except RuntimeError:   # ~name of no user on this machine (pathlib cannot expand it)
        user = Path(text).parts[0]
        raise ConfigError(f"{what} {shown(text)}: there is no user {user[1:]!r} on this machine, so {user} cannot be "
                          "expanded; give the full path (or ./" + shown(text) + " for a folder named so)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{what} {shown(text)}: a loop of symbolic links (a link that leads back to itself); "
                              "fix or remove the link") from None
    except ValueError:   # an embedded NUL byte
        raise ConfigError(f"{what} {shown(text)!r}: a path cannot hold a NUL character") from None


def regular_input(path: Path, what: str, error: type = ConfigError) -> None:
    """`error` for an input file that is not a plain file (nor a folder): a FIFO, a device (/dev/zero)
    or a socket blocks or never ends when read, and its size (0) says nothing about its content."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return   # the reader reports it, with its own words
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise error(f"{what} {shown(str(path))} is {kind}, not a regular file; give a file saved on disk")


def cache_root() -> Path:
    """Where edgerl keeps what it converts or measures once per machine (EDGERL_CACHE overrides)."""
    return Path(os.environ.get("EDGERL_CACHE", Path.home() / ".cache" / "edgerl"))


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a complete converted HF model (its config and safetensors weights)."""
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def converted_folder(name: str) -> Optional[Path]:
    """The HF folder a model named `name` was converted into in the cache (the embedded model,
    edgerl/models/embedded.py), if the conversion is complete there; never converts."""
    target = cache_root() / name.strip().lower()
    return target if is_converted(target) else None
