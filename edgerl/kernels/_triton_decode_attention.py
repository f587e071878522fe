"""The rollout's decode-step attention as one Triton kernel. Imported only when it runs.

One program per (row, KV head): it loads the G query heads that share the KV head, walks the cached
columns the row may see, [start[row], col], in blocks of BLOCK columns (`tiles.DECODE_BLOCK_S`) with
an online softmax (fp32 scores, running max and sum), and writes the G output heads. The bounds are
read from device tensors, so the kernel reads only the columns a row needs and a captured CUDA graph
replays it at every column. The launcher picks the pipeline depth that fits the device's shared
memory (`tiles.decode_attention_stages`).
SDPA's memory-efficient kernel, which the decode step called before, tiles 64 queries for the one
token each head has and reads every column of the static cache, masked (docs/benchmarks.md, Decode attention kernel).
`decode_attention_rope_kernel` also does the three steps before it, from the q/k/v projection's output:
the rotary embedding of q and k, the write of k and v into the cache's column, and the query's copy
into the kernel's layout (three small kernels per layer otherwise).

If TRITON_INTERPRET=1 is set when triton is first imported, the kernel runs in Triton's CPU
interpreter on CPU tensors (that is how the CPU tests run it).
"""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend(q, k_row, v_row, o_row, start, end, scale, sk_s, sv_s, so_g,
            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
            UPCAST: tl.constexpr):
    """q (GP, D) in registers (fp32 when UPCAST) attends to the columns start .. end - 1 of one row and
    KV head of the cache (k_row, v_row: their column 0); the G output heads go to o_row (stride so_g)."""
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # The first block holds column `start`, so every block has a column to see: the running max is
    # finite after the first and no exp(-inf - -inf) occurs.
    for s0 in range((start // BLOCK) * BLOCK, end, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        seen = (s >= start) & (s < end)
        k = tl.load(k_row + s[:, None] * sk_s + d[None, :], mask=seen[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE or UPCAST:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(seen[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_row + s[:, None] * sv_s + d[None, :], mask=seen[:, None], other=0.0)
        p = p.to(v.dtype)   # the weights round to the cache's dtype for the second product, as SDPA's kernels do
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    out = acc / den[:, None]
    tl.store(o_row + g[:, None] * so_g + d[None, :], out.to(o_row.dtype.element_ty), mask=g[:, None] < G)


@triton.jit
def decode_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, col_ptr, scale,
                            sq_b, sq_h, sq_g, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_g,
                            KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            BLOCK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """q (B, KVH, G, D), k and v (B, KVH, S, D), o (B, KVH, G, D), last dims contiguous; start (B,) and
    col (1,) int64: row b attends to columns start[b] .. col[0] inclusive (start <= col). GP: G padded
    to a power of two >= 16 (tl.dot's least size). IEEE: fp32 inputs multiply in fp32, not TF32.
    UPCAST (the interpreter, whose tl.dot misreads 16-bit inputs): 16-bit values are widened to fp32
    before each product; the products are exact either way, so only the order of the sums differs."""
    pid = tl.program_id(0)
    b = pid // KVH
    h = pid % KVH
    start = tl.load(start_ptr + b).to(tl.int32)
    end = tl.load(col_ptr).to(tl.int32) + 1
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    _attend(q, k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h, o_ptr + b * so_b + h * so_h, start, end,
            scale, sk_s, sv_s, so_g, G, GP, D, BLOCK, IEEE, UPCAST)


@triton.jit
def _rotate(x, xr, cos, sin, DT: tl.constexpr, PLAIN: tl.constexpr):
    """Rotary embedding as the engine's eager ops compute it (`StaticDecoder.rotate`): x * cos +
    rotate_half(x) * sin, xr = rotate_half(x) (loaded with the halves swapped), sin with rotate_half's
    sign folded in; each product and the sum rounded to DT, the compute dtype. On the GPU the products
    and the sum are libdevice's round-to-nearest ops, which the compiler may not contract: written as
    plain ops, Triton fuses the 16-bit round trips away into one fma.rn.bf16x2 (fp32: an FFMA), a rounding
    step off the engine's k in about a quarter of the elements. PLAIN (the interpreter, which has no
    libdevice) computes with plain ops."""
    if PLAIN:
        a = (x.to(tl.float32) * cos.to(tl.float32)).to(DT).to(tl.float32)
        r = (xr.to(tl.float32) * sin.to(tl.float32)).to(DT).to(tl.float32)
        return (a + r).to(DT)
    a = libdevice.mul_rn(x.to(tl.float32), cos.to(tl.float32)).to(DT).to(tl.float32)
    r = libdevice.mul_rn(xr.to(tl.float32), sin.to(tl.float32)).to(DT).to(tl.float32)
    return libdevice.add_rn(a, r).to(DT)


@triton.jit
def decode_attention_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, o_ptr, start_ptr, col_ptr, scale,
                                 s_qkv, s_cos, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_g,
                                 QW: tl.constexpr, KVW: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                                 GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
                                 UPCAST: tl.constexpr, PLAIN: tl.constexpr):
    """The decode step's rotary embedding, cache write and attention in one kernel. qkv (B, QW + 2 KVW):
    the row's q, k and v projections, not yet rotated; cos, sin (B, D): the row's rotary tables (sin
    with rotate_half's sign folded in); k and v (B, KVH, S, D): the cache, whose column col[0] this
    kernel writes (k rotated, v as is) before it attends over start[b] .. col[0], that column read back
    after a block barrier. PLAIN (the interpreter): `_rotate` without libdevice. Else as
    `decode_attention_kernel`."""
    pid = tl.program_id(0)
    b = pid // KVH
    h = pid % KVH
    start = tl.load(start_ptr + b).to(tl.int32)
    col = tl.load(col_ptr).to(tl.int32)
    DT = k_ptr.dtype.element_ty
    d = tl.arange(0, D)
    dr = (d + D // 2) % D   # rotate_half's source of each element
    row = qkv_ptr + b * s_qkv
    cos = tl.load(cos_ptr + b * s_cos + d)
    sin = tl.load(sin_ptr + b * s_cos + d)
    kb = row + QW + h * D
    k_raw, k_half = tl.load(kb + d), tl.load(kb + dr)
    v_new = tl.load(row + QW + KVW + h * D + d)
    g = tl.arange(0, GP)
    qb = row + (h * G + g[:, None]) * D
    live = g[:, None] < G
    # every read of the row's q/k/v issued before the cache writes: the compiler keeps a load after a store to
    # memory the load may alias, and the stores wait for k's loads, so q's loads written after them went out one
    # round trip through memory later (docs/benchmarks.md, Decode attention kernel)
    q_raw, q_half = tl.load(qb + d[None, :], mask=live, other=0.0), tl.load(qb + dr[None, :], mask=live, other=0.0)
    tl.store(k_ptr + b * sk_b + h * sk_h + col * sk_s + d, _rotate(k_raw, k_half, cos, sin, DT, PLAIN))
    tl.store(v_ptr + b * sv_b + h * sv_h + col * sv_s + d, v_new)
    q = _rotate(q_raw, q_half, cos[None, :], sin[None, :], DT, PLAIN)
    if UPCAST:
        q = q.to(tl.float32)
    tl.debug_barrier()   # the column just written is read back below by other threads of the block
    _attend(q, k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h, o_ptr + b * so_b + h * so_h, start,
            col + 1, scale, sk_s, sv_s, so_g, G, GP, D, BLOCK, IEEE, UPCAST)
