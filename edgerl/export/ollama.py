"""An Ollama Modelfile beside the GGUF: FROM the file, TEMPLATE in Ollama's Go template syntax where the
model's chat template is one edgerl recognises, its default system prompt, and the stop tokens.

The chat template is recognised by what it renders, not by its text: the HF template is rendered for a
system message and a user message (and for a user message alone), and compared with what each known
format renders. A template that matches none gets no TEMPLATE line; Ollama then reads the chat template
the GGUF carries (tokenizer.chat_template), which it matches against the formats it knows.
"""

from __future__ import annotations

from typing import Any, Optional

SYS, USER = "SYSTEM-TEXT", "USER-TEXT"

# name -> (render(system or None, user) as the HF template would, Ollama template, stop tokens)
FORMATS: dict[str, tuple[Any, str, list[str]]] = {
    "chatml": (
        lambda s, u: (f"<|im_start|>system\n{s}<|im_end|>\n" if s is not None else "")
        + f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n",
        "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
        "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n",
        ["<|im_start|>", "<|im_end|>"]),
    "llama3": (
        lambda s, u: "<|begin_of_text|>" + (f"<|start_header_id|>system<|end_header_id|>\n\n{s}<|eot_id|>"
                                            if s is not None else "")
        + f"<|start_header_id|>user<|end_header_id|>\n\n{u}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}"
        "<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant"
        "<|end_header_id|>\n\n{{ .Response }}<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "gemma": (
        lambda s, u: "<bos><start_of_turn>user\n" + (f"{s}\n\n" if s is not None else "")
        + f"{u}<end_of_turn>\n<start_of_turn>model\n",
        "<start_of_turn>user\n{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}<end_of_turn>\n"
        "<start_of_turn>model\n{{ .Response }}<end_of_turn>\n",
        ["<end_of_turn>"]),
}


def _render(template: str, system: Optional[str]) -> Optional[str]:
    from transformers.utils.chat_template_utils import render_jinja_template
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": USER}]
    try:
        out = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True)
        return out[0][0]
    except Exception:   # a template that needs other variables or raises: not one of the known formats
        return None


def recognise(template: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(format name, default system prompt the template inserts) or (None, None)."""
    if not isinstance(template, str):
        return None, None
    with_system, alone = _render(template, SYS), _render(template, None)
    if with_system is None or alone is None:
        return None, None
    for name, (render, _, _) in FORMATS.items():
        if with_system.removeprefix("<bos>") != render(SYS, USER).removeprefix("<bos>"):
            continue
        if alone.removeprefix("<bos>") == render(None, USER).removeprefix("<bos>"):
            return name, None
        head, _, tail = render(SYS, USER).partition(SYS)   # a default system prompt in the rendering
        if alone.startswith(head) and alone.endswith(tail) and len(alone) > len(head) + len(tail):
            return name, alone[len(head):len(alone) - len(tail)]
    return None, None


def modelfile(gguf_name: str, template: Optional[str], eos: Optional[str], all_files: list[str]) -> str:
    """The Modelfile text, with the commands that serve the file in comments."""
    name, system = recognise(template)
    lines = [f"# Ollama: ollama create MODEL_NAME -f Modelfile && ollama run MODEL_NAME",
             f"# llama.cpp: llama-server -m {gguf_name} -ngl 99 --jinja  (then http://127.0.0.1:8080)",
             f"# other files here: {', '.join(f for f in all_files if f != gguf_name)} (change FROM to use one)"
             if len(all_files) > 1 else "# (one GGUF file)", f"FROM ./{gguf_name}"]
    stops: list[str] = []
    if name is not None:
        _, go, stops = FORMATS[name]
        lines.append(f'TEMPLATE """{go}"""')
        if system is not None:
            lines.append(f'SYSTEM """{system}"""')
    else:
        lines.append("# no TEMPLATE: the chat template is not one edgerl translates; Ollama reads the GGUF's own "
                     "tokenizer.chat_template")
    for s in dict.fromkeys(stops + ([eos] if eos else [])):
        lines.append(f'PARAMETER stop "{s}"')
    return "\n".join(lines) + "\n"
