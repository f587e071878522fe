"""A few rows times an NF4 weight, in one kernel that reads the 4-bit codes once (the rollout's decode step).

bitsandbytes multiplies a few rows by a 4-bit weight in two steps: dequantize the whole weight to the
compute dtype (writing N x K values), then a GEMM that reads them back. For a decode step of 16 rows in
fp32 (what a P40 plan computes in), that is 8.5 bytes moved per weight for 32 flops, and it was most of
the step (docs/benchmarks.md, Fused NF4 decode kernel). This kernel reads the packed codes (0.5 bytes a weight) and
their block scales, decodes them in registers and multiplies in fp32: the same products, no fp32 copy.

    y = x @ W.T (+ bias),  W[n, k] = code[q(n, k)] * absmax[(n K + k) // blocksize]

with q the 4-bit code (two per byte, the first element in the high nibble) and, under double
quantization, absmax[b] = code2[qabsmax[b]] * absmax2[b // blocksize2] + offset, exactly as
`bitsandbytes.functional.dequantize_4bit` computes it. A state with `block_offsets` (one offset per nested block:
several weights stacked as one, each with its own offset, `edgerl.rollout.lora_group`) adds
block_offsets[b // blocksize2] instead. x in fp32, fp16 or bf16; the products and sums
in fp32; y in x's dtype. `reference` is the same formula in plain torch, slowly; the tests compare the
kernel with it and with bitsandbytes on random weights of odd sizes.

Work split: each lane owns R (1 or 2) rows of W and reads 64 codes of a row at a time (two 16-byte
loads); a block of 8 warps owns 32 R rows and up to MT = 16 rows of x, and its warps take turns over
the steps of 64 along K. Each warp stages its own 64 columns of x in shared memory (MT x 1 KB), which
all lanes then read at the same address (a broadcast), so one staged value feeds R x 32 multiply-adds.
Partial sums stay in registers (R x MT a lane) and meet in shared memory at the end (32 MT KB at most,
within the 48 KB a Pascal block may use). K is also split across blocks where that fills the GPU's
waves better (`_splits`), and a second small kernel then adds the fp32 partials. A LoRA adapter
(`lora=`) rides along: its A as r more rows of the weight in fp32 (x A^T summed with the rest), and
scale * (x A^T) B^T joins the second kernel's sum; no kernel of its own (docs/benchmarks.md, Fused NF4 decode kernel).
A first version (a warp per 8 K-chunked rows, x chunks behind a block barrier) was barely ahead of bitsandbytes
(docs/lab-log.md, 2026-12-01, NF4 kernel versions; this one: docs/benchmarks.md, Fused NF4 decode kernel).

fp16 x on CC 7.5 and up (a T4's fp16 plan; Ampere and later in fp16; not a V100, whose tensor cores lack
mma.sync m16n8k8) goes to a second kernel, `nf4_mma`, on tensor cores (`tensor_cores`): at 16 rows the fp32
kernel's 32 fp32 FLOPs a 4-bit weight take longer than reading the weight on such cards (a T4: 8.1 TFLOP/s of
fp32 against 320 GB/s, 25 FLOPs a byte; the weight is 64 FLOPs a byte), while mma.sync multiplies fp16 at several
times that rate. It decodes each code to
its value in fp16 (the code table rounded to fp16), multiplies 64 columns of K at a time on tensor cores with
fp32 sums, and scales each step's sums by the rows' fp32 block scales: W[n, k] counts as fp16(code) x absmax,
each value within 2^-11 of the exact weight, relatively, as bitsandbytes' own fp16 weight (code x absmax rounded
to fp16) is. `reference(..., fp16_codes=True)` is that formula; a LoRA adapter's x A^T stays in fp32.

Compiled at run time with NVRTC (`nvrtc.py`) for the GPU's own architecture: CC 6.0 and up with a
CUDA 12 torch, 7.5 and up with CUDA 13.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .nvrtc import KernelUnavailable, blocks_per_sm, kernel
from .tiles import nf4_on_tensor_cores

MAX_ROWS_PER_BLOCK = 16
WARPS = 8
SUM_ROWS = 4       # rows of x per block of splits_sum (the source's SUM_ROWS)
MAX_ROWS = 65535   # rows of x one call takes (nf4_mm's grid has a block row per 16 rows, splits_sum per 4)
MAX_RANK = 256   # a LoRA adapter's rank the kernels take (splits_sum stages x A^T in 256 floats of shared memory)

COMMON = r"""
typedef unsigned char u8;
typedef unsigned short u16;
struct h16 { u16 v; };
struct b16 { u16 v; };

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const h16* p) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p->v)); return f; }
__device__ __forceinline__ float ld(const b16* p) { return __uint_as_float(((unsigned)p->v) << 16); }
__device__ __forceinline__ void st(float* p, float f) { *p = f; }
__device__ __forceinline__ void st(h16* p, float f) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); p->v = h; }
__device__ __forceinline__ void st(b16* p, float f) {   // round to nearest even, as torch's cast does
  unsigned u = __float_as_uint(f);
  p->v = (f != f) ? (u16)0x7fc0 : (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }

"""

# The splits' partial sums added up with the bias and a LoRA adapter's term (fp32_mm.py launches it too).
SUM_SOURCE = r"""
// The partial sums of the splits added up, the bias, and a LoRA adapter's share scale * t B[n]^T, with
// t = x A^T summed from its own partials (columns N.. of the workspace) into shared memory first. Where several
// weights are stacked as one (a layer's q, k and v: edgerl.rollout.lora_group), so are their adapters: A's rows
// (rank each) one after another, B's rows with the weight's; the columns from b1 (and from b2) take the second
// (third) adapter's rank columns of t. Block:
// 256 output columns of SUM_ROWS rows of x. A thread reads its column's row of B once, four floats at a
// time, for all its rows (the first version, a block per row reading B one float at a time, waited on
// those loads in turn: docs/lab-log.md, Figures from earlier code comments). Every output's sum runs in the same
// order as before: the splits in turn, the bias, then scale * sum_j t[j] B[n, j] over j in turn.
#define SUM_ROWS 4
template <typename T>
__global__ void __launch_bounds__(256) splits_sum(const float* __restrict__ ws, const T* __restrict__ bias,
                                                  T* __restrict__ y, int M, int N, int splits, int has_bias,
                                                  const float* __restrict__ lb, int rank, double lscale, int wsn,
                                                  int b1, int b2) {
  __shared__ __align__(16) float t[SUM_ROWS * 256];
  const int m0 = blockIdx.y * SUM_ROWS, n = blockIdx.x * 256 + threadIdx.x;
  const int ranks = rank * (1 + (b1 < N) + (b2 < N));   // x A^T's columns: every stacked adapter's
  for (int i = threadIdx.x; i < SUM_ROWS * ranks; i += 256) {
    const int m = i / ranks, j = i - m * ranks;
    float v = 0.f;
    if (m0 + m < M)
      for (int s = 0; s < splits; ++s) v += ws[((long long)s * M + m0 + m) * wsn + N + j];
    t[m * 256 + j] = v;
  }
  __syncthreads();
  if (n >= N) return;
  float v[SUM_ROWS], l[SUM_ROWS];
#pragma unroll
  for (int m = 0; m < SUM_ROWS; ++m) {
    v[m] = 0.f;
    l[m] = 0.f;
  }
  for (int s = 0; s < splits; ++s) {
#pragma unroll
    for (int m = 0; m < SUM_ROWS; ++m)
      if (m0 + m < M) v[m] += ws[((long long)s * M + m0 + m) * wsn + n];
  }
  if (rank) {
    const float* b = lb + (long long)n * rank;
    const int tj = rank * ((n >= b1) + (n >= b2));   // this column's adapter's first column of t
    const bool vec = (rank & 3) == 0;   // then B's rows are 16-byte aligned (cudaMalloc'd, rank a multiple of 4)
    for (int j = 0; j < rank; j += 4) {
      float4 bv;
      if (vec) {
        bv = *(const float4*)&b[j];
      } else {
        bv.x = b[j];
        bv.y = j + 1 < rank ? b[j + 1] : 0.f;
        bv.z = j + 2 < rank ? b[j + 2] : 0.f;
        bv.w = j + 3 < rank ? b[j + 3] : 0.f;
      }
#pragma unroll
      for (int m = 0; m < SUM_ROWS; ++m) {
        const float* tm = t + m * 256 + tj + j;
        float a = fmaf(tm[0], bv.x, l[m]);
        if (j + 1 < rank) a = fmaf(tm[1], bv.y, a);
        if (j + 2 < rank) a = fmaf(tm[2], bv.z, a);
        if (j + 3 < rank) a = fmaf(tm[3], bv.w, a);
        l[m] = a;
      }
    }
  }
  const float hb = has_bias ? ld(bias + n) : 0.f;
#pragma unroll
  for (int m = 0; m < SUM_ROWS; ++m) {
    if (m0 + m >= M) break;
    float o = v[m];
    if (has_bias) o += hb;
    if (rank) o += (float)lscale * l[m];
    st(y + (long long)(m0 + m) * N + n, o);
  }
}
"""

SOURCE = COMMON + r"""
// A warp's 64 columns of the MT rows of x from column k, into its shared-memory stage (zeros past row M).
template <typename T, int MT>
__device__ __forceinline__ void stage_x(float* xs, const T* __restrict__ x, int M, int K, int m0, int k, int lane) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int gm = m0 + m;
    const T* xr = x + (long long)gm * K + k;
    xs[m * 64 + lane] = gm < M ? ld(xr + lane) : 0.f;
    xs[m * 64 + 32 + lane] = gm < M ? ld(xr + 32 + lane) : 0.f;
  }
}

