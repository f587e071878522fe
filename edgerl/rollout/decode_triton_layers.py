"""Decode backend `triton-layers`: each decode layer as five Triton kernels, no torch.compile.

The RMS norm fused into the q/k/v product, the rotary decode-attention kernel, the o product with the
residual add, the norm fused into the gate/up product with SiLU(gate) * up as its epilogue, and the
down product with the residual add (`edgerl/kernels/decode_linear.py`), each rounded where HF's ops round.
The products that add to the residual stream also write the new rows' sums of squares, which the next
norm reads instead of the rows. The plan picks it in 16 bits from CC 8.0 with triton, for fused
projections and a SiLU MLP. It was the fastest 16-bit decode step measured, ahead of the torch.compile'd
step (with its o and down products split-K), which is why that step is not in the library
(docs/benchmarks.md, Rollout decode step).
"""

from __future__ import annotations

import torch

from .decode_triton_attention import Backend as TritonAttention
from .decode_step import DecodeKernelUnavailable, LayerStep
from .decoder import StaticDecoder


class Backend(TritonAttention):
    name = "triton-layers"

    def __init__(self, dec: StaticDecoder) -> None:
        from edgerl.kernels.decode_linear import decode_linear, unavailable_reason
        why = dec.fused_norms_reason() or (
            f"it reads the fused projections' weights ({dec.proj_note})" if any(p.kind != "fused" for p in dec.proj)
            else "the MLP's activation is not SiLU (the gate/up kernel's epilogue computes SiLU(gate) * up)"
            if not dec.silu else unavailable_reason(dec.device, dec.dtype))
        if why:
            raise DecodeKernelUnavailable(f"decode backend 'triton-layers' cannot run here: {why}")
        super().__init__(dec)
        self.linear = decode_linear
        self.note = "Triton layers: the norms, SiLU * up and residual adds inside the projections"

    def first(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.float().square().sum(-1)[None]   # the first norm's sums of squares

    def layer(self, x: torch.Tensor, d: torch.Tensor, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """d: x's rows' sums of squares as (P, B) fp32 partial sums, written by the product that added to
        the residual stream last. Qwen3's per-head q/k norms, where `step.norms` has them, run as torch's ops
        between the q/k/v product and the attention kernel; there are no post norms here
        (`StaticDecoder.fused_norms_reason`). Returns (x, d) for the next layer."""
        B, lin, dec, proj, n = x.shape[0], self.linear, self.dec, step.proj, step.norms
        qkv = lin(x, proj.qkv_w, norm=n.ln1, eps=n.eps1, bias=proj.qkv_b, sumsq=d)
        if n.qk is not None:
            dec.qk_norm(qkv, n.qk)
        o = self.attend(qkv, step)
        x, ss = lin(o.view(B, dec.q_width), proj.o_w, bias=proj.o_b, residual=x, return_sumsq=True)
        h = lin(x, proj.gu_w, norm=n.ln2, eps=n.eps2, bias=proj.gu_b, glu=True, sumsq=ss)
        return lin(h, proj.down_w, bias=proj.down_b, residual=x, return_sumsq=True)

    def last(self, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return x   # the down product added itself to the residual stream
