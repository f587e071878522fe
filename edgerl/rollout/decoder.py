"""A llama-family decoder written against a static KV cache, reading an HF model's own weights
(llama, mistral, qwen2, qwen3 and gemma3_text: `arch.py` says how they differ).

HF's forward builds masks and cache objects in Python and synchronises with the host on the way;
this one does neither in the decode step, so `torch.cuda.CUDAGraph` can capture it (plain graphs,
no torch.compile needed: Pascal, CC 6.x, has no Triton). The math follows `modeling_llama.py` /
`modeling_qwen3.py` / `modeling_gemma3.py` op for op (RMSNorm in fp32, rotary tables computed as HF computes them from the
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

from .arch import (SUPPORTED, UnsupportedModel, check_supported, describe, inv_freq_for, model_inv_freq,  # noqa: F401
                   rope_parameters)
from .projections import make_projections

ATTENTIONS = ("auto", "bmm", "sdpa", "triton", "triton_rope", "cuda")
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


class DecodeKernelUnavailable(ValueError):
    """The decode-attention kernel asked for cannot run here (the message says why)."""


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
        check_supported(model)
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
        self.arch = describe(model, self.head_dim)
        self.norm = self.arch.norm   # the model's RMS norm (llama's, or Gemma's (1 + weight) form)
        # per layer: (attention-input norm, eps, MLP-input norm, eps) and (q/k norms, post norms) or None each
        self.norms = [(lay.ln1, lay.eps1, lay.ln2, lay.eps2) for lay in self.arch.layers]
        self.extras = [(lay.qk, lay.post) for lay in self.arch.layers]
        self.proj, self.proj_note = make_projections(layers, projections)
        emb = self.embed.weight
        self.device, self.dtype = emb.device, emb.dtype
        self.ropes = [self._rope_table(inv, scale) for inv, scale in self.arch.ropes]   # [(cos, sin)] per table
        self.cos, self.sin = self.ropes[0]
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
            why = decode_cuda.unavailable_reason(self.device, self.head_dim, self.dtype, self.group) or (
                f"its kernels fuse llama-style RMS norms, not {self.arch.name}'s (1 + weight) norms around attention"
                if self.arch.sandwich else None)
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

    def _rope_table(self, inv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (max_seq_len, D) in the compute dtype: the same elementwise fp32 ops as the HF rotary
        forward, for every position at once, then cast. rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2)
        exactly (negation is exact): the sign lives in the sin table, which saves a negation kernel per
        layer and step."""
        freqs = torch.arange(self.max_seq_len, dtype=torch.float)[:, None] * inv[None, :]
        emb_f = torch.cat((freqs, freqs), dim=-1)
        cos = (emb_f.cos() * scale).to(self.device, self.dtype)
        sin = (emb_f.sin() * scale).to(self.device, self.dtype)
        half = self.head_dim // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    # ---- memory and weights ---------------------------------------------------------------------

    def allocate(self) -> None:
        """(layers, 2, max_batch, KVH, S, D). Zeroed: masked columns get weight 0, and 0 * NaN from
        uninitialised memory would still poison the weighted sum over V."""
        if self.cache is None:
            self.cache = torch.zeros((self.n_layers, 2, self.max_batch, self.n_kv, self.cache_len, self.head_dim),
                                     device=self.device, dtype=self.dtype)

    def free(self) -> None:
        self.cache = None

    def cache_bytes(self) -> int:
        return (self.n_layers * 2 * self.max_batch * self.n_kv * self.cache_len * self.head_dim
                * self.dtype.itemsize)

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
        if self.arch.sandwich:
            return f"{self.arch.name} norms the o and down products before the residual add"
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
        if self.arch.sandwich:
            return f"the kernels fuse llama-style RMS norms, not {self.arch.name}'s (1 + weight) norms around attention"
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
        gate, up = proj.gate_up(self.norm(x, ln2, eps2))
        return self.act(gate) * up

    def _mlp_in(self, x: torch.Tensor, proj, ln2, eps2) -> torch.Tensor:
        return proj.down(self._mlp_hidden(x, proj, ln2, eps2))

    def _qk_norm(self, qkv: torch.Tensor, qk) -> None:
        """Qwen3 and Gemma 3: an RMS norm over each query and key head (q_norm, k_norm), in place in the q and
        k columns of qkv (..., N), before the rotary embedding."""
        qn, kn, eps = qk
        q = qkv[..., :self.q_width].unflatten(-1, (self.n_heads, self.head_dim))
        k = qkv[..., self.q_width:self.q_width + self.kv_width].unflatten(-1, (self.n_kv, self.head_dim))
        q.copy_(self.norm(q, qn, eps))
        k.copy_(self.norm(k, kn, eps))

    def _decode_layer(self, x, d, proj, ln1, eps1, ln2, eps2, kv, cos, sin, bias, col, qk=None, post=None):
        """x: (B, hidden) residual stream; d: the previous layer's MLP output, not yet added (None for the
        first layer), so a compiled layer fuses that add with this layer's norm. kv: this layer's cache
        (2, B, KVH, S, D); cos, sin: (B, 1, D); bias: additive mask (the rows' first visible columns (B,) for
        the kernels, which mask by them); col: (1,). qk: the q/k norms or None; post: Gemma's post-attention
        and post-MLP norms (weights, eps) or None. Returns (x, d)."""
        if d is not None:
            x = self._plus(x, d)
        B = x.shape[0]
        qkv = proj.qkv(self.norm(x, ln1, eps1))                                     # (B, N)
        if qk is not None:
            self._qk_norm(qkv, qk)
        if self.attention == "triton_rope":   # rotary, the cache write and attention in one kernel
            o = self.attend(qkv, cos.view(B, -1), sin.view(B, -1), kv[0], kv[1], bias, col, self.scaling,
                            self.group)
        else:
            o = self._attend_cache(qkv, kv, cos, sin, bias, col)
        o = o.reshape(B, self.q_width)
        if post is not None:   # Gemma: each block's output normed before its residual add (no split-K here)
            x = x + self.norm(proj.o(o), post[0], post[2])
            return x, self.norm(proj.down(self._mlp_hidden(x, proj, ln2, eps2)), post[1], post[2])
        # under split-K the o partials are summed into this add, the down partials into the next layer's (d)
        x = self._plus(x, self._partials(o, proj.o_w) if self.split_k else proj.o(o))
        h = self._mlp_hidden(x, proj, ln2, eps2)
        return x, (self._partials(h, proj.down_w) if self.split_k else proj.down(h))

    def _decode_layer_triton(self, x, d, proj, ln1, eps1, ln2, eps2, kv, cos, sin, start, col, qk=None, post=None):
        """`_decode_layer` as five kernels (`set_triton_layers`; one more where q/k norms sit between the
        projection and the attention kernel). Each product's epilogue adds it to the residual
        stream itself, so d is not a product to add: it is x's rows' sums of squares as (P, B) fp32 partial
        sums, which the products that add to the residual stream write for the norm that reads it next.
        Returns (x, d) for the next layer."""
        B, lin = x.shape[0], self.linear
        qkv = lin(x, proj.qkv_w, norm=ln1, eps=eps1, bias=proj.qkv_b, sumsq=d)
        if qk is not None:
            self._qk_norm(qkv, qk)
        o = self.attend(qkv, cos.view(B, -1), sin.view(B, -1), kv[0], kv[1], start, col, self.scaling, self.group)
        x, ss = lin(o.view(B, self.q_width), proj.o_w, bias=proj.o_b, residual=x, return_sumsq=True)
        h = lin(x, proj.gu_w, norm=ln2, eps=eps2, bias=proj.gu_b, glu=True, sumsq=ss)
        return lin(h, proj.down_w, bias=proj.down_b, residual=x, return_sumsq=True)

    def _decode_layer_cuda(self, x, d, proj, ln1, eps1, ln2, eps2, kv, cos, sin, start, col, qk=None, post=None):
        """`_decode_layer` through `kernels/decode_cuda.py` (attention 'cuda', fp32): the residual add and
        norm in one kernel, q, k and v straight from their projections into the rotary + cache write +
        attention kernel, the second add and norm in one, SiLU * up in one."""
        k, B = self.kernels, x.shape[0]
        x, h = k.add_rms_norm(x, d, ln1, eps1)
        q, kk, v = proj.qkv_parts(h)
        if qk is not None:   # Qwen3's per-head norms, before the kernel rotates
            q = self.norm(q.unflatten(-1, (self.n_heads, self.head_dim)), qk[0], qk[2]).flatten(-2)
            kk = self.norm(kk.unflatten(-1, (self.n_kv, self.head_dim)), qk[1], qk[2]).flatten(-2)
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
        tables = [(F.embedding(pos, c)[:, :, None], F.embedding(pos, s)[:, :, None]) for c, s in self.ropes]
        # Causal, and pad keys hidden; a pad query sees itself so its (unused) row stays finite.
        own = torch.eye(W, dtype=torch.bool, device=ids.device)[None]
        allowed = (cols[None, :] <= cols[:, None])[None] & ((cols[None, None, :] >= start[:, None, None]) | own)
        # a sliding-window layer's query at column q sees the keys of columns q - window + 1 .. q
        masks = {None: allowed[:, None]}                                         # (B, 1, W, W)
        for w in self.arch.windows:
            masks[w] = (allowed & ((cols[:, None] - cols[None, :] < w)[None] | own))[:, None]
        x = self.embed(ids)
        for i, proj in enumerate(self.proj):
            ln1, eps1, ln2, eps2 = self.norms[i]
            (qk, post), lay = self.extras[i], self.arch.layers[i]
            qkv = proj.qkv(self.norm(x, ln1, eps1))                              # (B, W, N)
            if qk is not None:
                self._qk_norm(qkv, qk)
            self._rotate(qkv, *tables[lay.rope])
            q = qkv[..., :self.q_width].view(B, W, H, D).transpose(1, 2)         # (B, H, W, D)
            kvn = qkv[..., self.q_width:].view(B, W, 2, KVH, D).permute(2, 0, 3, 1, 4)   # (2, B, KVH, W, D)
            self.cache[i, :, dst, :, :W] = kvn
            k, v = kvn[0], kvn[1]
            o = _sdpa(q, k, v, masks[lay.window], self.scaling, self.group > 1)
            a = proj.o(o.transpose(1, 2).reshape(B, W, -1))
            x = x + (a if post is None else self.norm(a, post[0], post[2]))
            m = self._mlp_in(x, proj, ln2, eps2)
            x = x + (m if post is None else self.norm(m, post[1], post[2]))
        return self._logits(x[:, -1])

    def copy_rows(self, src: list[int], dst: list[int], width: int) -> None:
        """Cache columns [0, width) of row src[i] into row dst[i], for every layer (the prompt a group of
        samples shares, computed once)."""
        for a, b in zip(src, dst):
            self.cache[:, :, b, :, :width] = self.cache[:, :, a, :, :width]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.final_norm
        x = self.norm(x, norm.weight, getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        logits = self.lm_head(x)   # tied models share the embedding Parameter itself
        cap = self.arch.final_softcap
        if cap is not None:   # Gemma's final_logit_softcapping, in the compute dtype as HF computes it
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def decode(self, tok: torch.Tensor, col: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One token per row. tok: (B,) inputs; col: (1,) cache column they go to (all rows share it);
        start: (B,). Returns fp32 logits (B, vocab). No host synchronisation, fixed shapes and
        addresses: safe to capture in a CUDA graph and replay with tok/col/start updated in place."""
        B, S = tok.shape[0], self.cache_len
        pos = col - start                                                               # (B,)
        tables = [(F.embedding(pos, c)[:, None], F.embedding(pos, s)[:, None]) for c, s in self.ropes]  # (B, 1, D)
        biases = {None: start}
        for w in self.arch.windows:   # a sliding-window layer sees columns col - w + 1 .. col
            biases[w] = torch.maximum(start, col - (w - 1))
        if self.attend is None:   # one additive mask per window for all layers: each layer's scores are one baddbmm
            zero = torch.zeros((), device=tok.device, dtype=self.dtype)
            for w, first in biases.items():
                hidden = (self.cols[None, :] < first[:, None]) | (self.cols[None, :] > col)      # (B, S)
                bias = torch.where(hidden, -math.inf, zero)[:, None, None, :]                   # (B, 1, 1, S)
                if self.attention == "bmm":
                    bias = bias.expand(B, self.n_kv, 1, S).reshape(B * self.n_kv, 1, S)     # (B*KVH, 1, S)
                biases[w] = bias
        # (the kernels mask by the rows' first visible columns themselves)
        x, d = self.embed(tok), None
        if self.linear is not None:   # the Triton layers pass the rows' sums of squares along (as d)
            d = x.float().square().sum(-1)[None]
        if self.compiled:   # every layer call then has the same signature, so it is compiled once
            x, d = torch.zeros_like(x), x
            if self.split_k:   # d as the later layers get it: S partials (the embedding and zeros), fp32
                d = torch.cat((d.float()[None], d.new_zeros((self.split_k - 1,) + d.shape, dtype=torch.float32)))
        for i, proj in enumerate(self.proj):
            lay = self.arch.layers[i]
            x, d = self.layer_step(x, d, proj, *self.norms[i], self.cache[i, :, :B], *tables[lay.rope],
                                   biases[lay.window], col, *self.extras[i])
        return self._logits(x if self.linear is not None else self._plus(x, d))
