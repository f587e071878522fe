"""Training prompts: load, validate, apply the chat template, tokenize; sample them resumably.

    prompts, report = load_prompts(cfg.data, tokenizer)      # all validation happens here
    sampler = PromptSampler(len(prompts), cfg.train.prompts_per_step, cfg.train.seed, cfg.data.shuffle,
                            log=log)                  # says when a step must repeat prompts
    batch = [prompts[i] for i in sampler.next_batch()]

Sources: .parquet / .jsonl / .json / .csv files, HF datasets by name, 'builtin:arithmetic'.
verl's parquet files are read as they are: `prompt` as a chat list, `reward_model.ground_truth`,
`data_source`, `extra_info`. Every problem is found before training starts and reported with the
file, the 0-based row and the field; rows over the length limit are an error or are dropped and
counted (`data.on_too_long`), never dropped silently.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from edgerl.config.schema import DataConfig
from edgerl.data.files import ANSWER_NAMES, RawTable, check_column, get_field, is_missing, json_type, read_table
from edgerl.core.errors import DataError
from edgerl.rewards.rules import ground_truth_problem
from edgerl.data.sampler import PromptSampler  # noqa: F401  (part of the data API)
from edgerl.data.builtin import BUILTIN_PREFIX, prepare_gsm8k, read_builtin  # prepare_gsm8k: part of the data API

__all__ = ["DataError", "Prompt", "DataReport", "DataSummary", "load_prompts", "check_data",
           "PromptSampler", "prepare_gsm8k"]

Chat = list[dict[str, str]]
_MAX_LISTED = 5  # rows named in one error message
ROLES = ("system", "user", "assistant", "tool")
# role names of other chat formats (ShareGPT, Gemma), offered as the fix
_ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}


@dataclass(frozen=True)
class Prompt:
    """One training prompt. `text` is what was tokenized (chat template applied where it applies);
    `input_ids` its tokens; `row` the 0-based row in the source; `ground_truth` None when the data
    has no answers (data.answer_key = ''); `extra` the row's extra_info (verl) or {};
    `raw_prompt` the prompt as the data holds it (a string or a chat list), e.g. for a reward model."""
    row: int
    text: str
    input_ids: tuple[int, ...]
    ground_truth: Optional[str]
    data_source: str
    extra: dict = field(default_factory=dict, hash=False)
    raw_prompt: Union[str, Chat, None] = field(default=None, hash=False)  # as in the data, untemplated
    messages: Optional[Chat] = field(default=None, hash=False)  # what the chat template rendered (None: no template)


@dataclass(frozen=True)
class DataReport:
    source: str
    rows_read: int
    rows_kept: int
    filtered: dict[str, int]  # reason -> rows dropped

    def lines(self) -> list[str]:
        out = [f"data: {self.source}: {self.rows_read} rows read, {self.rows_kept} kept"]
        out += [f"data: dropped {n} rows: {why}" for why, n in self.filtered.items()]
        return out


@dataclass(frozen=True)
class DataSummary:
    """What `check_data` found: everything `edgerl data check` prints."""
    source: str
    rows: int
    columns: list[str]
    prompt_key: str
    answer_key: str
    data_source_key: str
    prompt_format: str                 # e.g. "chat list (chat template)" / "text (chat template)"
    sources: dict[str, int]            # data_source -> rows
    length_percentiles: dict[str, int]  # p50, p90, p99, max (tokens)
    max_prompt_len: int
    rows_over_limit: int
    first_rows_over_limit: list[int]
    on_too_long: str


@dataclass
class _Row:
    row: int
    messages: Optional[Chat]  # None for plain text
    text: str                 # the plain prompt (when messages is None)
    ground_truth: Optional[str]
    data_source: str
    extra: dict


# --- validation ---------------------------------------------------------------------------------

def _check_prompt(value: Any) -> Union[str, Chat]:
    """The prompt value, or a ValueError saying what is wrong with it."""
    if value is None:
        raise ValueError("is null")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is an empty string")
        if _holds_json_chat(value):
            raise ValueError("is a string holding a JSON chat list; it would reach the model as that text, "
                             "not as a conversation: store the list itself (JSONL, JSON or parquet; CSV "
                             "cannot hold lists)")
        return value
    if isinstance(value, list):
        return _check_chat(value)
    if isinstance(value, dict) and "role" in value:
        raise ValueError(f"is one message ({_short(value)}), not a chat list; wrap it in a list: [{{...}}]")
    raise ValueError(f"is {json_type(value)} ({_short(value)}); expected a string or a chat list "
                     "[{'role': 'user', 'content': ...}]")


def _check_chat(value: list) -> Chat:
    """A chat list the model can answer: known roles, a user turn, and a last turn the model replies
    to. The chat template renders every message into the prompt, so a trailing assistant turn
    (often the reference answer) would hand the model the answer."""
    if not value:
        raise ValueError("is an empty chat list")
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise ValueError(f"message {j} of the chat list is {_short(msg)}; each message must be "
                             "{'role': str, 'content': str}")
    roles = [m["role"] for m in value]
    for j, role in enumerate(roles):
        if role not in ROLES:
            guess = role.lower() if role.lower() in ROLES else _ROLE_HINTS.get(role.lower())
            hint = f"; write '{guess}' for it" if guess else ""
            raise ValueError(f"message {j} of the chat list has the role {role!r}; the roles are "
                             f"{', '.join(ROLES)}{hint}")
    if "user" not in roles:
        raise ValueError(f"is a chat list without a user turn (roles: {', '.join(roles)}); add the user's "
                         "message the model should answer")
    if roles[-1] == "assistant":
        raise ValueError(f"is a chat list that ends with an assistant turn (message {len(roles) - 1}), which "
                         "would put the answer in the model's input; drop the trailing assistant turn, or "
                         "point data.prompt_key at a column of user turns")
    if roles[-1] == "system":
        raise ValueError(f"is a chat list that ends with a system turn (message {len(roles) - 1}); end it "
                         "with the user turn the model should answer")
    for j, m in enumerate(value):
        if m["role"] == "user" and not m["content"].strip():
            raise ValueError(f"message {j} of the chat list is a user turn with empty content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _holds_json_chat(text: str) -> bool:
    s = text.strip()
    if not (s.startswith("[") and s.endswith("]") and '"role"' in s):
        return False
    try:
        value = json.loads(s)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _check_answer(value: Any) -> str:
    if value is None:
        raise ValueError("is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"is {json_type(value)} ({_short(value)}); expected a string or a number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"is {value}, which no answer can equal; give a finite number or a string")
        return str(int(value)) if value.is_integer() else repr(value)
    s = str(value)
    if not s.strip():
        raise ValueError("is an empty string")
    return s


def _short(value: Any, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[:n] + "..."


def _rows(table: RawTable, cfg: DataConfig) -> list[_Row]:
    """Validate every row of `table` against the column settings; raise one DataError listing the
    first problems and their count."""
    check_column(table, cfg.prompt_key, "data.prompt_key", ("prompt", "question", "problem", "query"))
    if cfg.answer_key:
        check_column(table, cfg.answer_key, "data.answer_key", ANSWER_NAMES)
    has_source = cfg.data_source_key in table.columns
    if not has_source and cfg.default_source is None:
        raise DataError(f"{table.name}: no '{cfg.data_source_key}' column (data.data_source_key) to pick "
                        "each row's reward; set data.default_source to gsm8k, math or arithmetic (or the "
                        "name your --reward function expects), or add the column")
    out, problems = [], []
    for i, raw in enumerate(table.rows):
        try:
            prompt = _field(raw, cfg.prompt_key, _check_prompt)
            answer = _field(raw, cfg.answer_key, _check_answer) if cfg.answer_key else None
            source = raw.get(cfg.data_source_key) if has_source else None
            if source is None:
                if cfg.default_source is None:
                    raise ValueError(f"field '{cfg.data_source_key}' is null and data.default_source is "
                                     "not set")
                source = cfg.default_source
            elif not isinstance(source, str) or not source:
                raise ValueError(f"field '{cfg.data_source_key}' is {_short(source)}; expected a "
                                 "non-empty string naming the reward")
            problem = ground_truth_problem(source, answer)
            if problem is not None:
                raise ValueError(problem if answer is None else f"field '{cfg.answer_key}' {problem}")
            extra = raw.get("extra_info")
            extra = dict(extra) if isinstance(extra, dict) else {}
            messages = prompt if isinstance(prompt, list) else None
            text = prompt if isinstance(prompt, str) else ""
            out.append(_Row(i, messages, text, answer, source, extra))
        except ValueError as e:
            problems.append(f"{table.where(i)}: {e}")
    if len(problems) == 1:
        raise DataError(f"{table.name}: 1 bad row; fix or remove it: {problems[0]}")  # one line
    if problems:
        shown = "\n  ".join(problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise DataError(f"{table.name}: {len(problems)} bad row(s); fix or remove them:\n  {shown}{more}")
    return out


def _field(raw: dict, key: str, check: Callable[[Any], Any]) -> Any:
    value = get_field(raw, key)
    if is_missing(value):
        top = key.split(".")[0]
        inner = raw.get(top)
        if isinstance(inner, dict):
            keys = f" (it has {', '.join(map(str, inner))})"
        elif top in raw:
            keys = f" ('{top}' is {_short(inner)}, not an object)"
        else:  # rows of JSON lines need not share their keys: show what this one has
            keys = f" (the row has {', '.join(map(str, raw)) or 'no fields'})"
        raise ValueError(f"field '{key}' is missing{keys}")
    try:
        return check(value)
    except ValueError as e:
        raise ValueError(f"field '{key}' {e}") from None


# --- chat template and tokens ---------------------------------------------------------------------

def _render(rows: list[_Row], cfg: DataConfig, tokenizer: Any, name: str, tools: Optional[list[dict]] = None
            ) -> tuple[list[str], list[bool], str, list[Optional[Chat]]]:
    """(texts, add_special_tokens per text, a description of the format, the messages each text rendered).
    `tools`: the JSON schemas of the run's tools, rendered by the template (rollout.tools)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat_template == "always" and not has_template:
        raise DataError("data.chat_template='always' but the tokenizer has no chat template; use a "
                        "tokenizer with one (model.tokenizer) or set data.chat_template=auto")
    plain_templated = has_template and cfg.chat_template != "never"
    if cfg.system_prompt is not None and not plain_templated and any(r.messages is None for r in rows):
        raise DataError("data.system_prompt is set but plain-text prompts get no chat template "
                        f"(data.chat_template={cfg.chat_template!r}, tokenizer "
                        f"{'has' if has_template else 'has no'} template); unset data.system_prompt "
                        "or use a tokenizer with a chat template")
    texts, special, rendered = [], [], []
    n_chat = 0
    for r in rows:
        if r.messages is None and not plain_templated:
            texts.append(r.text)
            special.append(True)  # no template: the tokenizer adds BOS itself if the model wants one
            rendered.append(None)
            continue
        if not has_template:
            raise DataError(f"{name}: row {r.row} (0-based) is a chat list, which needs a chat template, "
                            "but the tokenizer has none; set model.tokenizer to a tokenizer with a chat "
                            "template, or give plain-text prompts")
        messages = r.messages if r.messages is not None else [{"role": "user", "content": r.text}]
        n_chat += r.messages is not None
        if cfg.system_prompt is not None:
            if messages[0]["role"] == "system":
                raise DataError(f"{name}: row {r.row} (0-based) already starts with a system message and "
                                "data.system_prompt is set too; unset one of them")
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        rendered.append(messages)
        try:
            texts.append(render_chat(tokenizer, messages, tools))
        except Exception as e:
            raise DataError(f"{name}: the chat template failed on row {r.row} (0-based): "
                            f"{type(e).__name__}: {e}") from None
        # the rendered template already holds BOS where the model wants it (Llama, Gemma...);
        # add_special_tokens=True would add a second one
        special.append(False)
    kinds = []
    if n_chat:
        kinds.append(f"{n_chat} chat list(s), chat template")
    if len(rows) - n_chat:
        kinds.append(f"{len(rows) - n_chat} text prompt(s), "
                     f"{'chat template' if plain_templated else 'as is (no chat template)'}")
    return texts, special, "; ".join(kinds), rendered


