"""Tile sizes for the Triton log-prob kernels, and chunk sizes for the torch path, as pure functions.

The planner calls these without a GPU and without torch, so this module imports neither torch nor
triton. Everything here is arithmetic on integers and strings.

Both Triton kernels (the fused forward and the grad-logits kernel of the backward, see
``_triton_kernels.py``) compute a logits tile ``z[BLOCK_N tokens, BLOCK_V vocab] = h @ W.T`` with a
``tl.dot`` loop over the hidden size in steps of BLOCK_K, then an epilogue on the fp32 tile. Their
shared memory is what :func:`estimate_smem` counts.
"""
from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of the tl.dot operands (and of the grad-logits tile the backward stores).
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# The default static limit, and the only one on Pascal: tiles chosen for it compile everywhere.
SMEM_DEFAULT = 49152

# Largest logits tile: 128 x 128 fp32 accumulators are 64 registers per thread at 8 warps; the
# epilogue holds two or three more tiles of that size, so a larger tile spills registers.
_MAX_TILE_AREA = 128 * 128
_BLOCKS = (128, 64, 32, 16)  # tl.dot needs every dimension >= 16
_BLOCK_K = (64, 32, 16)
_STAGES = (4, 3, 2, 1)

# Bytes per logit of the torch path's temporaries: the fp32 logits chunk and one fp32 tile of the
# same shape (exp in the forward; p and grad-logits in the backward). Measured by
# tests/test_kernels_on_cpu.py::test_torch_path_peak_memory_is_bounded_by_the_chunk.
TORCH_BYTES_PER_LOGIT = 8


@dataclass(frozen=True)
class Tiles:
    """A tile configuration for the Triton kernels.

    block_n: tokens per tile (M of the tl.dot), block_v: vocabulary entries per tile (N),
    block_k: hidden-size step (K). smem_bytes: what :func:`estimate_smem` says the kernels need for
    ``dtype``; reason: one line on why this configuration was chosen.
    """

    block_n: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int
    smem_bytes: int
    dtype: str
    reason: str

    def __post_init__(self):
        for name in ("block_n", "block_v", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles.{name}={v}: tl.dot needs a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tiles.num_warps={self.num_warps}: use 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"Tiles.num_stages={self.num_stages}: must be >= 1")
        _dtype_bytes(self.dtype)


def _dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPE_BYTES)}") from None


def estimate_smem(block_n: int, block_v: int, block_k: int, num_stages: int, dtype: str) -> int:
    """Shared memory (bytes) one program of either kernel needs, an upper bound.

    - Operand buffers of the pipelined tl.dot loop: each stage holds one h tile (block_n x block_k)
      and one W tile (block_k x block_v) in the input dtype. Triton allocates num_stages of them on
      sm_90 and num_stages - 1 (at least one) on sm_80-sm_89.
    - Epilogue: the grad-logits kernel stores its (block_n x block_v) tile in the input dtype; Triton
      converts the tl.dot accumulator layout to a coalesced one through shared memory first. The
      forward kernel's row reductions need far less.
    Triton can let the epilogue scratch reuse the operand buffers (its allocator is liveness-based),
    in which case it needs the larger of the two; we count the sum, so that the estimate stays an
    upper bound if a Triton version does not. tests/test_tiles_on_cpu.py compiles the kernels for
    sm_80/86/90 and checks the compiler's own figure against this one.
    """
    elt = _dtype_bytes(dtype)
    pipeline = num_stages * (block_n + block_v) * block_k * elt
    epilogue = block_n * block_v * elt
    return pipeline + epilogue


