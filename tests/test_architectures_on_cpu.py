"""Qwen3 and Gemma 3 on the static engine, and any causal LM in the trainer's log-prob head: token for token
against transformers' generate and forward, on tiny random models built from configs (fp32, CPU)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from edgerl.rollout import HFGenerateEngine, SamplingParams, StaticCacheEngine
from rollout_helpers import (PROMPTS, next_token_logits, recompute_logprobs, tiny_gemma3, tiny_llama, tiny_qwen3,
                             with_lora)

MODELS = {"qwen3": lambda: tiny_qwen3(),
          # Qwen3's own sliding-window option: the first layer full, the other two through a window of 5
          "qwen3-window": lambda: tiny_qwen3(5, use_sliding_window=True, sliding_window=5, max_window_layers=1),
          "gemma3": lambda: tiny_gemma3()}


def greedy(n, eos=()):
    return SamplingParams(max_new_tokens=n, greedy=True, eos_token_ids=tuple(eos), pad_token_id=0)


def engine(model, sdpa=False, **kw):
    """The static engine, decode backend torch; sdpa: its 16-bit attention path (SDPA) on these fp32 models."""
    eng = StaticCacheEngine(model, 8, 64, cuda_graphs=False, **kw)
    eng.dec.backend.sdpa = sdpa
    return eng


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_equals_hf_generate_in_every_mode(name):
    """The torch backend's bmm attention over fused projections and its sdpa over module projections, two samples
    per prompt (a prompt prefilled once and copied), rows stopping at EOS and rows running on: the same tokens as
    HF generate."""
    model = MODELS[name]()
    free = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(24)).response_ids
    eos = next(t for r in free for t in r[2:-2] if sum(t in s for s in free) < len(free))
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(24, [eos]))
    assert any(not t for t in ref.truncated) and any(ref.truncated)
    for attention, projections in (("bmm", "auto"), ("sdpa", "modules")):
        got = engine(model, sdpa=attention == "sdpa", projections=projections).generate(
            PROMPTS, 2, greedy(24, [eos]))
        assert got.response_ids == ref.response_ids, (attention, projections)
        assert got.truncated == ref.truncated


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sampled_logprobs_equal_the_models_forward(name):
    """Each sampled token's log-prob equals log_softmax(logits / T) of HF's forward over the left-padded
    batch, the forward training runs: Gemma's final soft-capping, windows and rope bases included."""
    model = MODELS[name]()
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, pad_token_id=0)
    out = engine(model).generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(1))
    ref = recompute_logprobs(model, out.prompt_ids, out.response_ids, 0.8)
    for got_row, ref_row in zip(out.logprobs, ref):
        torch.testing.assert_close(torch.tensor(got_row), torch.tensor(ref_row), atol=2e-5, rtol=0)


def test_the_gemma_settings_moved_from_their_defaults_change_the_model():
    """The tiny Gemma 3's window, query_pre_attn_scalar, local rope base and final soft-capping each change
    HF's logits, so the equalities above would catch an engine that ignored any of them; its attention
    soft-capping does not (Gemma3Attention does not apply it), and the engine follows HF there too."""
    base = tiny_gemma3()
    resp = HFGenerateEngine(base, 8).generate(PROMPTS, 1, greedy(24)).response_ids
    want = next_token_logits(base, PROMPTS, resp)
    for change in ({"window": 64}, {"query_pre_attn_scalar": 16}, {"final_logit_softcapping": None},
                   {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}):
        other = next_token_logits(tiny_gemma3(**change), PROMPTS, resp)
        assert max((a - b).abs().max() for a, b in zip(want, other)) > 1e-3, change
    same = next_token_logits(tiny_gemma3(attn_logit_softcapping=None), PROMPTS, resp)
    assert max((a - b).abs().max() for a, b in zip(want, same)) == 0
    got = engine(base).generate(PROMPTS, 1, greedy(24)).response_ids
    assert got == resp


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_lora_modules_and_weight_sync_equal_hf(name):
    model = MODELS[name]()
    lora = with_lora(copy.deepcopy(model))
    ref = HFGenerateEngine(lora, 8).generate(PROMPTS, 1, greedy(20)).response_ids
    assert ref != HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(20)).response_ids
    eng = engine(lora)
    assert eng.dec.proj[0].kind == "modules"
    assert eng.generate(PROMPTS, 1, greedy(20)).response_ids == ref
    # a training update's weights (norms and q/k norms included) reach the fused engine in place
    fused = engine(model)
    source = MODELS[name]()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fused.sync_weights(source.state_dict().items())
    assert fused.generate(PROMPTS, 1, greedy(20)).response_ids == \
        HFGenerateEngine(source, 8).generate(PROMPTS, 1, greedy(20)).response_ids


