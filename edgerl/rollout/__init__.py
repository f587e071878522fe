"""Rollout engines behind one interface (`base.RolloutEngine`), built by the name the plan chose
(`plan.rollout_engine`):

    "static"       edgerl's own decoder over a static KV cache (engine_static.py); the decode step is
                   replayed from a CUDA graph on GPUs and its layers run through `plan.decode_backend`
                   (decode_torch.py, decode_triton_attention.py, decode_triton_layers.py, decode_cuda_c.py)
    "hf-generate"  transformers' `generate`, for models the static decoder does not implement
    "vllm"         a colocated vLLM engine

Engine `x-y` lives in `engine_x_y.py` and is built by its `build(plan, ctx)`; adding one is that file
and its entry in plan/engines.py (when the plan may pick it). The trainer only calls `build_engine` and
the interface.
"""

from __future__ import annotations

import importlib

from .base import (ActorWeights, EngineContext, OwnWeights, RolloutBatch, RolloutEngine, SamplingParams, cut_at_eos,
                   load_weights)
from .arch import SUPPORTED, UnsupportedModel
from .engine_hf_generate import HFGenerateEngine
from .engine_static import StaticCacheEngine
from .engine_vllm import vllm_share


def build_engine(plan, ctx: EngineContext) -> RolloutEngine:
    """The engine the plan chose, ready for its first `sync_weights`."""
    name = plan.rollout_engine
    try:
        module = importlib.import_module(f"{__name__}.engine_{name.replace('-', '_')}")
    except ModuleNotFoundError:
        raise ValueError(f"plan.rollout_engine={name!r}: no such engine (edgerl/rollout/engine_"
                         f"{name.replace('-', '_')}.py)") from None
    return module.build(plan, ctx)


__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams", "cut_at_eos", "HFGenerateEngine", "load_weights",
           "StaticCacheEngine", "UnsupportedModel", "SUPPORTED", "EngineContext", "build_engine", "OwnWeights",
           "ActorWeights", "vllm_share"]
