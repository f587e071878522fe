"""What the trainer keeps and restores: checkpoints (save, resume), the final export, and the
out-of-memory path that saves the last good state. A mixin of `Trainer`, which holds the state."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from .errors import TrainingError
from . import checkpoint
from . import lora as lora_io
from .config import to_dict
from .memory import fmt_bytes
from .models import lm_weights, save_hf




class TrainerState:
    # --- failure handling -------------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "rng": checkpoint.rng_state(self.gen),
                "optim_steps": _optim_steps(self.optim)}

    def _out_of_memory(self, e: BaseException, before: dict[str, Any]) -> None:
        measured = torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0
        saved = "no checkpoint written (the optimizer had already stepped this step)"
        if _optim_steps(self.optim) == before["optim_steps"]:  # the weights are still those of the last step
            self.sampler.load_state_dict(before["sampler"])
            checkpoint.set_rng_state(before["rng"], self.gen)
            folder = self.save()
            saved = f"saved the last good state (step {self.step}) to {folder}"
        p = self.plan
        if p.micro_batch > 1:
            fix = f"--set train.micro_batch={max(1, p.micro_batch // 2)}"
        elif not p.grad_checkpointing:
            fix = "--set plan.grad_checkpointing=true"
        elif p.rollout_batch > 1:
            fix = f"--set plan.rollout_batch={max(1, p.rollout_batch // 2)}"
        else:
            other = ("--set plan.base_dtype=fp16" if self.lora and p.base_dtype == "fp32" else
                     "a smaller model" if self.lora else "--set lora.enabled=true")
            fix = f"--set rollout.max_new_tokens={max(16, self.cfg.rollout.max_new_tokens // 2)} or {other}"
        raise TrainingError(f"CUDA out of memory in step {self.step + 1}: the plan estimated "
                            f"{fmt_bytes(p.memory.total)} (peak in {p.memory.peak_phase}), the process reserved "
                            f"{fmt_bytes(measured)} before failing. {saved}. Try {fix}, then resume with "
                            f"--resume {self.run_dir}") from e

    # --- checkpoints --------------------------------------------------------------------------------------

    def save(self) -> Optional[Path]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        files: dict[str, bytes] = {}
        if self.lora:  # the frozen base is the model's own: only the adapter, in peft's format
            tensors = {"adapter_model": lora_io.adapter_state(self.actor)}
            files["adapter_config.json"] = lora_io.adapter_config_json(self.actor)
        else:
            tensors = {"actor": get_model_state_dict(self.actor, options=full)}
        optim_state = self.offload.state_dict(lambda: get_optimizer_state_dict(self.actor, self.optim, options=full))
        state: dict[str, Any] = {"optim": optim_state, "sched": self.sched.state_dict()}
        if self.critic is not None:
            tensors["critic"] = (lora_io.trainable_state(self.critic) if self.lora else
                                 get_model_state_dict(self.critic, options=full))
            state["critic_optim"] = self.critic_offload.state_dict(
                lambda: get_optimizer_state_dict(self.critic, self.critic_optim, options=full))
            state["critic_sched"] = self.critic_sched.state_dict()
        state["train"] = {"step": self.step, "sampler": self.sampler.state_dict(), "rng": checkpoint.rng_state(self.gen),
                          "kl_ctl": self.kl_ctl.state_dict(), "bad_in_a_row": self.bad_in_a_row,
                          "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        if self.rank != 0:
            return None
        meta = {"step": self.step, "config": to_dict(self.cfg), "plan": self.plan.decisions()}
        folder = checkpoint.save(self.run_dir, self.step, tensors, state, meta, self.cfg.run.keep_last, files)
        self.log(f"checkpoint: {folder}")
        return folder

    def _load(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        tensors, state, meta = checkpoint.load(folder)
        full = StateDictOptions(full_state_dict=True)
        kind = "adapter_model" if self.lora else "actor"
        if kind not in tensors:
            raise checkpoint.CheckpointError(
                f"{folder} holds {'a LoRA adapter' if 'adapter_model' in tensors else 'full weights'}, but this run "
                f"{'trains LoRA' if self.lora else 'trains every weight'}; resume with the lora.enabled the run had")
        try:
            if self.lora:
                lora_io.load_adapter_state(self.actor, tensors["adapter_model"], str(folder))
            else:
                set_model_state_dict(self.actor, tensors["actor"], options=full)
            set_optimizer_state_dict(self.actor, self.optim, state["optim"], options=full)
            self.sched.load_state_dict(state["sched"])
            if self.critic is not None:
                if "critic" not in tensors:
                    raise checkpoint.CheckpointError(f"{folder} has no critic; it was not a PPO (gae) run")
                if self.lora:
                    lora_io.load_trainable(self.critic, tensors["critic"], f"{folder} (critic)")
                else:
                    set_model_state_dict(self.critic, tensors["critic"], options=full)
                set_optimizer_state_dict(self.critic, self.critic_optim, state["critic_optim"], options=full)
                self.critic_sched.load_state_dict(state["critic_sched"])
        except ValueError as e:
            raise checkpoint.CheckpointError(str(e)) from None
        self.offload.to_host()
        if self.critic_offload is not None:
            self.critic_offload.to_host()
        tr = state["train"]
        self.step = tr["step"]
        self.sampler.load_state_dict(tr["sampler"])
        checkpoint.set_rng_state(tr["rng"], self.gen)
        self.kl_ctl.load_state_dict(tr["kl_ctl"])
        self.bad_in_a_row = tr["bad_in_a_row"]
        if self.scaler is not None and tr.get("scaler"):
            self.scaler.load_state_dict(tr["scaler"])
        self.log(f"resumed from {folder} at step {self.step}")

    def export(self, out: Path) -> Path:
        """The trained actor as an HF folder that transformers loads. Under LoRA: the adapter (peft format)
        in `<out>-adapter`, and the merged model in `out` when lora.export_merged."""
        out = Path(out)
        if self.lora:
            adapter = lora_io.adapter_state(self.actor)
            if self.rank == 0:
                folder = lora_io.save_adapter(self.actor, out.with_name(out.name + "-adapter"), adapter)
                self.log(f"final adapter: {folder}")
            if not self.cfg.lora.export_merged:
                return out.with_name(out.name + "-adapter")
        # one tensor at a time to the host: a second full copy on the GPU could run out of memory;
        # merged LoRA weights are fp32 (W + scale B A), so the whole merged folder is fp32
        weights = {k: (v.float() if self.lora else v).cpu() for k, v in lm_weights(self.actor)}
        if self.rank == 0:
            save_hf(weights, self.cfg.model.path, self.tokenizer, out, self.cfg.model.trust_remote_code)
            self.log(f"final model: {out}" + (" (merged: plain transformers, no peft needed)" if self.lora else ""))
        return out


def _optim_steps(optim: torch.optim.Optimizer) -> int:
    return sum(int(s.get("step", 0)) for s in optim.state.values() if isinstance(s, dict)) if optim.state else 0
