"""The chat template's side of tools: which tool-call format a template uses, the calls in a model's turn,
and the tokens that follow the turn (tool results or an environment's observation, then the header of the
model's next turn), rendered by the template itself.

Formats (what the model writes; the template renders the tools' schemas and the results):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as it likes: Qwen2.5 and
  Qwen3 (their chat templates on the Hugging Face Hub; the format is NousResearch's Hermes function calling);
- "llama3": the whole turn is one JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`: Llama 3.1 to 3.3 (Meta's model card, "JSON based tool calling").
A template that never reads `tools` has no tool support: the run is refused before it starts.

What follows a turn is the template's own rendering: a short conversation ending in an assistant message
whose content is a marker, with the new messages after it and the generation prompt, rendered as text;
the text after the assistant message's end-of-turn token is the continuation. The episode's tokens are
then prompt + the model's tokens + these, never a re-rendering of the whole conversation (which some
templates change, e.g. Qwen3 drops the reasoning of earlier turns).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from edgerl.core.errors import ToolError

FORMATS = ("hermes", "llama3")
_MARK = "EDGERL_TURN_MARK_7f3a"
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def template_text(tokenizer: Any) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):   # several named templates: the default one renders the conversation
        tpl = tpl.get("default") or next(iter(tpl.values()), None)
    return tpl or ""


def tool_format(tokenizer: Any, model: str) -> str:
    """The template's tool-call format, or a ToolError (one line) when the model cannot take tools."""
    tpl = template_text(tokenizer)
    if not tpl:
        raise ToolError(f"rollout.tools: the tokenizer of {model} has no chat template, so it cannot be given "
                        "tools; use a model whose chat template renders tools, such as Qwen2.5, Qwen3 or Llama 3.1+")
    if not re.search(r"\btools\b", tpl):
        raise ToolError(f"rollout.tools: the chat template of {model} has no tool support (it never reads `tools`); "
                        "use a model whose chat template renders tools, such as Qwen2.5, Qwen3 or Llama 3.1+")
    if "<tool_call>" in tpl:
        return "hermes"
    if "<|python_tag|>" in tpl or "ipython" in tpl:
        return "llama3"
    raise ToolError(f"rollout.tools: the chat template of {model} renders tools in a format edgerl does not read; "
                    "it reads Qwen/Hermes <tool_call> JSON and Llama 3.1+ JSON calls (docs/agents.md)")


@dataclass
class ToolCall:
    """One call the model wrote: its tool and arguments, or `error` (what the model reads back) when the
    call cannot be read."""
    name: str
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None


def _one(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("?", error=f"a tool call must be a JSON object with a \"name\" and \"{args_key}\"")
    args = obj.get(args_key, obj.get("arguments" if args_key == "parameters" else "parameters", {}))
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"the \"{args_key}\" of a tool call must be a JSON object")
    return ToolCall(obj["name"], args)


def _json(text: str) -> tuple[Any, Optional[str]]:
    try:
        return json.loads(text), None
    except ValueError as e:
        return None, f"the tool call is not valid JSON ({e})"


def parse_calls(text: str, fmt: str) -> list[ToolCall]:
    """The tool calls in a model's turn (its text without the end-of-turn token); [] when it calls none."""
    if fmt == "hermes":
        out = []
        for body in _HERMES.findall(text):
            obj, err = _json(body.strip())
            out.append(ToolCall("?", error=err) if err else _one(obj, "arguments"))
        return out
    if fmt == "llama3":
        s = text.strip()
        if s.startswith("<|python_tag|>"):
            s = s[len("<|python_tag|>"):].strip()
        if not s.startswith("{"):
            return []
        obj, err = _json(s)
        if err is not None:   # several calls separated by ';' (Llama 3.2's examples)
            parts = [p.strip() for p in s.split(";") if p.strip()]
            objs = [_json(p) for p in parts]
            if len(parts) > 1 and all(e is None for _, e in objs):
                return [_one(o, "parameters") for o, _ in objs]
            return [ToolCall("?", error=err)]
        return [_one(obj, "parameters")]
    raise ValueError(f"unknown tool-call format {fmt!r}; one of {FORMATS}")


class Continuations:
    """Tokens that follow a model's turn: `tokens(messages)` for messages (role 'tool' or 'user') after an
    assistant turn, ending with the header of the model's next turn. `end_text` is the template's end of an
    assistant turn (the tokenizer's EOS for ChatML and Llama 3)."""

    def __init__(self, tokenizer: Any, template_kwargs: Optional[dict] = None) -> None:
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.end_text = tokenizer.eos_token or ""
        if not self.end_text:
            raise ToolError("the tokenizer has no EOS token to end the model's turn; multi-turn episodes need one")

    def text(self, messages: list[dict]) -> str:
        """The continuation as text."""
        tail = self._render(messages, with_call=False)
        if tail is None:   # templates that render a tool result only after an assistant message with calls
            tail = self._render(messages, with_call=True)
        if tail is None:
            raise ToolError("the chat template does not render an assistant turn followed by "
                            f"{', '.join(m['role'] for m in messages)} messages in a way edgerl can continue from "
                            f"(no {self.end_text!r} after the assistant's content)")
        return tail

    def _render(self, messages: list[dict], with_call: bool) -> Optional[str]:
        assistant: dict = {"role": "assistant", "content": _MARK}
        if with_call:
            name = next((m.get("name") for m in messages if m.get("name")), "tool")
            assistant["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": {}}}]
        conv = [{"role": "user", "content": "?"}, assistant] + messages
        try:
            full = self.tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **self.kwargs)
        except Exception:
            return None
        i = full.find(_MARK)
        j = full.find(self.end_text, i + len(_MARK)) if i >= 0 else -1
        return full[j + len(self.end_text):] if j >= 0 else None

    def tokens(self, messages: list[dict]) -> list[int]:
        return list(self.tok(self.text(messages), add_special_tokens=False)["input_ids"])


def tool_messages(calls: list[ToolCall], results: list[str]) -> list[dict]:
    """The tool messages of a turn's calls, in order (role 'tool', the tool's name, the result)."""
    return [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results)]
