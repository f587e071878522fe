"""The tokenizer in GGUF, as llama.cpp's converter writes a byte-level BPE one ("gpt2" in GGUF's terms):
every token and its type, the merges, the special token ids, whether BOS/EOS are added, the chat template.

llama.cpp picks its pre-tokenizer (how text is split before the merges) by name in tokenizer.ggml.pre; the
name is read here from the tokenizer's own pre_tokenizer in tokenizer.json, matched against the splits of
the tokenizers the supported families ship:

    smollm      Digits(individual) then ByteLevel with GPT-2's split   SmolLM2
    gpt-2       ByteLevel with GPT-2's split                            GPT-2-style BPE
    llama-bpe   Split(LLAMA3) then ByteLevel                            Llama 3.x
    qwen2       Split(QWEN2) then ByteLevel                             Qwen2, Qwen2.5, Qwen3
    tekken      Split(TEKKEN) then ByteLevel                            Mistral's Tekken (Nemo, Small 3)

Any other split, and SentencePiece-style tokenizers (byte fallback: Llama 2, Mistral 7B v0.1-v0.3, Gemma),
are refused in one line: llama.cpp's converter handles those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from edgerl.core.errors import ModelError

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
SPLITS = {LLAMA3: "llama-bpe", QWEN2: "qwen2", TEKKEN: "tekken"}


def pre_name(pre: Optional[dict[str, Any]]) -> Optional[str]:
    """llama.cpp's pre-tokenizer name for a tokenizer.json pre_tokenizer, or None when none matches."""
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps or []]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if str(steps[0].get("behavior", "")).lower() == "isolated" and not steps[0].get("invert"):
            return SPLITS.get(pattern)
    return None


def _looks_special(text: str) -> bool:
    """Added tokens written like control tokens (<|im_start|>, <｜end▁of▁sentence｜>) are CONTROL in llama.cpp
    even where the tokenizer does not flag them special."""
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def write_vocab(writer: Any, folder: Path, n_vocab: int) -> dict[str, Any]:
    """Add the tokenizer in `folder` to `writer`; returns {"eos": text, "tokens": n} for the Modelfile."""
    import gguf
    from transformers import AutoTokenizer
    path = folder / "tokenizer.json"
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelError(f"{path} is missing or unreadable: edgerl writes GGUF tokenizers from a fast tokenizer's "
                         "tokenizer.json; convert with llama.cpp's convert_hf_to_gguf.py") from None
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ModelError(f"{path}: a {'SentencePiece-style ' if model.get('byte_fallback') else ''}"
                         f"{model.get('type')} tokenizer; edgerl writes byte-level BPE tokenizers to GGUF (SmolLM2, "
                         "Llama 3, Qwen, Tekken): convert this model with llama.cpp's convert_hf_to_gguf.py")
    pre = pre_name(tj.get("pre_tokenizer"))
    if pre is None:
        raise ModelError(f"{path}: its pre_tokenizer is not one llama.cpp names (smollm, gpt-2, llama-bpe, qwen2, "
                         "tekken); convert this model with llama.cpp's convert_hf_to_gguf.py")
    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = tok.get_vocab()
    if vocab and max(vocab.values()) >= n_vocab:
        raise ModelError(f"{folder}: the tokenizer has ids up to {max(vocab.values())}, past the model's vocab_size "
                         f"{n_vocab}")
    reverse = {i: t for t, i in vocab.items()}
    added = tok.added_tokens_decoder
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:   # embedding rows the tokenizer never produces (Qwen pads its vocabulary)
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            text = added[i].content
            tokens.append(text)
            types.append(T.CONTROL if added[i].special or _looks_special(text) else T.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(T.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ModelError(f"{path} holds no merges; a BPE tokenizer without them cannot be written")
    ids = tok("a")["input_ids"]   # whether encoding adds BOS / EOS, as the tokenizer itself does it
    special.add_special_token["bos"] = bool(ids) and tok.bos_token_id is not None and ids[0] == tok.bos_token_id
    special.add_special_token["eos"] = bool(ids) and tok.eos_token_id is not None and ids[-1] == tok.eos_token_id
    if special.chat_template is None and getattr(tok, "chat_template", None):
        special.chat_template = tok.chat_template   # a template set on the tokenizer object only
    special.add_to_gguf(writer, quiet=True)
    eos = special.special_token_ids.get("eos")
    return {"eos": tokens[eos] if eos is not None else None, "template": special.chat_template, "pre": pre}
