"""The fused NF4 kernel's reference decoding against bitsandbytes, and its choices, on the CPU (the kernel
itself needs CUDA: tests/test_nf4_kernel_cuda.py)."""

import pytest
import torch

from edgerl.doctor.kernel_refs import NF4_CODE
from edgerl.kernels import nf4

bnb = pytest.importorskip("bitsandbytes", reason="NF4 weights come from bitsandbytes' quantizer")


@pytest.mark.parametrize("n,k,nested,blocksize", [(24, 136, True, 64), (7, 200, False, 64), (33, 264, True, 128),
                                                  (5, 8, True, 64)])
def test_reference_decodes_as_bitsandbytes_does(n, k, nested, blocksize):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    packed, state = bnb.functional.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    want = bnb.functional.dequantize_4bit(packed, state).float()
    assert torch.equal(nf4.dequantize_reference(packed, state), want)
    x = torch.randn(3, k)
    assert torch.allclose(nf4.reference(x, packed, state), x @ want.T, rtol=1e-5, atol=1e-5)


def test_unsupported_says_why():
    w = torch.randn(16, 64)
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert "not on a CUDA device" in nf4.unsupported(torch.randn(2, 64), packed, state)
    with pytest.raises(ValueError, match="nf4_matmul: the input is not on a CUDA device"):
        nf4.nf4_matmul(torch.randn(2, 64), packed, state)


@pytest.mark.parametrize("m,tile", [(1, 1), (2, 2), (3, 4), (16, 16), (17, 16), (200, 16)])
def test_rows_tile(m, tile):
    assert nf4._rows_tile(m) == tile


@pytest.mark.parametrize("n,r", [(18944, 2), (3584, 2), (1024, 2), (1000, 1), (512, 1)])
def test_rows_of_w(n, r):
    assert nf4._rows_of_w(n) == r


# blocks of rows, steps of 64 along K, resident blocks (SMs x blocks per SM) -> splits
@pytest.mark.parametrize("blocks,steps,slots,splits", [(56, 56, 264, 4), (296, 56, 264, 7), (8, 56, 264, 7),
                                                        (112, 56, 60, 1), (56, 56, 60, 1), (1, 1, 60, 1),
                                                        (16, 8, 60, 1)])
def test_splits_fill_the_waves_and_leave_every_warp_a_step(blocks, steps, slots, splits):
    assert nf4._splits(blocks, steps, slots) == splits


def test_widths_the_kernel_does_not_take_are_named():
    w = torch.randn(16, 96)
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")

    class Cuda:   # unsupported() reads is_cuda and dtype first; the width check comes next
        is_cuda, dtype = True, torch.float32
    assert "in_features=96 must be a multiple of 64" in nf4.unsupported(Cuda(), packed, state)


def _nf4_layer():
    from edgerl.models.quant import quantize_linear
    torch.manual_seed(0)
    return quantize_linear(torch.nn.Linear(128, 64), "nf4", torch.float32)


def test_enable_leaves_layers_off_cuda_to_bitsandbytes_and_says_why():
    from edgerl.models import quant_decode
    model = torch.nn.Sequential(_nf4_layer(), torch.nn.ReLU(), _nf4_layer())
    assert quant_decode.enable(model, rows=16) == (0, {"not on a CUDA device": 2})
    assert all(type(m).__name__ == "Linear4bit" for m in (model[0], model[2]))


