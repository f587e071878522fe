"""A llama-family decoder written against a static KV cache, reading an HF model's own weights.

HF's forward builds masks and cache objects in Python and synchronises with the host on the way;
this one does neither in the decode step, so `torch.cuda.CUDAGraph` can capture it (no
torch.compile: Pascal, CC 6.x, has no Triton). The math follows `modeling_llama.py` /
`modeling_qwen2.py` op for op (RMSNorm in fp32, rotary tables computed as HF computes them,
grouped-query attention, the module's own activation), so greedy output equals HF `generate`.

Left padding as HF does it: every prompt of a batch ends at column W-1; row b's first real token
sits at column `start[b]`, and its position ids count from there (`column - start[b]`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at init
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA = _TORCH >= (2, 5)  # `enable_gqa=` of scaled_dot_product_attention


class UnsupportedModel(ValueError):
    """The static engine cannot run this model; the factory falls back to HF generate and says why."""


def check_supported(model: torch.nn.Module, max_seq_len: int) -> None:
    """Raise UnsupportedModel naming what is wrong and what is supported."""
    arch = type(model).__name__
    if arch not in SUPPORTED:
        raise UnsupportedModel(f"{arch} is not a llama-family decoder the static engine implements "
                               f"(supported: {', '.join(SUPPORTED)} and fine-tunes of them such as SmolLM2)")
    cfg = model.config
    need = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    for i, layer in enumerate(model.model.layers):
        for path in need:
            obj = layer
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                raise UnsupportedModel(f"{arch} layer {i} has no {path}; the static engine needs the "
                                       f"llama module structure ({', '.join(SUPPORTED)})")
    # Sliding-window attention only differs from full attention past the window.
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or []
    sliding = ("sliding_attention" in types) if types else (
        window is not None and getattr(cfg, "use_sliding_window", True))
    if sliding and window is not None and max_seq_len > window:
        raise UnsupportedModel(f"{arch} uses sliding-window attention (window {window}) and sequences "
                               f"reach {max_seq_len} tokens; the static engine only implements full attention")
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        raise UnsupportedModel(f"{arch} has pretraining_tp={cfg.pretraining_tp}; only 1 is implemented")


def rope_parameters(config) -> tuple[str, dict]:
    """(rope_type, parameters) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x)."""
    rp = getattr(config, "rope_parameters", None)
    if rp:
        if "rope_type" not in rp and all(isinstance(v, dict) for v in rp.values()):
            raise NotImplementedError("per-layer-type rope parameters are not implemented by the static engine")
        return rp.get("rope_type", rp.get("type", "default")), dict(rp)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    return rtype, {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}


def inv_freq_for(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, head_dim/2) and the cos/sin scale, as the HF rotary module computes them."""
    rtype, params = rope_parameters(config)
    if rtype not in _STATIC_ROPE:
        raise NotImplementedError(
            f"rope_type {rtype!r} is not implemented by the static engine (its frequencies change with the "
            f"sequence length); implemented: {', '.join(_STATIC_ROPE)}. Use the plain HF generate engine.")
    if rtype == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scale = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv, scale = ROPE_INIT_FUNCTIONS[rtype](config, torch.device("cpu"))
        inv = inv.float()
    if inv.numel() * 2 != head_dim:
        raise NotImplementedError(f"partial rotary embeddings ({inv.numel() * 2} of {head_dim} dims) "
                                  "are not implemented by the static engine")
    return inv, float(scale)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF: normalise in fp32, cast back, then scale. F.rms_norm is one fused kernel on CUDA instead of
    # five (pow, mean, add, rsqrt, mul), which counts when a decode step is ~1200 tiny kernels.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticDecoder:
    """The model's weights (by reference: an in-place weight copy is seen here and by captured graphs)
    and a KV cache of `max_batch` x `max_seq_len`. Shapes: B rows, W prompt columns, S = max_seq_len,
    KVH key/value heads, G = heads / KVH query heads per KV head, D head dim."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int) -> None:
        check_supported(model, max_seq_len)
        cfg = model.config
        self.model = model
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        first = model.model.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = first.q_proj.weight.shape[0] // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.scaling = getattr(first, "scaling", self.head_dim ** -0.5)
        emb = model.model.embed_tokens.weight
        self.device, self.dtype = emb.device, emb.dtype
        inv, scale = inv_freq_for(cfg, self.head_dim)
        # Same elementwise fp32 ops as the HF rotary forward, for every position at once, then cast.
        freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv[None, :]
        emb_f = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb_f.cos() * scale).to(self.device, self.dtype)   # (S, D)
        self.sin = (emb_f.sin() * scale).to(self.device, self.dtype)
        self.cols = torch.arange(max_seq_len, device=self.device)       # (S,)
        self.cache: torch.Tensor | None = None

    def allocate(self) -> None:
        """(layers, 2, max_batch, KVH, S, D). Zeroed: masked columns get weight 0, and 0 * NaN from
        uninitialised memory would still poison the weighted sum over V."""
        if self.cache is None:
            n = len(self.model.model.layers)
            self.cache = torch.zeros((n, 2, self.max_batch, self.n_kv, self.max_seq_len, self.head_dim),
                                     device=self.device, dtype=self.dtype)

    def free(self) -> None:
        self.cache = None

    def cache_bytes(self) -> int:
        n = len(self.model.model.layers)
        return n * 2 * self.max_batch * self.n_kv * self.max_seq_len * self.head_dim * self.dtype.itemsize

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """x: (B, L, hidden); pos: (B, L) position ids. `attend(i, q, k, v)` stores k, v in layer i's
        cache and returns the attention output (B, L, heads * D) from q (B, H, L, D), k, v (B, KVH, L, D)."""
        B, L, _ = x.shape
        cos = F.embedding(pos, self.cos).unsqueeze(1)                       # (B, 1, L, D)
        sin = F.embedding(pos, self.sin).unsqueeze(1)
        for i, layer in enumerate(self.model.model.layers):
            at, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            q = F.linear(h, at.q_proj.weight, at.q_proj.bias).view(B, L, -1, self.head_dim).transpose(1, 2)
            k = F.linear(h, at.k_proj.weight, at.k_proj.bias).view(B, L, -1, self.head_dim).transpose(1, 2)
            v = F.linear(h, at.v_proj.weight, at.v_proj.bias).view(B, L, -1, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(i, q, k, v)
            x = x + F.linear(o, at.o_proj.weight, at.o_proj.bias)
            h = _rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            h = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)) * \
                F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + F.linear(h, mlp.down_proj.weight, mlp.down_proj.bias)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.model.model.norm
        x = _rms_norm(x, norm.weight, norm.variance_epsilon)
        head = self.model.lm_head   # tied models share the embedding Parameter itself
        return F.linear(x, head.weight, head.bias).float()

    def prefill(self, ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """ids: (B, W) left-padded prompts; start: (B,) first real column. Writes cache columns [0, W)
        of rows [0, B) and returns the fp32 logits of the last column, (B, vocab). Runs eagerly."""
        B, W = ids.shape
        assert self.cache is not None and B <= self.max_batch and W <= self.max_seq_len
        cols = self.cols[:W]
        pos = (cols[None, :] - start[:, None]).clamp(min=0)                     # (B, W)
        # Causal, and pad keys hidden; a pad query sees itself so its (unused) row stays finite.
        allowed = (cols[None, :] <= cols[:, None])[None] & (
            (cols[None, None, :] >= start[:, None, None]) | torch.eye(W, dtype=torch.bool, device=ids.device)[None])
        allowed = allowed[:, None]                                               # (B, 1, W, W)

        def attend(i, q, k, v):
            self.cache[i, 0, :B, :, :W] = k
            self.cache[i, 1, :B, :, :W] = v
            if _SDPA_GQA:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scaling,
                                                   enable_gqa=self.group > 1)
            else:
                o = F.scaled_dot_product_attention(q, k.repeat_interleave(self.group, 1),
                                                   v.repeat_interleave(self.group, 1),
                                                   attn_mask=allowed, scale=self.scaling)
            return o.transpose(1, 2).reshape(B, W, -1)

        x = self._layers(F.embedding(ids, self.model.model.embed_tokens.weight), pos, attend)
        return self._logits(x[:, -1])

    def decode(self, tok: torch.Tensor, col: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One token per row. tok: (B,) inputs; col: (1,) cache column they go to (all rows share it);
        start: (B,). Returns fp32 logits (B, vocab). No host synchronisation, fixed shapes and
        addresses: safe to capture in a CUDA graph and replay with tok/col/start updated in place."""
        B, S, BK = tok.shape[0], self.max_seq_len, tok.shape[0] * self.n_kv
        pos = (col - start)[:, None]                                                    # (B, 1)
        hidden = (self.cols[None, :] < start[:, None]) | (self.cols[None, :] > col)     # (B, S)
        # One additive mask for all layers, so each layer's scores are a single baddbmm.
        zero = torch.zeros((), device=tok.device, dtype=self.dtype)
        bias = torch.where(hidden, -math.inf, zero)[:, None, None, :]
        bias = bias.expand(B, self.n_kv, 1, S).reshape(BK, 1, S)                       # (B*KVH, 1, S)

        def attend(i, q, k, v):
            kc, vc = self.cache[i, 0, :B], self.cache[i, 1, :B]          # (B, KVH, S, D)
            kc.index_copy_(2, col, k)
            vc.index_copy_(2, col, v)
            # GQA without repeat_kv: query heads grouped under their KV head (head h uses KV head h // G).
            qg = q.reshape(BK, self.group, self.head_dim)                # (B*KVH, G, D)
            s = torch.baddbmm(bias, qg, kc.reshape(BK, S, self.head_dim).transpose(1, 2), alpha=self.scaling)
            p = torch.softmax(s, -1, dtype=torch.float32).to(self.dtype)  # (B*KVH, G, S)
            return torch.bmm(p, vc.reshape(BK, S, self.head_dim)).reshape(B, 1, -1)   # (B, 1, H * D)

        x = self._layers(F.embedding(tok[:, None], self.model.model.embed_tokens.weight), pos, attend)
        return self._logits(x[:, 0])
