"""A decode step's work between its matmuls, in three CUDA C kernels (NVRTC): for GPUs without Triton.

In fp32 (what a P40, P100 or GTX 10-series plan computes in) the static engine's decode layer ran about
18 small kernels besides its matmuls: the residual add, the RMS norm and its scale (twice), the
rotary embedding (a concatenation and three elementwise ops), the cache write, baddbmm, softmax and
bmm over the whole masked cache, SiLU and the product with up. A decode step of 16 rows is bound by
the number of its kernels, not by their arithmetic, and Pascal has no Triton to fuse them
(`torch.compile` needs CC 7.0). These kernels do the same work in three per layer (four with the
norm's second use):

- `add_rms_norm`: x + d (the previous sublayer's output) and w * rms_norm(x + d), one block per row;
- `rope_attend`: the rotary embedding of the G query heads of one KV head and of its new key, the key
  and value written into cache column `col`, and attention over the columns [start[b], col] that row
  sees (not the whole masked cache), one block per row and KV head; softmax in blocks of 256 columns
  with a running maximum, so any cache length fits in 16 KB of shared memory. The columns a row sees are
  split into slices, a block each, and `attend_combine` merges the slices' outputs by their maxima and sums
  (split-K, as flash-decoding does): at 16 rows and 2 KV heads the unsplit kernel has 32 blocks, each walking
  up to thousands of columns while most SMs wait. The grid has `slices` slices per row and KV head (two blocks
  for each SM), and each row's columns spread over them at every length (the grid is fixed when a CUDA graph
  captures it; the kernels compute a slice's columns from the step's column);
- `silu_mul`: SiLU(gate) * up.

Storage in fp32, or in fp16 (Volta and Turing plans compute in fp16, and edgerl's Triton kernels run from CC 8.0): every
kernel reads its inputs, the cache included, in the storage type and computes in fp32. The elementwise
products and sums round where the eager ops do (no contraction into FMAs; in fp16, each rounded to fp16
where torch's fp16 op rounds its result: the rotary products and their sum, the residual add, the normalised
value before its scale, the SiLU before the product), so the cache column is bit for bit what `_rotate` and
`index_copy_` write; the dot products, the norm's mean and the softmax's sums run in another order than
cuBLAS and torch's reductions, so those agree to rounding. `reference_*` are the same formulas in plain torch
in float64, slowly; the CUDA tests compare the kernels with them. The fp16 instantiations compile for sm_61
to sm_90 (NVRTC 12.9; no register spills at heads of 64 and more, a few bytes at a head of 32 with one query head
per KV head) and compute the same fp32 operations as the fp32 ones (their PTX
float instructions are the fp32 path's, in order, plus the conversions: tests/test_nvrtc_compile_on_cpu.py
checks both without a GPU). On an H200 they pass the same CUDA tests as the fp32 ones; no Volta or Turing card
has run them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .nvrtc import KernelUnavailable, kernel
from .tiles import DECODE_CUDA_HEAD_DIMS as HEAD_DIMS, DECODE_CUDA_MAX_GROUP as MAX_GROUP
from .tiles import DECODE_CUDA_SLICE_BLOCKS_PER_SM as SLICE_BLOCKS_PER_SM, DECODE_CUDA_SLICE_COLUMNS as SLICE_COLUMNS
from .tiles import decode_cuda_shape_reason as shape_reason
from .triton_impl import _device_limits   # (smem, CC, SM count) of a device, cached; no Triton import

SPLIT_COLUMNS: Optional[int] = None   # fixed slices of this many columns in place of `slices` (None: `slices`)

THREADS = 256   # the kernels' blocks; rope_attend's softmax takes 256 cache columns at a time (one per thread)

SOURCE = r"""
// Scalars are int or double: the launcher (torch.cuda._utils) passes a Python int as a C int and a float
// as a C double.
#define NEG_INF __int_as_float(0xff800000)

