"""The fused NF4 kernel (edgerl.kernels.nf4) against its plain-torch reference and bitsandbytes, on a GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the fused NF4 kernel runs on CUDA only (compiled with NVRTC for the GPU)", allow_module_level=True)
bnb = pytest.importorskip("bitsandbytes", reason="NF4 weights come from bitsandbytes' quantizer")

from edgerl.models import quant_decode  # noqa: E402
from edgerl.kernels import nf4  # noqa: E402
from edgerl.kernels.nf4 import nf4_matmul, reference  # noqa: E402

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # of the output's largest value


def quantized(n, k, nested=True, blocksize=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).cuda()
    return bnb.functional.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,m", [(40, 256, 1), (513, 1024, 3), (7, 64, 16), (300, 2048, 17), (96, 512, 40),
                                   (33, 4096, 5)])
@pytest.mark.parametrize("nested,blocksize", [(True, 64), (False, 64), (True, 128)])
def test_kernel_equals_the_reference(dtype, n, k, m, nested, blocksize):
    packed, state = quantized(n, k, nested, blocksize)
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if n % 2 else None
    got, want = nf4_matmul(x, packed, state, bias), reference(x, packed, state, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = want.float().abs().max().item()
    grow = k ** 0.5 if dtype == torch.float32 else 1   # fp32: sums of k terms in another order
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale * grow


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_agrees_with_bitsandbytes_linear4bit(dtype):
    lin = torch.nn.Linear(1024, 513, bias=True)
    layer = bnb.nn.Linear4bit(1024, 513, bias=True, compute_dtype=dtype, quant_type="nf4", compress_statistics=True)
    layer.load_state_dict(lin.state_dict())
    layer = layer.cuda()
    x = torch.randn(2, 5, 1024, device="cuda").to(dtype)
    want = layer(x).float()
    got = nf4_matmul(x, layer.weight.data, layer.weight.quant_state, layer.bias).float()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 4 * TOL[dtype] * want.abs().max().item()


def test_kernel_is_captured_by_a_cuda_graph():
    packed, state = quantized(384, 1024)
    x = torch.randn(16, 1024, device="cuda")
    nf4_matmul(x, packed, state)   # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = nf4_matmul(x, packed, state)
    for seed in (1, 2):
        x.copy_(torch.randn(16, 1024, generator=torch.Generator().manual_seed(seed)).cuda())
        g.replay()
        torch.cuda.synchronize()
        want = reference(x, packed, state)
        assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_enable_sends_few_rows_without_autograd_to_the_kernel_and_the_rest_to_bitsandbytes(monkeypatch):
    from edgerl.models.quant import quantize_linear
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 320), torch.nn.Linear(320, 64)).cuda()
    model[0] = quantize_linear(model[0], "nf4", torch.float32)
    assert quant_decode.enable(model, rows=4) == (1, {})
    assert type(model[0]).__name__ == "DecodeLinear4bit" and isinstance(model[0], bnb.nn.Linear4bit)
    import edgerl.kernels.nf4 as nf4
    calls = []
    real = nf4.nf4_matmul
    monkeypatch.setattr(nf4, "nf4_matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    quant_decode._classes.clear()   # rebuild the class so it picks the counting function
    quant_decode.disable(model)
    quant_decode.enable(model, rows=4)
    calls.clear()   # enable() ran the kernel once to check it
    plain = type(model[0]).__mro__[1]
    with torch.no_grad():
        x = torch.randn(4, 256, device="cuda")
        got = model[0](x)
        want = plain.forward(model[0], x)
        assert len(calls) == 1 and (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        model[0](torch.randn(5, 256, device="cuda"))   # more rows than asked for: bitsandbytes
    assert len(calls) == 1
    x = torch.randn(3, 256, device="cuda", requires_grad=True)
    model(x).sum().backward()   # autograd: bitsandbytes, and the gradient reaches the input
    assert len(calls) == 1 and x.grad is not None and x.grad.abs().sum() > 0
    quant_decode.disable(model)
    quant_decode._classes.clear()   # the class bound the counting function
    assert type(model[0]) is plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,m,rank", [(64, 256, 1, 8), (3584, 3584, 16, 16), (513, 1024, 3, 65), (40, 512, 17, 200),
                                        (512, 3584, 16, 1)])
def test_kernel_adds_a_lora_adapter(dtype, n, k, m, rank):
    """x A^T computed as more rows of the weight (one tile of A's rows, or several: rank 65 and 200 at two
    rows of W per lane or one), then scale (x A^T) B^T in the sum kernel; one or several row tiles of x."""
    packed, state = quantized(n, k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    a, b = torch.randn(rank, k, device="cuda") / k ** 0.5, torch.randn(n, rank, device="cuda")
    bias = torch.randn(n, device="cuda").to(dtype)
    got = nf4_matmul(x, packed, state, bias, (a, b, 0.5)).float()
    want = reference(x, packed, state, bias, (a, b, 0.5)).float()
    grow = k ** 0.5 if dtype == torch.float32 else 1
    assert (got - want).abs().max().item() <= TOL[dtype] * want.abs().max().item() * grow
    with pytest.raises(ValueError, match="lora needs fp32 A"):
        nf4_matmul(x, packed, state, bias, (a.T.contiguous(), b, 0.5))


def test_peft_layers_over_nf4_decode_through_the_kernel_as_peft_computes():
    from peft import LoraConfig, get_peft_model
    from edgerl.models.quant import quantize_linear

    class Net(torch.nn.Module):
        is_loaded_in_4bit = True

        def __init__(self):
            super().__init__()
            self.up = quantize_linear(torch.nn.Linear(512, 1024), "nf4", torch.float32, "cuda")
            self.down = quantize_linear(torch.nn.Linear(1024, 512), "nf4", torch.float32, "cuda")

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    net = get_peft_model(Net(), LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"], lora_dropout=0.0))
    for name, p in net.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(16, 512, device="cuda")
    with torch.no_grad():
        want = net(x)
        assert quant_decode.enable(net, rows=32) == (2, {})
        assert type(net.base_model.model.up).__name__ == "DecodeLoraLinear4bit"
        got = net(x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    quant_decode.disable(net)
    assert type(net.base_model.model.up).__name__ == "Linear4bit"


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 8, 56])
@pytest.mark.parametrize("with_lora", [False, True])
def test_every_split_of_k_gives_the_same_sums(splits, with_lora):
    """The benchmark sweeps the split count; every count, with and without an adapter (one split with an
    adapter still goes through the workspace and the sum kernel), gives the reference's result."""
    packed, state = quantized(1000, 3584)
    x = torch.randn(16, 3584, device="cuda")
    lora = (torch.randn(8, 3584, device="cuda") / 60, torch.randn(1000, 8, device="cuda"), 0.5) if with_lora else None
    got = nf4_matmul(x, packed, state, lora=lora, splits=splits)
    want = reference(x, packed, state, lora=lora)
    assert (got - want).abs().max().item() <= TOL[torch.float32] * want.abs().max().item() * 3584 ** 0.5


