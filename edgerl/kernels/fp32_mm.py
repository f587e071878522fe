"""A few rows times an fp32 weight, streaming the weight at the memory's rate (the fp32 rollout's decode step).

In an fp32 plan (a P40, P100 or GTX 10-series card) every decode step multiplies a few rows (16 at most) by every
weight of the model: y = x @ W.T (+ bias), with W (N, K) as `nn.Linear` stores it. Each weight is read once and
multiplied into each row, 2 x 16 FLOPs per 4-byte weight, so the step is bound by reading the weights. cuBLAS's
fp32 GEMM at 16 rows read them at a fraction of the copy bandwidth (docs/benchmarks.md, Decode step at long
lengths). This kernel reads them as a stream (its figures against cuBLAS: docs/benchmarks.md, fp32 decode matmuls):

- a block of 8 warps and one slice of K of `ks` columns (a multiple of 128) stages x's rows over that slice in
  shared memory once, issuing all its loads before any store, and with its first loads of W already in flight;
  then it takes tiles of 8 x NC rows of W (a warp NC of them, NC = 4) in turn, so a slice's stage serves several
  tiles (the grid is as many blocks as the GPU holds at once, not one per tile: `plan_grid`);
- a warp walks its NC rows 128 columns at a time, each lane 4 consecutive columns (one 16-byte load per row:
  the warp reads 512 contiguous bytes of each row), and multiplies them into every row of x from shared memory
  (consecutive lanes, consecutive addresses), keeping NC x MT partial sums in registers; each step's loads are
  in flight during the previous step's products, and a tile's first loads during the previous tile's writes;
- the 32 lanes' partial sums meet by halving: at each of 5 shuffle rounds a lane sends half its values and
  keeps half, so the NC x MT sums cost 62 shuffles (for 64 values), not 5 per value;
- where K is split into more than one slice (so that small weights still fill the GPU), each slice's warp writes
  fp32 partial sums and counts itself done; the last of a tile's slices to finish adds them up in a fixed order
  (slice 0, 1, ...) with the bias, in the same kernel: the result does not depend on which block finished first,
  and no second kernel is launched;
- a LoRA adapter (`lora=`: peft's layer over an fp32 base in a decode step) rides along: x A^T first, through
  this kernel, then scale (x A^T) B^T added to each output as it is written, with the bias.

The products and sums are fp32 (fused multiply-adds), in another order than cuBLAS; `reference` is the same
formula in float64, slowly; the CUDA tests compare the kernel with it. Compiled at run time with NVRTC
(`nvrtc.py`) for the GPU's own architecture.
"""

from __future__ import annotations

from typing import Optional

import torch

from .nvrtc import KernelUnavailable, blocks_per_sm, kernel

MAX_ROWS = 16     # rows of x one call takes (a decode step's); more rows go to cuBLAS (`takes`)
MIN_ROWS = 2      # the fewest rows `takes` sends to the kernel: one row goes to cuBLAS's GEMV
MAX_RANK = 256    # a LoRA adapter's rank `fp32_matmul` adds (a loop over it per output)
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

// acc[c MT + m] += the 4 columns of W's row c in w[c] times those of x's row m at xs[m ks]
template <int MT, int NC>
__device__ __forceinline__ void products(float* acc, const float4* w, const float* xs, int ks) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const float4 a = *(const float4*)&xs[m * ks];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      float u = acc[c * MT + m];
      u = fmaf(w[c].x, a.x, u); u = fmaf(w[c].y, a.y, u);
      u = fmaf(w[c].z, a.z, u); u = fmaf(w[c].w, a.w, u);
      acc[c * MT + m] = u;
    }
  }
}

// An output from its sum over K: the bias added, then a LoRA adapter's ls (t B^T)[m, n] with t = x A^T (M, lr) and
// B (N, lr), as peft adds it (lr = 0: none).
__device__ __forceinline__ float out(float v, const float* __restrict__ bias, int has_bias,
                                     const float* __restrict__ lt, const float* __restrict__ lb, float ls, int lr,
                                     int m, int n) {
  if (has_bias) v += bias[n];
  if (lr) {
    float u = 0.f;
    for (int j = 0; j < lr; ++j) u = fmaf(lt[m * lr + j], lb[(long long)n * lr + j], u);
    v += u * ls;
  }
  return v;
}