def test_decode_layer_sends_only_few_rows_outside_autograd_in_its_compute_dtype_to_the_kernel(monkeypatch):
    """The dispatch rule, with the kernel replaced by a recorder (the kernel itself: the CUDA tests)."""
    import edgerl.kernels.nf4 as k
    from edgerl.models import quant_decode
    calls = []
    monkeypatch.setattr(k, "input_unsupported", lambda x: "")
    monkeypatch.setattr(k, "nf4_matmul", lambda x, p, s, b=None, lora=None: calls.append(tuple(x.shape)) or
                        torch.zeros(*x.shape[:-1], s.shape[0], dtype=x.dtype))
    monkeypatch.setattr(quant_decode, "_classes", {})
    layer = _nf4_layer()
    plain = type(layer)
    layer.__class__ = quant_decode._decode_class(plain)
    layer.decode_rows = 4
    want = plain.forward(layer, torch.ones(4, 128))
    with torch.no_grad():
        assert torch.equal(layer(torch.ones(4, 128)), torch.zeros(4, 64)) and calls == [(4, 128)]
        assert torch.allclose(layer(torch.ones(5, 128)), plain.forward(layer, torch.ones(5, 128)))   # too many rows
        layer(torch.ones(2, 128, dtype=torch.float64))   # not the compute dtype: bitsandbytes casts as it does
    x = torch.ones(4, 128, requires_grad=True)
    assert torch.allclose(layer(x), want) and calls == [(4, 128)]   # inside autograd: bitsandbytes