// Storage: float, or h16 (fp16 bits; no cuda_fp16.h, which NVRTC may not find). Every value is computed in
// fp32; ld widens, st rounds to nearest even, rn<T> rounds to T's precision and widens again (identity in fp32):
// where the eager fp16 ops round a product or a sum to fp16 (torch computes each op in fp32 and rounds its
// result), the kernels round there too.
typedef unsigned short u16;
struct h16 { u16 v; };
__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const h16* p) { return h2f(p->v); }
__device__ __forceinline__ void st(float* p, float f) { *p = f; }
__device__ __forceinline__ void st(h16* p, float f) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); p->v = h; }
template <typename T> __device__ __forceinline__ float rn(float f);
template <> __device__ __forceinline__ float rn<float>(float f) { return f; }
template <> __device__ __forceinline__ float rn<h16>(float f) { h16 h; st(&h, f); return ld(&h); }
// Two consecutive values from an even index (8 bytes in fp32, 4 in fp16: a thread's share of a value row).
__device__ __forceinline__ float2 ld2(const float* p) { return *(const float2*)p; }
__device__ __forceinline__ float2 ld2(const h16* p) {
  const unsigned u = *(const unsigned*)p;
  return make_float2(h2f((u16)(u & 0xffffu)), h2f((u16)(u >> 16)));
}
// Eight consecutive values from an 8-aligned index: two 16-byte loads in fp32, one in fp16 (a key row of the cache).
__device__ __forceinline__ void ld8(const float* p, float4& a, float4& b) {
  a = *(const float4*)p;
  b = *(const float4*)(p + 4);
}
__device__ __forceinline__ void ld8(const h16* p, float4& a, float4& b) {
  const uint4 u = *(const uint4*)p;
  a = make_float4(h2f((u16)(u.x & 0xffffu)), h2f((u16)(u.x >> 16)), h2f((u16)(u.y & 0xffffu)), h2f((u16)(u.y >> 16)));
  b = make_float4(h2f((u16)(u.z & 0xffffu)), h2f((u16)(u.z >> 16)), h2f((u16)(u.w & 0xffffu)), h2f((u16)(u.w >> 16)));
}

// HF's rotary: y[d] = x[d] cos[d] + x[d +- D/2] sin'[d] (sin' carries rotate_half's sign), each product
// and the sum rounded in T, as the eager mul_ / add_ do.
template <typename T>
__device__ __forceinline__ float rot(const T* x, const T* c, const T* s, int d, int half) {
  const int j = d < half ? d + half : d - half;
  return rn<T>(__fadd_rn(rn<T>(__fmul_rn(ld(x + d), ld(c + d))), rn<T>(__fmul_rn(ld(x + j), ld(s + d)))));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One block of 1024 threads per row (a few values each: a decode step has few rows, and 256 threads per row
// were slower, waiting on their loads: docs/lab-log.md, Figures from earlier code comments): xo = x + d (when has_d),
// y = w * ((x + d) * rsqrt(mean((x + d)^2) + eps)), in fp16 with x + d and the normalised value rounded to fp16
// where HF's eager ops round them.
template <typename T>
__global__ void __launch_bounds__(1024) add_rms_norm(const T* __restrict__ x, const T* __restrict__ d,
                                                    const T* __restrict__ w, T* __restrict__ xo,
                                                    T* __restrict__ y, int H, double eps, int has_d) {
  __shared__ float part[32];
  const int tid = threadIdx.x;
  const long long base = (long long)blockIdx.x * H;
  float ss = 0.f;
#pragma unroll 4
  for (int i = tid; i < H; i += 1024) {   // unrolled: the loads of one thread in flight together
    float v = ld(x + base + i);
    if (has_d) { v = rn<T>(__fadd_rn(v, ld(d + base + i))); st(xo + base + i, v); }
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) part[tid >> 5] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) t += part[i];
  const float r = rsqrtf(t / (float)H + (float)eps);
#pragma unroll 4
  for (int i = tid; i < H; i += 1024) {   // x + d once more (the same rounding), not read back from xo
    const float v = has_d ? rn<T>(__fadd_rn(ld(x + base + i), ld(d + base + i))) : ld(x + base + i);
    st(y + base + i, __fmul_rn(ld(w + i), rn<T>(__fmul_rn(v, r))));   // HF: w * rms_norm(x) cast to T
  }
}

// y (M, W) = SiLU(g) * u for g and u with row strides gs and us (views into a wider output).
template <typename T>
__global__ void __launch_bounds__(256) silu_mul(const T* __restrict__ g, const T* __restrict__ u,
                                                T* __restrict__ y, int M, int W, int gs, int us) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i >= (long long)M * W) return;
  const long long m = i / W, c = i - m * W;   // row strides as 64-bit products below
  const float a = ld(g + m * gs + c);
  st(y + i, __fmul_rn(rn<T>(a / (1.0f + expf(-a))), ld(u + m * us + c)));   // SiLU rounded to T, then the product
}

