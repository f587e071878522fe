"""Tile and chunk choosers: pure functions, checked across the capability table, plus a compile of the
real kernels for sm_80/86/90 (no GPU needed) to prove the shared-memory estimate bounds what Triton
allocates."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgerl.device.device import CAPABILITIES
from edgerl.kernels.tiles import SMEM_DEFAULT, Tiles, choose_chunk, choose_tiles, estimate_smem, make_tiles

REPO = Path(__file__).resolve().parents[1]

# Shared memory per block (opt-in) by compute capability, from edgerl's one capability table.
CAPABILITY_SMEM = {cc: row.smem_per_block_optin for cc, row in CAPABILITIES.items()}
HIDDEN = (576, 896, 960, 2048, 4096)
VOCAB = (49152, 151936)


def test_tiles_module_imports_neither_torch_nor_triton():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('tiles', {str(REPO / 'edgerl' / 'kernels' / 'tiles.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['tiles'] = m; spec.loader.exec_module(m)\n"
        "m.choose_tiles(49152, 'bf16', 896, 151936)\n"
        "bad = [n for n in ('torch', 'triton') if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("cc,smem", sorted(CAPABILITY_SMEM.items()))
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_choose_tiles_never_exceeds_the_device(cc, smem, dtype):
    for hidden in HIDDEN:
        for vocab in VOCAB:
            for cc_arg in (cc, None):
                t = choose_tiles(smem, dtype, hidden, vocab, cc=cc_arg)
                assert isinstance(t, Tiles) and t.dtype == dtype
                assert t.smem_bytes == estimate_smem(t.block_n, t.block_v, t.block_k, t.num_stages, dtype)
                assert t.smem_bytes <= smem, (cc, dtype, hidden, vocab, t)
                assert str(smem) in t.reason
                if cc_arg is not None and cc < (8, 0):
                    assert t.num_stages <= 2  # no cp.async before sm_80
    # Bigger budgets never choose a worse tile than the 48 KB default.
    small = choose_tiles(SMEM_DEFAULT, dtype, 896, 151936)
    big = choose_tiles(smem, dtype, 896, 151936)
    assert big.block_n * big.block_v >= small.block_n * small.block_v


def test_choose_tiles_uses_what_big_devices_offer():
    hopper = choose_tiles(232448, "bf16", 896, 151936, cc=(9, 0))
    assert (hopper.block_n, hopper.block_v, hopper.block_k, hopper.num_stages) == (128, 128, 64, 4)
    assert hopper.smem_bytes > 2 * SMEM_DEFAULT  # it really uses the opt-in memory
    a100 = choose_tiles(166912, "bf16", 2048, 49152, cc=(8, 0))
    assert a100.smem_bytes > 3 * SMEM_DEFAULT
    p48 = choose_tiles(49152, "bf16", 896, 151936)
    assert p48.block_n * p48.block_v <= 64 * 64


def test_estimate_smem_counts_stages_and_operands():
    # 4 stages x (128 + 128) x 64 bf16 operand bytes + the 128 x 128 bf16 epilogue tile
    assert estimate_smem(128, 128, 64, 4, "bf16") == 4 * 256 * 64 * 2 + 128 * 128 * 2
    assert estimate_smem(64, 64, 32, 2, "fp32") == 2 * estimate_smem(64, 64, 32, 2, "bf16")
    assert estimate_smem(64, 64, 32, 3, "bf16") > estimate_smem(64, 64, 32, 2, "bf16")


def test_small_shapes_get_small_blocks():
    t = choose_tiles(232448, "fp32", 24, 40)
    assert t.block_k <= 32 and t.block_v <= 64


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="dtype='float16'"):
        choose_tiles(49152, "float16", 896, 1000)
    with pytest.raises(ValueError, match="smallest tile config"):
        choose_tiles(1024, "fp32", 896, 1000)
    with pytest.raises(ValueError, match="power of two"):
        make_tiles(48, 64, 32, "bf16")
    with pytest.raises(ValueError, match="n_tokens"):
        choose_chunk(0, 100, 1 << 20)


def test_choose_chunk_bounds_the_temporaries():
    for n, v, budget, bpl in [(8192, 151936, 256 << 20, 8), (12288, 49152, 1 << 30, 2), (7, 300, 1 << 30, 8),
                              (100, 151936, 1000, 8)]:
        c = choose_chunk(n, v, budget, bytes_per_logit=bpl)
        assert 1 <= c <= n
        assert c == 1 or c * v * bpl <= budget
        if c < n:  # as large as the budget allows
            assert (c + 1) * v * bpl > budget


def _compile_shared(configs, *mode):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "triton_compile_smem.py"), *mode, json.dumps(configs)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_estimate_bounds_what_triton_allocates_when_compiling_the_kernels():
    """Compile both kernels for real targets (Triton's bundled ptxas; no GPU needed) with the tiles
    chosen for a 48 KB budget and for each target's own budget; Triton's metadata.shared must fit
    under our estimate, which fits under the budget. Compile with aligned pointers and hidden % 16
    == 0, as the JIT specialises a real launch, so the loop really is pipelined."""
    cases = []
    for dtype in ("bf16", "fp32"):
        t48 = choose_tiles(SMEM_DEFAULT, dtype, 896, 151936)
        cases += [(cc, dtype, t48, SMEM_DEFAULT) for cc in (80, 90)]
    for cc, smem in ((80, 166912), (86, 101376), (90, 232448)):
        t = choose_tiles(smem, "bf16", 896, 151936, cc=(cc // 10, cc % 10))
        cases.append((cc, "bf16", t, smem))
    configs = [[cc, dt, t.block_n, t.block_v, t.block_k, t.num_warps, t.num_stages] for cc, dt, t, _ in cases]
    results = _compile_shared(configs)
    for (cc, dt, t, budget), got in zip(cases, results):
        for kernel in ("fwd", "grad"):
            assert 0 < got[kernel] <= t.smem_bytes <= budget, (cc, dt, t, got)
            # and the estimate is not so loose that it wastes the device: within 2x of Triton's figure
            # for bf16 on sm_90, where the wgmma pipeline allocates all num_stages buffers.
            if cc == 90 and dt == "bf16":
                assert t.smem_bytes <= 2 * got[kernel], (cc, dt, t, got)


# (cc, shared memory per block, opt-in): A100, A10/3090 (sm_86; sm_89 compiles to the same sizes), H100/H200
DECODE_TARGETS = ((80, 166912), (86, 101376), (90, 232448))


def test_decode_attention_stages_fit_what_triton_allocates():
    """The decode-attention kernel compiled for real targets with the pipeline depth the launcher picks
    for each head size, dtype and group: Triton's metadata.shared fits under the estimate, which fits
    under the target's shared memory; where no depth fits, the launcher refuses (a forced fp32 kernel at
    head size 256 on sm_86) rather than fail at the first decode step."""
    from edgerl.kernels.tiles import decode_attention_smem, decode_attention_stages, group_pad
    cases = []
    # 16-bit at every head size (fp16 compiles to bf16's sizes), fp32 (forced) at the large ones; groups
    # of 7 (Qwen2.5) and 20 (padded to 32)
    shapes = [("bf16", 2, 64, 7), ("bf16", 2, 128, 7), ("bf16", 2, 256, 20), ("fp32", 4, 128, 20), ("fp32", 4, 256, 7)]
    for cc, smem in DECODE_TARGETS:
        for dtype, elt, head_dim, group in shapes:
            stages = decode_attention_stages(smem, head_dim, elt, group_pad(group))
            if stages is None:
                assert (cc, dtype, head_dim) == (86, "fp32", 256)
                continue
            cases.append((cc, smem, dtype, elt, head_dim, group, stages))
    assert {c[6] for c in cases if c[0] == 90 and c[2] == "bf16" and c[4] <= 128} == {3}   # as measured on the H200
    assert any(c[6] < 3 for c in cases if c[0] == 86)   # a smaller depth where the big one does not fit
    got = _compile_shared([[cc, dtype, hd, group, stages] for cc, _, dtype, _, hd, group, stages in cases], "decode")
    for (cc, smem, dtype, elt, head_dim, group, stages), shared in zip(cases, got):
        estimate = decode_attention_smem(head_dim, elt, group_pad(group), stages)
        assert 0 < shared <= estimate <= smem, (cc, dtype, head_dim, group, stages, shared, estimate)


# The decode step's projections at the 360M and 1.7B widths: (k, n, glu, norm)
DECODE_SHAPES = [(960, 1600, False, True), (960, 960, False, False), (960, 2560, True, True), (2560, 960, False, False),
                 (2048, 6144, False, True), (2048, 2048, False, False), (2048, 8192, True, True),
                 (8192, 2048, False, False)]


@pytest.mark.parametrize("cc", sorted(CAPABILITIES))
def test_decode_linear_tiles_fit_every_device(cc):
    """Every GPU edgerl knows gets blocks that tl.dot accepts, whose buffers fit its shared memory, and a split
    whose slices hold whole BK blocks; the products with a norm or SiLU * up are never split."""
    from edgerl.kernels.tiles import decode_linear_smem, decode_linear_tiles
    smem = CAPABILITIES[cc].smem_per_block_optin
    for rows in (1, 16, 48, 200):
        for dtype_bytes in (2, 4):
            for k, n, glu, norm in DECODE_SHAPES:
                bm, bn, bk, warps, stages, split, swap = decode_linear_tiles(rows, n, k, dtype_bytes, glu, 80, smem,
                                                                             norm=norm)
                assert min(bm, bn, bk) >= 16 and all(v & (v - 1) == 0 for v in (bm, bn, bk)) and bm >= min(rows, 64)
                assert decode_linear_smem(bm, bn, bk, dtype_bytes, glu, stages) <= smem
                assert split == 1 or (not (glu or norm) and k // split >= 2 * bk)
                assert swap in (0, 1) and warps == 4


def test_decode_linear_tiles_are_the_measured_ones_on_an_h200():
    """The H200 rows of docs/benchmarks.md, Decode projections (132 SMs, 227 KB per block)."""
    from edgerl.kernels.tiles import decode_linear_tiles
    got = [decode_linear_tiles(16, n, k, 2, glu, 132, 232448, norm=norm)[1:] for k, n, glu, norm in DECODE_SHAPES]
    assert got[4] == (64, 256, 4, 4, 1, 1)     # q/k/v: W x^T, one pass over the inner dimension
    assert got[6] == (32, 256, 4, 3, 1, 0)     # gate/up: two weight blocks per program, 3 stages
    assert got[7] == (32, 128, 4, 4, 4, 0)     # down: the 8192-wide inner dimension over 4 programs
    assert got[1] == got[5] == (16, 256, 4, 4, 1, 0)   # o: 16 columns per program, one pass, not split
    assert got[3][4] == 4                      # 360M down: 2560 columns hold four slices of 2 x 128
