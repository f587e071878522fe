"""The decode-layer kernels' references (edgerl/kernels/decode_cuda.py) against the rollout tests' own float64
attention and rotary helpers, and the decoder's 'cuda' layer wired to those references against its bmm
layer, on the CPU (the kernels themselves need CUDA: tests/test_decode_cuda_kernels_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from edgerl.kernels import decode_cuda, fp32_mm
from edgerl.rollout import SamplingParams, StaticCacheEngine
from rollout_helpers import PROMPTS, decode_attention_reference, rotate_reference, tiny_llama


@pytest.mark.parametrize("B,KVH,G,D,S,col", [(3, 2, 2, 32, 40, 30), (2, 1, 8, 64, 300, 290), (1, 3, 1, 128, 8, 0)])
def test_rope_attend_reference_is_the_rotation_the_cache_write_and_the_windowed_attention(B, KVH, G, D, S, col):
    g = torch.Generator().manual_seed(S)
    H = KVH * G
    q, k, v = (torch.randn(B, n * D, generator=g) for n in (H, KVH, KVH))
    ang = torch.rand(B, D // 2, generator=g) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)
    kc, vc = torch.randn(B, KVH, S, D, generator=g), torch.randn(B, KVH, S, D, generator=g)
    start = torch.randint(0, col + 1, (B,), generator=g)
    colt = torch.tensor([col])
    k0, v0 = kc.clone(), vc.clone()
    o, kr = decode_cuda.reference_rope_attend(q, k, v, cos, sin, kc, vc, start, colt, D ** -0.5)
    assert torch.equal(kr, rotate_reference(k.view(B, KVH, D), cos[:, None], sin[:, None]))
    assert torch.equal(kc[:, :, col], kr) and torch.equal(vc[:, :, col], v.view(B, KVH, D))
    others = [i for i in range(S) if i != col]
    assert torch.equal(kc[:, :, others], k0[:, :, others]) and torch.equal(vc[:, :, others], v0[:, :, others])
    qr = rotate_reference(q.view(B, KVH, G, D), cos[:, None, None], sin[:, None, None])
    want = decode_attention_reference(qr, kc, vc, start, colt, D ** -0.5)
    torch.testing.assert_close(o, want.reshape(B, H * D), rtol=1e-6, atol=1e-6)


def test_the_attentions_default_grid_gives_every_sm_two_blocks_within_the_caches_slices():
    """`decode_cuda.slices`: enough slices per row and KV head for two blocks a SM, never more than the cache
    has multiples of `SLICE_COLUMNS`, and the unsplit kernel (1) once the rows and heads alone fill the GPU."""
    assert (decode_cuda.SLICE_BLOCKS_PER_SM, decode_cuda.SLICE_COLUMNS) == (2, 64)
    assert decode_cuda.slices(16, 2, 8320, 132) == 9        # Qwen2.5-1.5B's 2 KV heads at 16 rows, an H100
    assert decode_cuda.slices(16, 8, 8320, 132) == 3        # Llama-3.1-8B's 8
    assert decode_cuda.slices(16, 2, 8320, 30) == 2         # a P40's 30 SMs
    assert decode_cuda.slices(16, 2, 100, 132) == 2         # a 100-column cache: two slices of 64 at most
    assert decode_cuda.slices(64, 8, 8320, 132) == 1        # 512 blocks unsplit: more than two a SM already
    assert decode_cuda.slices(1, 1, 1, 132) == 1
    for rows, heads, cols, sms in [(16, 2, 8320, 132), (8, 8, 4096, 80), (3, 4, 700, 30)]:
        n = decode_cuda.slices(rows, heads, cols, sms)
        assert n * rows * heads >= 2 * sms or n * 64 >= cols


def test_norm_and_silu_references():
    g = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(4, 96, generator=g), torch.randn(4, 96, generator=g), torch.randn(96, generator=g)
    xo, y = decode_cuda.reference_add_rms_norm(x, d, w, 1e-6)
    torch.testing.assert_close(xo, (x + d).double())
    want = w * torch.nn.functional.rms_norm(x + d, (96,), eps=1e-6)
    torch.testing.assert_close(y.float(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decode_cuda.reference_silu_mul(x, d).float(), torch.nn.functional.silu(x) * d)


class _Calls(list):
    """The rows of each few-row matmul, and (`loras`) whether each added a LoRA adapter."""

    def __init__(self):
        super().__init__()
        self.loras = []


def _wire_references(monkeypatch):
    """Decode backend cuda-c's kernels replaced by their references, each result rounded to its inputs' dtype."""
    monkeypatch.setattr(decode_cuda, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(decode_cuda, "add_rms_norm",
                        lambda x, d, w, eps: tuple(t.to(x.dtype)
                                                   for t in decode_cuda.reference_add_rms_norm(x, d, w, eps)))
    monkeypatch.setattr(decode_cuda, "silu_mul", lambda g, u: decode_cuda.reference_silu_mul(g, u).to(g.dtype))
    monkeypatch.setattr(decode_cuda, "rope_attend",
                        lambda *a, flag=None: decode_cuda.reference_rope_attend(*a)[0].to(a[0].dtype))
    calls = _Calls()   # the fp32 few-row matmuls (fp32_mm.linear's kernel side): their rows

    def matmul(x, w, bias=None, ks=None, lora=None):
        calls.append(x.numel() // x.shape[-1])
        calls.loras.append(lora is not None)
        return fp32_mm.reference(x, w, bias, lora).float()
    monkeypatch.setattr(fp32_mm, "_kernel", lambda name, device: None)
    monkeypatch.setattr(fp32_mm, "unsupported", lambda x, w, bias=None: "" if x.dtype == w.dtype == torch.float32
                        else "not fp32")
    monkeypatch.setattr(fp32_mm, "fp32_matmul", matmul)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("projections", ["fused", "modules"])
def test_the_cuda_layer_wired_to_the_references_decodes_as_the_torch_layer(monkeypatch, projections, dtype):
    """Decode backend cuda-c's layer (rollout/decode_cuda_c.py: which tensors go to which kernel, in what
    order) with each kernel replaced by its reference, rounded to the model's dtype (fp32, or fp16 as a Volta
    or Turing plan computes): the same greedy tokens as the torch backend."""
    calls = _wire_references(monkeypatch)
    model = tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       dtype=dtype)
    params = SamplingParams(max_new_tokens=24, greedy=True)
    cuda = StaticCacheEngine(model, 8, 64, cuda_graphs=False, projections=projections, backend="cuda-c")
    assert cuda.dec.backend.name == "cuda-c" and cuda.dec.dtype == dtype
    torch_ops = StaticCacheEngine(model, 8, 64, cuda_graphs=False, projections=projections, backend="torch")
    assert cuda.generate(PROMPTS, 2, params).response_ids == torch_ops.generate(PROMPTS, 2, params).response_ids
    # fp32: the logits of the 4 rows' last prompt positions, then each of the 23 decode steps' (the engine's 8 rows)
    # fused projections (4 a layer) and logits through the few-row matmul; the prefill's projections (more than 16
    # rows) through cuBLAS; in fp16, and the modules' projections (peft, bitsandbytes), never
    per_step = (4 * len(model.model.layers) + 1) if projections == "fused" else 1
    assert calls == ([] if dtype != torch.float32 else [4] + [8] * per_step * 23), (len(calls), set(calls))


def test_the_cuda_layer_over_an_fp16_cache_under_fp32_wired_to_the_references(monkeypatch):
    """plan.kv_cache_dtype=fp16 under fp32, the kernels replaced by their references (which write the cache column
    through torch's fp32 -> fp16 cast, as the kernel rounds it): the cache is fp16, the sampled log-probs stay
    near the full fp32 forward's, a key or value past fp16's range stops the rollout naming the setting, and a
    backend that reads the cache in the compute dtype refuses an fp16 one."""
    from rollout_helpers import logprob_gap
    from edgerl.rollout.decoder import CacheOverflow, DecodeKernelUnavailable
    _wire_references(monkeypatch)
    model = tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    engine = StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend="cuda-c", cache_dtype=torch.float16)
    params = SamplingParams(max_new_tokens=24, temperature=0.8)
    out = engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    assert engine.dec.cache.dtype == torch.float16 and "in float16" in engine.describe()
    assert engine.dec.cache_bytes() * 2 == StaticCacheEngine(model, 8, 64, cuda_graphs=False,
                                                             backend="cuda-c").dec.cache_bytes()
    gap = logprob_gap(model, out, 0.8)
    assert 0 < gap.max() <= 2e-2, gap.max()   # the cache's rounding shows, within its bound's order
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(1e6)
    with pytest.raises(CacheOverflow, match="past float16's range .* set plan.kv_cache_dtype=fp32"):
        engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    assert int(engine.dec.overflow) == 0   # the check clears it: the next rollout starts clean
    with pytest.raises(DecodeKernelUnavailable, match="needs decode backend cuda-c"):
        StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend="torch", cache_dtype=torch.float16)


def test_lora_over_an_fp32_base_sends_its_layers_through_the_few_row_kernel(monkeypatch):
    """A peft LoRA model in fp32 (a P40's LoRA plan) decodes through its modules: each LoRA layer's base matmul
    and its adapter take the few-row matmul (one call) in the decode steps, q/k/v and gate/up stacked into one call
    each (rollout/lora_group.py), the tokens are the torch backend's,
    training's matmuls stay cuBLAS's and peft's (the adapters keep their gradients), and `set_matmul(dec, None)`
    gives the layers back."""
    from torch import nn
    from edgerl.rollout.decode_cuda_c import MatmulLinear, set_matmul
    from rollout_helpers import with_lora
    calls = _wire_references(monkeypatch)
    model = with_lora(tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2))
    params = SamplingParams(max_new_tokens=24, greedy=True)
    want = StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend="torch").generate(PROMPTS, 2, params)
    cuda = StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend="cuda-c")
    layers = len(model.base_model.model.model.layers)
    assert "the logits and the %d LoRA layers (their fp32 base matmuls and adapters) through the few-row matmul " \
        "kernel" % (7 * layers) in cuda.describe()
    assert "LoRA q/k/v and gate/up stacked: %d of %d groups" % (2 * layers, 2 * layers) in cuda.describe()
    assert cuda.generate(PROMPTS, 2, params).response_ids == want.response_ids
    # the prompts' last positions' logits, then each decode step's 4 products a layer (q/k/v, o, gate/up, down;
    # each with its adapters) and its logits
    assert calls == [4] + [8] * (4 * layers + 1) * 23, (len(calls), set(calls))
    assert calls.loras == [False] + ([True] * 4 * layers + [False]) * 23
    calls.clear()
    calls.loras.clear()
    model.train()
    batch = torch.randint(0, 100, (2, 12))
    model(input_ids=batch).logits.sum().backward()   # 24 rows with grad: cuBLAS, and gradients reach the adapters
    with torch.enable_grad():   # 2 rows, the adapters taking gradients: peft's path, not the kernel's
        model.zero_grad()
        model(input_ids=batch[:, :1]).logits.sum().backward()
    assert calls.loras.count(True) == 0 and all(p.grad is not None for n, p in model.named_parameters()
                                                if "lora_" in n)
    bases = [m for m in model.modules() if type(m) is MatmulLinear]
    wrappers = [m for m in model.modules() if type(m).__name__ == "LoraMatmul"]
    assert len(bases) == len(wrappers) == 7 * layers
    assert set_matmul(cuda.dec, None) == (0, 7 * layers)
    assert all(type(m) is nn.Linear and not hasattr(m, "mm") for m in bases)
    assert not any(type(m).__name__ == "LoraMatmul" for m in model.modules())
