"""bf16 AdamW on a CUDA GPU: the eager step's temporaries stay under WORKSPACE_BYTES however large the
parameter and the fused step makes none; both agree with the CPU's and with the formula; parameters
held in host memory, streamed through the GPU, step as they would on it. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from edgerl.train.adamw_bf16 import CHUNK, WORKSPACE_BYTES, AdamWBF16
from edgerl.train.optim import make_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
NAMES = ["adamw-bf16", "adamw-bf16-sr"]


def extra_memory(opt) -> int:
    """Device bytes a second step allocates beyond what is held (the first creates the state)."""
    opt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("name", NAMES)
def test_eager_step_temporaries_stay_under_the_workspace_bound_and_fused_make_none(name):
    p = torch.nn.Parameter(torch.randn(3 * CHUNK + 17, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    eager = make_optimizer([p], name, 1e-4, (0.9, 0.999), 0.1, fused=False)
    # a whole-tensor step would need about 26 bytes per element: 156 MiB here, past the bound
    assert extra_memory(eager) <= WORKSPACE_BYTES
    fused = make_optimizer([p], name, 1e-4, (0.9, 0.999), 0.1)
    assert fused.uses_fused(p.device)   # the default on CUDA with triton
    assert extra_memory(fused) == 0


@pytest.mark.parametrize("fused", [False, True])
def test_kahan_step_on_cuda_equals_the_cpu_step(fused):
    """The weights and compensation of a Kahan step do not depend on the random bits (CUDA's Philox
    and the CPU's Mersenne Twister differ), so after one step they match the CPU's."""
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(4097, generator=gen).bfloat16(), torch.randn(4097, generator=gen).bfloat16()
    out = {}
    for dev in ("cpu", "cuda"):
        p = torch.nn.Parameter(w.to(dev, copy=True))
        opt = make_optimizer([p], "adamw-bf16", 1e-3, (0.9, 0.999), 0.1, fused=fused if dev == "cuda" else None)
        p.grad = g.to(dev)
        opt.step()
        out[dev] = (p.detach().cpu(), opt.state[p]["compensation"].cpu())
    # weight + compensation is the exact result to ~16 bits on both; a fused multiply-add on the GPU
    # may move the fp32 intermediate by its last bit, which can flip a bf16 rounding at a tie
    value = {dev: w_.double() + c.double() for dev, (w_, c) in out.items()}
    torch.testing.assert_close(value["cuda"], value["cpu"], rtol=2 ** -15, atol=0)
    assert (out["cuda"][0] == out["cpu"][0]).float().mean() > 0.99


def test_fused_stochastic_rounding_is_unbiased_on_the_gpu():
    """8 columns of (weight, gradient, moments), each on 2^16 rows: every stored value is one of the two
    bf16 neighbours of the exact fp32-formula value, and their mean is the exact value (unbiased)."""
    gen = torch.Generator().manual_seed(1)
    rows, lr, b1, b2, eps, wd, step = 1 << 16, 3e-3, 0.9, 0.99, 1e-8, 0.1, 5
    col = lambda t: t.bfloat16().expand(rows, 8).contiguous().cuda()  # noqa: E731
    w, g = col(torch.randn(8, generator=gen)), col(torch.randn(8, generator=gen))
    m, v = col(0.1 * torch.randn(8, generator=gen)), col(0.01 * torch.rand(8, generator=gen) + 1e-4)
    p = torch.nn.Parameter(w.clone())
    opt = AdamWBF16([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, kahan=False, fused=True)
    opt.state[p].update(step=torch.tensor(float(step - 1)), exp_avg=m.clone(), exp_avg_sq=v.clone())
    p.grad = g.clone()
    opt.step()
    w0, g0, m0, v0 = (t[0].double().cpu() for t in (w, g, m, v))
    m_ref = b1 * m0 + (1 - b1) * g0
    v_ref = b2 * v0 + (1 - b2) * g0 * g0
    w_ref = w0 * (1 - lr * wd) - lr / (1 - b1 ** step) * m_ref / (v_ref.sqrt() / math.sqrt(1 - b2 ** step) + eps)
    for stored, ref in ((p.detach(), w_ref), (opt.state[p]["exp_avg"], m_ref), (opt.state[p]["exp_avg_sq"], v_ref)):
        stored = stored.double().cpu()
        _, e = torch.frexp(ref)
        gap = torch.ldexp(torch.ones_like(ref), e - 8)
        assert ((stored - ref).abs() < gap).all()
        err = (stored.mean(0) - ref).abs()
        assert (err <= 4 * gap / 2 / math.sqrt(rows)).all(), (err / gap).max()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_host_parameters_streamed_through_the_gpu_step_as_on_the_gpu(name, fused):
    """Parameters in pinned host memory with step_device=cuda: chunks go to the GPU and back; the result
    equals the same optimizer stepping the parameters on the GPU bit for bit, and the GPU holds no more
    than the step's workspace while it runs."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2 * CHUNK + 1001, generator=gen).bfloat16()
    on_gpu = torch.nn.Parameter(w.cuda())
    on_host = torch.nn.Parameter(w.clone().pin_memory())
    opts = [make_optimizer([on_gpu], name, 1e-3, (0.9, 0.999), 0.1, fused=fused),
            make_optimizer([on_host], name, 1e-3, (0.9, 0.999), 0.1, fused=fused, step_device=torch.device("cuda"))]
    for step in range(3):
        g = torch.randn(w.shape, generator=gen).bfloat16()
        on_gpu.grad, on_host.grad = g.cuda(), g.clone().pin_memory()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opts[1].step()
        assert torch.cuda.max_memory_allocated() - before <= WORKSPACE_BYTES
        opts[0].step()
    assert on_host.device.type == "cpu"
    assert all(t.is_pinned() for k, t in opts[1].state[on_host].items() if k != "step")  # pinned once
    assert torch.equal(on_gpu.detach().cpu(), on_host.detach())
    for k, v in opts[0].state[on_gpu].items():
        assert torch.equal(v.cpu(), opts[1].state[on_host][k]), k
