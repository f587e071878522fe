"""A plan written out for others to run: an edgerl run config (TOML) and verl overrides."""

from __future__ import annotations

import dataclasses
from typing import Optional

from edgerl.algos import ESTIMATORS
from edgerl.config.schema import Config, to_toml
from edgerl.plan.decisions import DEFAULT_LORA_TARGETS
from edgerl.plan.dtypes import hf_name
from edgerl.plan.modelspec import HF_IDS
from edgerl.plan.plan import Plan

_VERL_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def pinned_config(cfg: Config, p: Plan, profile: Optional[str]) -> Config:
    """`cfg` with the plan's decisions written into [plan] and train.micro_batch, so that
    `edgerl train --config` reproduces this plan exactly."""
    po = dataclasses.replace(
        cfg.plan, dtype=p.dtype.compute, attention=p.attention, rollout_engine=p.rollout_engine,
        cuda_graphs=p.cuda_graphs, rollout_compile=p.rollout_compile, decode_attention=p.decode_attention,
        nf4_kernel=p.nf4_kernel, share_prompts=p.share_prompts,
        kernel_backend=p.kernel_backend,
        grad_checkpointing=p.grad_checkpointing, activation_offload=p.activation_offload,
        attention_chunk=p.attention_chunk or None,
        param_offload=p.param_offload, optimizer_offload=p.optimizer_offload, optimizer=p.optimizer,
        base_dtype=p.base_dtype if p.lora else cfg.plan.base_dtype,
        rollout_batch=p.rollout_batch, score_micro_batch=p.score_micro_batch)
    lora = dataclasses.replace(cfg.lora, enabled=bool(p.lora))
    if p.lora:  # the targets the plan counted, so that a different architecture default cannot creep in
        lora = dataclasses.replace(lora, target_modules=list(p.lora["targets"]))
    train = dataclasses.replace(cfg.train, micro_batch=p.micro_batch)
    run = dataclasses.replace(cfg.run, profile=profile or cfg.run.profile)
    return dataclasses.replace(cfg, plan=po, lora=lora, train=train, run=run)


def plan_toml(cfg: Config, p: Plan, profile: Optional[str]) -> str:
    pinned = pinned_config(cfg, p, profile)
    notes = {f"plan.{k}": p.reasons.get(k, "") for k in p.DECISIONS}
    notes["train.micro_batch"] = p.reasons.get("micro_batch", "")
    notes["lora.enabled"] = p.reasons.get("lora", "")
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
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={p.micro_batch}",
        f"actor_rollout_ref.actor.ppo_epochs={cfg.train.ppo_epochs}",
        f"actor_rollout_ref.actor.optim.lr={cfg.train.lr}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={p.grad_checkpointing}",
        f"actor_rollout_ref.actor.fsdp_config.param_offload={p.param_offload}",
        f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={p.optimizer_offload or p.param_offload}",
        f"actor_rollout_ref.ref.fsdp_config.param_offload={p.swap_models or p.param_offload}",
        f"actor_rollout_ref.rollout.name={'vllm' if dev.is_cuda else 'hf'}",
        f"actor_rollout_ref.rollout.dtype={hf_name(p.dtype.compute)}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={max(0.1, round(p.rollout_memory_share, 2))}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={p.score_micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={p.score_micro_batch}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={p.attention}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
    ]
    if p.dtype.compute != "bf16":
        lines.append(f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={hf_name(p.dtype.compute)}")
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
    if p.lora:
        lines += [f"actor_rollout_ref.model.lora_rank={p.lora['rank']}",
                  f"actor_rollout_ref.model.lora_alpha={p.lora['alpha']:g}",
                  "actor_rollout_ref.model.target_modules=" + (
                      "all-linear" if tuple(p.lora["targets"]) == DEFAULT_LORA_TARGETS  # the same 7 projections
                      else f"[{','.join(p.lora['targets'])}]")]
    if p.kernel_backend == "triton":
        caveats.append("edgerl's fused log-prob kernel has no verl switch; verl's closest is "
                       "actor_rollout_ref.model.use_fused_kernels=True (Ampere and newer).")
    return lines, caveats
