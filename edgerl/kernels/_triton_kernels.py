"""Triton kernels for token log-probs and entropy. Imported only when the triton backend runs.

Notation: h (N, H) hidden states, W (V, H) lm-head weight, z = (h @ W.T) / temperature in fp32,
lse = logsumexp(z), p = softmax(z), mz = sum_j p_j z_j, entropy = lse - mz.

Both kernels compute a (BLOCK_N x BLOCK_V) tile of z with tl.dot over the hidden size in steps of
BLOCK_K (fp32 accumulation whatever the input dtype) and never write z to memory.

If TRITON_INTERPRET=1 is set when this module is imported, the kernels run in Triton's CPU
interpreter on CPU tensors (that is how the CPU tests run them).
"""
import triton
import triton.language as tl

# Finite stand-in for -inf: exp(NEG_BIG - m) is exactly 0, and 0 * (NEG_BIG - m) is 0, not NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_hn, stride_wv,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """fp32 (BLOCK_N, BLOCK_V) tile of h[rows] @ W[cols].T; out-of-range rows/cols give 0.

    DOT_UPCAST is only set under the interpreter, whose tl.dot multiplies bf16 bit patterns as
    integers (triton-lang/triton#11584). bf16 -> fp32 is exact and bf16 products are exact in fp32,
    so the upcast dot gives what the GPU's bf16 MMA with fp32 accumulation gives.
    """
    ks = tl.arange(0, BLOCK_K)
    # int64 offsets: V * H exceeds 2**31 for e.g. a 256k vocabulary at hidden 8192.
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hn + ks[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wv + ks[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < H - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def fwd_stats_kernel(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, ztgt_ptr,
                     N, V, H, stride_hn, stride_wv, inv_temp, tiles_per_split,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     DOT_UPCAST: tl.constexpr):
    """Online log-sum-exp over one vocabulary split for one block of tokens.

    Grid (cdiv(N, BLOCK_N), n_splits); split s covers vocabulary tiles [s*tiles_per_split, ...).
    Writes, per split and token (buffers of shape (n_splits, N)), relative to the running max m:
    m, s = sum_j exp(z_j - m), t = sum_j exp(z_j - m) (z_j - m); and z[target] into ztgt (N,) from
    the one split whose range holds the target. Keeping t relative to m means the entropy
    log(s) - t/s never subtracts two large numbers, even for logits of 1e3 or more.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)

    m = tl.full((BLOCK_N,), NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ztgt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_begin = pid_s * tiles_per_split * BLOCK_V
    n_tiles = tl.minimum(tiles_per_split, tl.cdiv(V - v_begin, BLOCK_V))
    for i in range(0, n_tiles):
        cols = v_begin + i * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_hn, stride_wv,
                         BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, INPUT_PRECISION, DOT_UPCAST) * inv_temp
        ztgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        # Columns past V get NEG_BIG: exp(NEG_BIG - m_new) is exactly 0 since every tile processed
        # has a real column, so they drop out of s and t without another mask.
        z = tl.where(col_ok[None, :], z, NEG_BIG)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        zm = z - m_new[:, None]
        e = tl.exp(zm)
        if COMPUTE_ENTROPY:
            # sum e^(z-m_new)(z-m_new) = alpha * (t + (m - m_new) * s) + this tile's terms
            t = alpha * (t + (m - m_new) * s) + tl.sum(e * zm, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new

    out = pid_s * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    if COMPUTE_ENTROPY:
        tl.store(t_ptr + out, t, mask=row_ok)
    mine = row_ok & (tgt >= v_begin) & (tgt < v_begin + n_tiles * BLOCK_V)
    tl.store(ztgt_ptr + rows, ztgt, mask=mine)


@triton.jit
def grad_logits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, mz_ptr, dlogp_ptr, dent_ptr, g_ptr,
                       R, C, H, stride_hn, stride_wv, stride_g, col0, inv_temp, n_row_blocks,
                       BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, HAS_DLOGP: tl.constexpr, HAS_DENT: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Gradient w.r.t. the logits for one slab: G (R, C) of rows [0, R) x vocabulary [col0, col0 + C).

    h_ptr, tgt/lse/mz/dlogp/dent point at the slab's first row, w_ptr at W[col0]. With z = logits/T:
      d logp / dz_j = onehot_j - p_j,   d entropy / dz_j = -p_j (z_j - mz),
      G_j = [dlogp * onehot_j - p_j * (dlogp + dent * (z_j - mz))] / T.
    1-D grid over (row block, col block), row blocks fastest: programs running together share one
    W tile, and h (N x H) is small enough to stay in L2.
    """
    pid = tl.program_id(0)
    pid_r = pid % n_row_blocks
    pid_c = pid // n_row_blocks
    rows = pid_r * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_c * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < R
    col_ok = cols < C
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_hn, stride_wv,
                     BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, INPUT_PRECISION, DOT_UPCAST) * inv_temp
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    if HAS_DLOGP:
        dl = tl.load(dlogp_ptr + rows, mask=row_ok, other=0.0)
    else:
        dl = tl.zeros((BLOCK_N,), dtype=tl.float32)
    coef = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32) + dl[:, None]
    if HAS_DENT:
        de = tl.load(dent_ptr + rows, mask=row_ok, other=0.0)
        mz = tl.load(mz_ptr + rows, mask=row_ok, other=0.0)
        coef += de[:, None] * (z - mz[:, None])
    g = -p * coef
    if HAS_DLOGP:
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        g += tl.where((cols + col0)[None, :] == tgt[:, None], dl[:, None], 0.0)
    g = g * inv_temp
    g_ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# triton.jit returns an InterpretedFunction instead of a JITFunction under TRITON_INTERPRET=1.
INTERPRETED = not isinstance(fwd_stats_kernel, triton.runtime.jit.JITFunction)
