"""`Device`: what edgerl knows about the hardware, from a probe, a profile or a spec.

The per-capability table below is the one place facts about compute capabilities live; every
row cites docs/hardware.md (which names its public sources), the CUDA programming guide or
NVIDIA's CCCL. A `Device` is plain data:
the plan reads it, nothing reads the hardware except `edgerl.device.probe`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional
from edgerl.core.errors import SpecError

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class Capability:
    """Facts shared by every GPU of one compute capability (docs/hardware.md, Compute capabilities)."""
    cc: tuple[int, int]
    arch: str
    smem_per_block_optin: int   # bytes; tiles are sized against this (docs/hardware.md, Shared memory)
    smem_per_sm: int
    max_threads_per_sm: int
    fp16_fast: bool             # fp16 arithmetic at least as fast as fp32 (false on sm_61: 1/64 rate)
    tensor_cores: bool          # fp16 tensor cores (sm_75 parts without them: turing_without_tensor_cores)
    bf16: bool                  # native bf16; emulated bf16 on 7.x is never counted
    examples: str
    fp16_native: bool = True    # false on sm_50/sm_52: half is a storage format, arithmetic runs in fp32
    integrated: bool = False    # every GPU of this CC is a Tegra SoC sharing memory with the CPU (Jetson)


_K = 1024
# Sources. 6.0, 6.1, 7.0, 7.5, 8.x, 9.0, 10.0, 12.0: docs/hardware.md, Compute capabilities [G][CCCL]. 5.x and
# 7.2: CUDA C++ Programming Guide 12.x, "Technical Specifications per Compute Capability": 48 KB per block with no
# opt-in above it on 5.x/6.x, 64/96/64 KB per SM on 5.0/5.2/5.3, 96 KB per SM and per block on 7.2, 2048
# resident threads per SM; fp16: the same guide's arithmetic-throughput table (no native fp16 arithmetic on
# 5.0/5.2, 2x fp32 on 5.3 and 6.2, 1/64 on 6.1). 6.2: NVIDIA/cccl arch_traits.h@004ad19 (64 KB per SM,
# 48 KB opt-in). 10.3, 12.1: the same file (sm_103 has sm_100's traits, sm_121 has sm_120's).
# Integrated: 5.3 Tegra X1, 6.2 Tegra X2, 7.2 Xavier, 8.7 Orin are SoCs (docs/hardware.md, Jetson).
CAPABILITIES: dict[tuple[int, int], Capability] = {c.cc: c for c in [
    Capability((5, 0), "Maxwell", 48 * _K, 64 * _K, 2048, False, False, False, "GTX 750 Ti, GTX 950M",
               fp16_native=False),
    Capability((5, 2), "Maxwell", 48 * _K, 96 * _K, 2048, False, False, False, "Tesla M40, M60, GTX 9xx",
               fp16_native=False),
    Capability((5, 3), "Maxwell", 48 * _K, 64 * _K, 2048, True, False, False, "Jetson Nano, Jetson TX1",
               integrated=True),
    Capability((6, 0), "Pascal", 48 * _K, 64 * _K, 2048, True, False, False, "P100"),
    Capability((6, 1), "Pascal", 48 * _K, 96 * _K, 2048, False, False, False, "P40, P4, GTX 10xx"),
    Capability((6, 2), "Pascal", 48 * _K, 64 * _K, 2048, True, False, False, "Jetson TX2", integrated=True),
    Capability((7, 0), "Volta", 96 * _K, 96 * _K, 2048, True, True, False, "V100"),
    Capability((7, 2), "Volta", 96 * _K, 96 * _K, 2048, True, True, False, "Jetson AGX Xavier, Xavier NX",
               integrated=True),
    Capability((7, 5), "Turing", 64 * _K, 64 * _K, 1024, True, True, False, "T4, RTX 20xx, GTX 16xx"),
    Capability((8, 0), "Ampere", 163 * _K, 164 * _K, 2048, True, True, True, "A100"),
    Capability((8, 6), "Ampere", 99 * _K, 100 * _K, 1536, True, True, True, "A10, RTX 30xx"),
    Capability((8, 7), "Ampere", 163 * _K, 164 * _K, 1536, True, True, True, "Jetson Orin", integrated=True),
    Capability((8, 9), "Ada", 99 * _K, 100 * _K, 1536, True, True, True, "L4, RTX 40xx"),
    Capability((9, 0), "Hopper", 227 * _K, 228 * _K, 2048, True, True, True, "H100, H200"),
    Capability((10, 0), "Blackwell", 227 * _K, 228 * _K, 2048, True, True, True, "B200"),
    Capability((10, 3), "Blackwell", 227 * _K, 228 * _K, 2048, True, True, True, "B300"),
    Capability((12, 0), "Blackwell", 99 * _K, 100 * _K, 1536, True, True, True, "RTX 50xx"),
    Capability((12, 1), "Blackwell", 99 * _K, 100 * _K, 1536, True, True, True, "GB10 (DGX Spark)"),
]}
MIN_CC = (5, 0)
DEFAULT_SMEM_PER_BLOCK = 48 * _K  # static shared memory limit on every CC (docs/hardware.md, Shared memory)


def _known() -> str:
    return ", ".join(f"{a}.{b}" for a, b in CAPABILITIES)


def capability(cc: tuple[int, int]) -> Capability:
    """The table row for `cc`. Raises SpecError for CCs below 5.0 and for CCs the table does not hold:
    a GPU edgerl does not know is refused rather than planned with another CC's facts."""
    if cc < MIN_CC:
        arch = {1: "Tesla", 2: "Fermi", 3: "Kepler"}.get(cc[0], "pre-Maxwell")
        raise SpecError(
            f"compute capability {cc[0]}.{cc[1]} ({arch}) is below 5.0, which edgerl needs: no PyTorch wheel "
            "built with CUDA 12 or newer has code for it (the last with Kepler code were the cu118 wheels up "
            "to torch 2.7, built for sm_37 only), and SDPA's fused attention backends start at sm_50")
    if cc in CAPABILITIES:
        return CAPABILITIES[cc]
    raise SpecError(f"compute capability {cc[0]}.{cc[1]} is not in edgerl's table ({_known()}); edgerl does not "
                    "guess the shared memory, fp16 and tensor-core facts of a GPU it does not know: add its row "
                    "to CAPABILITIES in edgerl/device.py, with sources")


