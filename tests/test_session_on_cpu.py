"""How a run caps its device memory: a profile emulated on a bigger GPU, and plan.memory_gib (a budget
the run keeps, not one it only plans for). torch.cuda's cap is recorded, not applied (no GPU here)."""

import pytest
import torch

from edgerl.config.load import load_config
from edgerl.config.schema import ConfigError
from edgerl.device.device import GiB
from edgerl.plan.memory import DEFAULT_CALIBRATION
from edgerl.train.session import _device_for
from edgerl.config.target import resolve_target
from fakes import fake_probe


@pytest.fixture
def caps(monkeypatch):
    got = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda share, index=None: got.append(share))
    return got


def _cfg(*sets):
    return load_config(None, list(sets))


def test_memory_gib_caps_the_allocator_at_the_budget_less_the_context(caps):
    target = resolve_target(probe_fn=lambda: fake_probe("A100"))
    total = target.real.total_memory
    device, note = _device_for(target, _cfg("plan.memory_gib=6"))
    assert device.type == "cuda"
    assert caps == [pytest.approx((6 * GiB - DEFAULT_CALIBRATION.cuda_context) / total)]
    assert "plan.memory_gib=6" in note and "capped" in note


def test_no_budget_no_cap(caps):
    _, note = _device_for(resolve_target(probe_fn=lambda: fake_probe("A100")), _cfg())
    assert caps == [] and note == ""


def test_a_budget_below_the_profile_lowers_the_emulated_cap(caps):
    target = resolve_target("p40", probe_fn=lambda: fake_probe("A100"))
    _, plain = _device_for(target, _cfg())
    _, budgeted = _device_for(target, _cfg("plan.memory_gib=8"))
    assert caps[1] < caps[0], caps
    assert "emulating" in budgeted and "plan.memory_gib=8" in budgeted and "plan.memory_gib" not in plain
    _device_for(target, _cfg("plan.memory_gib=200"))   # a budget above the profile's memory changes nothing
    assert caps[2] == caps[0]


def test_a_budget_the_context_alone_fills_is_refused(caps):
    with pytest.raises(ConfigError, match=r"plan.memory_gib=0.8 leaves nothing .*raise it"):
        _device_for(resolve_target(probe_fn=lambda: fake_probe("A100")), _cfg("plan.memory_gib=0.8"))  # < 880 MiB
    assert caps == []


def test_the_cpu_ignores_the_budget(caps):
    device, note = _device_for(resolve_target(probe_fn=lambda: fake_probe(None, torch_cuda=None)),
                               _cfg("plan.memory_gib=6"))
    assert device.type == "cpu" and caps == [] and note == ""


def test_several_processes_leave_room_for_nccls_buffers(caps):
    """Under torchrun each process holds NCCL's buffers outside the allocator as well: the cap is the
    budget less both, and the plan counts both."""
    import dataclasses
    from edgerl.plan.modelspec import CATALOGUE
    from edgerl.plan.plan import plan
    from edgerl.plan.task import Task
    target = resolve_target(probe_fn=lambda: fake_probe("A100"))
    total = target.real.total_memory
    _device_for(target, _cfg("plan.memory_gib=6"), processes=2)
    cal = DEFAULT_CALIBRATION
    assert caps == [pytest.approx((6 * GiB - cal.cuda_context - cal.nccl) / total)]
    assert cal.outside_allocator(1) == cal.cuda_context and cal.outside_allocator(2) == cal.cuda_context + cal.nccl
    task = Task(prompt_len=128, response_len=128)
    one = plan(target.device, CATALOGUE["qwen2.5-0.5b"], task)
    two = plan(target.device, CATALOGUE["qwen2.5-0.5b"], dataclasses.replace(task, world_size=2))
    assert one.memory.phases["update"]["CUDA context"] == cal.cuda_context
    assert two.memory.phases["update"]["CUDA context"] == cal.cuda_context + cal.nccl
