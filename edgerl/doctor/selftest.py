"""`edgerl doctor --selftest`: is edgerl right on this GPU, for the plan this machine's task would get?

In about two minutes on a GPU: every kernel the plan launches, compiled here and checked against its
torch reference at the plan's dtype and the model's widths (`kernel_checks`); the model checks the
caller passes in (`edgerl.train.selftest_model`: the rollout engine against HF's forward, two training
steps against the plan's reference path, their time and memory against the plan's memory model); and
this GPU's matmul and copy speeds (`edgerl.device.measure`). Each check gets a verdict: pass, fail with
the setting that avoids the failing part, or skip with the reason. The report is a JSON file and a block
of text to paste into a bug report; neither holds a path of this machine or its host name.
"""

from __future__ import annotations

import getpass
import os
import platform
import re
import socket
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.doctor.verdict import Verdict
from edgerl.plan.plan import Plan

ModelChecks = Callable[[Plan, Any], list[Verdict]]


@dataclass
class SelfTest:
    environment: dict[str, Any]
    plan: dict[str, Any]
    verdicts: list[Verdict] = field(default_factory=list)
    seconds: float = 0.0
    date: str = ""

    @property
    def ok(self) -> bool:
        return not any(v.status == "fail" for v in self.verdicts)

    def counts(self) -> dict[str, int]:
        return {s: sum(v.status == s for v in self.verdicts) for s in ("pass", "fail", "skip")}

    def to_dict(self) -> dict[str, Any]:
        return scrub({"edgerl_selftest": 1, "date": self.date, "ok": self.ok, "counts": self.counts(),
                      "seconds": round(self.seconds, 1), "environment": self.environment, "plan": self.plan,
                      "checks": [v.to_dict() for v in self.verdicts]})

    def report_text(self) -> str:
        """The block a user pastes into a bug report: the machine, the plan, each check's line."""
        e = self.environment
        c = self.counts()
        lines = ["edgerl doctor --selftest", f"date: {self.date}; {c['pass']} passed, {c['fail']} failed, "
                 f"{c['skip']} skipped in {self.seconds:.0f} s"]
        lines += [f"{k}: {v}" for k, v in e.items()]
        lines.append("plan: " + ", ".join(f"{k}={v}" for k, v in self.plan.items()))
        lines += [scrub(v.line()) for v in self.verdicts]
        return "\n".join(lines)


