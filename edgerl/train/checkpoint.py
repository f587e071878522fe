"""Checkpoints and export folders written atomically (a temporary folder, then one rename), the last K
kept. Single files go through `edgerl.core.files.write_atomically`.

A checkpoint folder `step-000012/` holds: the actor (and critic) weights as safetensors, the
optimizer and scheduler states, every RNG state, the data position, the KL controller, the
config and the plan. A half-written checkpoint is never visible under its final name, so a run
killed while saving resumes from the previous one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from edgerl.core.errors import CheckpointError
from edgerl.core.files import json_text, remove_folder, temporaries
from edgerl.train.manifest import own

_STEP = re.compile(r"^step-(\d{6,})$")

# mkdtemp makes private folders (0700); what edgerl writes for the user gets the permissions any
# folder they make would get (the umask), read once while single-threaded.
_UMASK = os.umask(0)
os.umask(_UMASK)


def _public(path: Path) -> None:
    os.chmod(path, 0o777 & ~_UMASK)


def rng_state(generator: Optional[torch.Generator] = None) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: Optional[torch.Generator] = None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    if not root.is_dir():
        raise CheckpointError(f"{root} is a file, but a run keeps its checkpoints in a folder of that name; move "
                              f"the file away (mv {root} {root}.file), or choose another run folder")
    found = [p for p in root.iterdir() if p.is_dir() and _STEP.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP.match(p.name).group(1)))


def is_step_folder(path: Path) -> bool:
    return bool(_STEP.match(Path(path).name))


def latest(run_dir: Path) -> Optional[Path]:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_folder(target: Path, aside: Optional[Path] = None) -> Iterator[Path]:
    """Yield a temporary folder beside `target`; on success it becomes `target` in one rename. An
    existing `target` is first moved to `aside` (kept, never deleted); without `aside` it is an error.
    On failure the temporary folder is removed and `target` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-tmp-", dir=target.parent))
    try:
        _public(tmp)
        try:
            yield tmp
        except Exception as e:
            if _write_failure(e):  # safetensors and torch.save do not raise OSError for a full disk
                raise OSError(errno.EIO, f"writing {target.name} failed ({_last_line(e)}){_free_note(tmp)}") from e
            raise
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if target.exists():
            if aside is None:
                raise CheckpointError(f"{target} already exists")
            os.replace(target, aside)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def stale_temporaries(run_dir: Path) -> list[Path]:
    """Temporary folders and files left by writes that were killed (checkpoints, exports, configs).
    Only meaningful while holding the run folder's lock: then no write is in progress."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.glob(".*-tmp-*")] + [p for p in (run_dir / "checkpoints").glob(".step-*")]
    found += temporaries(run_dir)   # config.toml, plan.json, metrics.jsonl (core.files.write_atomically)
    return sorted(found)


def save(run_dir: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
         meta: dict[str, Any], keep_last: int, files: Optional[dict[str, bytes]] = None,
         keep_best: bool = False) -> Path:
    """Write checkpoint `step`: `tensors` name -> state dict (safetensors), `state` name -> object
    (torch.save), `files` name -> bytes written as is, and meta.json: `meta` plus the size and sha256
    of every other file (`damage` checks them before a resume). Returns the folder. A failed write (a
    full disk) is an OSError naming the file, with the earlier checkpoints untouched. Once it is in
    place, the checkpoints edgerl.train.retention lets go (beyond `keep_last`, `keep_best`) are removed."""
    from safetensors.torch import save_file
    root = Path(run_dir) / "checkpoints"
    own(run_dir, root.name)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step:06d}-", dir=root))
    try:
        _public(tmp)
        for name, sd in tensors.items():
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
            _writing(tmp / f"{name}.safetensors", lambda path: save_file(_untie(cpu), str(path)))
        for name, obj in state.items():
            _writing(tmp / f"{name}.pt", lambda path: torch.save(obj, path))
        for name, data in (files or {}).items():
            _writing(tmp / name, lambda path: path.write_bytes(data))
        sums = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in sorted(tmp.iterdir())}
        text = json_text({**meta, "files": sums}, indent=2, default=str)
        _writing(tmp / "meta.json", lambda path: path.write_text(text))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        aside = None
        if final.exists():  # the same step saved again: the old copy stays whole until the new one is in
            aside = final.with_name(f".{final.name}-old-{secrets.token_hex(4)}")
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    from edgerl.train.retention import doomed
    for old in doomed(checkpoints(run_dir), keep_last, keep_best):
        remove_folder(old)
    return final


def _writing(path: Path, write: Any) -> None:
    """`write(path)`, its failure an OSError naming the file: torch.save raises RuntimeError and
    safetensors SafetensorError (not OSError) when the disk fills up under them."""
    from safetensors import SafetensorError
    try:
        write(path)
    except OSError as e:
        raise OSError(e.errno, f"writing {path.name}: {e.strerror or e}{_free_note(path)}") from e
    except (RuntimeError, SafetensorError) as e:
        raise OSError(errno.EIO, f"writing {path.name} failed ({_last_line(e)}){_free_note(path)}") from e


def _write_failure(e: BaseException) -> bool:
    """A failed write reported as safetensors' SafetensorError or torch's RuntimeError ('PytorchStreamWriter
    failed writing file', 'file write failed')."""
    from safetensors import SafetensorError
    return isinstance(e, SafetensorError) or (isinstance(e, RuntimeError) and "writ" in str(e).lower())


def _last_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]