def render_chat(tokenizer: Any, messages: Chat, tools: Optional[list[dict]] = None) -> str:
    """The chat template's text for `messages` and the model's turn to come (with the tools' schemas)."""
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)


def with_observation(prompt: Prompt, observation: str, tokenizer: Any, tools: Optional[list[dict]] = None
                     ) -> list[int]:
    """The prompt's tokens with `observation` (an environment's first one) added to its last user message."""
    if prompt.messages is None:
        raise DataError(f"prompt row {prompt.row}: an environment's first observation joins the prompt's last "
                        "user message, which needs a chat template; use a tokenizer with one")
    messages = [dict(m) for m in prompt.messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] += "\n\n" + observation
    return list(tokenizer(render_chat(tokenizer, messages, tools), add_special_tokens=False)["input_ids"])


def _tokenize(texts: list[str], special: list[bool], tokenizer: Any) -> list[list[int]]:
    ids: list[list[int]] = [[] for _ in texts]
    for flag in (True, False):
        idx = [i for i, s in enumerate(special) if s == flag]
        for start in range(0, len(idx), 1024):
            chunk = idx[start:start + 1024]
            enc = tokenizer([texts[i] for i in chunk], add_special_tokens=flag)["input_ids"]
            for i, seq in zip(chunk, enc):
                ids[i] = list(seq)
    return ids