@pytest.mark.parametrize("backend", ["cuda-c", "triton-layers"])
def test_gemma_refuses_the_decode_backends_that_fuse_llama_norms(backend):
    """The plan does not pick them for Gemma (test_modelspec_on_cpu.py); asked for anyway, the decoder says why
    in one line naming the backend, before any device check."""
    from edgerl.rollout.decoder import DecodeKernelUnavailable
    dec = engine(tiny_gemma3()).dec
    assert dec.arch.sandwich and dec.arch.windows == [6] and dec.arch.final_softcap == 3.0
    with pytest.raises(DecodeKernelUnavailable, match=f"decode backend '{backend}' cannot run here: gemma3_text's "
                       r"\(1 \+ weight\) RMS norms around attention and the MLP are not the llama-style norms"):
        engine(tiny_gemma3(), backend=backend)
    qwen = engine(tiny_qwen3()).dec
    assert qwen.arch.qk_norm and not qwen.arch.sandwich and qwen.fused_norms_reason() == ""


# ---- the trainer's log-prob head on any causal LM ---------------------------------------------------------

def _tiny(kind: str):
    """Tiny random causal LMs whose logits each come out of the head differently."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128)
    if kind == "gpt_neox":   # embed_out, not lm_head; gpt_neox.layers, not model.layers
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
    if kind == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0))
    if kind == "cohere":     # logits * logit_scale
        return tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.5, pad_token_id=0))
    if kind == "granite":    # logits / logits_scaling
        return tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=4.0))
    if kind == "gemma3":     # cap * tanh(logits / cap)
        return tiny_gemma3()
    if kind == "gemma3-vlm":   # Gemma 3 4B and up: a vision tower beside the language model, text alone here;
        # its class does not apply the text_config's final_logit_softcapping, so neither may the trainer
        text = dict(common, num_key_value_heads=1, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=5.0)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        return tf.AutoModelForCausalLM.from_config(tf.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
            boi_token_index=297, eoi_token_index=298))
    return tiny_llama()


@pytest.mark.parametrize("kind", ["llama", "gpt_neox", "phi3", "cohere", "granite", "gemma3", "gemma3-vlm"])
def test_policy_head_logprobs_are_the_models_own(kind):
    """PolicyHead (what the trainer differentiates) against log_softmax(model(ids).logits / T), with the
    gradient of a soft-capped head against plain autograd through the full logits."""
    from edgerl.models.load import PolicyHead, decoder_layers
    model = _tiny(kind).float()
    assert len(decoder_layers(model)) == model.config.get_text_config().num_hidden_layers
    plan = SimpleNamespace(kernel_backend="torch", logprob_chunk=5, kernel_tiles=None, share_prompts=False)
    head = PolicyHead(model, plan).train()   # as the trainer runs it (no dropout in these configs)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                         # left padding in the second row
    start, T = 4, 0.7
    targets = ids[:, start + 1:]
    logp, ent = head(ids, mask, targets, start, T)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, start:start + targets.shape[1]]
    ref = torch.log_softmax(logits.float() / T, -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), atol=1e-4, rtol=0)
    if kind == "gemma3":
        w = model.lm_head.weight
        (logp.sum() + 0.3 * ent.sum()).backward()
        got = w.grad.clone()
        w.grad = None
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, start:start + targets.shape[1]]
        ref = torch.log_softmax(logits.float() / T, -1)
        (ref.gather(-1, targets[..., None]).sum() - 0.3 * (ref.exp() * ref).sum()).backward()
        torch.testing.assert_close(got, w.grad, atol=1e-5, rtol=1e-4)
