"""Launcher for the decode-step attention kernel (edgerl/kernels/_triton_decode_attention.py); triton is
imported only here. The kernel is registered as a torch custom op, so a torch.compile'd decoder layer
calls it as one opaque kernel and a CUDA graph captures it."""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from .tiles import (DECODE_BLOCK_S, decode_attention_head_reason, decode_attention_smem, decode_attention_stages,
                    group_pad)
from .triton_impl import _device_limits, kernel_device_reason

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_module():
    """The kernel's module, imported on first use (raises ImportError without triton)."""
    return importlib.import_module("._triton_decode_attention", __package__)


def _smem_limit(device: torch.device) -> int:
    """Shared memory per block (opt-in) of a CUDA device, as the log-prob launchers read it."""
    return _device_limits(torch.device(device))[0]


def stages_for(device: torch.device, head_dim: int, dtype: torch.dtype, group: int) -> Optional[int]:
    """The kernel's pipeline depth on this CUDA device (`tiles.decode_attention_stages`), None if even
    one stage needs more shared memory than a block may have."""
    return decode_attention_stages(_smem_limit(device), head_dim, dtype.itemsize, group_pad(group))


def unavailable_reason(device: torch.device, head_dim: int, dtype: torch.dtype, group: int = 1) -> Optional[str]:
    """Why the kernel cannot run for this device, head size, dtype and query heads per KV head, or None."""
    if not hasattr(torch.library, "custom_op"):
        return f"torch {torch.__version__} has no torch.library.custom_op (torch >= 2.4 has)"
    if dtype not in DTYPES:
        return f"{dtype} is not one of the kernel's dtypes (bf16, fp16, fp32)"
    if (why := decode_attention_head_reason(head_dim)) is not None:
        return why
    if why := kernel_device_reason(kernel_module, device, dtype):
        return why
    if device.type == "cuda" and stages_for(device, head_dim, dtype, group) is None:
        need = decode_attention_smem(head_dim, dtype.itemsize, group_pad(group), 1)
        return (f"its blocks of {DECODE_BLOCK_S} cache columns at head size {head_dim} in {dtype} need "
                f"{need // 1024} KB of shared memory per block, more than this GPU's "
                f"{_smem_limit(device) // 1024} KB")
    return None


def _launch_options(mod, name: str, device: torch.device, head_dim: int, dtype: torch.dtype, kv_heads: int,
                    group: int) -> dict:
    """The compile-time constants and pipeline depth both kernels launch with: the deepest pipeline
    that fits the device's shared memory (the interpreter has none to fit)."""
    stages = 1 if mod.INTERPRETED else stages_for(device, head_dim, dtype, group)
    if stages is None:
        raise ValueError(f"{name}: {unavailable_reason(device, head_dim, dtype, group)}")
    return dict(KVH=kv_heads, G=group, GP=group_pad(group), D=head_dim, BLOCK=DECODE_BLOCK_S,
                IEEE=dtype == torch.float32, UPCAST=mod.INTERPRETED and dtype != torch.float32, num_stages=stages)


_OP = None


def attention_op():
    """The kernel as a torch custom op, registered on first use: opaque to torch.compile (Inductor calls
    it as an extern kernel and does not re-parse its Triton source), with a fake for shape propagation.
    A compiled caller should hold the op itself (this lookup imports a module, which Dynamo skips)."""
    global _OP
    if _OP is None:
        mod = kernel_module()

        @torch.library.custom_op("edgerl::decode_attention", mutates_args=())
        def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                                col: torch.Tensor, scale: float) -> torch.Tensor:
            if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
                raise ValueError("decode_attention needs contiguous last dimensions of q, k and v")
            B, KVH, G, D = q.shape
            opts = _launch_options(mod, "decode_attention", q.device, D, q.dtype, KVH, G)
            o = torch.empty((B, KVH, G, D), device=q.device, dtype=q.dtype)
            mod.decode_attention_kernel[(B * KVH,)](
                q, k, v, o, start, col, scale, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                **opts)
            return o

        @decode_attention_op.register_fake
        def _(q, k, v, start, col, scale):
            return torch.empty_like(q, memory_format=torch.contiguous_format)

        _OP = decode_attention_op
    return _OP


_ROPE_OP = None


def attention_rope_op():
    """`decode_attention_rope` as a torch custom op that writes the cache in place (mutates k and v),
    registered on first use; see `attention_op`."""
    global _ROPE_OP
    if _ROPE_OP is None:
        mod = kernel_module()

        @torch.library.custom_op("edgerl::decode_attention_rope", mutates_args=("k", "v"))
        def decode_attention_rope_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                                     v: torch.Tensor, start: torch.Tensor, col: torch.Tensor, scale: float,
                                     group: int) -> torch.Tensor:
            B, KVH, _, D = k.shape
            if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride() or k.stride(-1) != 1 \
                    or v.stride(-1) != 1 or qkv.shape != (B, (group + 2) * KVH * D) or qkv.dtype != k.dtype \
                    or cos.shape != (B, D) or sin.shape != cos.shape or v.shape != k.shape:
                raise ValueError(f"decode_attention_rope: qkv {tuple(qkv.shape)} {qkv.dtype} must hold q, k and v "
                                 f"of {KVH} KV heads x {group} query heads of size {D} for each of the cache's {B} "
                                 f"rows in its dtype {k.dtype}, cos and sin ({B}, {D}), with contiguous last "
                                 "dimensions of every input")
            opts = _launch_options(mod, "decode_attention_rope", qkv.device, D, qkv.dtype, KVH, group)
            o = torch.empty((B, KVH, group, D), device=qkv.device, dtype=qkv.dtype)
            mod.decode_attention_rope_kernel[(B * KVH,)](
                qkv, cos, sin, k, v, o, start, col, scale, qkv.stride(0), cos.stride(0), *k.stride()[:3],
                *v.stride()[:3], *o.stride()[:3], QW=group * KVH * D, KVW=KVH * D, PLAIN=mod.INTERPRETED,
                **opts)
            return o

        @decode_attention_rope_op.register_fake
        def _(qkv, cos, sin, k, v, start, col, scale, group):
            return qkv.new_empty((k.shape[0], k.shape[1], group, k.shape[3]))

        _ROPE_OP = decode_attention_rope_op
    return _ROPE_OP


def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          start: torch.Tensor, col: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    """The rotary embedding of the new token's q and k, k and v written into cache column col, and
    `decode_attention` over the row's columns, in one kernel. qkv: (B, (group + 2) KVH D), the q/k/v
    projection's output before rotation (q heads, then k, then v); cos, sin: (B, D) the rows' rotary
    tables as the engine keeps them (sin carries rotate_half's sign); k, v: (B, KVH, S, D), written in
    place. Returns (B, KVH, group, D)."""
    return attention_rope_op()(qkv, cos, sin, k, v, start, col, scale, group)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, col: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one new token per row over a static KV cache. q: (B, KVH, G, D), the G query heads
    of each KV head (query head h uses KV head h // G, as HF's repeat_kv); k, v: (B, KVH, S, D) with
    contiguous last dims; start: (B,) int64, the first column row b sees; col: (1,) int64, the last
    (the new token's own column, already written). Returns (B, KVH, G, D) in q's dtype: softmax(q k^T
    * scale) v over columns start[b]..col, scores and softmax in fp32."""
    return attention_op()(q, k, v, start, col, scale)
