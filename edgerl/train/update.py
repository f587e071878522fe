"""One PPO update, shared by the actor and the critic.

    for each epoch, for each mini-batch:
        for each micro-batch: loss -> skip the mini-batch if any rank's loss is not finite
                              -> backward(loss x its share of the mini-batch loss)
        clip gradients -> optimizer step (the offloaded state comes back for it) -> free gradients

The micro-batch weights make the accumulated gradient equal the mini-batch's (algos.accumulation_weight).
Under torchrun each rank holds its share of every mini-batch: the weights count the whole mini-batch
over all ranks, and FSDP2's gradient reduction (a mean over ranks) is undone by scaling with the
world size, so N processes take the step one process would take on the same rollouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from edgerl import algos
from edgerl.train import ranks
from edgerl.train.experience import Experience, micro_batches, token_micro_batches
from edgerl.train.optim import StateOffload


@dataclass
class Learner:
    """A model that trains: its optimizer, learning-rate schedule and optimizer-state offload."""
    name: str                              # "actor" or "critic": the metrics prefix
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    offload: StateOffload

    def optimizer_steps(self) -> int:
        """Steps taken so far (read from the optimizer's state): tells whether this step already stepped."""
        st = self.optim.state
        return sum(int(s.get("step", 0)) for s in st.values() if isinstance(s, dict)) if st else 0


@dataclass
class UpdateResult:
    stats: dict[str, float] = field(default_factory=dict)   # averaged over the mini-batches that stepped
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0                                          # mini-batches whose loss was not finite
    skipped_norm: int = 0                                     # ... whose gradient norm was not finite
    scaler_skipped: int = 0                                   # optimizer steps the fp16 scaler skipped (its
                                                              # scaled gradients overflowed; it lowered the scale)


LossFn = Callable[[Experience, int], tuple[torch.Tensor, dict[str, float]]]


def mini_batches(exp: Experience, mini: int, epochs: int, gen: torch.Generator,
                 keep: Optional[torch.Tensor] = None) -> Iterator[tuple[int, Experience, Optional[torch.Tensor]]]:
    """(epoch, mini-batch, its rows of `keep`) for every PPO epoch; rows are reshuffled each epoch when a
    step holds more than one mini-batch. A mini-batch keeps its rows in rollout order, so the samples of
    a prompt that it holds sit together and a micro-batch computes their prompt once (edgerl/packing.py)."""
    for epoch in range(epochs):
        order = torch.randperm(len(exp), generator=gen) if mini < len(exp) else torch.arange(len(exp))
        for m0 in range(0, len(exp), mini):
            idx = order[m0:m0 + mini].sort().values
            yield epoch, exp.rows(idx), keep[idx] if keep is not None else None


def zero_gradients(learner: Learner, scaler: Optional[torch.amp.GradScaler], device: torch.device) -> None:
    """The gradients a mini-batch of zero-loss rows leaves: zeros (not None: the optimizer still steps,
    its moments decay and weight decay applies, as they would after computing those rows)."""
    for p in learner.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if scaler is not None:
        scaler.scale(torch.zeros((), device=device))   # the scaler's state is made on its first scale()


def finite_everywhere(loss: torch.Tensor) -> bool:
    """True when the loss is finite on every rank: all ranks must skip together, or FSDP2's
    collectives in the next backward would wait forever."""
    ok = torch.tensor([float(torch.isfinite(loss).all())], device=loss.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def optimizer_step(learner: Learner, max_grad_norm: float, scaler: Optional[torch.amp.GradScaler]) -> Optional[float]:
    """Clip, step (through the fp16 scaler when there is one), free the gradients. Returns the norm, or
    None when the step was skipped because the norm was not finite.

    A NaN or infinite norm with finite losses means the weights or activations have blown up: clipping
    would multiply the gradients by 0 (inf * 0 = NaN), and the step would write NaN into every weight,
    so it is skipped. Under the fp16 loss scaler an overflow is the scaler's business (it skips the
    step and halves the scale); it counts as a skipped update only once the scale is already at or
    below 1, when the unscaled gradients themselves overflow. The norm is the same on every rank
    (FSDP2's is the global norm), so every rank skips together."""
    params = [p for p in learner.model.parameters() if p.grad is not None]
    if scaler is not None:
        scaler.unscale_(learner.optim)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    finite = math.isfinite(norm)
    if not finite and (scaler is None or scaler.get_scale() <= 1.0):
        learner.optim.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()   # the scaler saw the overflow in unscale_; it lowers the scale as usual
        return None
    with learner.offload.resident():  # offloaded state comes back for the step only
        if scaler is not None:
            scaler.step(learner.optim)
            scaler.update()
        else:
            learner.optim.step()
    learner.optim.zero_grad(set_to_none=True)  # gradients are dead weight during the next rollout
    return norm if finite else float("nan")


def run_update(learner: Learner, exp: Experience, loss_fn: LossFn, *, mini: int, epochs: int, micro: int,
               agg: str, gen: torch.Generator, device: torch.device, max_grad_norm: float,
               scaler: Optional[torch.amp.GradScaler], keep: Optional[torch.Tensor] = None,
               tokens: Optional[int] = None) -> UpdateResult:
    """PPO epochs of `loss_fn(micro-batch on device, epoch) -> (loss, stats)` over `exp`. `keep` (B,) bool:
    the rows to compute; the others must have a loss of exactly 0 (they are left out of the passes, the
    mini-batches and their loss weights stay those of every row, so the step is the same). The stats
    are then means over the rows computed. Micro-batches hold at most `tokens` tokens each, trimmed to
    their longest response (`micro` rows each when None; always under torchrun, where every rank must take
    the same number of micro-steps)."""
    out = UpdateResult()
    sums: dict[str, float] = {}
    weights = 0.0
    stepped = 0
    world = ranks.world()
    learner.model.train()  # HF checkpoints activations (and applies LoRA dropout) only in training mode
    for epoch, mexp, mkeep in mini_batches(exp, mini, epochs, gen, keep):
        learner.optim.zero_grad(set_to_none=True)
        whole = tuple(ranks.sum_floats(list(algos.batch_counts(mexp.response_mask)), device))
        acc: dict[str, float] = {}
        finite = True
        if mkeep is not None:
            mexp = mexp.rows(mkeep.nonzero().squeeze(1))
            if len(mexp) == 0:
                zero_gradients(learner, scaler, device)
        slices = token_micro_batches(mexp, tokens, micro) if world == 1 else micro_batches(len(mexp), micro)
        for sl in slices:
            part = mexp.rows(sl).trimmed().to(device)
            loss, stats = loss_fn(part, epoch)
            if not finite_everywhere(loss):
                finite = False
                break
            w = algos.accumulation_weight(part.response_mask, whole, agg)
            scaled = loss * (w * world)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            for k, v in stats.items():
                acc[k] = acc.get(k, 0.0) + float(v) * w
            acc[""] = acc.get("", 0.0) + w   # the share of the mini-batch's loss computed
        if not finite:
            learner.optim.zero_grad(set_to_none=True)
            out.skipped += 1
            continue
        norm = optimizer_step(learner, max_grad_norm, scaler)
        if norm is None:
            out.skipped_norm += 1
            continue
        if math.isfinite(norm):
            out.grad_norms.append(norm)
        else:   # optimizer_step leaves an overflow at a scale above 1 to the scaler, which skipped the step
            out.scaler_skipped += 1
        stepped += 1
        weights += acc.pop("", 0.0)
        for k, v in acc.items():
            sums[k] = sums.get(k, 0.0) + v
    learner.model.eval()
    keys = sorted(sums)  # the same on every rank: each runs the same loss on its share
    totals = ranks.sum_floats([sums[k] for k in keys] + [weights], device)
    done = totals.pop() if keep is not None else stepped   # every row computed: each mini-batch's weights sum to 1
    out.stats = {f"{learner.name}/{k}": v / done for k, v in zip(keys, totals)} if done > 0 else {}
    if out.grad_norms:
        out.stats[f"{learner.name}/grad_norm"] = sum(out.grad_norms) / len(out.grad_norms)
    return out
