"""`edgerl doctor`: is this machine ready, and if not, exactly what to fix.

Each check is a small function of the probe (or a simulated device) returning a `Check` with a
status (ok / warn / fail / skip), what was found, and the fix. Only the folder and disk checks
touch the machine, and they do it through `Environment` so tests can fake them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from edgerl.device.device import GiB, Device, arch_covers
from edgerl.plan.memory import fmt_bytes
from edgerl.plan.plan import Plan
from edgerl.device.probe import NvmlReport, ProbeResult
from edgerl.doctor.check import STATUSES, Check, _c  # noqa: F401  (Check is part of doctor's API)
from edgerl.doctor.plan_checks import plan_checks
from edgerl.device.wheels import wheel_advice

@dataclass
class Environment:
    """What the folder checks read: environment variables and writable, roomy folders."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    run_dir: str = "runs"

    def which(self, program: str) -> Optional[str]:
        """The program's path on this environment's PATH (as shutil.which finds it), or None."""
        return shutil.which(program, path=self.env.get("PATH"))

    def folder_state(self, path: Path) -> tuple[bool, Optional[int], str]:
        """(writable, free bytes, note) for `path` or its nearest existing parent."""
        probe_dir = path
        while not probe_dir.exists() and probe_dir != probe_dir.parent:
            probe_dir = probe_dir.parent
        try:
            free = shutil.disk_usage(probe_dir).free
        except OSError:
            free = None
        try:
            with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".edgerl-doctor-"):
                pass
            return True, free, "" if probe_dir == path else f"(does not exist yet; {probe_dir} is writable)"
        except OSError as e:
            return False, free, f"({probe_dir}: {e.strerror})"


def check_driver(nvml: NvmlReport, simulated: bool) -> Check:
    if simulated:
        return _c("driver and NVML", "skip", "simulated GPU: this machine's driver is not checked")
    if not nvml.ok:  # a machine without a GPU is a valid (slow) place to train: warn, do not fail
        return _c("driver and NVML", "warn", f"{nvml.reason}; edgerl trains on the CPU",
                  "if this machine has an NVIDIA GPU: install its driver (nvidia-smi must work) and "
                  "`pip install nvidia-ml-py`")
    gpus = "; ".join(f"{g.index}: {g.name} (sm_{g.cc[0]}{g.cc[1]}, {g.total / GiB:.1f} GiB)" for g in nvml.gpus)
    return _c("driver and NVML", "ok", f"driver {nvml.driver_version} (CUDA {nvml.cuda_driver}); {gpus or 'no GPU'}")


def check_torch_cuda(dev: Device, probe: ProbeResult, simulated: bool) -> Check:
    sw = dev.software
    if sw.torch is None:
        return _c("torch sees CUDA", "fail", "torch is not installed",
                  _wheel(dev, dev.cc, dev.cuda_driver).fix() if dev.is_cuda else "pip install torch")
    if simulated:
        if sw.torch_cuda is None:
            return _c("torch sees CUDA", "fail", f"torch {sw.torch} here is a CPU-only build; on the {dev.name} "
                      "it would not see the GPU", _wheel(dev, dev.cc, None).fix())
        return _c("torch sees CUDA", "skip", f"torch {sw.torch} with CUDA {sw.torch_cuda}; simulated GPU")
    if probe.cuda_available:
        return _c("torch sees CUDA", "ok", f"torch {sw.torch} (CUDA {sw.torch_cuda}) sees "
                  f"{len(probe.devices)} GPU(s): " + ", ".join(d.describe() for d in probe.devices))
    if not probe.nvml.ok:
        return _c("torch sees CUDA", "skip", f"no usable NVIDIA GPU ({dev.note}); edgerl runs on the CPU")
    g = probe.nvml.gpus[0] if probe.nvml.gpus else None
    cmd = _wheel(dev, g.cc, probe.nvml.cuda_driver).fix() if g else "pip install torch"
    return _c("torch sees CUDA", "fail", dev.note, cmd)


def check_arch(dev: Device, probe: ProbeResult) -> Check:
    name = "torch build covers this GPU"
    cc, drv = _target_cc(dev, probe)
    if cc is None:
        return _c(name, "skip", "no GPU")
    arch = dev.software.arch_list
    if dev.software.torch_cuda is None:
        return _c(name, "fail", f"CPU-only torch {dev.software.torch}: no CUDA kernels at all",
                  _wheel(dev, cc, drv).fix())
    if not arch:
        return _c(name, "warn", "torch reports no arch list (no GPU visible to it)")
    if arch_covers(arch, cc):
        return _c(name, "ok", f"sm_{cc[0]}{cc[1]} is covered by {' '.join(arch)}")
    return _c(name, "fail", f"sm_{cc[0]}{cc[1]} is not in this torch build ({' '.join(arch)}): every kernel "
              "launch fails with 'no kernel image is available for execution on the device'",
              _wheel(dev, cc, drv).fix())


