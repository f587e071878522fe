"""A llama-family decoder written against a static KV cache, reading an HF model's own weights.

HF's forward builds masks and cache objects in Python and synchronises with the host on the way;
this one does neither in the decode step, so `torch.cuda.CUDAGraph` can capture it (plain graphs,
no torch.compile needed: Pascal, CC 6.x, has no Triton). The math follows `modeling_llama.py` /
`modeling_qwen2.py` op for op (RMSNorm in fp32, rotary tables computed as HF computes them from the
model's own inverse frequencies, grouped-query attention, the module's own activation), so greedy
output equals HF `generate`.
A layer's projections go through a small object (`projections.py`): fused q/k/v and gate/up
matmuls over plain weights, or the modules themselves (LoRA adapters, quantized layers). The decode
step's layers run through a backend (`plan.decode_backend`), one file each beside this one:
`decode_torch.py` (torch's ops), `decode_triton_attention.py`, `decode_triton_layers.py` and
`decode_cuda_c.py`; backend `x-y` lives in `decode_x_y.py` and is its `Backend` class. The prefill is
the same torch code for all of them.

A decode step for a few rows is bound by the number of kernels, not by the weight reads, so the
step avoids kernels that do no arithmetic HF would not do: rotary on q and k in one pass with the
sign folded into the sin table, k and v written to the cache by one copy, no casts around the norm
and softmax where the kernel computes in fp32 anyway.

Left padding as HF does it: every prompt of a batch ends at column W-1; row b's first real token
sits at column `start[b]`, and its position ids count from there (`column - start[b]`).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .projections import make_projections

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at init
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA = _TORCH >= (2, 5)  # `enable_gqa=` of scaled_dot_product_attention


def sdpa(q, k, v, mask, scale, gqa: bool):
    """scaled_dot_product_attention with a mask; on CUDA on the memory-efficient or math backend only,
    the kernels every dtype was checked on against HF's forward (bench/bench_rollout.py). (A bf16
    mismatch once blamed on the backend choice was the rotary frequencies: see `model_inv_freq`.)"""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa) if _SDPA_GQA \
            else F.scaled_dot_product_attention(q, _repeat(k, q, gqa), _repeat(v, q, gqa), attn_mask=mask, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, _repeat(k, q, gqa), _repeat(v, q, gqa), attn_mask=mask, scale=scale)


def _repeat(kv: torch.Tensor, q: torch.Tensor, gqa: bool) -> torch.Tensor:
    """K or V (B, KVH, S, D) repeated to q's heads (B, H, ., D): HF's repeat_kv."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], 1) if gqa and q.shape[1] != kv.shape[1] else kv


class UnsupportedModel(ValueError):
    """The static engine cannot run this model; the factory falls back to HF generate and says why."""


class DecodeKernelUnavailable(ValueError):
    """The decode backend asked for cannot run here (the message says why)."""


def backend_class(name: str) -> type:
    """The `Backend` class of decode backend `name` (`decode_<name with - as _>.py` beside this file).

    A backend is built with the decoder (`Backend(dec)`, raising DecodeKernelUnavailable where it cannot
    run) and runs one decode step's layers: `mask(start, col)` what the layers read to hide the columns a
    row does not see (an additive mask, or the rows' start columns for a kernel that bounds its reads);
    `first(x)` -> (x, d) from the embedded tokens x (B, hidden); `layer(x, d, proj, ln1, eps1, ln2, eps2,
    kv, cos, sin, mask, col)` -> (x, d) for each layer (kv its cache (2, B, KVH, S, D), cos and sin (B, 1,
    D)); `last(x, d)` the residual stream the final norm reads. d is what a layer hands the next one (the
    MLP output not yet added, or the rows' sums of squares). `name` and `note` describe it."""
    try:
        module = importlib.import_module(f"{__package__}.decode_{name.replace('-', '_')}")
    except ModuleNotFoundError:
        raise ValueError(f"no decode backend {name!r} (edgerl/rollout/decode_{name.replace('-', '_')}.py)") from None
    return module.Backend


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


