"""A llama-family decoder written against a static KV cache, reading an HF model's own weights.

HF's forward builds masks and cache objects in Python and synchronises with the host on the way;
this one does neither in the decode step, so `torch.cuda.CUDAGraph` can capture it (plain graphs,
no torch.compile needed: Pascal, CC 6.x, has no Triton). The math follows `modeling_llama.py` /
`modeling_qwen2.py` op for op (RMSNorm in fp32, rotary tables computed as HF computes them from the
model's own inverse frequencies, grouped-query attention, the module's own activation), so greedy
output equals HF `generate`.
A layer's projections go through a small object (`projections.py`): fused q/k/v and gate/up
matmuls over plain weights, or the modules themselves (LoRA adapters, quantized layers).

A decode step for a few rows is bound by the number of kernels, not by the weight reads, so the
step avoids kernels that do no arithmetic HF would not do: rotary on q and k in one pass with the
sign folded into the sin table, k and v written to the cache by one copy, no casts around the norm
and softmax where the kernel computes in fp32 anyway.

Left padding as HF does it: every prompt of a batch ends at column W-1; row b's first real token
sits at column `start[b]`, and its position ids count from there (`column - start[b]`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .projections import make_projections

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ATTENTIONS = ("auto", "bmm", "sdpa", "triton", "triton_rope", "cuda")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at init
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA = _TORCH >= (2, 5)  # `enable_gqa=` of scaled_dot_product_attention


def _sdpa(q, k, v, mask, scale, gqa: bool):
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
    """The decode-attention kernel asked for cannot run here (the message says why)."""


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
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
    (see `projections.py`). attention: how a decode step attends, 'bmm' (baddbmm, softmax, bmm: plain
    kernels every GPU has), 'sdpa' (one scaled_dot_product_attention call, its fused kernel where the
    device has one), 'triton' (edgerl's decode-attention kernel, `kernels/decode_attention.py`: reads
    only the columns each row sees; CUDA CC >= 7.0 with triton), 'triton_rope' (the same kernel doing
    the rotary embedding, the cache write and the query's copy too: three kernels fewer per layer, the
    plan's choice where the kernel runs), 'cuda' (fp32, any CUDA GPU NVRTC builds for, Pascal included:
    `kernels/decode_cuda.py` does the rotary embedding, the cache write and attention over the columns
    each row sees in one kernel, and the layer's residual adds with its RMS norms and SiLU * up in
    three more, about 18 kernels fewer per layer) or 'auto': bmm in fp32, sdpa in 16 bits. A 16-bit baddbmm
    rounds the scores to 16 bits before the softmax, where HF's SDPA forward (what training runs) keeps
    them in fp32: measured on the H200 in bf16 (docs/benchmarks.md), bmm agreed with HF's argmax on
    54-60% of tokens, sdpa on 76-83%, as HF generate itself does (83-87%)."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int, *,
                 projections: str = "auto", attention: str = "auto") -> None:
        model = _unwrap(model)
        check_supported(model, max_seq_len)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTIONS))}, got {attention!r}")
        if attention == "auto":
            attention = "bmm" if model.model.embed_tokens.weight.dtype == torch.float32 else "sdpa"
        cfg = model.config
        self.model, self.attention = model, attention
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
        self.act = layers[0].mlp.act_fn   # one object for every layer, so a compiled layer is compiled once
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
        self.attend = None
        if attention in ("triton", "triton_rope"):
            from ..kernels.decode_attention import attention_op, attention_rope_op, unavailable_reason
            why = unavailable_reason(self.device, self.head_dim, self.dtype, self.group)
            if why:
                raise DecodeKernelUnavailable(f"decode attention {attention!r} cannot run here: {why}; use 'sdpa' or "
                                              "'bmm'")
            # the op itself: a compiled layer calls it without a module lookup
            self.attend = attention_op() if attention == "triton" else attention_rope_op()
        elif attention == "cuda":
            from ..kernels import decode_cuda
            why = decode_cuda.unavailable_reason(self.device, self.head_dim, self.dtype, self.group)
            if why:
                raise DecodeKernelUnavailable(f"decode attention 'cuda' cannot run here: {why}; use 'bmm' or 'sdpa'")
            self.kernels = decode_cuda
            self.attend = decode_cuda.rope_attend
        self.cache: torch.Tensor | None = None
        self.split_k = 0   # o and down as S-way split-K products (see `set_split_k`); 0: one matmul each
        self.linear = None   # kernels/decode_linear.py's launcher under `set_triton_layers`
        # the engine swaps in a compiled one under compile_step
        self.layer_step = self._decode_layer_cuda if attention == "cuda" else self._decode_layer
        self.compiled = False

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

    def split_k_reason(self, parts: int) -> str | None:
        """Why the decode step's o and down products cannot run as `parts`-way split-K products, or None."""
        if any(p.kind != "fused" for p in self.proj):
            return f"it reads the fused projections' plain weights ({self.proj_note})"
        if self.attention == "cuda":
            return "decode attention 'cuda' runs its own layer kernels"
        if self.linear is not None:
            return "the Triton layers add the o and down products to the residual stream inside their kernels"
        if any(p.o_b is not None or p.down_b is not None for p in self.proj):
            return "the o or down projection has a bias"
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"{self.dtype} is not fp32, bf16 or fp16"
        if self.dtype != torch.float32 and "dtype" not in torch.ops.aten.bmm.overloads():
            return f"torch {torch.__version__} has no bmm with fp32 output from 16-bit inputs (torch >= 2.8 has)"
        inner = self.proj[0].o_w.shape[1], self.proj[0].down_w.shape[1]
        if parts < 2 or any(k % (8 * parts) for k in inner):
            return f"inner widths {inner} do not split into {parts} parts of whole 8-element groups"
        return None

    def set_split_k(self, parts: int) -> None:
        """The decode step's o and down products as `parts` batched products over slices of their inner
        dimension, with fp32 partials (`torch.bmm(out_dtype=float32)` in 16 bits), summed by the kernel that
        adds them to the residual (Inductor fuses the sum into the residual add + RMS norm): more thread
        blocks for these short-and-wide products than cuBLAS gives them, and no split-K reduction kernel of
        its own. The sum rounds once, where F.linear's output rounds. 0 turns it off."""
        if parts and (why := self.split_k_reason(parts)):
            raise ValueError(f"split_k={parts} cannot run: {why}")
        self.split_k = parts

    def triton_layers_reason(self) -> str | None:
        """Why the decode step's layers cannot run as `kernels/decode_linear.py`'s fused projections, or None."""
        if any(p.kind != "fused" for p in self.proj):
            return f"they read the fused projections' weights ({self.proj_note})"
        if self.attention != "triton_rope":
            return f"they run with decode attention 'triton_rope' (its rotary and cache write), not {self.attention!r}"
        if not self.silu:
            return "the MLP's activation is not SiLU (the kernel's gate/up epilogue computes SiLU(gate) * up)"
        from ..kernels.decode_linear import unavailable_reason
        return unavailable_reason(self.device, self.dtype)

    def set_triton_layers(self) -> None:
        """Run each decode layer as five kernels: the RMS norm fused into the q/k/v product, the rotary
        attention kernel, the o product with the residual add, the norm fused into the gate/up product with
        SiLU(gate) * up as its epilogue, and the down product with the residual add (`_decode_layer_triton`),
        each rounded where HF's ops round. Raises ValueError with the reason where it cannot run."""
        if why := self.triton_layers_reason():
            raise ValueError(f"the Triton decode layers cannot run: {why}")
        from ..kernels.decode_linear import decode_linear
        self.linear = decode_linear
        self.layer_step = self._decode_layer_triton

    def _partials(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (B, K) @ w (N, K)^T as split_k fp32 partial products (S, B, N) over K / S slices (views, no copy)."""
        S, (B, K), N = self.split_k, x.shape, w.shape[0]
        a = x.view(B, S, K // S).transpose(0, 1)                                          # (S, B, K/S)
        b = w.view(N, S, K // S).permute(1, 2, 0)                                         # (S, K/S, N)
        return torch.bmm(a, b) if x.dtype == torch.float32 else torch.bmm(a, b, out_dtype=torch.float32)

    def _plus(self, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x + d, where d may be split-K partials (S, B, N) in fp32: summed one by one (elementwise, so a
        compiled layer fuses the sum into the add) and rounded once to the compute dtype."""
        if d.dim() == x.dim():
            return x + d
        total = d[0]
        for i in range(1, d.shape[0]):
            total = total + d[i]
        return x + total.to(x.dtype)

    # ---- one layer --------------------------------------------------------------------------------

    def _rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding of q and k together, in place in the q/k columns of qkv (..., N).
        HF: q * cos + rotate_half(q) * sin, the products and the sum each rounded in the compute dtype."""
        qk = qkv[..., :self.q_width + self.kv_width].unflatten(-1, (-1, self.head_dim))
        half = self.head_dim // 2
        r = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        r.mul_(sin)
        qk.mul_(cos).add_(r)

    def _mlp_hidden(self, x: torch.Tensor, proj, ln2, eps2) -> torch.Tensor:
        """act(gate) * up of the normed rows: the down projection's input."""
        gate, up = proj.gate_up(_rms_norm(x, ln2, eps2))
        return self.act(gate) * up

    def _mlp_in(self, x: torch.Tensor, proj, ln2, eps2) -> torch.Tensor:
        return proj.down(self._mlp_hidden(x, proj, ln2, eps2))

    def _decode_layer(self, x, d, proj, ln1, eps1, ln2, eps2, kv, cos, sin, bias, col):
        """x: (B, hidden) residual stream; d: the previous layer's MLP output, not yet added (None for the
        first layer), so a compiled layer fuses that add with this layer's norm. kv: this layer's cache
        (2, B, KVH, S, D); cos, sin: (B, 1, D); bias: additive mask (the rows' start columns (B,) for
        'triton' attention, which masks by them); col: (1,). Returns (x, d)."""
        if d is not None:
            x = self._plus(x, d)
        B = x.shape[0]
        qkv = proj.qkv(_rms_norm(x, ln1, eps1))                                     # (B, N)
        if self.attention == "triton_rope":   # rotary, the cache write and attention in one kernel
            o = self.attend(qkv, cos.view(B, -1), sin.view(B, -1), kv[0], kv[1], bias, col, self.scaling,
                            self.group)
        else:
            o = self._attend_cache(qkv, kv, cos, sin, bias, col)
        # under split-K the o partials are summed into this add, the down partials into the next layer's (d)
        o = o.reshape(B, self.q_width)
        x = self._plus(x, self._partials(o, proj.o_w) if self.split_k else proj.o(o))
        h = self._mlp_hidden(x, proj, ln2, eps2)
        return x, (self._partials(h, proj.down_w) if self.split_k else proj.down(h))

    def _decode_layer_triton(self, x, d, proj, ln1, eps1, ln2, eps2, kv, cos, sin, start, col):
        """`_decode_layer` as five kernels (`set_triton_layers`). Each product's epilogue adds it to the residual
        stream itself, so d is not a product to add: it is x's rows' sums of squares as (P, B) fp32 partial
        sums, which the products that add to the residual stream write for the norm that reads it next.
        Returns (x, d) for the next layer."""
        B, lin = x.shape[0], self.linear
        qkv = lin(x, proj.qkv_w, norm=ln1, eps=eps1, bias=proj.qkv_b, sumsq=d)
        o = self.attend(qkv, cos.view(B, -1), sin.view(B, -1), kv[0], kv[1], start, col, self.scaling, self.group)
        x, ss = lin(o.view(B, self.q_width), proj.o_w, bias=proj.o_b, residual=x, return_sumsq=True)
        h = lin(x, proj.gu_w, norm=ln2, eps=eps2, bias=proj.gu_b, glu=True, sumsq=ss)
        return lin(h, proj.down_w, bias=proj.down_b, residual=x, return_sumsq=True)

    def _decode_layer_cuda(self, x, d, proj, ln1, eps1, ln2, eps2, kv, cos, sin, start, col):
        """`_decode_layer` through `kernels/decode_cuda.py` (attention 'cuda', fp32): the residual add and
        norm in one kernel, q, k and v straight from their projections into the rotary + cache write +
        attention kernel, the second add and norm in one, SiLU * up in one."""
        k, B = self.kernels, x.shape[0]
        x, h = k.add_rms_norm(x, d, ln1, eps1)
        q, kk, v = proj.qkv_parts(h)
        o = k.rope_attend(q, kk, v, cos.view(B, -1), sin.view(B, -1), kv[0], kv[1], start, col, self.scaling)
        x, h = k.add_rms_norm(x, proj.o(o), ln2, eps2)
        gate, up = proj.gate_up(h)
        return x, proj.down(k.silu_mul(gate, up) if self.silu else self.act(gate) * up)

    def _attend_cache(self, qkv, kv, cos, sin, bias, col):
        """The new token's rotary embedding, its k and v written into cache column col, and attention over
        the cache (sdpa, triton or bmm). Returns the output heads, (B, KVH, G, D) or (B*KVH, G, D)."""
        B = qkv.shape[0]
        self._rotate(qkv, cos, sin)
        # k and v sit side by side after q: one copy puts both in the cache column.
        kv.index_copy_(3, col, qkv[:, self.q_width:].view(B, 2, self.n_kv, 1, self.head_dim).transpose(0, 1))
        if self.attention in ("sdpa", "triton"):   # q (B, KVH, G, D): each KV head attends for its G query heads
            q = qkv[:, :self.q_width].view(B, self.n_kv, self.group, self.head_dim)
            return (self.attend(q, kv[0], kv[1], bias, col, self.scaling) if self.attend is not None
                    else _sdpa(q, kv[0], kv[1], bias, self.scaling, False))
        # GQA without repeat_kv: query heads grouped under their KV head (head h uses KV head h // G)
        BK, S, D = B * self.n_kv, self.cache_len, self.head_dim
        q = qkv[:, :self.q_width].reshape(BK, self.group, D)                            # (B*KVH, G, D)
        s = torch.baddbmm(bias, q, kv[0].reshape(BK, S, D).transpose(1, 2), alpha=self.scaling)
        # HF: softmax in fp32, then cast. A 16-bit softmax computes in fp32 and rounds once: the same
        # values, one kernel fewer.
        p = torch.softmax(s, -1, dtype=torch.float32 if s.dtype == torch.float32 else None)
        return torch.bmm(p, kv[1].reshape(BK, S, D))                                    # (B*KVH, G, D)

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
            qkv = proj.qkv(_rms_norm(x, ln1, eps1))                              # (B, W, N)
            self._rotate(qkv, cos, sin)
            q = qkv[..., :self.q_width].view(B, W, H, D).transpose(1, 2)         # (B, H, W, D)
            kvn = qkv[..., self.q_width:].view(B, W, 2, KVH, D).permute(2, 0, 3, 1, 4)   # (2, B, KVH, W, D)
            self.cache[i, :, dst, :, :W] = kvn
            k, v = kvn[0], kvn[1]
            o = _sdpa(q, k, v, allowed, self.scaling, self.group > 1)
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
        x = _rms_norm(x, self.final_norm.weight, self.final_norm.variance_epsilon)
        return self.lm_head(x).float()   # tied models share the embedding Parameter itself

    def decode(self, tok: torch.Tensor, col: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One token per row. tok: (B,) inputs; col: (1,) cache column they go to (all rows share it);
        start: (B,). Returns fp32 logits (B, vocab). No host synchronisation, fixed shapes and
        addresses: safe to capture in a CUDA graph and replay with tok/col/start updated in place."""
        B, S = tok.shape[0], self.cache_len
        pos = col - start                                                               # (B,)
        cos, sin = F.embedding(pos, self.cos)[:, None], F.embedding(pos, self.sin)[:, None]   # (B, 1, D)
        if self.attend is not None:   # the kernel masks by the rows' start columns itself
            bias = start
        else:   # one additive mask for all layers, so each layer's scores are a single baddbmm
            hidden = (self.cols[None, :] < start[:, None]) | (self.cols[None, :] > col)     # (B, S)
            zero = torch.zeros((), device=tok.device, dtype=self.dtype)
            bias = torch.where(hidden, -math.inf, zero)[:, None, None, :]                  # (B, 1, 1, S)
        if self.attention == "bmm":
            bias = bias.expand(B, self.n_kv, 1, S).reshape(B * self.n_kv, 1, S)         # (B*KVH, 1, S)
        x, d = self.embed(tok), None
        if self.linear is not None:   # the Triton layers pass the rows' sums of squares along (as d)
            d = x.float().square().sum(-1)[None]
        if self.compiled:   # every layer call then has the same signature, so it is compiled once
            x, d = torch.zeros_like(x), x
            if self.split_k:   # d as the later layers get it: S partials (the embedding and zeros), fp32
                d = torch.cat((d.float()[None], d.new_zeros((self.split_k - 1,) + d.shape, dtype=torch.float32)))
        for i, proj in enumerate(self.proj):
            x, d = self.layer_step(x, d, proj, *self.norms[i], self.cache[i, :, :B], cos, sin, bias, col)
        return self._logits(x if self.linear is not None else self._plus(x, d))
