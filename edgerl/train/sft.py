"""Supervised fine-tuning (`edgerl sft`, sft.enabled): the training loop of `Trainer` with its step replaced by
one pass of cross-entropy on the assistant tokens of written conversations (edgerl.data.sft).

Everything else is the RL run's: the plan (its memory model counts the update alone: no rollout engine, no
reference, no critic), the actor as the plan builds it (dtype, LoRA or QLoRA, FSDP2, checkpointing,
offload), the optimizer, micro-batches and gradient accumulation (train.update.run_update), checkpoints,
resume, signals, metrics and the final export, so `edgerl train --model RUN/final` goes on with RL.

A row is laid out as an Experience whose "prompt" is the row's first token and whose "response" is the rest,
with the loss mask as the response mask: the actor's log-prob pass then computes exactly the next-token
log-probs of the row, and the loss is their negative mean over assistant tokens (token-mean over the
mini-batch, as the PPO loss aggregates).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from edgerl import algos
from edgerl.data.prompts import PromptSampler
from edgerl.data.sft import SftRow
from edgerl.models.load import build_actor, init_distributed
from edgerl.train import overflow, state
from edgerl.train.experience import Experience
from edgerl.train.session import Session
from edgerl.train.trainer import Trainer
from edgerl.train.update import run_update
from edgerl.config.schema import to_dict


def sft_batch(rows: list[SftRow], pad_id: int) -> Experience:
    """Rows as an Experience: column 0 the first token, the response the rest (right-padded), the loss mask
    shifted by one (token t + 1 is predicted at column t)."""
    R = max(len(r.input_ids) for r in rows) - 1
    B = len(rows)
    ids = torch.full((B, R + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((B, R + 1), dtype=torch.long)
    loss = torch.zeros((B, R), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids, dtype=torch.long)
        mask[i, :n] = 1
        loss[i, :n - 1] = torch.tensor(r.loss_mask[1:], dtype=torch.float32)
    return Experience(input_ids=ids, attention_mask=mask, response_ids=ids[:, 1:].clone(), response_mask=loss,
                      start=0, scores=torch.zeros(B))


class SftTrainer(Trainer):
    """`Trainer` whose step is supervised: no engine, reference, critic or reward."""

    def _build(self, s: Session) -> None:
        cfg, plan, device = self.cfg, self.plan, self.device = s.cfg, s.plan, s.device
        self.run_dir, self.log, self.tokenizer, self.prompts = s.run_dir, s.log, s.tokenizer, s.prompts
        torch.manual_seed(cfg.train.seed)
        init_distributed(device)
        self.rank, self.world = s.rank.rank, s.rank.world
        self.eval_prompts, self.functions, self.reward_model = [], [], None
        self.lora = plan.lora is not None
        self.actor = build_actor(cfg.model.path, plan, device, cfg.model.trust_remote_code, cfg.lora.dropout)
        self.ref = self.critic = self.engine = self.toolbox = self.episodes = None
        if self.lora:
            n = sum(p.numel() for p in self.actor.parameters() if p.requires_grad)
            self.log(f"LoRA r={plan.lora['rank']}: {n:,} trainable parameters; base stored in {plan.base_dtype}")
        t = cfg.train
        loop = state.LoopState(
            step=0, sampler=PromptSampler(len(self.prompts), t.prompts_per_step, t.seed, cfg.data.shuffle, log=self.log),
            gen=torch.Generator().manual_seed(t.seed + self.rank), kl_ctl=algos.FixedKL(0.0),
            scaler=torch.amp.GradScaler(device.type) if plan.dtype.grad_scaler else None)
        self.state = state.TrainState(actor=self._learner("actor", self.actor, t.lr), critic=None, loop=loop,
                                      lora=self.lora, meta={"config": to_dict(cfg), "plan": plan.decisions()})
        self._start(s)

    def _sync(self) -> None:
        """No engine holds a copy of the weights."""

    def step_once(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        cfg, p, lp = self.cfg, self.plan, self.state.loop
        self.phase = "update"
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        mine = lp.sampler.next_batch()   # the global batch, the same on every rank; this rank takes its share
        k = len(mine) // self.world
        exp = sft_batch([self.prompts[i] for i in mine[self.rank * k:(self.rank + 1) * k]],
                        self.tokenizer.pad_token_id)

        def loss_fn(part: Experience, epoch: int):
            logp, _ = self.actor(part.input_ids, part.attention_mask, part.response_ids, part.start, 1.0)
            loss = algos.aggregate(-logp, part.response_mask, "token-mean")
            return loss, {"loss": loss.detach()}

        res = run_update(self.state.actor, exp, loss_fn, mini=(cfg.train.mini_batch or cfg.sequences_per_step)
                         // self.world, epochs=1, micro=p.micro_batch, agg="token-mean", gen=lp.gen, device=self.device,
                         max_grad_norm=cfg.train.max_grad_norm, scaler=lp.scaler, tokens=p.micro_batch_tokens)
        self.state.actor.sched.step()
        skipped = res.skipped + res.skipped_norm
        lp.skipped_total += skipped
        if skipped:   # as the RL update counts them: train.max_bad_steps in a row stop the run, naming the site
            what = " and ".join(w for w, n in (("the loss", res.skipped), ("the gradient norm", res.skipped_norm)) if n)
            overflow.bad_step(self, f"{what} was", f"{skipped} update(s) skipped", exp, [], rollout=False)
        else:
            lp.bad_in_a_row = 0
        self.phase = "after the update phase"
        took = time.perf_counter() - t0
        tokens = int(exp.attention_mask.sum())
        out = {"sft/loss": res.stats.get("actor/loss", float("nan")),
               "sft/assistant_tokens": float(exp.response_mask.sum()), "sft/tokens": float(tokens),
               "actor/grad_norm": res.stats.get("actor/grad_norm", float("nan")),
               "actor/lr": self.state.actor.sched.get_last_lr()[0],
               "actor/skipped_updates": float(res.skipped + res.skipped_norm),
               "perf/step_s": took, "perf/tokens_per_s": tokens * self.world / took if took > 0 else 0.0}
        if lp.scaler is not None:   # the fp16 scaler's own skips (it then lowers the scale); not a bad step
            out["actor/scaler_skips"] = float(res.scaler_skipped)
        if self.device.type == "cuda":
            out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._samples = []
        return out


def trainer_for(session: Session) -> Trainer:
    """The loop the session's config asks for: the supervised one under sft.enabled, else RL's."""
    return (SftTrainer if session.cfg.sft.enabled else Trainer)(session)
