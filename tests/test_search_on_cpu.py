"""The plan's search: micro-batches costed from the card's fp32 rate and bandwidth (edgerl/search.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from edgerl.device.device import GiB, Software
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.moves import MICRO_HALVING_COST, STAGE_COST, stages_for
from edgerl.plan.plan import Task, plan
from edgerl.device.profiles import device_from_profile, get_profile
from edgerl.plan.search import LAUNCH_S_PER_LAYER, UPDATE_SHARE, MicroCost, candidates, micro_cost

QWEN7B = CATALOGUE["qwen2.5-7b"]
TASK = Task(prompt_len=128, response_len=256, prompts_per_step=2, samples_per_prompt=8, lora=True)


BNB = Software(torch="2.7.1", torch_cuda="12.6", libs=(("bitsandbytes", "0.50.2"),))


def _device(name: str):
    return device_from_profile(get_profile(name), BNB, 64 * GiB)


def test_a_p40_qlora_micro_step_costs_its_launches_and_dequantization_by_hand():
    p40 = _device("p40")
    p = plan(p40, QWEN7B, TASK)
    assert p.base_dtype == "nf4" and p.dtype.compute == "fp32"
    s = dataclasses.replace(_setting_of(p), base_quant="nf4")
    mc = micro_cost(p40, QWEN7B, TASK, s)
    P, tokens = QWEN7B.n_params(), 16 * 384
    compute = 4 * P * tokens / 11.8e12                           # forward + input gradients, frozen base
    fixed = QWEN7B.num_layers * LAUNCH_S_PER_LAYER + 2 * P * (2 * 4 + 0.5) / 347e9
    assert mc.per_step == pytest.approx(UPDATE_SHARE * fixed / compute, rel=1e-9)
    assert mc.cost(16, 2) == pytest.approx(7 * mc.per_step)
    # the plan trades checkpointing (~17% of a step) for small micro-batches, and says so
    assert not p.grad_checkpointing and p.micro_batch <= 4
    assert mc.cost(16, p.micro_batch) < STAGE_COST["grad_checkpointing"]
    assert "cost less here than recomputing" in p.reasons["grad_checkpointing"]
    assert "11.8 TFLOP/s and 347 GB/s" in p.reasons["micro_batch"]


def _setting_of(p):
    """The memory Setting the plan's search found (what micro_cost is given)."""
    from edgerl.plan.memory import Setting
    return Setting(compute_bytes=p.dtype.compute_bytes, base_bytes=4, grad_checkpointing=p.grad_checkpointing,
                   swap_models=p.swap_models, optimizer_offload=p.optimizer_offload, param_offload=p.param_offload,
                   micro_batch=p.micro_batch, score_micro_batch=p.score_micro_batch, rollout_batch=p.rollout_batch,
                   logprob_chunk=p.logprob_chunk, logit_bytes=8, eager_attention=False,
                   lora_params=p.lora["params"] if p.lora else 0)


def test_without_the_cards_rates_or_in_16_bits_each_halving_costs_the_flat_share():
    a100 = _device("a100-40gb")            # bf16 compute: tensor cores, no table for their rate
    p = plan(a100, CATALOGUE["smollm2-1.7b"], TASK)
    assert p.dtype.compute == "bf16"
    assert micro_cost(a100, CATALOGUE["smollm2-1.7b"], TASK, _setting_of(p)) is None
    assert "the largest divisor of the mini-batch" in p.reasons["micro_batch"]
    p40 = dataclasses.replace(_device("p40"), fp32_tflops=None)   # a probed card without its profile
    assert micro_cost(p40, QWEN7B, TASK, _setting_of(plan(_device("p40"), QWEN7B, TASK))) is None
    stages = stages_for(None, False, False, False)
    order = candidates(stages, 16, None)
    first = [(st.name, mb) for st, mb, _ in order[:4]]
    assert first[0] == (stages[0].name, 16)
    flat = [st.cost() + MICRO_HALVING_COST * math.log2(16 / mb) for st, mb, _ in order]
    assert flat == sorted(flat) or all(a <= b + 1.0 for a, b in zip(flat, flat[1:]))
    assert all(mb >= 4 for st, mb, last in order if not last)   # under 4 sequences: only the last stage


def test_small_micro_batches_come_early_only_where_they_fill_the_gpu():
    mc = MicroCost(per_step=0.001, tokens_per_sequence=384, hidden=960, sm_count=30, tflops=11.8,
                   bandwidth_gbs=347)
    # 2 sequences: ceil(768 / 128) x ceil(960 / 128) = 6 x 8 = 48 tiles < 2 x 30; 4: 12 x 8 = 96
    assert not mc.fills(2) and mc.fills(4)
    stages = stages_for(None, False, False, False)
    order = candidates(stages, 16, None, mc)
    early = [mb for st, mb, last in order if not last]
    assert 4 in early and 2 not in early and 1 not in early
    wide = dataclasses.replace(mc, hidden=3584)                 # 6 x 28 = 168 tiles: fills
    assert wide.fills(2)
    assert 2 in [mb for st, mb, last in candidates(stages, 16, None, wide) if not last]


def test_a_bigger_budget_never_picks_a_costlier_setting():
    """The frontier has no cliffs: the setting a budget gets is never further down the search's order
    than what a smaller budget gets (P40, the 7B QLoRA shape, budgets 10-22 GiB)."""
    p40 = _device("p40")
    picked = []
    for gib in (10, 11, 12, 13, 14, 16, 18, 20, 22):
        try:
            p = plan(p40, QWEN7B, TASK, {"memory_gib": gib, "base_dtype": "nf4"})
        except Exception:   # noqa: BLE001 - a budget that fits nothing
            continue
        s = _setting_of(p)
        mc = micro_cost(p40, QWEN7B, TASK, dataclasses.replace(s, base_quant="nf4"))
        stage = STAGE_COST["grad_checkpointing"] * p.grad_checkpointing + STAGE_COST["swap_models"] * p.swap_models \
            + STAGE_COST["optimizer_offload"] * p.optimizer_offload + STAGE_COST["rollout_resident"] * p.rollout_resident
        picked.append((gib, stage + mc.cost(16, p.micro_batch)))
    assert len(picked) >= 5
    costs = [c for _, c in picked]
    assert all(b <= a + 1e-12 for a, b in zip(costs, costs[1:])), picked


def test_forced_fp32_keeps_fp32_weights_under_a_tight_budget():
    """plan.dtype=fp32 is never answered with bf16 weights (a bf16 optimizer stage), however small the
    budget; left to itself the plan may choose them on a bf16 card."""
    from fakes import fake_probe
    dev = fake_probe("3090").primary
    m = CATALOGUE["qwen2.5-0.5b"]
    small = Task(prompt_len=128, response_len=128, prompts_per_step=2, samples_per_prompt=4)
    free = plan(dev, m, small, {"memory_gib": 4})
    assert free.optimizer.startswith("adamw-bf16") and free.dtype.param == "bf16"
    forced = plan(dev, m, small, {"memory_gib": 4, "dtype": "fp32"})
    assert forced.dtype.param == "fp32" and forced.dtype.compute == "fp32"
    assert not forced.optimizer.startswith("adamw-bf16")
