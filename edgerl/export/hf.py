"""`--format hf`: merged safetensors with the config, tokenizer and chat template, and a model card
(README.md) holding the run's config, its plan and its last evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from edgerl.core.errors import ConfigError
from edgerl.export.source import Source
from edgerl.export.tensors import numel

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
ST_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}
SHARD_BYTES = 2 * 2**30
HUB_NAMES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}   # the embedded model's hub id


def out_dtype(src: Source, quant: Optional[str]) -> str:
    """The weights' number format: --quant (f32, bf16, f16), else the one the source stores them in (a merged
    LoRA export is fp32: W + scale * B @ A is kept unrounded until asked)."""
    if quant is not None:
        if quant not in DTYPES:
            raise ConfigError(f"--quant {quant} with --format hf: choose f32, bf16 or f16 (q8_0 and k-quants are "
                              "GGUF formats: --format gguf)")
        return quant
    kinds = {ST_DTYPES.get(d, "f32") for d in getattr(src.weights, "dtypes", {"F32"})}
    return kinds.pop() if len(kinds) == 1 else "f32"


def write_hf(src: Source, quant: Optional[str], out: Path, log: Callable[[str], None] = print) -> None:
    """Write the model in `src` as an HF folder into `out` (an empty temporary folder)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer
    dtype = out_dtype(src, quant)
    config = AutoConfig.from_pretrained(str(src.config_dir))
    config.dtype = DTYPES[dtype]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    names = [n for n in src.weights.names() if not (tied and n == "lm_head.weight")
             and not n.endswith("rotary_emb.inv_freq")]
    size = DTYPES[dtype].itemsize
    shards: list[list[str]] = [[]]
    used = 0
    for n in names:
        b = numel(src.weights.shape(n)) * size
        if shards[-1] and used + b > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(n)
        used += b
    index: dict[str, str] = {}
    for i, part in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: src.weights.load(n).to(DTYPES[dtype]).contiguous() for n in part}, str(out / file),
                  metadata={"format": "pt"})
        index.update({n: file for n in part})
    if len(shards) > 1:
        total = sum(numel(src.weights.shape(n)) * size for n in names)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")
    config.save_pretrained(str(out))
    gen = src.config_dir / "generation_config.json"
    if gen.is_file():
        (out / gen.name).write_bytes(gen.read_bytes())
    AutoTokenizer.from_pretrained(str(src.tokenizer_dir)).save_pretrained(str(out))
    (out / "README.md").write_text(model_card(src, dtype, "hf"), encoding="utf-8")
    log(f"wrote {len(names)} tensors in {dtype} ({len(shards)} safetensors file(s)), config, tokenizer, README.md")


def _hub_id(base: Optional[str]) -> Optional[str]:
    if base is None:
        return None
    if base.strip().lower() in HUB_NAMES:
        return HUB_NAMES[base.strip().lower()]
    from edgerl.core.hub import is_hub_id
    return base if is_hub_id(base) else None


def model_card(src: Source, number_format: str, fmt: str, files: Optional[list[str]] = None) -> str:
    """README.md: what the model is, how it was trained (plan and config) and how it scored."""
    base = _hub_id(src.base)
    cfg = _toml(src.run_config)
    algo = (cfg.get("algo") or {}).get("advantage") if cfg else None
    tags = ["edgerl"] + ([algo] if algo else []) + (["gguf"] if fmt == "gguf" else [])
    lines = ["---"] + ([f"base_model: {base}"] if base else []) + (
        ["library_name: transformers"] if fmt == "hf" else []) + ["tags:"] + [f"- {t}" for t in tags] + ["---", "",
                                                                                                           f"# {src.name}", ""]
    what = f"Exported by edgerl from {src.what}"
    if src.base:
        what += f"; trained from `{src.base}`"
    lines += [what + ".", ""]
    if src.notes:
        lines += [f"Note: {n}." for n in src.notes] + [""]
    lines += [f"Weights: {number_format}" + (f" ({', '.join(files)})" if files else "") + ".", ""]
    lines += ["## Evaluation", ""]
    if src.evals:
        lines += [f"Held-out evaluation at step {src.eval_step} (edgerl's eval.data):", "", "| metric | value |",
                  "|---|---|"] + [f"| {k} | {v:.4g} |" for k, v in sorted(src.evals.items())] + [""]
    else:
        lines += ["No held-out evaluation was recorded for this run (eval.data was not set)." if src.run else
                  "Not an edgerl run: no evaluation recorded.", ""]
    plan = (src.plan or {}).get("plan") or {}
    reasons = (src.plan or {}).get("reasons") or {}
    if plan:
        device = ((src.plan or {}).get("device") or {}).get("name")
        lines += ["## Training plan", "", f"edgerl's plan" + (f" for {device}" if device else "") + ":", "",
                  "| decision | value | reason |", "|---|---|---|"]
        for key, value in plan.items():
            if key in reasons or isinstance(value, (str, int, float, bool)):
                lines.append(f"| {key} | {_cell(value)} | {_cell(reasons.get(key, ''))} |")
        lines.append("")
    if src.run_config:
        lines += ["## Run config", "", "```toml", src.run_config.strip(), "```", ""]
    lines += ["## Use", ""]
    if fmt == "hf":
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(FOLDER)", "model = AutoModelForCausalLM.from_pretrained(FOLDER)",
                  "```", ""]
    else:
        lines += ["See `Modelfile` (Ollama) and the commands in it for llama.cpp's `llama-server`.", ""]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    text = json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def _toml(text: Optional[str]) -> dict[str, Any]:
    import tomllib
    try:
        return tomllib.loads(text or "")
    except ValueError:
        return {}
