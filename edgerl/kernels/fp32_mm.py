"""A few rows times an fp32 weight, streaming the weight at the memory's rate (the fp32 rollout's decode step).

In an fp32 plan (a P40, P100 or GTX 10-series card) every decode step multiplies a few rows (16 at most) by every
weight of the model: y = x @ W.T (+ bias), with W (N, K) as `nn.Linear` stores it. Each weight is read once and
multiplied into each row, 2 x 16 FLOPs per 4-byte weight, so the step is bound by reading the weights. cuBLAS's
fp32 GEMM at 16 rows read them at a fraction of the copy bandwidth (docs/benchmarks.md, Decode step at long
lengths). This kernel reads them as a stream (its figures against cuBLAS: docs/benchmarks.md, fp32 decode matmuls):

- a block of 8 warps owns 8 x NC rows of W (a warp NC of them, NC = 4) and one slice of K of `ks` columns (a
  multiple of 128); the block stages x's rows over that slice in shared memory once, after issuing its first
  loads of W;
- a warp walks its NC rows 128 columns at a time, each lane 4 consecutive columns (one 16-byte load per row:
  the warp reads 512 contiguous bytes of each row), and multiplies them into every row of x from shared memory
  (consecutive lanes, consecutive addresses), keeping NC x MT partial sums in registers;
- the 32 lanes' partial sums meet by halving: at each of 5 shuffle rounds a lane sends half its values and
  keeps half, so the NC x MT sums cost 62 shuffles (for 64 values), not 5 per value;
- where K is split into more than one slice (so that small weights still fill the GPU: `split_columns`), each
  slice writes fp32 partial sums and a second kernel (`mm_sum`) adds them up in a fixed order with the bias: the
  result does not depend on which block finished first;
- a LoRA adapter (`lora=`) rides along as the NF4 kernel's does: its A as r more rows of the weight (x A^T in the
  same launch, in columns N.. of the partial sums), and scale (x A^T) B^T in the second kernel (the NF4 kernel's,
  `nf4.SUM_SOURCE`'s `splits_sum`): two launches a projection, where computing x A^T first took four (each
  product with its own sum).

The products and sums are fp32 (fused multiply-adds), in another order than cuBLAS; `reference` is the same
formula in float64, slowly; the CUDA tests compare the kernel with it. Compiled at run time with NVRTC
(`nvrtc.py`) for the GPU's own architecture.
"""

from __future__ import annotations

from typing import Optional

import torch

from .nf4 import COMMON, SUM_SOURCE, lora_bounds, lora_term, sum_splits
from .nvrtc import KernelUnavailable, blocks_per_sm, kernel

MAX_ROWS = 16     # rows of x one call takes (a decode step's); more rows go to cuBLAS (`takes`)
MIN_ROWS = 2      # the fewest rows `takes` sends to the kernel: one row goes to cuBLAS's GEMV
MAX_RANK = 256    # a LoRA adapter's rank `fp32_matmul` adds (the sum kernel stages x A^T in 256 floats)
NC = 4            # rows of W per warp (the source's NC)
WARPS = 8
STAGE_FLOATS = 12288   # the block's stage of x: MT x ks floats in 48 KB (the source's STAGE)
STEP = 128        # columns of K a warp reads per step (32 lanes x 4)