// Block: 8 warps, 32 R rows of W (lane l of the warp owns rows n0 + 32 r + l), MT rows of x, the K steps
// (64 codes each) of split blockIdx.z; warp w takes every 8th step. x is staged per warp (no block barrier
// in the loop) and read by all lanes at one address (a broadcast). The warps' partial sums meet in shared
// memory at the end; with more than one split, or a LoRA adapter, each split writes fp32 partials (rows of
// `wsn` columns) that splits_sum adds up.
// A LoRA adapter's x A^T rides along as `rank` more rows of W, in fp32: the blocks past the weight's last
// (blockIdx.x >= N tiles) multiply by rows of A (r, K) instead of decoded codes and write their partials
// in columns N.. of the same rows, which splits_sum adds up before it multiplies by B. A separate kernel for
// x A^T (cuBLAS: a split-K GEMM and its reduction) cost more (docs/lab-log.md, 2026-12-01, NF4 kernel versions).
template <typename T, int MT, int R>
__global__ void __launch_bounds__(256) nf4_mm(
    const T* __restrict__ x, const u8* __restrict__ w, const u8* __restrict__ qabs,
    const float* __restrict__ abs2, const float* __restrict__ code2, const float* __restrict__ offp,
    const float* __restrict__ absf, const float* __restrict__ code, const T* __restrict__ bias,
    T* __restrict__ y, float* __restrict__ ws, int M, int N, int K, int lbs, int lbs2, int nested,
    int has_bias, int steps_per_split, const float* __restrict__ la, int rank, int wsn) {
  __shared__ __align__(16) float sm[8 * MT * 64];   // x stages; then the partial sums (R <= 2 fits)
  __shared__ float c2[256];
  __shared__ float c16[16];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wtiles = (N + 32 * R - 1) / (32 * R);
  const bool atile = blockIdx.x >= wtiles;   // this block multiplies by rows of A
  const int n0 = (atile ? blockIdx.x - wtiles : blockIdx.x) * 32 * R, m0 = blockIdx.y * MT;
  const int s0 = blockIdx.z * steps_per_split, s1 = min(K >> 6, s0 + steps_per_split);
  if (nested) c2[tid] = code2[tid];
  if (tid < 16) c16[tid] = code[tid];
  __syncthreads();
  const float off = nested == 1 ? *offp : 0.f;   // nested 2: an offset per nested block (offp[b >> lbs2])
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  float* xs = sm + warp * MT * 64;
  if (atile) {   // rows of A in fp32, 4 columns at a time: a loop of its own, so the codes' loop keeps its registers
    for (int s = s0 + warp; s < s1; s += 8) {
      const int k = s << 6;
      __syncwarp();
      stage_x<T, MT>(xs, x, M, K, m0, k, lane);
      __syncwarp();
#pragma unroll 1
      for (int jc = 0; jc < 16; jc += 4) {   // four float4 loads per row in flight, then their products
        float4 av[4][R];
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const int jr = n0 + 32 * r + lane;
            av[q][r] = jr < rank ? *(const float4*)&la[(long long)jr * K + k + 4 * (jc + q)]
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            const float4 a = *(const float4*)&xs[m * 64 + 4 * (jc + q)];
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float t = acc[r][m];
              t = fmaf(av[q][r].x, a.x, t); t = fmaf(av[q][r].y, a.y, t);
              t = fmaf(av[q][r].z, a.z, t); t = fmaf(av[q][r].w, a.w, t);
              acc[r][m] = t;
            }
          }
      }
    }
  } else {
    for (int s = s0 + warp; s < s1; s += 8) {
      const int k = s << 6;
      uint4 raw[R][2];
      float scale[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int n = n0 + 32 * r + lane;
        if (n < N) {
          const long long flat = (long long)n * K + k;
          const uint4* p = (const uint4*)(w + (flat >> 1));
          raw[r][0] = p[0];
          raw[r][1] = p[1];
          const long long b = flat >> lbs;
          scale[r] = nested ? c2[qabs[b]] * abs2[b >> lbs2] + (nested == 2 ? offp[b >> lbs2] : off) : absf[b];
        } else {
          raw[r][0] = make_uint4(0, 0, 0, 0);
          raw[r][1] = raw[r][0];
          scale[r] = 0.f;
        }
      }
      __syncwarp();
      stage_x<T, MT>(xs, x, M, K, m0, k, lane);
      __syncwarp();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float wv[R][32];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const unsigned q4[4] = {raw[r][h].x, raw[r][h].y, raw[r][h].z, raw[r][h].w};
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              const unsigned q = (q4[i] >> (8 * b)) & 0xffu;
              wv[r][8 * i + 2 * b] = c16[q >> 4] * scale[r];
              wv[r][8 * i + 2 * b + 1] = c16[q & 15u] * scale[r];
            }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float4 a = *(const float4*)&xs[m * 64 + 32 * h + 4 * j];
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float t = acc[r][m];
              t = fmaf(wv[r][4 * j], a.x, t); t = fmaf(wv[r][4 * j + 1], a.y, t);
              t = fmaf(wv[r][4 * j + 2], a.z, t); t = fmaf(wv[r][4 * j + 3], a.w, t);
              acc[r][m] = t;
            }
          }
        }
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) sm[(warp * MT + m) * 32 * R + 32 * r + lane] = acc[r][m];
  __syncthreads();
  const int lim = atile ? rank : N, col = atile ? N : 0;
  for (int o = tid; o < 32 * R * MT; o += 256) {
    const int m = o / (32 * R), rr = o - m * 32 * R, n = n0 + rr, gm = m0 + m;
    if (n >= lim || gm >= M) continue;
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) v += sm[(i * MT + m) * 32 * R + rr];
    if (gridDim.z == 1 && !rank) {
      if (has_bias) v += ld(bias + n);
      st(y + (long long)gm * N + n, v);
    } else {
      ws[((long long)blockIdx.z * M + gm) * wsn + col + n] = v;
    }
  }
}