def _free_note(path: Path) -> str:
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return ""
    return f"; the disk holding it has {free / 2**20:.0f} MiB free" if free < 2**30 else ""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# what every checkpoint holds, for checkpoints written before meta.json recorded its files
_NEEDED = ("train.pt", "optim.pt", "sched.pt")


def damage(folder: Path, optimizer: bool = True) -> Optional[str]:
    """Why checkpoint `folder` cannot be trusted, naming the file (missing, cut short, or its bytes not
    those written: the sha256 in meta.json differs), or None when every file is as written. `optimizer`:
    a resume needs the optimizer state too (an evaluation takes weights only)."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("no integer 'step' in it")
    except FileNotFoundError:
        return f"{meta_path} is missing"
    except (OSError, ValueError) as e:
        return f"{meta_path} is damaged ({getattr(e, 'strerror', None) or e})"
    if meta.get("weights_only") and optimizer:
        return (f"{folder} holds weights only: its optimizer state was removed when the run finished "
                "(run.final_only)")
    sums = meta.get("files")
    if not isinstance(sums, dict):   # written before checksums were recorded: the files must be there
        weights = [n for n in ("actor.safetensors", "adapter_model.safetensors") if (folder / n).exists()]
        missing = [n for n in (_NEEDED if optimizer else ()) if not (folder / n).exists()] + \
            ([] if weights else ["actor.safetensors"])
        return f"{folder / missing[0]} is missing" if missing else None
    for name, want in sums.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        try:
            size = path.stat().st_size
            if size != want.get("bytes"):
                return (f"{path} is damaged: {size} bytes, but {want.get('bytes')} were written (cut short or "
                        "replaced)")
            if sha256(path) != want.get("sha256"):
                return f"{path} is damaged: its bytes differ from those written (sha256 mismatch)"
        except OSError as e:
            return f"{path} cannot be read ({e.strerror or e})"
        except AttributeError:
            return f"{meta_path} is damaged (its 'files' entry for {name} is not a record)"
    return None


def _untie(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (tied embeddings): keep separate copies."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.setdefault(ptr, k)
    return out


def load(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any], dict[str, Any]]:
    """(tensors, state, meta) of a checkpoint folder written by `save`."""
    from safetensors.torch import load_file
    folder = Path(folder)
    if not (folder / "meta.json").exists():
        raise CheckpointError(f"{folder} is not an edgerl checkpoint (no meta.json)")
    try:
        tensors = {p.stem: load_file(str(p)) for p in folder.glob("*.safetensors")}
        state = {p.stem: torch.load(p, map_location="cpu", weights_only=False) for p in folder.glob("*.pt")}
        meta = json.loads((folder / "meta.json").read_text())
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {folder}: {e}") from e
    return tensors, state, meta


def non_finite(folder: Path) -> list[str]:
    """The weights of checkpoint `folder` that hold NaN or infinity, as 'file/tensor' names; read
    one tensor at a time, so checking a large checkpoint does not hold it in memory."""
    from safetensors import SafetensorError, safe_open
    bad = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    if t.is_floating_point() and not torch.isfinite(t).all():
                        bad.append(f"{path.stem}/{key}")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read checkpoint {folder}: {path.name} is damaged ({e}); resume from "
                                  "another checkpoint") from None
    return bad

