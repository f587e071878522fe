"""The `hf-generate` engine: transformers' own `generate`, for the models edgerl's static-cache decoder
does not implement (other architectures, rope types whose frequencies change with the length, a
sliding window the sequences outgrow), and the reference the faster engine is tested against."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import GenerationConfig

from .base import EngineContext, OwnWeights, RolloutBatch, SamplingParams, cut_at_eos, inference_copy, load_weights


def build(plan, ctx: EngineContext) -> OwnWeights:
    copy = inference_copy(plan, ctx)
    engine = HFGenerateEngine(copy, plan.rollout_batch, note=plan.reasons.get("rollout_engine", ""))
    return OwnWeights(engine, copy, plan.rollout_resident)


class HFGenerateEngine:
    """Plain `model.generate` over left-padded prompts. The reference behaviour for the faster engines.

    `model` is the engine's own inference copy (compute dtype, on the device); the trainer pushes
    its weights in with `sync_weights` after every update."""

    name = "hf-generate"

    def __init__(self, model: torch.nn.Module, batch_size: int, note: str = "") -> None:
        self.model = model
        self.batch_size = max(1, batch_size)
        self.note = note

    def describe(self) -> str:
        return f"hf generate, {self.batch_size} sequences at a time" + (f" ({self.note})" if self.note else "")

    @torch.no_grad()
    def sync_weights(self, weights) -> None:
        load_weights(self.model, weights)

    def release(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n_samples: int, params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> RolloutBatch:
        rows = [p for p in prompts for _ in range(n_samples)]
        responses: list[list[int]] = []
        truncated: list[bool] = []
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), params.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, p in enumerate(chunk):  # left padding: every prompt ends at the same column
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                if generator is not None:  # HF generate samples from the global RNG
                    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
                # A complete GenerationConfig, so the model's own defaults (top_k=50, repetition
                # penalties) never change the distribution the trainer's log-probs assume.
                gen = GenerationConfig(
                    max_new_tokens=params.max_new_tokens, do_sample=not params.greedy,
                    temperature=params.temperature if not params.greedy else 1.0,
                    top_p=params.top_p if not params.greedy else 1.0,
                    top_k=(params.top_k or 0) if not params.greedy else None,
                    eos_token_id=list(params.eos_token_ids) or None, pad_token_id=params.pad_token_id,
                    use_cache=True)
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                          generation_config=gen)
                for row in out[:, width:].tolist():
                    resp, cut = cut_at_eos(row, params.eos_token_ids, params.max_new_tokens)
                    responses.append(resp)
                    truncated.append(cut)
        finally:
            self.model.train(was_training)
        return RolloutBatch(prompt_ids=rows, response_ids=responses, truncated=truncated)
