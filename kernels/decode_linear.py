"""Launcher for the decode step's projection kernel (kernels/_triton_decode_linear.py); triton is
imported only here. Called straight from the decode layer (no torch.compile), which a CUDA graph
captures."""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from .tiles import _next_pow2, decode_layer_prefetch, decode_linear_prefetch_cols, decode_linear_tiles
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


def pdl_reason(device: torch.device) -> Optional[str]:
    """Why the kernels cannot use programmatic dependent launch on this device, or None: it needs a CUDA
    device of CC >= 9.0 (griddepcontrol, bulk L2 prefetch) and a triton with `gdc_wait` (>= 3.4)."""
    mod = kernel_module()
    if mod.INTERPRETED or device.type != "cuda":
        return "programmatic dependent launch is a CUDA feature (not the CPU or Triton's interpreter)"
    cc = torch.cuda.get_device_capability(device)
    if cc < (9, 0):
        return f"programmatic dependent launch needs CC >= 9.0; this GPU is {cc[0]}.{cc[1]}"
    if not mod.HAS_GDC:
        import triton
        return f"triton {triton.__version__} has no gdc_wait (triton >= 3.4 has)"
    return None


def decode_linear(x: torch.Tensor, w: torch.Tensor, *, norm: Optional[torch.Tensor] = None, eps: float = 0.0,
                  bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                  glu: bool = False, sumsq: Optional[torch.Tensor] = None, return_sumsq: bool = False,
                  tiles: Optional[tuple[int, ...]] = None, pdl: bool = False, prefetch: bool = True):
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
    (without norm and glu) splits the inner dimension over that many programs, swap computes W x^T (see the
    kernel). pdl: launch with programmatic dependent launch (where `pdl_reason` is None: the caller checks
    once), with prefetch the weight's first columns asked into L2 before the kernel waits for the one
    before (`tiles.decode_linear_prefetch_cols`). A new output tensor."""
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
    if split > 1 and (glu or norm is not None):
        raise ValueError("decode_linear: split > 1 is for products without norm and glu")
    ks = _cdiv(_cdiv(K, split), bk) * bk   # each slice whole BK blocks
    split = _cdiv(K, ks)
    out = torch.empty((B, N), device=x.device, dtype=x.dtype)
    grid = (_cdiv(N, bn), _cdiv(B, bm), split)
    ws = torch.empty((split, B, N), device=x.device, dtype=torch.float32) if split > 1 else out
    cnt = _counters(x.device, grid[0] * grid[1]) if split > 1 else out
    ssq_out = torch.empty((grid[0], B), device=x.device, dtype=torch.float32) if return_sumsq else None
    nb = sumsq.shape[0] if sumsq is not None else 1
    interp = mod.INTERPRETED
    esz = w.element_size()
    pf_cols = 0
    if pdl and prefetch and w.data_ptr() % 16 == 0 and (w.stride(0) * esz) % 16 == 0 and (K * esz) % 16 == 0:
        l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
        pf_cols = decode_linear_prefetch_cols(rows_w, ks, split, esz, l2)
    mod.decode_linear_kernel[grid](
        x, norm if norm is not None else x, w, bias if bias is not None else x,
        residual if residual is not None else x, out, sumsq if sumsq is not None else out,
        ssq_out if ssq_out is not None else out, ws, cnt, B, K, N, float(eps), x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), N if glu else 0, nb, ks,
        NORM=norm is not None, SSQ_IN=sumsq is not None, NBP=max(2, _next_pow2(nb)), GLU=glu,
        RESID=residual is not None, SSQ_OUT=return_sumsq, HAS_BIAS=bias is not None, SPLIT=split,
        BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32, UPCAST=interp and x.dtype != torch.float32,
        PLAIN=interp, SWAP=swap, PDL=pdl, PF_COLS=pf_cols, ESZ=esz, num_warps=warps,
        num_stages=1 if interp else stages, **({"launch_pdl": True} if pdl else {}))
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


def layer_module():
    """The persistent layer kernel's module (kernels/_triton_decode_layer.py), imported on first use."""
    return importlib.import_module("._triton_decode_layer", __package__)


