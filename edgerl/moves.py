"""The memory-saving moves, in one ordered list, fastest first.

The plan's search walks `STAGES` until the memory model fits; the no-fit message names the moves
on the task (`TASK_MOVES`) and LoRA that would fit; the out-of-memory advice after a run that did
not fit in practice proposes the next move after the plan's own. All three read this module, so
they cannot disagree about the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Stage:
    """A combination of the plan's memory knobs (each stage also searches the micro-batch)."""
    name: str
    grad_checkpointing: bool
    swap_models: bool
    optimizer_offload: bool
    param_offload: bool
    eight_bit: bool

    def knobs(self) -> dict[str, bool]:
        return {"grad_checkpointing": self.grad_checkpointing, "swap_models": self.swap_models,
                "optimizer_offload": self.optimizer_offload, "param_offload": self.param_offload}


STAGES = (
    Stage("none", False, False, False, False, False),
    Stage("gradient checkpointing", True, False, False, False, False),
    Stage("+ the reference waits in host memory outside scoring", True, True, False, False, False),
    # exact fp32 state over PCIe before approximate 8-bit state: offload costs ~2 x 8 bytes per parameter
    # of transfer per step, small next to a rollout on the cards that need it
    Stage("+ optimizer state in host memory between updates", True, True, True, False, False),
    Stage("+ 8-bit AdamW state (bitsandbytes) on the GPU", True, True, False, False, True),
    Stage("+ 8-bit AdamW state in host memory between updates", True, True, True, False, True),
    Stage("+ FSDP2 CPU offload of parameters, gradients and optimizer", True, True, True, True, False),
)

# Moves on the task itself, which the plan never makes on its own: (label, config key, new value).
TASK_MOVES = (
    ("a shorter response", "rollout.max_new_tokens", lambda t: t.response_len // 2 if t.response_len > 32 else None),
    ("fewer samples", "rollout.n_samples", lambda t: t.samples_per_prompt // 2 if t.samples_per_prompt > 2 else None),
    ("one prompt per step", "train.prompts_per_step", lambda t: 1 if t.prompts_per_step > 1 else None),
)


def stages_for(optimizer: Optional[str], bnb_ok: bool, param_offload: bool) -> list[Stage]:
    """STAGES for this run: 8-bit ones only where bitsandbytes runs and plan.optimizer is not adamw;
    with plan.optimizer=adamw8bit every stage uses it (duplicates dropped); `param_offload` False drops
    the last stage (LoRA=auto tries adapters before streaming every weight over PCIe)."""
    out, seen = [], set()
    for st in STAGES:
        if st.param_offload and not param_offload:
            continue
        if optimizer == "adamw" and st.eight_bit or optimizer is None and st.eight_bit and not bnb_ok:
            continue
        key = tuple(st.knobs().values())
        if optimizer == "adamw8bit":
            if key in seen:
                continue
            st = Stage(st.name, *key, True)
        seen.add(key)
        out.append(st)
    return out


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def next_moves(plan: Any, response_len: int) -> list[str]:
    """What to change after a plan that fit on paper ran out of memory in practice, as --set overrides,
    the nearest move first: a smaller micro-batch, then the next stage after the plan's own, a smaller
    rollout batch, a smaller LoRA base, LoRA, then a shorter response."""
    out: list[str] = []
    if plan.micro_batch > 1:
        out.append(f"--set train.micro_batch={max(1, plan.micro_batch // 2)}")
    mine = {"grad_checkpointing": plan.grad_checkpointing, "swap_models": plan.swap_models,
            "optimizer_offload": plan.optimizer_offload, "param_offload": plan.param_offload}
    eight = plan.optimizer == "adamw8bit"
    later = False
    for st in STAGES:
        if st.knobs() == mine and st.eight_bit == eight:
            later = True
            continue
        if later and all(st.knobs()[k] >= v for k, v in mine.items()) and (st.eight_bit or not eight):
            changes = [f"--set plan.{k}={_value(v)}" for k, v in st.knobs().items() if v != mine[k]]
            if st.eight_bit and not eight:
                changes.append("--set plan.optimizer=adamw8bit")
            out.append(" ".join(changes))
            break
    if plan.rollout_batch > 1:
        out.append(f"--set plan.rollout_batch={max(1, plan.rollout_batch // 2)}")
    if plan.lora and plan.base_dtype == "fp32":
        out.append("--set plan.base_dtype=fp16")
    if not plan.lora:
        out.append("--set lora.enabled=true")
    out.append(f"--set rollout.max_new_tokens={max(16, response_len // 2)}")
    return out
