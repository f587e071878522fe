"""Rows for supervised fine-tuning (`edgerl sft`): conversations whose assistant turns are learned.

A row is either a chat, `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}`
(sft.messages_key), or a pair, `{"prompt": ..., "response": ...}` (data.prompt_key, sft.response_key; the
prompt a string or a chat list), which becomes [user: prompt, assistant: response]. Each row is rendered
with the tokenizer's chat template; the loss covers the assistant turns only, each with the tokens that
close it (<|im_end|>, say), so that the model learns to stop. Which tokens are the assistant's is found by
rendering: the conversation up to an assistant turn with the generation prompt, then up to its end; the
characters between are the turn's, and the tokens whose text starts there carry the loss.

Every bad row is an error naming the file, the row and the field; rows over sft.max_len tokens stop the
run with their numbers, or are dropped and counted (data.on_too_long=filter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from edgerl.core.errors import DataError
from edgerl.data.files import RawTable, get_field, is_missing, json_type, read_table

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class SftRow:
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]     # 1 where the token is an assistant token (the model predicts it)


def _messages(raw: dict[str, Any], messages_key: str, prompt_key: str, response_key: str,
              system: Optional[str]) -> list[dict[str, str]]:
    """The row's conversation, or ValueError('field ...: what is wrong')."""
    value = get_field(raw, messages_key)
    if not is_missing(value):
        if not isinstance(value, list) or not value:
            raise ValueError(f"field {messages_key!r} is {json_type(value)}; expected a non-empty list of "
                             "{'role': ..., 'content': ...} messages")
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise ValueError(f"field {messages_key!r}[{j}] is {str(m)[:80]!r}; each message needs a role "
                                 f"({', '.join(ROLES)}) and a string content")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in value):
            raise ValueError(f"field {messages_key!r} has no assistant message with content: nothing to learn")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    prompt, response = get_field(raw, prompt_key), get_field(raw, response_key)
    if is_missing(prompt) or is_missing(response):
        have = ", ".join(map(repr, list(raw)[:8]))
        raise ValueError(f"has neither field {messages_key!r} (a chat) nor both {prompt_key!r} and {response_key!r} "
                         f"(a prompt and its response); its fields: {have}")
    if not isinstance(response, str) or not response.strip():
        raise ValueError(f"field {response_key!r} is {json_type(response)}; expected the response text")
    if isinstance(prompt, str) and prompt.strip():
        chat = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and m.get("role") in ROLES
                                                     and isinstance(m.get("content"), str) for m in prompt):
        chat = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(f"field {prompt_key!r} is {json_type(prompt)}; expected a string or a chat list")
    if system and chat[0]["role"] != "system":
        chat = [{"role": "system", "content": system}] + chat
    return chat + [{"role": "assistant", "content": response}]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def tokenize_row(tokenizer: Any, messages: list[dict[str, str]]) -> SftRow:
    """The row's tokens and its loss mask, or ValueError when the chat template cannot show the assistant turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("cannot be rendered: the tokenizer has no chat template (set model.tokenizer to one "
                         "that has)")
    text = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[:i + 1], False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError(f"message {i}: the chat template renders earlier turns differently once later ones "
                             "follow (Qwen3's drops the reasoning of earlier answers); give one assistant turn per "
                             "row")
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return SftRow(tuple(enc["input_ids"]), tuple(mask))


def load_sft_rows(path: str, split: str, messages_key: str, prompt_key: str, response_key: str,
                  system: Optional[str], tokenizer: Any, max_len: int, on_too_long: str,
                  log: Optional[Callable[[str], None]] = print) -> list[SftRow]:
    """The file's rows, rendered and checked; DataError naming the file, row and field for a bad one. `log`
    (None: silent) hears what was dropped and what is learned."""
    log = log or (lambda s: None)
    table: RawTable = read_table(path, split)
    if not table.rows:
        raise DataError(f"{table.source} has no rows")
    rows, too_long = [], []
    for i, raw in enumerate(table.rows):
        try:
            if not isinstance(raw, dict):
                raise ValueError(f"is {json_type(raw)}, not an object with fields")
            row = tokenize_row(tokenizer, _messages(raw, messages_key, prompt_key, response_key, system))
        except ValueError as e:
            raise DataError(f"{table.source}: {table.where(i)} {e}") from None
        if len(row.input_ids) > max_len:
            too_long.append(i)
            continue
        if sum(row.loss_mask[1:]) == 0:
            raise DataError(f"{table.source}: {table.where(i)} has no assistant token after its first token")
        rows.append(row)
    if too_long and on_too_long == "error":
        raise DataError(f"{table.source}: {len(too_long)} row(s) are longer than sft.max_len={max_len} tokens (rows "
                        f"{', '.join(map(str, too_long[:8]))}{', ...' if len(too_long) > 8 else ''}); raise "
                        "sft.max_len, or drop them with data.on_too_long=filter")
    if too_long:
        log(f"{len(too_long)} of {len(table.rows)} rows dropped: longer than sft.max_len={max_len} tokens "
            "(data.on_too_long=filter)")
    if not rows:
        raise DataError(f"{table.source}: no row is left to train on")
    loss = sum(sum(r.loss_mask) for r in rows)
    log(f"sft data: {len(rows)} rows from {table.source}, {sum(len(r.input_ids) for r in rows)} tokens, {loss} of "
        "them assistant tokens (the loss)")
    return rows
