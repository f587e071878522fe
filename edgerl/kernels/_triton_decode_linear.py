"""The rollout's decode-step projections as Triton kernels, each with the elementwise work around it
fused in. Imported only when it runs.

At decode time a projection multiplies a few rows (the rollout's batch, 16 in the benchmarks) by a
weight that is read once per step, so its time is the weight's bytes over the memory bandwidth, plus
the kernel's start-up. A decoder layer run as torch ops is eight kernels (add + norm, q/k/v, attention,
o, add + norm, gate/up, SiLU * up, down), each a start-up and a round trip of its small output
through memory. `decode_linear_kernel` folds those into the products:

- NORM: the RMS norm of the input rows as the prologue (each program gets the rows' 1 / RMS first, then
  normalises each block of columns as it feeds it to the product), rounded where HF's `LlamaRMSNorm`
  rounds: the normalised row to the compute dtype, then its product with the norm weight. SSQ_IN: the rows'
  sums of squares come as NB partial sums per row, written by the kernel that produced the rows
  (SSQ_OUT), so a program reads a few hundred bytes instead of every row once more before its product.
- GLU: two products per program, the gate's and the up's columns (rows j and INTER + j of the fused
  gate/up weight), and the epilogue act(gate) * up with SiLU, each rounded as the torch ops round.
- SPLIT: the inner dimension split over several programs, the last of them summing the partials in a fixed
  order (more programs for products with few output columns or a long inner dimension).
- RESID: the epilogue adds the product, rounded to the compute dtype, to the residual row
  (`x + o_proj(o)` in HF's order), and the kernel writes the new residual stream; SSQ_OUT: with each
  program's sums of squares of its block of the new rows (fp32, of the rounded values the next norm reads).
- HAS_BIAS: the bias added to the fp32 product before it rounds (cuBLAS's epilogue does the same).
- SWAP: the product computed as W x^T, the weight block as tl.dot's first operand (faster for q/k/v).

One program per block of BN output columns and BM rows (and inner slice under SPLIT), so each weight element
is read once, and every sum is in a fixed order (the same tokens on every run). IEEE: fp32 inputs multiply
in fp32, not TF32. UPCAST (the interpreter, whose tl.dot misreads 16-bit inputs): 16-bit values are widened
to fp32 before each product. PLAIN (the interpreter, which has no libdevice): plain ops for the exponential,
division and square root.
If TRITON_INTERPRET=1 is set when triton is first imported, the kernel runs in Triton's CPU interpreter.
"""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rsqrt_mean(ss, K, eps, PLAIN: tl.constexpr):
    """rsqrt(ss / K + eps) in fp32: 1 / RMS from the rows' sums of squares."""
    if PLAIN:
        return 1.0 / tl.sqrt(ss / K + eps)
    return libdevice.rsqrt(ss / K + eps)


@triton.jit
def _rstd(x_ptr, rows, rmask, sx, K, eps, BK: tl.constexpr, BM: tl.constexpr, PLAIN: tl.constexpr):
    """1 / RMS of each row, in fp32: rsqrt(mean(x^2) + eps) over the K columns."""
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + rows[:, None] * sx + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        ss += tl.sum(a * a, 1)
    return _rsqrt_mean(ss, K, eps, PLAIN)


@triton.jit
def _rstd_from_partials(ssq_ptr, NB, B, rows, rmask, K, eps, NBP: tl.constexpr, PLAIN: tl.constexpr):
    """1 / RMS of each row from its NB partial sums of squares (ssq (NB, B), fp32), summed in a fixed order."""
    j = tl.arange(0, NBP)
    part = tl.load(ssq_ptr + j[:, None] * B + rows[None, :], mask=(j[:, None] < NB) & rmask[None, :], other=0.0)
    return _rsqrt_mean(tl.sum(part, 0), K, eps, PLAIN)


