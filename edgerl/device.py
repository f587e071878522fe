"""`Device`: what edgerl knows about the hardware, from a probe, a profile or a spec.

The per-capability table below is the one place facts about compute capabilities live; every
row cites ../shared/reference/hardware.md (which names its sources). A `Device` is plain data:
the plan reads it, nothing reads the hardware except `edgerl.probe`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal, Optional
from .errors import SpecError

GiB = 1024**3
MiB = 1024**2




@dataclass(frozen=True)
class Capability:
    """Facts shared by every GPU of one compute capability (hardware.md §1, §8, §9)."""
    cc: tuple[int, int]
    arch: str
    smem_per_block_optin: int   # bytes; tiles are sized against this (hardware.md §1)
    smem_per_sm: int
    max_threads_per_sm: int
    fp16_fast: bool             # fp16 arithmetic at least as fast as fp32 (false on sm_61: 1/64 rate)
    tensor_cores: bool          # fp16 tensor cores (GTX 16xx at 7.5 is the exception: see profiles)
    bf16: bool                  # native bf16; emulated bf16 on 7.x is never counted
    examples: str


_K = 1024
CAPABILITIES: dict[tuple[int, int], Capability] = {c.cc: c for c in [
    Capability((6, 0), "Pascal", 48 * _K, 64 * _K, 2048, True, False, False, "P100"),
    Capability((6, 1), "Pascal", 48 * _K, 96 * _K, 2048, False, False, False, "P40, P4, GTX 10xx"),
    Capability((7, 0), "Volta", 96 * _K, 96 * _K, 2048, True, True, False, "V100"),
    Capability((7, 5), "Turing", 64 * _K, 64 * _K, 1024, True, True, False, "T4, RTX 20xx, GTX 16xx"),
    Capability((8, 0), "Ampere", 163 * _K, 164 * _K, 2048, True, True, True, "A100"),
    Capability((8, 6), "Ampere", 99 * _K, 100 * _K, 1536, True, True, True, "A10, RTX 30xx"),
    Capability((8, 7), "Ampere", 163 * _K, 164 * _K, 1536, True, True, True, "Jetson Orin"),
    Capability((8, 9), "Ada", 99 * _K, 100 * _K, 1536, True, True, True, "L4, RTX 40xx"),
    Capability((9, 0), "Hopper", 227 * _K, 228 * _K, 2048, True, True, True, "H100, H200"),
    Capability((10, 0), "Blackwell", 227 * _K, 228 * _K, 2048, True, True, True, "B200"),
    Capability((12, 0), "Blackwell", 99 * _K, 100 * _K, 1536, True, True, True, "RTX 50xx"),
]}
MIN_CC = (6, 0)
DEFAULT_SMEM_PER_BLOCK = 48 * _K  # static shared memory limit on every CC (hardware.md §1)


def capability(cc: tuple[int, int]) -> Capability:
    """The table row for `cc`, or for the nearest lower minor of the same major (e.g. 7.2 -> 7.0).

    Raises ValueError for CCs edgerl does not support (below 6.0) or does not know."""
    if cc < MIN_CC:
        raise SpecError(f"compute capability {cc[0]}.{cc[1]} is below 6.0 (Pascal); edgerl and current "
                         "PyTorch wheels do not support it")
    if cc in CAPABILITIES:
        return CAPABILITIES[cc]
    same_major = [c for c in CAPABILITIES if c[0] == cc[0] and c[1] <= cc[1]]
    if same_major:
        row = CAPABILITIES[max(same_major)]
        return replace(row, cc=cc)
    known = ", ".join(f"{a}.{b}" for a, b in CAPABILITIES)
    raise SpecError(f"compute capability {cc[0]}.{cc[1]} is not in edgerl's table ({known})")


@dataclass(frozen=True)
class Software:
    """The software side of a machine: torch build, arch list, optional libraries."""
    python: str = ""
    torch: Optional[str] = None
    torch_cuda: Optional[str] = None          # torch.version.cuda, e.g. "12.6"; None for CPU builds
    arch_list: tuple[str, ...] = ()           # torch.cuda.get_arch_list()
    libs: tuple[tuple[str, Optional[str]], ...] = ()  # (distribution, version or None)
    machine: str = ""                         # platform.machine(): x86_64, aarch64; "" when unknown

    def version(self, lib: str) -> Optional[str]:
        return dict(self.libs).get(lib)

    def has(self, lib: str) -> bool:
        return self.version(lib) is not None


@dataclass(frozen=True)
class Device:
    """One compute device as the planner sees it. `kind == "cpu"` carries `note` saying why."""
    kind: Literal["cuda", "cpu"]
    name: str
    total_memory: int                          # bytes the process can allocate on the device
    host_memory: int                           # host RAM in bytes (offload target)
    software: Software = field(default_factory=Software)
    cc: Optional[tuple[int, int]] = None
    index: Optional[int] = None                # torch index (CUDA_VISIBLE_DEVICES order)
    nvml_index: Optional[int] = None           # physical index as NVML numbers it
    free_memory: Optional[int] = None
    sm_count: Optional[int] = None
    smem_per_block: int = DEFAULT_SMEM_PER_BLOCK
    smem_per_block_optin: int = DEFAULT_SMEM_PER_BLOCK
    tensor_cores: bool = False
    bf16: bool = False
    fp16_fast: bool = False
    integrated: bool = False                   # shares memory with the host (Jetson)
    memory_bandwidth_gbs: Optional[float] = None
    pcie_gen: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_width_max: Optional[int] = None
    utilization_pct: Optional[int] = None
    driver_version: Optional[str] = None
    cuda_driver: Optional[str] = None          # highest CUDA version the driver supports, "13.0"
    host_memory_available: Optional[int] = None
    source: Literal["probe", "profile", "spec", "cpu"] = "probe"
    profile: Optional[str] = None              # profile name this device matches or came from
    note: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def sm(self) -> str:
        """'sm_61' style name, 'cpu' for the CPU."""
        return f"sm_{self.cc[0]}{self.cc[1]}" if self.cc else "cpu"

    def describe(self) -> str:
        if not self.is_cuda:
            return f"CPU ({self.host_memory / GiB:.0f} GiB RAM)"
        return f"{self.name} ({self.sm}, {self.total_memory / GiB:.1f} GiB)"


def cpu_device(host_memory: int, software: Software, note: str,
               host_memory_available: Optional[int] = None) -> Device:
    """The CPU as a training device; `note` says why no GPU is used."""
    return Device(kind="cpu", name="CPU", total_memory=host_memory, host_memory=host_memory,
                  host_memory_available=host_memory_available, software=software, source="cpu",
                  profile="cpu", note=note)


def gpu_from_capability(name: str, cc: tuple[int, int], total_memory: int, host_memory: int,
                        software: Software, **facts) -> Device:
    """A CUDA device whose missing facts come from the capability table."""
    row = capability(cc)
    base = dict(smem_per_block_optin=row.smem_per_block_optin, tensor_cores=row.tensor_cores,
                bf16=row.bf16, fp16_fast=row.fp16_fast)
    base.update({k: v for k, v in facts.items() if v is not None})
    return Device(kind="cuda", name=name, cc=cc, total_memory=total_memory, host_memory=host_memory,
                  software=software, **base)


# --- the torch build's arch list -----------------------------------------------------------------

_ARCH = re.compile(r"^(sm|compute)_(\d+)([a-z]?)$")


def _arch_cc(n: int) -> tuple[int, int]:
    return (n // 10, n % 10)


def arch_covers(arch_list: tuple[str, ...] | list[str], cc: tuple[int, int]) -> bool:
    """Does a torch build with this arch list have code that runs on `cc`?

    A cubin sm_XY runs on X.z iff z >= Y (same major); PTX compute_XY JIT-compiles forward to any
    later CC (hardware.md §2). torch's own `_check_cubins` compares majors only and misjudges V100
    on sm_75-only wheels, so edgerl checks minors too."""
    for arch in arch_list:
        m = _ARCH.match(arch.strip())
        if not m:
            continue
        kind, num, suffix = m.group(1), int(m.group(2)), m.group(3)
        acc = _arch_cc(num)
        if kind == "sm":
            if suffix == "a" and acc != cc:   # sm_90a: arch-specific, runs on exactly that CC
                continue
            if acc[0] == cc[0] and acc[1] <= cc[1]:
                return True
        elif acc <= cc:
            return True
    return False


def _cuda_tuple(v: Optional[str]) -> Optional[tuple[int, int]]:
    if not v:
        return None
    parts = v.split(".")
    try:
        return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0)
    except ValueError:
        return None


def wheel_for(cc: tuple[int, int], cuda_driver: Optional[str] = None) -> tuple[str, str]:
    """(pip install command, reason) for a torch build whose arch list covers `cc` (hardware.md §2).

    cu128/cu130 builds start at sm_75 (torch 2.11) or sm_70; Pascal needs cu126 or older. The
    driver must also support the wheel's CUDA version."""
    drv = _cuda_tuple(cuda_driver)
    url = "https://download.pytorch.org/whl/"

    def cmd(tag: str, pin: str = "torch") -> str:
        return f"pip install '{pin}' --index-url {url}{tag}"

    if cc < (7, 0):
        if drv is not None and drv < (12, 6):
            return (cmd("cu118", "torch<2.8"), f"sm_{cc[0]}{cc[1]} needs a wheel with sm_60 code; the "
                    f"driver supports CUDA {cuda_driver}, below 12.6, so cu118 (torch <= 2.7)")
        return (cmd("cu126"), f"sm_{cc[0]}{cc[1]} (Pascal) is in cu126 wheels (sm_50..sm_90); cu128 and "
                "newer builds start at sm_70/sm_75")
    if cc < (7, 5):
        if drv is not None and drv < (12, 6):
            return (cmd("cu118", "torch<2.8"), f"sm_70 with a CUDA {cuda_driver} driver: cu118 wheels")
        return (cmd("cu126"), "sm_70 (Volta) was dropped from cu128/cu130 builds in torch 2.11; "
                "cu126 still has it")
    if cc >= (10, 0):
        return (cmd("cu128"), f"sm_{cc[0]}{cc[1]} (Blackwell) needs CUDA 12.8 or newer wheels")
    if drv is not None and drv < (12, 6):
        return (cmd("cu118", "torch<2.8"), f"the driver supports CUDA {cuda_driver}: cu118 wheels")
    if drv is not None and drv < (12, 8):
        return (cmd("cu126"), f"the driver supports CUDA {cuda_driver}: cu126 wheels")
    return (cmd("cu128"), f"sm_{cc[0]}{cc[1]} is in cu126, cu128 and cu130 builds")


