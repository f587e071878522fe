"""The training loop, one method per phase of a step, in the order a step runs them:

    rollout -> rewards -> scores (old / reference log-probs, values) -> advantages -> update
            -> weight sync -> metrics -> checkpoint

It is built from a prepared `Session` (edgerl/session.py) and reads its `Plan`; it never asks which
GPU it runs on.
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

from edgerl import algos, correction
from edgerl.train import ranks
from edgerl.train import resume as resume_changes
from edgerl.train import overflow, state
from edgerl.models import lora as lora_io
from edgerl.config.schema import Config, to_dict
from edgerl.data.prompts import Prompt, PromptSampler
from edgerl.plan.dtypes import torch_dtype
from edgerl.core.errors import USER_ERRORS, RewardError, RunDirError, TrainingError
from edgerl.train.experience import Experience, advantages, critic_values, pad_batch, pad_columns, policy_logprobs
from edgerl.train.metrics import MetricsWriter
from edgerl.core.files import write_atomically
from edgerl.models.load import (build_actor, build_critic, build_frozen, init_distributed, lm_weights, on_device, save_hf)
from edgerl.plan.moves import next_moves
from edgerl.train.optim import StateOffload, make_optimizer
from edgerl.rewards.contain import MAX_ABS_REWARD, Interrupted, call_user, other_ranks
from edgerl.rewards.builtins import RewardRow
from edgerl.rewards.functions import check_total, sample_text, score as score_rewards
from edgerl.rollout import EngineContext, build_engine
from edgerl.rollout.base import RolloutBatch, SamplingParams
from edgerl.rollout.decode_step import CacheOverflow
from edgerl.rollout.episodes import EpisodeRollout, episode_metrics, episode_sample
from edgerl.train import retention
from edgerl.train.manifest import own
from edgerl.train.runfolder import aside_name, export_step, mark_export
from edgerl.train.session import Session
from edgerl.train.step_metrics import global_explained_variance, global_mean, rollout_metrics, step_metrics
from edgerl.train import evaluate as evaluation
from edgerl.train.groups import Drawn, draw, overlong_penalty, rows_with_gradient, skip_policy, uniform_groups
from edgerl.train.update import Learner, run_update

__all__ = ["Trainer", "TrainingError", "lr_lambda"]


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


class Trainer:
    def __init__(self, session: Session) -> None:
        """Build models, optimizers and the engine, and restore the checkpoint to resume from. The
        session's run-folder lock is released when this fails, or when `run` ends."""
        self.session = session
        self.functions: list[Any] = session.reward_functions
        try:
            self._check_lock()
            self._build(session)
        except BaseException:
            self._close_user_code()
            session.close()
            raise

    def _build(self, s: Session) -> None:
        if s.cfg.sft.enabled:   # its rows are no prompts: the supervised loop is edgerl.train.sft's
            raise TypeError("an sft run's session goes to the supervised loop: edgerl.train.sft.trainer_for(session)")
        cfg, plan, device = self.cfg, self.plan, self.device = s.cfg, s.plan, s.device
        self.run_dir, self.log, self.tokenizer, self.prompts = s.run_dir, s.log, s.tokenizer, s.prompts
        torch.manual_seed(cfg.train.seed)  # the same on every rank: every rank builds the same models
        init_distributed(device)
        self.rank, self.world = s.rank.rank, s.rank.world
        m, t = cfg.model, cfg.train
        self.eval_prompts = s.eval_prompts
        self.functions = s.reward_functions or evaluation.reward_functions(cfg)
        self.skip_rows, why = skip_policy(cfg, self.world)
        self.log(why)
        if self.eval_prompts:
            e = cfg.eval
            when = f"every {e.every} steps" if e.every else "before the first step and after the last"
            self.log(f"eval: {len(self.eval_prompts)} held-out prompts {when}, greedy"
                     + (f" and {e.samples} samples each" if e.samples else "") + f"; on the rollout engine, "
                     f"{plan.rollout_batch} sequences at a time, in the rollout phase's memory")
        self.reward_model = None
        if plan.reward_model_dtype:
            from edgerl.rewards.model import RewardModel
            self.reward_model = RewardModel(cfg.reward.model, device=device,
                                            dtype=torch_dtype(plan.reward_model_dtype))

        self.lora = plan.lora is not None
        self.actor = build_actor(m.path, plan, device, m.trust_remote_code, cfg.lora.dropout)
        self.ref = None
        if cfg.algo.kl_coef > 0:  # under LoRA the reference is the actor with its adapter disabled
            self.ref = lora_io.ReferencePolicy(self.actor) if self.lora else build_frozen(
                m.path, plan, device if not plan.swap_models else torch.device("cpu"), m.trust_remote_code)
        self.critic = build_critic(m.critic_path or m.path, plan, device, m.trust_remote_code, cfg.lora.dropout,
                                   cfg.lora.target_modules) if plan.task.critic else None
        if self.lora:
            n = sum(p.numel() for p in self.actor.parameters() if p.requires_grad)
            self.log(f"LoRA r={plan.lora['rank']}: {n:,} trainable parameters (the plan counted "
                     f"{plan.lora['params']:,}); base stored in {plan.base_dtype}")
        loop = state.LoopState(
            step=0, sampler=PromptSampler(len(self.prompts), t.prompts_per_step, t.seed, cfg.data.shuffle,
                                           log=self.log),
            gen=torch.Generator().manual_seed(t.seed + self.rank),  # each rank samples its own responses
            kl_ctl=(algos.AdaptiveKL(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
                    if cfg.algo.kl_target else algos.FixedKL(cfg.algo.kl_coef)),
            # fp16 needs loss scaling (CC 7.x); bf16 and fp32 do not
            scaler=torch.amp.GradScaler(device.type) if plan.dtype.grad_scaler else None)
        self.state = state.TrainState(
            actor=self._learner("actor", self.actor, t.lr),
            critic=self._learner("critic", self.critic, t.critic_lr) if self.critic is not None else None,
            loop=loop, lora=self.lora, meta={"config": to_dict(cfg), "plan": plan.decisions()})
        # the tokens after a prompt are the plan's (plan.task.response_len: one response, or an episode's budget);
        # the static engine's episodes hold one turn more (edgerl/rollout/turns_static.py). Held-out prompts are
        # no longer than data.max_prompt_len either: the plan's KV cache holds them
        self.response_len = plan.task.response_len
        turn = cfg.rollout.max_new_tokens if cfg.rollout.episodes else 0
        max_len = max(len(x.input_ids) for x in self.prompts + self.eval_prompts) + self.response_len + turn
        if plan.rollout_engine == "vllm" and self.rank == 0:
            own(self.run_dir, "rollout-model")   # vLLM loads the weights from a folder there
        self.engine = build_engine(plan, EngineContext(
            model_path=m.path, trust_remote_code=m.trust_remote_code, device=device, max_seq_len=max_len,
            seed=t.seed, work_dir=self.run_dir,
            save_initial=lambda folder: self._write_hf(folder, dict(lm_weights(self.actor))), actor=self.actor))
        self.toolbox = s.toolbox
        self.episodes = EpisodeRollout(self.engine, s.toolbox, s.tool_format, self.tokenizer, cfg.rollout) \
            if cfg.rollout.episodes else None
        self._start(s)
        self._sync()
        eos = self.tokenizer.eos_token_id
        r = cfg.rollout
        self.sampling = SamplingParams(
            max_new_tokens=self.response_len, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            eos_token_ids=(eos,) if (r.stop_at_eos and eos is not None) else (),
            pad_token_id=self.tokenizer.pad_token_id)

    def _start(self, s: Session) -> None:
        """Restore the checkpoint to resume from, write the run's config and plan, open the metrics."""
        cfg, plan = self.cfg, self.plan
        self.stop_signal: Optional[str] = None
        self._samples: list[dict[str, Any]] = []
        self.phase = "setup"
        self._scores: dict[int, float] = {}   # step -> held-out score, for run.keep_best
        weights, optim_bytes = state.checkpoint_bytes(self.state, plan.optimizer)
        final = None if self.lora else state.export_bytes(self.actor.lm)
        r = cfg.run
        self.log(retention.plan_line(weights, optim_bytes, r.save_every, r.keep_last, r.keep_best,
                                     bool(self.eval_prompts), r.final_only, final))
        if s.resume is not None:
            saved = state.restore(s.resume.checkpoint, self.state, self.log, seed=cfg.train.seed)
            resume_changes.apply(self.state, cfg, saved.get("config"), self.log)
        s.commit()   # a run resumed in place writes its config and plan once its checkpoint has loaded
        self.metrics = MetricsWriter(self.run_dir, resume=s.resume is not None, log=self.log, loggers=cfg.run.loggers,
                                     samples=cfg.run.log_samples > 0, config=to_dict(cfg), project=cfg.run.project) \
            if self.rank == 0 else _NoMetrics()   # rank 0 alone writes files
        if s.resume is not None:
            moved = self.metrics.archive_after(self.state.loop.step)
            if moved is not None:
                self.log(f"metrics of the steps after {self.state.loop.step} (they are redone now) moved to {moved}")

    def _learner(self, name: str, model: torch.nn.Module, lr: float) -> Learner:
        p, t = self.plan, self.cfg.train
        # parameters FSDP2 keeps in host memory: the bf16 step streams them through the GPU; on a GPU its
        # step is the fused Triton kernel exactly when the plan's kernels are Triton's
        cuda = self.device.type == "cuda"
        optim = make_optimizer(model.parameters(), p.optimizer, lr, tuple(t.betas), t.weight_decay,
                               dist.get_world_size(), seed=t.seed, fused=(p.kernel_backend == "triton") if cuda else None,
                               step_device=self.device if p.param_offload and cuda else None)
        # the state waits in host memory between updates unless FSDP2 already keeps it there
        offload = StateOffload(optim, p.optimizer_offload and not p.param_offload, cuda)
        return Learner(name, model, optim, torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(self.cfg)), offload)

    @property
    def step(self) -> int:
        return self.state.loop.step

    def _sync(self) -> None:
        """The engine's weights := the actor's (every rank joins the gather of sharded weights)."""
        if self.engine.needs_weights:
            self.engine.sync_weights(lm_weights(self.actor))

    # --- the phases of one step --------------------------------------------------------------------

    def rollout(self, prompts: list[Prompt]) -> RolloutBatch:
        """n samples per prompt from the current policy (the engine holds a synced copy or the weights); with
        tools or an environment, n episodes of several turns."""
        try:
            return self.generate(prompts, self.cfg.rollout.n_samples, self.sampling, self.state.loop.gen)
        except RuntimeError as e:   # transformers' generate refuses to sample from a NaN distribution
            if overflow.sampler_failed(e):
                raise overflow.sampling_stopped(self, [list(p.input_ids) for p in prompts]) from None
            raise

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams, gen: Optional[torch.Generator]
                 ) -> RolloutBatch:
        if self.episodes is not None:
            return self.episodes.generate(prompts, n, params, gen)
        return evaluation.on_engine(self.engine)(prompts, n, params, gen)

    def rewards(self, prompts: list[Prompt], batch: RolloutBatch) -> Drawn:
        """One score per response: reward.functions weighted, plus the reward model's score if any, and
        DAPO's length penalty under algo.overlong=soft_penalty."""
        cfg = self.cfg
        n = cfg.rollout.n_samples
        texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        rows = [p for p in prompts for _ in range(n)]
        items = [RewardRow(p.data_source, p.raw_prompt, p.text, text, tuple(ids), p.ground_truth, p.extra)
                 for p, text, ids in zip(rows, texts, batch.response_ids)]
        res = score_rewards(self.functions, items, cfg.data.answer_key)
        scores, components = res.total, res.components
        if self.reward_model is not None:
            # its forward is model code (remote code, with trust_remote_code): contained as a reward function
            who = f"reward model {self.cfg.reward.model}"
            rm = call_user(self.reward_model.score, who, f"the batch of {len(texts)} responses",
                           [p.raw_prompt for p in rows], texts, passthrough=(torch.OutOfMemoryError, RewardError))
            for i, (r, item) in enumerate(zip(rm, items)):
                if not (math.isfinite(r) and abs(r) <= MAX_ABS_REWARD):
                    raise RewardError(f"{who} scored {r:g} {sample_text(i, item)}; a reward must be finite and "
                                      f"within +-{MAX_ABS_REWARD:g} (in fp16 the model may overflow: --set "
                                      "plan.dtype=fp32)")
            components["reward_model"] = rm
            scores = [s + cfg.reward.model_coef * r for s, r in zip(scores, rm)]
        if batch.episodes is not None and cfg.rollout.environment is not None:   # the turns' rewards
            env = [ep.discounted_return(cfg.rollout.turn_discount) for ep in batch.episodes]
            components["environment"] = env
            scores = [s + e for s, e in zip(scores, env)]
        if cfg.algo.overlong == "soft_penalty":
            r = self.response_len
            pen = overlong_penalty([len(x) for x in batch.response_ids], r, cfg.algo.overlong_buffer or max(1, r // 4),
                                   cfg.algo.overlong_penalty)
            components["overlong_penalty"] = pen
            scores = [s + p for s, p in zip(scores, pen)]
        added = [(k, w, fix) for k, w, fix in (("reward_model", cfg.reward.model_coef, "reward.model_coef"),
                                               ("environment", 1.0, "the environment's rewards"),
                                               ("overlong_penalty", 1.0, "algo.overlong_penalty")) if k in components]
        for i, total in enumerate(scores):   # each term is within the bound; their sum must be too
            terms = [f"{res.total[i]:g} (reward functions)"] + [
                f"{w:g} x {components[k][i]:g} ({k.replace('_', ' ')})" for k, w, _ in added]
            check_total(total, " + ".join(terms), lambda i=i: sample_text(i, items[i]),
                        " or ".join(["reward.weights"] + [fix for _, _, fix in added]))
        return Drawn(list(prompts), batch, scores, res.by_function, components)

    def score(self, exp: Experience, kl_coef: float) -> Experience:
        """Old and reference log-probs and the critic's values, without gradients."""
        cfg, p = self.cfg, self.plan
        T = cfg.rollout.temperature
        updates = (len(exp) // (cfg.train.mini_batch or len(exp))) * cfg.train.ppo_epochs
        # the scoring micro-batch's token budget (rows whose responses ended early share one); one process only,
        # since under torchrun every rank must take as many forward passes as the others
        score_tokens = p.score_micro_batch * p.micro_batch_tokens // p.micro_batch if self.world == 1 else None
        self.actor.eval()
        # On-policy with one update per step, the old log-probs equal the current ones: the update's
        # own forward provides them (ratio 1), and this pass is skipped.
        if updates > 1 or (kl_coef > 0 and cfg.algo.kl_in == "reward"):
            exp.old_logp, _ = policy_logprobs(self.actor, exp, p.score_micro_batch, T, self.device, score_tokens)
        if self.ref is not None:
            with on_device(self.ref, self.device, p.swap_models and not self.lora):
                exp.ref_logp, _ = policy_logprobs(self.ref, exp, p.score_micro_batch, T, self.device, score_tokens)
        if self.critic is not None:
            self.critic.eval()
            exp.values = critic_values(self.critic, exp, p.score_micro_batch, self.device, score_tokens)
        return exp

    def update(self, exp: Experience, kl_coef: float) -> dict[str, float]:
        """PPO epochs for the actor, then the critic; counts skipped (non-finite) updates. Rows whose loss is
        exactly 0 are not computed where skip_policy allows it."""
        cfg, a, lp = self.cfg, self.cfg.algo, self.state.loop
        agg = a.loss_agg_mode()
        keep = rows_with_gradient(exp.advantages, exp.response_mask) if self.skip_rows else None
        epoch0: dict[str, list[torch.Tensor]] = {"logp": [], "ent": [], "mask": [], "ref": [], "old": [], "sampled": []}
        mode = self.plan.rollout_correction
        if mode != "none" and exp.sampled_logp is None:   # the plan allows it only with an engine that reports them
            raise TrainingError(f"the plan's rollout correction ({mode}) needs the rollout engine's sampled log-probs, "
                                f"and the {self.plan.rollout_engine} engine returned none")
        R = exp.response_ids.shape[1]   # micro-batches come trimmed to their longest response

        def actor_loss(part: Experience, epoch: int):
            logp, ent = self.actor(part.input_ids, part.attention_mask, part.response_ids, part.start,
                                   cfg.rollout.temperature)
            old = part.old_logp if part.old_logp is not None else logp.detach()
            mask = part.response_mask
            weights = None if mode == "none" else correction.weights(
                old, part.sampled_logp, mask, mode, a.rollout_correction_level, a.rollout_correction_threshold)[0]
            loss, st = algos.compute_policy_loss(a.policy_loss, logp, old, part.advantages, mask, a, weights)
            st["pg_loss"] = loss.detach()
            if a.entropy_coef:
                loss = loss - a.entropy_coef * algos.aggregate(ent, mask, agg)
            if part.ref_logp is not None and a.kl_in == "loss" and kl_coef > 0:
                loss = loss + kl_coef * algos.kl_loss(logp, part.ref_logp, mask, a.kl_estimator, agg)
            if epoch == 0:
                epoch0["logp"].append(pad_columns(logp.detach().float().cpu(), R))
                epoch0["ent"].append(pad_columns(ent.detach().float().cpu(), R))
                epoch0["mask"].append(pad_columns(mask.cpu(), R))
                if part.ref_logp is not None:
                    epoch0["ref"].append(pad_columns(part.ref_logp.cpu(), R))
                if part.sampled_logp is not None:   # rows in any order: each with its own sampled log-probs
                    epoch0["old"].append(pad_columns(old.detach().float().cpu(), R))
                    epoch0["sampled"].append(pad_columns(part.sampled_logp.float().cpu(), R))
            return loss, st

        def critic_loss(part: Experience, epoch: int):
            v = self.critic(part.input_ids, part.attention_mask, part.start, part.response_ids.shape[1])
            loss, st = algos.value_loss(v, part.values, part.returns, part.response_mask, a.value_clip, agg)
            return loss, {"vf_loss": loss.detach(), "vf_clip_frac": st["vf_clip_frac"]}

        common = dict(mini=(cfg.train.mini_batch or cfg.sequences_per_step) // self.world, epochs=cfg.train.ppo_epochs,
                      micro=self.plan.micro_batch,
                      agg=agg, gen=lp.gen, device=self.device, max_grad_norm=cfg.train.max_grad_norm,
                      scaler=lp.scaler, tokens=self.plan.micro_batch_tokens)
        res = run_update(self.state.actor, exp, actor_loss, keep=keep, **common)
        out = {**res.stats, "actor/skipped_updates": float(res.skipped + res.skipped_norm)}
        if keep is not None:
            out["batch/skipped_sequences"] = ranks.sum_floats([float((~keep).sum())], self.device)[0]
        if epoch0["logp"]:
            logp, ent, mask = (torch.cat(epoch0[k]) for k in ("logp", "ent", "mask"))
            out["actor/entropy"] = global_mean(ent, mask, self.device)
            if epoch0["ref"]:
                kl = algos.kl_estimate(logp, torch.cat(epoch0["ref"]), a.kl_estimator)
                out["actor/kl"] = global_mean(kl, mask, self.device)
            if exp.sampled_logp is not None and common["mini"] == len(exp):  # rows in rollout order
                # the engine's log-probs against the trainer's own: a rollout/training mismatch shows here
                sampled = exp.sampled_logp if keep is None else exp.sampled_logp[keep]
                out["rollout/logprob_diff"] = global_mean((logp - sampled).abs(), mask, self.device)
            if epoch0["old"]:
                out |= rollout_metrics(torch.cat(epoch0["old"]), torch.cat(epoch0["sampled"]), mask, mode,
                                       a.rollout_correction_level, a.rollout_correction_threshold, self.device)
        loss_bad, norm_bad = res.skipped, res.skipped_norm
        if self.critic is not None:
            cres = run_update(self.state.critic, exp, critic_loss, **common)
            out |= cres.stats
            out["critic/values_mean"] = global_mean(exp.values, exp.response_mask, self.device)
            out["critic/explained_var"] = global_explained_variance(exp, self.device)
            out["critic/skipped_updates"] = float(cres.skipped + cres.skipped_norm)
            loss_bad, norm_bad = loss_bad + cres.skipped, norm_bad + cres.skipped_norm
        skipped = loss_bad + norm_bad
        what = " and ".join(w for w, n in (("the loss", loss_bad), ("the gradient norm", norm_bad)) if n)
        lp.skipped_total += skipped
        if lp.scaler is not None:   # the fp16 scaler's own skips (it then lowers the scale); not a bad step
            out["actor/scaler_skips"] = float(res.scaler_skipped)
        if skipped:
            overflow.bad_step(self, f"{what} was", f"{skipped} update(s) skipped", exp, [], rollout=False)
        else:
            lp.bad_in_a_row = 0
        return out

    def step_once(self) -> dict[str, Any]:
        """One step, readable top to bottom. Returns its metrics."""
        t0, times = time.perf_counter(), {}
        lp = self.state.loop
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        @contextlib.contextmanager
        def phase(name: str):
            start = time.perf_counter()
            self.phase = name   # an out-of-memory error names the phase it happened in
            yield
            self.phase = f"after the {name} phase"
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            key = f"time/{name}_s"
            times[key] = times.get(key, 0.0) + time.perf_counter() - start   # dynamic sampling draws again

        self.phase = "before the rollout"
        def one() -> Drawn:
            mine = lp.sampler.next_batch()  # the global batch, the same on every rank; this rank takes its share
            k = len(mine) // self.world
            prompts = [self.prompts[i] for i in mine[self.rank * k:(self.rank + 1) * k]]
            with phase("rollout"):
                batch = self.rollout(prompts)
            with phase("reward"):
                return self.rewards(prompts, batch)
        n, a = self.cfg.rollout.n_samples, self.cfg.algo
        drawn, drew = self._agreed(lambda: draw(one, n, a.max_extra_draws, self.device) if a.dynamic_sampling
                                   else (one(), {}))
        batch, scores, components = drawn.batch, drawn.scores, drawn.components
        exp = pad_batch(batch, self.tokenizer.pad_token_id, scores)
        if a.overlong == "mask":   # DAPO's overlong filtering: cut responses carry no loss
            cut = torch.tensor(batch.truncated, dtype=torch.bool)
            exp.response_mask[cut] = 0
            kept, total = ranks.sum_floats([float((~cut).sum()), float(len(cut))], self.device)
            if kept == 0:   # silently useless otherwise: the step runs, and learns nothing from its rollouts
                self.log(f"step {lp.step + 1}: all {total:.0f} responses were cut at rollout.max_new_tokens="
                         f"{self.cfg.rollout.max_new_tokens}, and algo.overlong=\"mask\" leaves cut responses out "
                         "of the loss, so no response carries a loss and this step learns nothing from its rollouts; "
                         "raise rollout.max_new_tokens, or set algo.overlong=\"soft_penalty\"")
        self.engine.release()   # its memory serves scoring and the update
        kl_coef = lp.kl_ctl.value
        bad = overflow.nonfinite_rows(batch)
        nonfinite = ranks.sum_floats([float(len(bad))], self.device)[0]
        if nonfinite:   # samples drawn from a NaN distribution: nothing trains on this rollout
            lp.skipped_total += 1
            overflow.bad_step(self, "the rollout's log-probs were", f"in {nonfinite:.0f} row(s): the step trains on "
                              "nothing", exp, bad, rollout=True)
            stats = {}
        else:
            with phase("score"):
                exp = self.score(exp, kl_coef)
            exp = advantages(exp, self.cfg.algo, self.cfg.rollout.n_samples, kl_coef, ranks.tensor_sum(self.device))
            with phase("update"):
                stats = self.update(exp, kl_coef)
        for ln in (self.state.actor, self.state.critic):
            if ln is not None:
                ln.sched.step()
        with phase("sync"):
            self._sync()
        if "actor/kl" in stats:
            lp.kl_ctl.update(stats["actor/kl"], len(exp))
        extra = {"actor/lr": self.state.actor.sched.get_last_lr()[0], "actor/kl_coef": kl_coef,
                 "train/bad_steps_in_a_row": lp.bad_in_a_row, "rollout/nonfinite_rows": nonfinite, **drew,
                 "batch/uniform_groups": ranks.sum_floats([float(sum(uniform_groups(scores, n)))], self.device)[0],
                 **episode_metrics(batch, lambda v: ranks.sum_floats(v, self.device),
                                   lambda v: ranks.max_floats(v, self.device))}
        self._samples = self._sample_rows(drawn)
        return step_metrics(batch, scores, components, {**stats, **extra}, times, time.perf_counter() - t0,
                            self.device, drawn.by_function)

    def _sample_rows(self, drawn: Drawn) -> list[dict[str, Any]]:
        """The first run.log_samples responses of this step (this process's share), for samples.jsonl."""
        k = self.cfg.run.log_samples
        if not k:
            return []
        n = self.cfg.rollout.n_samples
        texts = self.tokenizer.batch_decode(drawn.batch.response_ids[:k], skip_special_tokens=True)
        eps = drawn.batch.episodes
        return [{"prompt": drawn.prompts[i // n].text, "response": t, "reward": drawn.scores[i],
                 "rewards": {name: None if math.isnan(v[i]) else v[i] for name, v in drawn.by_function.items()},
                 "ground_truth": drawn.prompts[i // n].ground_truth, "truncated": drawn.batch.truncated[i],
                 **(episode_sample(eps[i]) if eps is not None else {})}
                for i, t in enumerate(texts)]

    def evaluate(self) -> dict[str, float]:
        """eval.data's held-out prompts on the engine's current weights (every rank calls it); writes their
        samples. {} without eval.data."""
        if not self.eval_prompts:
            return {}
        cfg = self.cfg
        res = evaluation.evaluate(self.generate, self.tokenizer, self.eval_prompts, self.functions, self.sampling,
                                  cfg.eval.samples, cfg.train.seed, self.step, self.device, cfg.data.answer_key,
                                  keep=cfg.run.log_samples)
        self.metrics.write_samples(self.step, "eval", res.samples)
        return res.metrics

    def _agreed(self, fn: Callable[[], Any]) -> Any:
        """fn(), but under torchrun a reward that failed or was interrupted on one rank, or a rollout whose KV
        cache overflowed there (`CacheOverflow`), stops every rank here, before the next collective, so that all of
        them save the last good step together. Every rank raises the same: Interrupted when a signal reached any
        rank, else the error of the first rank that failed, of its class, with that rank's own message (rank 0
        alone prints it)."""
        if self.world == 1:
            return fn()
        failure: Optional[BaseException] = None
        try:
            out = fn()
        except (RewardError, CacheOverflow, Interrupted) as e:
            failure = e
            if isinstance(e, Interrupted) and not e.elsewhere:
                ranks.announce_stop(e.signal)
        report = None
        if isinstance(failure, Interrupted):   # the signal, named with the rank it reached
            report = (True, failure.signal if failure.elsewhere else f"{failure.signal} (to rank {self.rank})")
        elif failure is not None:
            report = (False, str(failure), type(failure))
        reports = ranks.gather(report)
        if all(r is None for r in reports):
            return out
        ranks.ended_together()
        signalled = [x[1] for x in reports if x is not None and x[0]]
        if signalled:
            if isinstance(failure, Interrupted):
                raise failure
            raise Interrupted(signalled[0], "another rank's reward", elsewhere=True)
        r, what, kind = next((r, x[1], x[2]) for r, x in enumerate(reports) if x is not None)
        raise kind(what + (f" (on rank {r} of {self.world})" if r else ""))   # RewardError or CacheOverflow

    def _close_user_code(self) -> None:
        """Stop the processes of the user's reward functions (edgerl.rewards.contain.UserFunction)."""
        for f in self.functions:
            close = getattr(f.fn, "close", None)
            if close is not None:
                close()
        if getattr(self, "toolbox", None) is not None:
            self.toolbox.close()

    # --- checkpoints, export, failures -------------------------------------------------------------

    def save(self) -> Optional[Path]:
        r = self.cfg.run
        return state.save(self.run_dir, self.state, r.keep_last, self.rank == 0, self.log, keep_best=r.keep_best,
                          score=self._scores.get(self.step))

    def _write_hf(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        if self.rank == 0:
            save_hf(weights, self.cfg.model.path, self.tokenizer, folder, self.cfg.model.trust_remote_code)

    def export(self, out: Path) -> Path:
        """The trained actor as an HF folder that transformers loads, written atomically; an earlier
        export at `out` is kept beside it. Under LoRA: the adapter (peft format) in `<out>-adapter`, and
        the merged model in `out` when lora.export_merged."""
        from edgerl.train import checkpoint
        out = Path(out)
        step = self.state.loop.step
        if self.lora:
            adapter = lora_io.adapter_state(self.actor)
            self._finite_export({"adapter": adapter})
            target = out.with_name(out.name + "-adapter")
            if self.rank == 0:
                with checkpoint.atomic_folder(target, self._owned_aside(target)) as tmp:
                    lora_io.save_adapter(self.actor, tmp, adapter)
                    mark_export(tmp, step)
                self.log(f"final adapter: {target}")
            if not self.cfg.lora.export_merged:
                return target
        # one tensor at a time to the host: a second full copy on the GPU could run out of memory.
        # Merged LoRA weights are fp32 (W + scale B A), so the merged folder is fp32; over a quantized base
        # it is written in 16 bits (bf16, or fp16 where the plan computes in fp16), never in 4 bits
        from edgerl.models.load import quantized_base
        out_dtype = (torch.float16 if self.plan.dtype.compute == "fp16" else torch.bfloat16) \
            if quantized_base(self.plan) else torch.float32
        weights = {k: (v.to(out_dtype) if self.lora else v).cpu() for k, v in lm_weights(self.actor)}
        self._finite_export({"model": weights})
        if self.rank == 0:
            with checkpoint.atomic_folder(out, self._owned_aside(out)) as tmp:
                self._write_hf(tmp, weights)
                mark_export(tmp, step)
            self.log(f"final model: {out}" + (" (merged: plain transformers, no peft needed)" if self.lora else ""))
        return out

    def _owned_aside(self, target: Path) -> Path:
        """Where an earlier export at `target` goes; both names listed in the run's manifest first."""
        aside = aside_name(target, export_step(target))
        own(target.parent, target.name, *([aside.name] if target.exists() else []))
        return aside

    def _finite_export(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Refuse to export weights that are not finite (NaN, inf, or past the largest value of the
        export's dtype): nothing is written, and the last good checkpoint stays."""
        bad = ranks.agree(lambda: state.non_finite(tensors), self.rank == 0)
        if bad:
            raise TrainingError(f"the final weights (step {self.step}) hold NaN or infinite values "
                                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): not exported; "
                                f"{state.last_good(self.run_dir)}")

    def _write(self, fn: Callable[[], Any]) -> Any:
        """A checkpoint or export: a full disk or a folder that went read-only is one clear error (the
        writes are atomic, so what was there before is intact)."""
        try:
            return fn()
        except OSError as e:
            raise RunDirError(f"cannot write to {self.run_dir} ({e.strerror or e}); the last complete checkpoint "
                              f"and export are intact: free disk space, then resume with --resume {self.run_dir}") \
                from None

    def _failed(self, e: BaseException, before_steps: int, snap: dict[str, Any]) -> BaseException:
        """The step raised: save the last good state (when the weights are still those of the last
        completed step), then return the error to raise: out of memory becomes advice; a user error
        (a reward function that raised, say) keeps its type and gains what was saved; anything else
        is raised as it is, after a line saying what was saved."""
        saved = state.failed_step(self.state, before_steps, snap, self.save)
        resume = f"then resume with --resume {self.run_dir}"
        if isinstance(e, torch.OutOfMemoryError):
            from edgerl.train.oom import oom_message, oom_record, write_oom
            p = self.plan
            cuda = self.device.type == "cuda"
            measured = {"reserved_peak": torch.cuda.max_memory_reserved(self.device) if cuda else 0,
                        "allocated_peak": torch.cuda.max_memory_allocated(self.device) if cuda else 0,
                        "reserved_now": torch.cuda.memory_reserved(self.device) if cuda else 0}
            record = oom_record(p, self.step + 1, self.phase, measured, str(e))
            try:
                write_oom(self.run_dir, record, self.rank)
            except OSError as write_error:   # the report must not hide the out-of-memory error itself
                self.log(f"could not write oom.json: {write_error}")
            fixes = next_moves(p, self.response_len)
            return TrainingError(oom_message(record, self.run_dir) + f". {saved}. Try {fixes[0]}"
                                 + (f" (next: {fixes[1]})" if len(fixes) > 1 else "")
                                 + (f", or raise plan.memory_gib={self.cfg.plan.memory_gib:g} (the allocator is capped "
                                    "at it)" if self.cfg.plan.memory_gib is not None else "") + f", {resume}")
        if isinstance(e, USER_ERRORS):
            return type(e)(f"{e}\n{saved}; fix the cause, {resume}")
        self.log(f"step {self.step + 1} failed ({type(e).__name__}); {saved}")
        return e

    # --- the loop ----------------------------------------------------------------------------------

    def run(self, on_step: Optional[Callable[[int, dict], None]] = None) -> Path:
        """Train until train.steps (or a signal); returns the run folder.

        One handler covers the whole run: the evaluation before the first step, each step, and what
        follows it (its evaluation, its metrics and loggers, `on_step`). SIGINT or SIGTERM stops the run
        once the step in progress is done, or at once where it stopped user code (a reward), and the last
        completed step is saved; `stop_signal` names it (the CLI exits 130). An error saves the last
        completed step, then is raised: a user error keeps its type and says what was saved (exit 2)."""
        self._check_lock()
        handlers = {}
        lp = self.state.loop

        def request_stop(signum, _frame):
            self.stop_signal = signal.Signals(signum).name
            ranks.announce_stop(self.stop_signal)   # a rank waiting on a reward stops too (contain.other_ranks)
            self.log(f"{self.stop_signal} received: finishing step {lp.step + 1}, then saving a checkpoint")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                handlers[sig] = signal.signal(sig, request_stop)
            except ValueError:  # not in the main thread
                pass
        start = lp.step
        last = self.cfg.train.steps
        other_ranks(ranks.stopped_elsewhere if self.world > 1 else None)
        try:
            if lp.step == 0 and self.eval_prompts:   # the held-out score before training: the baseline
                self._after_step({}, on_step, evaluate=True)
            while lp.step < self.cfg.train.steps and self.stop_signal is None:
                snap, before = lp.snapshot(), self.state.actor.optimizer_steps()
                try:
                    with self._profiled(lp.step + 1):
                        stats = self.step_once()
                except CacheOverflow as e:   # the rollout stopped before the update: the last completed step is saved
                    raise self._failed(e, before, snap) from e
                except TrainingError:
                    raise
                except Interrupted as e:  # user code was stopped mid-step: save the last completed step
                    saved = state.failed_step(self.state, before, snap, self.save)
                    self.stop_signal = e.signal
                    self.log(f"{e}: step {lp.step + 1} abandoned; {saved}")
                    break
                except Exception as e:  # save what the completed steps earned, then stop with the cause
                    err = self._failed(e, before, snap)
                    if err is e:
                        raise
                    raise err from e
                lp.step += 1
                self._after_step(stats, on_step, self.eval_prompts and evaluation.due(lp.step, self.cfg.eval.every,
                                                                                       last))
                every = self.cfg.run.save_every
                # a signal may reach one process only: every rank stops after the same step
                if ranks.any_rank(self.stop_signal is not None, self.device):
                    ranks.ended_together()
                    if self.stop_signal is None:
                        self.stop_signal = ranks.stopped_elsewhere() or "a signal to another rank"
                if self.stop_signal or (every and lp.step % every == 0):
                    self._write(self.save)
            if self.stop_signal is None:
                if lp.step > start and self.cfg.run.save_every and lp.step % self.cfg.run.save_every:
                    self._write(self.save)
                if self.cfg.run.export_final:
                    self._write(lambda: self.export(self.run_dir / "final"))
                    if self.cfg.run.final_only and self.rank == 0:
                        from edgerl.train.checkpoint import checkpoints
                        retention.finish(self.run_dir, checkpoints(self.run_dir), lp.step, self.cfg.run.keep_best,
                                         self.log)
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
            other_ranks(None)
            self._close_user_code()
            self.metrics.close()
            self.session.close()
        return self.run_dir

    def _after_step(self, stats: dict[str, Any], on_step: Optional[Callable[[int, dict], None]],
                    evaluate: bool) -> None:
        """What follows a completed step (at step 0: the evaluation before the first): its samples, its
        evaluation, its metrics row and loggers, `on_step`. User code stopped by a signal here (a reward
        scoring a held-out answer) stops the run: the loop then saves the step. An error saves the step
        first, then is raised, a user error with what was saved."""
        step = self.step
        where = "the evaluation before the first step" if step == 0 else f"after step {step}"
        try:
            self._keep_lock()
            if step:
                self.metrics.write_samples(step, "train", self._samples)
            if evaluate:
                stats = self._evaluated(stats)
            self.metrics.write(step, stats)
            if on_step:
                on_step(step, stats)
        except Interrupted as e:
            self.stop_signal = e.signal
            self._salvage_row(step, stats)
            self.log(f"{e}: {where} stopped" + ("; no step had completed" if step == 0 else
                                                f"; step {step} completed and is saved"))
        except Exception as e:
            saved = self._save_completed(step, stats)
            if isinstance(e, USER_ERRORS):
                raise type(e)(f"{where}: {e}\n{saved}; fix the cause, then resume with --resume {self.run_dir}"
                              if step else f"{where}: {e}\n{saved}; fix the cause, then run the same command "
                              "again") from e
            self.log(f"{where}: {type(e).__name__}; {saved}")
            raise

    def _salvage_row(self, step: int, stats: dict[str, Any]) -> None:
        """The metrics row of `step` in metrics.jsonl, if what followed the step failed before writing it."""
        if step and self.metrics.last_step != step:
            try:
                self.metrics.write_row(step, stats)
            except Exception as e:   # the cause being reported matters more than this row
                self.log(f"the metrics of step {step} could not be written ({type(e).__name__}: {e})")

    def _save_completed(self, step: int, stats: dict[str, Any]) -> str:
        """Save completed step `step` (its weights are current) after what followed it failed; one line
        saying what was saved."""
        if step == 0:
            return "no checkpoint written (no step had completed)"
        self._salvage_row(step, stats)
        try:
            return f"saved step {step} to {self._write(self.save)}"
        except USER_ERRORS as e:
            return f"step {step} could not be saved ({e})"

    def _check_lock(self) -> None:
        """Rank 0 trains only while it holds the run folder's lock (released when a run ends or is closed)."""
        s = self.session
        if s.rank.main and (s.lock is None or not s.lock.held):
            raise RunDirError(f"{s.run_dir} is no longer locked by this process (the run ended or was closed), "
                              "so it cannot train there: prepare the run again (edgerl.prepare(resume=...))")

    def _keep_lock(self) -> None:
        if self.session.lock is not None:
            note = self.session.lock.keep()
            if note:
                self.log(note)

    def _evaluated(self, stats: dict[str, Any]) -> dict[str, Any]:
        """`stats` with the evaluation's metrics, its score kept for run.keep_best."""
        out = {**stats, **self.evaluate()}
        score = retention.score_of(out)
        if score is not None:
            self._scores[self.step] = score
        return out

    @contextlib.contextmanager
    def _profiled(self, step: int):
        """Record `step` with torch's profiler when it is run.profile_step; every rank writes its own
        files (rank-R in the name under torchrun), atomically, never over an earlier run's (a resumed
        run that records the same step again writes step-N-2.txt, ...)."""
        if step != self.cfg.run.profile_step:
            yield
            return
        from torch.profiler import ProfilerActivity, profile
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=False) as prof:
            yield
        if cuda:
            torch.cuda.synchronize(self.device)
        folder = self.run_dir / "profile"
        own(self.run_dir, folder.name)
        folder.mkdir(exist_ok=True)
        who = f"-rank{self.rank}" if dist.get_world_size() > 1 else ""
        base, n = f"step-{step}{who}", 1
        while (folder / f"{base}.txt").exists() or (folder / f"{base}.trace.json").exists():
            n += 1
            base = f"step-{step}{who}-{n}"
        by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=by, row_limit=60)
        p = self.plan
        head = (f"step {step} of {self.cfg.train.steps} on {self.device}; plan: {p.dtype.name}, {p.optimizer}, "
                f"micro-batch {p.micro_batch}, checkpointing {'on' if p.grad_checkpointing else 'off'}, "
                f"kernels {p.kernel_backend}, param offload {'on' if p.param_offload else 'off'}\n"
                f"operators by {by.replace('_', ' ')} (torch.profiler key_averages)\n\n")
        write_atomically(folder / f"{base}.txt", lambda tmp: tmp.write_text(head + table + "\n"))
        write_atomically(folder / f"{base}.trace.json", lambda tmp: prof.export_chrome_trace(str(tmp)))
        self.log(f"step {step} profiled: {folder / base}.txt and .trace.json (open the trace in "
                 "chrome://tracing or ui.perfetto.dev)")


class _NoMetrics:
    """The metrics writer of ranks other than 0."""
    tb_note = note = "metrics written by rank 0"
    last_step = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def write_row(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def write_samples(self, step: int, kind: str, rows: list) -> None:
        pass

    def archive_after(self, step: int) -> None:
        return None

    def close(self) -> None:
        pass


