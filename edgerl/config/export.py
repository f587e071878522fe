"""A plan written out for others to run: an edgerl run config (TOML) and verl overrides."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from edgerl.algos import ESTIMATORS
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
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "loss":
        lines += ["actor_rollout_ref.actor.use_kl_loss=True",
                  f"actor_rollout_ref.actor.kl_loss_coef={cfg.algo.kl_coef}",
                  f"actor_rollout_ref.actor.kl_loss_type={_VERL_KL[cfg.algo.kl_estimator]}"]
    elif cfg.algo.kl_coef > 0:
        lines += ["algorithm.use_kl_in_reward=True", f"algorithm.kl_ctrl.kl_coef={cfg.algo.kl_coef}"]
    if p.task.critic:
        critic = cfg.model.critic_path or cfg.model.path
        lines += [f"critic.model.path={HF_IDS.get(critic.lower(), critic)}",
                  f"critic.ppo_micro_batch_size_per_gpu={p.micro_batch}"]
    if p.kernel_backend == "triton":
        caveats.append("edgerl's fused log-prob kernel has no verl switch; verl's closest is "
                       "actor_rollout_ref.model.use_fused_kernels=True (Ampere and newer).")
    return lines, caveats
