"""bf16 AdamW on a CUDA GPU: the step's temporaries stay under WORKSPACE_BYTES however large the
parameter, and the update equals the CPU's. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from edgerl.adamw_bf16 import CHUNK, WORKSPACE_BYTES
from edgerl.optim import make_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


@pytest.mark.parametrize("name", ["adamw-bf16", "adamw-bf16-sr"])
def test_step_temporaries_stay_under_the_workspace_bound(name):
    p = torch.nn.Parameter(torch.randn(3 * CHUNK + 17, device="cuda", dtype=torch.bfloat16))
    opt = make_optimizer([p], name, 1e-4, (0.9, 0.999), 0.1)
    p.grad = torch.randn_like(p)
    opt.step()  # creates the state
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # a whole-tensor step would need about 26 bytes per element: 156 MiB here, past the 56 MiB bound
    assert extra <= WORKSPACE_BYTES, (extra, WORKSPACE_BYTES)
    assert torch.cuda.memory_allocated() == before


def test_kahan_step_on_cuda_equals_the_cpu_step():
    """The weights and compensation of a Kahan step do not depend on the random bits (CUDA's Philox
    and the CPU's Mersenne Twister differ), so after one step they match the CPU's."""
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(4097, generator=gen).bfloat16(), torch.randn(4097, generator=gen).bfloat16()
    out = {}
    for dev in ("cpu", "cuda"):
        p = torch.nn.Parameter(w.to(dev, copy=True))
        opt = make_optimizer([p], "adamw-bf16", 1e-3, (0.9, 0.999), 0.1)
        p.grad = g.to(dev)
        opt.step()
        out[dev] = (p.detach().cpu(), opt.state[p]["compensation"].cpu())
    # weight + compensation is the exact result to ~16 bits on both; a fused multiply-add on the GPU
    # may move the fp32 intermediate by its last bit, which can flip a bf16 rounding at a tie
    value = {dev: w_.double() + c.double() for dev, (w_, c) in out.items()}
    torch.testing.assert_close(value["cuda"], value["cpu"], rtol=2 ** -15, atol=0)
    assert (out["cuda"][0] == out["cpu"][0]).float().mean() > 0.99