def make_tiles(block_n: int, block_v: int, block_k: int, dtype: str, *, num_warps: int | None = None,
               num_stages: int = 2, reason: str = "given") -> Tiles:
    """A Tiles with its smem estimate filled in (for tests, benchmarks and hand-tuning)."""
    if num_warps is None:
        num_warps = 8 if block_n * block_v >= _MAX_TILE_AREA else 4
    smem = estimate_smem(block_n, block_v, block_k, num_stages, dtype)
    return Tiles(block_n, block_v, block_k, num_warps, num_stages, smem, dtype, reason)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def choose_tiles(smem_per_block_optin: int, dtype: str, hidden: int, vocab: int, *,
                 cc: tuple[int, int] | None = None) -> Tiles:
    """The tile configuration for a device with ``smem_per_block_optin`` bytes of shared memory per block.

    dtype: "fp32" | "fp16" | "bf16" (the dtype of hidden states and weight). cc: the compute capability,
    if known; below sm_80 there is no cp.async, so more than two stages buy nothing there.
    Never returns a config whose :func:`estimate_smem` exceeds ``smem_per_block_optin``.

    Score = arithmetic intensity of the logits tile, block_n*block_v / (block_n+block_v) (how many
    flops each loaded byte feeds), times how much of the K loop's memory latency the pipeline hides,
    min(block_k * num_stages, 128) / 128; ties go to the larger tile, then more stages. For bf16
    this gives 128x128, K step 64, 4 stages on 227 KB (H100/H200) and 163 KB (A100); 128x128, K step
    32, 4 stages on 99 KB (sm_86/89/120); 64x64 with block_k x stages = 128 on 48 KB.
    """
    elt = _dtype_bytes(dtype)
    if hidden < 1 or vocab < 1:
        raise ValueError(f"hidden={hidden}, vocab={vocab}: both must be >= 1")
    max_stages = 2 if cc is not None and tuple(cc) < (8, 0) else max(_STAGES)
    k_cap = max(16, _next_pow2(hidden))
    v_cap = max(16, _next_pow2(vocab))
    best = None
    for bn in _BLOCKS:
        for bv in _BLOCKS:
            if bn * bv > _MAX_TILE_AREA or bv > v_cap:
                continue
            for bk in _BLOCK_K:
                if bk > k_cap:
                    continue
                for st in _STAGES:
                    if st > max_stages:
                        continue
                    smem = estimate_smem(bn, bv, bk, st, dtype)
                    if smem > smem_per_block_optin:
                        continue
                    intensity = bn * bv / (bn + bv)
                    hide = min(bk * st, 128) / 128
                    key = (intensity * hide, bn * bv, st, bk)
                    if best is None or key > best[0]:
                        best = (key, bn, bv, bk, st, smem)
    if best is None:
        need = estimate_smem(16, 16, 16, 1, dtype)
        raise ValueError(f"smem_per_block_optin={smem_per_block_optin} bytes: the smallest tile config "
                         f"needs {need} bytes for {dtype}; is this the right device attribute?")
    _, bn, bv, bk, st, smem = best
    warps = 8 if bn * bv >= _MAX_TILE_AREA else 4
    reason = (f"{smem_per_block_optin} B smem per block: {bn}x{bv} tokens x vocab tile, K step {bk}, "
              f"{st} stages, {warps} warps need {smem} B ({elt}-byte {dtype} operands)")
    return Tiles(bn, bv, bk, warps, st, smem, dtype, reason)


