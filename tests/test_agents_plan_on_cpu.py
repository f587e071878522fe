"""The plan for episodes of several turns: the memory model counts the episode's budget (prompt + every
turn + what comes between them) and, on the static engine, one turn more in the KV cache (its rows align
at the longest); `recommend` names the longest episode that fits and the key that sets it."""

from __future__ import annotations

import dataclasses

import pytest

from edgerl.config.load import load_config
from edgerl.config.target import task_from_config
from edgerl.plan.memory import kv_cache_bytes
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import STEP, Task, fits_on, longest_line, longest_response, plan
from edgerl.plan.memory import DEFAULT_CALIBRATION
from fakes import fake_probe

EPISODE = ['rollout.tools=["calculator"]', "rollout.max_turns=4", "rollout.max_new_tokens=256",
           "rollout.max_episode_tokens=1024", "data.max_prompt_len=256"]


def test_the_task_of_an_episode_run_is_its_budget_and_one_turn():
    t = task_from_config(load_config(None, EPISODE))
    assert (t.prompt_len, t.response_len, t.turn_len, t.length_key) == (256, 1024, 256, "rollout.max_episode_tokens")
    default = task_from_config(load_config(None, EPISODE[:3]))   # no budget given: max_turns x max_new_tokens
    assert default.response_len == 4 * 256
    plain = task_from_config(load_config(None, ["rollout.max_new_tokens=256"]))
    assert (plain.response_len, plain.turn_len, plain.length_key) == (256, 0, "rollout.max_new_tokens")


@pytest.mark.parametrize("engine, extra", [("static", 256), ("hf-generate", 0)])
def test_the_kv_cache_holds_the_budget_and_on_the_static_engine_one_turn_more(engine, extra):
    dev = fake_probe("T4").primary
    model = CATALOGUE["qwen3-1.7b"]
    task = Task(prompt_len=256, response_len=1024, prompts_per_step=2, samples_per_prompt=4, lora=True, turn_len=256)
    p = plan(dev, model, task, {"rollout_engine": engine})
    b_c = 2   # the T4 computes in fp16
    want = kv_cache_bytes(model, p.rollout_batch, 256 + 1024 + extra, b_c, windowed=engine == "hf-generate")
    assert p.memory.phases["rollout"]["KV cache"] == want
    single = plan(dev, model, dataclasses.replace(task, turn_len=0), {"rollout_engine": engine})
    assert p.memory.phases["rollout"]["KV cache"] - single.memory.phases["rollout"]["KV cache"] == \
        want - kv_cache_bytes(model, p.rollout_batch, 1280, b_c, windowed=engine == "hf-generate")


@pytest.mark.parametrize("engine", ["static", "hf-generate"])
def test_the_rollout_counts_the_prefill_between_turns(engine):
    """Between turns the static engine prefills what follows each turn in groups of rows of at most rows x one
    turn tokens (a row alone may bring up to the budget); transformers' generate prefills every row's whole
    conversation again. The rollout's prefill activations are the larger of that and the prompts' prefill,
    at (4h + 3I) compute-dtype values a token."""
    dev = fake_probe("T4").primary
    model = CATALOGUE["qwen3-1.7b"]
    task = Task(prompt_len=256, response_len=1024, prompts_per_step=2, samples_per_prompt=4, lora=True, turn_len=256)
    p = plan(dev, model, task, {"rollout_engine": engine})
    rows, per_token = p.rollout_batch, (4 * model.hidden_size + 3 * model.intermediate_size) * 2   # fp16 on a T4
    prompts = (rows // 4 if engine == "static" else rows) * 256   # the static engine prefills a prompt once
    between = max(rows * 256, 1024) if engine == "static" else rows * (256 + 1024)
    assert p.memory.phases["rollout"]["prefill activations"] == max(prompts, between) * per_token
    single = plan(dev, model, dataclasses.replace(task, turn_len=0), {"rollout_engine": engine})
    assert single.memory.phases["rollout"]["prefill activations"] == prompts * per_token


def test_recommend_names_the_longest_episode_that_fits():
    dev = fake_probe("T4").primary
    model = CATALOGUE["qwen3-4b"]   # LoRA on a T4: memory ends the episode before the model's context does
    task = Task(prompt_len=256, response_len=1024, prompts_per_step=4, samples_per_prompt=8, lora=True,
                turn_len=512)
    n, _ = longest_response(dev, model, task)
    assert 0 < n < model.max_position   # memory, not the context, ends it here
    assert fits_on(dev, model, dataclasses.replace(task, response_len=n), {}, DEFAULT_CALIBRATION)
    assert not fits_on(dev, model, dataclasses.replace(task, response_len=n + STEP), {}, DEFAULT_CALIBRATION)
    line = longest_line(dev, model, task)
    assert line.startswith(f"longest episode that fits (its turns of up to 512 tokens and what comes between "
                           f"them): {n} tokens"), line


def test_a_plan_that_does_not_fit_offers_a_shorter_episode():
    from edgerl.core.errors import PlanError
    dev = fake_probe("T4").primary
    model = CATALOGUE["qwen3-4b"]
    task = Task(prompt_len=256, response_len=38000, prompts_per_step=4, samples_per_prompt=8, lora=True,
                turn_len=512)
    with pytest.raises(PlanError) as e:
        plan(dev, model, task)
    assert "episode 38000 tokens" in str(e.value) and "--set rollout.max_episode_tokens=" in str(e.value)
    assert "--set rollout.max_new_tokens" not in str(e.value)
