"""A llama-family decoder written against a static KV cache, reading an HF model's own weights
(llama, mistral, qwen2, qwen3 and gemma3_text: `arch.py` says how they differ).

HF's forward builds masks and cache objects in Python and synchronises with the host on the way;
this one does neither in the decode step, so `torch.cuda.CUDAGraph` can capture it (plain graphs,
no torch.compile needed: Pascal, CC 6.x, has no Triton). The math follows `modeling_llama.py` /
`modeling_qwen3.py` / `modeling_gemma3.py` op for op (RMSNorm in fp32, rotary tables computed as HF computes them from the
model's own inverse frequencies, grouped-query attention, the module's own activation), so greedy
output equals HF `generate`.
A layer's projections go through a small object (`projections.py`): fused q/k/v and gate/up
matmuls over plain weights, or the modules themselves (LoRA adapters, quantized layers). The decode
step's layers run through a backend (`plan.decode_backend`), one file each beside this one:
`decode_torch.py` (torch's ops), `decode_triton_attention.py`, `decode_triton_layers.py` and
`decode_cuda_c.py`, named in decode_backends.py's `DECODE_BACKENDS`; what a backend is handed and provides is
decode_step.py's `LayerStep` and `DecodeBackend`. The prefill is the same torch code for all of them.

A decode step for a few rows is bound by the number of kernels, not by the weight reads, so the
step avoids kernels that do no arithmetic HF would not do: rotary on q and k in one pass with the
sign folded into the sin table, k and v written to the cache by one copy, no casts around the norm
and softmax where the kernel computes in fp32 anyway.

Left padding as HF does it: every prompt of a batch ends at column W-1; row b's first real token
sits at column `start[b]`, and its position ids count from there (`column - start[b]`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .arch import UnsupportedModel, check_supported, describe
from .decode_step import BackendClass, CacheOverflow, DecodeKernelUnavailable, LayerStep, sdpa
from .projections import make_projections

__all__ = ["StaticDecoder", "CacheOverflow", "DecodeKernelUnavailable", "sdpa", "UnsupportedModel"]


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
    (see `projections.py`). backend: the class of the decode step's layers (decode_backends.DECODE_BACKENDS
    holds one per value of `plan.decode_backend`), built on this decoder; it raises DecodeKernelUnavailable,
    saying why, where it cannot run."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int, *, backend: BackendClass,
                 projections: str = "auto", cache_dtype: torch.dtype | None = None) -> None:
        model = _unwrap(model)
        check_supported(model)
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
        # a backend's own matmul for the logits where lm_head is a plain nn.Linear (None: lm_head's own forward)
        self.head_mm = None
        self.arch = describe(model, self.head_dim)
        self.norm = self.arch.norm   # the model's RMS norm (llama's, or Gemma's (1 + weight) form)
        self.proj, self.proj_note = make_projections(layers, projections)
        emb = self.embed.weight
        self.device, self.dtype = emb.device, emb.dtype
        self.ropes = [self._rope_table(inv, scale) for inv, scale in self.arch.ropes]   # [(cos, sin)] per table
        self.cols = torch.arange(self.cache_len, device=self.device)       # (S,)
        self.cache: torch.Tensor | None = None
        # The KV cache's storage: the compute dtype, or fp16 under fp32 (`plan.kv_cache_dtype`: half the bytes a
        # long decode step reads; the arithmetic stays fp32). Then every written key and value is checked against
        # fp16's range: `overflow` (int32, on the device) becomes 1, and `check_cache` raises after the rollout.
        self.cache_dtype = cache_dtype or self.dtype
        self.overflow = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.backend = backend(self)
        if self.cache_dtype != self.dtype and self.cache_dtype not in getattr(self.backend, "cache_dtypes", {}).get(
                self.dtype, ()):
            raise DecodeKernelUnavailable(
                f"decode backend '{self.backend.name}' reads the KV cache in the compute dtype ({self.dtype}); a "
                f"{self.cache_dtype} cache under it needs decode backend cuda-c (set plan.kv_cache_dtype to the "
                "compute dtype)")

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

    def allocate(self, rows: int | None = None) -> None:
        """(layers, 2, rows, KVH, S, D), rows at most max_batch (default): what the batch needs. Zeroed: masked
        columns get weight 0, and 0 * NaN from uninitialised memory would still poison the weighted sum over V.
        A cache with fewer rows than asked for is replaced (captured graphs must then be dropped)."""
        rows = min(rows or self.max_batch, self.max_batch)
        if self.cache is None or self.cache.shape[2] < rows:
            self.cache = None
            self.cache = torch.zeros((self.n_layers, 2, rows, self.n_kv, self.cache_len, self.head_dim),
                                     device=self.device, dtype=self.cache_dtype)

    def free(self) -> None:
        self.cache = None

    def cache_bytes(self) -> int:
        rows = self.cache.shape[2] if self.cache is not None else self.max_batch
        return self.n_layers * 2 * rows * self.n_kv * self.cache_len * self.head_dim * self.cache_dtype.itemsize

    @property
    def narrow_cache(self) -> bool:
        """The cache is stored in fewer bits than the compute dtype (fp16 under fp32)."""
        return self.cache_dtype.itemsize < self.dtype.itemsize

    def _guard(self, kvn: torch.Tensor) -> None:
        """Note (on the device, no sync) a key or value a narrow cache cannot hold: past fp16's range, or not
        finite."""
        if self.narrow_cache:
            self.overflow.bitwise_or_((~(kvn.abs() <= torch.finfo(self.cache_dtype).max)).any().to(torch.int32))

    def check_cache(self) -> None:
        """Raise where a key or value written since the last check did not fit the cache's storage (one sync)."""
        if self.narrow_cache and int(self.overflow.item()):
            self.overflow.zero_()
            raise CacheOverflow(
                f"a key or value of this rollout is past {str(self.cache_dtype).split('.')[-1]}'s range "
                f"({torch.finfo(self.cache_dtype).max:g}) or not finite, and the KV cache stores "
                f"{str(self.cache_dtype).split('.')[-1]}: set plan.kv_cache_dtype=fp32 (the cache in the compute "
                "dtype: twice its memory, and a long decode step reads more)")

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step reads from the model (parameters, buffers, fused weights)."""
        out = list(self.model.parameters()) + list(self.model.buffers())
        for p in self.proj:
            out += p.tensors()
        return out

    def check_weights(self) -> bool:
        """Raise if the weights are released; re-fuse where a parameter left its fused storage (returns
        True then: the addresses changed); copy the trained adapters into their stacked copies (LoRA groups)."""
        for name, p in self.model.named_parameters():
            if p.untyped_storage().nbytes() == 0 and p.numel() > 0:
                raise RuntimeError(f"the rollout model's weights are released ({name} has no storage); "
                                   "call models.restore_weights and sync the weights before generating")
        stale = [p for p in self.proj if not p.intact()]
        for p in stale:
            p.refuse()
        for p in self.proj:   # stacked LoRA adapters (ModuleProjections.groups) from the trained ones
            p.sync()
        return bool(stale)

    def fused_norms_reason(self) -> str:
        """Why layer kernels that fuse llama's RMS norms (triton-layers, cuda-c) cannot run this model's
        layers, or "": its architecture's row (plan/archs.py), which the plan reads too."""
        return self.arch.row.fused_norms_reason()

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
        gate, up = proj.gate_up(self.norm(x, ln2, eps2))
        return self.act(gate) * up

    def _mlp_in(self, x: torch.Tensor, proj, ln2, eps2) -> torch.Tensor:
        return proj.down(self.mlp_hidden(x, proj, ln2, eps2))

    def qk_norm(self, qkv: torch.Tensor, qk) -> None:
        """Qwen3 and Gemma 3: an RMS norm over each query and key head (q_norm, k_norm), in place in the q and
        k columns of qkv (..., N), before the rotary embedding."""
        qn, kn, eps = qk
        q = qkv[..., :self.q_width].unflatten(-1, (self.n_heads, self.head_dim))
        k = qkv[..., self.q_width:self.q_width + self.kv_width].unflatten(-1, (self.n_kv, self.head_dim))
        q.copy_(self.norm(q, qn, eps))
        k.copy_(self.norm(k, kn, eps))

    # ---- prefill and decode -----------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """ids: (B, W) left-padded prompts; start: (B,) first real column. Writes cache columns [0, W)
        of cache rows `rows` (B,) (default: rows [0, B)) and returns the fp32 logits of the last column,
        (B, vocab). Runs eagerly."""
        B, W = ids.shape
        assert self.cache is not None and B <= self.max_batch and W <= self.max_seq_len
        dst = slice(0, B) if rows is None else rows
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
        for i, (proj, lay) in enumerate(zip(self.proj, self.arch.layers)):
            def cached(kvn, i=i):   # the prompt's K and V go to the cache; its queries attend to them
                self._guard(kvn)
                self.cache[i, :, dst, :, :W] = kvn.to(self.cache_dtype)
                return kvn
            x = self._eager_layer(x, proj, lay, tables, masks, cached)
        return self._logits(x[:, -1])

    def _eager_layer(self, x: torch.Tensor, proj, lay, tables, masks, cached) -> torch.Tensor:
        """One layer over M new columns of B rows (x: (B, M, hidden)), eagerly, for the prefill and `extend`:
        `cached(kvn)` puts their K and V (2, B, KVH, M, D) in the cache and returns the K and V the new columns
        attend over."""
        B, M = x.shape[:2]
        qkv = proj.qkv(self.norm(x, lay.ln1, lay.eps1))                          # (B, M, N)
        if lay.qk is not None:
            self.qk_norm(qkv, lay.qk)
        self.rotate(qkv, *tables[lay.rope])
        q = qkv[..., :self.q_width].view(B, M, self.n_heads, self.head_dim).transpose(1, 2)    # (B, H, M, D)
        kvn = qkv[..., self.q_width:].view(B, M, 2, self.n_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        kv = cached(kvn)
        o = sdpa(q, kv[0], kv[1], masks[lay.window], self.scaling, self.group > 1)
        a = proj.o(o.transpose(1, 2).reshape(B, M, -1))
        x = x + (a if lay.post is None else self.norm(a, lay.post[0], lay.post[2]))
        m = self._mlp_in(x, proj, lay.ln2, lay.eps2)
        return x + (m if lay.post is None else self.norm(m, lay.post[1], lay.post[2]))

    def extend(self, ids: torch.Tensor, start: torch.Tensor, col0: int, fresh: torch.Tensor,
               row0: int = 0) -> torch.Tensor:
        """Append tokens to rows [row0, row0 + B) of the cache: ids (B, M) go to columns [col0, col0 + M), where fresh
        (B, M) bool is True; elsewhere the window holds what the row already has (its cached K and V stay,
        and its ids there are ignored). start: (B,) each row's first real column. The new tokens attend to
        the row's columns [start, their own]; returns the fp32 logits of column col0 + M - 1 (B, vocab).
        The prefill of what follows a turn in an episode (the tools' results): the cache then holds what a
        prefill of the whole conversation would. Runs eagerly."""
        B, M = ids.shape
        W = col0 + M
        assert self.cache is not None and row0 + B <= self.cache.shape[2] and W <= self.cache_len
        rows = slice(row0, row0 + B)
        cols, keys = self.cols[col0:W], self.cols[:W]
        pos = (cols[None, :] - start[:, None]).clamp(min=0)                     # (B, M)
        tables = [(F.embedding(pos, c)[:, :, None], F.embedding(pos, s)[:, :, None]) for c, s in self.ropes]
        own = (keys[None, :] == cols[:, None])[None]                              # (1, M, W)
        allowed = ((keys[None, :] <= cols[:, None])[None] & (keys[None, None, :] >= start[:, None, None])) | own
        masks = {None: allowed[:, None]}                                          # (B, 1, M, W)
        for w in self.arch.windows:
            masks[w] = (allowed & ((cols[:, None] - keys[None, :] < w)[None] | own))[:, None]
        keep = fresh[None, :, None, :, None]                                      # (1, B, 1, M, 1)
        x = self.embed(ids)
        for i, (proj, lay) in enumerate(zip(self.proj, self.arch.layers)):
            def cached(kvn, i=i):   # fresh columns written, the others kept; the new tokens attend to [0, W)
                self._guard(kvn)
                window = self.cache[i, :, rows, :, col0:W]
                window.copy_(torch.where(keep, kvn.to(window.dtype), window))
                return self.cache[i, :, rows, :, :W].to(self.dtype)
            x = self._eager_layer(x, proj, lay, tables, masks, cached)
        return self._logits(x[:, -1])

    def move_columns(self, src: int, dst: int, first: int, n: int, to: int) -> None:
        """Columns [first, first + n) of cache row `src` to columns [to, to + n) of row `dst`, layer by layer
        (a layer's slice at a time in temporary memory). K and V carry their rotary position, which a row
        keeps when its start column moves by the same amount."""
        if n <= 0 or (src == dst and first == to):
            return
        for i in range(self.cache.shape[0]):
            self.cache[i, :, dst, :, to:to + n] = self.cache[i, :, src, :, first:first + n].clone()

    def copy_rows(self, src: list[int], dst: list[int], width: int) -> None:
        """Cache columns [0, width) of row src[i] into row dst[i], for every layer (the prompt a group of
        samples shares, computed once)."""
        for a, b in zip(src, dst):
            if a != b:
                self.cache[:, :, b, :, :width] = self.cache[:, :, a, :, :width]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.final_norm
        x = self.norm(x, norm.weight, getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        head = self.lm_head   # tied models share the embedding Parameter itself
        mm = self.head_mm if type(head) is nn.Linear else None
        logits = mm(x, head.weight, head.bias) if mm is not None else head(x)
        cap = self.arch.final_softcap
        if cap is not None:   # Gemma's final_logit_softcapping, in the compute dtype as HF computes it
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def decode(self, tok: torch.Tensor, col: torch.Tensor, start: torch.Tensor,
               span: int | None = None) -> torch.Tensor:
        """One token per row. tok: (B,) inputs; col: (1,) cache column they go to (all rows share it);
        start: (B,); span: the cache columns a backend that reads a span (`reads_span`) attends over, a
        multiple of 16 above col (default: the whole cache). Returns fp32 logits (B, vocab). No host
        synchronisation, fixed shapes and addresses: safe to capture in a CUDA graph and replay with
        tok/col/start updated in place, while col stays below the span."""
        B, be = tok.shape[0], self.backend
        S = min(span or self.cache_len, self.cache_len) if be.reads_span else self.cache_len
        pos = col - start                                                               # (B,)
        tables = [(F.embedding(pos, c)[:, None], F.embedding(pos, s)[:, None]) for c, s in self.ropes]  # (B, 1, D)
        # what the layers read to hide the columns a row does not see: one per attention span, from each row's
        # first visible column (a sliding-window layer sees columns col - window + 1 .. col)
        hide = {None: be.hide(start, col, S)}
        for w in self.arch.windows:
            hide[w] = be.hide(torch.maximum(start, col - (w - 1)), col, S)
        x, d = be.first(self.embed(tok))
        for i, (proj, lay) in enumerate(zip(self.proj, self.arch.layers)):
            x, d = be.layer(x, d, LayerStep(proj, lay, self.cache[i, :, :B, :, :S], *tables[lay.rope],
                                            hide[lay.window], col))
        return self._logits(be.last(x, d))
