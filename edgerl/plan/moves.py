"""The memory-saving moves, in one ordered list, fastest first.

The plan's search walks `STAGES` until the memory model fits; the no-fit message names the moves
on the task (`TASK_MOVES`) and LoRA that would fit; the out-of-memory advice after a run that did
not fit in practice proposes the next move after the plan's own. All three read this module, so
they cannot disagree about the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


# Rough slowdown of a step, as a share of its time, for each move: the search tries (stage,
# micro-batch) pairs in order of their summed cost, so a bigger budget never ends slower than a
# smaller one and a smaller one always gains memory. Checkpointing recomputes the update's forward
# (a third of the update, about a sixth of a step); offloads pay PCIe transfers; each halving of the
# micro-batch below the mini-batch costs launches and smaller matmuls. Relative, not measured per
# GPU: docs/benchmarks.md holds the frontier they produce on an H200.
MICRO_HALVING_COST = 0.08
STAGE_COST = {"rollout_resident": -0.05, "grad_checkpointing": 0.17, "activation_offload": 0.03, "swap_models": 0.12,
              "optimizer_offload": 0.15, "param_offload": 1.0,
              "adamw": 0.0, "adamw-bf16-sr": 0.02, "adamw-bf16": 0.03, "adamw8bit": 0.04}
# Stochastic rounding before Kahan compensation although it is less exact per step: on the CPU demo
# (24 GRPO steps, lr 1e-5, one seed each) bf16 weights with stochastic rounding learned about as fp32
# AdamW did (reward 0.13 -> 0.67 against 0.09 -> 0.73), Kahan-compensated ones much less (0.10 ->
# 0.23): the forward sees a compensated weight move only once its updates add up to half a bf16 step,
# while rounding at random moves it by the update on average (docs/benchmarks.md, CPU demo).


@dataclass(frozen=True)
class Stage:
    """A combination of the plan's memory knobs (each stage also searches the micro-batch)."""
    name: str
    grad_checkpointing: bool
    swap_models: bool
    optimizer_offload: bool
    param_offload: bool
    optimizer: str = "adamw"           # a name of memory.OPTIMIZERS
    rollout_resident: bool = False     # the rollout engine keeps weights, KV cache and graphs between steps
    activation_offload: bool = False   # checkpointed layers' inputs wait in pinned host memory (async copies)

    def knobs(self) -> dict[str, bool]:
        return {"grad_checkpointing": self.grad_checkpointing, "swap_models": self.swap_models,
                "optimizer_offload": self.optimizer_offload, "param_offload": self.param_offload,
                "rollout_resident": self.rollout_resident, "activation_offload": self.activation_offload}

    def cost(self) -> float:
        return sum(STAGE_COST[k] for k, on in self.knobs().items() if on) + STAGE_COST[self.optimizer]


STAGES = (
    Stage("the rollout engine stays resident between steps", False, False, False, False, rollout_resident=True),
    Stage("the rollout copy is freed between rollouts", False, False, False, False),
    Stage("gradient checkpointing", True, False, False, False),
    # the checkpointed layers' inputs (tokens x layers x hidden) go to pinned host memory as each layer's
    # forward ends, on a side stream, and come back one layer ahead in the backward: the copies overlap
    # compute, and at long responses these inputs are the largest saved tensor
    Stage("+ checkpointed layer inputs in pinned host memory", True, False, False, False, activation_offload=True),
    Stage("+ the reference waits in host memory outside scoring", True, True, False, False, activation_offload=True),
    # exact fp32 state over PCIe before approximate 8-bit state: offload costs ~2 x 8 bytes per parameter
    # of transfer per step, small next to a rollout on the cards that need it
    Stage("+ optimizer state in host memory between updates", True, True, True, False, activation_offload=True),
    Stage("+ 8-bit AdamW state (bitsandbytes) on the GPU", True, True, False, False, "adamw8bit",
          activation_offload=True),
    Stage("+ 8-bit AdamW state in host memory between updates", True, True, True, False, "adamw8bit",
          activation_offload=True),
    Stage("+ FSDP2 CPU offload of parameters, gradients and optimizer", True, True, True, True,
          activation_offload=True),
)

