"""A whole decoder layer of the rollout's decode step as one persistent Triton kernel. Imported only when
it runs.

The Triton layers (`decode_linear_kernel` around `decode_attention_rope_kernel`) are five kernels per layer,
and at 16 rows each costs its start-up and its ramp whatever it reads (docs/benchmarks.md section 17).
`decode_layer_kernel` runs the same five steps as phases of one launch: a grid of at most one program per SM
(all resident together), each program taking the phase's work items (`_linear_tile`'s tiles, then
`_attention_rope_item`'s (row, KV head) pairs) in turn, and a grid barrier between phases, since each reads
what the one before wrote:

    q/k/v (norm fused) -> rotary + cache write + attention -> o (+ residual, sums of squares)
    -> gate/up (norm fused, SiLU * up) -> down (+ residual, sums of squares)

The tiles, rounding and sums are those of the five kernels (the same functions), so the layer gives their
results bit for bit. Data a phase reads that another program wrote in this launch is loaded past L1
(`_ld`'s FRESH). The barrier: every program counts itself in an int32 counter (release, at GPU scope, after
a block barrier so every thread's stores are issued) and waits until the count reaches the phase's total
(acquire); the last program out sets the counters back to zero for the next launch.

If TRITON_INTERPRET=1 is set when triton is first imported, the kernel runs in Triton's CPU interpreter,
which runs programs one after another: the launcher gives it one program, whose barriers pass at once.
"""
import os

import triton
import triton.language as tl

