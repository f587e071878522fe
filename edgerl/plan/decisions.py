"""The single-choice hardware and resource decisions, each made once with its reason: dtype, LoRA
base storage, attention, log-prob kernel and tiles, shared prompts, headroom, bitsandbytes, optimizer,
the environment, the reward model's dtype (the rollout's engine and decode backend: engines.py). The
plan's steps (steps.py, one per row of table.py) call them; engines, kernels, models and doctor read
the plan and at most assert it. Nothing else decides these.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from edgerl.device.device import GiB, MiB, Device
from edgerl.plan.archs import ARCHITECTURES, architecture, lora_defaults
from edgerl.plan.dtypes import nbytes
from edgerl.plan.fp16 import overflow
from edgerl.core.errors import PlanError
from edgerl.plan.memory import packed_tokens
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.task import Task

if TYPE_CHECKING:
    from edgerl.plan.ctx import Ctx


def fact(fn: Callable[["Ctx"], Any]) -> Callable[["Ctx"], Any]:
    """A fact several of the plan's steps read, computed once per plan (kept in `c.facts`)."""
    @functools.wraps(fn)
    def get(c: "Ctx") -> Any:
        if fn.__name__ not in c.facts:
            c.facts[fn.__name__] = fn(c)
        return c.facts[fn.__name__]
    return get


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

def lora_targets(model_type: str, explicit: Optional[tuple[str, ...] | list[str]]) -> tuple[str, ...]:
    """The modules LoRA adapts: `explicit`, else the architecture's (plan/archs.py: its attention and MLP
    projections)."""
    if explicit:
        return tuple(explicit)
    targets = architecture(model_type).lora_targets
    if not targets:
        raise PlanError(f"LoRA has no default target modules for model_type {model_type!r} (defaults exist for "
                        f"{', '.join(lora_defaults())}); name its linear layers with lora.target_modules, e.g. "
                        "--set 'lora.target_modules=[\"q_proj\", \"v_proj\"]'")
    return targets


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
            # docs/hardware.md, fp16 on Pascal: native half math is 1/64 on sm_61, but torch's fp16 GEMM is
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


@fact
def compute(c: "Ctx") -> tuple["DtypePolicy", str]:
    """The compute dtype (with fp32 master weights) the memory search plans with; the `dtype` decision
    adds what the optimizer does to the weights. fp32 where fp16 would overflow this model (plan/fp16.py)."""
    policy, reason = device_dtype(c)
    why = fp16_overflow(c)
    if why is None:
        return policy, reason
    if c.forced("dtype") == "fp16":
        raise PlanError(f"plan.dtype=fp16 would overflow {c.model.name}: {why}; fp16 turns it into inf, then NaN. "
                        "Leave plan.dtype unset (the plan computes in fp32 then) or set --set plan.dtype=fp32")
    return FP32, f"{why}: fp32 compute, not the fp16 that {c.device.sm} would otherwise use"


@fact
def device_dtype(c: "Ctx") -> tuple["DtypePolicy", str]:
    """The compute dtype the GPU (or plan.dtype) asks for, before the model's own range is considered."""
    return pick_dtype(c.device, c.forced("dtype"))


@fact
def fp16_overflow(c: "Ctx") -> Optional[str]:
    """Why this model must not compute in fp16 where the device asks for it (None: it may, or fp16 is not
    asked for). A forced plan.dtype=fp16 yields only to a measured record, not to the architecture's name."""
    if device_dtype(c)[0].compute != "fp16":
        return None
    return overflow(c.model.model_type, c.model.activations, measured_only=c.forced("dtype") == "fp16")


