"""Shared prompts on CUDA: the packed forward against the plain one in fp32, bf16 and over an NF4 base
with LoRA (bitsandbytes), log-probs and the adapter's gradients. The exact check is on the CPU in
float64 (tests/test_packing_on_cpu.py); here the kernels are CUDA's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from test_packing_on_cpu import ORDERS, _batch, _head
from rollout_helpers import tiny_llama, tiny_qwen2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
CUDA = torch.device("cuda", 0)


def _run(model, share: bool, batch, grads: bool):
    ids, mask, start, targets, rmask = (t.to(CUDA) if torch.is_tensor(t) else t for t in batch)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        lp, ent = _head(model, share)(ids, mask, targets, start, 0.8)
        if grads:
            w = torch.linspace(-1, 1, lp.numel(), device=CUDA).view_as(lp)
            ((lp * w + 0.1 * ent) * rmask).sum().backward()
    g = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach()[rmask], g


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_plain_on_cuda(arch, dtype):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no native bf16 on this GPU")
    make = tiny_llama if arch == "llama" else tiny_qwen2
    batch = _batch(*ORDERS[1])
    ref, gref = _run(make(dtype=dtype, device=CUDA).train(), False, batch, True)
    got, ggot = _run(make(dtype=dtype, device=CUDA).train(), True, batch, True)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:   # bf16 rounds each product: the same sums in another order move a log-prob by ~1e-2
        assert (got - ref).abs().mean() < 0.02, (got - ref).abs().mean()
    assert gref.keys() == ggot.keys() and gref
    for n in gref:   # relative to the gradient's size: fp32 1e-4, bf16 5e-2
        err = (ggot[n] - gref[n]).norm() / gref[n].norm().clamp(min=1e-12)
        assert err < (1e-4 if dtype == torch.float32 else 5e-2), (n, err.item())


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="an NF4 base needs bitsandbytes")
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRA needs peft")
def test_packed_equals_plain_over_an_nf4_base_with_lora():
    """The QLoRA path the P40 plan runs: bitsandbytes' fp32 dequantize + matmul, peft's adapter."""
    from edgerl.models.quant import quantize_linear
    from rollout_helpers import with_lora

    def model():
        m = tiny_llama(seed=4, device=CUDA)
        for layer in m.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        setattr(parent, name, quantize_linear(child, "nf4", torch.float32))
        for p in m.parameters():
            p.requires_grad_(False)
        return with_lora(m).base_model.model.train()

    batch = _batch(*ORDERS[0])
    ref, gref = _run(model(), False, batch, True)
    got, ggot = _run(model(), True, batch, True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert gref and gref.keys() == ggot.keys() and all("lora" in n for n in gref)
    for n in gref:
        torch.testing.assert_close(ggot[n], gref[n], rtol=1e-3, atol=1e-4 * gref[n].abs().max().item(), msg=n)