def choose_chunk(n_tokens: int, vocab: int, budget_bytes: int, *, bytes_per_logit: int = TORCH_BYTES_PER_LOGIT) -> int:
    """Tokens per chunk so that chunk x vocab temporaries stay within ``budget_bytes``.

    The torch path holds about ``TORCH_BYTES_PER_LOGIT`` bytes per logit of a chunk at once; the
    Triton backward holds its grad-logits slab in the input dtype (pass ``bytes_per_logit=2`` for
    fp16/bf16, 4 for fp32). At least one token, at most ``n_tokens``.
    """
    if n_tokens < 1 or vocab < 1:
        raise ValueError(f"n_tokens={n_tokens}, vocab={vocab}: both must be >= 1")
    if budget_bytes < 1 or bytes_per_logit < 1:
        raise ValueError(f"budget_bytes={budget_bytes}, bytes_per_logit={bytes_per_logit}: both must be >= 1")
    return max(1, min(n_tokens, budget_bytes // (vocab * bytes_per_logit)))


# ---- the decode-step attention kernel (edgerl/kernels/_triton_decode_attention.py) ---------------------------------

DECODE_BLOCK_S = 64   # cache columns per loop iteration


def decode_attention_head_reason(head_dim: int) -> str | None:
    """Why the kernel cannot take this head size (tl.arange needs a power of two), or None."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two in [16, 256]"
    return None


def decode_attention_smem(head_dim: int, dtype_bytes: int, group_pad: int, num_stages: int) -> int:
    """Shared memory (bytes) one program of the decode-attention kernel needs, an upper bound: the
    pipelined loop's K and V blocks (DECODE_BLOCK_S x head_dim each; Triton keeps num_stages - 1 pairs
    on sm_80-sm_90 for this kernel's mma, one K block without pipelining), and the query tile and the
    softmax weights' layout conversion ((group_pad + 32) x head_dim) with 4 KB to spare.
    tests/test_tiles_on_cpu.py compiles the kernel for sm_80/86/90 and checks Triton's own figure
    against this one."""
    block = DECODE_BLOCK_S * head_dim * dtype_bytes
    buffers = 2 * (num_stages - 1) if num_stages >= 2 else 1
    return buffers * block + (group_pad + 32) * head_dim * dtype_bytes + 4096


def decode_attention_stages(smem_per_block_optin: int, head_dim: int, dtype_bytes: int,
                            group_pad: int) -> int | None:
    """The deepest pipeline (3, 2 or 1 stages) whose shared memory fits the device, or None."""
    for stages in (3, 2, 1):
        if decode_attention_smem(head_dim, dtype_bytes, group_pad, stages) <= smem_per_block_optin:
            return stages
    return None


def group_pad(group: int) -> int:
    """Query heads per KV head padded to a power of two >= 16 (tl.dot's least size)."""
    return max(16, _next_pow2(group))


# edgerl/kernels/decode_cuda.py (the fp32 decode layer in CUDA C): 256 threads share a head's columns in the
# P V product (256 / D of them per dimension), and the softmax gives each query head of a KV head a warp.
DECODE_CUDA_HEAD_DIMS = (32, 64, 128, 256)
DECODE_CUDA_MAX_GROUP = 8
# rope_attend splits the columns a row sees into slices, a block each (split-K), merged by a second kernel: one
# block per row and KV head (32 at 16 rows of Qwen2.5-1.5B's 2 KV heads) leaves most SMs idle. The grid has
# enough slices per row and KV head for this many blocks per SM, and a row's columns spread over them at every
# length, each slice a multiple of DECODE_CUDA_SLICE_COLUMNS columns. Swept on an H100 (16 and 8 rows; 2, 4 and 8
# KV heads; 512 to 8192 columns), the fastest fixed slice at each length gave 128 to 512 blocks, mostly 2 to 4 a
# SM, where the former fixed slices of 512 columns gave 32 to 128 blocks at 512 columns; two blocks a SM beat three
# and four at the fp32 plans' heads (docs/benchmarks.md, The attention at long lengths: split over columns).
DECODE_CUDA_SLICE_BLOCKS_PER_SM = 2
DECODE_CUDA_SLICE_COLUMNS = 64


# The fused NF4 decode kernel (edgerl/kernels/nf4.py) takes a decode step's rows up to this many: per projection
# in fp32 it beat bitsandbytes' dequantize-then-GEMM at 32 rows and matched it at 64 (docs/benchmarks.md, Fused
# NF4 decode kernel); more rows go to bitsandbytes.
NF4_DECODE_ROWS = 32


def nf4_on_tensor_cores(compute: str, cc: tuple[int, int]) -> bool:
    """Whether the fused NF4 kernel multiplies a decode step in `compute` ("fp32", "fp16", "bf16") on a GPU of
    compute capability `cc` on tensor cores (kernels/nf4.py, nf4_mma): fp16 from CC 7.5, where mma.sync m16n8k8
    starts (a V100's tensor cores lack it)."""
    return compute == "fp16" and tuple(cc) >= (7, 5)


def decode_cuda_shape_reason(head_dim: int, group: int) -> str | None:
    """Why the CUDA C decode kernels cannot take this head size and query heads per KV head (None: they can)."""
    if head_dim not in DECODE_CUDA_HEAD_DIMS:
        return f"head size {head_dim} is not one of {', '.join(map(str, DECODE_CUDA_HEAD_DIMS))}"
    if not 1 <= group <= DECODE_CUDA_MAX_GROUP:
        return f"{group} query heads per KV head (at most {DECODE_CUDA_MAX_GROUP})"
    return None


# edgerl/kernels/_triton_decode_linear.py (the decode step's projections with their elementwise work fused):
# each program walks the inner dimension (or a slice of it) for BN output columns, so the programs' count
# is what spreads the weight's bytes over the SMs, and the bytes each has in flight (BK x BN x stages) what
# hides the memory's latency. The blocks come from a sweep at 16 rows over the 360M and 1.7B
# shapes (`bench/bench_decode_gemm.py --triton --sweep`, docs/benchmarks.md, Decode projections): for each of
# the eight products within 7% of the fastest tiles measured in the same run.


def decode_linear_smem(block_m: int, block_n: int, block_k: int, dtype_bytes: int, glu: bool, stages: int) -> int:
    """Shared memory of one program: `stages` buffers of the x block and the weight block(s)."""
    return stages * block_k * (block_m + block_n * (2 if glu else 1)) * dtype_bytes


def decode_linear_tiles(rows: int, n: int, k: int, dtype_bytes: int, glu: bool, sms: int,
                        smem_per_block_optin: int, *, norm: bool = False) -> tuple[int, int, int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages, split, swap) for `rows` rows times an (n, k) weight (n: output
    columns; under glu each program reads two weight blocks of BN rows):
    - glu (gate/up, the norm before it): BN 32, BK 256, up to 3 stages;
    - norm (q/k/v): BN 64, BK 256, the product computed as W x^T (swap: the weight block as the first
      operand, faster there: docs/lab-log.md, Figures from earlier code comments);
    - o (the residual add after it, an inner dimension no longer than its output): BN 16, BK 256, not split
      (faster than the down product's tiles: docs/benchmarks.md, Decode projections);
    - otherwise (down, the residual add after it): BN 32, BK 128, the inner dimension split over 4 or 2
      programs where each slice still holds two BK blocks and the programs stay within 4 per SM.
    Stages: the deepest of up to 4 that fits in shared memory with a quarter spare for the compiler's own
    scratch (BK halved until 2 stages fit). fp32 (dtype_bytes 4): half the BK."""
    bm = min(64, max(16, _next_pow2(rows)))
    m_blocks = -(-rows // bm)
    most, swap = 4, norm and not glu
    if glu:
        bn, bk, most = 32, 256, 3
    elif norm:
        bn, bk = 64, 256
    elif k <= n:
        bn, bk = 16, 256
    else:
        bn, bk = 32, 128
    if dtype_bytes == 4:
        bk //= 2
    split = 1
    if not (glu or norm or k <= n):
        programs = -(-n // bn) * m_blocks
        split = next((s for s in (4, 2) if k // s >= 2 * bk and programs * s <= 4 * sms), 1)
    room = smem_per_block_optin * 3 // 4
    while True:
        stages = next((s for s in (4, 3, 2) if s <= most and decode_linear_smem(bm, bn, bk, dtype_bytes, glu, s)
                       <= room), 0)
        if stages or bk <= 32:
            return bm, bn, bk, 4, max(stages, 1), split, int(swap)
        bk //= 2