// fp16 x on tensor cores (CC 7.5 and up): y = x W^T by mma.sync m16n8k8 (fp16 in, fp32 sums). A step is 64
// columns of K, inside one block of scales (the block size is 64 or a larger power of two): the step's 4-bit codes
// become their fp16 values (the code table rounded to fp16), multiply x over the step on tensor cores, and the
// step's sums times each row's fp32 block scale join fp32 accumulators. So W[n, k] counts as fp16(code) x scale,
// as near the exact weight as bitsandbytes' fp16 weight (code x scale rounded to fp16), for one multiply a row a
// step instead of one a weight.
// Block: MW warps; warp w owns 32 rows of W (four tiles of 8) and 16 rows of x from m0, and walks the steps of
// split blockIdx.z. K is permuted inside a step so that loads stay wide: lane (g = lane / 4, q = lane % 4) reads
// 16 consecutive codes of row g of each tile (8 bytes) and 16 consecutive columns of rows g and g + 8 of x, all
// from column k + 16 q; mma j of the step (j < 8) takes their pair j, so its A and B fragments hold the same
// columns of K. Blocks past the weight's tiles (blockIdx.x >= wtiles) multiply x by ATILE rows of a LoRA adapter's A
// in fp32, their partials in columns N.. of the workspace.
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float h2f(unsigned h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h)); return f; }
__device__ __forceinline__ unsigned word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

