"""What a run wrote in its folder: RUN/edgerl-run.jsonl names every top-level file and folder edgerl
created there (config.toml, plan.json, metrics.jsonl, samples.jsonl, loggers.json, checkpoints/, final/,
tensorboard/, wandb/, profile/, curves.png, ...), one JSON line each, `{"wrote": "metrics.jsonl"}`.

    own(run, "metrics.jsonl")     # before the file is created: a crash never leaves one unlisted
    owned(run)                    # the names listed (None: no manifest)

Each name is appended in one write and flushed to disk before the file it names is created, so the list is
never behind the folder; a line cut short by a crash is ignored. Appends need no lock: `edgerl plot` may
list curves.png while the run that holds the folder lists its own files. A manifest deleted while this
process writes there is written again, whole (atomically), at its next entry.

Everything else in the folder is the user's: a new run never writes over it (runfolder.check_new), and
`--restart` moves exactly the listed names aside (runfolder.move_aside).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from edgerl.core.files import write_atomically

MANIFEST = "edgerl-run.jsonl"

# The fixed names a run (or `edgerl plot`) may write at the top of its folder. One a user had there and
# edgerl did not write refuses a new run in that folder (runfolder.check_new). Names edgerl picks to be
# free (metrics.previous.jsonl, final-step-N, earlier-run-N) cannot meet a user's file.
RUN_NAMES = ("config.toml", "plan.json", "metrics.jsonl", "samples.jsonl", "loggers.json", "checkpoints", "final",
             "final-adapter", "tensorboard", "wandb", "profile", "oom.json", "rollout-model")

_seen: dict[str, set[str]] = {}   # run folder -> the names this process listed there


def _line(name: str) -> bytes:
    return (json.dumps({"wrote": name}) + "\n").encode("utf-8")


def _valid(name: object) -> bool:
    """A name of the folder's own level: never a path (a hand-edited manifest must not send --restart
    elsewhere)."""
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name and \
        os.sep not in name and "\0" not in name


def owned(run: Path) -> Optional[set[str]]:
    """The names RUN's manifest lists, or None when it has none (a folder edgerl never wrote a run in,
    or a run written before edgerl kept manifests). Lines that are not entries are ignored."""
    try:
        text = (Path(run) / MANIFEST).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except (NotADirectoryError, IsADirectoryError):
        return None
    names = set()
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        name = entry.get("wrote") if isinstance(entry, dict) else None
        if _valid(name):
            names.add(name)
    return names


def own(run: Path, *names: str) -> None:
    """List `names` (top-level names in `run`) as written by edgerl, before they are created."""
    run = Path(run)
    path = run / MANIFEST
    key = os.path.abspath(run)
    known = _seen.setdefault(key, set())
    listed = owned(run)
    new = [n for n in dict.fromkeys(names) if _valid(n) and n not in (listed or ())]
    if listed is None and known:   # deleted while this process writes here: written again, whole
        write_atomically(path, b"".join(_line(n) for n in sorted(known | set(new))).decode("utf-8"))
    elif new:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"".join(_line(n) for n in new))
            os.fsync(fd)
        finally:
            os.close(fd)
    known.update(listed or (), new)


def forget(run: Path) -> None:
    """This process's memory of `run`'s manifest, after it was moved aside (a restart)."""
    _seen.pop(os.path.abspath(run), None)
