"""doctor checks over fake machines: each GPU class, no driver, CPU-only torch, a wheel without the GPU."""

import pytest

from edgerl.doctor import Environment, exit_code, run_checks
from edgerl.modelspec import CATALOGUE
from edgerl.plan import Task, plan
from fakes import CU126_ARCH, CU130_ARCH, GPUS, fake_probe


class FakeEnv(Environment):
    def __init__(self, writable=True, free=100 * 2**30, env=None):
        super().__init__(env=env or {}, run_dir="runs")
        self._state = (writable, free, "")

    def folder_state(self, path):
        return self._state


def checks_for(result, env=None, simulated=False):
    dev = result.primary
    p = plan(dev, CATALOGUE["smollm2-135m"], Task(prompt_len=128, response_len=128))
    return {c.name: c for c in run_checks(dev, result, p, env or FakeEnv(), simulated=simulated)}


@pytest.mark.parametrize("key", list(GPUS))
def test_healthy_machine_passes(key):
    arch = CU126_ARCH
    checks = checks_for(fake_probe(key, arch=arch))
    assert checks["driver and NVML"].status == "ok"
    assert checks["torch sees CUDA"].status == "ok"
    assert checks["torch build covers this GPU"].status == "ok"
    assert exit_code(list(checks.values())) == 0
    assert "bf16 tensor cores" in checks["native bf16"].detail if GPUS[key][1] >= (8, 0) \
        else "never picks bf16" in checks["native bf16"].detail


def test_wheel_without_the_gpu_is_the_no_kernel_image_failure():
    checks = checks_for(fake_probe("P40", arch=CU130_ARCH, torch_cuda="13.0"))
    arch = checks["torch build covers this GPU"]
    assert arch.status == "fail"
    assert "no kernel image is available" in arch.detail
    assert "whl/cu126" in arch.fix
    assert exit_code(list(checks.values())) == 1


def test_volta_on_a_cu130_wheel_fails_though_majors_match_sm_75():
    checks = checks_for(fake_probe("V100", arch=CU130_ARCH, torch_cuda="13.0"))
    assert checks["torch build covers this GPU"].status == "fail"


def test_no_driver():
    checks = checks_for(fake_probe("P40", nvml_ok=False))
    assert checks["driver and NVML"].status == "warn"  # a GPU-less machine still trains, on the CPU
    assert "no NVIDIA driver" in checks["driver and NVML"].detail


def test_cpu_only_torch_with_a_gpu_present_names_the_wheel():
    checks = checks_for(fake_probe("P40", torch_cuda=None))
    assert checks["torch sees CUDA"].status == "fail"
    assert "whl/cu126" in checks["torch sees CUDA"].fix
    assert checks["torch build covers this GPU"].status == "fail"


def test_runtime_newer_than_driver():
    r = fake_probe("T4", arch=CU130_ARCH, torch_cuda="13.0")  # driver supports 12.6
    assert checks_for(r)["CUDA runtime vs driver"].status == "fail"


def test_triton_and_flash_attn_by_capability():
    c = checks_for(fake_probe("P40", flash_attn="2.7.4"))
    assert c["Triton"].status == "ok" and "CC >= 7.0" in c["Triton"].detail
    assert c["FlashAttention-2"].status == "warn"
    c = checks_for(fake_probe("T4", triton=None))
    assert c["Triton"].status == "warn" and c["Triton"].fix == "pip install triton"
    c = checks_for(fake_probe("3090"))
    assert "mem-efficient" in c["SDPA backends"].detail and "flash" in c["SDPA backends"].detail


def test_folders_and_allocator():
    c = checks_for(fake_probe("T4"), FakeEnv(writable=False))
    assert c["run folder writable"].status == "fail"
    c = checks_for(fake_probe("T4"), FakeEnv(free=2 * 2**30))
    assert c["HF cache (HF_HOME) writable"].status == "warn"
    c = checks_for(fake_probe("T4"), FakeEnv(env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}))
    assert c["allocator settings"].status == "warn"


def test_narrow_pcie_link_warns():
    import dataclasses
    r = fake_probe("3090")
    dev = dataclasses.replace(r.primary, pcie_width=4)
    r = dataclasses.replace(r, devices=(dev,))
    assert checks_for(r)["PCIe link"].status == "warn"