#define ATILE 8   // rows of a LoRA adapter's A a block of nf4_mma takes (the source's ATILE)
template <int MW>
__global__ void __launch_bounds__(MW * 32, 5) nf4_mma(
    const h16* __restrict__ x, const u8* __restrict__ w, const u8* __restrict__ qabs,
    const float* __restrict__ abs2, const float* __restrict__ code2, const float* __restrict__ offp,
    const float* __restrict__ absf, const float* __restrict__ code, const h16* __restrict__ bias,
    h16* __restrict__ y, float* __restrict__ ws, int M, int N, int K, int lbs, int lbs2, int nested,
    int has_bias, int steps_per_split, const float* __restrict__ la, int rank, int wsn) {
#if __CUDA_ARCH__ >= 750
  __shared__ float c2[256];
  __shared__ u16 c16[16];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int wtiles = (N + 32 * MW - 1) / (32 * MW);
  const int m0 = blockIdx.y * 16;
  const int s0 = blockIdx.z * steps_per_split, s1 = min(K >> 6, s0 + steps_per_split);
  for (int i = tid; i < 256; i += MW * 32) c2[i] = nested ? code2[i] : 0.f;
  if (tid < 16) c16[tid] = f2h(code[tid]);
  __syncthreads();
  const float off = nested == 1 ? *offp : 0.f;   // nested 2: an offset per nested block (offp[b >> lbs2])
  const u16* xh = (const u16*)x;
  if (blockIdx.x >= wtiles) {   // rows r0 + MW i of A: lane l takes columns 4 l .. 4 l + 3 of every 128
    constexpr int RA = ATILE / MW;
    const int r0 = (blockIdx.x - wtiles) * ATILE + warp;
    float acc[RA][16];
#pragma unroll
    for (int i = 0; i < RA; ++i)
#pragma unroll
      for (int m = 0; m < 16; ++m) acc[i][m] = 0.f;
    for (int k = (s0 << 6) + 4 * lane; k < (s1 << 6); k += 128) {
      float4 a[RA];
#pragma unroll
      for (int i = 0; i < RA; ++i)
        a[i] = r0 + MW * i < rank ? *(const float4*)&la[(long long)(r0 + MW * i) * K + k] : make_float4(0, 0, 0, 0);
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const uint2 hx = m0 + m < M ? *(const uint2*)&xh[(long long)(m0 + m) * K + k] : make_uint2(0, 0);
        const float x0 = h2f(hx.x & 0xffffu), x1 = h2f(hx.x >> 16), x2 = h2f(hx.y & 0xffffu), x3 = h2f(hx.y >> 16);
#pragma unroll
        for (int i = 0; i < RA; ++i)
          acc[i][m] = fmaf(a[i].w, x3, fmaf(a[i].z, x2, fmaf(a[i].y, x1, fmaf(a[i].x, x0, acc[i][m]))));
      }
    }
#pragma unroll
    for (int i = 0; i < RA; ++i) {
      float mine = 0.f;   // lane m < 16 keeps row m's sum
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        float v = acc[i][m];
#pragma unroll
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == m) mine = v;
      }
      const int r = r0 + MW * i;
      if (r < rank && lane < 16 && m0 + lane < M) ws[((long long)blockIdx.z * M + m0 + lane) * wsn + N + r] = mine;
    }
    return;
  }
  const int n0 = blockIdx.x * 32 * MW + warp * 32;
  float acc[4][4];
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  const bool r0ok = m0 + g < M, r1ok = m0 + g + 8 < M;
  const u16* x0 = xh + (long long)(m0 + g) * K;
  const u16* x1 = xh + (long long)(m0 + g + 8) * K;
  for (int s = s0; s < s1; s += 2) {   // two steps an iteration, all their loads issued first
    uint2 raw[2][4];
    float own[2][4];   // the block scale of this lane's row of each tile
    uint4 xa[2][2], xb[2][2];   // columns k .. k + 15 of rows g and g + 8 of x
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool live = s + h < s1;
      const int kb = (s + h) << 6, k = kb + 16 * q;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int n = n0 + 8 * t + g;
        if (n < N && live) {
          raw[h][t] = *(const uint2*)(w + (((long long)n * K + k) >> 1));
          const long long b = ((long long)n * K + kb) >> lbs;
          own[h][t] = nested ? c2[qabs[b]] * abs2[b >> lbs2] + (nested == 2 ? offp[b >> lbs2] : off) : absf[b];
        } else {
          raw[h][t] = make_uint2(0, 0);
          own[h][t] = 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        xa[h][i] = (r0ok && live) ? *(const uint4*)(x0 + k + 8 * i) : make_uint4(0, 0, 0, 0);
        xb[h][i] = (r1ok && live) ? *(const uint4*)(x1 + k + 8 * i) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        unsigned b[8];   // b[j]: codes 2 j (byte j's high nibble) and 2 j + 1 in fp16, from the shared table
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const unsigned byte = ((j < 4 ? raw[h][t].x : raw[h][t].y) >> (8 * (j & 3))) & 0xffu;
          b[j] = (unsigned)c16[byte >> 4] | ((unsigned)c16[byte & 15u] << 16);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          asm volatile(
              "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
              : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
              : "r"(word_of(xa[h][j >> 2], j & 3)), "r"(word_of(xb[h][j >> 2], j & 3)), "r"(b[j]));
        }
        // c: rows g (0, 1) and g + 8 (2, 3) of x, columns 2 q and 2 q + 1 of the tile, whose scales lanes 8 q
        // and 8 q + 4 (g = 2 q, 2 q + 1) hold
        const float sa = __shfl_sync(0xffffffffu, own[h][t], 8 * q);
        const float sb = __shfl_sync(0xffffffffu, own[h][t], 8 * q + 4);
        acc[t][0] = fmaf(c[0], sa, acc[t][0]);
        acc[t][1] = fmaf(c[1], sb, acc[t][1]);
        acc[t][2] = fmaf(c[2], sa, acc[t][2]);
        acc[t][3] = fmaf(c[3], sb, acc[t][3]);
      }
  }
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int gm = m0 + g + (i >> 1) * 8, n = n0 + 8 * t + 2 * q + (i & 1);
      if (gm >= M || n >= N) continue;
      float v = acc[t][i];
      if (gridDim.z == 1 && !rank) {
        if (has_bias) v += ld(bias + n);
        st(y + (long long)gm * N + n, v);
      } else {
        ws[((long long)blockIdx.z * M + gm) * wsn + n] = v;
      }
    }
