"""The longest response a task can generate and train on here: the plan's search, run at each length.

Memory grows with the response length in every phase (KV cache, activations, log-prob pass), so
whether a plan exists is monotone in it, and a binary search over multiples of STEP finds the
longest length that fits. `recommend` prints it; a plan that does not fit names it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from edgerl.device.device import Device
from edgerl.plan.memory import DEFAULT_CALIBRATION, Calibration
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.task import Task

STEP = 64   # lengths are searched in multiples of this many tokens


def longest_response(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]] = None,
                     cal: Calibration = DEFAULT_CALIBRATION) -> tuple[int, int]:
    """(the longest response length, a multiple of STEP, for which the plan finds a setting that fits this
    task here, 0 when not even STEP tokens fit; the model's context limit on the response, which caps it)."""
    from edgerl.plan.plan import fits_on
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    context = max(STEP, model.max_position - task.prompt_len)
    lo, hi = 0, context // STEP        # lo fits (0: nothing tried yet), hi + 1 is past the context

    def fits(k: int) -> bool:
        return fits_on(device, model, replace(task, response_len=k * STEP), o, cal)

    if not fits(1):
        return 0, context
    lo = 1
    if fits(hi):
        return hi * STEP, context
    while hi - lo > 1:                 # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * STEP, context


def longest_line(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]] = None,
                 cal: Calibration = DEFAULT_CALIBRATION) -> str:
    """One line for `recommend`: the longest response that fits, with what caps it."""
    n, context = longest_response(device, model, task, overrides, cal)
    if n == 0:
        return f"longest response that fits: none (not even {STEP} tokens after a {task.prompt_len}-token prompt)"
    if n >= context - context % STEP:
        return (f"longest response that fits: {n} tokens (the model's context of {model.max_position} tokens, less the "
                f"{task.prompt_len}-token prompt, ends it before memory does)")
    from edgerl.plan.plan import plan
    p = plan(device, model, replace(task, response_len=n), overrides, cal)
    how = ("full fine-tuning" if not p.lora else f"LoRA on a {p.base_dtype} base") + (
        f", micro-batch {p.micro_batch}, rollout batch {p.rollout_batch}"
        + (", checkpointing" if p.grad_checkpointing else "")
        + (" with the layer inputs in host memory" if p.activation_offload else ""))
    return (f"longest response that fits: {n} tokens (after a {task.prompt_len}-token prompt, "
            f"{task.effective_batch().split(';')[0]}; at that length the plan trains with {how})")