// The columns of each slice of a row that sees len columns, split into ns slices: len / ns rounded up to a multiple
// of CH, so the rows' work spreads over the grid's slices at every length (a short row takes fewer slices, each at
// least CH columns). rope_attend_split and attend_combine compute it alike. With ns = ceil(S / CH) (a grid for the
// whole cache) it is CH: slices of a fixed size.
__device__ __forceinline__ int slice_columns(int len, int ns, int CH) {
  const int per = (max(len, 1) + ns - 1) / ns;
  return (per + CH - 1) / CH * CH;
}

// One block of 256 threads per (row b, KV head h) and, split (SPLIT), per slice z of slice_columns: rotate the G
// query heads h G .. h G + G - 1 into shared memory, write the rotated key and the value into cache column col
// (the block whose columns hold col: the only one that reads it), then attend over its columns (all of
// [start[b], col] unsplit; [start[b] + z ch, ...] split) in tiles of 256 (a thread per column for the scores, its key
// row 16 bytes a load; for P V a thread per two values of a row, P = 2 THREADS / D parts each over every P-th
// column, their sums met by halves at the end), with a running maximum across tiles. Unsplit, o (B, KVH G D) gets
// the normalised output; split, po (fp32) is (B KVH, NS, G, D): the slice's unnormalised P V, with its maximum and
// sum in pm and pl (B KVH, NS, G), and attend_combine merges the slices. A slice past col (its first column after
// it) returns at once.
// q, k, v: rows of the step's projections (row strides sq, sk, sv); cos, sin: (B, D); kc, vc: this layer's
// cache (B, KVH, S, D), read and written (not __restrict__: the new column is read back after a barrier).
// The cache's storage C is T, or h16 under fp32 (T float): then the rotated key and the value are rounded to fp16 as
// they are written, and a value past fp16's range (or not finite) sets *flag, which the engine reads after the
// rollout: a cache entry never overflows silently.
template <typename T, typename C, int G, int D, bool SPLIT>
__device__ __forceinline__ void attend(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    int sq, int sk, int sv, const T* __restrict__ cs, const T* __restrict__ sn,
    C* kc, C* vc, const long long* __restrict__ start, const long long* __restrict__ colp,
    T* __restrict__ o, float* __restrict__ po, int KVH, int S, double scale_d, int CH, float* __restrict__ pm,
    float* __restrict__ pl, int* __restrict__ flag) {
  constexpr int NT = 256, TS = 256, HALF = D / 2;
  __shared__ __align__(16) float qs[G * D];
  __shared__ __align__(16) float sc[G * TS];   // scores, then exp(score - max); at the end the parts' sums
  __shared__ float mrow[G], lrow[G], arow[G];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x / KVH, h = blockIdx.x - b * KVH;
  const int col = (int)colp[0];
  const int ch = SPLIT ? slice_columns(col - (int)start[b] + 1, (int)gridDim.y, CH) : 0;
  const int lo = (int)start[b] + (SPLIT ? (int)blockIdx.y * ch : 0);
  if (lo > col) return;   // a slice past the last column: the whole block, before any barrier
  const int hi = SPLIT ? min(col, lo + ch - 1) : col;
  const float scale = (float)scale_d;
  const T* c = cs + (long long)b * D;
  const T* s = sn + (long long)b * D;
  const long long cache = ((long long)b * KVH + h) * S * D;
  C* kr = kc + cache;
  C* vr = vc + cache;
  for (int i = tid; i < G * D; i += NT) {
    const int g = i / D;
    qs[i] = rot(q + (long long)b * sq + (long long)(h * G + g) * D, c, s, i - g * D, HALF);
  }
  if (hi == col && tid < D) {
    const float kw = rot(k + (long long)b * sk + (long long)h * D, c, s, tid, HALF);
    const float vw = ld(v + (long long)b * sv + (long long)h * D + tid);
    st(kr + (long long)col * D + tid, kw);
    st(vr + (long long)col * D + tid, vw);
    if (sizeof(C) < sizeof(T) && !(fabsf(kw) <= 65504.f && fabsf(vw) <= 65504.f)) atomicOr(flag, 1);
  }
  if (tid < G) { mrow[tid] = NEG_INF; lrow[tid] = 0.f; }
  __syncthreads();
  constexpr int DT = D / 2, P = NT / DT;   // P V: a thread per two values of a row (DT a row), P parts of the columns
  const int d = 2 * (tid % DT), part = tid / DT;
  float acc[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = 0.f;
  for (int t0 = lo; t0 <= hi; t0 += TS) {
    const int p = t0 + tid;
    if (p <= hi) {
      float dot[G];
#pragma unroll
      for (int g = 0; g < G; ++g) dot[g] = 0.f;
      const C* kp = kr + (long long)p * D;
#pragma unroll 4
      for (int j = 0; j < D / 8; ++j) {   // 8 values a load in fp16 (16 bytes), as in fp32 (two loads); same order
        float4 kv[2];
        ld8(kp + 8 * j, kv[0], kv[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float4 qv = *(const float4*)&qs[g * D + 8 * j + 4 * h];
            dot[g] = fmaf(qv.x, kv[h].x, dot[g]); dot[g] = fmaf(qv.y, kv[h].y, dot[g]);
            dot[g] = fmaf(qv.z, kv[h].z, dot[g]); dot[g] = fmaf(qv.w, kv[h].w, dot[g]);
          }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) sc[g * TS + tid] = dot[g] * scale;
    } else {
#pragma unroll
      for (int g = 0; g < G; ++g) sc[g * TS + tid] = NEG_INF;
    }
    __syncthreads();
    if (warp < G) {   // warp g: this tile's maximum, exp(score - max) in place, their sum
      const int g = warp;
      float mx = NEG_INF;
#pragma unroll
      for (int i = lane; i < TS; i += 32) mx = fmaxf(mx, sc[g * TS + i]);
      mx = warp_max(mx);
      const float mnew = fmaxf(mrow[g], mx);   // finite: every tile holds column t0 <= hi
      float sum = 0.f;
#pragma unroll
      for (int i = lane; i < TS; i += 32) {
        const float e = expf(sc[g * TS + i] - mnew);
        sc[g * TS + i] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float a = expf(mrow[g] - mnew);
        arow[g] = a;
        lrow[g] = lrow[g] * a + sum;
        mrow[g] = mnew;
      }
    }
    __syncthreads();
    const int n = min(TS, hi - t0 + 1);
#pragma unroll
    for (int g = 0; g < G; ++g) { acc[g][0] *= arow[g]; acc[g][1] *= arow[g]; }
#pragma unroll 4
    for (int i = part; i < n; i += P) {   // two values a load: 8 bytes in fp32, 4 in fp16
      const float2 vv = ld2(vr + (long long)(t0 + i) * D + d);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pg = sc[g * TS + i];
        acc[g][0] = fmaf(pg, vv.x, acc[g][0]);
        acc[g][1] = fmaf(pg, vv.y, acc[g][1]);
      }
    }
    __syncthreads();   // the next tile overwrites sc
  }
  // the P parts' sums meet in sc by halves (at most P / 2 x G x D = G x TS floats a round), part 0 holding the total
#pragma unroll
  for (int half = P / 2; half >= 1; half >>= 1) {
    if (part >= half && part < 2 * half) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        sc[((part - half) * G + g) * D + d] = acc[g][0];
        sc[((part - half) * G + g) * D + d + 1] = acc[g][1];
      }
    }
    __syncthreads();
    if (part < half) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        acc[g][0] += sc[(part * G + g) * D + d];
        acc[g][1] += sc[(part * G + g) * D + d + 1];
      }
    }
    __syncthreads();
  }
  if (part > 0) return;
  if (SPLIT) {
    const long long slot = (long long)blockIdx.x * gridDim.y + blockIdx.y;
    float* out = po + slot * G * D;
#pragma unroll
    for (int g = 0; g < G; ++g) { out[g * D + d] = acc[g][0]; out[g * D + d + 1] = acc[g][1]; }
    if (tid < G) { pm[slot * G + tid] = mrow[tid]; pl[slot * G + tid] = lrow[tid]; }
  } else {
    T* out = o + ((long long)b * KVH + h) * G * D;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      st(out + g * D + d, acc[g][0] / lrow[g]);
      st(out + g * D + d + 1, acc[g][1] / lrow[g]);
    }
  }
}

