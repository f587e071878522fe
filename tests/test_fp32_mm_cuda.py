"""The fp32 few-row matmul kernel (edgerl.kernels.fp32_mm) against float64, cuBLAS and the engine, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("the fp32 few-row matmul kernel runs on CUDA only (compiled with NVRTC for the GPU)",
                allow_module_level=True)

from edgerl.kernels import fp32_mm  # noqa: E402
from edgerl.rollout import SamplingParams, StaticCacheEngine  # noqa: E402
from rollout_helpers import PROMPTS, logprob_gap, tiny_llama  # noqa: E402

TOL = 2e-6   # of the output's largest value, times sqrt(K): sums of K fp32 terms in another order


def _check(got, x, w, bias=None):
    want = fp32_mm.reference(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOL * scale * w.shape[1] ** 0.5


@pytest.mark.parametrize("n,k,m", [(40, 128, 1), (513, 1024, 3), (7, 4, 16), (300, 1540, 13), (2048, 1536, 16),
                                   (1536, 8960, 16), (33, 36, 5), (96, 260, 8), (1, 772, 2)])
def test_kernel_equals_float64(n, k, m):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    bias = torch.randn(n, device="cuda", generator=g) if n % 2 else None
    _check(fp32_mm.fp32_matmul(x, w, bias), x, w, bias)


@pytest.mark.parametrize("m", [16, 5, 1])
def test_every_slice_of_k_gives_the_same_product_to_rounding_and_repeats_bit_for_bit(m):
    x = torch.randn(m, 2308, device="cuda")
    w = torch.randn(200, 2308, device="cuda") * 0.02
    bias = torch.randn(200, device="cuda")
    cap = fp32_mm.STAGE_FLOATS // fp32_mm.rows_tile(m)
    for ks in range(fp32_mm.STEP, min(cap, 2432) + 1, fp32_mm.STEP):
        got = fp32_mm.fp32_matmul(x, w, bias, ks=ks)
        _check(got, x, w, bias)
        assert torch.equal(got, fp32_mm.fp32_matmul(x, w, bias, ks=ks))   # a fixed order: no atomics
    with pytest.raises(ValueError, match="ks=100 must be a multiple of 128"):
        fp32_mm.fp32_matmul(x, w, bias, ks=100)


@pytest.mark.parametrize("n,k,m,r", [(2048, 1536, 16, 16), (200, 2308, 5, 4), (1536, 8960, 8, 64), (33, 36, 2, 1)])
def test_a_lora_adapter_added_in_the_kernel_equals_float64(n, k, m, r):
    """y = x W^T + bias + scale (x A^T) B^T, as peft's LoRA layer adds it, with K whole in a block and split."""
    g = torch.Generator(device="cuda").manual_seed(n + r)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    bias = torch.randn(n, device="cuda", generator=g) if n % 2 == 0 else None
    lora = (torch.randn(r, k, device="cuda", generator=g) * k ** -0.5, torch.randn(n, r, device="cuda", generator=g),
            0.5)
    plain = fp32_mm.fp32_matmul(x, w, bias)
    for ks in (None, 128):
        got = fp32_mm.fp32_matmul(x, w, bias, ks=ks, lora=lora)
        want = fp32_mm.reference(x, w, bias, lora)
        assert (got.double() - want).abs().max().item() <= TOL * want.abs().max().item() * k ** 0.5
        term = (want - fp32_mm.reference(x, w, bias)).abs().max().item()   # the adapter's part is there, scaled
        assert (got - plain).abs().max().item() >= 0.5 * term > 0
    with pytest.raises(ValueError, match=r"lora needs A \(r, %d\) and B \(%d, r\)" % (k, n)):
        fp32_mm.fp32_matmul(x, w, bias, lora=(lora[0], lora[1].T.contiguous(), 0.5))


def test_batched_rows_and_misaligned_inputs():
    w = torch.randn(64, 256, device="cuda")
    x = torch.randn(2, 3, 257, device="cuda")[..., 1:]   # rows 16-byte misaligned and not contiguous
    got = fp32_mm.fp32_matmul(x, w)
    assert got.shape == (2, 3, 64)
    _check(got.reshape(6, 64), x.reshape(6, 256), w)


