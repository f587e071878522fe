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

import os
import re
import secrets
from pathlib import Path
from typing import Callable, Optional, Union

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


_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp(\.[^.]*)?$")


def temporaries(folder: Path) -> list[Path]:
    """The temporary files `write_atomically` left in `folder` when it was killed mid-write."""
    return sorted(p for p in Path(folder).glob(".*") if _TEMPORARY.match(p.name))


def cache_root() -> Path:
    """Where edgerl keeps what it converts or measures once per machine (EDGERL_CACHE overrides)."""
    return Path(os.environ.get("EDGERL_CACHE", Path.home() / ".cache" / "edgerl"))
