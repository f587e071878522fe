"""A plan written out for others to run: an edgerl run config (TOML) and verl overrides."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from edgerl.algos import ESTIMATORS, POLICY_LOSSES
from edgerl.config.schema import Config, to_toml
from edgerl.plan import table
from edgerl.plan.modelspec import HF_IDS
from edgerl.plan.plan import Plan

_VERL_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def pinned_config(cfg: Config, p: Plan, profile: Optional[str]) -> Config:
    """`cfg` with each decision the table pins written into its key ([plan], train.micro_batch, [lora]),
    so that `edgerl train --config` reproduces this plan exactly."""
    for key, value in _pins(p).items():
        section, name = key.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, profile=profile or cfg.run.profile))


def _pins(p: Plan) -> dict[str, Any]:
    return {k: v for d in table.TABLE if d.name in p.values for k, v in d.pinned(p.values[d.name]).items()}


def plan_toml(cfg: Config, p: Plan, profile: Optional[str]) -> str:
    pinned = pinned_config(cfg, p, profile)
    notes = {f"plan.{d.config_key}": p.reasons.get(d.name, "") for d in table.TABLE if d.override is not None}
    notes |= {k: p.reasons.get(d.name, "") for d in table.TABLE if d.name in p.values
              for k in d.pinned(p.values[d.name])}
    head = (f"# edgerl run config for {p.device.describe()} and {p.model.name}, written by edgerl recommend.\n"
            f"# {p.task.effective_batch()}\n# memory estimate {p.memory.total / 2**30:.2f} GiB of "
            f"{p.memory.budget / 2**30:.2f} GiB budget (peak in {p.memory.peak_phase})\n\n")
    return head + to_toml(pinned, notes)


def verl_overrides(cfg: Config, p: Plan) -> tuple[list[str], list[str]]:
    """(Hydra overrides for `python -m verl.trainer.main_ppo`, what verl cannot do on this GPU).

    Keys follow verl's ppo_trainer.yaml; verl counts ppo_mini_batch_size in prompts, not sequences."""
    caveats: list[str] = []
    dev = p.device
    if dev.is_cuda and dev.cc < (7, 0):
        caveats.append(f"verl cannot train on {dev.describe()}: its rollout needs vLLM or SGLang (its HF "
                       "rollout is not registered), and neither runs below CC 7.0. Use edgerl train instead.")
    if not dev.is_cuda:
        caveats.append("verl needs CUDA GPUs; it does not train on the CPU.")
    if dev.is_cuda and dev.cc < (8, 0) and dev.cc >= (7, 0):
        caveats.append("verl defaults to bf16 and FlashAttention-2; the dtype and attention overrides below "
                       "are required on this GPU (verl#2517). Recent verl also expects CUDA >= 12.8, which "
                       "dropped sm_70 in torch 2.11 builds.")
    n = p.task.samples_per_prompt
    mini_prompts = max(1, p.task.mini // n)
    lines = [
        f"algorithm.adv_estimator={ESTIMATORS[p.task.algo].verl_name}",
        f"data.train_batch_size={p.task.prompts_per_step}",
        f"data.max_prompt_length={p.task.prompt_len}",
        f"data.max_response_length={p.task.response_len}",
        f"actor_rollout_ref.model.path={HF_IDS.get(cfg.model.path.lower(), cfg.model.path)}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_prompts}",
        f"actor_rollout_ref.actor.ppo_epochs={cfg.train.ppo_epochs}",
        f"actor_rollout_ref.actor.optim.lr={cfg.train.lr}",
        f"actor_rollout_ref.rollout.name={'vllm' if dev.is_cuda else 'hf'}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
    ]
    lines += [line for d in table.TABLE if d.verl and d.name in p.values for line in d.verl(p)]
    math_lines, math_caveats = verl_algorithm(cfg, p.task.critic)
    lines += math_lines
    caveats += math_caveats
    if p.task.critic:
        critic = cfg.model.critic_path or cfg.model.path
        lines += [f"critic.model.path={HF_IDS.get(critic.lower(), critic)}",
                  f"critic.ppo_micro_batch_size_per_gpu={p.micro_batch}"]
    if p.rollout_correction == "mis":
        caveats.append("edgerl's mis gives a token outside [1/C, C] the weight 0 and keeps it in the loss's "
                       "denominator, as TRL does; verl's rejection (rollout_rs) takes it out of the response mask, "
                       "so under token-mean verl's loss is edgerl's times (tokens / tokens kept).")
    r = cfg.rollout
    if r.episodes:   # verl's multi-turn rollout (its docs, "Multi-turn Rollout Support")
        lines += ["actor_rollout_ref.rollout.multi_turn.enable=True",
                  f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={r.turns()}"]
        caveats.append("verl takes tools as classes listed in a YAML file (actor_rollout_ref.rollout.multi_turn."
                       "tool_config_path) and environments as interactions (interaction_config_path), not edgerl's "
                       f"functions ({', '.join(r.tools + ([r.environment] if r.environment else []))}): write them "
                       "for verl; its multi-turn rollout runs on SGLang or vLLM's async server.")
    if p.kernel_backend == "triton":
        caveats.append("edgerl's fused log-prob kernel has no verl switch; verl's closest is "
                       "actor_rollout_ref.model.use_fused_kernels=True (Ampere and newer).")
    return lines, caveats


# verl's PPO loss always applies its dual clip (actor.clip_ratio_c, 3.0 by default). It clamps the
# log-ratio to [-20, 20], so the ratio never exceeds e^20 < 4.9e8, and a bound of 1e9 x |A| never binds:
# that is edgerl's dual clip turned off.
VERL_NO_DUAL_CLIP = 1e9


def _v(x: object) -> str:
    """A value as a Hydra override writes it."""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_v(v) for v in x) + "]"
    return str(x)


def verl_algorithm(cfg: Config, critic: bool) -> tuple[list[str], list[str]]:
    """(overrides, caveats) that make verl's RL math that of `cfg`: every setting of the loss, the
    advantages, the KL, the optimizer, the schedule and the sampling, written whether or not verl's
    default agrees (its defaults differ in lam, the KL estimator, the dual clip, the weight decay, the
    critic's value clip and top_k, and they may change)."""
    a, t, r = cfg.algo, cfg.train, cfg.rollout
    loss = POLICY_LOSSES[a.policy_loss]
    (clip_low, clip_high), agg = a.clip_range(), a.loss_agg_mode()
    kl_loss = a.kl_coef > 0 and a.kl_in == "loss"
    kl_reward = a.kl_coef > 0 and a.kl_in == "reward"
    actor, caveats = "actor_rollout_ref.actor", []
    lines = [
        f"algorithm.gamma={a.gamma}", f"algorithm.lam={a.lam}",
        f"algorithm.norm_adv_by_std_in_grpo={a.norm_adv_by_std}",
        f"algorithm.use_kl_in_reward={kl_reward}", f"algorithm.kl_penalty={_VERL_KL[a.kl_estimator]}",
        f"algorithm.kl_ctrl.kl_coef={a.kl_coef}",
        f"algorithm.kl_ctrl.type={'adaptive' if a.kl_target else 'fixed'}",
        f"{actor}.use_kl_loss={kl_loss}", f"{actor}.kl_loss_coef={a.kl_coef}",
        f"{actor}.kl_loss_type={_VERL_KL[a.kl_estimator]}",
        f"{actor}.policy_loss.loss_mode={loss.verl_name}",
        f"{actor}.clip_ratio_low={clip_low}", f"{actor}.clip_ratio_high={clip_high}",
        f"{actor}.loss_agg_mode={agg}", f"{actor}.entropy_coeff={a.entropy_coef}",
        f"{actor}.grad_clip={t.max_grad_norm}",
        f"{actor}.optim.weight_decay={t.weight_decay}", f"{actor}.optim.betas={_v(t.betas)}",
        f"{actor}.optim.lr_warmup_steps_ratio={t.warmup_ratio}",
        f"{actor}.optim.lr_scheduler_type={t.lr_schedule}", f"{actor}.optim.min_lr_ratio={t.min_lr_ratio}",
        f"trainer.total_training_steps={t.steps}",
        f"actor_rollout_ref.rollout.temperature={r.temperature}", f"actor_rollout_ref.rollout.top_p={r.top_p}",
        f"actor_rollout_ref.rollout.top_k={r.top_k or -1}",   # verl's "off" is -1, edgerl's 0
        f"actor_rollout_ref.rollout.ignore_eos={not r.stop_at_eos}",
    ]
    if loss.dual_clip:  # verl's PPO loss (vanilla) alone reads clip_ratio_c
        lines.append(f"{actor}.clip_ratio_c={float(a.dual_clip if a.dual_clip is not None else VERL_NO_DUAL_CLIP)!r}")
    if a.kl_target:
        lines += [f"algorithm.kl_ctrl.target_kl={a.kl_target}", f"algorithm.kl_ctrl.horizon={a.kl_horizon}"]
        if kl_loss:
            caveats.append("verl adapts the KL coefficient only for the KL in the reward (algorithm.kl_ctrl); "
                           f"its KL loss keeps actor.kl_loss_coef={a.kl_coef} fixed, where edgerl adapts it "
                           f"toward algo.kl_target={a.kl_target}. Use algo.kl_in=reward to match.")
    if critic:
        lines += [f"critic.optim.lr={t.critic_lr}", f"critic.cliprange_value={a.value_clip}",
                  f"critic.grad_clip={t.max_grad_norm}", f"critic.optim.weight_decay={t.weight_decay}",
                  f"critic.optim.betas={_v(t.betas)}", f"critic.optim.lr_warmup_steps_ratio={t.warmup_ratio}",
                  f"critic.optim.lr_scheduler_type={t.lr_schedule}", f"critic.optim.min_lr_ratio={t.min_lr_ratio}"]
    if agg == "seq-mean-token-sum-norm":
        caveats.append("edgerl's seq-mean-token-sum-norm divides the summed loss by sequences x the step's longest "
                       "response; verl's divides by the padded response length only (actor.loss_scale_factor), "
                       "so verl's loss, and its effective learning rate, is larger by about the batch size.")
    if t.warmup_ratio > 0:
        caveats.append("the warm-up ramps differ by one step: verl's learning rate starts at 0 (step/warm-up), "
                       "edgerl's at 1/(warm-up + 1) ((step + 1)/(warm-up + 1)).")
    return lines, caveats