template <typename T, int G, int D>
__global__ void __launch_bounds__(256) rope_attend(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    int sq, int sk, int sv, const T* __restrict__ cs, const T* __restrict__ sn,
    T* kc, T* vc, const long long* __restrict__ start, const long long* __restrict__ colp,
    T* __restrict__ o, int KVH, int S, double scale_d) {
  attend<T, T, G, D, false>(q, k, v, sq, sk, sv, cs, sn, kc, vc, start, colp, o, nullptr, KVH, S, scale_d, 0, nullptr,
                            nullptr, nullptr);
}

template <typename T, int G, int D>
__global__ void __launch_bounds__(256) rope_attend_split(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    int sq, int sk, int sv, const T* __restrict__ cs, const T* __restrict__ sn,
    T* kc, T* vc, const long long* __restrict__ start, const long long* __restrict__ colp,
    float* __restrict__ part, int KVH, int S, double scale_d, int CH, float* __restrict__ pm,
    float* __restrict__ pl) {
  attend<T, T, G, D, true>(q, k, v, sq, sk, sv, cs, sn, kc, vc, start, colp, nullptr, part, KVH, S, scale_d, CH, pm,
                           pl, nullptr);
}

// The same over a cache stored in C (h16 under fp32 compute: half the bytes a long decode step reads), with the
// overflow flag.
template <typename T, typename C, int G, int D>
__global__ void __launch_bounds__(256) rope_attend_kv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    int sq, int sk, int sv, const T* __restrict__ cs, const T* __restrict__ sn,
    C* kc, C* vc, const long long* __restrict__ start, const long long* __restrict__ colp,
    T* __restrict__ o, int KVH, int S, double scale_d, int* __restrict__ flag) {
  attend<T, C, G, D, false>(q, k, v, sq, sk, sv, cs, sn, kc, vc, start, colp, o, nullptr, KVH, S, scale_d, 0, nullptr,
                            nullptr, flag);
}