# GTX 16xx (TU116/TU117), the Quadro/NVIDIA T-series (T400...T2000, T500/T550 laptop parts) and MX450/MX550 are
# sm_75 without tensor cores (docs/hardware.md, GPU names [GTX16]). Word boundaries, never substrings: "Tesla
# T4" has tensor cores and must not match "T4..." rules, nor "T400" match "T4".
_NO_TENSOR_CORES = re.compile(r"\b(?:GTX\s*16[0-9]0|T(?:400|500|550|600|1000|1200|2000)|MX\s*[45]50)\b",
                              re.IGNORECASE)


def turing_without_tensor_cores(name: str) -> bool:
    """Is `name` an sm_75 part without tensor cores? Used for every Device: probed, profiled or specified."""
    return bool(_NO_TENSOR_CORES.search(name))


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
    fp16_native: bool = True                   # false on sm_50/sm_52: no fp16 arithmetic units at all
    integrated: bool = False                   # shares memory with the host (Jetson)
    memory_bandwidth_gbs: Optional[float] = None
    fp32_tflops: Optional[float] = None        # fp32 (CUDA-core) matmul rate from the profile's datasheet row
    fp16_tflops: Optional[float] = None        # 16-bit matmul rate (tensor cores with fp32 accumulation, where present)
    tf32_tflops: Optional[float] = None        # fp32 matmuls on TF32 tensor cores (CC >= 8.0)
    pcie_gen: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_width_max: Optional[int] = None
    utilization_pct: Optional[int] = None
    ecc_enabled: Optional[bool] = None         # NVML's current ECC mode; None when unknown or not applicable
    uuid: Optional[str] = None                 # NVML's GPU UUID (probed devices only)
    measured: Optional[Any] = None             # measurements.Measurements from `edgerl doctor --bench`, if cached
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

    def fp16_speed(self) -> str:
        """fp16 arithmetic speed in words that are true for this CC (docs/hardware.md, Compute capabilities;
        fp16 on Pascal)."""
        if not self.is_cuda:
            return "CPU: half-precision matmuls are slow or unsupported"
        if not self.fp16_native:
            return f"{self.sm}: no native fp16 arithmetic (fp16 is a storage format; math runs in fp32)"
        if not self.fp16_fast:
            return f"{self.sm}: fp16 arithmetic runs at 1/64 of fp32"
        tc = "with fp16 tensor cores" if self.tensor_cores else "without tensor cores"
        return f"{self.sm}: fp16 arithmetic at least as fast as fp32, {tc}"

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
    """A CUDA device whose missing facts come from the capability table. Every Device of a GPU is built
    here (probe, profile, --gpu-spec), so the name rules below hold on every path."""
    row = capability(cc)
    base = dict(smem_per_block_optin=row.smem_per_block_optin, tensor_cores=row.tensor_cores,
                bf16=row.bf16, fp16_fast=row.fp16_fast, fp16_native=row.fp16_native, integrated=row.integrated)
    base.update({k: v for k, v in facts.items() if v is not None})
    if cc == (7, 5) and turing_without_tensor_cores(name):
        base["tensor_cores"] = False
    if base["integrated"]:  # a Jetson's GPU memory is the host's memory: there is nothing to offload to
        host_memory = total_memory
    return Device(kind="cuda", name=name, cc=cc, total_memory=total_memory, host_memory=host_memory,
                  software=software, **base)


