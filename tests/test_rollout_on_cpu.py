"""The static-cache engine (eager decode, decode backend torch) against HF generate and a full-forward
recomputation, fp32 on the CPU: fused and module-call projections, LoRA adapters, weight sync into fused
views, release/restore of fused storage, state kept across generates, the backends' refusals."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from edgerl.rollout import HFGenerateEngine, SamplingParams, StaticCacheEngine, UnsupportedModel, load_weights
from edgerl.rollout.sampling import filter_logits, sample
from rollout_helpers import (PROMPTS, next_token_logits, perturbed, recompute_logprobs, tiny_llama, tiny_qwen2,
                             with_lora)

MODELS = {"llama-tied": lambda: tiny_llama(tied=True), "qwen2-untied": lambda: tiny_qwen2(tied=False),
          "llama-untied": lambda: tiny_llama(3, tied=False), "qwen2-tied": lambda: tiny_qwen2(4, tied=True)}


def static(model, max_batch=8, max_seq_len=64):
    return StaticCacheEngine(model, max_batch, max_seq_len, cuda_graphs=False)


def greedy(n, eos=()):
    return SamplingParams(max_new_tokens=n, greedy=True, eos_token_ids=tuple(eos), pad_token_id=0)


def pick_eos(responses):
    """A token that greedy decoding emits early in some rows and never in another row."""
    counts = collections.Counter()
    for r in responses:
        counts.update(set(r[:-2]))
    for tok, c in counts.most_common():
        if 0 < c < len(responses):
            return tok
    raise AssertionError("no token stops some rows but not others; change the prompts or the seed")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_equals_hf_generate_with_eos(name):
    model = MODELS[name]()
    ref_free = HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(24))
    eng = static(model)
    got_free = eng.generate(PROMPTS, 1, greedy(24))
    assert got_free.response_ids == ref_free.response_ids
    assert all(got_free.truncated)

    eos = pick_eos(ref_free.response_ids)
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(24, [eos]))
    got = eng.generate(PROMPTS, 1, greedy(24, [eos]))
    assert got.response_ids == ref.response_ids
    assert got.truncated == ref.truncated
    assert any(not t for t in got.truncated) and any(got.truncated)   # some rows stopped, some ran on
    for r, cut in zip(got.response_ids, got.truncated):
        assert (r[-1] == eos) != cut and eos not in r[:-1]
    assert torch.isfinite(eng.dec.cache).all()                  # pad columns left nothing that poisons
    keep = static(model)
    keep.drop_finished = False   # every row decoded to the end (finished rows otherwise leave the batch)
    assert keep.generate(PROMPTS, 1, greedy(24, [eos])).response_ids == got.response_ids
    for i, r in enumerate(got.response_ids):
        assert keep._state.out_tok[i, len(r):24].eq(0).all()    # finished rows kept emitting pad
    assert [len(lp) for lp in got.logprobs] == [len(r) for r in got.response_ids]


def test_greedy_in_chunks_and_samples_per_prompt():
    """More rows than max_batch: chunks of 3, last one smaller; n_samples rows are contiguous."""
    model = tiny_llama()
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(12))
    got = static(model, max_batch=3).generate(PROMPTS, 2, greedy(12))
    assert got.prompt_ids == ref.prompt_ids == [p for p in PROMPTS for _ in range(2)]
    assert got.response_ids == ref.response_ids
    assert got.info["chunks"] == 3


def test_all_rows_stop_early():
    """When every row has hit EOS the loop stops before max_new_tokens (on the CPU: at once)."""
    model = tiny_llama()
    first = static(model).generate(PROMPTS, 1, greedy(4)).response_ids
    eos = sorted({r[1] for r in first})                 # every row stops at token 2 at the latest
    got = static(model, max_seq_len=256).generate(PROMPTS, 1, greedy(200, eos))
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(200, eos))
    assert got.response_ids == ref.response_ids
    assert not any(got.truncated)
    assert got.info["decode_steps"] == max(len(r) for r in got.response_ids) - 1


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_scaled_rope_equals_hf(rope):
    model = tiny_llama(5, rope_parameters={"rope_theta": 500000.0, **rope})
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(16))
    assert static(model).generate(PROMPTS, 1, greedy(16)).response_ids == ref.response_ids


def test_mistral_with_and_without_a_sliding_window_equals_hf():
    def mistral(window):
        torch.manual_seed(2)
        cfg = MistralConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            sliding_window=window, initializer_range=0.1)
        return MistralForCausalLM(cfg).eval()
    outputs = []
    for window in (None, 8):   # 8: shorter than the longest prompt, so every row's later tokens see a window
        model = mistral(window)
        ref = HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(12)).response_ids
        assert static(model).generate(PROMPTS, 1, greedy(12)).response_ids == ref
        outputs.append(ref)
    assert outputs[0] != outputs[1]                            # the window changes what the model says


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-untied"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 20, 1.0)])
def test_sampled_logprobs_match_full_forward(name, temperature, top_k, top_p):
    model = MODELS[name]()
    params = SamplingParams(max_new_tokens=20, temperature=temperature, top_k=top_k, top_p=top_p,
                            eos_token_ids=(7,), pad_token_id=0)
    out = static(model).generate(PROMPTS, 3, params, generator=torch.Generator().manual_seed(0))
    ref = recompute_logprobs(model, out.prompt_ids, out.response_ids, temperature)
    for got_row, ref_row in zip(out.logprobs, ref):
        assert len(got_row) == len(ref_row)
        torch.testing.assert_close(torch.tensor(got_row), torch.tensor(ref_row), atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.2), (5, 0.5)])
def test_top_k_top_p_never_leave_the_allowed_set(top_k, top_p):
    model = tiny_qwen2()
    params = SamplingParams(max_new_tokens=16, temperature=2.0, top_k=top_k, top_p=top_p)
    out = static(model).generate(PROMPTS, 4, params, generator=torch.Generator().manual_seed(1))
    logits = next_token_logits(model, out.prompt_ids, out.response_ids)
    seen = set()
    for r, lg in zip(out.response_ids, logits):
        scaled = lg / 2.0
        if top_k:
            scaled = TopKLogitsWarper(top_k)(None, scaled)
        if top_p < 1:
            scaled = TopPLogitsWarper(top_p)(None, scaled)
        allowed = torch.isfinite(scaled)
        for t, tok in enumerate(r):
            assert allowed[t, tok], f"token {tok} at step {t} is outside the top-k/top-p set"
            seen.add(int(allowed[t].sum()))
    assert max(seen) > 1          # the sets were not all trivial, so the test could have failed


def test_filter_equals_hf_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3
    for k, p in [(0, 0.9), (10, 1.0), (10, 0.5), (0, 0.05), (400, 0.99)]:
        ref = logits.clone()
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        got = filter_logits(logits, k, torch.tensor([p]) if p < 1 else None)
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), (k, p)


def test_gumbel_sampling_matches_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(40000, 4).contiguous()
    g = torch.Generator().manual_seed(0)
    tok, logp = sample(logits, torch.tensor([1.0]), greedy=False, top_k=0, top_p=None, generator=g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    torch.testing.assert_close(logp, probs.log()[tok])
    tok, _ = sample(logits, torch.tensor([1.0]), greedy=False, top_k=0, top_p=torch.tensor([0.7]), generator=g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0, 0]), atol=0.01, rtol=0)
    tok, _ = sample(logits, torch.tensor([0.5]), greedy=False, top_k=2, top_p=None, generator=g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    torch.testing.assert_close(freq, torch.tensor([25 / 34, 9 / 34, 0, 0]), atol=0.01, rtol=0)


def test_same_seed_same_samples():
    model = tiny_llama()
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    eng = static(model)
    a = eng.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(11))
    b = eng.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(11))
    c = eng.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(12))
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert a.response_ids != c.response_ids
    torch.manual_seed(5)
    d = eng.generate(PROMPTS, 2, params)
    torch.manual_seed(5)
    assert eng.generate(PROMPTS, 2, params).response_ids == d.response_ids


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-untied"])
def test_sync_weights_changes_output_like_hf(name):
    model = MODELS[name]()
    eng = static(model)
    before = eng.generate(PROMPTS, 1, greedy(16)).response_ids
    source = MODELS[name]()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng.sync_weights(source.state_dict().items())      # tied models send lm_head.weight too
    after = eng.generate(PROMPTS, 1, greedy(16)).response_ids
    assert after != before
    assert after == HFGenerateEngine(source, 8).generate(PROMPTS, 1, greedy(16)).response_ids
    eng.release()
    assert eng.dec.cache is None and eng._state is None
    assert eng.generate(PROMPTS, 1, greedy(16)).response_ids == after


def test_load_weights_rejects_unknown_and_missing_names():
    model = tiny_llama()
    named = list(model.named_parameters())
    with pytest.raises(KeyError, match="untouched"):
        load_weights(model, named[:-1])
    with pytest.raises(KeyError, match="no parameter"):
        load_weights(model, named + [("model.extra.weight", torch.zeros(1))])


def test_bad_requests_are_clear_errors():
    eng = static(tiny_llama(), max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate(PROMPTS, 1, greedy(8))
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1], []], 1, greedy(4))
    with pytest.raises(ValueError, match="CUDA"):
        StaticCacheEngine(tiny_llama(), 4, 16, cuda_graphs=True)


def test_unsupported_architecture_and_rope_are_refused_by_the_decoder():
    # the plan routes such models to hf-generate (engines.static_engine_support); the decoder checks again
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM, Qwen2ForCausalLM"):
        static(gpt2)
    dyn = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        static(dyn)


# ---- projections: fused views, module calls, LoRA ---------------------------------------------------

PROJECTION_MODELS = {**MODELS, "llama-mha": lambda: tiny_llama(6, num_key_value_heads=4),
                     "llama-mlp-bias": lambda: tiny_llama(8, mlp_bias=True, attention_bias=True)}


def with_sdpa(engine: StaticCacheEngine) -> StaticCacheEngine:
    """The torch backend's 16-bit attention (SDPA) on an fp32 model: its code path, checked against HF here."""
    engine.dec.backend.sdpa = True
    return engine