from ._triton_decode_attention import _attention_rope_item
from ._triton_decode_linear import _linear_tile, _prefetch_l2

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until every program has arrived here `target / programs` times (the phase number)."""
    tl.debug_barrier()   # every thread's stores issued before this program's count
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _linear_phase(pid, nprog, n_n, n_m, x_ptr, ln_ptr, w_ptr, b_ptr, res_ptr, out_ptr, ssq_in_ptr, ssq_out_ptr,
                  ws_ptr, cnt_ptr, B, K, N, eps, sx, sw, sres, sout, INTER, NB, KS, NORM: tl.constexpr,
                  SSQ_IN: tl.constexpr, NBP: tl.constexpr, GLU: tl.constexpr, RESID: tl.constexpr,
                  SSQ_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PLAIN: tl.constexpr,
                  SWAP: tl.constexpr):
    """This program's tiles of one product: items pid, pid + nprog, ... of n_n x n_m x SPLIT."""
    for t in range(pid, n_n * n_m * SPLIT, nprog):
        pid_n = t % n_n
        pid_m = (t // n_n) % n_m
        pid_k = t // (n_n * n_m)
        _linear_tile(pid_n, pid_m, pid_k, n_n, x_ptr, ln_ptr, w_ptr, b_ptr, res_ptr, out_ptr, ssq_in_ptr, ssq_out_ptr,
                     ws_ptr, cnt_ptr, B, K, N, eps, sx, sw, sres, sout, INTER, NB, KS, NORM, SSQ_IN, NBP, GLU, RESID,
                     SSQ_OUT, HAS_BIAS, SPLIT, BM, BN, BK, IEEE, UPCAST, PLAIN, SWAP, True)


@triton.jit
def _prefetch_phase(pid, nprog, n_n, n_m, w_ptr, N, K, KS, sw, INTER, SPLIT: tl.constexpr, BN: tl.constexpr,
                    GLU: tl.constexpr, ESZ: tl.constexpr):
    """Ask L2 for the weight rows and columns this program's tiles of a product will read (see
    `_linear_phase`'s order)."""
    for t in range(pid, n_n * n_m * SPLIT, nprog):
        pid_n = t % n_n
        pid_k = t // (n_n * n_m)
        if (t // n_n) % n_m == 0:   # the row blocks share the weight: once per (columns, slice)
            cols = pid_n * BN + tl.arange(0, BN)
            k_lo = pid_k * KS
            ncols = tl.minimum(K, k_lo + KS) - k_lo
            _prefetch_l2(w_ptr, cols, N, k_lo, ncols, sw, ESZ)
            if GLU:
                _prefetch_l2(w_ptr + INTER * sw, cols, N, k_lo, ncols, sw, ESZ)


@triton.jit
def _prefetch_cache(pid, nprog, B, k_ptr, v_ptr, start_ptr, col_ptr, sk_b, sk_h, sv_b, sv_h, KVH: tl.constexpr,
                    D: tl.constexpr, ESZ: tl.constexpr):
    """Ask L2 for the cache columns start[b] .. col - 1 of k and v that this program's attention items read."""
    col = tl.load(col_ptr).to(tl.int32)
    i = tl.arange(0, 2)
    for t in range(pid, B * KVH, nprog):
        b = t // KVH
        h = t % KVH
        start = tl.load(start_ptr + b).to(tl.int32)
        base = tl.where(i == 0, k_ptr + b * sk_b + h * sk_h + start * D, v_ptr + b * sv_b + h * sv_h + start * D)
        if col > start:
            _prefetch_l2(base, i * 0, 1, 0, (col - start) * D, 0, ESZ)


@triton.jit
def decode_layer_kernel(x_ptr, ssq0_ptr, ln1_ptr, qkv_w, qkv_b, qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, att_ptr,
                        start_ptr, col_ptr, o_w, o_b, xm_ptr, ssq1_ptr, ln2_ptr, gu_w, gu_b, h_ptr, dn_w, dn_b, xo_ptr,
                        ssq2_ptr, ws_ptr, cnt_ptr, bar_ptr, scale, eps1, eps2, B, H, INTER, NQKV, NB0, NB1, s_cos,
                        sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, KS_O, KS_D,
                        QW: tl.constexpr, KVW: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                        D: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, NBP0: tl.constexpr,
                        NBP1: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, SWAP_QKV: tl.constexpr,
                        BN_O: tl.constexpr, BK_O: tl.constexpr, SPLIT_O: tl.constexpr, BN_GU: tl.constexpr,
                        BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr, SPLIT_D: tl.constexpr,
                        BIAS_QKV: tl.constexpr, BIAS_O: tl.constexpr, BIAS_GU: tl.constexpr, BIAS_D: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr, PLAIN: tl.constexpr, PF_QKV: tl.constexpr = False,
                        PF_KV: tl.constexpr = False, PF_O: tl.constexpr = False, PF_GU: tl.constexpr = False,
                        PF_D: tl.constexpr = False, ESZ: tl.constexpr = 2):
    """One decoder layer for B rows. x (B, H): the residual stream in, with its sums of squares as (NB0, B)
    fp32 partials ssq0; weights as the Triton layers take them (qkv_w (NQKV, H), o_w (H, QW), gu_w (2 INTER,
    H), dn_w (H, INTER), biases where BIAS_*, norms ln1, ln2); cos, sin (B, D), the cache k and v (B, KVH,
    S, D), start (B,), col (1,) as `decode_attention_rope_kernel` takes them. Written: qkv (B, NQKV), att
    (B, QW), xm (B, H) and its partials ssq1 (NB1, B), h (B, INTER), and the layer's output xo (B, H) with
    its partials ssq2 (cdiv(H, BN_D), B) for the next layer. ws (fp32, SPLIT x B x H at least) and cnt (int32,
    zero) for the split products, bar (int32 (2,), zero) for the barriers. Every tensor contiguous.
    PF_*: first, each program asks L2 (bulk prefetch, sm_90; ESZ bytes per element) for what its items of
    that phase will read: the weights of q/k/v, o, gate/up, down and the cache columns of attention, so the
    later phases read from L2 while the earlier ones run (the launcher picks the phases that fit)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.cdiv(B, BM)
    if PF_QKV:
        _prefetch_phase(pid, nprog, tl.cdiv(NQKV, BN_QKV), n_m, qkv_w, NQKV, H, H, H, 0, 1, BN_QKV, False, ESZ)
    if PF_KV:
        _prefetch_cache(pid, nprog, B, k_ptr, v_ptr, start_ptr, col_ptr, sk_b, sk_h, sv_b, sv_h, KVH, D, ESZ)
    if PF_O:
        _prefetch_phase(pid, nprog, tl.cdiv(H, BN_O), n_m, o_w, H, QW, KS_O, QW, 0, SPLIT_O, BN_O, False, ESZ)
    if PF_GU:
        _prefetch_phase(pid, nprog, tl.cdiv(INTER, BN_GU), n_m, gu_w, INTER, H, H, H, INTER, 1, BN_GU, True, ESZ)
    if PF_D:
        _prefetch_phase(pid, nprog, tl.cdiv(H, BN_D), n_m, dn_w, H, INTER, KS_D, INTER, 0, SPLIT_D, BN_D, False,
                        ESZ)
    _linear_phase(pid, nprog, tl.cdiv(NQKV, BN_QKV), n_m, x_ptr, ln1_ptr, qkv_w, qkv_b, x_ptr, qkv_ptr, ssq0_ptr,
                  ssq0_ptr, ws_ptr, cnt_ptr, B, H, NQKV, eps1, H, H, 0, NQKV, 0, NB0, H, True, True, NBP0, False,
                  False, False, BIAS_QKV, 1, BM, BN_QKV, BK_QKV, IEEE, UPCAST, PLAIN, SWAP_QKV)
    _grid_sync(bar_ptr, nprog)
    for t in range(pid, B * KVH, nprog):
        _attention_rope_item(t, qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, att_ptr, start_ptr, col_ptr, scale, NQKV,
                             s_cos, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, QW, G * D, D, QW, KVW, KVH, G, GP, D, BLOCK,
                             IEEE, UPCAST, PLAIN, True)
    _grid_sync(bar_ptr, 2 * nprog)
    _linear_phase(pid, nprog, tl.cdiv(H, BN_O), n_m, att_ptr, ln1_ptr, o_w, o_b, x_ptr, xm_ptr, ssq0_ptr, ssq1_ptr,
                  ws_ptr, cnt_ptr, B, QW, H, eps1, QW, QW, H, H, 0, NB0, KS_O, False, False, NBP0, False, True, True,
                  BIAS_O, SPLIT_O, BM, BN_O, BK_O, IEEE, UPCAST, PLAIN, False)
    _grid_sync(bar_ptr, 3 * nprog)
    _linear_phase(pid, nprog, tl.cdiv(INTER, BN_GU), n_m, xm_ptr, ln2_ptr, gu_w, gu_b, xm_ptr, h_ptr, ssq1_ptr,
                  ssq1_ptr, ws_ptr, cnt_ptr, B, H, INTER, eps2, H, H, 0, INTER, INTER, NB1, H, True, True, NBP1, True,
                  False, False, BIAS_GU, 1, BM, BN_GU, BK_GU, IEEE, UPCAST, PLAIN, False)
    _grid_sync(bar_ptr, 4 * nprog)
    _linear_phase(pid, nprog, tl.cdiv(H, BN_D), n_m, h_ptr, ln2_ptr, dn_w, dn_b, xm_ptr, xo_ptr, ssq1_ptr, ssq2_ptr,
                  ws_ptr, cnt_ptr, B, INTER, H, eps2, INTER, INTER, H, H, 0, NB1, KS_D, False, False, NBP1, False,
                  True, True, BIAS_D, SPLIT_D, BM, BN_D, BK_D, IEEE, UPCAST, PLAIN, False)
    # The last program out sets the counters back: every program has left every barrier by then.
    tl.debug_barrier()
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)
