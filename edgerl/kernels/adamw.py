"""Launcher for the fused bf16 AdamW step (edgerl/kernels/_triton_adamw.py); triton is imported only here."""
from __future__ import annotations

import importlib
import math
from typing import Optional

import torch


def kernel_module():
    """The kernel's module, imported on first use (raises ImportError without triton)."""
    return importlib.import_module("._triton_adamw", __package__)


def unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the fused step cannot run on `device`, or None if it can."""
    try:
        interpreted = kernel_module().INTERPRETED
    except ImportError as e:
        return f"triton does not import ({e}); install it with `pip install triton`"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (7, 0):
            return "Triton needs CC >= 7.0"
        return None
    if not interpreted:
        return f"tensors are on {device}, not CUDA (TRITON_INTERPRET=1 before import runs Triton's CPU interpreter)"
    return None


def adamw_bf16_step(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    comp: Optional[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, seed: int, offset: int = 0) -> None:
    """One AdamW step in place on contiguous bf16 tensors of equal size (g may be any float dtype),
    with stochastically rounded moments, and a stochastically rounded weight (comp None) or a Kahan
    compensation `comp`. `seed` (63 bits) keys the random bits; `offset` is the index of w[0] in the
    shard it is a piece of (pieces of one shard stepped separately draw the bits of the whole)."""
    mod = kernel_module()
    n = w.numel()
    for t in (w, g, m, v, comp):
        if t is not None and not (t.is_contiguous() and t.numel() == n and t.device == w.device):
            raise ValueError("the fused bf16 AdamW step takes contiguous tensors of one size on one device")
    if n == 0:
        return
    grid = (-(-n // mod.BLOCK),)
    mod.adamw_bf16_kernel[grid](
        w, g, m, v, comp if comp is not None else w, n, offset, seed,
        1.0 - beta1, beta2, 1.0 - beta2, eps, 1.0 - lr * weight_decay, lr / (1 - beta1 ** step),
        math.sqrt(1 - beta2 ** step), KAHAN=comp is not None, BLOCK=mod.BLOCK)
