"""What a run keeps and restores, as functions over an explicit `TrainState`: checkpoints (save,
resume), the final export, and the last good state saved when a step fails.

A checkpoint holds every weight that trains (under LoRA the adapter only, in peft's format), the
optimizer and schedule of each learner, the data position, every RNG, the KL controller, the
gradient scaler, the config and the plan (edgerl/checkpoint.py writes the folder atomically).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import torch.distributed as dist

from edgerl.train import checkpoint
from edgerl.train import ranks
from edgerl.models import lora as lora_io
from edgerl.core.errors import CheckpointError, TrainingError
from edgerl.plan.memory import fmt_bytes
from edgerl.train.update import Learner


@dataclass
class LoopState:
    """Where the loop is: the step, the data position, the RNG and the KL controller."""
    step: int
    sampler: Any                       # data.PromptSampler
    gen: torch.Generator               # sampling seeds and mini-batch order
    kl_ctl: Any                        # algos.FixedKL | algos.AdaptiveKL
    scaler: Optional[torch.amp.GradScaler]
    bad_in_a_row: int = 0
    skipped_total: int = 0

    def snapshot(self) -> dict[str, Any]:
        """What a failed step must roll back before the last good state is saved."""
        return {"sampler": self.sampler.state_dict(), "rng": checkpoint.rng_state(self.gen)}

    def roll_back(self, snap: dict[str, Any]) -> None:
        self.sampler.load_state_dict(snap["sampler"])
        checkpoint.set_rng_state(snap["rng"], self.gen)


@dataclass
class TrainState:
    actor: Learner
    critic: Optional[Learner]
    loop: LoopState
    lora: bool
    meta: dict[str, Any] = field(default_factory=dict)   # config and plan, written into every checkpoint


def _full() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _learner_tensors(ln: Learner, lora: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    if lora:
        return lora_io.trainable_state(ln.model)
    return get_model_state_dict(ln.model, options=_full())


def _learner_state(ln: Learner) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return {"optim": ln.offload.state_dict(lambda: get_optimizer_state_dict(ln.model, ln.optim, options=_full())),
            "sched": ln.sched.state_dict()}


def save(run_dir: Path, st: TrainState, keep_last: int, is_writer: bool, log: Callable[[str], None],
         keep_best: bool = False, score: Optional[float] = None) -> Optional[Path]:
    """Write a checkpoint of `st` (every rank calls this: the state dicts are gathered collectively;
    the writer writes), with `score`, the step's held-out score if it was evaluated (edgerl.train.retention
    ranks checkpoints by it). Returns the folder on the writer, None elsewhere."""
    files: dict[str, bytes] = {}
    if st.lora:  # the frozen base is the model's own: only the adapter, in peft's format
        tensors = {"adapter_model": lora_io.adapter_state(st.actor.model)}
        files["adapter_config.json"] = lora_io.adapter_config_json(st.actor.model)
    else:
        tensors = {"actor": _learner_tensors(st.actor, False)}
    a = _learner_state(st.actor)
    state: dict[str, Any] = {"optim": a["optim"], "sched": a["sched"]}
    if st.critic is not None:
        tensors["critic"] = _learner_tensors(st.critic, st.lora)
        c = _learner_state(st.critic)
        state["critic_optim"], state["critic_sched"] = c["optim"], c["sched"]
    lp = st.loop
    rngs = ranks.gather(checkpoint.rng_state(lp.gen))   # every rank samples with its own generator
    state["train"] = {"step": lp.step, "sampler": lp.sampler.state_dict(), "rng": rngs[0], "rng_by_rank": rngs,
                      "world_size": len(rngs), "kl_ctl": lp.kl_ctl.state_dict(), "bad_in_a_row": lp.bad_in_a_row,
                      "scaler": lp.scaler.state_dict() if lp.scaler is not None else None}
    bad = ranks.agree(lambda: non_finite(tensors), is_writer)
    if bad:
        raise TrainingError(f"the weights after step {lp.step} hold NaN or infinite values ({_names(bad)}): not "
                            f"saved, so {last_good(run_dir)}")
    # every rank waits for the writer (and raises its error): under torchrun a rank that exits first, on a
    # signal or a failure, makes torchrun stop the others, the writer in the middle of its write included
    meta = {"step": lp.step, **({"eval_score": score} if score is not None else {}), **st.meta}
    folder = ranks.agree(lambda: checkpoint.save(run_dir, lp.step, tensors, state, meta, keep_last, files,
                                                 keep_best=keep_best), is_writer)
    if not is_writer:
        return None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    log(f"checkpoint: {folder} ({fmt_bytes(size)})")
    return folder


def export_bytes(lm: torch.nn.Module) -> int:
    """The bytes of `lm`'s weights as an HF folder stores them (tied weights once, as parameters() lists them)."""
    return sum(p.numel() * p.element_size() for p in lm.parameters())


def checkpoint_bytes(st: TrainState, optimizer: str) -> tuple[int, int]:
    """(weights, optimizer state) in bytes of one checkpoint of `st`, before any is written: the tensors
    `save` writes (tied weights twice, as safetensors stores them), and the optimizer's state bytes per
    trainable parameter (memory.OPTIMIZERS)."""
    from edgerl.plan.memory import OPTIMIZERS
    weights = trainable = 0
    for ln in (st.actor, st.critic):
        if ln is None:
            continue
        params = [p for p in ln.model.parameters() if p.requires_grad]
        trainable += sum(p.numel() for p in params)
        if st.lora:
            weights += sum(p.numel() * p.element_size() for p in params)
        else:
            weights += sum(t.numel() * t.element_size() for t in ln.model.state_dict().values()
                           if isinstance(t, torch.Tensor))
    return weights, trainable * OPTIMIZERS[optimizer].state


