"""Rollout engines behind one interface (`base.RolloutEngine`), built by the name the plan chose
(`plan.rollout_engine`):

    "static"       edgerl's own decoder over a static KV cache (engine_static.py); the decode step is
                   replayed from a CUDA graph on GPUs and its layers run through `plan.decode_backend`
                   (decode_torch.py, decode_triton_attention.py, decode_triton_layers.py, decode_cuda_c.py)
    "hf-generate"  transformers' `generate`, for models the static decoder does not implement
    "vllm"         a colocated vLLM engine

`ENGINES` names each engine's `build(plan, ctx)`; adding one is its file, its entry there and its entry in
plan/engines.py's ENGINES (when the plan may pick it; a test keeps the two lists the same). The trainer only
calls `build_engine` and the interface.
"""

from __future__ import annotations

from typing import Callable

from . import engine_hf_generate, engine_static, engine_vllm
from .base import (ActorWeights, EngineContext, OwnWeights, RolloutBatch, RolloutEngine, SamplingParams, cut_at_eos,
                   load_weights)
from .arch import UnsupportedModel
from .engine_hf_generate import HFGenerateEngine
from .engine_static import StaticCacheEngine
from .engine_vllm import vllm_share


ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "static": engine_static.build,
    "hf-generate": engine_hf_generate.build,
    "vllm": engine_vllm.build,
}


def build_engine(plan, ctx: EngineContext) -> RolloutEngine:
    """The engine the plan chose (`plan.rollout_engine`), ready for its first `sync_weights`."""
    name = plan.rollout_engine
    if name not in ENGINES:
        raise ValueError(f"plan.rollout_engine={name!r}: no such engine; choose one of {', '.join(ENGINES)}")
    return ENGINES[name](plan, ctx)


__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams", "cut_at_eos", "HFGenerateEngine", "load_weights",
           "StaticCacheEngine", "UnsupportedModel", "EngineContext", "build_engine", "OwnWeights",
           "ActorWeights", "vllm_share", "ENGINES"]
