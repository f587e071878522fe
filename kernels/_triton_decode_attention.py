"""The rollout's decode-step attention as one Triton kernel. Imported only when it runs.

One program per (row, KV head): it loads the G query heads that share the KV head, walks the cached
columns the row may see, [start[row], col], in blocks of BLOCK columns (`tiles.DECODE_BLOCK_S`) with
an online softmax (fp32 scores, running max and sum), and writes the G output heads. The bounds are
read from device tensors, so the kernel reads only the columns a row needs and a captured CUDA graph
replays it at every column. The launcher picks the pipeline depth that fits the device's shared
memory (`tiles.decode_attention_stages`).
SDPA's memory-efficient kernel, which the decode step called before, tiles 64 queries for the one
token each head has and reads every column of the static cache, masked (docs/benchmarks.md).

If TRITON_INTERPRET=1 is set when triton is first imported, the kernel runs in Triton's CPU
interpreter on CPU tensors (that is how the CPU tests run it).
"""
import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    k_row = k_ptr + b * sk_b + h * sk_h
    v_row = v_ptr + b * sv_b + h * sv_h
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
    tl.store(o_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=g[:, None] < G)
