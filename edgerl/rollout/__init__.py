"""Rollout engines behind one interface: ``hf`` (static KV cache + CUDA graphs on GPU) and ``vllm``."""

from __future__ import annotations

import torch

from .base import RolloutBatch, RolloutEngine, SamplingParams, cut_at_eos
from .decoder import SUPPORTED, UnsupportedModel
from .hf import HFGenerateEngine, load_weights
from .static import StaticCacheEngine

# CPU choice, measured on this project's shared 2-core x86 build machine, fp32, 8 rows, 1 torch thread,
# HF generate and the static engine called alternately in one process (median of per-round ratios
# hf/static): SmolLM2-135M shape 1.04x and 1.20x (64-token prompt, 32 new; rounds 0.86-1.64), 1.05x
# (16-token prompt, 64 new); a tiny 2-layer model 1.75x. With 2 threads the shared machine gave
# 0.33x-6x per round: noise. At 135M the CPU is bound by arithmetic, so the engines tie; the static
# engine is not slower, is faster on the tiny models CPU runs use, returns the sampler's log-probs,
# and CPU runs then check the same code the GPU runs.
CPU_STATIC = True
CPU_REASON = ("static cache eager decode on the CPU: measured 1.04-1.2x HF generate's speed at 135M, "
              "1.75x on tiny models, and it is the code the GPU runs")


def make_hf_engine(model: torch.nn.Module, *, device_is_cuda: bool, cuda_graphs: bool,
                   max_batch: int, max_seq_len: int) -> RolloutEngine:
    """The `hf` engine for the plan: the static-cache engine where it can run this model, else plain
    HF generate. `describe()` of the result says which and why. Only "cannot run this model" falls
    back (UnsupportedModel, NotImplementedError for a rope type); any other error propagates."""
    if not device_is_cuda:
        if cuda_graphs:
            raise ValueError("cuda_graphs=True needs a CUDA device; the plan sets it only on CUDA")
        if not CPU_STATIC:
            return HFGenerateEngine(model, max_batch, note=f"plain HF generate on the CPU: {CPU_REASON}")
        try:
            return StaticCacheEngine(model, max_batch, max_seq_len, cuda_graphs=False,
                                     note=CPU_REASON)
        except (UnsupportedModel, NotImplementedError) as e:
            return HFGenerateEngine(model, max_batch, note=f"plain HF generate on the CPU: {e}")
    try:
        why = ("decode step captured once, replayed per token" if cuda_graphs
               else "the plan turned CUDA graphs off")
        return StaticCacheEngine(model, max_batch, max_seq_len, cuda_graphs=cuda_graphs, note=why)
    except (UnsupportedModel, NotImplementedError) as e:
        return HFGenerateEngine(model, max_batch, note=f"plain HF generate: the static engine cannot run it: {e}")


__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams", "cut_at_eos", "HFGenerateEngine", "load_weights",
           "StaticCacheEngine", "UnsupportedModel", "SUPPORTED", "make_hf_engine"]
