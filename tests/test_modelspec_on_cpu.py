"""Model shapes from any config (Qwen3, Gemma 3, GPT-NeoX, ...), the catalogue's new entries, mixture-of-experts
refusal, windowed KV caches in the memory model, the plan's engine choice per architecture, and Hugging Face ids
through a local cache (no network)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from edgerl.core.errors import ModelError, ModelSpecError, PlanError
from edgerl.device.device import GiB
from edgerl.plan.archs import architecture
from edgerl.plan.decisions import lora_targets
from edgerl.plan.memory import Setting, estimate, kv_cache_bytes
from edgerl.plan.modelspec import CATALOGUE, ModelSpec, from_hf_config, resolve
from edgerl.plan.plan import Task, plan
from fakes import fake_probe

# config.json as published on the Hugging Face Hub (the fields the shape needs; the others left out)
QWEN3_1_7B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048,
              "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "sliding_window": None,
              "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": True,
              "hidden_act": "silu", "rms_norm_eps": 1e-06, "attention_bias": False}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
             "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
             "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
             "final_logit_softcapping": None, "attn_logit_softcapping": None}
# Gemma 3 4B is a vision-language model; its text_config names only what differs from Gemma3TextConfig's defaults
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                               "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                               "patch_size": 14}}
SMALL = Task(prompt_len=256, response_len=256, prompts_per_step=2, samples_per_prompt=8)


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    skip = {"name", "source", "max_position"}
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(ModelSpec) if f.name not in skip)


def test_published_configs_give_the_catalogue_shapes():
    assert same_shape(from_hf_config(QWEN3_1_7B, "q", "t"), CATALOGUE["qwen3-1.7b"])
    assert same_shape(from_hf_config(GEMMA3_1B, "g", "t"), CATALOGUE["gemma-3-1b"])
    assert same_shape(from_hf_config(GEMMA3_4B, "g", "t"), CATALOGUE["gemma-3-4b"])


def test_new_shapes_match_published_parameter_counts():
    """Qwen3's model cards (non-embedding parameters: 0.44B, 1.4B, 3.6B, 6.95B) and the Gemma 3 technical
    report's table 1 (embedding / non-embedding parameters: 1B 302M / 698M, 4B 675M / 3,209M)."""
    def non_embedding(m: ModelSpec) -> float:
        return (m.n_params() - m.embedding_params() * (1 if m.tie_embeddings else 2)) / 1e6
    for name, millions in {"qwen3-0.6b": 440, "qwen3-1.7b": 1400, "qwen3-4b": 3600, "qwen3-8b": 6950,
                           "gemma-3-1b": 698, "gemma-3-4b": 3209}.items():
        assert abs(non_embedding(CATALOGUE[name]) - millions) / millions < 0.015, name
    assert abs(CATALOGUE["gemma-3-1b"].embedding_params() / 1e6 - 302) < 1
    assert abs(CATALOGUE["gemma-3-4b"].embedding_params() / 1e6 - 675) / 675 < 0.01


def _hf_model(kind: str):
    import transformers as tf
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2)
    return {"llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
            "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True)),
            "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=24)),
            "gemma3_text": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=32, sliding_window=8)),
            "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0)),
            "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=16))}[kind]()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3_text", "phi3", "mistral"])
def test_spec_counts_every_parameter_of_the_model_transformers_builds(kind, tmp_path):
    model = _hf_model(kind)
    model.config.save_pretrained(tmp_path)
    spec = resolve(str(tmp_path))
    assert spec.model_type == kind
    assert spec.n_params() == sum(p.numel() for p in model.parameters())
    assert spec.fast_engine == (kind != "phi3")
    assert spec.lora_params(4, lora_targets(kind, None)) == 4 * sum(
        m.in_features + m.out_features for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in architecture(kind).lora_targets)