template <typename T, typename C, int G, int D>
__global__ void __launch_bounds__(256) rope_attend_split_kv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    int sq, int sk, int sv, const T* __restrict__ cs, const T* __restrict__ sn,
    C* kc, C* vc, const long long* __restrict__ start, const long long* __restrict__ colp,
    float* __restrict__ part, int KVH, int S, double scale_d, int CH, float* __restrict__ pm,
    float* __restrict__ pl, int* __restrict__ flag) {
  attend<T, C, G, D, true>(q, k, v, sq, sk, sv, cs, sn, kc, vc, start, colp, nullptr, part, KVH, S, scale_d, CH, pm,
                           pl, flag);
}

// One block per (row b, KV head h): the slices' outputs of rope_attend_split merged, each rescaled by
// exp(its maximum - the largest) and the sum divided by the rescaled sums; only the slices that held columns
// (start[b] + z ch <= col, ch from slice_columns as the split kernel took it) are read.
template <typename T, int G, int D>
__global__ void __launch_bounds__(256) attend_combine(
    const float* __restrict__ part, const float* __restrict__ pm, const float* __restrict__ pl,
    const long long* __restrict__ start, const long long* __restrict__ colp, T* __restrict__ o,
    int KVH, int NS, int CH) {
  const int bh = blockIdx.x, b = bh / KVH;
  const int len = max((int)colp[0] - (int)start[b] + 1, 1);
  const int nz = min(NS, (len - 1) / slice_columns(len, NS, CH) + 1);
  const long long base = (long long)bh * NS;
  for (int i = threadIdx.x; i < G * D; i += 256) {
    const int g = i / D;
    float m = NEG_INF;
    for (int z = 0; z < nz; ++z) m = fmaxf(m, pm[(base + z) * G + g]);
    float l = 0.f, a = 0.f;
    for (int z = 0; z < nz; ++z) {
      const float w = expf(pm[(base + z) * G + g] - m);
      l = fmaf(pl[(base + z) * G + g], w, l);
      a = fmaf(part[(base + z) * G * D + i], w, a);
    }
    st(o + (long long)bh * G * D + i, a / l);
  }
}
"""

def _kernel(name: str, device: torch.device):
    return kernel(SOURCE, name, device)


# the storage types the kernels take (the source's names); every one computes in fp32
TYPES = {torch.float32: "float", torch.float16: "h16"}
NAMES = {torch.float32: "fp32", torch.float16: "fp16"}


def _type(dtype: torch.dtype) -> str:
    if dtype not in TYPES:
        raise ValueError(f"decode kernels: {dtype} is not fp32 or fp16")
    return TYPES[dtype]


# the caches' storage the kernels take beside each compute dtype's own: fp16 under fp32 (`plan.kv_cache_dtype`)
CACHE_TYPES = {torch.float32: (torch.float32, torch.float16), torch.float16: (torch.float16,)}


def attend_name(group: int, head_dim: int, split: bool = False, dtype: torch.dtype = torch.float32,
                cache_dtype: Optional[torch.dtype] = None) -> str:
    """The attention kernel's instantiation for q, k and v in `dtype` and a cache in `cache_dtype` (default: dtype)."""
    cache_dtype = cache_dtype or dtype
    if cache_dtype not in CACHE_TYPES.get(dtype, ()):
        raise ValueError(f"decode kernels: a {NAMES.get(cache_dtype, cache_dtype)} cache under "
                         f"{NAMES.get(dtype, dtype)} compute is not one they take (fp32 under fp32, fp16 under either)")
    if cache_dtype == dtype:
        return f"rope_attend{'_split' if split else ''}<{_type(dtype)}, {group}, {head_dim}>"
    return f"rope_attend{'_split' if split else ''}_kv<{_type(dtype)}, {_type(cache_dtype)}, {group}, {head_dim}>"