def _prepare(cfg: DataConfig, tokenizer: Any, seed: int, tools: Optional[list[dict]] = None):
    if cfg.path.startswith(BUILTIN_PREFIX):
        table = read_builtin(cfg.path, cfg.difficulty, cfg.num_examples, seed)
    else:
        table = read_table(cfg.path, cfg.split)
    rows = _rows(table, cfg)
    texts, special, fmt, rendered = _render(rows, cfg, tokenizer, table.name, tools)
    ids = _tokenize(texts, special, tokenizer)
    return table, rows, texts, ids, fmt, rendered


def load_prompts(cfg: DataConfig, tokenizer: Any, seed: int = 0, log: Optional[Callable[[str], None]] = print,
                 tools: Optional[list[dict]] = None) -> tuple[list[Prompt], DataReport]:
    """Read, validate and tokenize the prompts of `cfg`; raise DataError on any bad row.

    `seed` only seeds the generated 'builtin:arithmetic' problems (keep it fixed across training
    seeds to train on the same problems). Rows over `cfg.max_prompt_len` tokens raise DataError
    (on_too_long='error') or are dropped, counted in the report and passed to `log`. `tools`: the JSON
    schemas the chat template renders with every prompt (rollout.tools).
    """
    table, rows, texts, ids, _, rendered = _prepare(cfg, tokenizer, seed, tools)
    over = [r.row for r, seq in zip(rows, ids) if len(seq) > cfg.max_prompt_len]
    filtered: dict[str, int] = {}
    if over:
        longest = max(len(seq) for seq in ids)
        listed = ", ".join(map(str, over[:_MAX_LISTED])) + (", ..." if len(over) > _MAX_LISTED else "")
        if cfg.on_too_long == "error":
            raise DataError(f"{table.name}: {len(over)} prompt(s) longer than data.max_prompt_len="
                            f"{cfg.max_prompt_len} tokens (rows {listed}, 0-based; longest {longest} "
                            "tokens); raise data.max_prompt_len or set data.on_too_long=filter to drop them")
        filtered[f"longer than data.max_prompt_len={cfg.max_prompt_len} tokens (rows {listed}, 0-based)"] = len(over)
    prompts = [Prompt(r.row, text, tuple(seq), r.ground_truth, r.data_source, r.extra,
                      r.messages if r.messages is not None else r.text, msgs)
               for r, text, seq, msgs in zip(rows, texts, ids, rendered) if len(seq) <= cfg.max_prompt_len]
    if not prompts:
        raise DataError(f"{table.name}: all {len(rows)} prompts are longer than data.max_prompt_len="
                        f"{cfg.max_prompt_len} tokens; nothing is left to train on")
    report = DataReport(table.source, len(table.rows), len(prompts), filtered)
    if log is not None and filtered:
        for line in report.lines()[1:]:
            log(line)
    return prompts, report


