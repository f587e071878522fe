"""`edgerl doctor`'s checks of what the plan chose for this device: precision, attention, the log-prob
kernel, the rollout engine, bitsandbytes and the fused NF4 kernel, host RAM, ECC and measured speed.

They report the plan's choices and reasons; they decide nothing. Without a plan (the model did not
fit, say) they ask the same functions in `decisions.py` that the plan would have asked.
"""

from __future__ import annotations

from typing import Optional

from edgerl.plan.decisions import bnb_support, pick_attention, pick_dtype, pick_kernels, sdpa_backends, vllm_install_advice
from edgerl.plan.engines import vllm_support
from edgerl.device.device import Device
from edgerl.doctor.check import Check, _c
from edgerl.plan.memory import fmt_bytes
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import Plan


def _choices(dev: Device, plan: Optional[Plan]) -> dict[str, tuple[object, str]]:
    if plan is not None:
        return {k: (getattr(plan, k), plan.reasons.get(k, "")) for k in ("dtype", "attention", "kernel_backend")}
    dtype, why = pick_dtype(dev, None)
    attention, awhy = pick_attention(dev, dtype, None)
    backend, _, kwhy = pick_kernels(dev, dtype, CATALOGUE["smollm2-135m"], None)
    return {"dtype": (dtype, why), "attention": (attention, awhy), "kernel_backend": (backend, kwhy)}


def check_bf16(dev: Device) -> Check:
    if not dev.is_cuda:
        return _c("native bf16", "skip", "CPU")
    if dev.bf16:
        return _c("native bf16", "ok", f"{dev.sm}: bf16 tensor cores")
    return _c("native bf16", "ok", f"{dev.sm}: no native bf16 (torch.cuda.is_bf16_supported() can say True by "
              "emulation); edgerl never picks bf16 here")


def check_precision(dev: Device, dtype: object, why: str) -> Check:
    if not dev.is_cuda:
        return _c("fp16 and compute dtype", "skip", "CPU: fp32")
    # the plan's reason names the device's fp16 speed itself unless the dtype was forced
    speed = "" if why.startswith(dev.sm) else f"{dev.fp16_speed()}; "
    return _c("fp16 and compute dtype", "ok", f"{speed}the plan computes in {dtype.compute}: {why}")


def check_attention(dev: Device, attention: str, why: str, compute: str) -> Check:
    v = dev.software.version("flash_attn")
    backends = sdpa_backends(dev, compute)
    detail = f"{attention}: {why} (SDPA backends for {compute}: {', '.join(backends)})"
    if v and attention != "flash_attention_2" and (not dev.is_cuda or dev.cc < (8, 0)):
        return _c("attention", "warn", f"flash_attn {v} is installed but cannot run here; {detail}",
                  "edgerl does not use it; code that imports it unconditionally fails here")
    if [b for b in backends if b != "math"]:
        return _c("attention", "ok", detail)
    return _c("attention", "warn", detail, "only the math backend: attention memory grows with length squared")


def check_kernel(dev: Device, backend: str, why: str) -> Check:
    if dev.is_cuda and dev.cc >= (8, 0) and not dev.software.has("triton"):
        return _c("log-prob kernel", "warn", f"{backend}: {why}", "pip install triton (the fused log-prob kernel "
                  "is faster and holds less memory from CC 8.0, and the bf16 AdamW step runs as one kernel)")
    return _c("log-prob kernel", "ok" if dev.is_cuda else "skip", f"{backend}: {why}")


def check_vllm(dev: Device, dtype: object) -> Check:
    ok, why = vllm_support(dev, dtype)
    if ok:
        return _c("vLLM", "ok", why)
    if dev.software.has("vllm"):
        return _c("vLLM", "warn", f"installed but not usable here: {why}", "edgerl uses its static engine instead")
    engine = "the static engine (static KV cache + CUDA graphs)" if dev.is_cuda else "the static engine"
    return _c("vLLM", "ok", f"{why}; {engine} is used", vllm_install_advice(dev))


