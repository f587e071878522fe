"""GPUs given only by --gpu-spec: the Device facts they get, and that the planner takes them without crashing."""

import pytest

from edgerl.device.device import GiB, SpecError, device_from_spec
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import Task, plan
from fakes import software

TASK = Task(prompt_len=128, response_len=128, prompts_per_step=2, samples_per_prompt=4, lora=None)

# spec -> (tensor cores, bf16, fp16 at least as fast as fp32, native fp16, integrated, smem opt-in KiB,
#          compute dtype the plan picks, kernel backend)
SPECS = [
    ('cc=5.2,memory=22939MiB,name="Tesla M40 24GB"', (False, False, False, False, False, 48, "fp32", "torch")),
    ("cc=5.3,memory=4GiB", (False, False, True, True, True, 48, "fp32", "torch")),   # Jetson Nano
    ("cc=6.2,memory=8GiB", (False, False, True, True, True, 48, "fp32", "torch")),   # Jetson TX2
    ("cc=7.2,memory=32GiB", (True, False, True, True, True, 96, "fp16", "torch")),  # Jetson Xavier
    ('cc=7.5,memory=6GiB,name="GeForce GTX 1660 Ti"', (False, False, True, True, False, 64, "fp16", "torch")),
    ('cc=7.5,memory=4GiB,name="Quadro T1000"', (False, False, True, True, False, 64, "fp16", "torch")),
    ("cc=8.7,memory=62841MiB", (True, True, True, True, True, 163, "bf16", "triton")),  # Jetson AGX Orin
    ("cc=10.0,memory=180GiB", (True, True, True, True, False, 227, "bf16", "triton")),
    ("cc=12.0,memory=32GiB", (True, True, True, True, False, 99, "bf16", "triton")),
]


@pytest.mark.parametrize("spec,expected", SPECS)
def test_gpu_spec_devices_and_their_plans(spec, expected):
    dev = device_from_spec(spec, software(), 64 * GiB)
    tc, bf16, fast, native, integrated, smem_kib, compute, backend = expected
    assert (dev.tensor_cores, dev.bf16, dev.fp16_fast, dev.fp16_native, dev.integrated) == \
        (tc, bf16, fast, native, integrated)
    assert dev.smem_per_block_optin == smem_kib * 1024
    if integrated:
        assert dev.host_memory == dev.total_memory  # the GPU's memory is the host's: offloading frees nothing
    p = plan(dev, CATALOGUE["smollm2-135m"], TASK)
    assert p.dtype.compute == compute and p.kernel_backend == backend
    assert p.memory.fits


def test_integrated_can_be_stated_and_overridden():
    assert device_from_spec("cc=8.6,memory=8GiB,integrated=true", software(), 64 * GiB).integrated
    assert not device_from_spec("cc=8.7,memory=8GiB,integrated=false", software(), 64 * GiB).integrated


def test_kepler_is_refused_with_the_true_reason():
    with pytest.raises(SpecError) as e:
        device_from_spec('cc=3.7,memory=11441MiB,name="Tesla K80"', software(), 64 * GiB)
    msg = str(e.value)
    assert "below 5.0" in msg and "cu118 wheels up to torch 2.7" in msg and "sm_50" in msg


def test_unknown_cc_above_the_table_is_refused_not_imagined():
    with pytest.raises(SpecError) as e:
        device_from_spec("cc=9.9,memory=80GiB", software(), 64 * GiB)
    assert "9.9 is not in edgerl's table" in str(e.value) and "12.0" in str(e.value)
