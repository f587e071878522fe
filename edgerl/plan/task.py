"""`Task`: the shape of the work the plan fits to the device (lengths, batch, algorithm, LoRA, GPUs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Task:
    """The shape of the work: what the memory model and batch decisions depend on, and the algorithm's
    settings a decision reads."""
    prompt_len: int = 256
    response_len: int = 256
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    mini_batch: Optional[int] = None       # sequences per PPO update; None = all of the step
    algo: str = "grpo"
    critic: bool = False                   # the estimator learns values (gae): a critic model trains too
    kl: bool = True                        # a reference model is needed (kl_coef > 0)
    reward_model_params: int = 0
    lora: Optional[bool] = False           # None: the plan turns LoRA on when full fine-tuning cannot fit
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: Optional[tuple[str, ...]] = None
    world_size: int = 1                    # GPUs (processes) sharing the step; the plan is for one of them
    # episodes of several turns (rollout.tools, rollout.environment): response_len is the episode's budget
    # after the prompt and turn_len one model turn (rollout.max_new_tokens), which the static engine's KV
    # cache holds beyond the budget (edgerl/rollout/turns_static.py); 0 for one response per prompt
    turn_len: int = 0
    rollout_correction: Optional[str] = None   # algo.rollout_correction: none | tis | mis; None: the plan decides
    rollout_correction_level: str = "token"
    rollout_correction_threshold: float = 2.0
    sft: bool = False                      # supervised fine-tuning: the update alone (no rollout, no scoring)

    @property
    def episodes(self) -> bool:
        return self.turn_len > 0

    @property
    def length_key(self) -> str:
        """The config key that sets response_len."""
        return "rollout.max_episode_tokens" if self.episodes else "rollout.max_new_tokens"

    @property
    def length_word(self) -> str:
        return "episode" if self.episodes else "response"

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def mini(self) -> int:
        return self.mini_batch or self.sequences

    @property
    def local_sequences(self) -> int:
        """Sequences one GPU generates, scores and trains on per step."""
        return self.sequences // self.world_size

    @property
    def local_mini(self) -> int:
        return self.mini // self.world_size

    def effective_batch(self) -> str:
        updates = self.sequences // self.mini
        if self.sft:
            return f"{self.sequences} rows per step (sft); mini-batch {self.mini} -> {updates} update(s) per step"
        per_gpu = (f" over {self.world_size} GPUs: {self.local_sequences} sequences and a mini-batch of "
                   f"{self.local_mini} per GPU" if self.world_size > 1 else "")
        return (f"{self.prompts_per_step} prompts x {self.samples_per_prompt} samples = {self.sequences} "
                f"sequences per step; mini-batch {self.mini} -> {updates} update(s) per epoch{per_gpu}")