def check_bnb(dev: Device) -> Check:
    if not dev.is_cuda:
        return _c("bitsandbytes", "skip", "CPU")
    ok, why = bnb_support(dev)
    if ok:
        return _c("bitsandbytes", "ok", f"{why}: 8-bit AdamW available")
    if dev.cc < (6, 0):
        return _c("bitsandbytes", "ok", f"{why}; bitsandbytes 0.49 and later have no Maxwell build")
    return _c("bitsandbytes", "ok", "not installed: 8-bit AdamW unavailable (optional)", "pip install bitsandbytes")


def check_nf4_kernel(dev: Device, plan: Optional[Plan], simulated: bool) -> Optional[Check]:
    """Whether NVRTC compiles the fused NF4 decode kernel for this GPU (a QLoRA rollout in fp32 uses it: decode
    backend cuda-c over an NF4 base). Only where it could matter: a real CUDA GPU with bitsandbytes installed,
    or a plan that uses it."""
    needed = plan is not None and plan.decode_backend == "cuda-c" and plan.base_dtype == "nf4"
    if not dev.is_cuda or simulated or not (needed or dev.software.has("bitsandbytes")):
        return None
    from edgerl.kernels.nf4 import SOURCE, decode_kernels
    from edgerl.kernels.nvrtc import KernelUnavailable, compile_cubin
    from edgerl.plan.dtypes import torch_dtype
    compute = plan.dtype.compute if needed else "fp32"   # the plan's, else what an fp32 QLoRA plan would use
    try:
        compile_cubin(SOURCE, decode_kernels(torch_dtype(compute), dev.cc), dev.cc)
    except (KernelUnavailable, OSError, AttributeError) as e:
        then = ("training with this plan stops at its start" if needed else
                "a QLoRA plan in fp32 needs plan.decode_backend=torch here (bitsandbytes' own matmul, slower)")
        return _c("fused NF4 kernel", "fail" if needed else "warn", f"NVRTC cannot compile it for {dev.sm}: {e}; {then}",
                  "torch's CUDA wheels bring NVRTC (nvidia-cuda-nvrtc); reinstall torch from its CUDA index, or "
                  "set plan.decode_backend=torch")
    return _c("fused NF4 kernel", "ok", f"NVRTC compiles it for {dev.sm}: QLoRA decode steps in {compute} read the "
              "4-bit weights once" + (" (this plan uses it)" if needed else ""))


def check_decode_kernels(dev: Device, plan: Optional[Plan], simulated: bool) -> Optional[Check]:
    """Whether NVRTC compiles the decode-layer kernels (edgerl/kernels/decode_cuda.py) this plan's rollout uses, in
    its compute dtype over its KV cache's."""
    if plan is None or plan.decode_backend != "cuda-c" or not dev.is_cuda or simulated:
        return None
    from edgerl.kernels import fp32_mm
    from edgerl.kernels.decode_cuda import SOURCE, kernel_names
    from edgerl.kernels.nvrtc import KernelUnavailable, compile_cubin
    from edgerl.plan.dtypes import torch_dtype
    try:
        kv = getattr(plan, "kv_cache_dtype", None)
        compile_cubin(SOURCE, kernel_names(plan.model.num_heads // plan.model.num_kv_heads, plan.model.hd,
                                           torch_dtype(plan.dtype.compute), torch_dtype(kv) if kv else None), dev.cc)
        if plan.dtype.compute == "fp32":   # the projections' and logits' few-row matmul
            compile_cubin(fp32_mm.SOURCE, fp32_mm.all_kernels(), dev.cc)
    except (KernelUnavailable, OSError, AttributeError) as e:
        return _c("decode-layer kernels", "fail", f"NVRTC cannot compile them for {dev.sm}: {e}; the rollout would "
                  "stop at its start", "torch's CUDA wheels bring NVRTC (nvidia-cuda-nvrtc); reinstall torch from its "
                  "CUDA index, or set plan.decode_backend=torch")
    return _c("decode-layer kernels", "ok", f"NVRTC compiles them for {dev.sm}: the {plan.dtype.compute} decode step "
              "attends over the columns each row sees and fuses its elementwise work (this plan uses them)")