def test_lora_layer_adds_its_adapter_inside_the_kernel_as_peft_adds_it(monkeypatch):
    """peft's LoRA layer over the 4-bit base, with the kernel replaced by its CPU reference: the fused
    path (x A^T and scale * (x A^T) B^T inside the kernel) equals peft's own forward."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    import edgerl.kernels.nf4 as k
    from edgerl.models import quant_decode
    calls = []
    monkeypatch.setattr(k, "input_unsupported", lambda x: "")
    monkeypatch.setattr(k, "nf4_matmul", lambda x, p, s, b=None, lora=None: calls.append(lora is not None) or
                        k.reference(x, p, s, b, lora))
    monkeypatch.setattr(quant_decode, "_classes", {})

    class Net(torch.nn.Module):
        is_loaded_in_4bit = True   # what transformers sets on a quantized model: peft then wraps bnb layers

        def __init__(self):
            super().__init__()
            self.proj = _nf4_layer()

        def forward(self, x):
            return self.proj(x)

    net = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], lora_dropout=0.0))
    wrapper = net.base_model.model.proj
    torch.nn.init.normal_(wrapper.lora_B["default"].weight)   # peft starts B at zero
    x = torch.randn(3, 128)
    with torch.no_grad():
        want = wrapper(x)
        base = wrapper.base_layer
        base.__class__, base.decode_rows = quant_decode._decode_class(type(base)), 16
        wrapper.__class__ = quant_decode._lora_class(type(wrapper))
        got = wrapper(x)
        assert calls == [True] and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        with net.disable_adapter():   # the reference model: the base alone, still through the kernel
            assert torch.allclose(wrapper(x), base.__class__.__mro__[1].forward(base, x), rtol=1e-5, atol=1e-5)
        assert calls == [True, False]
    calls.clear()
    got = wrapper(x)   # a training forward of a few rows: the adapter takes gradients, so peft adds it
    got.sum().backward()
    assert True not in calls and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert wrapper.lora_A["default"].weight.grad is not None and wrapper.lora_B["default"].weight.grad is not None


def test_nvrtc_on_a_torch_without_cuda_is_a_named_error():
    import torch
    from edgerl.kernels.nvrtc import KernelUnavailable, compile_cubin
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    with pytest.raises(KernelUnavailable, match="not a CUDA build"):
        compile_cubin(nf4.SOURCE, ["nf4_mm<float, 16, 2>"], (6, 1))


def test_a_kernel_that_cannot_run_stops_training_with_one_line_naming_the_setting(monkeypatch):
    import edgerl.kernels.nf4 as k
    from edgerl.models import quant_decode
    from edgerl.core.errors import TrainingError

    def broken(*a, **kw):
        raise k.KernelUnavailable("NVRTC could not compile for sm_120: invalid value for --gpu-architecture")
    monkeypatch.setattr(k, "nf4_matmul", broken)
    with pytest.raises(TrainingError, match=r"cannot run here: KernelUnavailable: NVRTC could not compile for "
                                            r"sm_120.*set plan.decode_backend=torch"):
        quant_decode.check_kernel(torch.device("cpu"))


def test_kernels_are_compiled_once_per_source_name_and_device(monkeypatch):
    """nvrtc.kernel keeps what it loaded; nf4's launcher asks the occupancy once per kernel (NVRTC and the
    driver replaced by recorders: the compile itself needs CUDA)."""
    import types
    import edgerl.kernels.nvrtc as nvrtc
    loads, occupancy = [], []
    monkeypatch.setattr(nvrtc, "_loaded", {})
    monkeypatch.setattr(nvrtc, "load", lambda src, names, dev: loads.append((names[0], dev.index)) or
                        {names[0]: types.SimpleNamespace()})
    monkeypatch.setattr(nf4, "blocks_per_sm", lambda k, threads: occupancy.append(threads) or 3)
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    a = nf4._kernel("splits_sum<float>", dev0)
    assert nf4._kernel("splits_sum<float>", dev0) is a and a.slots_per_sm == 3
    assert nf4._kernel("splits_sum<float>", dev1) is not a
    assert nvrtc.kernel("other source", "splits_sum<float>", dev0) is not a
    assert loads == [("splits_sum<float>", 0), ("splits_sum<float>", 1), ("splits_sum<float>", 0)]
    assert occupancy == [256, 256]


def test_the_kernel_check_compares_in_ieee_fp32_even_where_the_process_allows_tf32(monkeypatch):
    """With TF32 allowed (a script's choice on Ampere and newer), the reference's fp32 matmuls alone miss
    the check's 1e-4 bound: the check runs them in IEEE fp32 and gives the process its setting back."""
    import edgerl.kernels.nf4 as k
    from edgerl.models import quant_decode
    pytest.importorskip("bitsandbytes")
    seen = []

    def recording(x, packed, state, lora=None):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return x.new_zeros(x.shape[0], 40)
    monkeypatch.setattr(k, "nf4_matmul", recording)
    monkeypatch.setattr(k, "reference", recording)
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        quant_decode.check_kernel(torch.device("cpu"))
        assert seen == ["ieee"] * 4 and torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def _mma_m16n8k8(c, a, b):
    """PTX's mma.m16n8k8 (.row.col, fp16 in, fp32 sums) from the lanes' fragments: a[lane] = (a0, a1, a2, a3)
    holds A[g][2q + i] (i < 2) and A[g + 8][2q + i - 2], b[lane] = (b0, b1) holds B[2q + i][g], c[lane] the
    four sums at rows g, g, g + 8, g + 8 and columns 2q, 2q + 1 (g = lane / 4, q = lane % 4)."""
    A, B = torch.zeros(16, 8, dtype=torch.float64), torch.zeros(8, 8, dtype=torch.float64)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(4):
            A[g + 8 * (i // 2), 2 * q + i % 2] = a[lane][i]
        for i in range(2):
            B[2 * q + i, g] = b[lane][i]
    C = A @ B
    return [[c[lane][i] + C[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2].item() for i in range(4)]
            for lane in range(32)]


def test_the_tensor_core_kernels_fragments_hold_the_same_columns_of_k():
    """nf4_mma's lanes, step by step as the source indexes them: lane (g, q) loads columns k + 16 q .. + 15 of
    row g of a tile of W and of rows g and g + 8 of x, and mma j takes their pair j; the sums it leaves in each
    lane's four accumulators are x W^T at the rows and columns the kernel writes them to."""
    g0 = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (16, 256), generator=g0).double()
    w = torch.randint(-3, 4, (8, 256), generator=g0).double()   # one tile of 8 rows of W
    acc = [[0.0] * 4 for _ in range(32)]
    for step in range(256 // nf4.MMA_STEP):
        for j in range(8):
            a, b = [], []
            for lane in range(32):
                g, q = lane // 4, lane % 4
                k = step * nf4.MMA_STEP + 16 * q + 2 * j
                a.append((x[g, k], x[g, k + 1], x[g + 8, k], x[g + 8, k + 1]))
                b.append((w[g, k], w[g, k + 1]))
            acc = _mma_m16n8k8(acc, a, b)
    want = x @ w.T
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(4):
            assert acc[lane][i] == want[g + 8 * (i >> 1), 2 * q + (i & 1)].item()