# --- the torch build's arch list -----------------------------------------------------------------

_ARCH = re.compile(r"^(sm|compute)_(\d+)([a-z]?)$")


def _arch_cc(n: int) -> tuple[int, int]:
    return (n // 10, n % 10)


def arch_covers(arch_list: tuple[str, ...] | list[str], cc: tuple[int, int]) -> bool:
    """Does a torch build with this arch list have code that runs on `cc`?

    A cubin sm_XY runs on X.z iff z >= Y (same major); PTX compute_XY JIT-compiles forward to any
    later CC (docs/hardware.md, Arch coverage). torch's own `_check_cubins` compares majors only and misjudges V100
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


# --- ad-hoc specs: --gpu-spec cc=6.1,memory=24GiB,name="Quadro P6000" -----------------------------

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
# GB/MB are read as GiB/MiB: nvidia-smi and torch print binary units, and so do GPU datasheets' "24 GB"
_UNITS = {"gib": GiB, "gb": GiB, "g": GiB, "mib": MiB, "mb": MiB, "m": MiB, "kib": 1024, "kb": 1024, "k": 1024}
SPEC_KEYS = ("cc", "memory", "name", "sm_count", "smem", "bandwidth", "tensor_cores", "bf16",
             "host_memory", "integrated")
MIN_MEMORY = GiB  # below this no model edgerl plans for fits, and the planner's fixed costs alone exceed it


def parse_size(text: str, key: str = "memory") -> int:
    """'24GiB', '24 GB', '22919MiB', '48KiB' -> bytes. A bare number is an error: 24 could mean GiB or MiB."""
    example = "48KiB" if key == "smem" else "24GiB or " + key + "=22919MiB"
    m = _SIZE.match(text)
    if not m:
        raise SpecError(f"{key}={text!r} is not a size; write e.g. {key}={example}")
    if not m.group(2):
        raise SpecError(f"{key}={text!r} has no unit; write e.g. {key}={example}")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise SpecError(f"{key}={text!r}: unknown unit {m.group(2)!r}; use GiB, MiB or KiB, e.g. {key}={example}")
    return int(float(m.group(1)) * _UNITS[unit])


def _memory(fields: dict[str, str], key: str) -> int:
    size = parse_size(fields[key], key)
    if size < MIN_MEMORY:
        raise SpecError(f"--gpu-spec: {key}={fields[key]} is below 1 GiB, too little to plan for; give the "
                        f"total as nvidia-smi prints it, e.g. {key}=24GiB or {key}=22919MiB")
    return size


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
    name = fields.get("name") or f"GPU sm_{cc[0]}{cc[1]}"
    facts = {}
    if "sm_count" in fields:
        if not fields["sm_count"].isdigit():
            raise SpecError(f"--gpu-spec: sm_count={fields['sm_count']!r} is not a whole number")
        facts["sm_count"] = int(fields["sm_count"])
    if "smem" in fields:  # bytes, or a size with a unit
        facts["smem_per_block_optin"] = int(fields["smem"]) if fields["smem"].isdigit() \
            else parse_size(fields["smem"], "smem")
    if "bandwidth" in fields:
        try:
            facts["memory_bandwidth_gbs"] = float(fields["bandwidth"].lower().removesuffix("gb/s"))
        except ValueError:
            raise SpecError(f"--gpu-spec: bandwidth={fields['bandwidth']!r}: write GB/s, e.g. 347") from None
    for key in ("tensor_cores", "bf16", "integrated"):
        if key in fields:
            facts[key] = _parse_bool(key, fields[key])
    if facts.get("bf16") and cc < (8, 0):
        raise SpecError(f"--gpu-spec: bf16=true with cc={fields['cc']}: native bf16 starts at CC 8.0")
    if facts.get("tensor_cores") and cc < (7, 0):
        raise SpecError(f"--gpu-spec: tensor_cores=true with cc={fields['cc']}: tensor cores start at CC 7.0")
    if facts.get("tensor_cores") and cc == (7, 5) and turing_without_tensor_cores(name):
        raise SpecError(f"--gpu-spec: tensor_cores=true with name={name!r}: GTX 16xx, the T-series and MX450/550 "
                        "are sm_75 without tensor cores; drop tensor_cores or the name")
    host = _memory(fields, "host_memory") if "host_memory" in fields else host_memory
    dev = gpu_from_capability(name, cc, _memory(fields, "memory"), host, software, **facts)
    return replace(dev, source="spec", note=f"described by --gpu-spec {spec}")