def pick_base_dtype(dev: Device, dtype: DtypePolicy, forced: Optional[str]) -> tuple[str, str]:
    """Storage dtype of a frozen LoRA base. It never changes, so it needs no fp32 master copy."""
    if not forced:
        if dev.is_cuda and dtype.compute == "fp32":
            # the memory and step time of both bases under a P40's memory: docs/benchmarks.md, What fits under a P40
            return "fp16", (f"{dev.sm} computes in fp32; the frozen base is stored in fp16 and upcast one layer "
                            "at a time: measured 17% less memory for 3% more step time (docs/benchmarks.md, What fits "
                            "under a P40)")
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
    """Can a frozen LoRA base be stored quantized this way here? (docs/hardware.md,
    bitsandbytes: NF4 from CC 6.0 with a CUDA <= 12.6 build, Pascal included; LLM.int8's matmul from 7.5.)"""
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
    """PyTorch SDPA backends that serve `dtype` on `dev` (docs/hardware.md, Attention backends): the facts behind
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


# docs/benchmarks.md, cuDNN attention (bench/bench_attention.py).
CUDNN_SDPA_SETUP = ("it sets up each new sequence length anew, which cost up to seconds per forward and backward on an "
                    "H200 where the other backends take about a millisecond")


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


def pick_attention_chunk(dev: Device, dtype: DtypePolicy, attention: str, model: ModelSpec,
                         forced: Optional[int]) -> tuple[int, bool, str]:
    """How the trainer's forward passes attend (edgerl/models/attention.py), as (query rows per chunk, 0 for
    one fused kernel call; whether K and V are repeated to the query heads for it; reason). The rows are
    rolled to column 0, so no mask is needed: SDPA's FlashAttention (16 bits, sm_80 and up: takes grouped
    K/V heads as they are) or memory-efficient kernel (fp16/fp32 from sm_50, bf16 from sm_80; K/V repeated)
    attends causally in O(L) memory. Where neither serves the compute dtype, query rows are attended in
    chunks whose scores are recomputed in the backward: rows x heads x chunk x L scores, never L x L."""
    gqa = model.num_heads != model.num_kv_heads
    if attention != "sdpa":
        if forced:
            raise PlanError(f"plan.attention_chunk={forced} chunks SDPA's attention; plan.attention is {attention}")
        return 0, False, f"attention {attention}: " + ("FlashAttention-2 attends in O(L) memory"
                                                       if attention == "flash_attention_2" else
                                                       "eager attention keeps every layer's L x L scores (counted)")
    backends = sdpa_backends(dev, dtype.compute)
    flash = "flash" in backends and dev.is_cuda
    copies = gqa and not flash and dev.is_cuda
    fused = [b for b in backends if b in ("flash", "mem-efficient", "flash (CPU)")]
    if forced:
        return forced, copies, (f"asked for with plan.attention_chunk={forced}: {forced} query rows at a time, "
                                "each chunk's scores recomputed in the backward")
    if fused:
        kv = (f"; K and V repeated to the {model.num_heads} query heads for it (2 x {model.num_heads - model.num_kv_heads}"
              " heads x L per layer, counted)" if copies else "")
        return 0, copies, (f"rows rolled to column 0, so attention needs no (B, 1, L, L) mask: SDPA's "
                           f"{fused[0]} kernel attends causally in O(L) memory{kv}; where it cannot serve a call, "
                           f"chunks of query rows (plan.attention_chunk=N forces them)")
    chunk = 256
    return chunk, copies, (f"SDPA has no O(L)-memory kernel for {dtype.compute} here: {chunk} query rows at a time, "
                           "each chunk's scores recomputed in the backward (rows x heads x chunk x L, never L x L)")


def activation_offload_reason(dev: Device, on: bool, ckpt: bool, host_bytes: int, forced: Optional[bool]) -> str:
    if forced is not None:
        return f"asked for with plan.activation_offload={str(forced).lower()}"
    if not dev.is_cuda or dev.integrated:
        return "off: host memory is the device's memory here" if dev.integrated else "off: CPU"
    if not ckpt:
        return "off: no gradient checkpointing, so no layer inputs to move"
    if not on:
        return "off: the checkpointed layer inputs fit on the GPU"
    return ("on: each checkpointed layer's input goes to pinned host memory on a side stream as its forward ends "
            "and comes back one layer ahead in the backward, overlapping compute; the GPU keeps two layers' "
            f"inputs instead of every layer's (host RAM {host_bytes / GiB:.2f} GiB pinned per micro-batch)"
            + transfer_note(dev, host_bytes))


def _asked(setting: str, forced: Optional[bool], impossible: str) -> Optional[tuple[bool, str]]:
    """An on/off decision the user forced with plan.SETTING: (value, reason), a PlanError when on is
    `impossible` (non-empty: why), or None when nothing was forced."""
    if forced is None:
        return None
    if forced and impossible:
        raise PlanError(f"plan.{setting}=true is not possible: {impossible}; use plan.{setting}=false")
    return bool(forced), f"asked for with plan.{setting}={str(forced).lower()}"


# Below this width the packed attention's extra kernels cost more than the prompt tokens save (docs/benchmarks.md,
# Shared prompts: slower at hidden 960, faster at 2048).
PACK_MIN_HIDDEN = 2048


# Packed rows attend through an explicit (R x (W + R)) mask per row, which SDPA turns into an additive one in
# the compute dtype for every layer and which rules out causal kernels; past this many response tokens per
# prompt token the prompt tokens saved (under W / (W + R) of a forward) no longer pay for it.
PACK_MAX_RESPONSE_PER_PROMPT = 4


def share_blocker(attention: str, model: ModelSpec, forced: Optional[bool], task: Optional[Task] = None) -> str:
    """Why the trainer's forward passes will not share prompts for this model and attention ('' when
    they will): impossible (not SDPA, an unchecked decoder, a sliding window), not worth it (under
    PACK_MIN_HIDDEN unless forced on), or turned off (plan.share_prompts=false). The plan's memory
    model and its decision both read this."""
    if attention != "sdpa":
        return f"attention {attention}: packing runs through SDPA"
    if not architecture(model.model_type).packed:   # its HF layers hand attention keywords on (plan/archs.py)
        packed = [t for t, a in ARCHITECTURES.items() if a.packed]
        return f"{model.model_type} is not one of the checked decoders ({', '.join(packed)})"
    if model.sliding_window:
        return "the model attends through a sliding window"
    if forced is False:
        return "asked for with plan.share_prompts=false"
    if forced is None and model.hidden_size < PACK_MIN_HIDDEN:
        return (f"at hidden size {model.hidden_size} (under {PACK_MIN_HIDDEN}) the packed attention's extra "
                "kernels cost more than the shared prompt tokens save (measured on an H200); "
                "plan.share_prompts=true turns it on")
    if forced is None and task is not None and task.response_len > PACK_MAX_RESPONSE_PER_PROMPT * task.prompt_len:
        saved = task.prompt_len / (task.prompt_len + task.response_len)
        return (f"responses of {task.response_len} tokens after prompts of {task.prompt_len}: sharing would save under "
                f"{saved:.0%} of a forward's tokens, while packed rows attend through an explicit R x (W + R) mask "
                "per row instead of a causal kernel; plan.share_prompts=true turns it on")
    return ""


def pick_share_prompts(attention: str, model: ModelSpec, task: Task, micro_batch: int, score_micro_batch: int,
                       forced: Optional[bool]) -> tuple[bool, str]:
    """Whether the trainer's forward passes compute each distinct prompt of a micro-batch once
    (`edgerl.models.packing`): a GRPO group's samples share their prompt."""
    asked = _asked("share_prompts", forced, share_blocker(attention, model, forced=True))   # what no setting helps
    if asked:
        return asked
    why_not = share_blocker(attention, model, forced, task)
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
    tensor-core path and falls back to FMA, triton#5066; docs/hardware.md, Triton and torch.compile), else chunked torch,
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
    """Can bitsandbytes' 8-bit optimizers run here? (docs/hardware.md, bitsandbytes: CC >= 6.0, Pascal included)"""
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
    """What installing vLLM would take here (docs/hardware.md, vLLM), or why it cannot help."""
    if not dev.is_cuda:
        return ""
    if dev.cc < (7, 0):
        return (f"stock vLLM does not run on {dev.sm}; community Pascal builds exist (sasha0552/pascal-pkgs-ci), "
                "edgerl's static engine is used")
    if dev.cc < (7, 5):
        return (f"stock vLLM wheels start at sm_75 (CUDA 13 builds), so not on {dev.sm}; edgerl's static engine "
                "with CUDA graphs is used")
    return ("optional: pip install 'edgerl[vllm]'; stock vLLM wheels are built for CUDA 13 (driver >= R580) and "
            "pin their own torch, so they replace the torch you have")


# Pinned host<->device copy rates for cost estimates, by PCIe generation (docs/hardware.md, Host transfers: about
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