def environment(plan: Plan, device: Any, emulation: str = "") -> dict[str, Any]:
    """The machine as a bug report needs it: GPU, driver, CUDA, torch and library versions, compute
    capability, ECC, memory; the profile emulated, if any. No paths, user or host names."""
    import torch
    from edgerl.core import VERSION
    from edgerl.device.probe import probe
    out: dict[str, Any] = {"edgerl": VERSION, "python": platform.python_version(),
                           "os": f"{platform.system()} {platform.machine()}", "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda}
    for lib in ("triton", "transformers", "peft", "bitsandbytes"):
        out[lib] = _version(lib)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out["gpu"] = p.name
        out["compute_capability"] = f"{p.major}.{p.minor}"
        out["gpu_memory_gib"] = round(p.total_memory / 2**30, 2)
        out["sm_count"] = p.multi_processor_count
        found = probe()
        nvml = found.nvml
        out["driver"] = nvml.driver_version if nvml.ok else None
        out["driver_cuda"] = nvml.cuda_driver if nvml.ok else None
        gpus = [g for g in found.devices if g.index == (device.index or 0)] if nvml.ok else []
        out["ecc"] = gpus[0].ecc_enabled if gpus else None
    else:
        out["gpu"] = None
    if emulation:
        out["emulated_profile"] = plan.device.profile or plan.device.name
        out["emulation"] = emulation
    return out


def _version(lib: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(lib)
    except PackageNotFoundError:
        return None


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The plan's decisions that pick code paths, and the model's shape (not its folder)."""
    from edgerl.plan.modelspec import ALIASES, CATALOGUE
    m = plan.model
    known = m.name.lower() in CATALOGUE or m.name.lower() in ALIASES
    return {"device": plan.device.describe(), "model": m.name if known else f"(a local {m.model_type})",
            "model_shape": f"{m.model_type}, hidden {m.hidden_size}, {m.num_heads}/{m.num_kv_heads} heads of "
                           f"{m.hd}, MLP {m.intermediate_size}, vocabulary {m.vocab_size}",
            "dtype": plan.dtype.compute, "attention": plan.attention, "rollout_engine": plan.rollout_engine,
            "decode_backend": plan.decode_backend,
            "kernel_backend": plan.kernel_backend, "optimizer": plan.optimizer,
            "lora": bool(plan.lora), "base_dtype": plan.base_dtype}


def speed_check(plan: Plan, device: Any, budget_s: float = 15.0) -> Verdict:
    """This GPU's matmul rate per dtype and its copy bandwidth (`doctor --bench`'s measurement, not saved);
    a matmul whose result is wrong in the plan's dtype fails."""
    name = "matmul and copy speed"
    if device.type != "cuda":
        return Verdict(name, "skip", "measured on a CUDA GPU (edgerl doctor --bench measures this CPU)")
    from edgerl.device.measure import measure
    t0 = time.perf_counter()
    m = measure(f"cuda:{device.index or 0}", budget_s=budget_s, item_s=3.0)
    figs = {k: {"value": getattr(m, k).value, "status": getattr(m, k).status}
            for k in ("fp32_matmul", "fp16_matmul", "bf16_matmul", "memory_copy")}
    got = [f"{k.split('_')[0]} {getattr(m, k).value:.3g} TFLOP/s" for k in ("fp32_matmul", "fp16_matmul", "bf16_matmul")
           if getattr(m, k).value]
    copy = m.memory_copy.value
    detail = ", ".join(got) + (f"; copy {copy:.0f} GB/s" if copy else "")
    took = time.perf_counter() - t0
    mine = f"{plan.dtype.compute}_matmul"
    if getattr(m, mine).status == "wrong":
        avoid = "plan.dtype=fp32" if plan.dtype.compute != "fp32" else ""
        return Verdict(name, "fail", f"the {plan.dtype.compute} matmul gives wrong results: "
                       f"{getattr(m, mine).note}", figs, avoid, took)
    return Verdict(name, "pass", detail, figs, seconds=took)


def run_selftest(plan: Plan, device: Any, model_checks: Optional[ModelChecks] = None, *, emulation: str = "",
                 speed: bool = True, log: Callable[[Verdict], None] = lambda v: None) -> SelfTest:
    """Every check for `plan` on the torch `device`; `log` sees each verdict as it comes."""
    from edgerl.doctor.kernel_checks import check_kernels
    start = time.perf_counter()
    st = SelfTest(environment(plan, device, emulation), plan_summary(plan),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def add(vs: list[Verdict]) -> None:
        for v in vs:
            v.detail = scrub(v.detail)
            st.verdicts.append(v)
            log(v)

    add(check_kernels(plan, device))
    if model_checks is not None:
        add(model_checks(plan, device))
    if device.type != "cuda":
        add([Verdict("CUDA graph capture of the decode step", "skip", "no CUDA GPU: the decode step runs eagerly "
                     "(checked above against HF's forward)")])
    if emulation:   # the plan is the profile's, the speed this GPU's
        add([Verdict("matmul and copy speed", "skip", "a profile is emulated on this GPU: its speed is this GPU's, "
                     "not the profile's")])
    else:
        add([speed_check(plan, device) if speed else Verdict("matmul and copy speed", "skip", "not asked for")])
    st.seconds = time.perf_counter() - start
    return st


def write_report(st: SelfTest, path: Path) -> None:
    """selftest.json at `path`, written atomically (the caller checked the path with output_file)."""
    from edgerl.core.files import json_text, write_atomically
    text = json_text(st.to_dict() | {"report": st.report_text()}, indent=2, default=str) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def scrub(obj: Any) -> Any:
    """Text without this machine's paths, user or host name (replaced by placeholders)."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if not isinstance(obj, str):
        return obj
    for pattern, repl in _private_patterns():
        obj = pattern.sub(repl, obj)
    return obj


def _private_patterns() -> list[tuple[re.Pattern, str]]:
    out = []
    for path, name in ((tempfile.gettempdir(), "<tmp>"), (str(Path.home()), "~"), (os.getcwd(), "<cwd>")):
        if path and path != "/":
            out.append((re.compile(re.escape(path) + r"[^\s'\"),;]*"), name))
    for word in (socket.gethostname(), _user()):
        if word and len(word) >= 2:
            out.append((re.compile(rf"\b{re.escape(word)}\b"), "<host>" if word == socket.gethostname() else "<user>"))
    return out


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:   # no user name where the process runs without one (containers)
        return ""