@pytest.mark.parametrize("attention", ["bmm", "sdpa"])
@pytest.mark.parametrize("name", sorted(PROJECTION_MODELS))
def test_fused_and_module_projections_equal_hf_generate(name, attention):
    model = PROJECTION_MODELS[name]()
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(20)).response_ids
    fused = static(model, max_batch=8)
    fused = fused if attention == "bmm" else with_sdpa(fused)
    assert fused.dec.proj[0].kind == "fused" and fused.dec.backend.name == "torch"
    assert fused.generate(PROMPTS, 2, greedy(20)).response_ids == ref
    # HF's own forward reads the same fused storage through the parameter views: its output is unchanged.
    assert HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(20)).response_ids == ref
    mods = StaticCacheEngine(model, 8, 64, cuda_graphs=False, projections="modules")
    mods = mods if attention == "bmm" else with_sdpa(mods)
    assert mods.dec.proj[0].kind == "modules"
    assert mods.generate(PROMPTS, 2, greedy(20)).response_ids == ref


def test_fused_weights_are_the_parameters_storage():
    model = tiny_qwen2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    eng = static(model)
    at, p0 = model.model.layers[1].self_attn, eng.dec.proj[1]
    assert p0.qkv_w.data_ptr() == at.q_proj.weight.data_ptr()
    assert at.k_proj.weight.data_ptr() == p0.qkv_w[at.q_proj.out_features:].data_ptr()
    assert at.v_proj.bias.data_ptr() == p0.qkv_b[-at.v_proj.out_features:].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == total            # nothing copied or added
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # A second engine on the same model reuses the fused storage, so the first one stays valid.
    other = StaticCacheEngine(model, 4, 32, cuda_graphs=False)
    assert other.dec.proj[1].qkv_w.data_ptr() == p0.qkv_w.data_ptr()
    assert other.dec.proj[1].gu_w.data_ptr() == p0.gu_w.data_ptr()
    assert all(p.intact() for p in eng.dec.proj)