def model_inv_freq(model: torch.nn.Module, head_dim: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (fp32 on the CPU) and cos/sin scale the model's own rotary module uses.

    HF's rotary forward reads its `inv_freq` buffer (as `.float()`), not the config. Loaded with
    `from_pretrained(dtype=...)` that buffer is fp32 and equals `inv_freq_for(config)`; but
    `model.to(torch.bfloat16)` casts buffers too, and the model then rotates with bf16-rounded frequencies
    (0.3% off; 1.4 logit std at the 64th position of a 360M model, a different first token on every row).
    The engine must compute what the model computes, so it takes the buffer where there is one and the
    config only to check the rope type (`inv_freq_for` refuses those whose frequencies change)."""
    inv, scale = inv_freq_for(model.config, head_dim)
    rot = getattr(model.model, "rotary_emb", None)
    buf = getattr(rot, "inv_freq", None)
    if isinstance(buf, torch.Tensor) and buf.shape == inv.shape and buf.device.type != "meta":
        inv = buf.detach().float().cpu()
        scale = float(getattr(rot, "attention_scaling", scale))
    return inv, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF: normalise in fp32, cast back, then scale. F.rms_norm computes in fp32 internally for 16-bit
    # inputs and rounds once, the same values as HF's upcast/normalise/downcast, in one kernel (CUDA)
    # instead of five plus two casts; the scale stays a separate multiply so it rounds where HF's does.
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a peft wrapper (its LoRA layers stay in place inside it)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


class StaticDecoder:
    """The model's weights (by reference: an in-place weight copy is seen here and by captured graphs)
    and a KV cache of `max_batch` x `cache_len`. Shapes: B rows, W prompt columns, S = cache_len
    (max_seq_len rounded up to 16), KVH key/value heads, G = heads / KVH query heads per KV head,
    D head dim, N = (heads + 2 KVH) D the width of the q/k/v projection.

    projections: 'auto' (fused where every projection is a plain nn.Linear), 'fused' or 'modules'
    (see `projections.py`). backend: the decode step's layers (`plan.decode_backend`): 'torch',
    'triton-attention', 'triton-layers' or 'cuda-c' (`backend_class`); it raises
    DecodeKernelUnavailable, saying why, where it cannot run."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int, *,
                 projections: str = "auto", backend: str = "torch") -> None:
        model = _unwrap(model)
        check_supported(model, max_seq_len)
        cls = backend_class(backend)
        cfg = model.config
        self.model = model
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        # Whole 16-element rows keep the cache and the additive mask aligned for fused attention kernels
        # (they pad a misaligned mask per call); the extra columns are never written and always masked.
        self.cache_len = -(-max_seq_len // 16) * 16
        layers = model.model.layers
        first = layers[0].self_attn
        self.n_layers = len(layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(first, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.scaling = getattr(first, "scaling", self.head_dim ** -0.5)
        self.q_width = self.n_heads * self.head_dim
        self.kv_width = self.n_kv * self.head_dim
        acts = {type(layer.mlp.act_fn) for layer in layers}
        if len(acts) != 1:
            raise UnsupportedModel(f"layers use different activations ({acts}); the static engine needs one")
        self.act = layers[0].mlp.act_fn
        self.silu = getattr(cfg, "hidden_act", None) in ("silu", "swish")
        self.embed, self.final_norm, self.lm_head = model.model.embed_tokens, model.model.norm, model.lm_head
        self.norms = [(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                       layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
                      for layer in layers]
        self.proj, self.proj_note = make_projections(layers, projections)
        emb = self.embed.weight
        self.device, self.dtype = emb.device, emb.dtype
        inv, scale = model_inv_freq(model, self.head_dim)
        # Same elementwise fp32 ops as the HF rotary forward, for every position at once, then cast.
        freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv[None, :]
        emb_f = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb_f.cos() * scale).to(self.device, self.dtype)   # (max_seq_len, D)
        sin = (emb_f.sin() * scale).to(self.device, self.dtype)
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2) exactly (negation is exact): the sign
        # lives in the table, which saves a negation kernel per layer and step.
        half = self.head_dim // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.cols = torch.arange(self.cache_len, device=self.device)       # (S,)
        self.cache: torch.Tensor | None = None
        self.backend = cls(self)

    # ---- memory and weights ---------------------------------------------------------------------

    def allocate(self, rows: int | None = None) -> None:
        """(layers, 2, rows, KVH, S, D), rows at most max_batch (default): what the batch needs. Zeroed: masked
        columns get weight 0, and 0 * NaN from uninitialised memory would still poison the weighted sum over V.
        A cache with fewer rows than asked for is replaced (captured graphs must then be dropped)."""
        rows = min(rows or self.max_batch, self.max_batch)
        if self.cache is None or self.cache.shape[2] < rows:
            self.cache = None
            self.cache = torch.zeros((self.n_layers, 2, rows, self.n_kv, self.cache_len, self.head_dim),
                                     device=self.device, dtype=self.dtype)

    def free(self) -> None:
        self.cache = None

    def cache_bytes(self) -> int:
        rows = self.cache.shape[2] if self.cache is not None else self.max_batch
        return self.n_layers * 2 * rows * self.n_kv * self.cache_len * self.head_dim * self.dtype.itemsize

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step reads from the model (parameters, buffers, fused weights)."""
        out = list(self.model.parameters()) + list(self.model.buffers())
        for p in self.proj:
            out += p.tensors()
        return out

    def check_weights(self) -> bool:
        """Raise if the weights are released; re-fuse where a parameter left its fused storage (returns
        True then: the addresses changed)."""
        for name, p in self.model.named_parameters():
            if p.untyped_storage().nbytes() == 0 and p.numel() > 0:
                raise RuntimeError(f"the rollout model's weights are released ({name} has no storage); "
                                   "call models.restore_weights and sync the weights before generating")
        stale = [p for p in self.proj if not p.intact()]
        for p in stale:
            p.refuse()
        return bool(stale)

    # ---- pieces of a layer the backends share --------------------------------------------------------------------------------

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding of q and k together, in place in the q/k columns of qkv (..., N).
        HF: q * cos + rotate_half(q) * sin, the products and the sum each rounded in the compute dtype."""
        qk = qkv[..., :self.q_width + self.kv_width].unflatten(-1, (-1, self.head_dim))
        half = self.head_dim // 2
        r = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        r.mul_(sin)
        qk.mul_(cos).add_(r)

    def mlp_hidden(self, x: torch.Tensor, proj, ln2, eps2) -> torch.Tensor:
        """act(gate) * up of the normed rows: the down projection's input."""
        gate, up = proj.gate_up(rms_norm(x, ln2, eps2))
        return self.act(gate) * up

    def _mlp_in(self, x: torch.Tensor, proj, ln2, eps2) -> torch.Tensor:
        return proj.down(self.mlp_hidden(x, proj, ln2, eps2))

    # ---- prefill and decode -----------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """ids: (B, W) left-padded prompts; start: (B,) first real column. Writes cache columns [0, W)
        of cache rows `rows` (B,) (default: rows [0, B)) and returns the fp32 logits of the last column,
        (B, vocab). Runs eagerly."""
        B, W = ids.shape
        assert self.cache is not None and B <= self.max_batch and W <= self.max_seq_len
        dst = slice(0, B) if rows is None else rows
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        cols = self.cols[:W]
        pos = (cols[None, :] - start[:, None]).clamp(min=0)                     # (B, W)
        cos, sin = F.embedding(pos, self.cos)[:, :, None], F.embedding(pos, self.sin)[:, :, None]   # (B, W, 1, D)
        # Causal, and pad keys hidden; a pad query sees itself so its (unused) row stays finite.
        allowed = (cols[None, :] <= cols[:, None])[None] & (
            (cols[None, None, :] >= start[:, None, None]) | torch.eye(W, dtype=torch.bool, device=ids.device)[None])
        allowed = allowed[:, None]                                               # (B, 1, W, W)
        x = self.embed(ids)
        for i, proj in enumerate(self.proj):
            ln1, eps1, ln2, eps2 = self.norms[i]
            qkv = proj.qkv(rms_norm(x, ln1, eps1))                              # (B, W, N)
            self.rotate(qkv, cos, sin)
            q = qkv[..., :self.q_width].view(B, W, H, D).transpose(1, 2)         # (B, H, W, D)
            kvn = qkv[..., self.q_width:].view(B, W, 2, KVH, D).permute(2, 0, 3, 1, 4)   # (2, B, KVH, W, D)
            self.cache[i, :, dst, :, :W] = kvn
            k, v = kvn[0], kvn[1]
            o = sdpa(q, k, v, allowed, self.scaling, self.group > 1)
            x = x + proj.o(o.transpose(1, 2).reshape(B, W, -1))
            x = x + self._mlp_in(x, proj, ln2, eps2)
        return self._logits(x[:, -1])

    def copy_rows(self, src: list[int], dst: list[int], width: int) -> None:
        """Cache columns [0, width) of row src[i] into row dst[i], for every layer (the prompt a group of
        samples shares, computed once)."""
        for a, b in zip(src, dst):
            if a != b:
                self.cache[:, :, b, :, :width] = self.cache[:, :, a, :, :width]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.final_norm.weight, self.final_norm.variance_epsilon)
        return self.lm_head(x).float()   # tied models share the embedding Parameter itself

    def decode(self, tok: torch.Tensor, col: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One token per row. tok: (B,) inputs; col: (1,) cache column they go to (all rows share it);
        start: (B,). Returns fp32 logits (B, vocab). No host synchronisation, fixed shapes and
        addresses: safe to capture in a CUDA graph and replay with tok/col/start updated in place."""
        B, be = tok.shape[0], self.backend
        pos = col - start                                                               # (B,)
        cos, sin = F.embedding(pos, self.cos)[:, None], F.embedding(pos, self.sin)[:, None]   # (B, 1, D)
        hide = be.mask(start, col)   # what the layers read to hide the columns a row does not see
        x, d = be.first(self.embed(tok))
        for i, proj in enumerate(self.proj):
            x, d = be.layer(x, d, proj, *self.norms[i], self.cache[i, :, :B], cos, sin, hide, col)
        return self._logits(be.last(x, d))