def _percentile(sorted_values: list[int], p: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    k = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[k - 1]


def check_data(cfg: DataConfig, tokenizer: Any, seed: int = 0) -> DataSummary:
    """Run all of `load_prompts`' validation and summarise the data; prompts over the length limit
    are counted here (not an error), so the summary shows what training would do with them."""
    table, rows, _, ids, fmt, _ = _prepare(cfg, tokenizer, seed)
    lengths = sorted(len(seq) for seq in ids)
    over = [r.row for r, seq in zip(rows, ids) if len(seq) > cfg.max_prompt_len]
    sources = Counter(r.data_source for r in rows)
    return DataSummary(
        source=table.source, rows=len(rows), columns=list(table.columns), prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key or "(none)", data_source_key=(
            cfg.data_source_key if cfg.data_source_key in table.columns
            else f"(none: default_source={cfg.default_source})"),
        prompt_format=fmt, sources=dict(sources.most_common()),
        length_percentiles={"p50": _percentile(lengths, 50), "p90": _percentile(lengths, 90),
                            "p99": _percentile(lengths, 99), "max": lengths[-1]},
        max_prompt_len=cfg.max_prompt_len, rows_over_limit=len(over), first_rows_over_limit=over[:_MAX_LISTED],
        on_too_long=cfg.on_too_long)
