"""What the static decoder needs to know about an HF model's forward: its architecture's row (plan/archs.py,
by config.json's model_type: whether the decoder runs it, the modules it reads, its norm, q/k norms and
post-norms), and the rest read from the model itself (weights, windows, rotary tables, soft-capping).

The decoder implements one layer shape, `x + attn(norm(x))` then `x + mlp(norm(x))` with rotary
grouped-query attention, and these variations, each as `modeling_<arch>.py` computes it:

    llama, mistral, qwen2   the plain layer (qwen2: biases on q, k and v)
    qwen3                   an RMS norm on every query and key head before the rotary embedding
    gemma3_text             the same q/k norms; every RMS norm scales by (1 + weight) in fp32 and rounds
                            after the scale; the attention and MLP outputs are normed again before the
                            residual add (post_attention_layernorm, post_feedforward_layernorm), the MLP's
                            input by pre_feedforward_layernorm; the embedding is scaled by sqrt(hidden) (by
                            the model's own embedding module); scores scale by query_pre_attn_scalar ** -0.5;
                            sliding-window layers rotate with their own base (rope_local_base_freq); the
                            logits are soft-capped, cap * tanh(logits / cap), where final_logit_softcapping
                            is set. (Gemma3Attention keeps attn_logit_softcapping but, in transformers 5,
                            never passes it to the attention function: the scores are not capped, here
                            either, so that rollout and training compute the same model.)

Sliding-window layers (Mistral, Qwen2/Qwen3 with use_sliding_window, Gemma 3's local layers) attend to
the keys of the last `window` columns, as transformers' sliding-window mask does (`kv > q - window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from edgerl.plan.archs import ARCHITECTURES, Architecture, architecture
from edgerl.plan.modelspec import STATIC_ROPE


class UnsupportedModel(ValueError):
    """The static engine cannot run this model; the factory falls back to HF generate and says why."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in fp32, cast back, then scale.
    F.rms_norm computes in fp32 internally for 16-bit inputs and rounds once, the same values as HF's
    upcast/normalise/downcast, in one kernel (CUDA) instead of five plus two casts; the scale stays a
    separate multiply so it rounds where HF's does."""
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm op for op: normalise and scale by (1 + weight) in fp32, round once at the end."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


NORMS = {"rms": rms_norm, "gemma": gemma_norm}   # plan/archs.py's `norm`


@dataclass
class Layer:
    """One decoder layer's norms and attention variant. ln1 normalises the attention's input and ln2 the
    MLP's; qk: (q_norm weight, k_norm weight, eps) or None; post: (post-attention weight, post-MLP weight,
    eps) or None; window: the sliding window or None; rope: index of its rotary table."""
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qk: Optional[tuple] = None
    post: Optional[tuple] = None
    window: Optional[int] = None
    rope: int = 0


@dataclass
class Arch:
    """The model's variant of the layer shape (see the module docstring), read by `describe`."""
    name: str
    row: Architecture                         # its architecture's row (plan/archs.py)
    norm: Callable
    layers: list[Layer]
    ropes: list[tuple[torch.Tensor, float]]   # (inverse frequencies fp32 on the CPU, cos/sin scale) per table
    final_softcap: Optional[float]
    sandwich: bool                            # post-attention and post-MLP norms (Gemma)

    @property
    def windows(self) -> list[int]:
        return sorted({lay.window for lay in self.layers if lay.window is not None})

    @property
    def qk_norm(self) -> bool:
        return self.layers[0].qk is not None


def _weight(module) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None)
    return module.weight, float(getattr(module, "eps", 1e-6) if eps is None else eps)


def layer_types(config, n: int) -> list[str]:
    types = list(getattr(config, "layer_types", None) or [])
    return types if len(types) == n else ["full_attention"] * n


