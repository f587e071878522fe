"""Hugging Face Hub ids (`Qwen/Qwen3-1.7B`): their files from huggingface_hub's cache, downloaded into it
when missing, with its token (HF_TOKEN or `hf auth login`) and its settings (HF_HOME, HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_ENDPOINT). Planning needs a model's config.json only; training needs its weights and
tokenizer. Every failure is one line naming the id, the cache folder and HF_HUB_OFFLINE.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Optional

from edgerl.core.errors import ModelError, ModelSpecError

# the Hub's own rule: ASCII letters, digits, '-', '_' and '.', no '--' or '..', neither at either end of a part
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?$",
                      re.ASCII)
# What training reads from a model repository: config, weights, tokenizer and chat template. Not the
# other copies some repositories ship (original/ checkpoints, GGUF files, ONNX exports).
TRAIN_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
SKIP_FILES = ["original/*", "*.gguf", "onnx/*", "*/onnx/*"]


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub id (owner/name) rather than a local path."""
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def cache_folder() -> str:
    from huggingface_hub import constants
    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def _why(e: BaseException, repo_id: str = "OWNER/NAME") -> str:
    """A download failure as a clause, one line."""
    from huggingface_hub import errors
    if _unreachable(e):
        return (f"the Hub cannot be reached ({type(e).__name__}); on a machine with a network, download it into "
                f"the cache with `hf download {repo_id}`, then set HF_HUB_OFFLINE=1 to use the cache alone")
    if isinstance(e, errors.GatedRepoError):
        return "the repository is gated: accept its terms on the Hub and log in (hf auth login, or HF_TOKEN)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return "the Hub has no such repository, or it is private (log in with hf auth login, or set HF_TOKEN)"
    if isinstance(e, (errors.RevisionNotFoundError, errors.EntryNotFoundError)):
        return f"the repository has no such file ({type(e).__name__})"
    first = " ".join(str(e).split())[:200]
    return f"it could not be downloaded ({type(e).__name__}: {first}); check the network, or set HF_HUB_OFFLINE=1 " \
           "to use the cache alone"


def _unreachable(e: BaseException) -> bool:
    """No connection to the Hub: huggingface_hub's LocalEntryNotFoundError (it could not connect, and the cache
    lacks the file) or a connection error of the HTTP library under it, anywhere in the chain of causes."""
    from huggingface_hub import errors
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, errors.LocalEntryNotFoundError) or type(e).__name__ in (
                "ConnectionError", "ConnectError", "ConnectTimeout", "NameResolutionError", "MaxRetryError"):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _missing(repo_id: str, what: str, why: str) -> str:
    return (f"model {repo_id!r}: {what} not in the Hugging Face cache ({cache_folder()}) and {why}; or pass a local "
            "HF model folder")


def _offline_why() -> str:
    return "HF_HUB_OFFLINE=1 forbids downloading (run once with HF_HUB_OFFLINE unset, or hf download the model)"


def config_file(repo_id: str) -> Path:
    """The id's config.json: from the cache, else downloaded into it (never the weights). Raises
    ModelSpecError in one line when neither works."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception as e:   # an id the Hub's own check refuses (HFValidationError)
        raise ModelSpecError(f"model {repo_id!r} is not a Hugging Face id ({e}); or pass a local HF model folder") \
            from None
    if isinstance(found, str):
        return Path(found)
    if offline():
        raise ModelSpecError(_missing(repo_id, "its config.json is", _offline_why()))
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:   # network, authentication, a missing repository: all one line
        raise ModelSpecError(_missing(repo_id, "its config.json is", _why(e, repo_id))) from None


def cached_folder(repo_id: str) -> Optional[Path]:
    """The id's snapshot folder in huggingface_hub's cache where its config.json is there, else None (never
    downloads)."""
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


@functools.lru_cache(maxsize=None)
def snapshot(repo_id: str) -> Path:
    """The folder of the id's config, weights and tokenizer in the cache, downloaded there first where
    missing (offline: the cache alone). Raises ModelError in one line when the weights are not there."""
    from huggingface_hub import snapshot_download
    kwargs = dict(allow_patterns=TRAIN_FILES, ignore_patterns=SKIP_FILES)
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=offline(), **kwargs))
        if not _has_weights(folder) and not offline():   # a repository with .bin weights only
            folder = Path(snapshot_download(repo_id, allow_patterns=["pytorch_model*.bin"],
                                            ignore_patterns=SKIP_FILES))
    except Exception as e:
        raise ModelError(_missing(repo_id, "its weights are", _offline_why() if offline() else _why(e, repo_id))) \
            from None
    if not _has_weights(folder):
        raise ModelError(_missing(repo_id, "its weights are", _offline_why() if offline() else _no_weights(repo_id)))
    return folder


def _no_weights(repo_id: str) -> str:
    """Why a download left no weights: huggingface_hub returns a cached snapshot without them (a config that
    `recommend` fetched) when the Hub cannot be reached, so ask the Hub before blaming the repository."""
    from huggingface_hub import HfApi
    try:
        HfApi().model_info(repo_id)
    except Exception as e:
        return _why(e, repo_id)
    return "the repository has no .safetensors or pytorch_model*.bin weights"
