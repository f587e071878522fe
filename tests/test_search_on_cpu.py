"""The plan's search: micro-batches costed from the card's fp32 rate and bandwidth (edgerl/search.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from edgerl.core.errors import PlanError
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


# --- the search by estimated step time (plan/timing.py), where the card's rates are known ----------------------



def _p40_15b_8k():
    from edgerl.plan.modelspec import ModelSpec
    model = ModelSpec("1.5b", "llama", 49152, 1536, 28, 12, 2, 8960, True, max_position=32768)
    task = Task(prompt_len=64, response_len=8192, prompts_per_step=2, samples_per_prompt=8, kl=True, lora=False)
    return model, task


def _captured_search(monkeypatch, device, model, task, overrides=None):
    """plan() on `device`, recording what its search was given (the arguments of each call)."""
    import edgerl.plan.steps as steps
    calls = []
    real = steps.search

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(steps, "search", spy)
    p = plan(device, model, task, overrides or {})
    return p, calls


def _every_fit_by_brute_force(args):
    """Each (stage, micro-batch) of the search's list that fits, with its weighed seconds: the slow reference."""
    from edgerl.plan.memory import estimate
    from edgerl.plan.search import HOST_USABLE, divisors_desc, fit_rollout_and_score
    model, task, base, budget, forced, cal, host, stages, _micro, seconds = args
    out = []
    for st in stages:
        for mb in divisors_desc(task.local_mini):
            s = dataclasses.replace(base, micro_batch=mb, optimizer=st.optimizer, **st.knobs())
            s = fit_rollout_and_score(model, task, s, budget, forced, cal)
            mem = estimate(model, s, task.prompt_len, task.response_len, budget, cal)
            if mem.fits and mem.host_needed * task.world_size <= host * HOST_USABLE:
                out.append((seconds(s) * (1 + STAGE_COST[st.optimizer]), st.name, mb, s))
    return out


def test_the_timed_search_finds_the_fastest_setting_that_fits_as_brute_force_does(monkeypatch):
    """The P40 1.5B 8K row: the search weighs every setting that fits by its estimated step time and stops early
    on a lower bound; every setting that fits, weighed one by one, finds the same fastest, and it is over the
    margin faster than the fixed order's first fit (8-bit AdamW and 8 rows a rollout pass, as the row ran, its KV
    cache in fp32), so it is taken: fp32 AdamW state in host memory, all 16 rows in one pass."""
    from edgerl.plan.search import TIMED_MARGIN
    model, task = _p40_15b_8k()
    p, calls = _captured_search(monkeypatch, _device("p40"), model, task, {"kv_cache_dtype": "fp32"})
    args, _ = calls[0]
    found, _ = __import__("edgerl.plan.search", fromlist=["search"]).search(*args)
    every = _every_fit_by_brute_force(args)
    assert len(every) >= 5
    fastest = min(every, key=lambda e: e[0])
    assert found.timed.fastest[2] == pytest.approx(fastest[0])
    assert found.timed.taken and found.timed.fastest[2] < (1 - TIMED_MARGIN) * found.timed.first[2]
    assert found.timed.first[:2] == ("+ 8-bit AdamW state (bitsandbytes) on the GPU", 2)
    assert (p.optimizer, p.optimizer_offload, p.rollout_batch) == ("adamw", True, 16)
    assert "the fastest setting that fits by the step time estimate" in p.reasons["micro_batch"]


