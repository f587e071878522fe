"""`plan()`: how to train on this device. Pure: same inputs, same plan, no I/O.

Each decision is a row of `plan/table.py` whose step (`plan/steps.py`) makes it and gives its reason;
the memory-relevant knobs come from one search (`search.py`), which walks `moves.STAGES` from the
fastest setting to the most frugal until the memory model fits the budget. `doctor`, `recommend`,
`train` and the README print this `Plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Optional

from edgerl.core.errors import PlanError
from edgerl.device.device import GiB, Device
from edgerl.plan import table
from edgerl.plan.ctx import Ctx, NoFit
from edgerl.plan.decisions import fp16_overflow, quant_support
from edgerl.plan.memory import DEFAULT_CALIBRATION, Calibration, MemoryEstimate, fmt_bytes
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.moves import TASK_MOVES
from edgerl.plan.steps import memory
from edgerl.plan.task import Task


@dataclass(frozen=True)
class Plan:
    """The decisions (`values`, by name in the table's order, each also an attribute: `plan.dtype`),
    their reasons, and the memory estimate of the setting they make."""
    device: Device
    model: ModelSpec
    task: Task
    memory: MemoryEstimate
    values: dict[str, Any]
    reasons: dict[str, str]

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"Plan has no decision {name!r} (decisions: {', '.join(values)})")

    @property
    def DECISIONS(self) -> tuple[str, ...]:
        return tuple(self.values)

    def value(self, key: str) -> Any:
        """A decision's value as plan.json holds it."""
        return table.rows()[key].as_json(self.values[key])

    def decisions(self) -> dict[str, Any]:
        return {k: self.value(k) for k in self.values}

    def to_dict(self) -> dict[str, Any]:
        return {"device": _device_dict(self.device), "model": dataclasses.asdict(self.model)
                | {"n_params": self.model.n_params()},
                "task": dataclasses.asdict(self.task), "plan": self.decisions(),
                "reasons": {k: self.reasons.get(k, "") for k in self.values},
                "memory": self.memory.to_dict() | {"headroom_bytes": self.headroom},
                "effective_batch": self.task.effective_batch()}


def _device_dict(d: Device) -> dict[str, Any]:
    out = dataclasses.asdict(d)
    out["software"] = {"python": d.software.python, "torch": d.software.torch,
                       "torch_cuda": d.software.torch_cuda, "arch_list": list(d.software.arch_list),
                       "libs": dict(d.software.libs)}
    return out


def plan(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]] = None,
         calibration: Calibration = DEFAULT_CALIBRATION) -> Plan:
    """The plan for `task` on `device`. `overrides` holds [plan] keys (None = decide) plus
    `micro_batch`. Raises PlanError when nothing fits, saying what would."""
    return _plan(device, model, task, overrides, calibration, explain=True)


def _plan(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]],
          calibration: Calibration, explain: bool) -> Plan:
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    c = Ctx(device, model, task, o, calibration, explain, table.rows())
    known = {r.config_key for r in c.rows.values()}
    for key in sorted(set(o) - known):
        if key in table.RETIRED:
            raise PlanError(f"plan.{key} no longer exists; {table.RETIRED[key]}")
        raise PlanError(f"unknown plan override {key} (known: {', '.join(sorted(known))})")
    _check_world(task, o)
    try:
        for name in c.rows:
            c[name]
    except NoFit as e:
        if not explain:
            raise
        raise PlanError(no_fit_message(c, e.limit, e.attempts)) from None
    values = {name: c.values[name] for name in c.rows}
    return Plan(device=device, model=model, task=task, memory=memory(c), values=values,
                reasons={name: c.reasons[name] for name in c.rows})


def _check_world(task: Task, o: dict[str, Any]) -> None:
    """The global batch must split evenly over the GPUs: whole prompts (a GRPO group stays on one GPU)
    and whole mini-batches per GPU."""
    w = task.world_size
    if w < 1:
        raise PlanError(f"world size {w}: at least one GPU")
    if w == 1:
        return
    if task.prompts_per_step % w:
        raise PlanError(f"train.prompts_per_step={task.prompts_per_step} does not split over {w} GPUs (each GPU "
                        f"generates whole groups of prompts); use a multiple of {w}")
    if task.mini % w or (task.local_sequences % task.local_mini):
        raise PlanError(f"train.mini_batch={task.mini} does not split over {w} GPUs; use a multiple of {w} that "
                        f"divides the {task.sequences} sequences per step")
    if o.get("micro_batch") and task.local_mini % o["micro_batch"]:
        raise PlanError(f"train.micro_batch={o['micro_batch']} must divide the mini-batch of {task.local_mini} per "
                        f"GPU ({task.mini} over {w} GPUs)")


