"""GPU profiles: data files (`edgerl/profile_data/*.toml`) describing GPUs
you may not have, so that `recommend --gpu p40` and `train --profile p40` can plan for them.

Each file holds the hardware facts with their sources in comments, plan overrides known to work
(`[defaults]`), and which facts were measured on a real card and which were derived.

`memory_mib` is the card's total as NVML / `nvidia-smi` prints it under its default ECC setting:
not the datasheet's "24 GB". Where drivers print different totals (newer ones print the full size
and report the driver's reservation separately), the profile keeps the smallest public figure,
which is the closest to what torch can allocate (docs/hardware.md, Usable memory).
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Optional

from edgerl.core.errors import ProfileError
from edgerl.device.device import GiB, MiB, Device, Software, capability, cpu_device, gpu_from_capability

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A probed GPU matches a profile only if its name is one of the profile's NVML names and its memory is
# within this fraction of the profile's: one name ("Orin") covers modules from 8 to 64 GB, and turning
# ECC off adds 1/15 (P40: 22919 -> 24451 MiB).
MEMORY_MATCH_TOLERANCE = 0.10


@dataclass(frozen=True)
class Profile:
    name: str
    display: str
    kind: str                                   # "cuda" or "cpu"
    cc: Optional[tuple[int, int]]
    memory_mib: int                             # NVML total under the default ECC setting; 0 for the CPU
    aliases: tuple[str, ...] = ()
    nvml_names: tuple[str, ...] = ()            # exact NVML/torch device names ("NVIDIA " prefix optional)
    ecc_default: bool = False                   # ECC is on out of the box (Tesla / data-centre cards)
    ecc_off_mib: Optional[int] = None           # NVML total after `nvidia-smi -e 0` and a reboot, when known
    sm_count: Optional[int] = None
    smem_per_block_optin: Optional[int] = None
    memory_bandwidth_gbs: Optional[float] = None
    fp32_tflops: Optional[float] = None
    fp16_tflops: Optional[float] = None          # 16-bit matmuls (tensor cores with fp32 accumulation, where present)
    tf32_tflops: Optional[float] = None          # fp32 matmuls on TF32 tensor cores (CC >= 8.0)
    tensor_cores: Optional[bool] = None         # None: from the capability table
    integrated: bool = False
    pcie_gen: Optional[int] = None
    pcie_width: Optional[int] = None
    defaults: dict[str, Any] = field(default_factory=dict)   # plan overrides known to work
    measured: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    notes: str = ""

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MiB

    @property
    def ecc_off_gain_bytes(self) -> Optional[int]:
        """Memory that turning ECC off gives back; None when unknown or ECC is off by default."""
        if not self.ecc_default or self.ecc_off_mib is None:
            return None
        return (self.ecc_off_mib - self.memory_mib) * MiB

    def summary(self) -> str:
        if self.kind == "cpu":
            return "the CPU (host RAM as memory)"
        cc = f"sm_{self.cc[0]}{self.cc[1]}"
        return f"{self.display}: {cc}, {self.memory_bytes / GiB:.1f} GiB"


def _norm(s: str) -> str:
    """Loose form for names a user types (--gpu "Tesla P40", p40, 3090); compared whole, never as substrings."""
    s = s.lower()
    for word in ("nvidia", "tesla", "geforce", "quadro"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


def nvml_key(name: str) -> str:
    """A device name as NVML or torch prints it, made comparable across drivers: drivers from about R465 on
    prefix GeForce names with "NVIDIA " ("GeForce RTX 3090" -> "NVIDIA GeForce RTX 3090")."""
    s = " ".join(name.lower().split())
    return s.removeprefix("nvidia ")


_HW_KEYS = {"cc", "memory_mib", "ecc_default", "ecc_off_mib", "sm_count", "smem_per_block_optin",
            "memory_bandwidth_gbs", "fp32_tflops", "fp16_tflops", "tf32_tflops", "tensor_cores", "integrated", "pcie_gen", "pcie_width"}


def _parse(name: str, text: str) -> Profile:
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"profile {name}.toml is not valid TOML: {e}") from None
    try:
        hw = d.get("hardware", {})
        unknown = set(hw) - _HW_KEYS
        if unknown:
            close = difflib.get_close_matches(sorted(unknown)[0], _HW_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ProfileError(f"profile {name}.toml: unknown [hardware] key {sorted(unknown)[0]!r}{hint}")
        kind = d.get("kind", "cuda")
        cc = None
        memory = 0
        if kind == "cuda":
            major, minor = (int(x) for x in str(hw["cc"]).split("."))
            cc = (major, minor)
            capability(cc)
            memory = hw["memory_mib"]
            if not isinstance(memory, int) or memory < 1024:
                raise ProfileError(f"profile {name}.toml: memory_mib={memory!r} must be a whole number of MiB "
                                   "(the NVML total, e.g. memory_mib = 22919)")
        ecc_off = hw.get("ecc_off_mib")
        if ecc_off is not None and not hw.get("ecc_default", False):
            raise ProfileError(f"profile {name}.toml: ecc_off_mib is set but ecc_default is not true; "
                               "ecc_off_mib only means something for cards that ship with ECC on")
        prov = d.get("provenance", {})
        return Profile(
            name=d["name"], display=d.get("display", d["name"]), kind=kind, cc=cc, memory_mib=memory,
            aliases=tuple(d.get("aliases", ())), nvml_names=tuple(d.get("nvml_names", ())),
            ecc_default=bool(hw.get("ecc_default", False)), ecc_off_mib=ecc_off,
            sm_count=hw.get("sm_count"), smem_per_block_optin=hw.get("smem_per_block_optin"),
            memory_bandwidth_gbs=hw.get("memory_bandwidth_gbs"), fp32_tflops=hw.get("fp32_tflops"),
            fp16_tflops=hw.get("fp16_tflops"), tf32_tflops=hw.get("tf32_tflops"), tensor_cores=hw.get("tensor_cores"), integrated=bool(hw.get("integrated", False)),
            pcie_gen=hw.get("pcie_gen"), pcie_width=hw.get("pcie_width"),
            defaults=dict(d.get("defaults", {})), measured=tuple(prov.get("measured", ())),
            derived=tuple(prov.get("derived", ())), notes=d.get("notes", ""))
    except (KeyError, ValueError) as e:
        if isinstance(e, ProfileError):
            raise
        raise ProfileError(f"profile {name}.toml is malformed: missing or bad {e}") from None


@lru_cache(maxsize=1)
def _all() -> tuple[Profile, ...]:
    root = importlib.resources.files("edgerl.profile_data")
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            p = _parse(entry.name[:-5], entry.read_text())
            if p.name != entry.name[:-5]:
                raise ProfileError(f"profile {entry.name} declares name={p.name!r}; they must agree")
            out.append(p)
    if not out:
        raise ProfileError("no profiles found in edgerl.profile_data; the package is missing its data files")
    return tuple(out)


def list_profiles() -> tuple[Profile, ...]:
    return _all()


def get_profile(name: str) -> Profile:
    """A profile by name, display name or alias ('p40', 'Tesla P40', '3090'); an unknown name lists close ones."""
    key = _norm(name)
    for p in _all():
        if key in {_norm(p.name), _norm(p.display), *(_norm(a) for a in p.aliases)}:
            return p
    names = [p.name for p in _all()]
    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ProfileError(f"unknown GPU {name!r}.{hint} Known profiles: {', '.join(names)}. "
                       "For another GPU use --gpu-spec cc=6.1,memory=24GiB,name=\"...\"")


def match_profile(dev: Device) -> Optional[Profile]:
    """The profile of a probed device: an exact NVML name, the same capability, and a memory total within
    MEMORY_MATCH_TOLERANCE of the profile's. Never a substring: "L4" is not "L40S", "T4" is not "T400"."""
    if not dev.is_cuda:
        return get_profile("cpu")
    key = nvml_key(dev.name)
    candidates = [p for p in _all() if p.kind == "cuda" and p.cc == dev.cc
                  and key in {nvml_key(n) for n in p.nvml_names}
                  and abs(dev.total_memory - p.memory_bytes) <= MEMORY_MATCH_TOLERANCE * p.memory_bytes]
    if not candidates:
        return None
    return min(candidates, key=lambda p: abs(p.memory_bytes - dev.total_memory))


def device_from_profile(p: Profile, software: Software, host_memory: int) -> Device:
    """The Device a profile describes, with this machine's software and host RAM (a Jetson's is its memory)."""
    if p.kind == "cpu":
        return replace(cpu_device(host_memory, software, "planned for the CPU (profile cpu)"),
                       source="profile")
    dev = gpu_from_capability(
        p.display, p.cc, p.memory_bytes, host_memory, software, sm_count=p.sm_count,
        smem_per_block_optin=p.smem_per_block_optin, tensor_cores=p.tensor_cores,
        memory_bandwidth_gbs=p.memory_bandwidth_gbs, fp32_tflops=p.fp32_tflops, fp16_tflops=p.fp16_tflops,
        tf32_tflops=p.tf32_tflops, integrated=p.integrated or None,
        pcie_gen=p.pcie_gen, pcie_gen_max=p.pcie_gen, pcie_width=p.pcie_width, pcie_width_max=p.pcie_width)
    return replace(dev, source="profile", profile=p.name, note=f"profile {p.name}: {p.summary()}")