needs_mma = pytest.mark.skipif(not nf4.tensor_cores(torch.float16, torch.cuda.get_device_capability()),
                               reason="the tensor-core kernel needs CC 7.5 (mma.sync m16n8k8)")


@needs_mma
@pytest.mark.parametrize("n,k,m", [(40, 256, 1), (513, 1024, 3), (7, 64, 16), (300, 2112, 17), (3584, 3584, 16),
                                   (1000, 4160, 9)])
@pytest.mark.parametrize("nested,blocksize", [(True, 64), (False, 64), (True, 128)])
def test_the_tensor_core_kernel_equals_the_reference_with_fp16_codes(n, k, m, nested, blocksize):
    """fp16 x on tensor cores: the codes as fp16 values, times their fp32 block scales, products and sums in fp32;
    against the reference with that table, within the output's fp16 rounding (and sums in another order), at
    every split. K % 128 == 64 (2112, 4160), rows of W past a warp's 32 and x's past 16. The weight it multiplies
    is as near the exact one as bitsandbytes' fp16 weight: each value within 2^-11 of it, relatively."""
    packed, state = quantized(n, k, nested, blocksize, seed=n)
    x = torch.randn(m, k, device="cuda").half()
    bias = torch.randn(n, device="cuda").half() if n % 2 else None
    want = reference(x, packed, state, bias, fp16_codes=True).float()
    for splits in (None, 1, 3):
        got = nf4_matmul(x, packed, state, bias, splits=splits, mma=True)
        assert got.dtype == torch.float16 and got.shape == (m, n)
        assert (got.float() - want).abs().max().item() <= 1e-3 * want.abs().max().item()
    assert torch.equal(got, nf4_matmul(x, packed, state, bias, splits=3, mma=True))
    exact = nf4.dequantize_reference(packed, state).double()
    for w in (nf4.dequantize_reference(packed, state, fp16_codes=True), exact.half()):   # ours, bitsandbytes'
        assert ((w.double() - exact).abs() <= 2 ** -11 * exact.abs() + 1e-7).all()


@needs_mma
@pytest.mark.parametrize("n,k,m,rank", [(64, 256, 1, 8), (3584, 3584, 16, 16), (513, 1024, 3, 65), (40, 576, 17, 200)])
def test_the_tensor_core_kernel_adds_a_lora_adapter_in_fp32(n, k, m, rank):
    packed, state = quantized(n, k)
    x = torch.randn(m, k, device="cuda").half()
    a, b = torch.randn(rank, k, device="cuda") / k ** 0.5, torch.randn(n, rank, device="cuda")
    bias = torch.randn(n, device="cuda").half()
    want = reference(x, packed, state, bias, (a, b, 0.5), fp16_codes=True).float()
    for splits in (None, 1, 2):
        got = nf4_matmul(x, packed, state, bias, (a, b, 0.5), splits=splits, mma=True).float()
        assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()


@needs_mma
def test_the_tensor_core_kernel_is_the_default_for_fp16_and_replays_in_a_graph():
    packed, state = quantized(768, 2048)
    x = torch.randn(16, 2048, device="cuda").half()
    assert torch.equal(nf4_matmul(x, packed, state), nf4_matmul(x, packed, state, mma=True))
    with pytest.raises(ValueError, match="mma=True takes fp16 x"):
        nf4_matmul(x.float(), packed, state, mma=True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = nf4_matmul(x, packed, state)
    x.copy_(torch.randn(16, 2048, device="cuda").half())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, nf4_matmul(x.clone(), packed, state))
