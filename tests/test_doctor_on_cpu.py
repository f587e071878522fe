"""doctor checks over fake machines: each GPU class, no driver, CPU-only torch, a wheel without the GPU."""

import pytest

from edgerl.doctor.doctor import Environment, exit_code, run_checks
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import Task, plan
from fakes import CU126_ARCH, CU130_ARCH, GPUS, fake_probe


class FakeEnv(Environment):
    def __init__(self, writable=True, free=100 * 2**30, env=None):
        super().__init__(env=env or {}, run_dir="runs")
        self._state = (writable, free, "")

    def folder_state(self, path):
        return self._state

    def which(self, program):   # a machine with gcc, whatever this one has
        return "/usr/bin/gcc" if program == "gcc" else None


def checks_for(result, env=None, simulated=False):
    dev = result.primary
    p = plan(dev, CATALOGUE["smollm2-135m"], Task(prompt_len=128, response_len=128))
    return {c.name: c for c in run_checks(dev, result, p, env or FakeEnv(), simulated=simulated)}


@pytest.mark.parametrize("key", list(GPUS))
def test_healthy_machine_passes(key, nvrtc_compiles):
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


def test_attention_and_kernel_report_the_plan():
    c = checks_for(fake_probe("P40", flash_attn="2.7.4"))
    assert c["log-prob kernel"].status == "ok" and "CC >= 7.0" in c["log-prob kernel"].detail
    assert c["attention"].status == "warn" and "flash_attn 2.7.4 is installed but cannot run here" in c["attention"].detail
    c = checks_for(fake_probe("T4"))
    assert c["log-prob kernel"].detail.startswith("torch:") and "FMA" in c["log-prob kernel"].detail
    c = checks_for(fake_probe("3090", triton=None))
    assert c["log-prob kernel"].status == "warn" and "pip install triton" in c["log-prob kernel"].fix
    c = checks_for(fake_probe("3090"))
    assert "mem-efficient" in c["attention"].detail and "flash" in c["attention"].detail
    assert c["log-prob kernel"].detail.startswith("triton:")


def test_fp16_reason_is_exact_for_each_class():
    assert "1/64" in checks_for(fake_probe("P40"))["fp16 and compute dtype"].detail
    assert "1/64" not in checks_for(fake_probe("P100"))["fp16 and compute dtype"].detail
    assert "no native fp16" in checks_for(fake_probe("M40"))["fp16 and compute dtype"].detail


def test_vllm_advice_names_the_capability_and_torch_constraints():
    assert "sm_75" in checks_for(fake_probe("V100"))["vLLM"].fix
    assert "replace the torch" in checks_for(fake_probe("3090"))["vLLM"].fix
    assert "community" in checks_for(fake_probe("P40"))["vLLM"].fix


def test_ecc_advice_when_the_plan_is_short_of_memory():
    import dataclasses
    r = fake_probe("P40")
    dev = dataclasses.replace(r.primary, ecc_enabled=True, profile="p40")
    big = plan(dev, CATALOGUE["qwen2.5-1.5b"], Task(prompt_len=256, response_len=512, prompts_per_step=8,
                                                     samples_per_prompt=8, lora=None))
    ecc = {c.name: c for c in run_checks(dev, r, big, FakeEnv())}["ECC"]
    assert ecc.status == "warn" and "nvidia-smi -i 0 -e 0" in ecc.fix and "1.50 GiB" in ecc.fix
    off = dataclasses.replace(dev, ecc_enabled=False)
    assert "ECC" not in {c.name for c in run_checks(off, r, big, FakeEnv())}


def test_several_gpus_are_listed_with_peer_access():
    from edgerl.device.device import GiB
    from edgerl.device.probe import probe
    from fakes import FakeCuda, FakeNvml, nvml_gpu, software
    gpus = [nvml_gpu("T4", 0), nvml_gpu("T4", 1)]
    for peer, status in ((True, "ok"), (False, "warn")):
        r = probe(nvml=FakeNvml(gpus), cuda=FakeCuda(gpus, CU126_ARCH, peer=peer), env={}, host=(64 * GiB, 48 * GiB),
                  software=software())
        c = {x.name: x for x in run_checks(r.primary, r, None, FakeEnv())}["GPUs and peer access"]
        assert c.status == status and "0: Tesla T4" in c.detail and "1: Tesla T4" in c.detail


