"""models.on_device on a GPU: the reference comes in from pinned host memory, computes what it computes
on the host, and leaves no device memory and an unchanged host copy behind."""

from __future__ import annotations

import pytest
import torch

from edgerl.models.load import on_device
from rollout_helpers import tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def test_on_device_pins_once_computes_the_same_and_frees_the_device():
    model = tiny_llama(tied=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    dev = torch.device("cuda")
    with on_device(model, dev, True), torch.no_grad():   # the first phase pins, and cuBLAS takes its workspace
        model(input_ids=ids.to(dev))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    for _ in range(2):
        with on_device(model, dev, True), torch.no_grad():
            assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
            got = model(input_ids=ids.to(dev)).logits.cpu()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert torch.cuda.memory_allocated(dev) == base
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
        assert model.lm_head.weight is model.model.embed_tokens.weight
    pinned = {n: p.data_ptr() for n, p in model.named_parameters()}
    with on_device(model, dev, True):
        pass
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pinned   # pinned once, not per phase
