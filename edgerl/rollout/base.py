"""The one rollout interface the trainer uses; engines live beside it (`hf`, `vllm`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0: off
    eos_token_ids: tuple[int, ...] = ()  # empty: never stop early
    pad_token_id: int = 0
    greedy: bool = False                 # argmax instead of sampling (tests, evaluation)


@dataclass
class RolloutBatch:
    """One response per row; the n samples of a prompt are contiguous rows."""
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]        # ends with the EOS token when the response stopped
    truncated: list[bool]                # reached max_new_tokens without EOS
    logprobs: Optional[list[list[float]]] = None   # the sampler's own log-probs, when the engine has them
    info: dict = field(default_factory=dict)       # engine notes, e.g. timings

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


class RolloutEngine(Protocol):
    name: str
    needs_weights: bool   # False when the engine runs the trainer's own modules (nothing to sync)

    def generate(self, prompts: list[list[int]], n_samples: int, params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> RolloutBatch:
        """Sample `n_samples` responses for each prompt (token ids, no padding)."""

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's current weights (HF parameter names, full tensors) after an update."""

    def release(self) -> None:
        """Free engine memory (KV cache, graphs) while the trainer updates."""

    def describe(self) -> str:
        """One line for the run log: engine, mode, and why."""


def cut_at_eos(tokens: list[int], eos: tuple[int, ...], limit: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first EOS; (response, truncated)."""
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1], False
    return tokens[:limit], True
