"""The trainer's attention without an L x L mask, at any sequence length.

A step's rows are left-padded prompts followed by right-padded responses. Handed to HF with its
(B, L) attention mask, transformers builds a (B, 1, L, L) boolean mask, and SDPA turns it into an
additive one in the compute dtype for every layer (4 bytes per element in fp32: 1.1 GB per layer for
4 rows of 8K tokens), which the memory-efficient kernel then keeps for its backward. So `roll_left`
shifts each row left by its padding: every row starts at column 0, padding only trails, and plain
causal attention is exact for the real tokens (no real token attends to a later column). HF then
passes no mask, and `causal_attention` runs one of SDPA's fused kernels with `is_causal` (FlashAttention
in 16 bits from sm_80, the memory-efficient kernel in fp16/fp32 from sm_50, both O(L) memory), or,
where neither serves the inputs, attends in chunks of query rows whose scores are recomputed in
the backward: memory for B x heads x chunk x L scores, never L x L.

`install()` registers the wrapper under transformers' "sdpa" name (once per process); calls with a
mask (the rollout's HF generate, a reward model) reach transformers' own SDPA function unchanged,
and packed rows (edgerl/models/packing.py) go to the packed attention.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from edgerl.models.packing import packed_attention

_ORIGINAL: dict = {}
FALLBACK_CHUNK = 256   # query rows per chunk where the plan expected a fused kernel and none serves


def roll_left(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) rows whose real tokens are one contiguous run (left-padded prompt, right-padded response)
    -> the same tokens starting at column 0 (what trails is the row's last token again: causal
    attention never lets a real token see it), and the shift of each row (B,). Raises ValueError when
    a row's real tokens are not contiguous (the layout `train.experience.pad_batch` builds)."""
    B, L = input_ids.shape
    mask = attention_mask.bool()
    lead = (mask.long().cumsum(-1) == 0).sum(-1)                               # leading padding per row
    count = mask.sum(-1)
    cols = torch.arange(L, device=input_ids.device)
    want = (cols[None] >= lead[:, None]) & (cols[None] < (lead + count)[:, None])
    if bool((want != mask).any()):
        raise ValueError("attention_mask: each row's real tokens must be one contiguous run (left-padded prompt, "
                         "right-padded response)")
    idx = (cols[None] + lead[:, None]).clamp(max=L - 1)
    return input_ids.gather(1, idx), lead


def gather_columns(hidden: torch.Tensor, first: torch.Tensor, length: int) -> torch.Tensor:
    """hidden (B, L, H) -> (B, length, H): row b's columns first[b] .. first[b] + length - 1."""
    B, _, H = hidden.shape
    idx = first[:, None] + torch.arange(length, device=hidden.device)[None]
    return hidden.gather(1, idx[..., None].expand(B, length, H))


def _repeat(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, KVH, L, D) -> (B, heads, L, D), each KV head serving heads / KVH query heads (HF's repeat_kv)."""
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, 1)


def fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> Optional[str]:
    """Which of SDPA's O(L)-memory kernels serves causal attention over these inputs here ("flash",
    "efficient"), or None (SDPA would fall back to its math backend: heads x L x L scores). On the CPU,
    SDPA's flash kernel for the CPU serves every float dtype."""
    if q.device.type != "cuda":
        return "flash" if q.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) else None
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
    try:
        params = SDPAParams(q, k, v, None, 0.0, True, gqa)
    except TypeError:   # torch before enable_gqa took no seventh argument
        if gqa:
            return None
        params = SDPAParams(q, k, v, None, 0.0, True)
    if torch.backends.cuda.flash_sdp_enabled() and can_use_flash_attention(params, False):
        return "flash"
    if torch.backends.cuda.mem_efficient_sdp_enabled() and can_use_efficient_attention(params, False):
        return "efficient"
    return None


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: Optional[float]
                     ) -> torch.Tensor:
    """Query rows first .. first + c - 1 of q (B, H, c, D) against keys 0 .. first + c - 1, causally."""
    c = q.shape[2]
    keys = torch.arange(first + c, device=q.device)
    allowed = keys[None, :] <= (first + torch.arange(c, device=q.device))[:, None]        # (c, first + c)
    return F.scaled_dot_product_attention(q, k[:, :, :first + c], v[:, :, :first + c], attn_mask=allowed, scale=scale)


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int,
                             scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of q (B, H, L, D) over k, v (B, H, L, D), `chunk` query rows at a time: each
    chunk's scores are (B, H, chunk, <= L). With gradients each chunk is checkpointed (its scores are
    recomputed in the backward), so no more than one chunk's scores exist at once. Equals
    `F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)` up to rounding."""
    L = q.shape[2]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for first in range(0, L, chunk):
        qc = q[:, :, first:first + chunk]
        if grad:
            from torch.utils.checkpoint import checkpoint
            outs.append(checkpoint(_chunk_attention, qc, k, v, first, scale, use_reentrant=False))
        else:
            outs.append(_chunk_attention(qc, k, v, first, scale))
    return torch.cat(outs, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                     chunk: int = 0, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention for rows that start at column 0 (`roll_left`): q (B, H, L, D), k and v (B, KVH, L, D)
    -> (B, H, L, D). `chunk` > 0: chunks of that many query rows (the plan's choice where SDPA has no
    O(L)-memory kernel for the compute dtype). 0: FlashAttention with the grouped K/V heads as they are,
    else the memory-efficient kernel with them repeated to the query heads (2 x B x H x L x D elements,
    what HF's own path copies), else chunks of FALLBACK_CHUNK rows."""
    heads = q.shape[1]
    if not chunk and k.shape[1] != heads and fused_kernel(q, k, v, True) == "flash":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=True)
    kr, vr = _repeat(k, heads), _repeat(v, heads)
    if not chunk and fused_kernel(q, kr, vr, False) is not None:
        return F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale, dropout_p=dropout)
    if dropout:
        raise NotImplementedError("attention dropout in chunked attention; edgerl trains with attention_dropout 0")
    return chunked_causal_attention(q, kr, vr, chunk or FALLBACK_CHUNK, scale)


def _sdpa(module, query, key, value, attention_mask, *args, edgerl_layout=None, edgerl_attention_chunk=None,
          **kwargs):
    """transformers' attention-function signature: (B, L, H, D) output and no weights."""
    if edgerl_layout is not None:
        dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
        return packed_attention(query, key, value, edgerl_layout, kwargs.get("scaling"), dropout), None
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-2:] == (1, 1) \
            and query.shape[-2] > 1:
        raise RuntimeError(
            f"{type(module).__name__} did not hand edgerl's packing layout on to its attention function; "
            "this model cannot share prompts: set plan.share_prompts=false")
    if edgerl_attention_chunk is not None and attention_mask is None and query.shape[2] == key.shape[2] > 1 \
            and getattr(module, "is_causal", True):
        dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
        out = causal_attention(query, key, value, kwargs.get("scaling"), edgerl_attention_chunk, dropout)
        return out.transpose(1, 2).contiguous(), None
    return _ORIGINAL["sdpa"](module, query, key, value, attention_mask, *args, **kwargs)


def install() -> None:
    """Register the wrapper with transformers under "sdpa" (once per process)."""
    if "sdpa" in _ORIGINAL:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    _ORIGINAL["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        from transformers import AttentionInterface
    except ImportError:   # transformers before AttentionInterface: the registry is a plain dict
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _sdpa
    else:
        AttentionInterface.register("sdpa", _sdpa)