// y (M, N) = x (M, K) W (N, K)^T (+ bias) (+ a LoRA adapter's term: `out`), M <= MT. The grid is (blocks of rows, slices of K): block (b, s) stages
// x's MT rows over the slice [k0, k0 + ks) of K in shared memory once (zeros past row M and past K), then takes
// the tiles of 8 NC rows of W b, b + gridDim.x, ... in turn; warp w of a tile multiplies its NC rows, each lane 4
// consecutive columns a step of 128. A tile's first loads are issued before the previous tile's writes.
// K % 4 == 0 and 16-byte aligned rows (the launcher checks). One slice: y gets the sums and the bias. More: each
// warp writes its slice's sums to ws (slices, M, N) and counts itself in cnt[its NC rows]; the last of the slices'
// warps to count adds ws's slices up in order (0, 1, ...) with the bias into y and sets the count back to 0, so the
// result does not depend on which block finished first and cnt is all zeros again when the kernel ends.
template <int MT, int NC>
__global__ void __launch_bounds__(256, 2) fp32_mm(const float* __restrict__ x, const float* __restrict__ w,
                                                 const float* __restrict__ bias, float* __restrict__ y,
                                                 float* __restrict__ ws, int* __restrict__ cnt,
                                                 int M, int N, int K, int ks, int has_bias,
                                                 const float* __restrict__ lt, const float* __restrict__ lb,
                                                 float ls, int lr) {
  __shared__ __align__(16) float xs[STAGE];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tiles = (N + 8 * NC - 1) / (8 * NC), S = gridDim.y;
  const int k0 = blockIdx.y * ks, kn = min(ks, K - k0);   // columns of this slice, a multiple of 4
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  int t = blockIdx.x;
  if (t >= tiles) return;   // (the launcher gives no more blocks of rows than tiles)
  // the warp's first row of W in this tile at column k0 + 4 lane, and its last row below N: row c of the warp
  // reads row min(c, last) (a row past N reads row N - 1, whose sums are never written)
  const float* wr = w + (long long)min(t * 8 * NC + warp * NC, N - 1) * K + k0 + 4 * lane;
  int last = min(NC - 1, N - 1 - min(t * 8 * NC + warp * NC, N - 1));
  float4 wv[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c)   // in flight while x is staged
    wv[c] = 4 * lane < kn ? *(const float4*)(wr + (long long)min(c, last) * K) : zero;
  {   // the stage, row m and columns 4 j .. 4 j + 3 of the slice per float4: every load issued before any store
    constexpr int R = STAGE / 4 / 256;
    const int q4 = ks >> 2;
    float4 st[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = tid + 256 * r, m = i / q4, j = i - m * q4;
      st[r] = (i < MT * q4 && m < M && 4 * j < kn) ? *(const float4*)(x + (long long)m * K + k0 + 4 * j) : zero;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = tid + 256 * r, m = i / q4, j = i - m * q4;
      if (i < MT * q4) *(float4*)&xs[m * ks + 4 * j] = st[r];
    }
  }
  __syncthreads();
  constexpr int V = NC * MT;
  constexpr int PER = V >= 32 ? V / 32 : 1;    // values a lane holds after the folds
  constexpr int RUN = V >= 32 ? 1 : 32 / V;    // lanes holding the same value
  for (;;) {
    const int n0 = t * 8 * NC + warp * NC;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.f;
    int k = 4 * lane;
    for (; k + 128 < kn; k += 128) {
      float4 nx[NC];   // the next step's loads, issued before this step's products
#pragma unroll
      for (int c = 0; c < NC; ++c) nx[c] = *(const float4*)(wr + (long long)min(c, last) * K + k - 4 * lane + 128);
      products<MT, NC>(acc, wv, xs + k, ks);
#pragma unroll
      for (int c = 0; c < NC; ++c) wv[c] = nx[c];
    }
    if (k < kn) products<MT, NC>(acc, wv, xs + k, ks);
    Fold<V, 16>::run(acc, lane);
    const int next = t + gridDim.x;
    if (next < tiles) {   // the next tile's first loads, in flight during this one's writes
      wr = w + (long long)min(next * 8 * NC + warp * NC, N - 1) * K + k0 + 4 * lane;
      last = min(NC - 1, N - 1 - min(next * 8 * NC + warp * NC, N - 1));
#pragma unroll
      for (int c = 0; c < NC; ++c) wv[c] = 4 * lane < kn ? *(const float4*)(wr + (long long)min(c, last) * K) : zero;
    }
    if (lane % RUN == 0) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int idx = PER * (lane / RUN) + i, c = idx / MT, m = idx - c * MT, n = n0 + c;
        if (m >= M || n >= N) continue;
        if (S == 1) y[(long long)m * N + n] = out(acc[i], bias, has_bias, lt, lb, ls, lr, m, n);
        else ws[((long long)blockIdx.y * M + m) * N + n] = acc[i];
      }
    }
    if (S > 1 && n0 < N) {
      __threadfence();   // this warp's sums reach every block before its count does
      __syncwarp();
      int done = 0;
      if (lane == 0) done = atomicAdd(&cnt[n0 / NC], 1) == S - 1;
      if (__shfl_sync(FULL, done, 0)) {
        __threadfence();
        for (int i = lane; i < NC * M; i += 32) {
          const int c = i / M, m = i - c * M, n = n0 + c;
          if (n >= N) continue;
          float v = 0.f;
          for (int s = 0; s < S; ++s) v += __ldcg(&ws[((long long)s * M + m) * N + n]);
          y[(long long)m * N + n] = out(v, bias, has_bias, lt, lb, ls, lr, m, n);
        }
        if (lane == 0) cnt[n0 / NC] = 0;
      }
    }
    if (next >= tiles) break;
    t = next;
  }
}
"""


def rows_tile(m: int) -> int:
    """The instantiation's rows of x (MT) for m rows: the least power of two from 1 to 16 that holds them."""
    return next(t for t in (1, 2, 4, 8, 16) if t >= min(m, MAX_ROWS))