SOURCE = r"""
#define STAGE 12288
#define FULL 0xffffffffu

// v[0 .. N) of every lane: lanes `off` apart trade halves, each keeps the sum of the half it holds in v[0 .. N/2).
template <int N>
__device__ __forceinline__ void fold(float* v, int lane, int off) {
  const bool up = lane & off;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float send = up ? v[i] : v[i + N / 2];
    const float keep = up ? v[i + N / 2] : v[i];
    v[i] = keep + __shfl_xor_sync(FULL, send, off);
  }
}

// The warp's sums of N values per lane over its 32 lanes: 5 rounds (offsets 16 .. 1) of folding while more than one
// value is held, plain sums after. At the end lane l holds the values (N / 32) l + i for i < N / 32 (N >= 32), or,
// N < 32, value l / (32 / N) (every lane of a run of 32 / N holds it).
template <int N, int OFF>
struct Fold {
  static __device__ __forceinline__ void run(float* v, int lane) {
    fold<N>(v, lane, OFF);
    Fold<(N > 2 ? N / 2 : 1), OFF / 2>::run(v, lane);
  }
};
template <int OFF>
struct Fold<1, OFF> {
  static __device__ __forceinline__ void run(float* v, int lane) {
    v[0] += __shfl_xor_sync(FULL, v[0], OFF);
    Fold<1, OFF / 2>::run(v, lane);
  }
};
template <int N>
struct Fold<N, 0> {
  static __device__ __forceinline__ void run(float*, int) {}
};
template <>
struct Fold<1, 0> {
  static __device__ __forceinline__ void run(float*, int) {}
};

// y (M, N) = x (M, K) W (N, K)^T (+ bias), M <= MT: block (8 warps) blockIdx.x owns W's rows n0 .. n0 + 8 NC - 1
// (warp w: n0 + w NC .. + NC - 1) and blockIdx.y the slice [k0, k0 + ks) of K. x's MT rows over the slice are
// staged in shared memory (zeros past row M and past K); each lane multiplies 4 consecutive columns of its warp's
// NC rows into them per step of 128 columns. K % 4 == 0 and 16-byte aligned rows (the launcher checks). One slice
// and no adapter: y gets the sums and the bias; else ws (slices, M, wsn) gets each slice's sums, which mm_sum adds
// (splits_sum with an adapter). Blocks from blockIdx.x = wtiles on multiply by the `rank` rows of a LoRA adapter's
// A (la, (rank, K)) instead, their sums in columns N.. of ws.
template <int MT, int NC>
__global__ void __launch_bounds__(256, 2) fp32_mm(const float* __restrict__ x, const float* __restrict__ w,
                                                 const float* __restrict__ bias, float* __restrict__ y,
                                                 float* __restrict__ ws, int M, int N, int K, int ks, int has_bias,
                                                 const float* __restrict__ la, int rank, int wsn, int wtiles) {
  __shared__ __align__(16) float xs[STAGE];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool atile = blockIdx.x >= wtiles;
  const float* src = atile ? la : w;
  const int rows = atile ? rank : N, col = atile ? N : 0;
  const int n0 = (atile ? blockIdx.x - wtiles : blockIdx.x) * 8 * NC + warp * NC;
  const int k0 = blockIdx.y * ks, kn = min(ks, K - k0);   // columns of this slice, a multiple of 4
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* wr[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) wr[c] = src + (long long)min(n0 + c, rows - 1) * K + k0;   // a row past the last:
  float4 wv[NC];                                                                  // read it, its sums not written
#pragma unroll
  for (int c = 0; c < NC; ++c) wv[c] = 4 * lane < kn ? *(const float4*)(wr[c] + 4 * lane) : zero;   // in flight
  const int q4 = ks >> 2;
  for (int i = tid; i < MT * q4; i += 256) {   // the stage: row m, columns 4 j .. 4 j + 3 of the slice
    const int m = i / q4, j = i - m * q4;
    *(float4*)&xs[m * ks + 4 * j] = (m < M && 4 * j < kn) ? *(const float4*)(x + (long long)m * K + k0 + 4 * j) : zero;
  }
  __syncthreads();
  float acc[NC * MT];
#pragma unroll
  for (int i = 0; i < NC * MT; ++i) acc[i] = 0.f;
  for (int k = 4 * lane; k < kn; k += 128) {
    float4 nx[NC];   // the next step's loads, issued before this step's products
    const bool more = k + 128 < kn;
#pragma unroll
    for (int c = 0; c < NC; ++c) nx[c] = more ? *(const float4*)(wr[c] + k + 128) : zero;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float4 a = *(const float4*)&xs[m * ks + k];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float t = acc[c * MT + m];
        t = fmaf(wv[c].x, a.x, t); t = fmaf(wv[c].y, a.y, t);
        t = fmaf(wv[c].z, a.z, t); t = fmaf(wv[c].w, a.w, t);
        acc[c * MT + m] = t;
      }
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) wv[c] = nx[c];
  }
  Fold<NC * MT, 16>::run(acc, lane);
  constexpr int V = NC * MT;
  constexpr int PER = V >= 32 ? V / 32 : 1;    // values a lane holds
  constexpr int RUN = V >= 32 ? 1 : 32 / V;    // lanes holding the same value
  if (lane % RUN) return;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int idx = PER * (lane / RUN) + i, c = idx / MT, m = idx - c * MT, n = n0 + c;
    if (m >= M || n >= rows) continue;
    if (gridDim.y == 1 && !rank) y[(long long)m * N + n] = has_bias ? acc[i] + bias[n] : acc[i];
    else ws[((long long)blockIdx.y * M + m) * wsn + col + n] = acc[i];
  }
}

// y (M, N) = the slices' partial sums in ws (S, M, N) added in order, then the bias: a thread per output (without an
// adapter; with one, splits_sum).
__global__ void __launch_bounds__(256) mm_sum(const float* __restrict__ ws, const float* __restrict__ bias,
                                              float* __restrict__ y, int M, int N, int S, int has_bias) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x, mn = (long long)M * N;
  if (i >= mn) return;
  float v = 0.f;
  for (int s = 0; s < S; ++s) v += ws[s * mn + i];
  y[i] = has_bias ? v + bias[i % N] : v;
}
""" + COMMON + SUM_SOURCE