def check_host_ram(dev: Device, plan: Optional[Plan]) -> Check:
    need = plan.memory.host_needed if plan else 0
    have = dev.host_memory_available or dev.host_memory
    detail = f"{fmt_bytes(dev.host_memory)} RAM ({fmt_bytes(dev.host_memory_available)} available)"
    if need and need > have:
        return _c("host RAM for offload", "fail", f"{detail}; the plan offloads {fmt_bytes(need)}",
                  "free memory, add RAM, or use LoRA (--set lora.enabled=true)")
    if need:
        return _c("host RAM for offload", "ok", f"{detail}; the plan offloads {fmt_bytes(need)}")
    return _c("host RAM for offload", "ok", f"{detail}; the plan offloads nothing")


def check_ecc(dev: Device, plan: Optional[Plan], simulated: bool) -> Optional[Check]:
    """ECC on (the default on data-centre cards) holds back memory on GDDR cards; say what turning it off
    gives back, and the price, when the plan is short of memory."""
    from edgerl.device.profiles import get_profile
    if not dev.is_cuda or not dev.profile:
        return None
    prof = get_profile(dev.profile)
    gain = getattr(prof, "ecc_off_gain_bytes", None)
    on = dev.ecc_enabled if not simulated else getattr(prof, "ecc_default", None)
    if not on:
        return None
    if gain == 0:
        return _c("ECC", "ok", f"ECC is on; on the {prof.display} turning it off frees no memory")
    if gain is None:
        return _c("ECC", "ok", f"ECC is on; what turning it off gives back on the {prof.display} is not known")
    tight = plan is None or plan.memory.total > 0.9 * plan.memory.budget or plan.grad_checkpointing
    fix = (f"sudo nvidia-smi -i {dev.nvml_index if dev.nvml_index is not None else 0} -e 0, then reboot: "
           f"{fmt_bytes(gain)} more for training, and memory bit errors are no longer corrected")
    return _c("ECC", "warn" if tight else "ok", f"ECC is on: {fmt_bytes(gain)} of the {prof.display}'s memory is held "
              "back for it" + ("; the plan is short of memory" if tight else ""), fix if tight else "")


def check_measured(dev: Device) -> Optional[Check]:
    """A cached `edgerl doctor --bench` of this GPU: its numbers, and a failure for a wrong result."""
    m = getattr(dev, "measured", None)
    if m is None:
        return None
    from edgerl.device.measured import summary
    wrong = [name for name in ("fp32_matmul", "fp16_matmul", "bf16_matmul") if getattr(m, name).status == "wrong"]
    lines = "; ".join(summary(m)[:3])  # the numbers; what was not measured, and why, is in --json
    if wrong:
        return _c("measured speed", "fail", f"{', '.join(wrong)} gave wrong results: {lines}",
                  f"reinstall the torch wheel for {dev.sm} (edgerl doctor names it), then edgerl doctor --bench again")
    return _c("measured speed", "ok", f"{lines} (measured {m.date[:10]})")


def plan_checks(dev: Device, plan: Optional[Plan], simulated: bool) -> list[Optional[Check]]:
    c = _choices(dev, plan)
    dtype, why = c["dtype"]
    return [check_bf16(dev), check_precision(dev, dtype, why),
            check_attention(dev, c["attention"][0], c["attention"][1], dtype.compute),
            check_kernel(dev, *c["kernel_backend"]), check_vllm(dev, dtype), check_bnb(dev),
            check_nf4_kernel(dev, plan, simulated), check_decode_kernels(dev, plan, simulated),
            check_host_ram(dev, plan), check_ecc(dev, plan, simulated),
            check_measured(dev)]