def test_lora_modules_path_equals_peft_generate_and_merged_fused_path():
    base = tiny_llama(7)
    plain = HFGenerateEngine(base, 8).generate(PROMPTS, 1, greedy(20)).response_ids
    lora = with_lora(copy.deepcopy(base))
    ref = HFGenerateEngine(lora, 8).generate(PROMPTS, 1, greedy(20)).response_ids
    assert ref != plain                                      # the adapter changes the output
    eng = static(lora)                                       # auto: LoRA layers are called as modules
    assert eng.dec.proj[0].kind == "modules" and "lora" in eng.describe().lower()
    assert eng.generate(PROMPTS, 1, greedy(20)).response_ids == ref
    with pytest.raises(ValueError, match="projections='modules'"):
        StaticCacheEngine(lora, 8, 64, cuda_graphs=False, projections="fused")
    # The training model itself, in train mode with adapter dropout: the engine generates in eval mode.
    training = with_lora(copy.deepcopy(base), dropout=0.5).train()
    assert any(isinstance(m, torch.nn.Dropout) for m in training.modules())
    assert static(training).generate(PROMPTS, 1, greedy(20)).response_ids == ref and training.training
    merged = copy.deepcopy(lora).merge_and_unload()
    fused = static(merged)
    assert fused.dec.proj[0].kind == "fused"
    assert fused.generate(PROMPTS, 1, greedy(20)).response_ids == ref


