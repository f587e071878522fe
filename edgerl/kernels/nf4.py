"""A few rows times an NF4 weight, in one kernel that reads the 4-bit codes once (the rollout's decode step).

bitsandbytes multiplies a few rows by a 4-bit weight in two steps: dequantize the whole weight to the
compute dtype (writing N x K values), then a GEMM that reads them back. For a decode step of 16 rows in
fp32 (what a P40 plan computes in), that is 8.5 bytes moved per weight for 32 flops, and it was most of
the step (docs/benchmarks.md, Fused NF4 decode kernel). This kernel reads the packed codes (0.5 bytes a weight) and
their block scales, decodes them in registers and multiplies in fp32: the same products, no fp32 copy.

    y = x @ W.T (+ bias),  W[n, k] = code[q(n, k)] * absmax[(n K + k) // blocksize]

with q the 4-bit code (two per byte, the first element in the high nibble) and, under double
quantization, absmax[b] = code2[qabsmax[b]] * absmax2[b // blocksize2] + offset, exactly as
`bitsandbytes.functional.dequantize_4bit` computes it. x in fp32, fp16 or bf16; the products and sums
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

Compiled at run time with NVRTC (`nvrtc.py`) for the GPU's own architecture: CC 6.0 and up with a
CUDA 12 torch, 7.5 and up with CUDA 13.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .nvrtc import KernelUnavailable, blocks_per_sm, kernel

MAX_ROWS_PER_BLOCK = 16
WARPS = 8
SUM_ROWS = 4       # rows of x per block of nf4_sum (the source's SUM_ROWS)
MAX_ROWS = 65535   # rows of x one call takes (nf4_mm's grid has a block row per 16 rows, nf4_sum per 4)
MAX_RANK = 256   # a LoRA adapter's rank the kernels take (nf4_sum stages x A^T in 256 floats of shared memory)

SOURCE = r"""
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
// `wsn` columns) that nf4_sum adds up.
// A LoRA adapter's x A^T rides along as `rank` more rows of W, in fp32: the blocks past the weight's last
// (blockIdx.x >= N tiles) multiply by rows of A (r, K) instead of decoded codes and write their partials
// in columns N.. of the same rows, which nf4_sum adds up before it multiplies by B. A separate kernel for
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
  const float off = nested ? *offp : 0.f;
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
          scale[r] = nested ? c2[qabs[b]] * abs2[b >> lbs2] + off : absf[b];
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

