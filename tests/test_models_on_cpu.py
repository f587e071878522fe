"""models.on_device: a frozen model brought to a device for a phase and dropped after, its host copy untouched."""

from __future__ import annotations

import pytest
import torch

from edgerl.models.load import on_device
from rollout_helpers import tiny_llama


def _host_state(model):
    return {n: (t.data_ptr(), t.clone()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def test_on_device_moves_in_drops_after_and_never_copies_back():
    model = tiny_llama(tied=True)
    before = _host_state(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    # The CPU as the target device: a copy all the same (what a GPU gets), at other addresses.
    with on_device(model, torch.device("cpu"), True) as m:
        assert m is model
        inside = _host_state(model)
        assert all(inside[n][0] != ptr for n, (ptr, _) in before.items())
        assert all(torch.equal(inside[n][1], v) for n, (_, v) in before.items())
        assert model.lm_head.weight is model.model.embed_tokens.weight   # still tied
        for p in model.parameters():   # a write on the device copy must not reach the host copy
            p.data = torch.empty_like(p.data)
    after = _host_state(model)
    assert after.keys() == before.keys()
    for name, (ptr, value) in before.items():
        assert after[name][0] == ptr, f"{name}: the host tensor was replaced"
        assert torch.equal(after[name][1], value), f"{name}: the host values changed"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


def test_on_device_restores_the_host_copy_when_the_phase_fails():
    model = tiny_llama()
    before = _host_state(model)
    with pytest.raises(ValueError, match="inside"):
        with on_device(model, torch.device("cpu"), True):
            raise ValueError("inside")
    assert {n: v[0] for n, v in _host_state(model).items()} == {n: v[0] for n, v in before.items()}


def test_on_device_disabled_or_none_does_nothing_and_refuses_a_model_not_on_the_host():
    model = tiny_llama()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    with on_device(model, torch.device("cpu"), False):
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    with on_device(None, torch.device("cpu"), True) as m:
        assert m is None
    model.to("meta")
    with pytest.raises(RuntimeError, match="expected the host"):
        with on_device(model, torch.device("cpu"), True):
            pass
