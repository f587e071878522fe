"""Fake NVML and torch.cuda layers, so that probe/plan/doctor tests need no GPU."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from edgerl.device.device import GiB, Software
from edgerl.device.probe import NvmlGpu, NvmlReport, probe

# name, cc, memory GiB, SMs, smem opt-in (bytes) as torch reports them
GPUS = {
    "M40": ("Tesla M40 24GB", (5, 2), 22.4, 24, 49152),
    "P40": ("Tesla P40", (6, 1), 22.4, 30, 49152),
    "P100": ("Tesla P100-PCIE-16GB", (6, 0), 15.9, 56, 49152),
    "V100": ("Tesla V100-SXM2-16GB", (7, 0), 15.8, 80, 98304),
    "T4": ("Tesla T4", (7, 5), 14.6, 40, 65536),
    "GTX1660": ("NVIDIA GeForce GTX 1660", (7, 5), 5.8, 22, 65536),
    "GTX1660TI": ("NVIDIA GeForce GTX 1660 Ti", (7, 5), 5.8, 24, 65536),
    "T1000": ("NVIDIA T1000 8GB", (7, 5), 7.8, 14, 65536),
    "3090": ("NVIDIA GeForce RTX 3090", (8, 6), 23.7, 82, 101376),
    "A100": ("NVIDIA A100-SXM4-40GB", (8, 0), 39.4, 108, 166912),
    "H100": ("NVIDIA H100 80GB HBM3", (9, 0), 79.1, 132, 232448),
    "ORIN": ("Orin", (8, 7), 61.4, 16, 166912),
}
INTEGRATED = {"ORIN"}  # torch says is_integrated=1: the GPU shares the host's memory

CU126_ARCH = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU130_ARCH = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


def nvml_gpu(key: str, index: int = 0) -> NvmlGpu:
    name, cc, mem, _, _ = GPUS[key]
    total = int(mem * GiB)
    return NvmlGpu(index=index, name=name, uuid=f"GPU-{key.lower()}-{index:04d}", cc=cc, total=total,
                   free=int(total * 0.97), pcie_gen=3, pcie_gen_max=3, pcie_width=16, pcie_width_max=16,
                   utilization_pct=0)


@dataclass
class FakeNvml:
    gpus: list
    ok: bool = True
    reason: str = ""
    cuda_driver: str = "12.6"

    def read(self) -> NvmlReport:
        if not self.ok:
            return NvmlReport(False, self.reason)
        return NvmlReport(True, "", "560.35.03", self.cuda_driver, list(self.gpus))


@dataclass
class FakeCuda:
    gpus: list                 # NvmlGpu entries visible to CUDA, in CUDA order
    arch: list
    version: Optional[str] = "12.6"
    available: bool = True
    peer: bool = True

    def is_available(self) -> bool:
        return self.available and bool(self.gpus)

    def device_count(self) -> int:
        return len(self.gpus) if self.available else 0

    def properties(self, i: int):
        g = self.gpus[i]
        key = g.uuid.split("-")[1].upper()
        _, _, _, sms, smem = GPUS[key]
        return SimpleNamespace(name=g.name, major=g.cc[0], minor=g.cc[1], total_memory=g.total - 300 * 2**20,
                               multi_processor_count=sms, shared_memory_per_block=49152,
                               shared_memory_per_block_optin=smem, uuid=g.uuid.removeprefix("GPU-"),
                               is_integrated=int(key in INTEGRATED), memory_clock_rate=None, memory_bus_width=None)

    def mem_get_info(self, i: int):
        return (self.gpus[i].free, self.gpus[i].total)

    def arch_list(self):
        return list(self.arch) if self.is_available() else []

    def cuda_version(self):
        return self.version

    def can_access_peer(self, a: int, b: int) -> bool:
        return self.peer


def software(torch_cuda: Optional[str] = "12.6", arch=CU126_ARCH, **libs) -> Software:
    base = {"torch": "2.7.1+cu126" if torch_cuda else "2.7.1+cpu", "transformers": "4.55.0", "triton": "3.3.1"}
    base.update(libs)
    return Software(python="3.11.7", torch=base["torch"], torch_cuda=torch_cuda,
                    arch_list=tuple(arch) if torch_cuda else (),
                    libs=tuple((k, v) for k, v in base.items() if v is not None))


def fake_probe(key: Optional[str], arch=CU126_ARCH, torch_cuda: Optional[str] = "12.6", nvml_ok: bool = True,
               env: Optional[dict] = None, **libs):
    """probe() on a machine with one GPU `key` (or none), a torch build with `arch`."""
    gpus = [nvml_gpu(key)] if key else []
    nvml = FakeNvml(gpus, ok=nvml_ok, reason="" if nvml_ok else "no NVIDIA driver: libnvidia-ml.so was not found")
    cuda = FakeCuda(gpus if torch_cuda else [], arch, torch_cuda, available=bool(torch_cuda) and nvml_ok)
    sw = software(torch_cuda, arch, **libs)
    return probe(nvml=nvml, cuda=cuda, env=env or {}, host=(64 * GiB, 48 * GiB), software=sw)
