"""`edgerl export`: a run's model (or any HF model) as an HF folder or as GGUF for llama.cpp, Ollama and LM
Studio, written atomically into a new folder; optionally pushed to the Hugging Face Hub.

    source.py      what RUN|MODEL names, and its weights (LoRA merged over the base)
    hf.py          --format hf, and the model card
    gguf_model.py  architectures, hyperparameters, tensor names and number formats as llama.cpp lays them out
    gguf_vocab.py  the tokenizer in GGUF
    gguf_write.py  one GGUF file, streamed
    ollama.py      the Modelfile
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Callable, Optional

from edgerl.core.errors import ConfigError, ExportError

FORMATS = ("hf", "gguf")


def export(given: str, fmt: str, quants: list[str], out: Path, *, force: bool = False, step: Optional[int] = None,
           push_to: Optional[str] = None, log: Callable[[str], None] = print) -> Path:
    """Export `given` (a run folder, one of its checkpoints, or an HF model) into the new folder `out`;
    returns it. Refuses, before writing anything: an unknown format or number format, an existing `out`
    without `force`, a source that is not a model, a family or tokenizer GGUF cannot hold."""
    from edgerl.export import gguf_model, source
    from edgerl.train.checkpoint import atomic_folder
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: choose hf (safetensors for transformers, vLLM) or gguf (llama.cpp, "
                          "Ollama, LM Studio)")
    if fmt == "gguf":
        quants = list(dict.fromkeys(gguf_model.check_quant(q) for q in quants or ["q8_0"]))
    elif len(quants or []) > 1:
        raise ConfigError("--format hf writes one number format; give --quant once (f32, bf16 or f16)")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a new folder for the export")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} already exists; pass --force to replace it, or choose another --out")
    src = source.resolve(given, step, log)
    inside = [p for p in (src.config_dir, src.run) if p is not None and _within(out, p)]
    if inside:
        raise ConfigError(f"--out {out} is inside {inside[0]}, which the export reads; choose a folder outside it")
    if fmt == "gguf":   # the family and tokenizer are checked before anything is written
        from edgerl.export.gguf_write import read_config
        gguf_model.family_of(read_config(src), str(src.config_dir / "config.json"))
    log(f"exporting {src.what} as {fmt} ({', '.join(quants) if quants else 'its own number format'}) to {out}")
    aside = out.with_name(f".{out.name}-replaced-{secrets.token_hex(4)}") if out.exists() else None
    with atomic_folder(out, aside) as tmp:
        if fmt == "hf":
            from edgerl.export.hf import write_hf
            write_hf(src, quants[0] if quants else None, tmp, log)
        else:
            _write_gguf_folder(src, quants, tmp, log)
        (tmp / "edgerl-export.json").write_text(json.dumps(
            {"source": src.what, "format": fmt, "quants": quants, "step": src.step}, indent=2) + "\n")
    if aside is not None:   # --force: the replaced export goes only once the new one is complete
        shutil.rmtree(aside, ignore_errors=True)
    log(f"export complete: {out}")
    if push_to:
        push(out, push_to, log)
    return out


def _within(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


def _write_gguf_folder(src, quants: list[str], tmp: Path, log: Callable[[str], None]) -> None:
    from edgerl.export.gguf_write import write_gguf
    from edgerl.export.hf import model_card
    from edgerl.export.ollama import modelfile
    files, vocab = [], {}
    for q in quants:
        name = f"{src.name}-{q}.gguf"
        vocab = write_gguf(src, q, tmp / name, log)
        files.append(name)
    (tmp / "Modelfile").write_text(modelfile(files[0], vocab.get("template"), vocab.get("eos"), files))
    (tmp / "README.md").write_text(model_card(src, ", ".join(quants), "gguf", files), encoding="utf-8")


def push(folder: Path, repo: str, log: Callable[[str], None] = print) -> None:
    """Upload `folder` to the Hub repository `repo` (created if missing, private by default); one line saying
    why not, and that the export is kept, when there is no token, no network, or the Hub refuses."""
    import re
    from edgerl.core.hub import offline
    later = f"the export is in {folder}; upload it later with: hf upload {repo} {folder}"
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise ExportError(f"--push-to-hub {repo}: give the repository as OWNER/NAME; {later}")
    if offline():
        raise ExportError(f"--push-to-hub {repo}: HF_HUB_OFFLINE is set, so nothing is sent; {later}")
    from huggingface_hub import HfApi, get_token
    if not get_token():
        raise ExportError(f"--push-to-hub {repo}: no Hugging Face token (log in with hf auth login, or set HF_TOKEN); "
                          f"{later}")
    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True, private=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="edgerl export")
    except Exception as e:   # the network, the Hub's answer, a token without write access: all said in one line
        first = " ".join(str(e).split())[:200] or type(e).__name__
        raise ExportError(f"--push-to-hub {repo}: the upload failed ({type(e).__name__}: {first}); {later}") from None
    log(f"pushed {folder} to https://huggingface.co/{repo} (private; change it on the Hub)")