def test_a_wrong_measured_matmul_fails_the_doctor():
    import dataclasses
    from edgerl.device.measured import Item, Measurements
    r = fake_probe("T4")
    m = Measurements(kind="cuda", name="Tesla T4", uuid="gpu-t4", cc=(7, 5), torch="2.7.1", cuda="12.6",
                     date="2026-12-01T00:00:00Z", fp32_matmul=Item(value=8.0, status="ok", note=""),
                     fp16_matmul=Item(value=60.0, status="wrong", note="max error 0.5"))
    dev = dataclasses.replace(r.primary, measured=m)
    c = {x.name: x for x in run_checks(dev, r, None, FakeEnv())}["measured speed"]
    assert c.status == "fail" and "fp16_matmul" in c.detail and "reinstall" in c.fix


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


def test_fused_nf4_kernel_compiles_or_doctor_says_what_qlora_loses(monkeypatch, nvrtc_compiles):
    import dataclasses
    import edgerl.kernels.nvrtc as nvrtc
    seen = nvrtc_compiles
    r = fake_probe("P40", bitsandbytes="0.50.2")
    c = checks_for(r)["fused NF4 kernel"]
    assert c.status == "ok" and "sm_61" in c.detail
    assert (["nf4_mm<float, 16, 2>", "splits_sum<float>"], (6, 1)) in seen
    assert "fused NF4 kernel" not in checks_for(r, simulated=True)   # a simulated GPU: NVRTC here is not its
    assert "fused NF4 kernel" not in checks_for(fake_probe("P40"))   # no bitsandbytes: no NF4 base to serve
    t4 = fake_probe("T4", bitsandbytes="0.50.2")   # an fp16 QLoRA plan through the cuda-c layers: the fp16 kernels
    asked = plan(t4.primary, CATALOGUE["smollm2-135m"], dataclasses.replace(Task(prompt_len=128, response_len=128),
                                                                            lora=True),
                 {"base_dtype": "nf4", "decode_backend": "cuda-c"})
    c = next(x for x in run_checks(t4.primary, t4, asked, FakeEnv()) if x.name == "fused NF4 kernel")
    assert c.status == "ok" and "in fp16" in c.detail and "this plan uses it" in c.detail
    # fp16 on tensor cores too
    assert (["nf4_mm<h16, 16, 2>", "splits_sum<h16>", "nf4_mma<4>"], (7, 5)) in seen

    def broken(src, names, cc):
        raise nvrtc.KernelUnavailable("no NVRTC library found")
    monkeypatch.setattr(nvrtc, "compile_cubin", broken)
    c = checks_for(r)["fused NF4 kernel"]
    assert c.status == "warn" and "no NVRTC library found" in c.detail and "plan.decode_backend=torch" in c.fix
    dev = r.primary
    qlora = plan(dev, CATALOGUE["smollm2-135m"], dataclasses.replace(Task(prompt_len=128, response_len=128), lora=True),
                 {"base_dtype": "nf4"})
    assert qlora.decode_backend == "cuda-c" and qlora.base_dtype == "nf4"
    checks = run_checks(dev, r, qlora, FakeEnv())
    assert next(x for x in checks if x.name == "fused NF4 kernel").status == "fail" and exit_code(checks) == 1


class NoCompilerEnv(FakeEnv):
    def __init__(self, found=(), env=None):
        super().__init__(env=env)
        self.found = set(found)

    def which(self, program):
        return f"/usr/bin/{program}" if program in self.found else None


