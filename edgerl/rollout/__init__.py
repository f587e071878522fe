"""Rollout engines behind one interface, built by the name the plan chose (`plan.rollout_engine`).

    "hf"           edgerl's static KV cache decoder; the decode step is replayed from a CUDA graph on GPUs
    "hf-generate"  transformers' `generate`, for models the static decoder does not implement
    "vllm"         a colocated vLLM engine

Adding an engine: a class with the `RolloutEngine` methods (base.py) and one entry in `ENGINES`.
The trainer only calls `build_engine` and the interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from edgerl.core.errors import TrainingError
from .base import RolloutBatch, RolloutEngine, SamplingParams, cut_at_eos
from .decoder import SUPPORTED, UnsupportedModel
from .hf import HFGenerateEngine, load_weights
from .static import StaticCacheEngine


@dataclass(frozen=True)
class EngineContext:
    """What an engine builder may need besides the plan."""
    model_path: str                 # the actor's model (config and initial weights)
    trust_remote_code: bool
    device: torch.device
    max_seq_len: int                # longest prompt + max_new_tokens
    seed: int
    work_dir: Path                  # a folder the engine may write to (vLLM loads from a folder)
    save_initial: Callable[[Path], None]   # writes the actor's current weights as an HF folder there
    actor: Optional[torch.nn.Module] = None   # the trained PolicyHead (FSDP2): for an engine without a copy


class OwnWeights:
    """An hf engine over its own compute-dtype copy of the weights, synced after every update. Unless the
    plan keeps it resident, the copy's storage, the KV cache and the graphs are freed between rollouts
    (the memory serves scoring and the update; the plan counts them in the rollout phase only) and the
    next weight sync re-allocates and refills every parameter. Resident, the sync copies in place and
    the captured graphs are replayed again."""

    needs_weights = True

    def __init__(self, engine, model: torch.nn.Module, resident: bool) -> None:
        self.engine, self.model, self.resident = engine, model, resident
        self.name = engine.name

    def generate(self, prompts, n_samples, params, generator=None) -> RolloutBatch:
        return self.engine.generate(prompts, n_samples, params, generator)

    def release(self) -> None:
        if self.resident:
            return
        from edgerl.models.load import release_weights
        self.engine.release()
        release_weights(self.model)

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from edgerl.models.load import restore_weights
        restore_weights(self.model)
        self.engine.sync_weights(weights)

    def describe(self) -> str:
        return self.engine.describe() + ("; resident between steps" if self.resident else "")


class ActorWeights:
    """An hf engine that runs the trained actor's own modules: a quantized base with its unmerged LoRA
    adapters, so rollout, reference and training share one copy of the weights and the rollout's
    log-probs come from the weights the trainer scores. FSDP2 shards the adapters; they are gathered
    for the rollout and re-sharded after (a CUDA graph is captured again when their addresses move)."""

    needs_weights = False

    def __init__(self, engine, actor: torch.nn.Module, resident: bool, fused_nf4: str = "") -> None:
        from torch.distributed.fsdp import FSDPModule
        self.engine, self.resident, self.fused_nf4 = engine, resident, fused_nf4
        self.fsdp = [m for m in actor.modules() if isinstance(m, FSDPModule)]
        self.name = engine.name

    def generate(self, prompts, n_samples, params, generator=None) -> RolloutBatch:
        for m in self.fsdp:
            m.unshard()
        try:
            return self.engine.generate(prompts, n_samples, params, generator)
        finally:
            for m in self.fsdp:
                m.reshard()

    def release(self) -> None:
        if not self.resident:
            self.engine.release()

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: the engine reads the actor's weights themselves."""

    def describe(self) -> str:
        return (self.engine.describe() + "; runs the actor's own quantized base and adapters (no copy)"
                + (f"; {self.fused_nf4}" if self.fused_nf4 else ""))


def _inference_copy(plan, ctx: EngineContext) -> torch.nn.Module:
    from edgerl.models.load import build_inference_copy
    return build_inference_copy(ctx.model_path, plan, ctx.device, ctx.trust_remote_code)


def _static_engine(plan, model: torch.nn.Module, rows: int, max_seq_len: int, **kw) -> StaticCacheEngine:
    """The static engine, or a one-line TrainingError naming the plan setting when its decode kernel cannot
    run on this machine (the plan sees the GPU, not whether NVRTC or triton works on it)."""
    from .decoder import DecodeKernelUnavailable
    try:
        return StaticCacheEngine(model, rows, max_seq_len, cuda_graphs=plan.cuda_graphs,
                                 decode_attention=plan.decode_attention, **kw)
    except DecodeKernelUnavailable as e:
        raise TrainingError(f"{e} (set plan.decode_attention=bmm in fp32, sdpa in 16 bits)") from None