def test_any_decoder_config_is_read_with_its_own_key_names(tmp_path):
    gpt2 = from_hf_config({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                           "n_positions": 1024, "activation_function": "gelu_new"}, "gpt2", "t")
    assert (gpt2.hidden_size, gpt2.num_layers, gpt2.num_kv_heads, gpt2.intermediate_size, gpt2.mlp) == \
        (768, 12, 12, 3072, "plain")
    assert not gpt2.fast_engine
    neox = from_hf_config({"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 768, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "intermediate_size": 3072, "rotary_pct": 0.25}, "p", "t")
    assert neox.module_shapes()["query_key_value"] == (768, 3 * 768) and neox.mlp == "plain"
    assert abs(neox.n_params() / 1e6 - 162) < 2   # Pythia-160M: 162M with its biases and norms left out
    with pytest.raises(ModelSpecError, match="t: config.json has no usable hidden_size"):
        from_hf_config({"model_type": "odd", "vocab_size": 10}, "x", "t")


@pytest.mark.parametrize("cfg,why", [
    ({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
      "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "moe_intermediate_size": 768},
     "num_experts=128"),
    ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_local_experts": 8}, "num_local_experts=8"),
    ({"model_type": "someone_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4}, "model_type 'someone_moe'")])
def test_mixture_of_experts_is_refused_with_the_reason(cfg, why, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSpecError, match=f"mixture-of-experts model \\({why}\\).*dense") as e:
        resolve(str(tmp_path))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_windowed_kv_bytes_count_each_layer_the_slow_way():
    m = CATALOGUE["gemma-3-1b"]
    types = ["full" if (i + 1) % 6 == 0 else "sliding" for i in range(m.num_layers)]
    for L in (100, 512, 513, 3000):
        slow = 0
        for t in types:
            for tok in range(L):
                if t == "full" or tok >= L - m.sliding_window:
                    slow += 2 * m.num_kv_heads * m.hd * 2
        assert m.kv_bytes(L, 2, windowed=True) == slow
        assert m.kv_bytes(L, 2, windowed=False) == L * m.kv_bytes_per_token(2)
    s = Setting(compute_bytes=2, base_bytes=4, grad_checkpointing=True, swap_models=False, optimizer_offload=False,
                param_offload=False, micro_batch=1, score_micro_batch=1, rollout_batch=8, logprob_chunk=256,
                logit_bytes=8, eager_attention=False)
    kv = {w: estimate(m, dataclasses.replace(s, kv_window=w), 1024, 2048, 100 * GiB).phases["rollout"]["KV cache"]
          for w in (False, True)}
    # the cache and 12 bytes a column of the engine's token and log-prob buffers (3072 columns: whole rows of 16)
    assert kv == {w: 8 * (m.kv_bytes(3072, 2, w) + 3072 * 12) for w in (False, True)} and kv[True] < kv[False]


def test_the_plan_names_the_engine_and_why_per_architecture():
    dev = fake_probe("T4").primary
    for name in ("qwen3-1.7b", "gemma-3-1b"):
        p = plan(dev, CATALOGUE[name], SMALL)
        assert p.rollout_engine == "static" and CATALOGUE[name].model_type in p.reasons["rollout_engine"]
    neox = from_hf_config({"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 768, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "intermediate_size": 3072}, "pythia", "t")
    p = plan(dev, neox, dataclasses.replace(SMALL, lora=False))
    assert p.rollout_engine == "hf-generate" and p.decode_backend is None
    assert "does not implement the gpt_neox architecture" in p.reasons["rollout_engine"]
    with pytest.raises(PlanError, match="rollout_engine=static is not possible: .*gpt_neox.*; use hf-generate"):
        plan(dev, neox, SMALL, {"rollout_engine": "static"})
    # transformers' generate keeps only the window of Gemma's sliding layers: the plan counts that
    gen = plan(dev, CATALOGUE["gemma-3-1b"], dataclasses.replace(SMALL, prompt_len=1024, response_len=1024),
               {"rollout_engine": "hf-generate"})
    static = plan(dev, CATALOGUE["gemma-3-1b"], dataclasses.replace(SMALL, prompt_len=1024, response_len=1024),
                  {"rollout_batch": gen.rollout_batch})
    per_row = {q.rollout_engine: q.memory.phases["rollout"]["KV cache"] / q.rollout_batch for q in (gen, static)}
    m = CATALOGUE["gemma-3-1b"]
    # (the static engine's cache: columns rounded up to 16 and 12 bytes a column of token and log-prob buffers; fp32
    # on a T4, where Gemma 3 would overflow fp16)
    b = gen.dtype.compute_bytes
    assert b == 4 and per_row == {"hf-generate": kv_cache_bytes(m, 1, 2048, b, True), "static": kv_cache_bytes(m, 1, 2048, b)}
    assert per_row["hf-generate"] < per_row["static"]


def test_gemma_decode_kernels_that_fuse_llama_norms_are_not_chosen():
    p40 = plan(fake_probe("P40").primary, CATALOGUE["gemma-3-1b"], SMALL)
    assert p40.decode_backend == "torch" and "(1 + weight) RMS norms" in p40.reasons["decode_backend"]
    qwen = plan(fake_probe("P40").primary, CATALOGUE["qwen3-1.7b"], SMALL)
    assert qwen.decode_backend == "cuda-c"   # Qwen3's q/k norms run between the projection and the kernel
    with pytest.raises(PlanError, match=r"decode_backend=cuda-c is not possible: .*\(1 \+ weight\) RMS norms.*; use torch"):
        plan(fake_probe("P40").primary, CATALOGUE["gemma-3-1b"], SMALL, {"decode_backend": "cuda-c"})
    # in 16 bits the attention kernel runs between torch's layers (Gemma's norms, windows and q/k norms in torch)
    h100 = plan(fake_probe("H100").primary, CATALOGUE["gemma-3-1b"], SMALL)
    assert h100.decode_backend == "triton-attention"
    with pytest.raises(PlanError, match="decode_backend=triton-layers is not possible: .*; use triton-attention"):
        plan(fake_probe("H100").primary, CATALOGUE["gemma-3-1b"], SMALL, {"decode_backend": "triton-layers"})
    assert plan(fake_probe("H100").primary, CATALOGUE["qwen3-1.7b"], SMALL).decode_backend == "triton-layers"


def test_lora_default_targets_for_the_new_architectures():
    for name in ("qwen3-4b", "gemma-3-1b"):
        m = CATALOGUE[name]
        p = plan(fake_probe("T4").primary, m, dataclasses.replace(SMALL, lora=True))
        assert p.lora["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---- Hugging Face ids through huggingface_hub's cache ------------------------------------------------------

def fake_hub(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A huggingface_hub cache holding one snapshot of `repo_id` (refs/main -> snapshots/<commit>/...)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from edgerl.core import hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.snapshot.cache_clear()
    yield tmp_path / "hub"
    hub.snapshot.cache_clear()


def test_a_hub_id_plans_from_its_cached_config_offline(offline_hub):
    fake_hub(offline_hub, "acme/qwen3-mini", {"config.json": json.dumps(QWEN3_1_7B).encode()})
    spec = resolve("acme/qwen3-mini")
    assert same_shape(spec, CATALOGUE["qwen3-1.7b"]) and spec.name == "acme/qwen3-mini"
    with pytest.raises(ModelSpecError) as e:
        resolve("acme/not-here")
    msg = str(e.value)
    assert "\n" not in msg and "'acme/not-here'" in msg and str(offline_hub) in msg and "HF_HUB_OFFLINE" in msg


def test_a_hub_id_without_cached_weights_is_one_line_offline(offline_hub):
    from edgerl.core.hub import snapshot
    fake_hub(offline_hub, "acme/config-only", {"config.json": b"{}"})
    with pytest.raises(ModelError) as e:
        snapshot("acme/config-only")
    msg = str(e.value)
    assert "\n" not in msg and "'acme/config-only'" in msg and "weights" in msg and "HF_HUB_OFFLINE" in msg
    folder = fake_hub(offline_hub, "acme/whole", {"config.json": b"{}", "model.safetensors": b"x"})
    assert snapshot("acme/whole") == folder


def test_recommend_with_an_uncached_hub_id_offline_exits_2_in_one_line(offline_hub):
    from typer.testing import CliRunner
    from edgerl.cli.main import app
    r = CliRunner().invoke(app, ["recommend", "--gpu", "t4", "--model", "acme/nothing-cached"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "acme/nothing-cached" in r.output and "HF_HUB_OFFLINE" in r.output


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """Online, but the Hub's address refuses connections (a closed local port): no network."""
    from huggingface_hub import constants
    from edgerl.core import hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    hub.snapshot.cache_clear()
    yield tmp_path / "hub"
    hub.snapshot.cache_clear()


def test_a_hub_id_without_a_network_says_the_hub_cannot_be_reached(unreachable_hub, tmp_path):
    """Not 'download the model again' (nothing was downloaded): the Hub cannot be reached, how to download it
    where there is a network, and HF_HUB_OFFLINE for the cache; through the tokenizer load `train` does first."""
    from edgerl.models.load import load_tokenizer
    fake_hub(unreachable_hub, "acme/config-only", {"config.json": b"{}"})   # `recommend` cached its config
    for repo in ("acme/config-only", "acme/nothing-cached"):
        with pytest.raises(ModelError) as e:
            load_tokenizer(repo)
        msg = str(e.value)
        assert "\n" not in msg and "the Hub cannot be reached" in msg and f"hf download {repo}" in msg, msg
        assert "HF_HUB_OFFLINE=1" in msg and "download the model again" not in msg
