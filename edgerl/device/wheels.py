"""Which PyTorch wheels have code for a GPU, and the one pip command to give a user.

Everything comes from one table, `BUILDS`: per CUDA build tag and range of torch versions, the
architectures the wheels contain and the oldest driver that runs them. Sources: docs/hardware.md,
PyTorch wheels (pytorch `.ci/manywheel/build_cuda.sh`, pytorch#175253, RFC #178665, PR #182849, RFC
#190355, RFC #190385, FBGEMM PR #5976) and NVIDIA's CUDA minor-version compatibility page for
the driver floors. Pure: no I/O, no torch; `doctor` passes in what the probe found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from edgerl.device.device import arch_covers

PYTORCH_INDEX = "https://download.pytorch.org/whl/"
JETPACK6_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"  # docs/hardware.md, Jetson
Version = tuple[int, int]


@dataclass(frozen=True)
class WheelBuild:
    """One CUDA build of torch over a range of torch versions with the same arch list."""
    tag: str                        # index name under download.pytorch.org/whl/, e.g. "cu126"
    cuda: Version
    first: Optional[Version]        # first torch (major, minor) of the range; None: before the table starts
    last: Optional[Version]         # last torch of the range; None: still built today
    archs: tuple[str, ...]          # as torch.cuda.get_arch_list() prints them
    driver: str                     # oldest driver branch that runs the wheel
    driver_cuda: Version            # ... and the CUDA version that driver reports
    note: str = ""


_CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
_BLACKWELL_128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
_CU130_ARCHS = _BLACKWELL_128 + ("compute_120",)
# Driver floors: CUDA 11.x wheels run on R450+, 12.x on R525+, 13.x on R580+ (minor-version compatibility; [MVC]).
BUILDS: tuple[WheelBuild, ...] = (
    # arch list as of 2.4-2.5 (pytorch/builder build_cuda.sh [BLD24]); cu118 was last built for torch 2.7 ([PTM])
    WheelBuild("cu118", (11, 8), None, (2, 7), ("sm_37",) + _CU126_ARCHS, "R450", (11, 0)),
    WheelBuild("cu126", (12, 6), (2, 6), (2, 14), _CU126_ARCHS, "R525", (12, 0),
               "torch 2.15 removes cu126 (RFC pytorch#190385)"),
    WheelBuild("cu128", (12, 8), (2, 7), (2, 7), _BLACKWELL_128, "R525", (12, 0), "no sm_70 in 2.7 [EUT59]"),
    WheelBuild("cu128", (12, 8), (2, 8), (2, 10), ("sm_70",) + _BLACKWELL_128, "R525", (12, 0)),
    WheelBuild("cu128", (12, 8), (2, 11), (2, 11), _BLACKWELL_128, "R525", (12, 0),
               "2.11 dropped sm_70 (pytorch#175253); 2.12 removed cu128 (PR #182849)"),
    WheelBuild("cu130", (13, 0), (2, 9), None, _CU130_ARCHS, "R580", (13, 0)),
    WheelBuild("cu132", (13, 2), (2, 12), None, _CU130_ARCHS, "R580", (13, 0),
               "arch list UNVERIFIED: taken as cu130's (CUDA 13 cannot target below sm_75)"),
)
# Jetson SoCs (integrated). JetPack 6 (Jetson Linux r36) is the Orin family's release (docs.nvidia.com/jetson,
# r36.x developer guides); the Nano lost support from L4T r34 on (forums.developer.nvidia.com/t/286278).
_JETSON = {(5, 3): "Jetson Nano/TX1", (6, 2): "Jetson TX2", (7, 2): "Jetson Xavier", (8, 7): "Jetson Orin"}


@dataclass(frozen=True)
class WheelAdvice:
    command: Optional[str]          # None: no wheel can be named; `reason` says what to do instead
    reason: str

    def fix(self) -> str:
        """One line for doctor's fix column."""
        return f"{self.command}  ({self.reason})" if self.command else self.reason