def _wheel(dev: Device, cc: tuple[int, int], driver_cuda: Optional[str]):
    return wheel_advice(cc, driver_cuda, integrated=dev.integrated, machine=dev.software.machine or "x86_64")


def _target_cc(dev: Device, probe: ProbeResult) -> tuple[Optional[tuple[int, int]], Optional[str]]:
    if dev.is_cuda:
        return dev.cc, dev.cuda_driver
    if probe.nvml.ok and probe.nvml.gpus:
        return probe.nvml.gpus[0].cc, probe.nvml.cuda_driver
    return None, None


def check_runtime_vs_driver(dev: Device, probe: ProbeResult, simulated: bool) -> Check:
    name = "CUDA runtime vs driver"
    tcuda, drv = dev.software.torch_cuda, (None if simulated else probe.nvml.cuda_driver)
    if tcuda is None or drv is None:
        return _c(name, "skip", "needs a CUDA torch and a driver" + (" (simulated GPU)" if simulated else ""))
    t = tuple(int(x) for x in tcuda.split(".")[:2])
    d = tuple(int(x) for x in drv.split(".")[:2])
    if t[0] > d[0]:  # no compatibility across major versions
        return _c(name, "fail", f"torch is built for CUDA {tcuda}; the driver supports up to {drv}",
                  f"upgrade the driver, or install a torch wheel for CUDA <= {drv}")
    if t > d:  # CUDA minor-version compatibility covers cubins, not PTX JIT
        return _c(name, "warn", f"torch CUDA {tcuda} is newer than the driver's {drv}; minor-version "
                  "compatibility runs prebuilt kernels but not PTX compiled at load time",
                  "upgrade the driver if kernels fail to load")
    return _c(name, "ok", f"torch CUDA {tcuda} <= driver CUDA {drv}")