def rows_tile(m: int) -> int:
    """The instantiation's rows of x (MT) for m rows: the least power of two from 1 to 16 that holds them."""
    return next(t for t in (1, 2, 4, 8, 16) if t >= min(m, MAX_ROWS))


def mm_name(rows: int = MAX_ROWS) -> str:
    return f"fp32_mm<{rows_tile(rows)}, {NC}>"


def decode_kernels(rows: int = MAX_ROWS) -> list[str]:
    """Every instantiation a decode step of `rows` rows launches (what the doctor compiles)."""
    return [mm_name(rows), "mm_sum", "splits_sum<float>"]


def all_kernels() -> list[str]:
    return sorted({mm_name(t) for t in (1, 2, 4, 8, 16)} | {"mm_sum", "splits_sum<float>"})


def _kernel(name: str, device: torch.device):
    k = kernel(SOURCE, name, device)
    if not hasattr(k, "slots_per_sm"):
        k.slots_per_sm = blocks_per_sm(k, WARPS * 32)
    return k


def slice_choices(k: int, rows: int) -> range:
    """The slices of K a call of `rows` rows may take: multiples of STEP up to the stage of x (MT x ks floats) and
    no wider than K needs."""
    return range(STEP, min(STAGE_FLOATS // rows_tile(rows), -(-k // STEP) * STEP) + 1, STEP)


def split_columns(n: int, k: int, rows: int, slots: int) -> int:
    """The slice of K each block multiplies (of `slice_choices`): the fewest waves of `slots` resident blocks times
    each block's steps, plus two steps of a block's fixed work (staging x, the sums across lanes). Too few blocks
    leave SMs idle (a 1536 x 1536 weight has 48 blocks of rows for an H100's 132 SMs), and a last wave barely
    filled costs a whole one."""
    tiles = -(-n // (WARPS * NC))

    def cost(ks: int) -> tuple[float, int]:
        blocks = tiles * -(-k // ks)
        return -(-blocks // slots) * (ks // STEP + 2), -ks   # ties: the fewest slices
    return min(slice_choices(k, rows), key=cost)


_slices: dict[tuple, int] = {}   # (N, K, rows, device) -> split_columns' choice


def chosen_slice(n: int, k: int, rows: int, device: torch.device) -> int:
    """`split_columns`' slice of K for this shape on this GPU (its SMs and the kernel's blocks per SM), once."""
    key = (n, k, rows, device.index)
    ks = _slices.get(key)
    if ks is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        ks = _slices[key] = split_columns(n, k, rows, sms * _kernel(mm_name(rows), device).slots_per_sm)
    return ks


def unsupported(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> str:
    """'' when `fp32_matmul` can multiply these, else why not."""
    if not (x.is_cuda and w.is_cuda):
        return "the input or the weight is not on a CUDA device"
    if x.dtype != torch.float32 or w.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return f"the input is {x.dtype} and the weight {w.dtype}, not fp32"
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        return f"the input's width {x.shape[-1]} is not the weight's {tuple(w.shape)} second dimension"
    if bias is not None and (not bias.is_cuda or tuple(bias.shape) != (w.shape[0],)):
        return f"the bias {tuple(bias.shape)} on {bias.device} is not the weight's {w.shape[0]} outputs on its GPU"
    if w.shape[1] % 4 or not w.is_contiguous() or w.data_ptr() % 16:
        return (f"the weight {tuple(w.shape)} must be contiguous, 16-byte aligned and have a multiple of 4 columns "
                "(the kernel reads 4 at a time)")
    return ""


def lora_unsupported(w: torch.Tensor, lora: tuple) -> str:
    """'' when `fp32_matmul` can add this LoRA adapter (A, B, scale), or these adapters stacked with their weights
    (A, B, scale, bounds: `nf4.lora_bounds`), to a product with `w`, else why not."""
    a, b = lora[0], lora[1]
    n, k = w.shape
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2 \
            or a.shape[1] != k or b.shape[0] != n or not 0 < a.shape[0] <= MAX_RANK:
        return (f"lora needs A (r, {k}) and B ({n}, r) with 0 < r <= {MAX_RANK}, got "
                f"{tuple(getattr(a, 'shape', ()))} and {tuple(getattr(b, 'shape', ()))}")
    try:
        lora_bounds(lora, n)
    except ValueError as e:
        return str(e)
    return unsupported(a.new_empty(0, k), a) or ("" if b.dtype == torch.float32 and b.device == w.device
                                                 else f"lora's B is {b.dtype} on {b.device}, not fp32 on {w.device}")


def takes(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether the decode step's matmul x @ w.T goes through the kernel: MIN_ROWS to MAX_ROWS rows, outside autograd,
    and inputs it takes. The prefill's many rows (a GEMM cuBLAS runs at its arithmetic rate) and a single row
    (cuBLAS's GEMV, as fast: docs/benchmarks.md, fp32 decode matmuls) go to cuBLAS."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (MIN_ROWS <= rows <= MAX_ROWS and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not unsupported(x, w, bias))


def fp32_matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                ks: Optional[int] = None, lora: Optional[tuple] = None) -> torch.Tensor:
    """x (..., K) @ w.T (+ bias) for an fp32 weight w (N, K), at most MAX_ROWS rows of x. Returns (..., N) fp32.
    ks: the slice of K each block multiplies (default: `split_columns`' choice; the benchmark sweeps it).
    lora = (A, B, scale), fp32 A (r, K) and B (N, r) with r <= MAX_RANK: adds scale (x A^T) B^T as peft's LoRA
    layer does: x A^T as more rows of the weight in the same launch, scale (x A^T) B^T in the sum kernel (peft's
    layer takes its base matmul and six more kernels); or (A, B, scale, bounds): adapters stacked with their
    weights (`nf4.lora_bounds`)."""
    why = unsupported(x, w, bias) or (lora_unsupported(w, lora) if lora is not None else "")
    if why:
        raise ValueError(f"fp32_matmul: {why}")
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.data_ptr() % 16:   # the kernel reads x's rows 16 bytes at a time
        x2 = x2.clone(memory_format=torch.contiguous_format)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp32_matmul: {m} rows; the kernel takes at most {MAX_ROWS} (a decode step's)")
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    if k == 0:
        # x A^T is zeros with K = 0, and so is the adapter's term
        return (y.zero_() if bias is None else y.copy_(bias.expand(m, n))).reshape(*x.shape[:-1], n)
    kern = _kernel(mm_name(m), x.device)
    if ks is None:
        ks = chosen_slice(n, k, m, x.device)
    elif ks % STEP or not STEP <= ks <= STAGE_FLOATS // rows_tile(m):
        raise ValueError(f"fp32_matmul: ks={ks} must be a multiple of {STEP} from {STEP} to "
                         f"{STAGE_FLOATS // rows_tile(m)} for {m} rows")
    slices = -(-k // ks)
    b = bias.contiguous() if bias is not None else y
    la, lb, scale, rank = y, y, 0.0, 0
    if lora is not None:
        la, lb, scale, rank = lora[0], lora[1].contiguous(), float(lora[2]), lora[0].shape[0]
        if lb.data_ptr() % 16:   # the sum kernel reads B's rows 16 bytes at a time
            lb = lb.clone()
    ws = torch.empty((slices, m, n + rank), dtype=torch.float32, device=x.device) if slices > 1 or rank else y
    wtiles = -(-n // (WARPS * NC))
    kern(grid=(wtiles + -(-rank // (WARPS * NC)), slices, 1), block=(WARPS * 32, 1, 1),
         args=[x2, w, b, y, ws, m, n, k, ks, int(bias is not None), la, rank, n + rank, wtiles])
    if rank:
        sum_splits(SOURCE, ws, b if bias is not None else None, y, slices, lb, rank, scale, lora_bounds(lora, n))
    elif slices > 1:
        _kernel("mm_sum", x.device)(grid=(-(-m * n // 256), 1, 1), block=(256, 1, 1),
                                    args=[ws, b, y, m, n, slices, int(bias is not None)])
    return y.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear` for the decode step: through the kernel where `takes` says so, else cuBLAS (`F.linear`)."""
    if takes(x, w, bias):
        return fp32_matmul(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
              lora: Optional[tuple] = None) -> torch.Tensor:
    """What `fp32_matmul` computes, in float64."""
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if lora is not None:
        y = y + lora_term(x.double(), lora)
    return y


__all__ = ["KernelUnavailable", "MAX_RANK", "MAX_ROWS", "chosen_slice", "decode_kernels", "fp32_matmul", "linear",
           "lora_unsupported", "reference", "slice_choices", "split_columns", "takes", "unsupported"]