// The partial sums of the splits added up, the bias, and a LoRA adapter's share scale * t B[n]^T, with
// t = x A^T summed from its own partials (columns N.. of the workspace) into shared memory first. Block:
// 256 output columns of SUM_ROWS rows of x. A thread reads its column's row of B once, four floats at a
// time, for all its rows (the first version, a block per row reading B one float at a time, waited on
// those loads in turn: docs/lab-log.md, Figures from earlier code comments). Every output's sum runs in the same order as before:
// the splits in turn, the bias, then scale * sum_j t[j] B[n, j] over j in turn.
#define SUM_ROWS 4
template <typename T>
__global__ void __launch_bounds__(256) nf4_sum(const float* __restrict__ ws, const T* __restrict__ bias,
                                               T* __restrict__ y, int M, int N, int splits, int has_bias,
                                               const float* __restrict__ lb, int rank, double lscale, int wsn) {
  __shared__ __align__(16) float t[SUM_ROWS * 256];
  const int m0 = blockIdx.y * SUM_ROWS, n = blockIdx.x * 256 + threadIdx.x;
  for (int i = threadIdx.x; i < SUM_ROWS * rank; i += 256) {
    const int m = i / rank, j = i - m * rank;
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
        const float* tm = t + m * 256 + j;
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


def mm_name(dtype: torch.dtype = torch.float32, rows: int = MAX_ROWS_PER_BLOCK, rows_of_w: int = 2) -> str:
    """The instantiation of `nf4_mm` for x in `dtype`, a tile of `rows` rows of x and `rows_of_w` rows of W
    per lane (what `nf4_matmul` launches; the defaults are a decode step's, which the doctor compiles)."""
    return f"nf4_mm<{_TYPES[dtype]}, {rows}, {rows_of_w}>"


def decode_kernels(dtype: torch.dtype = torch.float32) -> list[str]:
    """Every instantiation a decode step in `dtype` launches (what the doctor compiles)."""
    t = _TYPES[dtype]
    return [mm_name(dtype), f"nf4_sum<{t}>"]


def _kernel(name: str, device: torch.device):
    k = kernel(SOURCE, name, device)
    if not hasattr(k, "slots_per_sm"):
        k.slots_per_sm = blocks_per_sm(k, WARPS * 32)
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
    return ""


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, state: Any, bias: Optional[torch.Tensor] = None,
               lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
               splits: Optional[int] = None) -> torch.Tensor:
    """x (..., K) @ W.T (+ bias) for a bitsandbytes NF4 weight W (N, K): `packed` its uint8 codes,
    `state` its QuantState. Returns (..., N) in x's dtype. Any number of rows; meant for a few.
    lora = (A, B, scale): adds scale * (x A^T) B^T before the result is rounded, with A (r, K) and B (N, r)
    in fp32 and r <= MAX_RANK: a LoRA adapter's output, as peft adds it, inside the same two kernels.
    splits: how many parts K is split into (default: `_splits`' choice; the benchmark sweeps it)."""
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
    la, lb, rank, scale = x2, x2, 0, 0.0
    if lora is not None:
        la, lb, scale = lora[0].contiguous(), lora[1].contiguous(), float(lora[2])
        if la.data_ptr() % 16:   # the kernels read A's rows (and B's) 16 bytes at a time
            la = la.clone()
        if lb.data_ptr() % 16:
            lb = lb.clone()
        rank = la.shape[0]
        if la.dtype != torch.float32 or lb.dtype != torch.float32 or la.shape != (rank, k) or lb.shape != (n, rank) \
                or not 0 < rank <= MAX_RANK:
            raise ValueError(f"nf4_matmul: lora needs fp32 A (r, {k}) and B ({n}, r) with 0 < r <= {MAX_RANK}, got "
                             f"{lora[0].dtype} {tuple(lora[0].shape)} and {lora[1].dtype} {tuple(lora[1].shape)}")
    mt = _rows_tile(m)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    r = _rows_of_w(n)
    kern = _kernel(mm_name(x.dtype, mt, r), x.device)
    tiles = -(-n // (32 * r)) + -(-rank // (32 * r))   # the weight's rows, then A's
    blocks = tiles * -(-m // mt)
    splits = _splits(blocks, k // 64, sms * kern.slots_per_sm) if splits is None else max(1, min(splits, k // 64))
    per_split = -(-(k // 64) // splits)
    splits = -(-(k // 64) // per_split)
    code = state.code.to(device=x.device, dtype=torch.float32)
    if state.nested:
        s2 = state.state2
        qabs, abs2, code2, off, absf, lbs2 = state.absmax, s2.absmax, s2.code, state.offset, code, _log2(s2.blocksize)
    else:
        qabs, abs2, code2, off, absf, lbs2 = packed, code, code, code, state.absmax.float(), 0
    b = bias.to(x.dtype).contiguous() if bias is not None else x2
    wsn = n + rank   # a workspace row: the weight's outputs, then x A^T
    ws = torch.empty((splits, m, wsn), dtype=torch.float32, device=x.device) if splits > 1 or rank else y
    kern(
        grid=(tiles, -(-m // mt), splits), block=(WARPS * 32, 1, 1),
        args=[x2, packed, qabs, abs2, code2, off, absf, code, b, y, ws, m, n, k, _log2(state.blocksize), lbs2,
              int(bool(state.nested)), int(bias is not None), per_split, la, rank, wsn])
    if splits > 1 or rank:
        _kernel(f"nf4_sum<{_TYPES[x.dtype]}>", x.device)(grid=(-(-n // 256), -(-m // SUM_ROWS), 1), block=(256, 1, 1),
                                           args=[ws, b, y, m, n, splits, int(bias is not None), lb, rank, scale, wsn])
    return y.reshape(*x.shape[:-1], n)


def dequantize_reference(packed: torch.Tensor, state: Any) -> torch.Tensor:
    """The NF4 weight (N, K) in fp32, decoded the slow, obvious way (on the packed tensor's device)."""
    n, k = tuple(state.shape)
    b = packed.reshape(-1).to(torch.int64)
    codes = torch.stack((b >> 4, b & 15), dim=1).reshape(-1)[:n * k]
    if state.nested:
        s2 = state.state2
        scale2 = s2.absmax.float().repeat_interleave(s2.blocksize)[:state.absmax.numel()]
        absmax = s2.code.float()[state.absmax.to(torch.int64)] * scale2 + state.offset.float()
    else:
        absmax = state.absmax.float()
    w = state.code.float().to(packed.device)[codes] * absmax.repeat_interleave(state.blocksize)[:n * k]
    return w.reshape(n, k)


def reference(x: torch.Tensor, packed: torch.Tensor, state: Any, bias: Optional[torch.Tensor] = None,
              lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """What `nf4_matmul` computes, in plain torch: fp32 products and sums, the result in x's dtype."""
    y = x.float() @ dequantize_reference(packed, state).to(x.device).T
    if bias is not None:
        y = y + bias.to(x.dtype).float()
    if lora is not None:
        a, b, scale = lora
        y = y + scale * ((x.float() @ a.float().T) @ b.float().T)
    return y.to(x.dtype)


__all__ = ["KernelUnavailable", "MAX_ROWS_PER_BLOCK", "MAX_RANK", "dequantize_reference", "nf4_matmul", "reference",
           "input_unsupported", "unsupported", "weight_unsupported"]
