"""Decode backend `triton-attention`: torch's projections around edgerl's rotary decode-attention kernel.

`edgerl/kernels/decode_attention.py`'s rotary kernel rotates q and k, writes the new cache column and attends
over only the columns each row sees (SDPA's kernels read every column of the static cache, masked), in
one kernel per layer. The plan picks it in 16 bits from CC 8.0 with triton where the Triton layers
cannot run: a quantized base, whose projections are bitsandbytes modules, or an MLP that is not SiLU.
Its step against SDPA's: docs/benchmarks.md, Decode attention kernel.
"""

from __future__ import annotations

import torch

from .decode_torch import Backend as TorchOps
from .decode_step import DecodeKernelUnavailable, LayerStep
from .decoder import StaticDecoder


class Backend(TorchOps):
    name = "triton-attention"
    reads_span = False   # the whole cache: the kernel reads each row's visible columns only

    def __init__(self, dec: StaticDecoder) -> None:
        from edgerl.kernels.decode_attention import attention_rope_op, unavailable_reason
        super().__init__(dec)
        why = unavailable_reason(dec.device, dec.head_dim, dec.dtype, dec.group)
        if why:
            raise DecodeKernelUnavailable(f"decode backend 'triton-attention' cannot run here: {why}")
        self.rope_attend = attention_rope_op()
        self.note = "torch's projections around the rotary decode-attention kernel (Triton)"

    def hide(self, first: torch.Tensor, col: torch.Tensor, S: int) -> torch.Tensor:
        return first   # the kernel reads only the columns first[b] .. col of each row (a window: its first column)

    def attend(self, qkv: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Rotary, the cache write and attention in one kernel. Returns (B, KVH, G, D)."""
        B, dec, kv = qkv.shape[0], self.dec, step.kv
        return self.rope_attend(qkv, step.cos.view(B, -1), step.sin.view(B, -1), kv[0], kv[1], step.hide, step.col,
                                dec.scaling, dec.group)