# --- ad-hoc specs: --gpu-spec cc=6.1,memory=24GiB,name="Quadro P6000" -----------------------------

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|g|m)?\s*$", re.IGNORECASE)
SPEC_KEYS = ("cc", "memory", "name", "sm_count", "smem", "bandwidth", "tensor_cores", "bf16",
             "host_memory")


def parse_size(text: str, key: str = "memory") -> int:
    """'24GiB', '24 GB', '16384MiB', '24' (GiB) -> bytes. GB is read as GiB, as nvidia-smi prints."""
    m = _SIZE.match(text)
    if not m:
        raise SpecError(f"{key}={text!r} is not a size; write e.g. {key}=24GiB or {key}=16384MiB")
    value, unit = float(m.group(1)), (m.group(2) or "gib").lower()
    return int(value * (MiB if unit in ("mib", "mb", "m") else GiB))


def _split_spec(spec: str) -> list[str]:
    parts, cur, quote = [], "", None
    for ch in spec:
        if quote:
            if ch == quote:
                quote = None
            else:
                cur += ch
        elif ch in "\"'":
            quote = ch
        elif ch == ",":
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if quote:
        raise SpecError(f"--gpu-spec {spec!r}: unclosed quote")
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _parse_bool(key: str, v: str) -> bool:
    if v.lower() in ("1", "true", "yes"):
        return True
    if v.lower() in ("0", "false", "no"):
        return False
    raise SpecError(f"{key}={v!r}: write true or false")


