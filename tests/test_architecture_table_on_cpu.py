"""The architecture table (edgerl/plan/archs.py): a llama-identical architecture is one row. This file adds one,
"fakellama" (its own transformers config and model classes, registered as a new model_type's would be), and sees
it plan with the static engine and LoRA's default targets, decode token for token as transformers' generate, and
train a step; and checks that no code outside the table tests a model_type, and docs/models.md's table is the
table's."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from edgerl.plan import archs

ROOT = Path(__file__).resolve().parents[1]


def _fake_classes():
    """FakeLlamaConfig / FakeLlamaForCausalLM: llama's, under model_type "fakellama", registered with transformers'
    Auto classes (as a new architecture's would be by its transformers release)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    class FakeLlamaConfig(LlamaConfig):
        model_type = "fakellama"

    class FakeLlamaForCausalLM(LlamaForCausalLM):
        config_class = FakeLlamaConfig

    AutoConfig.register("fakellama", FakeLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(FakeLlamaConfig, FakeLlamaForCausalLM, exist_ok=True)
    return FakeLlamaConfig, FakeLlamaForCausalLM


@pytest.fixture
def fakellama(monkeypatch):
    """The row: llama's, with its own model_type and class."""
    monkeypatch.setitem(archs.ARCHITECTURES, "fakellama", replace(
        archs.ARCHITECTURES["llama"], model_type="fakellama", family="FakeLlama", examples="a test's",
        hf_class="FakeLlamaForCausalLM", gguf=None))
    return _fake_classes()


def _model(classes, **fields):
    config_cls, model_cls = classes
    torch.manual_seed(0)
    cfg = config_cls(**{**dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0), **fields})
    model = model_cls(cfg).eval()
    with torch.no_grad():   # norm weights off 1, so that a norm read wrongly shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape))
    return model


def test_a_new_row_plans_with_the_static_engine(fakellama, tmp_path):
    from edgerl.plan.modelspec import resolve
    from edgerl.plan.plan import plan
    from edgerl.plan.task import Task
    from fakes import fake_probe
    _model(fakellama).save_pretrained(tmp_path)
    spec = resolve(str(tmp_path))
    assert spec.model_type == "fakellama" and spec.fast_engine and spec.mlp == "gated" and not spec.qk_norm
    p = plan(fake_probe("3090").primary, spec, Task(lora=True))
    assert p.rollout_engine == "static" and p.decode_backend == "triton-layers", p.reasons
    assert tuple(p.lora["targets"]) == archs.DEFAULT_LORA_TARGETS
    without = plan(fake_probe("3090").primary, replace(spec, model_type="fakellama-without-a-row"), Task(lora=False))
    assert without.rollout_engine == "hf-generate" and "does not implement the fakellama-without-a-row" in \
        without.reasons["rollout_engine"]


def test_a_new_row_decodes_as_hf_generate(fakellama):
    from edgerl.rollout import HFGenerateEngine, SamplingParams, StaticCacheEngine
    from rollout_helpers import PROMPTS
    model = _model(fakellama)
    params = SamplingParams(max_new_tokens=16, greedy=True, pad_token_id=0)
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, params)
    eng = StaticCacheEngine(model, 8, 64, cuda_graphs=False)
    assert eng.dec.arch.row.model_type == "fakellama"
    assert eng.generate(PROMPTS, 2, params).response_ids == ref.response_ids


def test_without_its_row_the_decoder_refuses_it(monkeypatch):
    from edgerl.rollout import StaticCacheEngine, UnsupportedModel
    classes = _fake_classes()
    monkeypatch.delitem(archs.ARCHITECTURES, "fakellama", raising=False)
    with pytest.raises(UnsupportedModel, match="FakeLlamaForCausalLM is not an architecture the static engine"):
        StaticCacheEngine(_model(classes), 8, 64, cuda_graphs=False)


def test_a_new_row_trains(fakellama, tmp_path):
    from transformers import AutoTokenizer
    from conftest import need_tokenizer, prepare_trainer
    from edgerl.train.metrics import read_metrics
    tok = AutoTokenizer.from_pretrained(need_tokenizer())
    folder = tmp_path / "model"
    _model(fakellama, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
           pad_token_id=None).save_pretrained(folder)
    tok.save_pretrained(folder)
    t = prepare_trainer(folder, tmp_path / "run", [
        'run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=64", "train.steps=1", "run.save_every=0", "lora.enabled=true",
        "run.export_final=false", "algo.skip_uniform_groups=false"])
    assert t.plan.rollout_engine == "static"
    t.run()
    row = read_metrics(tmp_path / "run")[-1]
    assert row["step"] == 1 and torch.isfinite(torch.tensor(row["actor/grad_norm"]))


def test_no_code_outside_the_table_tests_a_model_type():
    """Facts about an architecture live in its row: no `model_type ==`, `model_type in (...)`, `model_type in
    A_LIST` or `startswith` on a model_type outside edgerl/plan/archs.py."""
    bad = []
    pattern = re.compile(r"model_type\s*(==|!=|in\s*\(|in\s*\[|\.startswith)|model_type\s+(not\s+)?in\s+[A-Z_]{3,}"
                         r"|\"(llama|qwen2|qwen3|gemma3_text|mistral)\"\s*(==|in)\s*\w*model_type")
    for top in ("edgerl",):
        for f in sorted((ROOT / top).rglob("*.py")):
            if f.name == "archs.py" and f.parent.name == "plan":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if pattern.search(line.split("#")[0]):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_models_doc_table_is_the_tables():
    doc = (ROOT / "docs" / "models.md").read_text()
    block = re.search(r"<!-- architectures:start -->\n(.*?)\n<!-- architectures:end -->", doc, re.S)
    assert block and block.group(1).strip() == archs.table(), \
        "docs/models.md's architecture table is stale: paste the output of `python -m edgerl.plan.archs`"


def test_every_row_is_consistent():
    from edgerl.plan.engines import DECODE_BACKENDS
    for name, a in archs.ARCHITECTURES.items():
        assert a.model_type == name and a.layout in archs.LAYOUTS and a.norm in ("rms", "gemma")
        assert set(a.decode_backends(tuple(DECODE_BACKENDS))) == set(DECODE_BACKENDS)
        if a.static:
            assert a.hf_class and a.layout == "llama" and a.mlp == "gated"
            assert not a.decode_backends(tuple(DECODE_BACKENDS))["torch"]
    assert set(archs.FUSED_NORM_BACKENDS) <= set(DECODE_BACKENDS)
    gemma = archs.architecture("gemma3_text").decode_backends(tuple(DECODE_BACKENDS))
    assert gemma["triton-layers"] and gemma["cuda-c"] and not gemma["triton-attention"]