def mm_name(rows: int = MAX_ROWS) -> str:
    return f"fp32_mm<{rows_tile(rows)}, {NC}>"


def decode_kernels(rows: int = MAX_ROWS) -> list[str]:
    """Every instantiation a decode step of `rows` rows launches (what the doctor compiles)."""
    return [mm_name(rows)]


def all_kernels() -> list[str]:
    return sorted({mm_name(t) for t in (1, 2, 4, 8, 16)})


def _kernel(name: str, device: torch.device):
    k = kernel(SOURCE, name, device)
    if not hasattr(k, "slots_per_sm"):
        k.slots_per_sm = blocks_per_sm(k, WARPS * 32)
    return k


def slice_choices(k: int, rows: int) -> range:
    """The slices of K a call of `rows` rows may take: multiples of STEP up to the stage of x (MT x ks floats) and
    no wider than K needs."""
    return range(STEP, min(STAGE_FLOATS // rows_tile(rows), -(-k // STEP) * STEP) + 1, STEP)


STAGE_COST = 2   # a block's staging of x, in steps of 128 columns (the cost model's unit)
TILE_COST = 1    # a tile's sums across lanes and its writes, in steps


def grid_cost(n: int, k: int, rows: int, slots: int, ks: int, blocks: Optional[int] = None) -> tuple[int, int]:
    """(cost in steps, blocks of rows) of slicing K by `ks` with `slots` blocks resident on the GPU at once. Each
    slice gets as many blocks of rows as fit beside the other slices' (or `blocks`); a block stages x once and then
    takes its tiles in turn, so the cost is the waves of blocks times a block's stage and its tiles' steps."""
    tiles = -(-n // (WARPS * NC))
    slices = -(-k // ks)
    bx = blocks if blocks is not None else max(1, min(tiles, slots // slices))
    waves = -(-bx * slices // slots)
    return waves * (STAGE_COST + -(-tiles // bx) * (-(-min(ks, k) // STEP) + TILE_COST)), bx


def plan_grid(n: int, k: int, rows: int, slots: int) -> tuple[int, int]:
    """(slice of K, blocks of rows per slice) of least `grid_cost`, ties to the fewest slices. Too few blocks leave
    SMs idle (a 1536 x 1536 weight has 48 tiles of rows for an H100's 132 SMs), and each slice's sums cost a write
    and a read more."""
    ks = min(slice_choices(k, rows), key=lambda s: (grid_cost(n, k, rows, slots, s)[0], -s))
    return ks, grid_cost(n, k, rows, slots, ks)[1]


_grids: dict[tuple, tuple[int, int]] = {}   # (N, K, rows, device) -> plan_grid's choice


def chosen_grid(n: int, k: int, rows: int, device: torch.device) -> tuple[int, int]:
    """`plan_grid`'s (slice of K, blocks of rows) for this shape on this GPU (its SMs and the kernel's blocks per
    SM), once."""
    key = (n, k, rows, device.index)
    got = _grids.get(key)
    if got is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        got = _grids[key] = plan_grid(n, k, rows, sms * _kernel(mm_name(rows), device).slots_per_sm)
    return got


_counts: dict[int, torch.Tensor] = {}   # device index -> the split products' counts (int32, zeros between calls)


def counts(n: int, device: torch.device) -> torch.Tensor:
    """The kernel's counts of slices done per NC rows of W, for N = n: zeros, which each call leaves zeros. One
    buffer per GPU, so calls on one GPU must be ordered (one stream, as the decode step's are)."""
    need = -(-n // NC)
    buf = _counts.get(device.index)
    if buf is None or buf.numel() < need:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fp32_matmul: a weight of {n} rows first met inside a CUDA graph's capture; run "
                               "the step once before capturing it")
        buf = _counts[device.index] = torch.zeros(max(need, 1 << 16), dtype=torch.int32, device=device)
    return buf


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
    """'' when `fp32_matmul` can add this LoRA adapter (A, B, scale) to a product with `w`, else why not."""
    a, b = lora[0], lora[1]
    n, k = w.shape
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2 \
            or a.shape[1] != k or tuple(b.shape) != (n, a.shape[0]) or not 0 < a.shape[0] <= MAX_RANK:
        return (f"lora needs A (r, {k}) and B ({n}, r) with 0 < r <= {MAX_RANK}, got "
                f"{tuple(getattr(a, 'shape', ()))} and {tuple(getattr(b, 'shape', ()))}")
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
                ks: Optional[int] = None, blocks: Optional[int] = None,
                lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """x (..., K) @ w.T (+ bias) for an fp32 weight w (N, K), at most MAX_ROWS rows of x. Returns (..., N) fp32.
    ks: the slice of K each block multiplies, blocks: the blocks of rows each slice gets (default: `plan_grid`'s
    choice; the benchmark sweeps them). lora = (A, B, scale), fp32 A (r, K) and B (N, r) with r <= MAX_RANK: adds
    scale * (x A^T) B^T as peft's LoRA layer does, x A^T through this kernel first and the rest in the outputs'
    writes (two launches where peft's layer takes six more kernels)."""
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
        return (y.zero_() if bias is None else y.copy_(bias.expand(m, n))).reshape(*x.shape[:-1], n)
    kern = _kernel(mm_name(m), x.device)
    if ks is None and blocks is None:
        ks, blocks = chosen_grid(n, k, m, x.device)
    else:
        if ks is None:
            ks = chosen_grid(n, k, m, x.device)[0]
        elif ks % STEP or not STEP <= ks <= STAGE_FLOATS // rows_tile(m):
            raise ValueError(f"fp32_matmul: ks={ks} must be a multiple of {STEP} from {STEP} to "
                             f"{STAGE_FLOATS // rows_tile(m)} for {m} rows")
        tiles = -(-n // (WARPS * NC))
        if blocks is None:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            blocks = grid_cost(n, k, m, sms * kern.slots_per_sm, ks)[1]
        elif not 1 <= blocks <= tiles:
            raise ValueError(f"fp32_matmul: blocks={blocks} must be from 1 to {tiles} (the weight's tiles of "
                             f"{WARPS * NC} rows)")
    slices = -(-k // ks)
    b = bias.contiguous() if bias is not None else y
    ws = torch.empty((slices, m, n), dtype=torch.float32, device=x.device) if slices > 1 else y
    cnt = counts(n, x.device) if slices > 1 else y
    lt, lb, scale, rank = y, y, 0.0, 0
    if lora is not None:
        lt, lb, scale, rank = fp32_matmul(x2, lora[0]), lora[1].contiguous(), float(lora[2]), lora[0].shape[0]
    kern(grid=(blocks, slices, 1), block=(WARPS * 32, 1, 1),
         args=[x2, w, b, y, ws, cnt, m, n, k, ks, int(bias is not None), lt, lb, scale, rank])
    return y.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear` for the decode step: through the kernel where `takes` says so, else cuBLAS (`F.linear`)."""
    if takes(x, w, bias):
        return fp32_matmul(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
              lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """What `fp32_matmul` computes, in float64."""
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if lora is not None:
        y = y + lora[2] * ((x.double() @ lora[0].double().T) @ lora[1].double().T)
    return y


__all__ = ["KernelUnavailable", "MAX_RANK", "MAX_ROWS", "chosen_grid", "decode_kernels", "fp32_matmul", "linear", "reference",
           "lora_unsupported", "plan_grid", "slice_choices", "takes", "unsupported"]
