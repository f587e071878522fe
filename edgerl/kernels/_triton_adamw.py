"""The bf16 AdamW step of edgerl/adamw_bf16.py as one Triton kernel. Imported only when it runs.

Each program steps BLOCK elements: it loads the bf16 weight, gradient and moments (and the Kahan
compensation), computes the step in fp32 as torch's AdamW does, draws its random bits with Philox
inside the kernel and stores the rounded results. One launch per parameter, no temporaries in
memory, where the eager step makes about 30 kernels and 24 bytes of temporaries per element of a
2M-element chunk.

Random bits: Philox-4x32 (10 rounds) keyed by the step's 64-bit seed, counter = (element index low
32 bits, high 32 bits, 0, 0); the low 16 bits of three of its four 32-bit outputs round the first
moment, the second moment and the weight. The element index counts from the start of the local shard
(`offset` is where the given piece starts), so a shard stepped whole and one streamed through in
pieces draw the same bits.

If TRITON_INTERPRET=1 is set when triton is first imported, the kernel runs in Triton's CPU
interpreter on CPU tensors (that is how the CPU tests run it).
"""
import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024


@triton.jit
def _round_sr(x, bits):
    """fp32 -> bf16, rounded away from zero with probability (dropped part) / (bf16 spacing); bits:
    int32 in [0, 2^16). As adamw_bf16.round_stochastic: add to the low half, clear it, and the
    conversion of the cleared value is exact."""
    r = (x.to(tl.int32, bitcast=True) + bits) & -65536
    return r.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _round_nearest(x):
    """fp32 -> bf16 rounded to nearest, ties to even, in integer arithmetic (Triton's interpreter
    truncates in its own conversion; on a GPU this is the conversion's rounding); NaN stays NaN."""
    xi = x.to(tl.int32, bitcast=True)
    r = (xi + (0x7FFF + ((xi >> 16) & 1))) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True)).to(tl.bfloat16)


@triton.jit
def adamw_bf16_kernel(w_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, offset, seed,
                      one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, bc2_sqrt,
                      KAHAN: tl.constexpr, BLOCK: tl.constexpr):
    """w <- w * decay - step_size * m / (sqrt(v) / bc2_sqrt + eps), with m, v updated first:
    decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t).
    Moments are stored stochastically rounded; the weight too (KAHAN=False) or rounded to nearest with
    the remainder kept in the compensation buffer c (KAHAN=True)."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)

    counter = idx + offset
    lo = (counter & 0xFFFFFFFF).to(tl.uint32)
    hi = (counter >> 32).to(tl.uint32)
    zero = lo * 0
    r0, r1, r2, _ = tl.philox(seed, lo, hi, zero, zero)

    m = m + one_minus_beta1 * (g - m)           # torch's lerp_ for a weight below 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    tl.store(m_ptr + idx, _round_sr(m, (r0 & 0xFFFF).to(tl.int32)), mask=mask)
    tl.store(v_ptr + idx, _round_sr(v, (r1 & 0xFFFF).to(tl.int32)), mask=mask)
    # the step uses this step's exact moments; only what is stored for the next step is rounded
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    if KAHAN:
        w = w + tl.load(c_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    w = w * decay - step_size * tl.div_rn(m, denom)
    if KAHAN:
        nearest = _round_nearest(w)
        tl.store(w_ptr + idx, nearest, mask=mask)
        tl.store(c_ptr + idx, _round_nearest(w - nearest.to(tl.float32)), mask=mask)
    else:
        tl.store(w_ptr + idx, _round_sr(w, (r2 & 0xFFFF).to(tl.int32)), mask=mask)