# Where bf16 weights and AdamW state can replace fp32 masters (native bf16, full fine-tuning), they
# come right after freeing the rollout copy: they cost no speed (no PCIe traffic, no recomputation),
# only precision, which Kahan compensation or stochastic rounding keeps near fp32 AdamW
# (tests/test_adamw_bf16_on_cpu.py); from then on every stage keeps the 8-byte variant, and 8-bit
# AdamW (10 bytes with its fp32 masters) is never better.
BF16_STAGES = (
    Stage("bf16 weights and AdamW state, stochastically rounded", False, False, False, False, "adamw-bf16-sr"),
    Stage("bf16 weights and AdamW state, Kahan-compensated", False, False, False, False, "adamw-bf16"),
)


# Moves on the task itself, which the plan never makes on its own: (label, config key, new value).
TASK_MOVES = (
    ("a shorter response", "rollout.max_new_tokens", lambda t: t.response_len // 2 if t.response_len > 32 else None),
    ("fewer samples", "rollout.n_samples", lambda t: t.samples_per_prompt // 2 if t.samples_per_prompt > 2 else None),
    ("one prompt per step", "train.prompts_per_step", lambda t: 1 if t.prompts_per_step > 1 else None),
)


def stages_for(optimizer: Optional[str], bnb_ok: bool, bf16_ok: bool, param_offload: bool,
               resident: Optional[bool] = None, offload_activations: Optional[bool] = None) -> list[Stage]:
    """STAGES for this run, fastest first. bf16_ok: the bf16 optimizers are allowed (native bf16, full
    fine-tuning): BF16_STAGES follow the first two and later stages use adamw-bf16-sr. 8-bit stages only
    where bitsandbytes runs and no optimizer is forced; a forced `optimizer` is used by every stage
    (duplicates dropped). `param_offload` False drops the last stage (LoRA=auto tries adapters before
    streaming every weight over PCIe). `resident` forces the rollout engine's residency either way;
    `offload_activations` False drops the activation offload (the CPU, a board whose host memory is its
    GPU's, or plan.activation_offload=false), True keeps it on wherever checkpointing is."""
    base = list(STAGES[:2]) + (list(BF16_STAGES) if bf16_ok and optimizer is None else []) + list(STAGES[2:])
    out, seen = [], set()
    for i, st in enumerate(base):
        if st.param_offload and not param_offload:
            continue
        name = st.optimizer
        if optimizer is not None:
            name = optimizer
        elif bf16_ok and i >= 2 + len(BF16_STAGES):
            if name == "adamw8bit":
                continue
            name = "adamw-bf16-sr"
        elif name == "adamw8bit" and not bnb_ok:
            continue
        knobs = st.knobs()
        if resident is not None:
            knobs["rollout_resident"] = resident
        if offload_activations is not None:
            knobs["activation_offload"] = offload_activations and knobs["grad_checkpointing"]
        key = (tuple(knobs.values()), name)
        if key in seen:
            continue
        seen.add(key)
        out.append(Stage(st.name, **{k: v for k, v in knobs.items()}, optimizer=name))
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
    mine = {k: getattr(plan, k) for k in STAGES[0].knobs()}   # each knob is also the plan's decision of that name
    bf16 = plan.optimizer.startswith("adamw-bf16")
    stages = stages_for(None, True, bf16, True)
    later = False
    for st in stages:
        # the plan's own stage, or the first that holds all its moves (the search drops a stage's moves that a
        # setting does not need, so the plan may make fewer than any stage)
        covers = all(st.knobs()[k] >= v for k, v in mine.items() if k != "rollout_resident")
        if not later and covers and (st.knobs() == mine and st.optimizer == plan.optimizer):
            later = True
            continue
        later = later or (covers and any(st.knobs()[k] > v for k, v in mine.items() if k != "rollout_resident"))
        if later and covers:
            changes = [f"--set plan.{k}={_value(v)}" for k, v in st.knobs().items() if v != mine[k]]
            if st.optimizer != plan.optimizer:
                changes.append(f"--set plan.optimizer={st.optimizer}")
            out.append(" ".join(changes))
            break
    if plan.rollout_batch > 1:
        out.append(f"--set plan.rollout_batch={max(1, plan.rollout_batch // 2)}")
    if plan.lora and plan.base_dtype == "fp32":
        out.append("--set plan.base_dtype=fp16")
    if not plan.lora:
        out.append("--set lora.enabled=true")
    out.append(f"--set {plan.task.length_key}={max(16, response_len // 2)}")
    return out
