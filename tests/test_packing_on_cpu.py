"""Shared prompts (edgerl/packing.py): the packed forward against the plain one, row by row.

Slow reference: PolicyHead without packing, the HF forward over every row's own prompt + response.
float64, so any difference beyond rounding is a wrong mask, position or gather."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edgerl.models import attention, packing
from edgerl.models.load import PolicyHead, enable_checkpointing
from rollout_helpers import tiny_llama, tiny_qwen2, with_lora

PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12], [3]]


def _batch(order: list[int], resp_lens: list[int], R: int = 7, seed: int = 0):
    """Rows of prompts PROMPTS[order[i]] (left-padded to one width) and random responses of the given
    real lengths (right-padded to R). Returns input_ids, attention_mask, start, targets, response mask."""
    g = torch.Generator().manual_seed(seed)
    W = max(len(p) for p in PROMPTS)
    B = len(order)
    ids = torch.zeros(B, W + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (k, n) in enumerate(zip(order, resp_lens)):
        p = PROMPTS[k]
        ids[i, W - len(p):W] = torch.tensor(p)
        ids[i, W:W + n] = torch.randint(3, 500, (n,), generator=g)
        mask[i, W - len(p):W + n] = 1
    start = W - 1
    targets = ids[:, W:]
    return ids, mask, start, targets, mask[:, W:].bool()


def _head(model, share: bool) -> PolicyHead:
    return PolicyHead(model, SimpleNamespace(kernel_backend="torch", logprob_chunk=64, kernel_tiles=None,
                                             share_prompts=share))


ORDERS = [([0, 0, 0, 1, 2, 2], [7, 3, 5, 7, 1, 6]),      # groups in order, ragged responses
          ([2, 0, 1, 0, 2, 1, 0], [4, 7, 7, 2, 7, 5, 6]),  # shuffled, as an update's mini-batch may be
          ([1, 1], [7, 7])]                               # one group


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("order,lens", ORDERS)
def test_packed_logprobs_and_entropy_equal_the_plain_forward(arch, order, lens):
    model = (tiny_llama() if arch == "llama" else tiny_qwen2()).to(torch.float64)
    ids, mask, start, targets, rmask = _batch(order, lens)
    with torch.no_grad():
        ref_lp, ref_ent = _head(model, False)(ids, mask, targets, start, 0.7)
        lp, ent = _head(model, True)(ids, mask, targets, start, 0.7)
    assert lp.shape == ref_lp.shape
    torch.testing.assert_close(lp[rmask], ref_lp[rmask], rtol=0, atol=1e-10)
    torch.testing.assert_close(ent[rmask], ref_ent[rmask], rtol=0, atol=1e-10)


def _grads(model, share: bool, batch, checkpointing: bool):
    ids, mask, start, targets, rmask = batch
    model.zero_grad(set_to_none=True)
    model.train()
    if checkpointing:
        enable_checkpointing(model)
    lp, ent = _head(model, share)(ids, mask, targets, start, 1.0)
    w = torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).view_as(lp)
    ((lp * w + 0.1 * ent) * rmask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_the_plain_backward(lora, checkpointing):
    """The prompt's keys serve every sample of its group: their gradients add up over the group, as the
    plain forward's copies do. With HF's gradient checkpointing the recomputation sees the layout too.
    HF's RMSNorm computes in fp32 even in a float64 model, so a gradient summed over a group before the
    norm (packed) or after it (plain) differs by fp32 rounding: the tolerance is fp32's, where a wrong
    mask, position or gather moves gradients by their own size."""
    def model():
        m = tiny_llama(seed=3).to(torch.float64)
        return with_lora(m).base_model.model if lora else m   # the module the actor holds (edgerl.models.lora)
    batch = _batch(*ORDERS[1])
    ref = _grads(model(), False, batch, checkpointing)
    got = _grads(model(), True, batch, checkpointing)
    assert ref.keys() == got.keys() and ref
    if lora:
        assert all("lora" in n for n in got)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=2e-6, atol=2e-6 * ref[n].abs().max().item(), msg=n)


def test_layout_counts_each_prompt_once_and_maps_every_column():
    ids, mask, start, _, _ = _batch(*ORDERS[1])
    lay = packing.plan_layout(ids, mask, start + 1)
    W, R = start + 1, ids.shape[1] - start - 1
    assert (lay.groups, lay.width, lay.rows, lay.resp) == (3, W, 7, R)
    assert lay.tokens == 3 * W + 7 * R
    packed = packing.pack(lay, ids)[0]
    where = packing.packed_index(lay, ids.device)
    assert torch.equal(packed[where], ids)                  # every row's every column comes back
    assert torch.equal(lay.group_of[[1, 3, 6]], lay.group_of[[1, 1, 1]])   # rows of prompt 0 share a group
    assert len(set(lay.group_of.tolist())) == 3


def test_no_layout_when_no_prompt_repeats():
    ids, mask, start, _, _ = _batch([0, 1, 2], [7, 7, 7])
    assert packing.plan_layout(ids, mask, start + 1) is None


def test_a_packed_row_without_its_layout_is_an_error_not_a_wrong_answer():
    """A model whose layers do not hand the layout on to attention reaches the SDPA wrapper with the
    sentinel mask and no layout: that must raise, not attend over the packed row as one sequence."""
    attention.install()
    q = torch.zeros(1, 2, 5, 4)
    with pytest.raises(RuntimeError, match="plan.share_prompts=false"):
        attention._sdpa(torch.nn.Module(), q, q, q, torch.ones(1, 1, 1, 1, dtype=torch.bool))


def test_plain_calls_still_reach_transformers_sdpa():
    attention.install()
    model = tiny_llama().to(torch.float64)
    ids, mask, *_ = _batch([0, 1], [7, 4])
    before = model(input_ids=ids, attention_mask=mask).logits
    attention.install()   # idempotent
    again = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(before, again, rtol=0, atol=0)