def _fake_search(seconds_of, by_micro=None):
    """search() over two stages of a small task with seconds given per stage name (no card model), or per
    micro-batch (`by_micro`)."""
    from edgerl.plan.memory import DEFAULT_CALIBRATION, Setting
    from edgerl.plan.search import search
    stages = stages_for(None, False, False, False)[1:3]      # the rollout copy freed; gradient checkpointing
    model = CATALOGUE["qwen2.5-0.5b"]
    task = Task(prompt_len=64, response_len=64, prompts_per_step=1, samples_per_prompt=4, lora=False)
    base = Setting(compute_bytes=4, base_bytes=4, grad_checkpointing=False, swap_models=False, optimizer_offload=False,
                   param_offload=False, micro_batch=1, score_micro_batch=1, rollout_batch=1, logprob_chunk=1024,
                   logit_bytes=8, eager_attention=False, mini_batch=4)

    def seconds(s):
        if by_micro:
            return by_micro[s.micro_batch]
        return seconds_of["ckpt" if s.grad_checkpointing else "plain"] * (1 + 0.01 * (4 // s.micro_batch - 1))
    found, _ = search(model, task, base, 64 * GiB, {}, DEFAULT_CALIBRATION, 64 * GiB, stages, None, seconds)
    return found


def test_a_setting_replaces_the_first_fit_only_past_the_margin():
    from edgerl.plan.search import TIMED_MARGIN
    first = _fake_search({"plain": 10.0, "ckpt": 12.0})          # the first fit is also the fastest
    assert not first.setting.grad_checkpointing and first.setting.micro_batch == 4 and not first.timed.taken
    close = _fake_search({"plain": 10.0, "ckpt": 10.0 * (1 - TIMED_MARGIN) + 0.01})
    assert not close.setting.grad_checkpointing and not close.timed.taken
    assert close.timed.fastest[0] == "gradient checkpointing"
    far = _fake_search({"plain": 10.0, "ckpt": 10.0 * (1 - TIMED_MARGIN) - 0.01})
    assert far.setting.grad_checkpointing and far.timed.taken and far.setting.micro_batch == 4


def test_no_micro_batch_below_the_first_fits_is_weighed():
    """A micro-step's fixed costs are the estimate's least measured part: however fast the estimate makes a
    smaller micro-batch, the search does not split the first fit's further."""
    found = _fake_search({}, by_micro={4: 10.0, 2: 5.0, 1: 1.0})
    assert found.setting.micro_batch == 4 and not found.timed.taken and found.timed.fastest[1] == 4


def test_without_the_cards_rates_the_search_keeps_the_fixed_order(monkeypatch):
    """A GPU whose bandwidth and matmul rate are not known (no profile matches it, no `doctor --bench`) gets no step
    time estimate, and so no weighing: the fixed order's first fit, as the row ran."""
    import edgerl.plan.timing as timing
    model, task = _p40_15b_8k()
    monkeypatch.setattr(timing, "rates", lambda *a, **k: None)
    p = plan(_device("p40"), model, task, {"kv_cache_dtype": "fp32"})
    assert (p.optimizer, p.rollout_batch, p.micro_batch) == ("adamw8bit", 8, 2)
    assert "step time estimate" not in p.reasons["micro_batch"]


def test_the_search_drops_the_moves_a_setting_fits_without():
    """A stage turns its moves on together; the plan keeps only those the setting needs to fit. The 1.7B shape at
    17.71 GiB on an H100 needs the reference in host memory but not the checkpointed inputs there (at 320 tokens
    they do not set the peak); LoRA's reference is its base, so a LoRA plan never swaps one."""
    from edgerl.plan.modelspec import ModelSpec
    from edgerl.plan.moves import next_moves
    h100 = _device("h100")
    model = ModelSpec("1.7b", "llama", 49152, 2048, 24, 32, 32, 8192, True, max_position=32768)
    task = Task(prompt_len=64, response_len=256, prompts_per_step=2, samples_per_prompt=8, kl=True, lora=False)
    p = plan(h100, model, task, {"memory_gib": 17.71})
    assert p.grad_checkpointing and p.swap_models and not p.activation_offload
    assert p.reasons["activation_offload"].startswith("off: the checkpointed layer inputs fit on the GPU")
    with_it = plan(h100, model, task, {"memory_gib": 17.71, "activation_offload": True})
    assert with_it.memory.total >= p.memory.total           # the move lowers nothing here
    # the out-of-memory advice names the move the plan left out, the next stage's
    assert "--set plan.activation_offload=true" in next_moves(p, 256)
    for card in ("t4", "p40", "rtx3090", "v100-16gb"):
        q = plan(_device(card), QWEN7B, TASK)
        assert q.lora and not q.swap_models, card
    forced = plan(_device("t4"), QWEN7B, TASK, {"swap_models": True})
    assert forced.swap_models and "nothing moves" in forced.reasons["swap_models"]


def test_an_fp16_kv_cache_under_fp32_halves_the_cache_the_plan_counts_and_fits_more_rows():
    """The P40 1.5B 8K row: with the cache in fp16 (the plan's default under fp32 with decode backend cuda-c) the
    estimate's KV cache is half the fp32 one's at the same rows, and the fixed order fits all 16 rows in one
    rollout pass where the fp32 cache fit 8."""
    import edgerl.plan.timing as timing
    model, task = _p40_15b_8k()
    p16 = plan(_device("p40"), model, task)
    p32 = plan(_device("p40"), model, task, {"kv_cache_dtype": "fp32", "rollout_batch": p16.rollout_batch})
    assert (p16.kv_cache_dtype, p32.kv_cache_dtype) == ("fp16", "fp32") and p16.decode_backend == "cuda-c"
    assert "half the bytes a long decode step reads" in p16.reasons["kv_cache_dtype"]
    assert "over a KV cache stored in fp16" in p16.reasons["rollout_correction"]
    kv16, kv32 = p16.memory.phases["rollout"]["KV cache"], p32.memory.phases["rollout"]["KV cache"]
    assert kv32 == 2 * kv16 - p16.rollout_batch * (64 + 8192) * 12   # the 12 bytes a column of bookkeeping aside
    r = timing.rates(_device("p40"), "fp32")
    assert timing.decode_step_s(model, p16.values, r, 16, 8192) < timing.decode_step_s(model, p32.values, r, 16, 8192)
    with __import__("unittest.mock").mock.patch.object(timing, "rates", lambda *a, **k: None):
        fixed = plan(_device("p40"), model, task)
    assert (fixed.optimizer, fixed.rollout_batch) == ("adamw8bit", 16)


def test_the_kv_cache_setting_is_refused_where_no_kernel_reads_it():
    model, task = _p40_15b_8k()
    with pytest.raises(PlanError, match="plan.kv_cache_dtype=fp16: the static engine stores its KV cache in the "
                                        "compute dtype \\(fp32\\), or in fp16 under fp32 compute where the decode "
                                        "backend is cuda-c"):
        plan(_device("p40"), model, task, {"kv_cache_dtype": "fp16", "decode_backend": "torch"})
    with pytest.raises(PlanError, match="plan.kv_cache_dtype=bf16"):
        plan(_device("p40"), model, task, {"kv_cache_dtype": "bf16"})
    assert plan(_device("h100"), model, task).kv_cache_dtype == "bf16"   # 16-bit compute: its own dtype