# ---- weights: sync, release/restore, state kept across generates ------------------------------------

@pytest.mark.parametrize("name", ["llama-tied", "qwen2-untied"])
def test_sync_fills_the_fused_weights(name):
    model = MODELS[name]()
    eng = static(model)
    source = perturbed(MODELS[name])
    eng.sync_weights(source.state_dict().items())
    for layer, src, proj in zip(model.model.layers, source.model.layers, eng.dec.proj):
        s_at, s_mlp = src.self_attn, src.mlp
        assert torch.equal(proj.qkv_w, torch.cat([s_at.q_proj.weight, s_at.k_proj.weight, s_at.v_proj.weight]))
        assert torch.equal(proj.gu_w, torch.cat([s_mlp.gate_proj.weight, s_mlp.up_proj.weight]))
        if proj.qkv_b is not None:
            assert torch.equal(proj.qkv_b, torch.cat([s_at.q_proj.bias, s_at.k_proj.bias, s_at.v_proj.bias]))
    assert eng.generate(PROMPTS, 1, greedy(16)).response_ids == \
        HFGenerateEngine(source, 8).generate(PROMPTS, 1, greedy(16)).response_ids


def test_release_and_restore_free_and_refill_the_fused_storage():
    from edgerl.models.load import release_weights, restore_weights
    model = tiny_qwen2()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    eng = static(model)
    eng.generate(PROMPTS, 1, greedy(4))
    assert release_weights(model) == weight_bytes          # the fused storages counted once each
    for proj in eng.dec.proj:
        assert all(t.untyped_storage().nbytes() == 0 for t in (proj.qkv_w, proj.qkv_b, proj.gu_w))
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(PROMPTS, 1, greedy(4))
    restore_weights(model)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert all(proj.intact() for proj in eng.dec.proj)     # still one storage per fused weight
    source = perturbed(lambda: tiny_qwen2())
    eng.sync_weights(source.state_dict().items())
    assert eng.generate(PROMPTS, 1, greedy(16)).response_ids == \
        HFGenerateEngine(source, 8).generate(PROMPTS, 1, greedy(16)).response_ids