def test_linear_takes_the_decode_steps_rows_and_leaves_the_rest_to_cublas():
    w = torch.randn(96, 128, device="cuda")
    b = torch.randn(96, device="cuda")
    x16, x17 = torch.randn(16, 128, device="cuda"), torch.randn(17, 128, device="cuda")
    with torch.no_grad():
        assert torch.equal(fp32_mm.linear(x16, w, b), fp32_mm.fp32_matmul(x16, w, b))
        assert torch.equal(fp32_mm.linear(x17, w, b), F.linear(x17, w, b))   # the prefill's rows: cuBLAS
    x1 = torch.randn(1, 128, device="cuda")
    with torch.no_grad():
        assert torch.equal(fp32_mm.linear(x1, w, b), F.linear(x1, w, b))   # one row: cuBLAS's GEMV
    xg = x16.clone().requires_grad_()
    assert fp32_mm.linear(xg, w, b).grad_fn is not None   # inside autograd: cuBLAS, differentiable
    odd = torch.randn(4, 126, device="cuda")
    assert not fp32_mm.takes(odd, torch.randn(8, 126, device="cuda"))   # K % 4: the kernel reads 4 at a time
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        fp32_mm.fp32_matmul(odd, torch.randn(8, 126, device="cuda"))
    with pytest.raises(ValueError, match="not fp32"):
        fp32_mm.fp32_matmul(x16.half(), w.half())
    with pytest.raises(ValueError, match="at most 16"):
        fp32_mm.fp32_matmul(x17, w)


def test_kernel_in_a_cuda_graph_replays_the_eager_product():
    w = torch.randn(1536, 8960, device="cuda") * 0.01
    x = torch.randn(16, 8960, device="cuda")
    eager = fp32_mm.fp32_matmul(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp32_mm.fp32_matmul(x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp32_mm.fp32_matmul(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    _check(out, x, w)
    x2 = x.clone()
    assert not torch.equal(out, eager) and torch.equal(out, fp32_mm.fp32_matmul(x2, w))


def test_engine_in_fp32_through_the_kernel_samples_what_the_full_forward_scores():
    """Decode backend cuda-c in fp32: the fused projections and the logits through the kernel, in CUDA graphs;
    sampled log-probs against the model's full forward, and greedy tokens equal to the torch backend's."""
    model = tiny_llama(device="cuda", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2)
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, projections="fused", backend="cuda-c")
    assert "fp32 projections and logits through the few-row matmul kernel" in engine.describe()
    assert all(p.mm is fp32_mm.linear for p in engine.dec.proj) and engine.dec.head_mm is fp32_mm.linear
    out = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=120, temperature=0.8),
                          generator=torch.Generator().manual_seed(0))
    gap = logprob_gap(model, out, 0.8)
    assert gap.max() <= 1e-4 and gap.mean() <= 1e-5, (gap.max(), gap.mean())
    greedy = SamplingParams(max_new_tokens=40, greedy=True)
    torch_ops = StaticCacheEngine(model, 8, 300, cuda_graphs=True, projections="fused", backend="torch")
    assert engine.generate(PROMPTS, 2, greedy).response_ids == torch_ops.generate(PROMPTS, 2, greedy).response_ids


def test_lora_over_an_fp32_base_through_the_kernel_samples_what_the_full_forward_scores():
    """A peft LoRA model in fp32 (modules, not fused projections): each LoRA layer's base matmul and adapter in
    one call of the kernel in CUDA graphs; sampled log-probs against the full forward, greedy tokens equal to the
    torch backend's."""
    from edgerl.rollout.decode_cuda_c import MatmulLinear
    from rollout_helpers import with_lora
    model = with_lora(tiny_llama(device="cuda", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2))
    greedy = SamplingParams(max_new_tokens=40, greedy=True)
    want = StaticCacheEngine(model, 8, 300, cuda_graphs=True, backend="torch").generate(PROMPTS, 2, greedy)  # cuBLAS
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, backend="cuda-c")
    assert "LoRA layers (their fp32 base matmuls and adapters) through the few-row matmul kernel" in engine.describe()
    assert any(type(m) is MatmulLinear for m in model.modules())
    assert any(type(m).__name__ == "LoraMatmul" for m in model.modules())
    out = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=120, temperature=0.8),
                          generator=torch.Generator().manual_seed(0))
    gap = logprob_gap(model, out, 0.8)
    assert gap.max() <= 1e-4 and gap.mean() <= 1e-5, (gap.max(), gap.mean())
    assert engine.generate(PROMPTS, 2, greedy).response_ids == want.response_ids
