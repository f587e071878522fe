"""The exported GGUF in llama.cpp itself (through llama-cpp-python, when installed; it builds llama.cpp from
source, so CI does not install it): the same tokens as the HF tokenizer, and next-token logits close to the
HF model's.

llama.cpp's CPU kernels round the activations too (to f16 for f16 weights, to 8-bit blocks for q8_0 weights)
and sum in another order, so its logits are compared within 3% (f16) and 6% (q8_0: weights and activations
both in 8-bit blocks) of their largest magnitude, and the most likely next token must agree at 90% of the
positions or more; the exact check of the file's contents against the rounded
HF model is transformers' (tests/test_export_on_cpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_tiny_model

llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (pip install llama-cpp-python; it "
                                "compiles llama.cpp)")

BOUND = {"f16": 0.03, "q8_0": 0.06}
TEXT = "Let's think step by step: 12 + 345 = 357, and the answer is 357.\n#### 357"


def _llama_cpp_logits(path, tokens):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(tokens)
    return llm, np.array(llm.scores[:len(tokens)], dtype=np.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral"])
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_llama_cpp_reads_the_export_as_the_hf_model(arch, quant, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from edgerl.export import export
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128) if arch == "qwen3" else {}
    model_dir = make_tiny_model(tmp_path / f"tiny-{arch[:2]}", arch=arch, tied=arch != "qwen3", initializer_range=0.1,
                                **shape)
    out = export(str(model_dir), "gguf", [quant], tmp_path / "out", log=lambda s: None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(TEXT).input_ids
    llm, got = _llama_cpp_logits(out / f"tiny-{arch[:2]}-{quant}.gguf", ids)
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=True) == ids
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() <= BOUND[quant] * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_llama_cpp_runs_the_embedded_model_export(tmp_path):
    """SmolLM2-135M-Instruct's real weights, q8_0: llama.cpp's next-token choices are HF's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from edgerl.export import export
    from edgerl.models.load import model_source
    out = export("smollm2-135m-instruct", "gguf", ["q8_0"], tmp_path / "out", log=lambda s: None)
    folder = model_source("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    llm, got = _llama_cpp_logits(out / "smollm2-135m-instruct-q8_0.gguf", ids)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(torch.tensor([ids])).logits[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    text = llm.create_chat_completion(messages=[{"role": "user", "content": "What is 12 + 30?"}], max_tokens=16,
                                      temperature=0.0)["choices"][0]["message"]["content"]
    assert text.strip()
