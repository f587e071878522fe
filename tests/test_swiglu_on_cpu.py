"""SiluMul (edgerl/swiglu.py) against autograd's SiLU and product: values, gradients, saved bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgerl.models.swiglu import SiluMul, fuse_mlps, fusable
from rollout_helpers import tiny_llama, tiny_qwen2, with_lora


def test_gradients_match_autograd_in_float64():
    g = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    u = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SiluMul.apply, (g, u))
    out = SiluMul.apply(g, u)
    torch.testing.assert_close(out, F.silu(g) * u, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_gradients_round_once_like_autograd(dtype):
    torch.manual_seed(0)
    g0, u0, d = torch.randn(64, 96) * 3, torch.randn(64, 96), torch.randn(64, 96)
    exact = [t.double().requires_grad_() for t in (g0, u0)]
    (F.silu(exact[0]) * exact[1]).backward(d.double())
    mine = [t.to(dtype).requires_grad_() for t in (g0, u0)]
    SiluMul.apply(*mine).backward(d.to(dtype))
    plain = [t.to(dtype).requires_grad_() for t in (g0, u0)]
    (F.silu(plain[0]) * plain[1]).backward(d.to(dtype))
    for e, m, p in zip(exact, mine, plain):   # no further from the exact gradient than autograd's own
        err_m = (m.grad.double() - e.grad).abs().mean()
        err_p = (p.grad.double() - e.grad).abs().mean()
        assert err_m <= err_p * 1.05 + 1e-12, (err_m, err_p)


def _saved_bytes(model, ids):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids).logits.float().square().mean()
    return loss, total[0]


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("lora", [False, True])
def test_fused_mlps_give_the_same_gradients_and_save_one_intermediate_tensor_fewer(make, lora):
    def model():
        m = make().to(torch.float64).train()
        return with_lora(m).base_model.model.train() if lora else m
    ids = torch.randint(3, 500, (2, 9))
    plain, fused = model(), model()
    layers = fused.model.layers
    assert all(fusable(layer.mlp) for layer in layers)
    assert fuse_mlps(layers) == len(layers)
    loss_p, bytes_p = _saved_bytes(plain, ids)
    loss_f, bytes_f = _saved_bytes(fused, ids)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-12, atol=0)
    loss_p.backward()
    loss_f.backward()
    for (n, p), (_, f) in zip(plain.named_parameters(), fused.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(f.grad, p.grad, rtol=1e-9, atol=1e-12, msg=n)
    inter = plain.config.intermediate_size
    one_tensor = ids.numel() * inter * 8 * len(layers)
    assert bytes_p - bytes_f == one_tensor, (bytes_p, bytes_f, one_tensor)


def test_other_activations_are_left_alone():
    m = tiny_llama(hidden_act="gelu")
    assert not fusable(m.model.layers[0].mlp)
    assert fuse_mlps(m.model.layers) == 0
