"""Launcher for the decode step's projection kernel (edgerl/kernels/_triton_decode_linear.py); triton is
imported only here. Called straight from the decode layer (no torch.compile), which a CUDA graph
captures."""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from .tiles import _next_pow2, decode_linear_tiles
from .triton_impl import _device_limits, kernel_device_reason

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_module():
    """The kernel's module, imported on first use (raises ImportError without triton)."""
    return importlib.import_module("._triton_decode_linear", __package__)


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why the kernel cannot run for this device and dtype, or None."""
    if dtype not in DTYPES:
        return f"{dtype} is not one of the kernel's dtypes (bf16, fp16, fp32)"
    return kernel_device_reason(kernel_module, device, dtype)


def decode_linear(x: torch.Tensor, w: torch.Tensor, *, norm: Optional[torch.Tensor] = None, eps: float = 0.0,
                  bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                  glu: bool = False, sumsq: Optional[torch.Tensor] = None, return_sumsq: bool = False,
                  tiles: Optional[tuple[int, ...]] = None):
    """One decode-step projection of the rows x (B, K) by w (N, K), with its neighbours fused in:

    - norm: the RMS norm weight (K,) applied to x first, as HF's `LlamaRMSNorm` (eps its epsilon);
    - glu: w is the fused gate/up weight (2 I, K), gate rows first; returns SiLU(x W_gate^T) * x W_up^T (B, I);
    - bias: added to the product (N,) (under glu (2 I,)) before it rounds;
    - residual: (B, N) rows the rounded product is added to; returns the sum (the new residual stream);
    - sumsq: with norm, the rows' sums of squares as (P, B) fp32 partial sums (what `return_sumsq` gives, or
      `x.float().square().sum(-1)[None]`), so the kernel need not read every row once more to get them;
    - return_sumsq: with residual, also return the new rows' sums of squares as (P, B) partials: (out, sumsq).

    Every tensor in one dtype (bf16, fp16 or fp32), last dimensions contiguous. tiles: (BM, BN, BK,
    num_warps, num_stages, split[, swap]), default `tiles.decode_linear_tiles` for this device; split > 1
    splits the inner dimension over that many programs, swap computes W x^T (see the kernel). A new output tensor."""
    mod = kernel_module()
    B, K = x.shape
    rows_w = w.shape[0]
    if glu and rows_w % 2:
        raise ValueError(f"decode_linear: a gate/up weight has an even number of rows, got {tuple(w.shape)}")
    N = rows_w // 2 if glu else rows_w
    for name, t, shape in (("w", w, (rows_w, K)), ("norm", norm, (K,)), ("bias", bias, (rows_w,)),
                           ("residual", residual, (B, N))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or t.stride(-1) != 1):
            raise ValueError(f"decode_linear: {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {x.dtype} "
                             "with a contiguous last dimension")
    if x.stride(-1) != 1:
        raise ValueError("decode_linear: x needs a contiguous last dimension")
    if sumsq is not None and (norm is None or sumsq.dim() != 2 or sumsq.shape[1] != B or sumsq.dtype != torch.float32
                              or not sumsq.is_contiguous()):
        raise ValueError(f"decode_linear: sumsq is {tuple(sumsq.shape)} {sumsq.dtype}, expected contiguous (P, {B}) "
                         "float32 partial sums of squares of x's rows, given with norm")
    if return_sumsq and residual is None:
        raise ValueError("decode_linear: return_sumsq needs residual (the sums are of the new residual rows)")
    if tiles is None:
        smem, _, sms = _device_limits(x.device)
        tiles = decode_linear_tiles(B, N, K, x.element_size(), glu, sms, smem, norm=norm is not None)
    bm, bn, bk, warps, stages, split = tiles[:6]
    swap = bool(tiles[6]) if len(tiles) > 6 else False
    ks = _cdiv(_cdiv(K, split), bk) * bk   # each slice whole BK blocks
    split = _cdiv(K, ks)
    out = torch.empty((B, N), device=x.device, dtype=x.dtype)
    grid = (_cdiv(N, bn), _cdiv(B, bm), split)
    ws = torch.empty((split, B, 2 * N if glu else N), device=x.device, dtype=torch.float32) if split > 1 else out
    cnt = _counters(x.device, grid[0] * grid[1]) if split > 1 else out
    ssq_out = torch.empty((grid[0], B), device=x.device, dtype=torch.float32) if return_sumsq else None
    nb = sumsq.shape[0] if sumsq is not None else 1
    interp = mod.INTERPRETED
    mod.decode_linear_kernel[grid](
        x, norm if norm is not None else x, w, bias if bias is not None else x,
        residual if residual is not None else x, out, sumsq if sumsq is not None else out,
        ssq_out if ssq_out is not None else out, ws, cnt, B, K, N, float(eps), x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), N if glu else 0, nb, ks,
        NORM=norm is not None, SSQ_IN=sumsq is not None, NBP=max(2, _next_pow2(nb)), GLU=glu,
        RESID=residual is not None, SSQ_OUT=return_sumsq, HAS_BIAS=bias is not None, SPLIT=split,
        BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32, UPCAST=interp and x.dtype != torch.float32,
        PLAIN=interp, SWAP=swap, num_warps=warps, num_stages=1 if interp else stages)
    return (out, ssq_out) if return_sumsq else out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []   # counters a larger launch replaced: captured graphs may still use them


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The split products' tile counters on this device: zeros, and each launch leaves them zero (the last
    program of a tile resets its counter), so launches one after another on a stream share them. Allocated
    outside a CUDA graph capture (a captured step's warm-up runs first) and never freed: a graph keeps
    using the counters it was captured with."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_linear: a split product's first launch is inside a CUDA graph capture; "
                               "run it once before capturing (the tile counters are allocated then)")
        if have is not None:
            _OUTGROWN.append(have)
        have = _COUNTERS[device] = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
    return have