@pytest.mark.parametrize("found,env,status", [((), {}, "fail"), (("gcc",), {}, "ok"), (("clang",), {}, "ok"),
                                              (("gcc",), {"CC": "cc-missing"}, "fail"),
                                              (("cc-custom",), {"CC": "cc-custom"}, "ok")])
def test_a_plan_with_triton_kernels_needs_a_c_compiler(found, env, status):
    """Triton builds each kernel's launcher with $CC, else gcc, else clang: an A100 plan (Triton log-prob
    kernel, Triton decode layers) fails the check without one, naming what to install or turn off."""
    from edgerl.doctor.doctor import exit_code
    result = fake_probe("A100")
    dev = result.primary
    p = plan(dev, CATALOGUE["smollm2-135m"], Task(prompt_len=128, response_len=128))
    assert p.kernel_backend == "triton"
    checks = {c.name: c for c in run_checks(dev, result, p, NoCompilerEnv(found, env))}
    c = checks["C compiler"]
    assert c.status == status, c
    if status == "fail":
        assert "cc-missing" in c.detail if env else "no gcc or clang" in c.detail
        assert "apt install gcc" in c.fix and "plan.kernel_backend=torch" in c.fix
        assert "the decode-attention kernel" in c.detail and "plan.decode_backend=torch" in c.fix
        assert exit_code(list(checks.values())) == 1
    else:
        assert c.detail.startswith("/usr/bin/")


def test_a_plan_without_triton_does_not_ask_for_a_c_compiler():
    result = fake_probe("P40")
    dev = result.primary
    p = plan(dev, CATALOGUE["smollm2-135m"], Task(prompt_len=128, response_len=128))
    assert p.kernel_backend == "torch" and p.decode_backend == "cuda-c"
    assert "C compiler" not in {c.name for c in run_checks(dev, result, p, NoCompilerEnv())}


def test_decode_layer_kernels_compile_or_doctor_names_the_setting(monkeypatch, nvrtc_compiles):
    """An fp32 plan's rollout decodes through the CUDA C layer kernels: the doctor compiles the ones the model
    needs (SmolLM2-135M: 3 query heads per KV head of size 64; the attention over the plan's fp16 KV cache) for the
    GPU, and fails naming the setting."""
    import edgerl.kernels.nvrtc as nvrtc
    r = fake_probe("P40")
    c = checks_for(r)["decode-layer kernels"]
    assert c.status == "ok" and "sm_61" in c.detail
    assert (["add_rms_norm<float>", "silu_mul<float>", "rope_attend_kv<float, h16, 3, 64>",
             "rope_attend_split_kv<float, h16, 3, 64>", "attend_combine<float, 3, 64>"], (6, 1)) in nvrtc_compiles
    assert "decode-layer kernels" not in checks_for(r, simulated=True)
    assert "decode-layer kernels" not in checks_for(fake_probe("3090"))   # bf16: the Triton kernel instead
    t4 = fake_probe("T4")
    c = checks_for(t4)["decode-layer kernels"]        # fp16 below CC 8.0: the same kernels, storing fp16
    assert c.status == "ok" and "the fp16 decode step" in c.detail and "sm_75" in c.detail
    torch_ops = plan(t4.primary, CATALOGUE["smollm2-135m"], Task(prompt_len=128, response_len=128),
                     {"decode_backend": "torch"})
    assert "decode-layer kernels" not in {c.name for c in run_checks(t4.primary, t4, torch_ops, FakeEnv())}
    assert (["add_rms_norm<h16>", "silu_mul<h16>", "rope_attend<h16, 3, 64>", "rope_attend_split<h16, 3, 64>",
             "attend_combine<h16, 3, 64>"], (7, 5)) in nvrtc_compiles

    def broken(src, names, cc):
        raise nvrtc.KernelUnavailable("no NVRTC library found")
    monkeypatch.setattr(nvrtc, "compile_cubin", broken)
    c = checks_for(r)["decode-layer kernels"]
    assert c.status == "fail" and "no NVRTC library found" in c.detail and "plan.decode_backend=torch" in c.fix
