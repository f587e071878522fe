"""The plan's search: which memory-relevant setting fits the budget, fastest first.

Outer loop: what is trained and how the frozen base is stored (`configs`: full fine-tuning, LoRA on a
float base, on an NF4 base, then LoRA with parameter offload). Inner loop: (stage, micro-batch) pairs
in order of their estimated slowdown (`moves.STAGES`, `moves.STAGE_COST`), each with the largest
rollout batch and scoring micro-batch that fit. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from .decisions import QUANT_BASES, quant_support
from .device import Device
from .memory import Calibration, MemoryEstimate, Setting, estimate, fmt_bytes
from .modelspec import ModelSpec
from .moves import MICRO_HALVING_COST, Stage
from .task import Task


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


@dataclass(frozen=True)
class Found:
    setting: Setting
    memory: MemoryEstimate
    stage: str


def candidates(stages: list[Stage], mini: int, forced_mb: Optional[int]) -> list[tuple[Stage, int, bool]]:
    """(stage, micro-batch, last resort) in order of their estimated slowdown (moves.STAGE_COST): the
    first that fits is the fastest setting that fits. Micro-batches below 4 sequences leave the GPU
    idle, so they are tried only in the most frugal stage."""
    small = min(mini, 4)
    out = []
    for i, st in enumerate(stages):
        last = i == len(stages) - 1
        for mb in ([forced_mb] if forced_mb else divisors_desc(mini)):
            if mb < small and not last and not forced_mb:
                break
            halvings = math.log2(mini / mb)
            out.append((st.cost() + MICRO_HALVING_COST * halvings + (1.0 if mb < small else 0.0), i, mb, st))
    return [(st, mb, i == len(stages) - 1) for _, i, mb, st in sorted(out, key=lambda c: c[:3])]


HOST_USABLE = 0.8   # of the host's RAM, for offloaded state: the OS, the data and other processes keep the rest


def search(model: ModelSpec, task: Task, base: Setting, budget: int, forced: dict[str, Any],
            cal: Calibration, host_memory: int, stages: list[Stage]) -> tuple[Optional[Found], list[str]]:
    tried: list[str] = []
    usable = host_memory * HOST_USABLE
    for stage, mb, _ in candidates(stages, task.local_mini, forced.get("micro_batch")):
        values = stage.knobs()
        if any(forced.get(k) is not None and forced[k] != v for k, v in values.items()):
            continue
        s = replace(base, micro_batch=mb, optimizer=stage.optimizer, **values)
        s = fit_rollout_and_score(model, task, s, budget, forced, cal)
        mem = estimate(model, s, task.prompt_len, task.response_len, budget, cal)
        # every process on the machine holds its own share in host memory (torchrun puts them on one host)
        host = mem.host_needed * task.world_size
        host_ok = host <= usable
        if mem.fits and host_ok:
            return Found(s, mem, stage.name), tried
        tried.append(f"{stage.name}, micro-batch {mb}: {fmt_bytes(mem.total)} ({mem.peak_phase})"
                     + ("" if host_ok else f", host RAM {fmt_bytes(host)} over the {fmt_bytes(int(usable))} usable "
                        f"({HOST_USABLE:.0%} of {fmt_bytes(host_memory)})"))
    return None, tried


def fit_rollout_and_score(model: ModelSpec, task: Task, s: Setting, budget: int, forced: dict[str, Any],
                           cal: Calibration) -> Setting:
    """Largest rollout batch and scoring micro-batch (divisors of the step's sequences) that fit."""
    seqs = task.local_sequences
    for key in ("rollout_batch", "score_micro_batch"):
        options = [forced[key]] if forced.get(key) else divisors_desc(seqs)
        for v in options:
            cand = replace(s, **{key: v})
            mem = estimate(model, cand, task.prompt_len, task.response_len, budget, cal)
            phase = "rollout" if key == "rollout_batch" else "score"
            if mem.phase_totals()[phase] <= budget or v == options[-1]:
                s = cand
                break
    return s


@dataclass(frozen=True)
class Config:
    """What is trained and how the frozen base is stored: the outer loop of the search."""
    lora: bool
    base: str                    # LoRA base storage (fp32/fp16/bf16/int8/nf4); the master dtype otherwise
    param_offload: bool          # the search may end with FSDP2 CPU offload


def configs(device: Device, task: Task, base_dtype: str, base_forced: bool) -> list[Config]:
    """Full fine-tuning, then LoRA on a base in its float storage, then on an NF4 base, then LoRA with
    every weight streamed over PCIe: fastest first."""
    out: list[Config] = []
    if not task.lora:
        out.append(Config(False, "fp32", task.lora is False))
        if task.lora is False:
            return out
    if base_forced:
        return out + [Config(True, base_dtype, base_dtype not in QUANT_BASES)]
    out.append(Config(True, base_dtype, False))
    # NF4 only: LLM.int8 rounds the activations too (the rollout's and the trainer's math would differ
    # from the float model's) and its outlier split has data-dependent shapes no CUDA graph can hold;
    # plan.base_dtype=int8 asks for it
    if quant_support(device, "nf4")[0] and device.is_cuda:
        out.append(Config(True, "nf4", False))
    return out + [Config(True, base_dtype, True)]
