"""The fp32 few-row matmul's host side and its lanes' reduction, without a GPU (the kernel itself:
tests/test_fp32_mm_cuda.py; its compilation for each card: tests/test_nvrtc_compile_on_cpu.py)."""

import pytest
import torch

from edgerl.kernels import fp32_mm


def _fold_like_the_kernel(values: list[list[float]]) -> list[list[float]]:
    """`Fold<V, 16>::run` of the source, lane by lane: values[lane] holds the lane's V partial sums."""
    v = [list(lane) for lane in values]
    n, off = len(v[0]), 16
    while off:
        if n > 1:   # fold<n>: lanes `off` apart trade halves
            new = []
            for lane in range(32):
                up, other = lane & off, v[lane ^ off]
                new.append([(v[lane][i + n // 2] if up else v[lane][i]) + (other[i + n // 2] if up else other[i])
                            for i in range(n // 2)] + v[lane][n // 2:])
            v, n = new, max(n // 2, 1)
        else:       # one value left: a plain sum
            v = [[v[lane][0] + v[lane ^ off][0]] + v[lane][1:] for lane in range(32)]
        off //= 2
    return v


@pytest.mark.parametrize("nc,mt", [(4, 1), (4, 2), (4, 4), (4, 8), (4, 16)])
def test_the_lanes_reduction_leaves_each_sum_where_the_kernel_reads_it(nc, mt):
    """After the folds, lane l holds value PER (l / RUN) + i for i < PER, the sum over all 32 lanes: the index
    arithmetic fp32_mm writes its outputs with."""
    V = nc * mt
    g = torch.Generator().manual_seed(V)
    parts = torch.randint(-1000, 1000, (32, V), generator=g).double()   # integers: sums exact in any order
    folded = _fold_like_the_kernel(parts.tolist())
    per, run = (V // 32, 1) if V >= 32 else (1, 32 // V)
    seen = set()
    for lane in range(32):
        if lane % run:
            continue
        for i in range(per):
            idx = per * (lane // run) + i
            assert folded[lane][i] == float(parts[:, idx].sum()), (lane, i, idx)
            seen.add(idx)
    assert seen == set(range(V))   # every output written once


def test_the_grid_fills_the_gpu_once_and_takes_every_tile_of_every_slice_once():
    slots = 264   # an H100: 132 SMs x 2 blocks
    for n, k, rows in [(2048, 1536, 16), (1536, 1536, 16), (17920, 1536, 16), (1536, 8960, 16), (49152, 1536, 1),
                       (7, 4, 3), (151936, 1536, 8), (40, 128, 1)]:
        ks, blocks = fp32_mm.plan_grid(n, k, rows, slots)
        assert ks in fp32_mm.slice_choices(k, rows)
        tiles, slices = -(-n // (fp32_mm.WARPS * fp32_mm.NC)), -(-k // ks)
        assert 1 <= blocks <= tiles and blocks * slices <= slots   # one wave: no block waits for another's SM
        # the least cost of every slice the kernel takes, with the blocks of rows grid_cost gives each
        assert all(fp32_mm.grid_cost(n, k, rows, slots, ks)[0] <= fp32_mm.grid_cost(n, k, rows, slots, s)[0]
                   for s in fp32_mm.slice_choices(k, rows))
        # the kernel's walk: block (b, s) takes tiles b, b + blocks, ... below `tiles`
        taken = sorted(t for b in range(blocks) for t in range(b, tiles, blocks))
        assert taken == list(range(tiles))
    # a 1536 x 1536 weight has 48 tiles of rows: split 3 ways or more they fill an H100 (144 blocks), not 2 (96)
    assert -(-1536 // fp32_mm.plan_grid(1536, 1536, 16, slots)[0]) >= 3
    # a wide weight takes the widest slice and several tiles a block: gate/up of Qwen2.5-1.5B
    ks, blocks = fp32_mm.plan_grid(17920, 1536, 16, slots)
    assert ks == fp32_mm.STAGE_FLOATS // 16 and blocks == slots // 2
    with_more_waves = fp32_mm.grid_cost(17920, 1536, 16, slots, ks, blocks=560)   # a block per tile: 5 waves
    assert with_more_waves[0] > fp32_mm.grid_cost(17920, 1536, 16, slots, ks)[0]


def test_rows_tile_and_what_the_kernel_takes(monkeypatch):
    assert [fp32_mm.rows_tile(m) for m in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert fp32_mm.decode_kernels(16) == ["fp32_mm<16, 4>"]
    x, w = torch.randn(4, 128), torch.randn(8, 128)
    assert not fp32_mm.takes(x, w)   # the CPU: F.linear
    assert "not on a CUDA device" in fp32_mm.unsupported(x, w)
    torch.testing.assert_close(fp32_mm.linear(x, w), torch.nn.functional.linear(x, w), rtol=0, atol=0)
    with pytest.raises(ValueError, match="fp32_matmul: the input or the weight is not on a CUDA device"):
        fp32_mm.fp32_matmul(x, w)
    monkeypatch.setattr(fp32_mm, "unsupported", lambda *a: "")   # the rows it takes, of inputs it takes
    assert [fp32_mm.takes(torch.randn(m, 128), w) for m in (1, 2, 16, 17)] == [False, True, True, False]
    assert fp32_mm.takes(torch.randn(2, 8, 128), w) and not fp32_mm.takes(torch.randn(0, 128), w)


def test_the_start_of_training_check_covers_a_lora_adapter(monkeypatch):
    """The kernel check of an fp32 cuda-c plan (doctor/kernel_refs.py) multiplies q/k/v's shape with a LoRA adapter
    of the plan's rank too; here with the kernel's place taken by its reference, so the check's own code runs."""
    from edgerl.doctor.kernel_refs import Widths, _fp32_mm
    monkeypatch.setattr(fp32_mm, "fp32_matmul",
                        lambda x, w, bias=None, lora=None: fp32_mm.reference(x, w, bias, lora).float())
    w = Widths(dtype=torch.float32, hidden=64, vocab=96, heads=4, kv_heads=2, head_dim=16, intermediate=128,
               qkv_bias=False, rows=8, cache=64, tokens=40, chunk=16, lora_rank=16, params=4097, full=False)
    parts = _fp32_mm(w, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert [p.what for p in parts] == ["fp32_matmul 128x64, 8 rows",
                                      "fp32_matmul 128x64 with a rank-16 LoRA adapter, 8 rows"]
    assert all(p.err <= p.tol for p in parts)
