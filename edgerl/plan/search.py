"""The plan's search: which memory-relevant setting fits the budget, fastest first.

Outer loop: what is trained and how the frozen base is stored (`configs`: full fine-tuning, LoRA on a
float base, on an NF4 base, then LoRA with parameter offload). Inner loop: (stage, micro-batch) pairs
in order of their estimated slowdown (`moves.STAGES`, `moves.STAGE_COST`), each with the largest
rollout batch and scoring micro-batch that fit; where the card's rates are known, the settings that fit are
also weighed by the step time estimate (`plan/timing.py`) and a much faster one replaces the first fit. The
setting found then drops each move it fits without. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from edgerl.plan.decisions import QUANT_BASES, quant_support
from edgerl.device.device import Device
from edgerl.plan.memory import Calibration, MemoryEstimate, Setting, estimate, fmt_bytes
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.moves import MICRO_HALVING_COST, STAGE_COST, Stage
from edgerl.plan.task import Task
from edgerl.plan.timing import output_tiles


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


@dataclass(frozen=True)
class Found:
    setting: Setting
    memory: MemoryEstimate
    stage: str
    micro: Optional["MicroCost"] = None    # how micro-batches were costed (None: per halving)
    timed: Optional["Timed"] = None        # the search by estimated step time (None: by the fixed costs)


@dataclass(frozen=True)
class Timed:
    """How the search by estimated step time (plan/timing.py) weighed the settings that fit: the seconds per step
    of the fixed order's first fit and of the fastest, each times one plus its optimizer's precision cost
    (moves.STAGE_COST), and which of the two was taken."""
    first: tuple[str, int, float]        # (stage, micro-batch, weighed seconds): the fixed order's first fit
    fastest: tuple[str, int, float]      # the same for the smallest weighed estimate
    taken: bool                          # the fastest replaced the first fit (over TIMED_MARGIN faster, or an earlier
                                         # stage of the list, fewer memory moves, at no more estimated time)


def candidates(stages: list[Stage], mini: int, forced_mb: Optional[int],
               micro: Optional["MicroCost"] = None, every: bool = False) -> list[tuple[Stage, int, bool]]:
    """(stage, micro-batch, last resort) in order of their estimated slowdown (moves.STAGE_COST): the
    first that fits is the fastest setting that fits. Without `micro` each halving of the micro-batch
    costs MICRO_HALVING_COST and micro-batches below 4 sequences, which leave the GPU idle, are tried
    only in the most frugal stage. With it (an fp32 update on a card whose rates are known) a
    micro-batch costs its extra micro-steps' fixed time, and any that fills the GPU may come first. `every`: no
    micro-batch is left out (the search by estimated time weighs them all)."""
    small = min(mini, 4)
    out = []
    for i, st in enumerate(stages):
        last = i == len(stages) - 1
        for mb in ([forced_mb] if forced_mb else divisors_desc(mini)):
            idle = mb < small and not (micro and micro.fills(mb))
            if idle and not last and not forced_mb and not every:
                break
            slower = micro.cost(mini, mb) if micro else MICRO_HALVING_COST * math.log2(mini / mb)
            out.append((st.cost() + slower + (1.0 if idle else 0.0), i, mb, st))
    return [(st, mb, i == len(stages) - 1) for _, i, mb, st in sorted(out, key=lambda c: c[:3])]


# One micro-step's fixed time beside its matmuls: host launches of eager PyTorch (forward and backward,
# some 60 kernels per layer, each paying a host launch) and, over a quantized base, dequantizing every weight to the
# compute dtype once in the forward and once in the backward (written, then read by the matmul).
LAUNCH_S_PER_LAYER = 0.5e-3
# The update's share of a step, the scale of moves.STAGE_COST (checkpointing's 0.17 is a third of it)
UPDATE_SHARE = 0.5
QUANT_CODE_BYTES = {"nf4": 0.5, "int8": 1.0}   # read per weight when dequantizing (scales left out)
FILL_WAVES = 2      # tiles per SM below which a micro-batch's matmuls leave SMs idle


@dataclass(frozen=True)
class MicroCost:
    """What a micro-batch costs an fp32 update, from the card's fp32 rate and bandwidth: one more
    micro-step's fixed time as a share of a step (`per_step`), and the tokens and width that decide
    whether its matmuls fill the GPU."""
    per_step: float
    tokens_per_sequence: int
    hidden: int
    sm_count: int
    tflops: float
    bandwidth_gbs: float

    def cost(self, mini: int, mb: int) -> float:
        return (mini // mb - 1) * self.per_step

    def fills(self, mb: int) -> bool:
        return output_tiles(mb * self.tokens_per_sequence, self.hidden) >= FILL_WAVES * self.sm_count


def micro_cost(device: Device, model: ModelSpec, task: Task, s: Setting) -> Optional[MicroCost]:
    """MicroCost for an fp32 update on a CUDA card whose fp32 rate, bandwidth and SM count are known
    (its profile, or `edgerl doctor --bench`); None otherwise (MICRO_HALVING_COST per halving). In
    16 bits tensor cores make the matmuls several times faster than any table here says."""
    measured = device.measured
    flops = (measured.fp32_tflops if measured else None) or device.fp32_tflops
    bandwidth = (measured.memory_gbs if measured else None) or device.memory_bandwidth_gbs
    if not device.is_cuda or s.compute_bytes != 4 or not flops or not bandwidth or not device.sm_count:
        return None
    params, tokens = model.n_params(), task.prompt_len + task.response_len
    # forward and backward: 2 + 4 flops per weight and token, 2 + 2 where the base is frozen (LoRA)
    compute = (4 if s.lora_params else 6) * params * task.local_mini * tokens / (flops * 1e12)
    fixed = model.num_layers * LAUNCH_S_PER_LAYER
    if not s.lora_params:   # full fine-tuning: each micro-step adds its fp32 gradients into .grad
        fixed += params * 3 * 4 / (bandwidth * 1e9)
    if s.base_quant:
        fixed += 2 * params * (2 * s.compute_bytes + QUANT_CODE_BYTES[s.base_quant]) / (bandwidth * 1e9)
    return MicroCost(UPDATE_SHARE * fixed / compute, tokens, model.hidden_size, device.sm_count, flops, bandwidth)


HOST_USABLE = 0.8   # of the host's RAM, for offloaded state: the OS, the data and other processes keep the rest


# The share of a step by which the fastest estimate must beat the fixed order's first fit to replace it: the
# estimate's error per step on the benchmark rows spans -18% to +17% (docs/benchmarks.md, Step time estimate),
# so a smaller predicted gain is not evidence enough to move off the order those rows were measured with.
TIMED_MARGIN = 0.15


def search(model: ModelSpec, task: Task, base: Setting, budget: int, forced: dict[str, Any],
            cal: Calibration, host_memory: int, stages: list[Stage],
            micro: Optional[MicroCost] = None,
            seconds: Optional[Callable[[Setting], float]] = None) -> tuple[Optional[Found], list[str]]:
    """The first (stage, micro-batch) that fits the budget and the host's memory, in the fixed order of
    `candidates`. With `seconds` (a setting's estimated seconds per step, plan/timing.py, where the card's rates
    are known) every setting that fits with no smaller micro-batch is also weighed by its seconds times one plus
    its optimizer's precision cost, and the fastest replaces the first fit where it is estimated over TIMED_MARGIN
    faster, or where it makes fewer memory moves (an earlier stage) at no more estimated time."""
    tried: list[str] = []
    usable = host_memory * HOST_USABLE

    def allowed(stage: Stage) -> bool:
        return not any(forced.get(k) is not None and forced[k] != v for k, v in stage.knobs().items())

    def fitted(stage: Stage, mb: int) -> tuple[Setting, MemoryEstimate, bool]:
        s = replace(base, micro_batch=mb, optimizer=stage.optimizer, **stage.knobs())
        s = fit_rollout_and_score(model, task, s, budget, forced, cal)
        mem = estimate(model, s, task.prompt_len, task.response_len, budget, cal)
        # every process on the machine holds its own share in host memory (torchrun puts them on one host)
        host = mem.host_needed * task.world_size
        if mem.fits and host <= usable:
            return s, mem, True
        tried.append(f"{stage.name}, micro-batch {mb}: {fmt_bytes(mem.total)} ({mem.peak_phase})"
                     + ("" if host <= usable else f", host RAM {fmt_bytes(host)} over the {fmt_bytes(int(usable))} "
                        f"usable ({HOST_USABLE:.0%} of {fmt_bytes(host_memory)})"))
        return s, mem, False

    def leanest(found: Found) -> Found:
        """`found` without the moves it does not need: each memory move the stage turned on (and nothing forced)
        is turned off where the setting still fits without it, costliest first. A stage turns its moves on
        together, and at short lengths the checkpointed inputs (activation offload) or the reference (LoRA has
        none apart from its base) may be too small to lower the peak: then the move costs time for nothing."""
        s, mem = found.setting, found.memory
        for knob in ("param_offload", "optimizer_offload", "swap_models", "activation_offload"):
            if not getattr(s, knob) or forced.get(knob) is not None:
                continue
            if knob == "optimizer_offload" and s.param_offload:
                continue        # FSDP2's CPU offload holds the optimizer state in host memory itself
            lean = replace(s, **{knob: False})
            lean_mem = estimate(model, lean, task.prompt_len, task.response_len, budget, cal)
            if lean_mem.fits and lean_mem.host_needed * task.world_size <= usable:
                s, mem = lean, lean_mem
        return found if s is found.setting else replace(found, setting=s, memory=mem)

    first: Optional[Found] = None
    for stage, mb, _ in candidates(stages, task.local_mini, forced.get("micro_batch"), micro):
        if allowed(stage):
            s, mem, ok = fitted(stage, mb)
            if ok:
                first = Found(s, mem, stage.name, micro)
                break
    if first is None or seconds is None:
        return (leanest(first) if first else None), tried

    def weigh(s: Setting) -> float:
        return seconds(s) * (1 + STAGE_COST[s.optimizer])

    # a setting's seconds with the largest rollout batch and scoring micro-batch bound its seconds once they are
    # fitted from below (fewer rows per pass only add time): weigh the cheapest bound first, and stop when no
    # bound left can beat the best
    seqs = task.local_sequences
    bounds = []
    for i, (stage, mb, _) in enumerate(candidates(stages, task.local_mini, forced.get("micro_batch"), every=True)):
        # no micro-batch below the first fit's: a micro-step's fixed costs are the estimate's least measured part
        # (the NF4 update's ran up to twice its estimate), and the fixed order costs micro-batches on its own
        if allowed(stage) and mb >= first.setting.micro_batch:
            widest = replace(base, micro_batch=mb, optimizer=stage.optimizer, **stage.knobs(),
                             rollout_batch=forced.get("rollout_batch") or seqs,
                             score_micro_batch=forced.get("score_micro_batch") or seqs)
            bounds.append((weigh(widest), i, stage, mb))
    ahead = weigh(first.setting)
    best = (ahead, first)
    for bound, _, stage, mb in sorted(bounds, key=lambda b: b[:2]):
        if bound >= best[0]:
            break
        if (stage.name, mb) == (first.stage, first.setting.micro_batch):
            continue
        s, mem, ok = fitted(stage, mb)
        weighed = weigh(s) if ok else best[0]
        if weighed < best[0]:
            best = (weighed, Found(s, mem, stage.name))
    fastest = best[1]
    # more than the margin faster, or fewer memory moves at no more estimated time
    index = {st.name: i for i, st in enumerate(stages)}
    taken = best[0] < (1 - TIMED_MARGIN) * ahead or (index[fastest.stage] < index[first.stage] and best[0] <= ahead)
    timed = Timed((first.stage, first.setting.micro_batch, ahead), (fastest.stage, fastest.setting.micro_batch,
                  best[0]), taken)
    return replace(leanest(fastest if taken else first), timed=timed), tried


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
            if mem.phase_totals().get(phase, 0) <= budget or v == options[-1]:
                s = cand
                break
    return s


@dataclass(frozen=True)
class Candidate:
    """What is trained and how the frozen base is stored: the outer loop of the search."""
    lora: bool
    base: str                    # LoRA base storage (fp32/fp16/bf16/int8/nf4); the master dtype otherwise
    param_offload: bool          # the search may end with FSDP2 CPU offload


def trained_and_base(device: Device, task: Task, base_dtype: str, base_forced: bool) -> list[Candidate]:
    """Full fine-tuning, then LoRA on a base in its float storage, then on an NF4 base, then LoRA with
    every weight streamed over PCIe: fastest first."""
    out: list[Candidate] = []
    if not task.lora:
        out.append(Candidate(False, "fp32", task.lora is False))
        if task.lora is False:
            return out
    if base_forced:
        return out + [Candidate(True, base_dtype, base_dtype not in QUANT_BASES)]
    out.append(Candidate(True, base_dtype, False))
    # NF4 only: LLM.int8 rounds the activations too (the rollout's and the trainer's math would differ
    # from the float model's) and its outlier split has data-dependent shapes no CUDA graph can hold;
    # plan.base_dtype=int8 asks for it
    if quant_support(device, "nf4")[0] and device.is_cuda:
        out.append(Candidate(True, "nf4", False))
    return out + [Candidate(True, base_dtype, True)]