def non_finite(tensors: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """'file/tensor' names of the floating-point tensors holding NaN or infinity."""
    return [f"{name}/{k}" for name, sd in tensors.items() for k, v in sd.items()
            if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def _names(bad: list[str]) -> str:
    return ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def last_good(run_dir: Path) -> str:
    """Where a run whose weights went bad goes on from: its latest checkpoint, kept as it was."""
    latest = checkpoint.latest(run_dir)
    if latest is None:
        return (f"no checkpoint of {run_dir} holds good weights; start again (--out {run_dir} --restart) with a "
                "lower train.lr, or plan.dtype=fp32 if fp16 overflowed")
    return (f"the last good checkpoint stays: {latest}; resume from it with a lower learning rate "
            f"(edgerl train --resume {run_dir} --set train.lr=...), or plan.dtype=fp32 if fp16 overflowed")


def restore(folder: Path, st: TrainState, log: Callable[[str], None], seed: int = 0) -> dict[str, Any]:
    """Load a checkpoint written by `save` into `st` (weights, optimizers, schedules, loop state), on this
    run's number of processes whatever the checkpoint's; returns its meta.json. Its files and weights were
    checked before the run folder was touched (runfolder.check_resume), and what this run changed against
    it (resume.check)."""
    from edgerl.models.full_state import set_full_model_state, set_full_optimizer_state
    tensors, state, meta = checkpoint.load(folder)
    saved_world, world = state["train"].get("world_size", 1), ranks.world()
    kind = "adapter_model" if st.lora else "actor"
    if kind not in tensors:
        raise CheckpointError(
            f"{folder} holds {'a LoRA adapter' if 'adapter_model' in tensors else 'full weights'}, but this run "
            f"{'trains LoRA' if st.lora else 'trains every weight'}; resume with the lora.enabled the run had")
    try:
        if st.lora:
            lora_io.load_adapter_state(st.actor.model, tensors["adapter_model"], str(folder))
        else:
            set_full_model_state(st.actor.model, tensors["actor"])
        set_full_optimizer_state(st.actor.model, st.actor.optim, state["optim"])
        st.actor.sched.load_state_dict(state["sched"])
        if st.critic is not None:
            if "critic" not in tensors:
                raise CheckpointError(f"{folder} has no critic; it was not a PPO (gae) run")
            if st.lora:
                lora_io.load_trainable(st.critic.model, tensors["critic"], f"{folder} (critic)")
            else:
                set_full_model_state(st.critic.model, tensors["critic"])
            set_full_optimizer_state(st.critic.model, st.critic.optim, state["critic_optim"])
            st.critic.sched.load_state_dict(state["critic_sched"])
    except (ValueError, KeyError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{folder} does not match this run's model or optimizer ({first}); resume with the "
                              "model, LoRA settings and optimizer the run was started with") from None
    for ln in (st.actor, st.critic):
        if ln is not None:
            ln.offload.to_host()
    tr, lp = state["train"], st.loop
    lp.step = tr["step"]
    lp.sampler.load_state_dict(tr["sampler"])   # the global prompt order: the same whatever the world size
    rank = dist.get_rank() if world > 1 else 0
    if saved_world == world:
        checkpoint.set_rng_state(tr.get("rng_by_rank", [tr["rng"]])[rank], lp.gen)
    else:
        # The weights and optimizer states are full state dicts, so they load into any number of shards;
        # the sampling streams were one per process and cannot be split or merged, so every rank starts a
        # new one from the seed, the step and its rank (the same on every resume to this world size).
        checkpoint.set_rng_state(tr["rng"])
        lp.gen.manual_seed(reseed(seed, lp.step, rank))
    # the coefficient reached so far; an adaptive controller's target and horizon are the config's
    lp.kl_ctl.value = float(tr["kl_ctl"]["value"])
    lp.bad_in_a_row = tr["bad_in_a_row"]
    if lp.scaler is not None and tr.get("scaler"):
        lp.scaler.load_state_dict(tr["scaler"])
    log(f"resumed from {folder} at step {lp.step}")
    if saved_world != world:
        log(f"resumed on {world} process(es) from a checkpoint written by {saved_world}: weights and optimizer "
            f"state re-sharded from its full state dicts, the prompt order continues where it stopped, and "
            f"each rank's sampling stream restarts from train.seed={seed}, the step and the rank")
    return meta


def reseed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of `rank` after a resume on another number of processes."""
    return (seed * 1_000_003 + step * 1_009 + rank) % 2**63


def failed_step(st: TrainState, before_steps: int, snap: dict[str, Any],
                save_fn: Callable[[], Optional[Path]]) -> str:
    """After a step raised: save the last good state if the optimizer had not stepped yet (the weights
    are still those after the previous step), rolling the data position and RNG back to it.
    Returns one line saying what was saved."""
    if st.loop.step == 0:
        return "no checkpoint written (no step had completed)"
    if st.actor.optimizer_steps() != before_steps:
        return "no checkpoint written (the optimizer had already stepped this step)"
    st.loop.roll_back(snap)
    folder = save_fn()
    return f"saved the last good state (step {st.loop.step}) to {folder}"
