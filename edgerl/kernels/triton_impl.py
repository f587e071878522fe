"""Launchers for the Triton kernels. triton itself is imported only inside these functions.

Shapes: h (N, H), w (V, H) contiguous rows, targets (N,) int64; per-token vectors (N,) float32.
"""
from __future__ import annotations

import functools
import importlib

import torch

from .tiles import DTYPE_BYTES, SMEM_DEFAULT, Tiles, choose_tiles, estimate_smem

TORCH_TO_TILE_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# backend="auto" picks Triton from CC 8.0: Triton's README supports 8.0+, and below it tl.dot falls back
# to FMA (triton#5066) while torch's chunked path reaches the tensor cores through cuBLAS. edgerl's plan
# passes its own choice explicitly (decisions.pick_kernels); this is the default for direct callers.
AUTO_MIN_CC = (8, 0)


def kernels_module():
    """The kernels module, imported on first use (raises ImportError without triton)."""
    return importlib.import_module("._triton_kernels", __package__)


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton path cannot run here, or None if it can."""
    if dtype not in TORCH_TO_TILE_DTYPE:
        return f"the Triton kernels take fp32, fp16 or bf16, not {dtype}"
    if device.type != "cuda":
        try:
            interpreted = kernels_module().INTERPRETED
        except ImportError as e:
            return f"triton does not import ({e})"
        if not interpreted:
            return f"tensors are on {device}, not CUDA (set TRITON_INTERPRET=1 before import to run Triton's CPU interpreter)"
        return None
    try:
        kernels_module()
    except ImportError as e:
        return f"triton does not import ({e}); install it with `pip install triton`"
    return None


def kernel_device_reason(load, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a Triton kernel module (`load()` imports it; it sets INTERPRETED) cannot run on this device in
    this dtype, or None: triton must import; on CUDA, CC >= 7.0 and bf16 products from CC 8.0; off CUDA,
    only Triton's CPU interpreter."""
    try:
        interpreted = load().INTERPRETED
    except ImportError as e:
        return f"triton does not import ({e}); install it with `pip install triton`"
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        if cc < (7, 0):
            return "Triton needs CC >= 7.0"
        if dtype == torch.bfloat16 and cc < (8, 0):
            return "bf16 products need CC >= 8.0"
        return None
    if not interpreted:
        return f"tensors are on {device}, not CUDA (TRITON_INTERPRET=1 before import runs Triton's CPU interpreter)"
    return None


@functools.lru_cache(maxsize=None)
def _device_limits(device: torch.device) -> tuple[int, tuple[int, int] | None, int]:
    """(shared memory per block opt-in, compute capability, SM count); interpreter: 48 KB, None, 1."""
    if device.type != "cuda":
        return SMEM_DEFAULT, None, 1
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    # torch < 2.7 lacks the attribute: fall back to the 48 KB every CC allows. edgerl's planner passes
    # tiles sized from its own capability table, so this only shapes direct callers' defaults there.
    smem = getattr(props, "shared_memory_per_block_optin", 0) or SMEM_DEFAULT
    return smem, cc, props.multi_processor_count


def resolve_tiles(h: torch.Tensor, vocab: int, tiles: Tiles | None) -> Tiles:
    """The given tiles (checked against the device), or choose_tiles for this device and shape."""
    smem, cc, _ = _device_limits(h.device)
    dt = TORCH_TO_TILE_DTYPE[h.dtype]
    if tiles is None:
        return choose_tiles(smem, dt, h.shape[1], vocab, cc=cc)
    need = estimate_smem(tiles.block_n, tiles.block_v, tiles.block_k, tiles.num_stages, dt)
    if need > smem:
        raise ValueError(f"tiles {tiles.block_n}x{tiles.block_v}x{tiles.block_k} with {tiles.num_stages} stages "
                         f"need about {need} bytes of shared memory for {dt}; this device allows {smem} per block. "
                         f"Use choose_tiles({smem}, {dt!r}, hidden, vocab) or smaller blocks.")
    return tiles


