"""probe() over fake NVML/torch layers: every GPU class, no driver, CPU-only torch, several GPUs."""

import pytest

from edgerl.device.device import GiB, arch_covers, capability, device_from_spec, SpecError
from edgerl.device.probe import probe
from fakes import CU126_ARCH, CU130_ARCH, GPUS, FakeCuda, FakeNvml, fake_probe, nvml_gpu, software

# What each GPU class must come out as (docs/hardware.md, Compute capabilities; fp16 on Pascal): tensor cores,
# fp16 at least as fast as fp32, native fp16 arithmetic at all, integrated (memory shared with the host)
EXPECTED = {
    "M40": (False, False, False, False),      # sm_52: no fp16 units at all
    "P40": (False, False, True, False),       # sm_61: fp16 at 1/64
    "P100": (False, True, True, False),
    "V100": (True, True, True, False),
    "T4": (True, True, True, False),
    "GTX1660": (False, True, True, False),    # sm_75 without tensor cores
    "GTX1660TI": (False, True, True, False),
    "T1000": (False, True, True, False),      # Quadro T-series: sm_75 without tensor cores
    "3090": (True, True, True, False),
    "A100": (True, True, True, False),
    "H100": (True, True, True, False),
    "ORIN": (True, True, True, True),
}


@pytest.mark.parametrize("key", list(GPUS))
def test_probe_reads_each_gpu_class(key):
    r = fake_probe(key)
    d = r.primary
    name, cc, mem, sms, smem = GPUS[key]
    assert d.kind == "cuda" and d.name == name and d.cc == cc
    assert d.sm_count == sms and d.smem_per_block_optin == smem
    assert d.nvml_index == 0 and d.index == 0
    assert d.bf16 == (cc >= (8, 0))
    assert (d.tensor_cores, d.fp16_fast, d.fp16_native, d.integrated) == EXPECTED[key]
    assert d.pcie_gen == 3 and d.driver_version == "560.35.03" and d.cuda_driver == "12.6"
    # a Jetson's GPU memory is its host memory: offloading there frees nothing
    assert d.host_memory == (d.total_memory if d.integrated else 64 * GiB) and d.host_memory_available == 48 * GiB


def test_probe_reports_the_ecc_mode_nvml_sees():
    p40 = nvml_gpu("P40")
    p40.ecc_enabled = True
    r = probe(nvml=FakeNvml([p40]), cuda=FakeCuda([p40], CU126_ARCH), env={}, host=(8 * GiB, None),
              software=software())
    assert r.primary.ecc_enabled is True
    assert fake_probe("3090").primary.ecc_enabled is None


def test_probe_refuses_kepler_with_the_true_reason():
    k80 = nvml_gpu("P40")
    k80.name, k80.cc = "Tesla K80", (3, 7)

    class K80(FakeCuda):
        def properties(self, i):
            p = super().properties(i)
            p.name, p.major, p.minor = "Tesla K80", 3, 7
            return p
    r = probe(nvml=FakeNvml([k80]), cuda=K80([k80], CU126_ARCH), env={}, host=(8 * GiB, None), software=software())
    assert r.primary.kind == "cpu"
    assert "Tesla K80" in r.primary.note and "below 5.0" in r.primary.note and "cu118" in r.primary.note


def test_no_driver_gives_cpu_with_reason():
    r = fake_probe("P40", nvml_ok=False)
    assert r.primary.kind == "cpu"
    assert "no NVIDIA driver" in r.primary.note


def test_cpu_only_torch_names_the_gpu_it_cannot_use():
    r = fake_probe("P40", torch_cuda=None)
    assert r.primary.kind == "cpu"
    assert "CPU-only build" in r.primary.note and "Tesla P40" in r.primary.note


def test_cuda_torch_without_gpu():
    nvml = FakeNvml([], ok=True)
    cuda = FakeCuda([], CU126_ARCH)
    r = probe(nvml=nvml, cuda=cuda, env={}, host=(8 * GiB, None), software=software())
    assert r.primary.kind == "cpu" and "no GPU" in r.primary.note