def check_folders(env: Environment) -> list[Check]:
    out = []
    hf_home = Path(env.env.get("HF_HOME") or Path(env.env.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface")
    for label, path in (("HF cache (HF_HOME)", hf_home), ("run folder", Path(env.run_dir))):
        writable, free, note = env.folder_state(path.expanduser())
        if not writable:
            out.append(_c(f"{label} writable", "fail", f"{path} is not writable {note}",
                          f"fix permissions or point it elsewhere ({'HF_HOME=...' if 'HF' in label else '--set run.out_dir=...'})"))
            continue
        if free is not None and free < 10 * GiB:
            out.append(_c(f"{label} writable", "warn", f"{path}: only {fmt_bytes(free)} free {note}",
                          "checkpoints and model downloads need several GiB"))
        else:
            out.append(_c(f"{label} writable", "ok", f"{path}: {fmt_bytes(free)} free {note}".strip()))
    return out


def check_pcie(dev: Device, simulated: bool) -> Check:
    if not dev.is_cuda or simulated or dev.pcie_gen is None:
        return _c("PCIe link", "skip", "not reported" if dev.is_cuda and not simulated else "no PCIe link to read")
    detail = f"gen {dev.pcie_gen} x{dev.pcie_width} (max gen {dev.pcie_gen_max} x{dev.pcie_width_max})"
    if dev.pcie_width and dev.pcie_width_max and dev.pcie_width < dev.pcie_width_max:
        return _c("PCIe link", "warn", f"{detail}: running narrower than the card allows; offload and weight "
                  "sync will be slower", "move the card to a full x16 slot, or check riser cables")
    if dev.pcie_gen and dev.pcie_gen_max and dev.pcie_gen < dev.pcie_gen_max:
        return _c("PCIe link", "warn", f"{detail}: below its maximum generation (GPUs drop the link speed when "
                  "idle; this matters only if it stays low under load)", "re-check under load: nvidia-smi -q -d PCIE")
    return _c("PCIe link", "ok", detail)


def check_allocator(dev: Device, env: Environment, plan: Optional[Plan]) -> Check:
    cur = env.env.get("PYTORCH_CUDA_ALLOC_CONF") or env.env.get("PYTORCH_ALLOC_CONF")
    want = dict(plan.env).get("PYTORCH_CUDA_ALLOC_CONF") if plan else None
    if not dev.is_cuda:
        return _c("allocator settings", "skip", "CPU")
    if cur and want and want not in cur:
        return _c("allocator settings", "warn", f"PYTORCH_CUDA_ALLOC_CONF={cur}; the plan wants {want}",
                  f"unset it or add {want}; edgerl train sets the plan's value only when the variable is unset")
    return _c("allocator settings", "ok", f"PYTORCH_CUDA_ALLOC_CONF={cur or '(unset)'}; edgerl train sets "
              f"{want or 'nothing'} when unset")


def check_memory_in_use(dev: Device, simulated: bool) -> Check:
    if not dev.is_cuda or simulated or dev.free_memory is None:
        return _c("GPU memory free", "skip", "not measured")
    used = dev.total_memory - dev.free_memory
    if used > 0.1 * dev.total_memory:
        return _c("GPU memory free", "warn", f"{fmt_bytes(used)} of {fmt_bytes(dev.total_memory)} already in use "
                  f"(utilisation {dev.utilization_pct}%)", "stop other processes on this GPU (nvidia-smi lists them)")
    return _c("GPU memory free", "ok", f"{fmt_bytes(dev.free_memory)} of {fmt_bytes(dev.total_memory)} free")


def check_gpus(probe: ProbeResult, simulated: bool) -> Optional[Check]:
    """Every GPU torch sees, and whether each pair can reach the other's memory directly (peer to peer);
    only for several GPUs."""
    if simulated or len(probe.devices) < 2 or not probe.cuda_available:
        return None
    names = "; ".join(f"{d.index}: {d.describe()}" for d in probe.devices)
    if not probe.peer_access:
        return _c("GPUs and peer access", "ok", f"{names}; peer access not reported")
    blocked = [f"{i}->{j}" for i, j, ok in probe.peer_access if not ok]
    if blocked:
        return _c("GPUs and peer access", "warn", f"{names}; no peer access for {', '.join(blocked)}: NCCL goes "
                  "through host memory between them (slower all-gathers under FSDP2)",
                  "check nvidia-smi topo -m; an IOMMU or PCIe ACS setting can block peer-to-peer")
    return _c("GPUs and peer access", "ok", f"{names}; every pair has peer access")


def check_c_compiler(dev: Device, env: Environment, plan: Optional[Plan]) -> Optional[Check]:
    """Triton builds a small C launcher for each kernel the first time it runs, with $CC or else gcc or
    clang (triton/runtime/build.py), and so does torch.compile through Triton: without a compiler the
    plan's first Triton kernel stops the run ("Failed to find C compiler"). Only where the plan uses one."""
    if plan is None or not dev.is_cuda:
        return None
    uses = []
    if plan.kernel_backend == "triton":
        uses.append("the fused log-prob kernel" + (" and the bf16 AdamW step" if plan.optimizer.startswith("adamw-bf16")
                                                   else ""))
    if plan.decode_backend in ("triton-attention", "triton-layers"):
        uses.append("the decode-attention kernel" + (" and the decode layers' projections"
                                                      if plan.decode_backend == "triton-layers" else ""))
    if not uses:
        return None
    cc = env.env.get("CC")
    found = env.which(cc) if cc else (env.which("gcc") or env.which("clang"))
    if found:
        return _c("C compiler", "ok", f"{found}: Triton builds its kernels' launchers with it ({' and '.join(uses)})")
    missing = f"CC={cc} is not found" if cc else "no gcc or clang on PATH"
    return _c("C compiler", "fail", f"{missing}; Triton builds each kernel's launcher with one the first time it runs, "
              f"so {' and '.join(uses)} would stop the run at its first step",
              "install gcc (apt install gcc, dnf install gcc) or set CC to a C compiler; or run without Triton: "
              "--set plan.kernel_backend=torch --set plan.decode_backend=torch")


def run_checks(dev: Device, probe: ProbeResult, plan: Optional[Plan], env: Optional[Environment] = None,
               simulated: bool = False) -> list[Check]:
    env = env or Environment()
    checks: list[Optional[Check]] = [
        check_driver(probe.nvml, simulated),
        check_torch_cuda(dev, probe, simulated),
        check_arch(dev, probe),
        check_runtime_vs_driver(dev, probe, simulated),
        check_gpus(probe, simulated),
        *plan_checks(dev, plan, simulated),
        check_c_compiler(dev, env, plan),
        *check_folders(env),
        check_pcie(dev, simulated),
        check_allocator(dev, env, plan),
        check_memory_in_use(dev, simulated),
    ]
    return [c for c in checks if c is not None]


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


__all__ = ["Check", "Environment", "run_checks", "exit_code"]