def test_cache_and_buffers_kept_across_generates_with_a_sync_between():
    model = tiny_llama()
    eng = static(model)
    first = eng.generate(PROMPTS, 1, greedy(16))
    cache, state = eng.dec.cache.data_ptr(), eng._state
    source = perturbed(tiny_llama)
    eng.sync_weights(source.named_parameters())
    second = eng.generate(PROMPTS, 1, greedy(16))
    assert eng.dec.cache.data_ptr() == cache and eng._state is state   # nothing re-allocated
    assert not second.info["graphs_dropped"]
    assert second.response_ids != first.response_ids
    assert second.response_ids == HFGenerateEngine(source, 8).generate(PROMPTS, 1, greedy(16)).response_ids
    mem = eng.memory_bytes()
    assert mem["kv_cache"] == eng.dec.cache_bytes() > 0 and mem["state"] > 0
    eng.release()
    assert eng.memory_bytes() == {"kv_cache": 0, "state": 0, "graph_pool": 0}


def test_graphs_are_dropped_when_weights_move_and_kept_when_they_stay():
    """The address check that guards kept CUDA graphs, driven on the CPU with stand-in graphs."""
    from edgerl.rollout.engine_static import _addresses
    model = tiny_llama()
    eng = static(model)
    eng.generate(PROMPTS, 1, greedy(4))

    def fake_capture():
        eng._graphs["stand-in"] = object()
        eng._stamp = _addresses(eng.dec)

    fake_capture()
    eng.sync_weights(perturbed(tiny_llama).named_parameters())         # in place: addresses stay
    out = eng.generate(PROMPTS, 1, greedy(4))
    assert not out.info["graphs_dropped"] and "stand-in" in eng._graphs
    norm = model.model.layers[0].input_layernorm.weight
    norm.data = norm.data.clone()                                      # a parameter moved
    out = eng.generate(PROMPTS, 1, greedy(4))
    assert out.info["graphs_dropped"] and not eng._graphs
    fake_capture()
    q = model.model.layers[2].self_attn.q_proj.weight
    q.data = q.data.clone()                                            # left its fused storage
    assert not eng.dec.proj[2].intact()
    out = eng.generate(PROMPTS, 1, greedy(16))
    assert out.info["graphs_dropped"] and eng.dec.proj[2].intact()    # fused again, from its values
    assert out.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(16)).response_ids
    source = perturbed(tiny_llama)
    eng.sync_weights(source.named_parameters())                        # reaches the new fused storage
    assert eng.generate(PROMPTS, 1, greedy(16)).response_ids == \
        HFGenerateEngine(source, 8).generate(PROMPTS, 1, greedy(16)).response_ids


def test_step_times_are_recorded_when_asked():
    eng = StaticCacheEngine(tiny_llama(), 8, 64, cuda_graphs=False, time_steps=True)
    out = eng.generate(PROMPTS, 1, greedy(10))
    assert len(out.info["step_ms"]) == out.info["decode_steps"] == 9 and min(out.info["step_ms"]) > 0
    assert "step_ms" not in static(tiny_llama()).generate(PROMPTS, 1, greedy(3)).info