def _input_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's own matmul setting, so the Triton and torch paths round alike:
    tf32 tensor cores under set_float32_matmul_precision('high'), full fp32 otherwise."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _dot_upcast(k, dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter cannot tl.dot bf16 (see _logits_tile); never set on a GPU."""
    return bool(k.INTERPRETED and dtype == torch.bfloat16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward_stats_triton(h, w, targets, inv_temp: float, tiles: Tiles, compute_entropy: bool,
                         splits: int | None = None):
    """Returns logp, entropy (or None), lse, mz (or None), all (N,) float32. Extra memory O(splits x N).

    The vocabulary is split over `splits` programs per token block so that the grid fills the GPU
    even when N / block_n is small. About 8 programs per SM: a 128x128 tile program holds one SM
    alone (255 registers x 256 threads), so the grid runs in waves and the last, partial wave
    idles part of the GPU; more, shorter programs shrink that tail. The per-split partial
    log-sum-exps (3 x splits x N floats) are merged here in torch.
    """
    k = kernels_module()
    n, hid = h.shape
    v = w.shape[0]
    bn, bv, bk = tiles.block_n, tiles.block_v, tiles.block_k
    row_blocks, n_tiles = _cdiv(n, bn), _cdiv(v, bv)
    if splits is None:
        sms = _device_limits(h.device)[2]
        splits = max(1, min(n_tiles, _cdiv(8 * sms, row_blocks)))
    tiles_per_split = _cdiv(n_tiles, max(1, splits))
    splits = _cdiv(n_tiles, tiles_per_split)  # no split is left without a vocabulary tile
    f32 = dict(dtype=torch.float32, device=h.device)
    m, s = torch.empty(splits, n, **f32), torch.empty(splits, n, **f32)
    t = torch.empty(splits, n, **f32) if compute_entropy else s
    ztgt = torch.empty(n, **f32)
    k.fwd_stats_kernel[(row_blocks, splits)](
        h, w, targets, m, s, t, ztgt, n, v, hid, h.stride(0), w.stride(0), inv_temp, tiles_per_split,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, EVEN_K=hid % bk == 0, COMPUTE_ENTROPY=compute_entropy,
        INPUT_PRECISION=_input_precision(h.dtype), DOT_UPCAST=_dot_upcast(k, h.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    big_m = m.amax(dim=0)
    scale = torch.exp(m - big_m)
    big_s = (s * scale).sum(dim=0)
    log_s = big_s.log()
    lse = big_m + log_s
    logp = ztgt - lse
    if not compute_entropy:
        return logp, None, lse, None
    # each split's t is relative to its own max m_i; move it to the common max M
    big_t = ((t + (m - big_m) * s) * scale).sum(dim=0)
    ent = log_s - big_t / big_s
    return logp, ent, lse, lse - ent


def grad_logits_triton(h, w, targets, lse, mz, dlogp, dent, inv_temp: float, tiles: Tiles, r0, r1, c0, c1):
    """Grad-logits slab G (r1-r0, c1-c0) in w's dtype, recomputing the logits tile by tile."""
    k = kernels_module()
    hid = h.shape[1]
    rows, cols = r1 - r0, c1 - c0
    g = torch.empty(rows, cols, dtype=w.dtype, device=w.device)
    row_blocks = _cdiv(rows, tiles.block_n)
    grid = (row_blocks * _cdiv(cols, tiles.block_v),)
    dummy = lse[r0:r1]  # stands in for absent pointers; the kernel does not read it
    k.grad_logits_kernel[grid](
        h[r0:r1], w[c0:c1], targets[r0:r1], lse[r0:r1], dummy if mz is None else mz[r0:r1],
        dummy if dlogp is None else dlogp[r0:r1], dummy if dent is None else dent[r0:r1], g,
        rows, cols, hid, h.stride(0), w.stride(0), g.stride(0), c0, inv_temp, row_blocks,
        BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k, EVEN_K=hid % tiles.block_k == 0,
        HAS_DLOGP=dlogp is not None, HAS_DENT=dent is not None, INPUT_PRECISION=_input_precision(h.dtype),
        DOT_UPCAST=_dot_upcast(k, h.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return g


def slab_bytes_per_logit(dtype: torch.dtype) -> int:
    """The Triton backward holds its grad-logits slab in the input dtype and nothing else of that size."""
    return DTYPE_BYTES[TORCH_TO_TILE_DTYPE[dtype]]