def combine_name(group: int, head_dim: int, dtype: torch.dtype = torch.float32) -> str:
    return f"attend_combine<{_type(dtype)}, {group}, {head_dim}>"


def kernel_names(group: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 cache_dtype: Optional[torch.dtype] = None) -> list[str]:
    """Every instantiation a decode step with this head layout launches in `dtype` (fp32 or fp16) over a cache in
    `cache_dtype` (default: dtype)."""
    t = _type(dtype)
    return [f"add_rms_norm<{t}>", f"silu_mul<{t}>", attend_name(group, head_dim, dtype=dtype, cache_dtype=cache_dtype),
            attend_name(group, head_dim, split=True, dtype=dtype, cache_dtype=cache_dtype),
            combine_name(group, head_dim, dtype)]


def unavailable_reason(device: torch.device, head_dim: int, dtype: torch.dtype, group: int,
                       cache_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the kernels cannot run here (None: they compile and load for this device)."""
    if device.type != "cuda":
        return f"tensors are on {device}, not a CUDA device"
    if dtype not in TYPES:
        return f"{dtype}: the kernels store fp32 or fp16 only"
    if (cache_dtype or dtype) not in CACHE_TYPES[dtype]:
        return f"a {cache_dtype} KV cache under {NAMES[dtype]} compute: the kernels take fp32 or fp16 caches under fp32"
    why = shape_reason(head_dim, group)
    if why:
        return why
    try:
        for n in kernel_names(group, head_dim, dtype, cache_dtype):
            _kernel(n, device)
    except (KernelUnavailable, RuntimeError, OSError) as e:   # no NVRTC, an arch it cannot build, a failed load
        return f"{type(e).__name__}: {str(e).strip()[:400]}"
    return None


def slices(rows: int, kv_heads: int, columns: int, sms: int) -> int:
    """Slices per row and KV head of rope_attend's default grid for a cache of `columns` columns on a GPU of
    `sms` SMs: `SLICE_BLOCKS_PER_SM` blocks for each SM, no more slices than the cache has multiples of
    `SLICE_COLUMNS` (1: the unsplit kernel, one block per row and KV head)."""
    return max(1, min(-(-columns // SLICE_COLUMNS), -(-SLICE_BLOCKS_PER_SM * sms // max(1, rows * kv_heads))))


def _rows(t: torch.Tensor, width: int, what: str, dtype: torch.dtype = torch.float32) -> int:
    """The row stride of a (B, >= width) CUDA tensor in `dtype` whose rows are contiguous."""
    if t.dim() != 2 or t.shape[1] < width or t.stride(1) != 1 or t.stride(0) >= 2**31 or t.dtype != dtype \
            or not t.is_cuda:
        raise ValueError(f"decode kernels: {what} must be a CUDA {NAMES.get(dtype, dtype)} (rows, >= {width}) tensor "
                         f"with contiguous rows, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    return t.stride(0)


def add_rms_norm(x: torch.Tensor, d: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, weight * rms_norm(x + d)) for x, d (B, H) and weight (H,), all fp32 or all fp16 (d None:
    (x, weight * rms_norm(x)))."""
    B, H = x.shape
    x = x.contiguous()
    d = d.contiguous() if d is not None else None
    if (d is not None and (d.shape != x.shape or d.dtype != x.dtype)) or weight.shape != (H,) \
            or weight.dtype != x.dtype or x.dtype not in TYPES:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, d "
                         f"{None if d is None else (tuple(d.shape), d.dtype)}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}: one dtype, fp32 or fp16")
    xo = torch.empty_like(x) if d is not None else x
    y = torch.empty_like(x)
    _kernel(f"add_rms_norm<{_type(x.dtype)}>", x.device)(
        grid=(B, 1, 1), block=(1024, 1, 1),
        args=[x, d if d is not None else x, weight.contiguous(), xo, y, H, float(eps), int(d is not None)])
    return xo, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for (B, W) fp32 or fp16 rows (views into a wider tensor are fine)."""
    M, W = gate.shape
    if up.shape != gate.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    t = _type(gate.dtype)
    gs, us = _rows(gate, W, "gate", gate.dtype), _rows(up, W, "up", gate.dtype)
    y = torch.empty((M, W), dtype=gate.dtype, device=gate.device)
    if M * W:
        _kernel(f"silu_mul<{t}>", gate.device)(grid=(-(-M * W // THREADS), 1, 1), block=(THREADS, 1, 1),
                                               args=[gate, up, y, M, W, gs, us])
    return y


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, col: torch.Tensor,
                scale: float, split_columns: Optional[int] = None, flag: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step's attention for B rows: q (B, >= H D), k and v (B, >= KVH D) (views of the
    projections' output are fine), cos and sin (B, D) (sin with rotate_half's sign), the layer's cache
    k_cache and v_cache (B, KVH, S, D) (column col[0] is written), start (B,) each row's first column.
    Returns (B, H D) in q's dtype (fp32 or fp16, every input in it; the arithmetic in fp32): the G = H / KVH
    query heads of KV head h are heads h G .. h G + G - 1. The caches are in q's dtype, or in fp16 under fp32
    (`CACHE_TYPES`): then the new column is rounded to fp16 as it is written, and flag (an int32 (1,) CUDA tensor,
    required) gets 1 where a written value is past fp16's range or not finite.
    The columns are split into slices, a block each, and the slices merged by a second kernel (split-K, as
    flash-decoding does): one block per row and KV head leaves most SMs idle. By default (`split_columns` None
    and `SPLIT_COLUMNS` None) the grid has `slices(B, KVH, S, the GPU's SMs)` slices per row and KV head, and
    each row's columns spread over them (each slice a multiple of `SLICE_COLUMNS`), at every length;
    `split_columns` n instead cuts the whole cache into fixed slices of n columns (the grid ceil(S / n) of them)."""
    B, KVH, S, D = k_cache.shape
    dt, ct = q.dtype, k_cache.dtype
    if v_cache.shape != k_cache.shape or not k_cache.is_contiguous() or not v_cache.is_contiguous() \
            or dt not in TYPES or ct not in CACHE_TYPES[dt] or v_cache.dtype != ct:
        raise ValueError(f"rope_attend: the caches must be contiguous (B, KVH, S, D) of one dtype, q's ({dt}) or fp16 "
                         f"under fp32, got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                         f"{v_cache.dtype}")
    mixed = ct != dt
    if mixed and (flag is None or flag.dtype != torch.int32 or flag.numel() != 1 or flag.device != q.device):
        raise ValueError("rope_attend: a cache in fp16 under fp32 compute needs flag, an int32 (1,) tensor on q's "
                         "device, for the overflow check")
    H = q.shape[1] // D if q.dim() == 2 else 0
    group = H // KVH
    why = shape_reason(D, group)
    if why or H != group * KVH or q.shape[0] != B:
        raise ValueError(f"rope_attend: q {tuple(q.shape)} against a cache of {KVH} KV heads of size {D} for {B} rows"
                         + (f": {why}" if why else ""))
    sq, sk, sv = _rows(q, H * D, "q", dt), _rows(k, KVH * D, "k", dt), _rows(v, KVH * D, "v", dt)
    for t, what in ((k, "k"), (v, "v")):
        if t.shape[0] != B:
            raise ValueError(f"rope_attend: {what} has {t.shape[0]} rows, the cache {B}")
    for t, what in ((cos, "cos"), (sin, "sin")):
        if tuple(t.shape) != (B, D) or not t.is_contiguous() or t.dtype != dt:
            raise ValueError(f"rope_attend: {what} must be contiguous {NAMES[dt]} ({B}, {D}), got {t.dtype} "
                             f"{tuple(t.shape)}")
    if start.dtype != torch.int64 or tuple(start.shape) != (B,) or col.dtype != torch.int64 or col.numel() != 1:
        raise ValueError(f"rope_attend: start must be int64 ({B},) and col int64 (1,), got {start.dtype} "
                         f"{tuple(start.shape)} and {col.dtype} {tuple(col.shape)}")
    if split_columns is None:
        split_columns = SPLIT_COLUMNS
    if split_columns is not None and split_columns < 1:
        raise ValueError(f"rope_attend: split_columns must be positive, got {split_columns}")
    o = torch.empty((B, H * D), dtype=dt, device=q.device)
    if not B:
        return o
    start = start.contiguous()
    # the grid is fixed when a CUDA graph captures it: it depends on the shapes and the GPU, not on the column
    if split_columns is None:   # the slices' columns a multiple of `quantum`, at least one of it
        ns, quantum = slices(B, KVH, S, _device_limits(q.device)[2]), SLICE_COLUMNS
    else:
        ns, quantum = -(-S // split_columns), split_columns
    extra = [flag] if mixed else []
    if ns <= 1:
        _kernel(attend_name(group, D, dtype=dt, cache_dtype=ct), q.device)(
            grid=(B * KVH, 1, 1), block=(THREADS, 1, 1),
            args=[q, k, v, sq, sk, sv, cos, sin, k_cache, v_cache, start, col, o, KVH, S, float(scale)] + extra)
        return o
    part = torch.empty((B * KVH * ns * group * D,), dtype=torch.float32, device=q.device)
    pm = torch.empty((B * KVH * ns * group,), dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    _kernel(attend_name(group, D, split=True, dtype=dt, cache_dtype=ct), q.device)(
        grid=(B * KVH, ns, 1), block=(THREADS, 1, 1),
        args=[q, k, v, sq, sk, sv, cos, sin, k_cache, v_cache, start, col, part, KVH, S, float(scale),
              int(quantum), pm, pl] + extra)
    _kernel(combine_name(group, D, dt), q.device)(
        grid=(B * KVH, 1, 1), block=(THREADS, 1, 1), args=[part, pm, pl, start, col, o, KVH, ns, int(quantum)])
    return o


# ---- the same, slowly (float64), for the tests ---------------------------------------------------------

def reference_add_rms_norm(x, d, weight, eps):
    xo = x.double() + (d.double() if d is not None else 0)
    y = weight.double() * xo * torch.rsqrt(xo.pow(2).mean(-1, keepdim=True) + eps)
    return xo, y


def reference_silu_mul(gate, up):
    g = gate.double()
    return g / (1 + torch.exp(-g)) * up.double()


def reference_rope_attend(q, k, v, cos, sin, k_cache, v_cache, start, col, scale):
    """Returns (o (B, H D), the rotated new key (B, KVH, D)), and writes column col of the caches as the
    kernel does (the rotation in fp32, rounded per op, as the engine's `_rotate`)."""
    B, KVH, S, D = k_cache.shape
    H = q.shape[1] // D
    G, half, c = H // KVH, D // 2, int(col[0])

    def rot(x):   # (B, n, D) fp32
        r = torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin[:, None]
        return x * cos[:, None] + r
    qr = rot(q[:, :H * D].reshape(B, H, D))
    kr = rot(k[:, :KVH * D].reshape(B, KVH, D))
    k_cache[:, :, c] = kr
    v_cache[:, :, c] = v[:, :KVH * D].reshape(B, KVH, D)
    o = torch.empty(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        lo = int(start[b])
        for hq in range(H):
            keys = k_cache[b, hq // G, lo:c + 1].double()
            vals = v_cache[b, hq // G, lo:c + 1].double()
            p = torch.softmax(scale * (keys @ qr[b, hq].double()), 0)
            o[b, hq] = p @ vals
    return o.reshape(B, H * D), kr


__all__ = ["HEAD_DIMS", "KernelUnavailable", "MAX_GROUP", "add_rms_norm", "kernel_names", "reference_add_rms_norm",
           "reference_rope_attend", "reference_silu_mul", "rope_attend", "shape_reason", "silu_mul", "slices",
           "unavailable_reason"]