def cuda_version(text: Optional[str]) -> Optional[Version]:
    """'12.6' -> (12, 6); None or junk -> None."""
    if not text:
        return None
    parts = text.strip().split(".")
    try:
        return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0)
    except ValueError:
        return None


def _v(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def _sm(cc: Version) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def builds_covering(cc: Version) -> list[WheelBuild]:
    """Every row of BUILDS whose wheels have code that runs on `cc` (the same rule doctor applies)."""
    return [b for b in BUILDS if arch_covers(b.archs, cc)]


def _code_for(b: WheelBuild, cc: Version) -> str:
    """The entry of b.archs that runs on cc: its own cubin, an older cubin of the same major, or PTX."""
    same = [a for a in b.archs if a.startswith("sm_") and arch_covers((a,), cc)]
    return same[-1] if same else next(a for a in b.archs if arch_covers((a,), cc))


@dataclass(frozen=True)
class _Choice:
    """Per build tag: the widest torch range whose wheels have code for one CC."""
    tag: str
    cuda: Version
    first: Optional[Version]        # None: earlier than the table knows
    last: Optional[Version]         # None: still built
    driver: str
    driver_cuda: Version
    code: str


def _choices(cc: Version) -> list[_Choice]:
    rows: dict[str, list[WheelBuild]] = {}
    for b in builds_covering(cc):
        rows.setdefault(b.tag, []).append(b)
    out = []
    for tag, bs in rows.items():
        first = None if any(b.first is None for b in bs) else min(b.first for b in bs)
        last = None if any(b.last is None for b in bs) else max(b.last for b in bs)
        b = bs[-1]
        out.append(_Choice(tag, b.cuda, first, last, b.driver, b.driver_cuda, _code_for(b, cc)))
    return out


def _rank(c: _Choice):
    # newest torch first (still built beats any last version), then the lower CUDA (older drivers run it)
    return ((1, (0, 0)) if c.last is None else (0, c.last), (-c.cuda[0], -c.cuda[1]))


def _command(c: _Choice) -> str:
    pin = "torch" if c.last is None else f"'torch<{c.last[0]}.{c.last[1] + 1}'"
    return f"pip install {pin} --index-url {PYTORCH_INDEX}{c.tag}"


def _range(c: _Choice) -> str:
    if c.last is None:
        return f"torch {_v(c.first)} and later"
    return f"torch up to {_v(c.last)}" if c.first is None else f"torch {_v(c.first)}-{_v(c.last)}"


def _driver(c: _Choice, gpu_floor: Version) -> str:
    if gpu_floor > c.driver_cuda:  # the GPU, not the wheel, sets the floor
        return f"a driver reporting CUDA {_v(gpu_floor)}+"
    return f"driver {c.driver}+"


def wheel_advice(cc: Version, driver_cuda: Optional[str] = None, *, integrated: bool = False,
                 machine: str = "x86_64") -> WheelAdvice:
    """The pip command that installs a torch with code for `cc`, and why (every clause from BUILDS).

    driver_cuda: the CUDA version the driver reports (NVML, nvidia-smi); None when unknown. integrated,
    machine: a Jetson (integrated, aarch64) is sent to JetPack's index, not download.pytorch.org. An unknown
    driver is taken to run CUDA 12 wheels (R525+) but not CUDA 13 ones (R580+), except on Blackwell,
    where only CUDA 12.8+ builds have code at all; the reason names the other choice."""
    sm = _sm(cc)
    aarch64 = machine.lower() in ("aarch64", "arm64")
    # these CCs exist only as Tegra SoCs, so on an aarch64 host they are a Jetson even when only NVML saw them
    if cc in _JETSON and (integrated or aarch64):
        if cc == (8, 7):
            return WheelAdvice(f"pip install torch --index-url {JETPACK6_INDEX}",
                               f"{_JETSON[cc]} ({sm}, integrated) takes JetPack 6 wheels from NVIDIA's Jetson "
                               "index, not download.pytorch.org, whose aarch64 builds are for servers")
        return WheelAdvice(None, f"{_JETSON[cc]} ({sm}): the JetPack 6 index ({JETPACK6_INDEX}) serves Orin only; "
                                 "install the torch wheel NVIDIA publishes for this board's JetPack release")
    if aarch64 and cc < (8, 0):
        return WheelAdvice(None, f"{sm} on aarch64: download.pytorch.org's aarch64 CUDA wheels are built for "
                                 "CC 8.0 and newer, so none has code for this GPU")
    choices = _choices(cc)
    if cc < (5, 0):
        have = "; ".join(f"{c.tag} ({_range(c)})" for c in choices) or "none in edgerl's table"
        return WheelAdvice(None, f"{sm}: edgerl needs CC 5.0 or newer, and no wheel built with CUDA 12 or newer "
                                 f"has code for {sm} (wheels that do: {have})")
    if not choices:
        return WheelAdvice(None, f"{sm}: no download.pytorch.org build in edgerl's table has code for it")
    drv = cuda_version(driver_cuda)
    # A driver older than the first CUDA that knows a Blackwell GPU cannot drive it; minor-version
    # compatibility does not help there (sm_100/sm_120 code first appears in the CUDA 12.8 builds).
    blackwell = cc >= (10, 0)
    gpu_floor = min(c.cuda for c in choices) if blackwell else (0, 0)

    def runnable(at: Version) -> list[_Choice]:
        return [c for c in choices if at >= c.driver_cuda and at >= gpu_floor]

    newest = max(choices, key=_rank)
    if drv is not None and not runnable(drv):
        need = gpu_floor if blackwell else min(c.driver_cuda for c in choices)
        return WheelAdvice(None, f"the driver reports CUDA {driver_cuda}; every wheel with {sm} code needs one "
                                 f"reporting CUDA {_v(need)} or newer: upgrade the driver to {newest.driver} or "
                                 f"newer, then: {_command(newest)}")
    assumed = drv if drv is not None else ((13, 0) if blackwell else (12, 0))
    best = max(runnable(assumed), key=_rank)
    code = "its own code" if best.code == sm else f"the {best.code} code"
    parts = [f"{sm} runs {code} in the {best.tag} wheels ({_range(best)}, {_driver(best, gpu_floor)})"]
    if best.last is not None:
        parts.append(f"the last {best.tag} wheels with that code are torch {_v(best.last)}, hence the pin")
    better = [c for c in choices if _rank(c) > _rank(best)]
    if better:
        c = min(better, key=lambda c: c.driver_cuda)
        if drv is None:
            parts.append(f"with driver {c.driver}+ (CUDA {_v(c.driver_cuda)}), {_command(c)} gives {_range(c)}")
        else:
            parts.append(f"{c.tag} needs driver {c.driver}+ (CUDA {_v(c.driver_cuda)}); this one reports "
                         f"{driver_cuda}")
    elif drv is None and blackwell:
        low = runnable(gpu_floor)
        if low:
            alt = max(low, key=_rank)
            parts.append(f"with a driver reporting CUDA {_v(gpu_floor)}-{_v((best.driver_cuda[0] - 1, 9))} "
                         f"instead: {_command(alt)}")
    missing = sorted({b.tag for b in BUILDS} - {c.tag for c in choices} - {"cu118"})
    if missing and best.last is not None:
        parts.append(f"{', '.join(missing)} wheels have no {sm} code")
    return WheelAdvice(_command(best), "; ".join(parts))


__all__ = ["BUILDS", "JETPACK6_INDEX", "PYTORCH_INDEX", "WheelAdvice", "WheelBuild", "builds_covering",
           "cuda_version", "wheel_advice"]
