"""The training loop, top to bottom:

    rollout -> rewards -> old / reference log-probs and values -> advantages
            -> PPO epochs over mini- and micro-batches -> optimizer -> metrics -> checkpoint

It reads the `Plan` and never asks which GPU it runs on.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from . import algos
from . import lora as lora_io
from .config import Config
from .data import PromptSampler, load_prompts
from .experience import Experience, advantages, critic_values, micro_batches, pad_batch, policy_logprobs
from .metrics import MetricsWriter
from .models import (build_actor, build_critic, build_frozen, build_inference_copy, init_distributed,
                     lm_weights, load_tokenizer, on_device, release_weights, restore_weights, save_hf)
from .optim import StateOffload, make_optimizer
from .plan import Plan
from .rewards import RewardItem, check_sources, default_compute_score, load_reward_function, score_batch
from .rollout.base import SamplingParams
from .rollout import make_hf_engine
from .trainer_state import TrainerState, TrainingError  # noqa: F401  (TrainingError is public here too)


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warm-up over warmup_ratio of the steps, then constant or cosine to min_lr_ratio."""
    t = cfg.train
    warm = int(round(t.warmup_ratio * t.steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if t.lr_schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, t.steps - warm)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


class Trainer(TrainerState):
    def __init__(self, cfg: Config, plan: Plan, device: torch.device, run_dir: Path,
                 log: Callable[[str], None] = print, resume: Optional[Path] = None) -> None:
        self.cfg, self.plan, self.device, self.run_dir, self.log = cfg, plan, device, Path(run_dir), log
        torch.manual_seed(cfg.train.seed)
        init_distributed(device)
        self.rank = dist.get_rank()
        m = cfg.model
        self.tokenizer = load_tokenizer(m.tokenizer or m.path, m.trust_remote_code)
        # the generated task is seeded apart from train.seed: every run trains on the same problems
        self.prompts, report = load_prompts(cfg.data, self.tokenizer, seed=0, log=log)
        log(report.lines()[0])
        if cfg.reward.function:
            self.reward_fn = load_reward_function(cfg.reward.function)
        else:
            check_sources({p.data_source for p in self.prompts})
            self.reward_fn = default_compute_score
        self.reward_model = None
        if cfg.reward.model:
            from .reward_model import RewardModel
            self.reward_model = RewardModel(cfg.reward.model, device=device)

        self.lora = plan.lora is not None
        self.actor = build_actor(m.path, plan, device, m.trust_remote_code, cfg.lora.dropout)
        self.ref = None
        if cfg.algo.kl_coef > 0:  # under LoRA the reference is the actor with its adapter disabled
            self.ref = lora_io.ReferencePolicy(self.actor) if self.lora else build_frozen(
                m.path, plan, device if not plan.swap_models else torch.device("cpu"), m.trust_remote_code)
        self.critic = build_critic(m.critic_path or m.path, plan, device, m.trust_remote_code, cfg.lora.dropout,
                                   cfg.lora.target_modules) if cfg.algo.advantage == "gae" else None
        if self.lora:
            n = sum(p.numel() for p in self.actor.parameters() if p.requires_grad)
            log(f"LoRA r={plan.lora['rank']}: {n:,} trainable parameters (the plan counted "
                f"{plan.lora['params']:,}); base stored in {plan.base_dtype}")
        t = cfg.train
        world = dist.get_world_size()
        # the state waits in host memory between updates unless FSDP2 already keeps it there
        offload, pin = plan.optimizer_offload and not plan.param_offload, device.type == "cuda"
        self.optim = make_optimizer(self.actor.parameters(), plan.optimizer, t.lr, tuple(t.betas), t.weight_decay,
                                    world)
        self.offload = StateOffload(self.optim, offload, pin)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_lambda(cfg))
        self.critic_optim = self.critic_sched = self.critic_offload = None
        if self.critic is not None:
            self.critic_optim = make_optimizer(self.critic.parameters(), plan.optimizer, t.critic_lr,
                                               tuple(t.betas), t.weight_decay, world)
            self.critic_offload = StateOffload(self.critic_optim, offload, pin)
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_optim, lr_lambda(cfg))
        # fp16 needs loss scaling (CC 7.x); bf16 and fp32 do not
        self.scaler = torch.amp.GradScaler(device.type) if plan.dtype.grad_scaler else None
        self.kl_ctl = (algos.AdaptiveKL(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
                       if cfg.algo.kl_target else algos.FixedKL(cfg.algo.kl_coef))
        self.engine = self._make_engine()
        self.sampler = PromptSampler(len(self.prompts), t.prompts_per_step, t.seed, cfg.data.shuffle)
        self.gen = torch.Generator().manual_seed(t.seed)
        self.step = 0
        self.bad_in_a_row = 0
        self.stop_signal: Optional[str] = None
        if resume is not None:
            self._load(resume)
        self.metrics = MetricsWriter(self.run_dir, cfg.run.tensorboard, resume=resume is not None)
        if resume is not None:
            self.metrics.truncate_after(self.step)
        self.engine.sync_weights(lm_weights(self.actor))
        eos = self.tokenizer.eos_token_id
        r = cfg.rollout
        self.sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            eos_token_ids=(eos,) if (r.stop_at_eos and eos is not None) else (),
            pad_token_id=self.tokenizer.pad_token_id)

    # --- setup helpers ------------------------------------------------------------------------------

    def _make_engine(self):
        p, m = self.plan, self.cfg.model
        max_len = max(len(x.input_ids) for x in self.prompts) + self.cfg.rollout.max_new_tokens
        self.rollout_model = None  # the hf engine's weights, freed between rollouts
        if p.rollout_engine == "vllm":
            from .rollout.vllm_engine import VLLMEngine
            folder = self.run_dir / "rollout-model"  # vLLM loads from a folder; weights are pushed after
            if self.rank == 0:
                save_hf(dict(lm_weights(self.actor)), m.path, self.tokenizer, folder, m.trust_remote_code)
            return VLLMEngine(str(folder), dtype=p.dtype.compute, gpu_memory_utilization=p.rollout_memory_share,
                              max_model_len=max_len, max_num_seqs=p.rollout_batch, seed=self.cfg.train.seed,
                              enable_sleep=self.device.type == "cuda", note=p.reasons["rollout_engine"])
        copy = build_inference_copy(m.path, p, self.device, m.trust_remote_code)
        self.rollout_model = copy
        return make_hf_engine(copy, device_is_cuda=self.device.type == "cuda", cuda_graphs=p.cuda_graphs,
                              max_batch=p.rollout_batch, max_seq_len=max_len)

    # --- one step -------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        cfg, t0, times = self.cfg, time.perf_counter(), {}
        n = cfg.rollout.n_samples
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        @contextlib.contextmanager
        def phase(name: str):
            start = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times[f"time/{name}_s"] = time.perf_counter() - start

        prompts = [self.prompts[i] for i in self.sampler.next_batch()]
        with phase("rollout"):
            batch = self.engine.generate([list(p.input_ids) for p in prompts], n, self.sampling, self.gen)
        with phase("reward"):
            texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
            rows = [p for p in prompts for _ in range(n)]
            items = [RewardItem(p.data_source, text, p.ground_truth, p.extra) for p, text in zip(rows, texts)]
            scores, components = score_batch(self.reward_fn, items)
            if self.reward_model is not None:
                rm = self.reward_model.score([p.raw_prompt for p in rows], texts)
                components["reward_model"] = rm
                scores = [s + cfg.reward.model_coef * r for s, r in zip(scores, rm)]
        exp = pad_batch(batch, self.tokenizer.pad_token_id, scores)
        self.engine.release()
        if self.rollout_model is not None:  # refilled by the next weight sync: its memory serves the update
            release_weights(self.rollout_model)

        updates = (len(exp) // (cfg.train.mini_batch or len(exp))) * cfg.train.ppo_epochs
        kl_coef = self.kl_ctl.value
        T = cfg.rollout.temperature
        self.actor.eval()
        with phase("score"):
            # On-policy with one update per step, the old log-probs equal the current ones: the
            # update's own forward provides them (ratio 1), and this pass is skipped.
            if updates > 1 or (kl_coef > 0 and cfg.algo.kl_in == "reward"):
                exp.old_logp, _ = policy_logprobs(self.actor, exp, self.plan.score_micro_batch, T, self.device)
            if self.ref is not None:
                with on_device(self.ref, self.device, self.plan.swap_models and not self.lora):
                    exp.ref_logp, _ = policy_logprobs(self.ref, exp, self.plan.score_micro_batch, T, self.device)
            if self.critic is not None:
                self.critic.eval()
                exp.values = critic_values(self.critic, exp, self.plan.score_micro_batch, self.device)
        exp = advantages(exp, cfg.algo, n, kl_coef)

        with phase("update"):
            stats = self.update_actor(exp, kl_coef)
            if self.critic is not None:
                stats |= self.update_critic(exp)
        self.sched.step()
        if self.critic_sched is not None:
            self.critic_sched.step()
        with phase("sync"):
            if self.rollout_model is not None:
                restore_weights(self.rollout_model)
            self.engine.sync_weights(lm_weights(self.actor))
        if "actor/kl" in stats:
            self.kl_ctl.update(stats["actor/kl"], len(exp))

        step_s = time.perf_counter() - t0
        lengths = [len(r) for r in batch.response_ids]
        sc = torch.tensor(scores)
        out = {"reward/mean": sc.mean().item(), "reward/std": sc.std().item() if len(sc) > 1 else 0.0,
               **{f"reward/{k}_mean": _nanmean(v) for k, v in components.items()},
               "response/length_mean": sum(lengths) / len(lengths), "response/length_min": min(lengths),
               "response/length_max": max(lengths),
               "response/clip_ratio": sum(batch.truncated) / len(batch.truncated),
               **stats, "actor/lr": self.sched.get_last_lr()[0], "actor/kl_coef": kl_coef,
               "perf/step_s": step_s, "perf/tokens_per_s": batch.response_tokens / step_s,
               "perf/rollout_tokens_per_s": batch.response_tokens / max(times["time/rollout_s"], 1e-9),
               **times, "train/bad_steps_in_a_row": self.bad_in_a_row}
        if self.device.type == "cuda":
            out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        try:
            import psutil
            out["memory/host_rss_gib"] = psutil.Process().memory_info().rss / 2**30
        except ImportError:  # pragma: no cover
            pass
        return out

    # --- updates ---------------------------------------------------------------------------------------

    def _weights(self, part: Experience, whole: Experience) -> float:
        """This micro-batch's share of the mini-batch loss, so that accumulation equals one big batch."""
        if self.cfg.algo.loss_agg == "token-mean":
            return part.response_mask.sum().item() / max(1.0, whole.response_mask.sum().item())
        nonempty = lambda e: (e.response_mask.sum(-1) > 0).sum().item()  # noqa: E731
        if self.cfg.algo.loss_agg == "seq-mean-token-sum-norm":
            return len(part) / len(whole)
        return nonempty(part) / max(1, nonempty(whole))

    def _finite_everywhere(self, loss: torch.Tensor) -> bool:
        ok = torch.tensor([float(torch.isfinite(loss).all())], device=loss.device)
        if dist.get_world_size() > 1:  # every rank must skip together, or FSDP's collectives hang
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def _optimizer_step(self, model, optim, offload: StateOffload) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(optim)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        with offload.resident():  # offloaded state comes back for the step only
            if self.scaler is not None:
                self.scaler.step(optim)
                self.scaler.update()
            else:
                optim.step()
        optim.zero_grad(set_to_none=True)  # gradients are dead weight during the next rollout
        return float(norm)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _mini_batches(self, exp: Experience):
        """(epoch, mini-batch) for every PPO epoch; the rows are reshuffled each epoch when a step holds
        more than one mini-batch."""
        mini = self.cfg.train.mini_batch or len(exp)
        for epoch in range(self.cfg.train.ppo_epochs):
            order = torch.randperm(len(exp), generator=self.gen) if mini < len(exp) else torch.arange(len(exp))
            for m0 in range(0, len(exp), mini):
                yield epoch, exp.rows(order[m0:m0 + mini])

    def update_actor(self, exp: Experience, kl_coef: float) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algo
        mini = cfg.train.mini_batch or len(exp)
        acc: dict[str, float] = {}
        first_epoch: dict[str, list[torch.Tensor]] = {"logp": [], "ent": [], "mask": [], "ref": []}
        grad_norms, skipped = [], 0
        self.actor.train()  # HF checkpoints activations (and applies LoRA dropout) only in training mode
        for epoch, mexp in self._mini_batches(exp):
            self.optim.zero_grad(set_to_none=True)
            bad = False
            for sl in micro_batches(len(mexp), self.plan.micro_batch):
                part = mexp.rows(sl).to(self.device)
                logp, ent = self.actor(part.input_ids, part.attention_mask, part.response_ids, part.start,
                                       cfg.rollout.temperature)
                old = part.old_logp if part.old_logp is not None else logp.detach()
                mask = part.response_mask
                loss, st = algos.policy_loss(logp, old, part.advantages, mask, a.clip_low, a.clip_high,
                                             a.dual_clip, a.loss_agg)
                st["pg_loss"] = loss.detach()
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * algos.aggregate(ent, mask, a.loss_agg)
                if part.ref_logp is not None and a.kl_in == "loss" and kl_coef > 0:
                    kl_term = algos.kl_loss(logp, part.ref_logp, mask, a.kl_estimator, a.loss_agg)
                    loss = loss + kl_coef * kl_term
                if not self._finite_everywhere(loss):
                    bad = True
                    break
                w = self._weights(part, mexp)
                self._backward(loss * w)
                for k, v in st.items():
                    acc[f"actor/{k}"] = acc.get(f"actor/{k}", 0.0) + float(v) * w / (
                        cfg.train.ppo_epochs * (len(exp) // mini))
                if epoch == 0:
                    first_epoch["logp"].append(logp.detach().float().cpu())
                    first_epoch["ent"].append(ent.detach().float().cpu())
                    first_epoch["mask"].append(mask.cpu())
                    if part.ref_logp is not None:
                        first_epoch["ref"].append(part.ref_logp.cpu())
            if bad:
                self.optim.zero_grad(set_to_none=True)
                skipped += 1
                continue
            grad_norms.append(self._optimizer_step(self.actor, self.optim, self.offload))
        self.actor.eval()
        self.bad_in_a_row = self.bad_in_a_row + 1 if skipped else 0
        if self.bad_in_a_row >= cfg.train.max_bad_steps:
            raise TrainingError(f"the loss was NaN or infinite in {self.bad_in_a_row} steps in a row (updates "
                                f"skipped); lower train.lr (now {cfg.train.lr}), check the rewards, or use fp32 "
                                f"(--set plan.dtype=fp32) if fp16 overflows")
        out = {**acc, "actor/skipped_updates": float(skipped)}
        if grad_norms:
            out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        if first_epoch["logp"]:
            logp, ent, mask = (torch.cat(first_epoch[k]) for k in ("logp", "ent", "mask"))
            out["actor/entropy"] = algos.masked_mean(ent, mask).item()
            if first_epoch["ref"]:
                ref = torch.cat(first_epoch["ref"])
                out["actor/kl"] = algos.masked_mean(algos.kl_estimate(logp, ref, a.kl_estimator), mask).item()
        return out

    def update_critic(self, exp: Experience) -> dict[str, float]:
        cfg = self.cfg
        losses, clips, norms = [], [], []
        self.critic.train()
        for _, mexp in self._mini_batches(exp):
            self.critic_optim.zero_grad(set_to_none=True)
            bad = False
            for sl in micro_batches(len(mexp), self.plan.micro_batch):
                part = mexp.rows(sl).to(self.device)
                v = self.critic(part.input_ids, part.attention_mask, part.start, part.response_ids.shape[1])
                loss, st = algos.value_loss(v, part.values, part.returns, part.response_mask,
                                            cfg.algo.value_clip, cfg.algo.loss_agg)
                if not self._finite_everywhere(loss):
                    bad = True
                    break
                self._backward(loss * self._weights(part, mexp))
                losses.append(loss.item())
                clips.append(float(st["vf_clip_frac"]))
            if bad:
                self.critic_optim.zero_grad(set_to_none=True)
                continue
            norms.append(self._optimizer_step(self.critic, self.critic_optim, self.critic_offload))
        self.critic.eval()
        ev = algos.explained_variance(exp.values, exp.returns, exp.response_mask).item()
        out = {"critic/vf_loss": _mean(losses), "critic/vf_clip_frac": _mean(clips),
               "critic/values_mean": algos.masked_mean(exp.values, exp.response_mask).item(),
               "critic/explained_var": ev}
        if norms:
            out["critic/grad_norm"] = _mean(norms)
        return out

    # --- the loop ------------------------------------------------------------------------------------

    def run(self, on_step: Optional[Callable[[int, dict], None]] = None) -> Path:
        """Train until train.steps (or a signal); returns the run folder."""
        handlers = {}

        def request_stop(signum, _frame):
            self.stop_signal = signal.Signals(signum).name
            self.log(f"{self.stop_signal} received: finishing step {self.step + 1}, then saving a checkpoint")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                handlers[sig] = signal.signal(sig, request_stop)
            except ValueError:  # not in the main thread
                pass
        try:
            while self.step < self.cfg.train.steps and self.stop_signal is None:
                before = self._snapshot()
                try:
                    stats = self.train_step()
                except torch.OutOfMemoryError as e:
                    self._out_of_memory(e, before)
                self.step += 1
                self.metrics.write(self.step, stats)
                if on_step:
                    on_step(self.step, stats)
                every = self.cfg.run.save_every
                if self.stop_signal or (every and self.step % every == 0):
                    self.save()
            if self.stop_signal is None:
                if self.cfg.run.save_every and self.step % self.cfg.run.save_every:
                    self.save()
                if self.cfg.run.export_final:
                    self.export(self.run_dir / "final")
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
            self.metrics.close()
        return self.run_dir


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _nanmean(xs: list[float]) -> float:
    vals = [x for x in xs if not math.isnan(x)]
    return _mean(vals)
