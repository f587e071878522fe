"""GPU profiles: data files (`profiles/*.toml`, installed as `edgerl.profile_data`) describing GPUs
you may not have, so that `recommend --gpu p40` and `train --profile p40` can plan for them.

Each file holds the hardware facts with their sources in comments, plan overrides known to work
(`[defaults]`), and which facts were measured on a real card and which were derived.
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Optional

from .errors import ProfileError
from .device import GiB, Device, Software, capability, cpu_device, gpu_from_capability

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib




@dataclass(frozen=True)
class Profile:
    name: str
    display: str
    kind: str                                   # "cuda" or "cpu"
    cc: Optional[tuple[int, int]]
    memory_bytes: int
    aliases: tuple[str, ...] = ()
    match: tuple[str, ...] = ()                 # substrings of NVML/torch device names
    sm_count: Optional[int] = None
    smem_per_block_optin: Optional[int] = None
    memory_bandwidth_gbs: Optional[float] = None
    fp32_tflops: Optional[float] = None
    tensor_cores: Optional[bool] = None         # None: from the capability table
    integrated: bool = False
    pcie_gen: Optional[int] = None
    pcie_width: Optional[int] = None
    defaults: dict[str, Any] = field(default_factory=dict)   # plan overrides known to work
    measured: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    notes: str = ""

    def summary(self) -> str:
        if self.kind == "cpu":
            return "the CPU (host RAM as memory)"
        cc = f"sm_{self.cc[0]}{self.cc[1]}"
        return f"{self.display}: {cc}, {self.memory_bytes / GiB:.0f} GiB"


def _norm(s: str) -> str:
    s = s.lower()
    for word in ("nvidia", "tesla", "geforce", "quadro"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


def _parse(name: str, text: str) -> Profile:
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"profile {name}.toml is not valid TOML: {e}") from None
    try:
        hw = d.get("hardware", {})
        kind = d.get("kind", "cuda")
        cc = None
        if kind == "cuda":
            major, minor = (int(x) for x in str(hw["cc"]).split("."))
            cc = (major, minor)
            capability(cc)
        memory = int(float(hw["memory_gib"]) * GiB) if "memory_gib" in hw else 0
        prov = d.get("provenance", {})
        return Profile(
            name=d["name"], display=d.get("display", d["name"]), kind=kind, cc=cc, memory_bytes=memory,
            aliases=tuple(d.get("aliases", ())), match=tuple(d.get("match", ())),
            sm_count=hw.get("sm_count"), smem_per_block_optin=hw.get("smem_per_block_optin"),
            memory_bandwidth_gbs=hw.get("memory_bandwidth_gbs"), fp32_tflops=hw.get("fp32_tflops"),
            tensor_cores=hw.get("tensor_cores"), integrated=bool(hw.get("integrated", False)),
            pcie_gen=hw.get("pcie_gen"), pcie_width=hw.get("pcie_width"),
            defaults=dict(d.get("defaults", {})), measured=tuple(prov.get("measured", ())),
            derived=tuple(prov.get("derived", ())), notes=d.get("notes", ""))
    except (KeyError, ValueError) as e:
        raise ProfileError(f"profile {name}.toml is malformed: {e}") from None


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
    """A profile by name or alias ('p40', 'Tesla P40', '3090'); an unknown name lists close ones."""
    key = _norm(name)
    for p in _all():
        if key == _norm(p.name) or key in (_norm(a) for a in p.aliases):
            return p
    names = [p.name for p in _all()]
    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ProfileError(f"unknown GPU {name!r}.{hint} Known profiles: {', '.join(names)}. "
                       "For another GPU use --gpu-spec cc=6.1,memory=24GiB,name=\"...\"")


def match_profile(dev: Device) -> Optional[Profile]:
    """The profile for a probed device: same capability, a name match, the nearest memory size."""
    if not dev.is_cuda:
        return get_profile("cpu")
    name = _norm(dev.name)
    candidates = [p for p in _all() if p.kind == "cuda" and p.cc == dev.cc
                  and any(_norm(m) in name for m in p.match)]
    if not candidates:
        return None
    return min(candidates, key=lambda p: abs(p.memory_bytes - dev.total_memory))


def device_from_profile(p: Profile, software: Software, host_memory: int) -> Device:
    """The Device a profile describes, with this machine's software and host RAM."""
    if p.kind == "cpu":
        return replace(cpu_device(host_memory, software, "planned for the CPU (profile cpu)"),
                       source="profile")
    dev = gpu_from_capability(
        p.display, p.cc, p.memory_bytes, host_memory, software, sm_count=p.sm_count,
        smem_per_block_optin=p.smem_per_block_optin, tensor_cores=p.tensor_cores,
        memory_bandwidth_gbs=p.memory_bandwidth_gbs, integrated=p.integrated,
        pcie_gen=p.pcie_gen, pcie_gen_max=p.pcie_gen, pcie_width=p.pcie_width, pcie_width_max=p.pcie_width)
    if p.integrated:  # Jetson: GPU memory is the host's memory
        dev = replace(dev, host_memory=p.memory_bytes)
    return replace(dev, source="profile", profile=p.name, note=f"profile {p.name}: {p.summary()}")