@pytest.mark.parametrize("cast", ["to_bf16", "bf16_weights_fp32_rope"])
def test_bf16_prefill_uses_the_models_own_rotary_frequencies(cast):
    """`model.to(torch.bfloat16)` rounds HF's `inv_freq` buffer too, and HF's forward rotates with it;
    `from_pretrained(dtype=torch.bfloat16)` keeps it fp32. Either way the engine must compute what the
    model computes: at head dim 64 and a 64-token prompt a 0.3% frequency error moves the last
    position's logits by more than one std (a different first token)."""
    model = tiny_llama(7, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       rope_parameters={"rope_theta": 100000.0})
    rot = model.model.rotary_emb
    fp32_inv = rot.inv_freq.clone()
    model = model.to(torch.bfloat16)
    if cast == "bf16_weights_fp32_rope":
        rot.inv_freq = fp32_inv
    assert rot.inv_freq.dtype == (torch.bfloat16 if cast == "to_bf16" else torch.float32)
    ids = torch.randint(3, 512, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1].float()
    eng = static(model, max_batch=3, max_seq_len=80)
    eng.dec.allocate()
    got = eng.dec.prefill(ids, torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(got, ref, atol=0.02 * float(ref.std()), rtol=0)
    out = eng.generate(ids.tolist(), 1, greedy(8))
    assert out.response_ids == HFGenerateEngine(model, 3).generate(ids.tolist(), 1, greedy(8)).response_ids


def test_a_prompt_shared_by_several_rows_is_prefilled_once():
    """GRPO's samples of one prompt: the prompt's cache columns are computed in its first row and copied to
    the others; every row's cache equals a prefill of all rows, and the output equals HF generate."""
    model = tiny_llama()
    eng = static(model, max_batch=8)
    seen = []
    real = eng.dec.prefill
    eng.dec.prefill = lambda ids, start, rows=None: seen.append(ids.shape[0]) or real(ids, start, rows)
    prompts = [PROMPTS[1], PROMPTS[0]]
    got = eng.generate(prompts, 4, greedy(6))
    assert seen == [2]
    assert got.response_ids == HFGenerateEngine(model, 8).generate(prompts, 4, greedy(6)).response_ids
    # the cache after a prefill of every row, no sharing
    rows = [p for p in prompts for _ in range(4)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    plain = static(model, max_batch=8)
    plain.dec.allocate()
    plain.dec.prefill(ids, torch.tensor([width - len(p) for p in rows]))
    shared = static(model, max_batch=8)
    shared.generate(prompts, 4, greedy(1))   # one token: the cache holds the prefill only
    torch.testing.assert_close(shared.dec.cache[:, :, :8, :, :width], plain.dec.cache[:, :, :8, :, :width],
                               rtol=1e-5, atol=1e-6)
    # rows in any order: a prompt's samples need not be next to each other
    mixed = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    seen.clear()
    out = eng.generate(mixed, 1, greedy(6))
    assert seen == [3]
    assert out.response_ids == HFGenerateEngine(model, 8).generate(mixed, 1, greedy(6)).response_ids


@pytest.mark.parametrize("projections", ["fused", "modules"])
def test_qkv_parts_are_the_columns_of_qkv(projections):
    model = tiny_qwen2()   # q/k/v biases
    eng = StaticCacheEngine(model, 2, 32, cuda_graphs=False, projections=projections)
    proj, h = eng.dec.proj[0], torch.randn(3, 64)
    parts = proj.qkv_parts(h)
    assert [p.shape[-1] for p in parts] == [64, 32, 32]
    assert torch.equal(torch.cat(parts, -1), proj.qkv(h))


def test_the_plans_engines_and_backends_are_the_rollouts():
    """Every engine and decode backend the plan may pick is one the rollout can build, and the other way round:
    the plan's dicts (edgerl/plan/engines.py) and the rollout's (ENGINES, DECODE_BACKENDS) name the same ones."""
    from edgerl.plan import engines
    from edgerl.rollout import ENGINES
    from edgerl.rollout.decode_backends import DECODE_BACKENDS
    assert set(engines.ENGINES) == set(ENGINES)
    assert set(engines.DECODE_BACKENDS) == set(DECODE_BACKENDS)
    assert all(cls.name == name for name, cls in DECODE_BACKENDS.items())


def test_a_kernel_backend_off_cuda_is_refused_with_the_reason():
    from edgerl.rollout.decoder import DecodeKernelUnavailable
    with pytest.raises(DecodeKernelUnavailable, match="decode backend 'cuda-c' cannot run here: tensors are on cpu"):
        StaticCacheEngine(tiny_llama(), 2, 32, cuda_graphs=False, backend="cuda-c")
    with pytest.raises(ValueError, match="no decode backend 'nvrtc'; choose one of torch, triton-attention, triton-layers, cuda-c"):
        StaticCacheEngine(tiny_llama(), 2, 32, cuda_graphs=False, backend="nvrtc")


def test_a_decode_backend_that_cannot_run_stops_training_naming_the_setting():
    import types
    from edgerl.core.errors import TrainingError
    from edgerl.rollout.engine_static import _engine
    plan = types.SimpleNamespace(decode_backend="cuda-c", rollout_batch=2, reasons={})
    with pytest.raises(TrainingError, match=r"cannot run here: tensors are on cpu.*set plan.decode_backend=torch"):
        _engine(plan, tiny_llama(), 32, cuda=False)