def device_from_spec(spec: str, software: Software, host_memory: int) -> Device:
    """A GPU described by `key=value` pairs; missing facts come from the capability table."""
    fields: dict[str, str] = {}
    for part in _split_spec(spec):
        if "=" not in part:
            raise SpecError(f"--gpu-spec: {part!r} is not key=value; example: "
                             "cc=6.1,memory=24GiB,name=\"Quadro P6000\"")
        k, v = (s.strip() for s in part.split("=", 1))
        if k not in SPEC_KEYS:
            import difflib
            close = difflib.get_close_matches(k, SPEC_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SpecError(f"--gpu-spec: unknown key {k!r}{hint}; keys: {', '.join(SPEC_KEYS)}")
        fields[k] = v
    if "cc" not in fields or "memory" not in fields:
        raise SpecError("--gpu-spec needs at least cc and memory, e.g. cc=6.1,memory=24GiB")
    m = re.match(r"^(\d+)\.(\d)$", fields["cc"])
    if not m:
        raise SpecError(f"--gpu-spec: cc={fields['cc']!r} is not a compute capability like 6.1 or 8.6")
    cc = (int(m.group(1)), int(m.group(2)))
    capability(cc)  # raises a clear error for unsupported or unknown CCs
    facts = {}
    if "sm_count" in fields:
        if not fields["sm_count"].isdigit():
            raise SpecError(f"--gpu-spec: sm_count={fields['sm_count']!r} is not a whole number")
        facts["sm_count"] = int(fields["sm_count"])
    if "smem" in fields:
        facts["smem_per_block_optin"] = parse_size(fields["smem"], "smem") if not fields["smem"].isdigit() \
            else int(fields["smem"])
    if "bandwidth" in fields:
        try:
            facts["memory_bandwidth_gbs"] = float(fields["bandwidth"].lower().removesuffix("gb/s"))
        except ValueError:
            raise SpecError(f"--gpu-spec: bandwidth={fields['bandwidth']!r}: write GB/s, e.g. 347") from None
    for key in ("tensor_cores", "bf16"):
        if key in fields:
            facts[key] = _parse_bool(key, fields[key])
    if facts.get("bf16") and cc < (8, 0):
        raise SpecError(f"--gpu-spec: bf16=true with cc={fields['cc']}: native bf16 starts at CC 8.0")
    host = parse_size(fields["host_memory"], "host_memory") if "host_memory" in fields else host_memory
    name = fields.get("name") or f"GPU sm_{cc[0]}{cc[1]}"
    dev = gpu_from_capability(name, cc, parse_size(fields["memory"]), host, software, **facts)
    return replace(dev, source="spec", note=f"described by --gpu-spec {spec}")
