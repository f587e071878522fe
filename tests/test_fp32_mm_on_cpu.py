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


def test_the_slice_of_k_fills_the_gpu_in_the_fewest_waves():
    slots = 264   # an H100: 132 SMs x 2 blocks
    for n, k, rows in [(2048, 1536, 16), (1536, 1536, 16), (17920, 1536, 16), (1536, 8960, 16), (49152, 1536, 1),
                       (7, 4, 3)]:
        ks = fp32_mm.split_columns(n, k, rows, slots)
        cap = fp32_mm.STAGE_FLOATS // fp32_mm.rows_tile(rows)
        assert ks % fp32_mm.STEP == 0 and fp32_mm.STEP <= ks <= max(cap, fp32_mm.STEP)
        tiles = -(-n // (fp32_mm.WARPS * fp32_mm.NC))

        def cost(s):
            return -(-tiles * -(-k // s) // slots) * (s // fp32_mm.STEP + 2)
        assert all(cost(ks) <= cost(s) for s in range(fp32_mm.STEP, cap + 1, fp32_mm.STEP))
    # a 1536 x 1536 weight has 48 blocks of rows: split 3 ways they fill an H100 (144 blocks), not 2 (96)
    assert -(-1536 // fp32_mm.split_columns(1536, 1536, 16, slots)) >= 3


def test_rows_tile_and_what_the_kernel_takes(monkeypatch):
    assert [fp32_mm.rows_tile(m) for m in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert fp32_mm.decode_kernels(16) == ["fp32_mm<16, 4>", "mm_sum", "splits_sum<float>"]
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


def test_the_lora_reference_is_peft_layers_sum_and_bad_adapters_are_named():
    """`reference` with lora = (A, B, scale) is what peft's LoRA layer computes (base + scale B(A x)), in float64;
    an adapter the kernel cannot add is refused naming the shapes it needs."""
    from torch import nn
    from peft import LoraConfig, get_peft_model

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 48)
    torch.manual_seed(0)
    m = get_peft_model(One(), LoraConfig(r=8, lora_alpha=24, target_modules=["proj"], init_lora_weights=False))
    layer = m.base_model.model.proj
    x = torch.randn(5, 64)
    ab = (layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"])
    assert ab[2] == 3.0
    with torch.no_grad():
        torch.testing.assert_close(fp32_mm.reference(x, layer.base_layer.weight, layer.base_layer.bias, ab).float(),
                                   layer(x), rtol=1e-5, atol=1e-5)
    w = torch.randn(48, 64)
    assert fp32_mm.lora_unsupported(w, (torch.randn(8, 64), torch.randn(8, 48), 1.0)).startswith(
        "lora needs A (r, 64) and B (48, r)")
    assert "0 < r <= 256" in fp32_mm.lora_unsupported(w, (torch.randn(300, 64), torch.randn(48, 300), 1.0))
    assert "not on a CUDA device" in fp32_mm.lora_unsupported(w, (torch.randn(8, 64), torch.randn(48, 8), 1.0))