@triton.jit
def _product(a, w_ptr, cols, cmask, kk, kmask, sw, IEEE: tl.constexpr, UPCAST: tl.constexpr, SWAP: tl.constexpr):
    """a (BM, BK) times the weight's rows `cols` at columns kk, transposed: (BM, BN) in fp32. SWAP: computed
    as W a^T (the weight block as the product's first operand), then transposed."""
    w = tl.load(w_ptr + cols[:, None] * sw + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    if SWAP:
        if IEEE or UPCAST:
            return tl.trans(tl.dot(w, tl.trans(a), input_precision="ieee"))
        return tl.trans(tl.dot(w, tl.trans(a)))
    if IEEE or UPCAST:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _sum_partials(part, stride, omask, SPLIT: tl.constexpr):
    """The SPLIT fp32 partial tiles at part, part + stride, ... summed in slice order (read past L1: other
    programs wrote them)."""
    acc = tl.load(part, mask=omask, other=0.0, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT):
        acc += tl.load(part + j * stride, mask=omask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _epilogue(acc, acc_up, b_ptr, res_ptr, out_ptr, ssq_out_ptr, rows, rmask, cols, cmask, B, INTER, sres, sout,
              pid_n, GLU: tl.constexpr, RESID: tl.constexpr, SSQ_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
              PLAIN: tl.constexpr):
    """Bias, SiLU(gate) * up, the residual add and the sums of squares of the finished fp32 product; the store."""
    DT = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(b_ptr + INTER + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(DT)
    if GLU:   # SiLU(gate) * up, as torch: SiLU in fp32 from the rounded gate, rounded; the product rounded
        g = y.to(tl.float32)
        if PLAIN:
            act = g / (1.0 + tl.exp(-g))
        else:
            act = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
        y = (act.to(DT).to(tl.float32) * acc_up.to(DT).to(tl.float32)).to(DT)
    omask = rmask[:, None] & cmask[None, :]
    if RESID:   # HF: residual + proj(x), the product rounded first
        r = tl.load(res_ptr + rows[:, None] * sres + cols[None, :], mask=omask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(DT)
        if SSQ_OUT:
            yf = tl.where(omask, y.to(tl.float32), 0.0)
            tl.store(ssq_out_ptr + pid_n * B + rows, tl.sum(yf * yf, 1), mask=rmask)
    tl.store(out_ptr + rows[:, None] * sout + cols[None, :], y, mask=omask)


@triton.jit
def decode_linear_kernel(x_ptr, ln_ptr, w_ptr, b_ptr, res_ptr, out_ptr, ssq_in_ptr, ssq_out_ptr, ws_ptr, cnt_ptr,
                         B, K, N, eps, sx, sw, sres, sout, INTER, NB, KS, NORM: tl.constexpr, SSQ_IN: tl.constexpr,
                         NBP: tl.constexpr, GLU: tl.constexpr, RESID: tl.constexpr, SSQ_OUT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PLAIN: tl.constexpr,
                         SWAP: tl.constexpr):
    """out (B, N) = epilogue(prologue(x) @ W^T). x (B, K), W (N, K) or, under GLU, (2 INTER, K) with the
    gate's rows first; ln (K,): the norm weight (NORM); ssq_in (NB, B) fp32: the rows' partial sums of
    squares (SSQ_IN; NBP: NB padded to a power of two); b: the bias (N,) or (2 INTER,) (HAS_BIAS); res
    (B, N): the residual rows (RESID); ssq_out (programs along N, B) fp32 (SSQ_OUT). Last dimensions
    contiguous; every tensor but the sums in the compute dtype.
    SPLIT > 1: the inner dimension in SPLIT slices of KS columns (program axis 2), for more programs on a
    product with few output columns or a long inner dimension (each program normalises its slice of the rows
    under NORM). Each program stores its fp32 partial tile in ws (SPLIT, B, N), under GLU (SPLIT, B, 2 N) with
    the up product's after the gate's, and counts itself in its tile's counter
    (cnt, int32, zero before the launch); the last of a tile's SPLIT programs sums the partials in slice
    order (the same sum on every run, whichever program finishes last), runs the epilogue and sets the
    counter back to zero for the next launch."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    DT = out_ptr.dtype.element_ty
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < B
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    if NORM:
        if SSQ_IN:
            rstd = _rstd_from_partials(ssq_in_ptr, NB, B, rows, rmask, K, eps, NBP, PLAIN)
        else:
            rstd = _rstd(x_ptr, rows, rmask, sx, K, eps, BK, BM, PLAIN)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = acc
    if GLU:
        acc_up = tl.zeros([BM, BN], tl.float32)
    k_lo = pid_k * KS
    k_hi = tl.minimum(K, k_lo + KS)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        a = tl.load(x_ptr + rows[:, None] * sx + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if NORM:   # HF: (x * rstd) rounded, then weight * that, rounded
            a = (a.to(tl.float32) * rstd[:, None]).to(DT)
            ln = tl.load(ln_ptr + kk, mask=kmask, other=0.0)
            a = (ln.to(tl.float32)[None, :] * a.to(tl.float32)).to(DT)
        if UPCAST:
            a = a.to(tl.float32)
        acc += _product(a, w_ptr, cols, cmask, kk, kmask, sw, IEEE, UPCAST, SWAP)
        if GLU:
            acc_up += _product(a, w_ptr, INTER + cols, cmask, kk, kmask, sw, IEEE, UPCAST, SWAP)
    if SPLIT > 1:
        omask = rmask[:, None] & cmask[None, :]
        NW = 2 * N if GLU else N   # a row of partials: the gate's then (GLU) the up's
        part = ws_ptr + rows[:, None] * NW + cols[None, :]
        tl.store(part + pid_k * B * NW, acc, mask=omask)
        if GLU:
            tl.store(part + N + pid_k * B * NW, acc_up, mask=omask)
        tl.debug_barrier()   # every thread's store issued before the count that may let another program read it
        tile = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            acc = _sum_partials(part, B * NW, omask, SPLIT)
            if GLU:
                acc_up = _sum_partials(part + N, B * NW, omask, SPLIT)
            tl.atomic_xchg(tile, 0)
            _epilogue(acc, acc_up, b_ptr, res_ptr, out_ptr, ssq_out_ptr, rows, rmask, cols, cmask, B, INTER, sres,
                      sout, pid_n, GLU, RESID, SSQ_OUT, HAS_BIAS, PLAIN)
    else:
        _epilogue(acc, acc_up, b_ptr, res_ptr, out_ptr, ssq_out_ptr, rows, rmask, cols, cmask, B, INTER, sres, sout,
                  pid_n, GLU, RESID, SSQ_OUT, HAS_BIAS, PLAIN)
