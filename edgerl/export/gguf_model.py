"""An HF model as llama.cpp lays it out in GGUF: the architecture, its hyperparameters and each tensor's
name, layout and number format, following llama.cpp's convert_hf_to_gguf.py (github.com/ggml-org/llama.cpp)
for the families edgerl's rollout engine runs.

    family (HF class)        GGUF arch  what changes from the HF weights
    LlamaForCausalLM         llama      q_proj / k_proj rows reordered per head for GGML's rope (below)
    MistralForCausalLM       llama      the same (llama.cpp runs Mistral 7B as llama)
    Qwen2ForCausalLM         qwen2      nothing (NEOX-style rope, as HF computes it)
    Qwen3ForCausalLM         qwen3      nothing; q_norm / k_norm become attn_q_norm / attn_k_norm
    Gemma3ForCausalLM        gemma3     every *norm.weight + 1 (Gemma's RMSNorm scales by 1 + w; GGML by w)

Tensor names come from the gguf package's own map (gguf.get_tensor_name_map), the one llama.cpp uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from edgerl.core.errors import ConfigError, ModelError
from edgerl.plan.archs import ARCHITECTURES, Gguf, architecture

# --quant -> (GGML type of the 2-D weights, llama.cpp's general.file_type)
QUANTS = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}
NOT_WRITTEN = {"q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "q3_k_m", "q2_k",
               "iq4_xs"}


def check_quant(quant: str) -> str:
    q = quant.strip().lower()
    if q in QUANTS:
        return q
    if q in NOT_WRITTEN:
        raise ConfigError(f"--quant {quant}: edgerl writes f16, bf16, f32 and q8_0 GGUF files (the gguf package "
                          f"cannot write k-quants); make {q.upper()} from the f16 file with llama.cpp: llama-quantize "
                          f"MODEL-f16.gguf MODEL-{q.upper()}.gguf {q.upper()}")
    raise ConfigError(f"--quant {quant}: choose f16, q8_0, bf16 or f32 (for q4_k_m and other k-quants, run "
                      "llama.cpp's llama-quantize on the f16 file)")


Family = Gguf   # how a model type is written (its row in plan/archs.py)


def family_of(config: dict[str, Any], where: str) -> Family:
    archs = config.get("architectures") or []
    name = archs[0] if archs else config.get("model_type", "?")
    row = architecture(str(config.get("model_type", "")))
    if row.gguf is None or (archs and archs[0] != row.hf_class):
        writes = ", ".join(a.hf_class for a in ARCHITECTURES.values() if a.gguf is not None)
        raise ModelError(f"{where}: {name} cannot be written as GGUF by edgerl (it writes {writes}); "
                         "convert it with llama.cpp's convert_hf_to_gguf.py, or export --format hf")
    return row.gguf


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of each head of a q_proj / k_proj weight (or bias) reordered from HF's rotate-half layout
    (the rope pairs are element i and i + d/2 of a head) to GGML's (pairs are elements 2i and 2i + 1):
    row j of a head, j < d/2, goes to 2j, and row d/2 + j to 2j + 1. llama.cpp's converter does this for
    llama-family models, whose GGML graph applies rope to adjacent pairs."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope(config: dict[str, Any], family: Family) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope theta, scaling dict or None); transformers 5 keeps both in rope_parameters (per layer type for
    Gemma 3: the full-attention layers' is the model's; llama.cpp fixes the sliding layers' base at 10000)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    theta = params.get("rope_theta", config.get("rope_theta", 1_000_000.0 if family.arch == "gemma3" else 10_000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> torch.Tensor:
    """Llama 3.1's per-frequency rope divisors (the rope_freqs tensor llama.cpp reads): frequencies with a
    wavelength under original_max / high_freq_factor keep theirs, those over original_max / low_freq_factor are
    divided by `factor`, and those between are blended linearly in original_max / wavelength."""
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_hparams(writer: Any, config: dict[str, Any], family: Family, quant: str, name: str) -> dict[str, Any]:
    """The model's GGUF metadata; returns what the tensor pass needs (heads, extra tensors)."""
    import gguf
    c = config
    heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    eps = c.get("rms_norm_eps", 1e-6)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(int(c.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(c["num_hidden_layers"]))
    writer.add_feed_forward_length(int(c["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(float(eps))
    if c.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    theta, scaling = _rope(c, family)
    writer.add_rope_freq_base(theta)
    extra: dict[str, torch.Tensor] = {}
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn" and family.arch != "gemma3":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif kind == "llama3" and family.arch == "llama":
        extra["rope_freqs.weight"] = llama3_rope_factors(scaling, theta, head_dim)
    else:
        raise ModelError(f"rope scaling {kind!r} of a {family.arch} model is not written by edgerl; convert it with "
                         "llama.cpp's convert_hf_to_gguf.py")
    if family.arch == "llama":
        writer.add_vocab_size(int(c["vocab_size"]))
        writer.add_rope_dimension_count(head_dim)
    if family.arch == "gemma3":
        if c.get("sliding_window") is not None:
            writer.add_sliding_window(int(c["sliding_window"]))
        if c.get("final_logit_softcapping") is not None or c.get("attn_logit_softcapping") is not None:
            raise ModelError("a Gemma 3 config with logit soft-capping is not a Gemma 3 llama.cpp runs")
        # llama.cpp scales attention by 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 62-layer 27B); HF by
        # 1/sqrt(query_pre_attn_scalar): a config where they differ would run with another scale there
        scalar = c.get("query_pre_attn_scalar", head_dim)
        if scalar != head_dim and not (int(c["num_hidden_layers"]) == 62 and scalar == hidden // heads):
            raise ModelError(f"this Gemma 3 config scales attention by 1/sqrt({scalar}), but llama.cpp would use "
                             f"1/sqrt({head_dim}) (its head_dim); not exported")
    writer.add_file_type(QUANTS[quant][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return {"heads": heads, "kv_heads": kv, "extra": extra}


@dataclass
class Planned:
    gguf_name: str
    hf_name: Optional[str]           # None: a tensor edgerl computes (rope_freqs)
    shape: tuple[int, ...]           # numpy order (rows, columns)
    qtype: Any                       # gguf.GGMLQuantizationType


def tensor_plan(weights: Any, config: dict[str, Any], family: Family, quant: str,
                extra: dict[str, torch.Tensor]) -> list[Planned]:
    """Every tensor to write, in order, with its GGUF name and type; an HF weight the map does not know is
    an error naming it (nothing is left out silently)."""
    import gguf
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    names = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    tied = bool(config.get("tie_word_embeddings", family.arch == "gemma3"))
    target = getattr(gguf.GGMLQuantizationType, QUANTS[quant][0])
    out = []
    for hf in weights.names():
        if hf.endswith("rotary_emb.inv_freq") or (tied and hf == "lm_head.weight"):
            continue   # recomputed by llama.cpp / the same tensor as token_embd
        new = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ModelError(f"the weight {hf} has no GGUF name in llama.cpp's {family.arch} layout; convert the "
                             "model with llama.cpp's convert_hf_to_gguf.py")
        out.append(Planned(new, hf, tuple(weights.shape(hf)), _qtype(new, weights.shape(hf), target)))
    for name, t in extra.items():
        out.append(Planned(name, None, tuple(t.shape), gguf.GGMLQuantizationType.F32))
    return out


def _qtype(name: str, shape: tuple[int, ...], target: Any) -> Any:
    """llama.cpp's rule: 1-D tensors and norms stay f32; a row that q8_0's 32-value blocks do not divide is
    written f16 instead."""
    import gguf
    T = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return T.F32
    if target == T.Q8_0 and shape[-1] % 32:
        return T.F16
    return target


def converted(p: Planned, t: torch.Tensor, family: Family, info: dict[str, Any]) -> np.ndarray:
    """The tensor `p` as GGUF stores it: reordered for llama's rope, +1 for Gemma's norms, in its type."""
    from gguf.quants import quantize
    t = t.detach().to(torch.float32)
    if family.permute_qk and p.hf_name and p.hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        t = permute_rows(t, info["heads"])
    elif family.permute_qk and p.hf_name and p.hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        t = permute_rows(t, info["kv_heads"])
    if family.norm_plus_one and p.hf_name and p.hf_name.endswith("norm.weight"):
        t = t + 1
    return quantize(t.numpy(), p.qtype)


def byte_shape(p: Planned) -> tuple[tuple[int, ...], Any]:
    """(shape, numpy dtype) of the array `converted` returns, for the header written before the data."""
    import gguf
    T = gguf.GGMLQuantizationType
    if p.qtype == T.F32:
        return p.shape, np.dtype(np.float32)
    if p.qtype == T.F16:
        return p.shape, np.dtype(np.float16)
    return tuple(gguf.quant_shape_to_byte_shape(p.shape, p.qtype)), np.dtype(np.uint8)