def test_nvml_missing():
    nvml = FakeNvml([], ok=False, reason="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    r = probe(nvml=nvml, cuda=None, env={}, host=(8 * GiB, None), software=software(None))
    assert r.primary.kind == "cpu" and "nvidia-ml-py" in r.primary.note


def test_torch_cuda_that_raises_is_a_note_not_a_traceback():
    class Broken(FakeCuda):
        def is_available(self):
            raise RuntimeError("CUDA driver initialization failed")
    gpus = [nvml_gpu("T4")]
    r = probe(nvml=FakeNvml(gpus), cuda=Broken(gpus, CU126_ARCH), env={}, host=(8 * GiB, None), software=software())
    assert r.primary.kind == "cpu"
    assert any("CUDA driver initialization failed" in n for n in r.notes)


def test_several_gpus_mapped_through_cuda_visible_devices():
    # NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES=2,0 makes NVML 2 torch's device 0.
    gpus = [nvml_gpu("P40", 0), nvml_gpu("T4", 1), nvml_gpu("3090", 2)]
    visible = [gpus[2], gpus[0]]
    cuda = FakeCuda(visible, CU126_ARCH)
    r = probe(nvml=FakeNvml(gpus), cuda=cuda, env={"CUDA_VISIBLE_DEVICES": "2,0"}, host=(8 * GiB, None),
              software=software())
    assert [d.name for d in r.devices] == ["NVIDIA GeForce RTX 3090", "Tesla P40"]
    assert [(d.index, d.nvml_index) for d in r.devices] == [(0, 2), (1, 0)]


def test_visible_devices_by_uuid_without_torch_uuid():
    gpus = [nvml_gpu("P40", 0), nvml_gpu("T4", 1)]

    class NoUuid(FakeCuda):
        def properties(self, i):
            p = super().properties(i)
            p.uuid = ""
            return p
    r = probe(nvml=FakeNvml(gpus), cuda=NoUuid([gpus[1]], CU126_ARCH), env={"CUDA_VISIBLE_DEVICES": "GPU-t4"},
              host=(8 * GiB, None), software=software())
    assert r.primary.name == "Tesla T4" and r.primary.nvml_index == 1


def test_visible_devices_hiding_everything():
    gpus = [nvml_gpu("T4", 0)]
    cuda = FakeCuda([], CU126_ARCH)
    r = probe(nvml=FakeNvml(gpus), cuda=cuda, env={"CUDA_VISIBLE_DEVICES": ""}, host=(8 * GiB, None),
              software=software())
    assert r.primary.kind == "cpu" and "CUDA_VISIBLE_DEVICES" in r.primary.note


@pytest.mark.parametrize("arch,cc,covered", [
    (CU126_ARCH, (6, 1), True),        # sm_60 cubin runs on sm_61
    (CU130_ARCH, (6, 1), False),       # the real cause of "no kernel image is available"
    (CU130_ARCH, (7, 0), False),       # torch's own check compares majors only and gets this wrong
    (CU130_ARCH, (7, 5), True),
    (CU130_ARCH, (8, 9), True),        # sm_86 runs on 8.9
    (["sm_80", "sm_90a"], (9, 0), True),
    (["sm_90a"], (9, 2), False),       # arch-specific cubins run on exactly their CC
    (["sm_75", "compute_75"], (12, 0), True),   # PTX JIT-compiles forward across majors
    (["sm_86"], (8, 0), False),
    ([], (8, 0), False),
])
def test_arch_coverage(arch, cc, covered):
    assert arch_covers(arch, cc) is covered


def test_capability_table_rules():
    assert capability((7, 2)).cc == (7, 2) and capability((7, 2)).arch == "Volta"
    assert capability((5, 2)).arch == "Maxwell" and capability((5, 2)).smem_per_block_optin == 48 * 1024
    with pytest.raises(SpecError, match=r"3\.7 \(Kepler\) is below 5\.0.*cu118 wheels up to torch 2\.7.*sm_50"):
        capability((3, 7))
    with pytest.raises(SpecError, match="not in edgerl's table"):
        capability((11, 0))
    # a CC above the known ones is refused, not planned with the facts of the nearest lower minor
    with pytest.raises(SpecError, match=r"9\.9 is not in edgerl's table \(5\.0, 5\.2, .*9\.0.*\)"):
        capability((9, 9))
    with pytest.raises(SpecError, match="not in edgerl's table"):
        capability((8, 8))


def test_sm62_is_not_described_as_slow_fp16():
    # Jetson TX2 (6.2) has fast fp16, unlike 6.1; the table must not fall back to 6.1's row
    tx2 = capability((6, 2))
    assert tx2.fp16_fast and tx2.integrated and tx2.smem_per_sm == 64 * 1024
    dev = device_from_spec("cc=6.2,memory=8GiB", software(), 8 * GiB)
    assert "1/64" not in dev.fp16_speed()
    assert "1/64" in device_from_spec("cc=6.1,memory=8GiB", software(), 8 * GiB).fp16_speed()


def test_gpu_spec_fills_missing_fields_from_the_table():
    d = device_from_spec('cc=6.1,memory=24GiB,name="Quadro P6000"', software(), 32 * GiB)
    assert d.name == "Quadro P6000" and d.cc == (6, 1) and d.total_memory == 24 * GiB
    assert d.smem_per_block_optin == 49152 and not d.fp16_fast and not d.bf16 and d.source == "spec"
    d = device_from_spec("cc=8.6,memory=12288MiB,sm_count=28,smem=48KiB", software(), 32 * GiB)
    assert d.total_memory == 12 * GiB and d.sm_count == 28 and d.bf16 and d.smem_per_block_optin == 49152


@pytest.mark.parametrize("spec,message", [
    ("cc=6.1", "needs at least cc and memory"),
    ("cc=six,memory=24GiB", "not a compute capability"),
    ("cc=6.1,memory=lots", "not a size"),
    ("cc=6.1,memory=24GiB,colour=red", "unknown key 'colour'"),
    ("cc=6.1,memory=24GiB,bf16=true", "native bf16 starts at CC 8.0"),
    ("cc=6.1,memory=24GiB,name=\"P6000", "unclosed quote"),
    ("cc=3.7,memory=12GiB", "below 5.0"),
    ("cc=6.1,memory=24", "memory='24' has no unit; write e.g. memory=24GiB or memory=22919MiB"),
    ("cc=6.1,memory=24GiB,host_memory=64", "host_memory='64' has no unit"),
    ("cc=6.1,memory=24TB", "unknown unit 'TB'"),
    ("cc=6.1,memory=100MiB", "memory=100MiB is below 1 GiB"),
    ("cc=6.1,memory=0.5GiB", "below 1 GiB"),
    ("cc=6.1,memory=24GiB,tensor_cores=true", "tensor cores start at CC 7.0"),
    ("cc=7.5,memory=6GiB,name='GeForce GTX 1660 Ti',tensor_cores=true", "sm_75 without tensor cores"),
    ("cc=9.9,memory=80GiB", "not in edgerl's table"),
    ("memory=24GiB,cc", "not key=value"),
])
def test_gpu_spec_errors(spec, message):
    with pytest.raises(SpecError, match=message):
        device_from_spec(spec, software(), 8 * GiB)