def _static(plan, ctx: EngineContext) -> RolloutEngine:
    from edgerl.models.load import quantized_base
    why = plan.reasons.get("cuda_graphs", "")
    # The plan chose this engine for this model (decisions.static_engine_support); the decoder checks
    # the loaded model again and raises UnsupportedModel if the two disagree.
    if quantized_base(plan):
        fused = ""
        if plan.nf4_kernel:
            from edgerl.plan.decisions import NF4_KERNEL_ROWS
            from edgerl.models.quant_decode import enable
            n, left = enable(ctx.actor.lm, NF4_KERNEL_ROWS)   # compiles and checks the kernel first (one-line error)
            fused = f"{n} NF4 layers decode through the fused kernel" + "".join(
                f"; {k} left to bitsandbytes: {why}" for why, k in left.items())
        engine = _static_engine(plan, ctx.actor.lm, plan.rollout_batch, ctx.max_seq_len, projections="modules",
                                note=why)
        return ActorWeights(engine, ctx.actor, plan.rollout_resident, fused)
    copy = _inference_copy(plan, ctx)
    try:
        engine = _static_engine(plan, copy, plan.rollout_batch, ctx.max_seq_len, compile_step=plan.rollout_compile,
                                note=why)
    except ValueError as e:
        if isinstance(e, UnsupportedModel):   # the plan read the config; the loaded model says otherwise
            raise TrainingError(f"the plan runs the rollout on edgerl's static-cache engine, and it cannot run this "
                                f"model: {e} (set plan.rollout_engine=hf-generate)") from None
        if plan.decode_attention == "triton_layers":
            # the plan cannot see the loaded model's layers (fusable projections, activation) or triton's import
            raise TrainingError(f"the plan runs the rollout's decode layers as Triton kernels, and they cannot run "
                                f"here: {e} (set plan.decode_attention=triton_rope)") from None
        if not plan.rollout_compile:
            raise
        # the plan cannot see the loaded model's layers (fusable projections) or the host's compiler
        raise TrainingError(f"the plan compiles the rollout's decode step, and this model cannot: {e} "
                            "(set plan.rollout_compile=false)") from None
    return OwnWeights(engine, copy, plan.rollout_resident)


def _generate(plan, ctx: EngineContext) -> RolloutEngine:
    copy = _inference_copy(plan, ctx)
    engine = HFGenerateEngine(copy, plan.rollout_batch, note=plan.reasons.get("rollout_engine", ""))
    return OwnWeights(engine, copy, plan.rollout_resident)


def _vllm(plan, ctx: EngineContext) -> RolloutEngine:
    from .vllm_engine import VLLMEngine
    folder = ctx.work_dir / "rollout-model"   # vLLM loads from a folder; weights are pushed after each update
    ctx.save_initial(folder)
    return VLLMEngine(str(folder), dtype=plan.dtype.compute, gpu_memory_utilization=vllm_share(plan, ctx.device),
                      max_model_len=ctx.max_seq_len, max_num_seqs=plan.rollout_batch, seed=ctx.seed,
                      enable_sleep=ctx.device.type == "cuda", note=plan.reasons.get("rollout_engine", ""))


def vllm_share(plan, device: torch.device) -> float:
    """The plan's rollout share of its device's memory, as a share of the GPU this process runs on
    (vLLM's gpu_memory_utilization): the same bytes when a profile with less memory is emulated on it."""
    if device.type != "cuda" or plan.device.kind != "cuda":
        return plan.rollout_memory_share
    real = torch.cuda.get_device_properties(device).total_memory
    return min(plan.rollout_memory_share, plan.rollout_memory_share * plan.device.total_memory / real)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": _static, "hf-generate": _generate, "vllm": _vllm}


def build_engine(plan, ctx: EngineContext) -> RolloutEngine:
    """The engine the plan chose, ready for its first `sync_weights`."""
    if plan.rollout_engine not in ENGINES:
        raise ValueError(f"plan.rollout_engine={plan.rollout_engine!r}: no such engine ({', '.join(ENGINES)})")
    return ENGINES[plan.rollout_engine](plan, ctx)


__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams", "cut_at_eos", "HFGenerateEngine", "load_weights",
           "StaticCacheEngine", "UnsupportedModel", "SUPPORTED", "ENGINES", "EngineContext", "build_engine",
           "OwnWeights", "ActorWeights"]
