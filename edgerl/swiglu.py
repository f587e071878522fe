"""The training MLP's SiLU-and-multiply as one autograd step that keeps only its two inputs.

HF's llama/qwen2 MLP is `down(silu(gate(x)) * up(x))`: autograd keeps gate(x) for the SiLU, and
silu(gate(x)) and up(x) for the product, three intermediate-sized tensors per token and layer (a
LoRA adapter on down_proj keeps the product as well, a fourth). `SiluMul` keeps gate(x) and up(x)
and recomputes the SiLU in the backward (elementwise, no matmul), as Liger's and Unsloth's SwiGLU
kernels do: one intermediate-sized tensor fewer per token and layer, about a fifth of a layer's
activations at the 7B widths. The backward computes in fp32 and rounds once, as PyTorch's SiLU
backward does. `tests/test_swiglu_on_cpu.py` checks the gradients against autograd's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


class SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        wide = torch.promote_types(gate.dtype, torch.float32)   # fp32 for 16-bit inputs, float64 stays
        g, u, d = gate.to(wide), up.to(wide), grad.to(wide)
        sig = torch.sigmoid(g)
        silu = g * sig
        d_gate = d * u * sig * (1 + g * (1 - sig))
        return d_gate.to(gate.dtype), (d * silu).to(up.dtype)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


def fusable(mlp: nn.Module) -> bool:
    """An MLP of the shape `down(act(gate(x)) * up(x))` with act SiLU."""
    act = getattr(mlp, "act_fn", None)
    return (all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")))


def fuse_mlps(layers) -> int:
    """Give every fusable MLP of `layers` (decoder layers) the SiluMul forward; returns how many."""
    n = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and fusable(mlp):
            mlp.forward = types.MethodType(_forward, mlp)
            n += 1
    return n