def layer_windows(config, n: int) -> list[Optional[int]]:
    """Each layer's sliding window (None: full attention), as the model's masks apply them."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window) if getattr(config, "use_sliding_window", True) else None] * n


def check_supported(model: torch.nn.Module) -> Architecture:
    """The model's architecture row where the static decoder runs it (the row's `static`, as the plan read it,
    and the class the row names); else raise UnsupportedModel naming what is wrong and what is supported."""
    arch = type(model).__name__
    row = architecture(str(getattr(model.config, "model_type", "")))
    if not row.static or arch != row.hf_class:
        supported = ", ".join(a.hf_class for a in ARCHITECTURES.values() if a.static)
        raise UnsupportedModel(f"{arch} is not an architecture the static engine implements "
                               f"(supported: {supported} and fine-tunes of them such as SmolLM2)")
    for i, layer in enumerate(model.model.layers):
        for path in row.layer_modules():
            obj = layer
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                raise UnsupportedModel(f"{arch} layer {i} has no {path}; the static engine needs the "
                                       f"module structure of {arch} in transformers")
    cfg = model.config
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        raise UnsupportedModel(f"{arch} has pretraining_tp={cfg.pretraining_tp}; only 1 is implemented")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{arch} with use_bidirectional_attention: the static engine decodes causally")
    return row


def rope_parameters(config, layer_type: Optional[str] = None) -> tuple[str, dict]:
    """(rope_type, parameters) from `rope_parameters` (transformers 5; one set per layer type for Gemma 3)
    or `rope_theta`/`rope_scaling` (4.x)."""
    rp = getattr(config, "rope_parameters", None)
    if rp:
        if "rope_type" not in rp and all(isinstance(v, dict) for v in rp.values()):
            rp = rp[layer_type or "full_attention"]
        return rp.get("rope_type", rp.get("type", "default")), dict(rp)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    return rtype, {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}


def per_type_rope(config) -> bool:
    rp = getattr(config, "rope_parameters", None)
    return bool(rp) and "rope_type" not in rp and all(isinstance(v, dict) for v in rp.values())


def inv_freq_for(config, head_dim: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, head_dim/2) and the cos/sin scale, as the HF rotary module computes them."""
    rtype, params = rope_parameters(config, layer_type)
    if rtype not in STATIC_ROPE:
        raise NotImplementedError(
            f"rope_type {rtype!r} is not implemented by the static engine (its frequencies change with the "
            f"sequence length); implemented: {', '.join(STATIC_ROPE)}. Use the plain HF generate engine.")
    if rtype == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scale = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        extra = {"layer_type": layer_type} if per_type_rope(config) else {}
        inv, scale = ROPE_INIT_FUNCTIONS[rtype](config, torch.device("cpu"), **extra)
        inv = inv.float()
    if inv.numel() * 2 != head_dim:
        raise NotImplementedError(f"partial rotary embeddings ({inv.numel() * 2} of {head_dim} dims) "
                                  "are not implemented by the static engine")
    return inv, float(scale)


def model_inv_freq(model: torch.nn.Module, head_dim: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (fp32 on the CPU) and cos/sin scale the model's own rotary module uses.

    HF's rotary forward reads its `inv_freq` buffer (as `.float()`), not the config. Loaded with
    `from_pretrained(dtype=...)` that buffer is fp32 and equals `inv_freq_for(config)`; but
    `model.to(torch.bfloat16)` casts buffers too, and the model then rotates with bf16-rounded frequencies
    (0.3% off; 1.4 logit std at the 64th position of a 360M model, a different first token on every row).
    The engine must compute what the model computes, so it takes the buffer where there is one and the
    config only to check the rope type (`inv_freq_for` refuses those whose frequencies change). Gemma 3's
    module holds one buffer per layer type (`sliding_attention_inv_freq`, ...)."""
    inv, scale = inv_freq_for(model.config, head_dim, layer_type)
    rot = getattr(model.model, "rotary_emb", None)
    prefix = f"{layer_type}_" if per_type_rope(model.config) else ""
    buf = getattr(rot, f"{prefix}inv_freq", None)
    if isinstance(buf, torch.Tensor) and buf.shape == inv.shape and buf.device.type != "meta":
        inv = buf.detach().float().cpu()
        scale = float(getattr(rot, f"{prefix}attention_scaling", scale))
    return inv, scale


def describe(model: torch.nn.Module, head_dim: int) -> Arch:
    """The model's layers as the decoder runs them (`check_supported` first: it returns the row read here)."""
    name = type(model).__name__
    cfg, layers = model.config, model.model.layers
    row = architecture(str(getattr(cfg, "model_type", "")))
    n = len(layers)
    types, windows = layer_types(cfg, n), layer_windows(cfg, n)
    kinds = sorted(set(types)) if per_type_rope(cfg) else [None]
    ropes = [model_inv_freq(model, head_dim, k) for k in kinds]
    out = []
    for i, layer in enumerate(layers):
        ln1, eps1 = _weight(layer.input_layernorm)
        ln2, eps2 = _weight(layer.pre_feedforward_layernorm if row.sandwich_norms else layer.post_attention_layernorm)
        qk = post = None
        if row.qk_norm:
            (qw, qe), (kw, _) = _weight(layer.self_attn.q_norm), _weight(layer.self_attn.k_norm)
            qk = (qw, kw, qe)
        if row.sandwich_norms:
            (pa, pe), (pf, _) = _weight(layer.post_attention_layernorm), _weight(layer.post_feedforward_layernorm)
            post = (pa, pf, pe)
        rope = kinds.index(types[i]) if kinds != [None] else 0
        out.append(Layer(ln1, eps1, ln2, eps2, qk, post, windows[i], rope))
    cap = getattr(cfg, "final_logit_softcapping", None)
    return Arch(name, row, NORMS[row.norm], out, ropes, float(cap) if cap else None, row.sandwich_norms)