#endif
}

""" + SUM_SOURCE

_TYPES = {torch.float32: "float", torch.float16: "h16", torch.bfloat16: "b16"}


def _rows_tile(m: int) -> int:
    return next(t for t in (1, 2, 4, 8, 16) if t >= min(m, MAX_ROWS_PER_BLOCK))


def _rows_of_w(n: int) -> int:
    """Rows of W per lane: 2 (each staged x value feeds twice the multiply-adds) from N = 1024 (the split
    along K fills the GPU either way; below it, 2 rows were slower: docs/lab-log.md, Figures from earlier
    code comments)."""
    return 2 if n >= 1024 else 1


SPLIT_OVERHEAD = 0.3   # a block's fixed work (tables, the final reduction) in units of one step per warp


def _splits(blocks: int, steps: int, slots: int) -> int:
    """How many parts K is split into: the fewest waves of `slots` resident blocks times the rounds of
    steps each warp of a block walks (plus a block's fixed work). Too few blocks leave SMs idle, and a
    last wave barely filled costs a whole one: on an H200 a 3584 x 3584 weight at 16 rows has 56
    blocks of rows and 56 steps; 4 splits run it in one wave of 2 rounds, 1 split in 7 rounds."""
    def cost(s: int) -> float:
        return -(-blocks * s // slots) * (-(-steps // (s * WARPS)) + SPLIT_OVERHEAD)
    return min(range(1, max(1, steps // WARPS) + 1), key=lambda s: (cost(s), s))


MMA_WARPS = 4   # warps of an nf4_mma block (each 32 rows of W)
MMA_STEP = 64   # columns of K a warp of nf4_mma takes a step (one block of scales)
MMA_ATILE = 8   # rows of a LoRA adapter's A a block of nf4_mma takes (the source's ATILE)


def tensor_cores(dtype: torch.dtype, cc: tuple[int, int]) -> bool:
    """Whether `nf4_matmul` multiplies x of `dtype` on a GPU of compute capability `cc` on tensor cores
    (`nf4_mma`): fp16 x from CC 7.5 (Turing's mma.sync m16n8k8). There at 16 rows the fp32 kernel's 32 fp32
    FLOPs a 4-bit weight cost more time than reading it (a T4: 8.1 TFLOP/s of fp32 against 320 GB/s)."""
    return nf4_on_tensor_cores("fp16" if dtype == torch.float16 else str(dtype), cc)


def _mma_splits(blocks: int, steps: int, slots: int) -> int:
    """`_splits` for nf4_mma, whose warps each walk every step of their split."""
    def cost(s: int) -> float:
        return -(-blocks * s // slots) * (-(-steps // s) + SPLIT_OVERHEAD)
    return min(range(1, steps + 1), key=lambda s: (cost(s), s))


def mm_name(dtype: torch.dtype = torch.float32, rows: int = MAX_ROWS_PER_BLOCK, rows_of_w: int = 2) -> str:
    """The instantiation of `nf4_mm` for x in `dtype`, a tile of `rows` rows of x and `rows_of_w` rows of W
    per lane (what `nf4_matmul` launches; the defaults are a decode step's, which the doctor compiles)."""
    return f"nf4_mm<{_TYPES[dtype]}, {rows}, {rows_of_w}>"


def decode_kernels(dtype: torch.dtype = torch.float32, cc: tuple[int, int] = (6, 0)) -> list[str]:
    """Every instantiation a decode step in `dtype` launches on a GPU of compute capability `cc` (what the doctor
    compiles): the fp32 kernel, and fp16 from CC 7.5 on tensor cores."""
    t = _TYPES[dtype]
    return [mm_name(dtype), f"splits_sum<{t}>"] + ([f"nf4_mma<{MMA_WARPS}>"] if tensor_cores(dtype, cc) else [])


def _kernel(name: str, device: torch.device, threads: int = WARPS * 32, source: Optional[str] = None):
    k = kernel(source or SOURCE, name, device)
    if not hasattr(k, "slots_per_sm"):
        k.slots_per_sm = blocks_per_sm(k, threads)
    return k


def _log2(v: int) -> int:
    return v.bit_length() - 1 if v > 0 and v & (v - 1) == 0 else -1


def unsupported(x: torch.Tensor, packed: torch.Tensor, state: Any) -> str:
    """'' when `nf4_matmul` can run on these inputs, else why not."""
    return input_unsupported(x) or weight_unsupported(packed, state)


def input_unsupported(x: torch.Tensor) -> str:
    """'' when `nf4_matmul` can take `x` (the weight's side: `weight_unsupported`), else why not."""
    if not x.is_cuda:
        return "the input is not on a CUDA device"
    if x.dtype not in _TYPES:
        return f"the input is {x.dtype}, not fp32, fp16 or bf16"
    return ""


def weight_unsupported(packed: torch.Tensor, state: Any) -> str:
    """'' when `nf4_matmul` can multiply by this weight, else why not."""
    if getattr(state, "quant_type", None) != "nf4":
        return f"the weight is {getattr(state, 'quant_type', None)!r}, not nf4"
    n, k = tuple(state.shape)
    # a step of 64 codes then never straddles two blocks of scales
    if k % 64 or state.blocksize < 64 or _log2(state.blocksize) < 0:
        return (f"in_features={k} must be a multiple of 64 and the block size ({state.blocksize}) a power of two "
                "of at least 64")
    if state.nested and _log2(state.state2.blocksize) < 0:
        return f"the nested block size {state.state2.blocksize} is not a power of two"
    if packed.dtype != torch.uint8 or packed.numel() * 2 != n * k or packed.data_ptr() % 16:
        return (f"the packed weight is {packed.dtype} with {packed.numel()} elements, not 16-byte aligned uint8 "
                f"with {n * k // 2}")
    if state.nested and state.state2.absmax.dtype != torch.float32:
        return f"the nested block scales are {state.state2.absmax.dtype}, not fp32"
    if _nested(state) == 2 and (state.block_offsets.dtype != torch.float32
                                or state.block_offsets.shape != state.state2.absmax.shape):
        return (f"the offsets per nested block are {state.block_offsets.dtype} {tuple(state.block_offsets.shape)}, "
                f"not fp32 {tuple(state.state2.absmax.shape)}")
    return ""


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, state: Any, bias: Optional[torch.Tensor] = None,
               lora: Optional[tuple] = None, splits: Optional[int] = None,
               mma: Optional[bool] = None) -> torch.Tensor:
    """x (..., K) @ W.T (+ bias) for a bitsandbytes NF4 weight W (N, K): `packed` its uint8 codes,
    `state` its QuantState. Returns (..., N) in x's dtype. Any number of rows; meant for a few.
    lora = (A, B, scale): adds scale * (x A^T) B^T before the result is rounded, with A (r, K) and B (N, r)
    in fp32 and r <= MAX_RANK: a LoRA adapter's output, as peft adds it, inside the same two kernels; or
    (A, B, scale, bounds): adapters stacked with their weights (`lora_bounds`).
    splits: how many parts K is split into (default: `_splits`' choice; the benchmark sweeps it).
    mma: multiply on tensor cores (`nf4_mma`: fp16 x only; the code table in fp16, the block scales in fp32) or
    not; default `tensor_cores`' choice for the GPU."""
    why = unsupported(x, packed, state)
    if why:
        raise ValueError(f"nf4_matmul: {why}")
    n, k = tuple(state.shape)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"nf4_matmul: {m} rows; the kernels take at most {MAX_ROWS} (a decode step has a few)")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    la, lb, rank, scale, bounds = x2, x2, 0, 0.0, (n, n)
    if lora is not None:
        la, lb, scale = lora[0].contiguous(), lora[1].contiguous(), float(lora[2])
        if la.data_ptr() % 16:   # the kernels read A's rows (and B's) 16 bytes at a time
            la = la.clone()
        if lb.data_ptr() % 16:
            lb = lb.clone()
        rank = la.shape[0]
        if la.dtype != torch.float32 or lb.dtype != torch.float32 or la.dim() != 2 or la.shape[1] != k \
                or lb.dim() != 2 or lb.shape[0] != n or not 0 < rank <= MAX_RANK:
            raise ValueError(f"nf4_matmul: lora needs fp32 A (r, {k}) and B ({n}, r) with 0 < r <= {MAX_RANK}, got "
                             f"{lora[0].dtype} {tuple(lora[0].shape)} and {lora[1].dtype} {tuple(lora[1].shape)}")
        bounds = lora_bounds(lora, n)
    props = torch.cuda.get_device_properties(x.device)
    sms = props.multi_processor_count
    if mma is None:
        mma = tensor_cores(x.dtype, (props.major, props.minor))
    elif mma and not tensor_cores(x.dtype, (props.major, props.minor)):
        raise ValueError(f"nf4_matmul: mma=True takes fp16 x on a GPU of CC 7.5 or later, not {x.dtype} on "
                         f"CC {props.major}.{props.minor}")
    if mma:
        _mma_matmul(x2, packed, state, bias, la, lb, rank, scale, splits, sms, y, bounds)
        return y.reshape(*x.shape[:-1], n)
    mt = _rows_tile(m)
    r = _rows_of_w(n)
    kern = _kernel(mm_name(x.dtype, mt, r), x.device)
    tiles = -(-n // (32 * r)) + -(-rank // (32 * r))   # the weight's rows, then A's
    blocks = tiles * -(-m // mt)
    splits = _splits(blocks, k // 64, sms * kern.slots_per_sm) if splits is None else max(1, min(splits, k // 64))
    per_split = -(-(k // 64) // splits)
    splits = -(-(k // 64) // per_split)
    qabs, abs2, code2, off, absf, code, lbs2 = _state_args(packed, state, x.device)
    b = bias.to(x.dtype).contiguous() if bias is not None else x2
    wsn = n + rank   # a workspace row: the weight's outputs, then x A^T
    ws = torch.empty((splits, m, wsn), dtype=torch.float32, device=x.device) if splits > 1 or rank else y
    kern(
        grid=(tiles, -(-m // mt), splits), block=(WARPS * 32, 1, 1),
        args=[x2, packed, qabs, abs2, code2, off, absf, code, b, y, ws, m, n, k, _log2(state.blocksize), lbs2,
              _nested(state), int(bias is not None), per_split, la, rank, wsn])
    if splits > 1 or rank:
        sum_splits(SOURCE, ws, b if bias is not None else None, y, splits, lb, rank, scale, bounds)
    return y.reshape(*x.shape[:-1], n)


def lora_bounds(lora: tuple, n: int) -> tuple[int, int]:
    """The output columns where the second and the third of stacked adapters start (n where there are none).
    `lora` is (A, B, scale): one adapter, A (r, K) and B (N, r); or (A, B, scale, bounds) for adapters stacked
    with their weights (`edgerl.rollout.lora_group`): A's rows (len(bounds) + 1) x r, adapter i's from row i r,
    B (N, r) with the weights' rows, and output columns from bounds[i - 1] on taking adapter i (two bounds at
    most). Raises ValueError for any other shape."""
    a, b = lora[0], lora[1]
    cuts = tuple(int(c) for c in lora[3]) if len(lora) > 3 else ()
    r = b.shape[1] if b.dim() == 2 else 0
    if len(cuts) > 2 or list(cuts) != sorted(set(cuts)) or any(not 0 < c < n for c in cuts) \
            or r == 0 or a.shape[0] != r * (len(cuts) + 1):
        raise ValueError(f"lora: {len(cuts) + 1} adapters of B's rank {r} need {r * (len(cuts) + 1)} rows of A (got "
                         f"{a.shape[0]}) and at most two increasing column bounds inside (0, {n}) (got {cuts})")
    return (*cuts, n, n)[:2]


def lora_term(x: torch.Tensor, lora: tuple) -> torch.Tensor:
    """scale (x A^T) B^T in x's dtype, the slow, obvious way: each stacked adapter (`lora_bounds`) on its own
    columns."""
    a, b, scale = lora[0].to(x.dtype), lora[1].to(x.dtype), lora[2]
    n, r = b.shape
    cuts = (0, *(tuple(lora[3]) if len(lora) > 3 else ()), n)
    parts = [(x @ a[i * r:(i + 1) * r].T) @ b[c0:c1].T for i, (c0, c1) in enumerate(zip(cuts, cuts[1:]))]
    return scale * torch.cat(parts, dim=-1)


def sum_splits(source: str, ws: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor, splits: int,
               lb: torch.Tensor, rank: int, scale: float, bounds: Optional[tuple[int, int]] = None) -> None:
    """y (M, N) = the splits' partial sums in ws (splits, M, N + rank) added in order, + bias, + scale (x A^T) B^T
    with x A^T summed from ws's last `rank` columns and B = lb (N, r): `splits_sum` of `source` (a source that
    holds SUM_SOURCE), in y's dtype. bounds: where stacked adapters' columns start (`lora_bounds`; none: one
    adapter, r = rank)."""
    m, n = y.shape
    b = bias if bias is not None else y
    b1, b2 = bounds or (n, n)
    r = lb.shape[1] if rank else 0
    _kernel(f"splits_sum<{_TYPES[y.dtype]}>", y.device, source=source)(
        grid=(-(-n // 256), -(-m // SUM_ROWS), 1), block=(256, 1, 1),
        args=[ws, b, y, m, n, splits, int(bias is not None), lb, r, scale, ws.shape[2], b1, b2])


def _nested(state: Any) -> int:
    """The kernels' `nested`: 0 fp32 block scales, 1 nested with one offset, 2 nested with an offset per nested
    block (`block_offsets`)."""
    if not state.nested:
        return 0
    return 2 if getattr(state, "block_offsets", None) is not None else 1


def _state_args(packed: torch.Tensor, state: Any, device: torch.device) -> list:
    """The kernels' arguments for the weight's block scales: qabs, abs2, code2, offset (or the offsets per nested
    block), absmax (fp32), the code table, log2 of the nested block size."""
    code = state.code.to(device=device, dtype=torch.float32)
    if state.nested:
        s2 = state.state2
        off = state.offset if _nested(state) == 1 else state.block_offsets
        return [state.absmax, s2.absmax, s2.code, off, code, code, _log2(s2.blocksize)]
    return [packed, code, code, code, state.absmax.float(), code, 0]


def _mma_matmul(x2: torch.Tensor, packed: torch.Tensor, state: Any, bias: Optional[torch.Tensor], la: torch.Tensor,
                lb: torch.Tensor, rank: int, scale: float, splits: Optional[int], sms: int, y: torch.Tensor,
                bounds: tuple[int, int]) -> None:
    """`nf4_matmul` on tensor cores into y (fp16 x2 (M, K)): nf4_mma, then splits_sum where K is split or an adapter
    rides along."""
    n, k = tuple(state.shape)
    m = x2.shape[0]
    if x2.data_ptr() % 16:   # the kernel reads x's rows 16 bytes at a time
        x2 = x2.clone()
    kern = _kernel(f"nf4_mma<{MMA_WARPS}>", y.device, MMA_WARPS * 32)
    tiles = -(-n // (32 * MMA_WARPS)) + -(-rank // MMA_ATILE)   # the weight's tiles (32 rows a warp), then A's
    blocks = tiles * -(-m // 16)
    steps = -(-k // MMA_STEP)
    splits = _mma_splits(blocks, steps, sms * kern.slots_per_sm) if splits is None else max(1, min(splits, steps))
    per_split = -(-steps // splits)
    splits = -(-steps // per_split)
    qabs, abs2, code2, off, absf, code, lbs2 = _state_args(packed, state, y.device)
    b = bias.to(y.dtype).contiguous() if bias is not None else x2
    wsn = n + rank
    ws = torch.empty((splits, m, wsn), dtype=torch.float32, device=y.device) if splits > 1 or rank else y
    kern(grid=(tiles, -(-m // 16), splits), block=(MMA_WARPS * 32, 1, 1),
         args=[x2, packed, qabs, abs2, code2, off, absf, code, b, y, ws, m, n, k, _log2(state.blocksize), lbs2,
               _nested(state), int(bias is not None), per_split, la, rank, wsn])
    if splits > 1 or rank:
        sum_splits(SOURCE, ws, b if bias is not None else None, y, splits, lb, rank, scale, bounds)


def dequantize_reference(packed: torch.Tensor, state: Any, fp16_codes: bool = False) -> torch.Tensor:
    """The NF4 weight (N, K) in fp32, decoded the slow, obvious way (on the packed tensor's device).
    fp16_codes: the code table's values rounded to fp16 (the tensor-core kernel's), the scales not."""
    n, k = tuple(state.shape)
    b = packed.reshape(-1).to(torch.int64)
    codes = torch.stack((b >> 4, b & 15), dim=1).reshape(-1)[:n * k]
    if state.nested:
        s2 = state.state2
        scale2 = s2.absmax.float().repeat_interleave(s2.blocksize)[:state.absmax.numel()]
        if _nested(state) == 2:
            offset = state.block_offsets.float().repeat_interleave(s2.blocksize)[:state.absmax.numel()]
        else:
            offset = state.offset.float()
        absmax = s2.code.float()[state.absmax.to(torch.int64)] * scale2 + offset
    else:
        absmax = state.absmax.float()
    table = state.code.float().to(packed.device)
    if fp16_codes:
        table = table.half().float()
    w = table[codes] * absmax.repeat_interleave(state.blocksize)[:n * k]
    return w.reshape(n, k)


def reference(x: torch.Tensor, packed: torch.Tensor, state: Any, bias: Optional[torch.Tensor] = None,
              lora: Optional[tuple] = None, fp16_codes: bool = False) -> torch.Tensor:
    """What `nf4_matmul` computes, in plain torch: fp32 products and sums, the result in x's dtype.
    fp16_codes: the code table rounded to fp16 first, as the tensor-core kernel (`mma`) decodes the codes."""
    y = x.float() @ dequantize_reference(packed, state, fp16_codes).to(x.device).T
    if bias is not None:
        y = y + bias.to(x.dtype).float()
    if lora is not None:
        y = y + lora_term(x.float(), lora)
    return y.to(x.dtype)


__all__ = ["KernelUnavailable", "MAX_ROWS_PER_BLOCK", "MAX_RANK", "dequantize_reference", "nf4_matmul", "reference",
           "input_unsupported", "unsupported", "weight_unsupported"]
