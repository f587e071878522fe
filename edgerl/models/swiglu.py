"""The training MLP's SiLU-and-multiply as one autograd step that keeps only its two inputs.

HF's llama/qwen2 MLP is `down(silu(gate(x)) * up(x))`: autograd keeps gate(x) for the SiLU, and
silu(gate(x)) and up(x) for the product, three intermediate-sized tensors per token and layer (a
LoRA adapter on down_proj keeps the product as well, a fourth). `SiluMul` keeps gate(x) and up(x)
and recomputes the SiLU in the backward (elementwise, no matmul), as Liger's and Unsloth's SwiGLU
kernels do: one intermediate-sized tensor fewer per token and layer, about a fifth of a layer's
activations at the 7B widths. The backward runs the kernels autograd runs (PyTorch's SiLU backward),
so its gradients are autograd's: `tests/test_swiglu_on_cpu.py`.
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
        # PyTorch's own SiLU backward kernel (what autograd runs): computes in fp32 for 16-bit inputs and
        # rounds once, in one kernel
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return d_gate, grad * F.silu(gate)


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