def no_fit_message(c: Ctx, budget: int, attempts: list) -> str:
    """What would fit, when nothing does: smaller task moves, LoRA, a 4-bit base, a bigger GPU."""
    device, model, task, o, cal = c.device, c.model, c.task, c.o, c.calibration
    _, _, tried = attempts[-1]
    lines = [f"{model.name} does not fit on {device.describe()} for this task "
             f"({task.effective_batch()}; prompt {task.prompt_len} + {task.length_word} {task.response_len} tokens); "
             f"budget {fmt_bytes(budget)}. Most frugal setting tried: {tried[-1] if tried else 'none'}.",
             "What would fit:"]
    found_any = False

    def fits(**changes: Any) -> bool:
        return fits_on(device, model, replace(task, **changes), o, cal)

    fields = {"rollout.max_new_tokens": "response_len", "rollout.n_samples": "samples_per_prompt",
              "train.prompts_per_step": "prompts_per_step"}
    longest, _ = longest_response(device, model, task, o, cal)
    if 0 < longest < task.response_len:
        lines.append(f"  - the longest {task.length_word} that fits this task here: {longest} tokens "
                     f"(--set {task.length_key}={longest})")
        found_any = True
    for label, key, smaller in TASK_MOVES:
        if key == "rollout.max_new_tokens" and longest:
            continue
        if key == "rollout.max_new_tokens" and task.episodes:   # an episode's length is its budget
            label, key, fields[task.length_key] = f"a shorter {task.length_word}", task.length_key, "response_len"
        value = smaller(task)
        if value is not None and fits(**{fields[key]: value}):
            lines.append(f"  - {label}: --set {key}={value}")
            found_any = True
    if not task.lora and task.lora is not None and fits(lora=True):
        lines.append(f"  - LoRA adapters (r={task.lora_rank}): --set lora.enabled=true")
        found_any = True
    if task.lora is not False and not device.software.has("bitsandbytes") and device.is_cuda and not o.get("base_dtype"):
        libs = device.software.libs + (("bitsandbytes", "0.50"),)
        with_bnb = replace(device, software=replace(device.software, libs=libs))
        if quant_support(with_bnb, "nf4")[0] and fits_on(with_bnb, model, replace(task, lora=True), o, cal):
            lines.append("  - a 4-bit (NF4) frozen base with LoRA, once bitsandbytes is installed: pip install "
                         "bitsandbytes, then --set lora.enabled=true (the plan picks NF4 when a float base does "
                         "not fit)")
            found_any = True
    if device.is_cuda:
        from edgerl.device.profiles import device_from_profile, list_profiles
        bigger = sorted((p for p in list_profiles() if p.kind == "cuda" and p.memory_bytes > device.total_memory
                         and p.integrated == device.integrated),
                        key=lambda p: p.memory_bytes)
        for p in bigger:
            if fits_on(device_from_profile(p, device.software, device.host_memory), model, task, o, cal):
                lines.append(f"  - a bigger GPU: {p.display} ({p.memory_bytes / GiB:.0f} GiB, profile {p.name})")
                found_any = True
                break
    if not found_any:
        lines.append("  - nothing close: a smaller model")
    why = fp16_overflow(c)
    if why is not None:   # fp32 was forced by the model's own range: that comes first, in one line
        return (f"{model.name} must compute in fp32 on {device.describe()}: {why}; in fp32 it does not fit this "
                f"task (budget {fmt_bytes(budget)}). What would fit: "
                + "; ".join(line.strip().removeprefix("- ") for line in lines[2:]))
    return "\n".join(lines)


def fits_on(device: Device, model: ModelSpec, task: Task, o: dict[str, Any], cal: Calibration) -> bool:
    try:
        _plan(device, model, task, o, cal, explain=False)
        return True
    except PlanError:
        return False


# The longest response a task can generate and train on here: memory grows with the response length in
# every phase (KV cache, activations, log-prob pass), so whether a plan exists is monotone in it, and a
# binary search over multiples of STEP finds the longest length that fits. `recommend` prints it; a plan
# that does not fit names it.

STEP = 64   # lengths are searched in multiples of this many tokens


def longest_response(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]] = None,
                     cal: Calibration = DEFAULT_CALIBRATION) -> tuple[int, int]:
    """(the longest response length, a multiple of STEP, for which the plan finds a setting that fits this
    task here, 0 when not even STEP tokens fit; the model's context limit on the response, which caps it)."""
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    context = max(STEP, model.max_position - task.prompt_len - task.turn_len)
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
    """One line for `recommend`: the longest response (an episode's budget) that fits, with what caps it."""
    n, context = longest_response(device, model, task, overrides, cal)
    what = f"longest {task.length_word} that fits"
    if task.episodes:
        what += f" (its turns of up to {task.turn_len} tokens and what comes between them)"
    if n == 0:
        return f"{what}: none (not even {STEP} tokens after a {task.prompt_len}-token prompt)"
    if n >= context - context % STEP:
        return (f"{what}: {n} tokens (the model's context of {model.max_position} tokens, less the "
                f"{task.prompt_len}-token prompt{' and a turn' if task.episodes else ''}, ends it before memory does)")
    p = plan(device, model, replace(task, response_len=n), overrides, cal)
    how = ("full fine-tuning" if not p.lora else f"LoRA on a {p.base_dtype} base") + (
        f", micro-batch {p.micro_batch}, rollout batch {p.rollout_batch}"
        + (", checkpointing" if p.grad_checkpointing else "")
        + (" with the layer inputs in host memory" if p.activation_offload else ""))
    return (f"{what}: {n} tokens (after a {task.prompt_len}-token prompt, "
            f"{task.effective_batch().split(';')[0]}; at that length the plan trains with {how})")