def decode_layer(x: torch.Tensor, sumsq: torch.Tensor, ln1: torch.Tensor, eps1: float, qkv_w: torch.Tensor,
                 qkv_b: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 start: torch.Tensor, col: torch.Tensor, scale: float, group: int, o_w: torch.Tensor,
                 o_b: Optional[torch.Tensor], ln2: torch.Tensor, eps2: float, gu_w: torch.Tensor,
                 gu_b: Optional[torch.Tensor], down_w: torch.Tensor, down_b: Optional[torch.Tensor],
                 tiles: Optional[dict] = None, prefetch: bool = True):
    """One decoder layer of the decode step as one persistent kernel (kernels/_triton_decode_layer.py): the five
    Triton-layer kernels' work (`decode_linear` for q/k/v, o, gate/up and down around `decode_attention_rope`) as
    phases of one launch, with their tiles, so the same results bit for bit. x (B, H) the residual stream and
    sumsq its rows' sums of squares as (P, B) fp32 partials; k, v (B, KVH, S, D) the layer's cache, written at
    column col; the rest as those launchers take them. Returns (the layer's output (B, H), its sums of squares
    as partials) for the next layer. tiles: {"qkv", "o", "gu", "down": `decode_linear`'s tiles} to replace the
    defaults (one BM for all; the stages are the fewest of any phase's). prefetch: on CC >= 9.0, the kernel
    first asks L2 for the weights and cache columns of the phases that fit in half of it, in phase order
    (`tiles.decode_layer_prefetch`)."""
    from .decode_attention import stages_for
    from .tiles import DECODE_BLOCK_S, group_pad
    mod = layer_module()
    B, H = x.shape
    _, KVH, _, D = k.shape
    QW, KVW, INTER = group * KVH * D, KVH * D, gu_w.shape[0] // 2
    NQKV = QW + 2 * KVW
    for name, t, shape in (("qkv_w", qkv_w, (NQKV, H)), ("o_w", o_w, (H, QW)), ("gu_w", gu_w, (2 * INTER, H)),
                           ("down_w", down_w, (H, INTER)), ("ln1", ln1, (H,)), ("ln2", ln2, (H,)),
                           ("qkv_b", qkv_b, (NQKV,)), ("o_b", o_b, (H,)), ("gu_b", gu_b, (2 * INTER,)),
                           ("down_b", down_b, (H,)), ("x", x, (B, H))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"decode_layer: {name} is {tuple(t.shape)} {t.dtype}, expected contiguous {shape} "
                             f"{x.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("decode_layer: the cache and the rotary tables need contiguous last dimensions")
    smem, _, sms = _device_limits(x.device)
    esz = x.element_size()
    shapes = {"qkv": (NQKV, H, False, True), "o": (H, QW, False, False), "gu": (INTER, H, True, True),
              "down": (H, INTER, False, False)}
    tiles = {name: decode_linear_tiles(B, n, kk, esz, glu, sms, smem, norm=norm)
             for name, (n, kk, glu, norm) in shapes.items()} | (tiles or {})
    bm = tiles["qkv"][0]
    ks = {}
    for name in ("o", "down"):
        kk, bk, split = shapes[name][1], tiles[name][2], tiles[name][5]
        ks[name] = _cdiv(_cdiv(kk, split), bk) * bk
    splits = {name: _cdiv(shapes[name][1], ks[name]) for name in ks}
    n_m = _cdiv(B, bm)
    items = [_cdiv(NQKV, tiles["qkv"][1]) * n_m, B * KVH, _cdiv(H, tiles["o"][1]) * n_m * splits["o"],
             _cdiv(INTER, tiles["gu"][1]) * n_m, _cdiv(H, tiles["down"][1]) * n_m * splits["down"]]
    nprog = min(sms, max(items))   # every program resident at once: at most one per SM
    attn_stages = 1 if mod.INTERPRETED else stages_for(x.device, D, x.dtype, group)
    stages = 1 if mod.INTERPRETED else min([t[4] for t in tiles.values()] + [attn_stages or 1])
    nb1, nb2 = _cdiv(H, tiles["o"][1]), _cdiv(H, tiles["down"][1])
    new = functools.partial(torch.empty, device=x.device)
    qkv, att, xm, h, xo = (new((B, NQKV), dtype=x.dtype), new((B, KVH, group, D), dtype=x.dtype),
                           new((B, H), dtype=x.dtype), new((B, INTER), dtype=x.dtype), new((B, H), dtype=x.dtype))
    ssq1, ssq2 = new((nb1, B), dtype=torch.float32), new((nb2, B), dtype=torch.float32)
    most_split = max(splits.values())
    ws = new((most_split, B, H), dtype=torch.float32) if most_split > 1 else ssq1
    cnt = _counters(x.device, max(nb1, nb2) * n_m)
    bar = _barrier(x.device)
    nb0 = sumsq.shape[0]
    pf = dict.fromkeys(("PF_QKV", "PF_KV", "PF_O", "PF_GU", "PF_D"), False)
    if prefetch and not mod.INTERPRETED and torch.cuda.get_device_capability(x.device) >= (9, 0):
        aligned = [t.data_ptr() % 16 == 0 and (t.shape[1] * esz) % 16 == 0 for t in (qkv_w, o_w, gu_w, down_w)]
        kv_ok = (k.stride(2) == D and v.stride(2) == D and (D * esz) % 16 == 0
                 and all(t.data_ptr() % 16 == 0 and all(st * esz % 16 == 0 for st in t.stride()[:2]) for t in (k, v)))
        sizes = [qkv_w.numel() * esz, 2 * B * KVH * k.shape[2] * D * esz, o_w.numel() * esz, gu_w.numel() * esz,
                 down_w.numel() * esz]
        chosen = decode_layer_prefetch(sizes, torch.cuda.get_device_properties(x.device).L2_cache_size)
        ok = [aligned[0], kv_ok, aligned[1], aligned[2], aligned[3]]
        pf = {key: c and o for key, c, o in zip(pf, chosen, ok)}
    mod.decode_layer_kernel[(nprog,)](
        x, sumsq, ln1, qkv_w, qkv_b if qkv_b is not None else x, qkv, cos, sin, k, v, att, start, col, o_w,
        o_b if o_b is not None else x, xm, ssq1, ln2, gu_w, gu_b if gu_b is not None else x, h, down_w,
        down_b if down_b is not None else x, xo, ssq2, ws, cnt, bar, float(scale), float(eps1), float(eps2), B, H,
        INTER, NQKV, nb0, nb1, cos.stride(0), *k.stride()[:3], *v.stride()[:3], ks["o"], ks["down"],
        QW=QW, KVW=KVW, KVH=KVH, G=group, GP=group_pad(group), D=D, BLOCK=DECODE_BLOCK_S, BM=bm,
        NBP0=max(2, _next_pow2(nb0)), NBP1=max(2, _next_pow2(nb1)), BN_QKV=tiles["qkv"][1], BK_QKV=tiles["qkv"][2],
        SWAP_QKV=bool(tiles["qkv"][6]), BN_O=tiles["o"][1], BK_O=tiles["o"][2], SPLIT_O=splits["o"],
        BN_GU=tiles["gu"][1], BK_GU=tiles["gu"][2], BN_D=tiles["down"][1], BK_D=tiles["down"][2],
        SPLIT_D=splits["down"], BIAS_QKV=qkv_b is not None, BIAS_O=o_b is not None, BIAS_GU=gu_b is not None,
        BIAS_D=down_b is not None, IEEE=x.dtype == torch.float32, UPCAST=mod.INTERPRETED and x.dtype != torch.float32,
        PLAIN=mod.INTERPRETED, ESZ=esz, **pf, num_warps=4, num_stages=stages)
    return xo, ssq2


_BARRIERS: dict[torch.device, torch.Tensor] = {}


def _barrier(device: torch.device) -> torch.Tensor:
    """The persistent layer kernel's barrier counters on this device (int32 (2,), zero; each launch leaves them
    zero). Allocated outside a CUDA graph capture, as `_counters`, and never freed."""
    have = _BARRIERS.get(device)
    if have is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_layer: the first launch is inside a CUDA graph capture; run it once before "
                               "capturing (the barrier counters are allocated then)")
        have = _BARRIERS[device] = torch.zeros(2, device=device, dtype=torch.int32)
    return have
