"""Bad training data, class by class: each is an error naming the file, the row (0-based), the
line where the file has lines, and the field, and saying what to do; nothing is taken silently."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from edgerl.config.schema import DataConfig
from edgerl.data.prompts import DataError, check_data, load_prompts
from edgerl.rewards.rules import default_compute_score, score_batch, RewardItem

from conftest import need_tokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(need_tokenizer()))


def cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **kw)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat_row(messages, truth="4"):
    return {"data_source": "math", "prompt": messages, "reward_model": {"ground_truth": truth}}


def user(text="What is 2 + 2?"):
    return {"role": "user", "content": text}


def error_of(c: DataConfig, tok) -> str:
    """The message of the DataError that both load_prompts and check_data raise for `c`."""
    with pytest.raises(DataError) as e:
        load_prompts(c, tok)
    with pytest.raises(DataError) as e2:
        check_data(c, tok)
    assert str(e.value) == str(e2.value)
    return str(e.value)


# --- 1. chat prompts the model cannot answer, or whose answer it would see ---------------------------

def test_trailing_assistant_turn_is_an_error_not_a_leak(tmp_path, tok):
    answer = {"role": "assistant", "content": "The answer is 4."}
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([chat_row([user()]), chat_row([user(), answer])]), path)
    msg = error_of(cfg(path), tok)
    assert msg.startswith(f"{path}: 1 bad row; fix or remove it: row 1 (0-based): field 'prompt' ")
    assert "ends with an assistant turn (message 1)" in msg
    assert "drop the trailing assistant turn, or point data.prompt_key at a column of user turns" in msg
    assert "\n" not in msg


def test_few_shot_chat_ending_with_the_user_is_fine(tmp_path, tok):
    shots = [{"role": "system", "content": "Be brief."}, user("1 + 1?"), {"role": "assistant", "content": "2"},
             user("2 + 2?")]
    path = write_jsonl(tmp_path / "d.jsonl", [chat_row(shots)])
    (p,), _ = load_prompts(cfg(path), tok)
    assert p.text == tok.apply_chat_template(shots, add_generation_prompt=True, tokenize=False)
    assert p.text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, want", [
    ([{"role": "system", "content": "You add numbers."}], "without a user turn (roles: system)"),
    ([{"role": "assistant", "content": "4"}], "without a user turn (roles: assistant)"),
    ([user(), {"role": "system", "content": "Be brief."}], "ends with a system turn (message 1)"),
    ([{"role": "human", "content": "2 + 2?"}], "has the role 'human'; the roles are system, user, "
                                               "assistant, tool; write 'user' for it"),
    ([{"role": "User", "content": "2 + 2?"}], "write 'user' for it"),
    ([{"role": "narrator", "content": "2 + 2?"}], "has the role 'narrator'; the roles are"),
    ([user("   ")], "message 0 of the chat list is a user turn with empty content"),
])
def test_chat_lists_the_model_cannot_answer(tmp_path, tok, messages, want):
    path = write_jsonl(tmp_path / "d.jsonl", [chat_row([user()]), chat_row(messages)])
    msg = error_of(cfg(path), tok)
    assert f"{path}: 1 bad row; fix or remove it: row 1 (0-based; line 2): field 'prompt' " in msg
    assert want in msg


def test_a_chat_written_as_json_text_is_not_sent_as_text(tmp_path, tok):
    chat = json.dumps([user(), {"role": "assistant", "content": "4"}])
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer\n"What is 3 + 3?",6\n"' + chat.replace('"', '""') + '",4\n')
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert "row 1 (0-based; line 3): field 'prompt' is a string holding a JSON chat list" in msg
    assert "store the list itself" in msg


def test_several_bad_chats_are_counted_and_listed(tmp_path, tok):
    answer = {"role": "assistant", "content": "4"}
    rows = [chat_row([user(), answer]) for _ in range(7)] + [chat_row([user()])]
    msg = error_of(cfg(write_jsonl(tmp_path / "d.jsonl", rows)), tok)
    assert "7 bad row(s); fix or remove them:" in msg and "... and 2 more" in msg
    assert "row 4 (0-based; line 5): field 'prompt' is a chat list that ends with an assistant turn" in msg


# --- 2. columns that a reader keyed by name would take one of, silently -------------------------------

def test_csv_duplicated_header(tmp_path, tok):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer,answer\nWhat is 2 + 2?,5,4\n")
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg == (f"{path}: the header has the column 'answer' 2 times (columns 2, 3, 1-based); rename or "
                   "delete all but one")


def test_csv_unnamed_column(tmp_path, tok):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer,\nWhat is 2 + 2?,4,\n")
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg.startswith(f"{path}: column 3 (1-based) of the header has no name; name it or delete the column")


def test_csv_rows_with_the_wrong_number_of_cells(tmp_path, tok):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\nWhat is 2 + 2?,4\nWhat is 1,000 + 1?,1001\n")
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg == (f"{path}: row 1 (0-based; line 3) has 3 cells but the header has 2 columns; quote cells "
                   "that contain a comma")
    path.write_text("prompt,answer\nWhat is 2 + 2?\n")
    assert "row 0 (0-based; line 2) has 1 cells but the header has 2 columns; add the missing cells" \
        in error_of(cfg(path, answer_key="answer", default_source="math"), tok)


def test_csv_rows_are_named_by_their_first_line(tmp_path, tok):
    """A quoted cell may span lines; the row is named by the line it starts on."""
    path = tmp_path / "d.csv"
    path.write_bytes(b"\xef\xbb\xbf"  # the byte-order mark Excel writes: not part of the first column's name
                     b'prompt,answer\r\n"Two lines:\r\nwhat is 2 + 2?",4\r\n\r\nWhat is 3 + 3?,\r\n')
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert "row 1 (0-based; line 5): field 'answer' is an empty string" in msg


def test_jsonl_rows_with_different_keys(tmp_path, tok):
    rows = [{"prompt": "2 + 2?", "answer": "4"}, {"question": "3 + 3?", "answer": "6"}]
    msg = error_of(cfg(write_jsonl(tmp_path / "d.jsonl", rows), answer_key="answer", default_source="math"), tok)
    assert "row 1 (0-based; line 2): field 'prompt' is missing (the row has question, answer)" in msg


def test_json_key_given_twice(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "2 + 2?", "answer": "4"}',
                                               '{"prompt": "3 + 3?", "answer": "5", "answer": "6"}'])
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg == (f"{path}: line 2 has the key 'answer' twice in one object (a JSON reader keeps only the last "
                   "value); remove one of them")
    nested = tmp_path / "d.json"
    nested.write_text('[\n  {"prompt": "2 + 2?", "reward_model": {"ground_truth": "4"}},\n'
                      '  {"prompt": "3 + 3?",\n   "reward_model": {"ground_truth": "6", "ground_truth": "7"}}\n]\n')
    msg = error_of(cfg(nested, default_source="math"), tok)
    assert msg.startswith(f"{nested}: row 1 (0-based; line 3) has the key 'ground_truth' twice in one object")


def test_json_array_rows_carry_their_lines(tmp_path, tok):
    path = tmp_path / "d.json"
    rows = [{"prompt": f"{i} + {i}?", "answer": str(2 * i)} for i in range(3)]
    rows[2]["answer"] = None
    path.write_text(json.dumps(rows, indent=2))  # each row spans 4 lines; row 2 starts on line 10
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert "row 2 (0-based; line 10): field 'answer' is null" in msg
    path.write_text('[{"prompt": "a", "answer": "1"},]')
    assert "not valid JSON at line 1, column 33" in error_of(cfg(path, answer_key="answer"), tok)
    path.write_text('[{"prompt": "a", "answer": "1"}] {"prompt": "b"}')
    assert "line 1, column 34: more text after the closing ']'" in error_of(cfg(path, answer_key="answer"), tok)
    path.write_text('[{"prompt": "a", "answer": "1"} {"prompt": "b"}]')
    assert "expected ',' or ']' after row 0" in error_of(cfg(path, answer_key="answer"), tok)


def test_line_separators_inside_json_strings_do_not_shift_lines(tmp_path, tok):
    rows = [{"prompt": "one\u2028two", "answer": "1"}, {"prompt": "x", "answer": None}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert "row 1 (0-based; line 2): field 'answer' is null" in msg


def test_parquet_duplicate_columns(tmp_path, tok):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["2 + 2?"]), pa.array(["5"]), pa.array(["4"])],
                                        names=["prompt", "answer", "answer"]), path)
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg == (f"{path}: the parquet schema has the column 'answer' 2 times (columns 2, 3, 1-based); "
                   "rename or delete all but one")


# --- 3. ground truths the row's reward can never give full credit for ----------------------------------

def test_a_decimal_arithmetic_answer_trains(tmp_path, tok):
    """3.5 used to pass the check and stop training at the first reward; the arithmetic reward
    compares numbers, so it is a fair answer and now scores."""
    rows = [{"prompt": "Half of 7?", "answer": 3.5}, {"prompt": "1,000 + 200?", "answer": "1,200"}]
    prompts, _ = load_prompts(cfg(write_jsonl(tmp_path / "d.jsonl", rows), answer_key="answer",
                                  default_source="arithmetic"), tok)
    assert [p.ground_truth for p in prompts] == ["3.5", "1,200"]
    items = [RewardItem(p.data_source, r, p.ground_truth) for p, r in zip(prompts, ["#### 3.5", "so 1200"])]
    scores, _ = score_batch(default_compute_score, items)
    assert scores == [1.0, 1.0]


@pytest.mark.parametrize("source, truth, want", [
    ("arithmetic", "seven", "field 'answer' is 'seven', which the arithmetic reward cannot compare"),
    ("arithmetic", "1/2", "field 'answer' is '1/2', which the arithmetic reward cannot compare: it compares "
                          "numbers; write an integer or a decimal, such as 12 or 3.5"),
    ("gsm8k", "1,000", "field 'answer' is '1,000', which the gsm8k reward can never match: it compares the "
                       "number after '#### ' in a response (commas removed) with it as text; write '1000'"),
    ("openai/gsm8k", "$5", "field 'answer' is '$5', which the gsm8k reward can never match: it compares "
                           "the number after '#### ' in a response (commas removed) with it as text; write "
                           "the number alone, digits only, e.g. '72'"),
    ("gsm8k", "72 apples", "field 'answer' is '72 apples', which the gsm8k reward can never match"
                             "!write '72'"),
    ("gsm8k", "3 + 4 = 7\n#### 7", "field 'answer' holds a whole GSM8K solution ('3 + 4 = 7\\n#### 7'); the "
                                  "gsm8k reward needs the number alone: write the data with `edgerl data "
                                  "prepare gsm8k`"),
])
def test_answers_the_reward_cannot_score(tmp_path, tok, source, truth, want):
    rows = [{"prompt": "q?", "answer": "12"}, {"prompt": "q?", "answer": truth}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    msg = error_of(cfg(path, answer_key="answer", default_source=source), tok)
    first, _, end = want.partition("!")
    assert f"{path}: 1 bad row; fix or remove it: row 1 (0-based; line 2): {first}" in msg
    assert msg.endswith(end)


@pytest.mark.parametrize("source", ["gsm8k", "math", "arithmetic", "edgerl/arithmetic"])
def test_rule_rewards_without_answers_are_an_error(tmp_path, tok, source):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q?"}])
    msg = error_of(cfg(path, answer_key="", default_source=source), tok)
    assert f"row 0 (0-based; line 1): data_source '{source}' is scored against a reference answer" in msg
    assert "set data.answer_key to the answer column" in msg
    prompts, _ = load_prompts(cfg(path, answer_key="", default_source="my/task"), tok)  # own reward: fine
    assert prompts[0].ground_truth is None


# --- 4. bytes that are not UTF-8: the line, not the byte offset ---------------------------------------

@pytest.mark.parametrize("name, head", [
    ("d.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n'),
    ("d.csv", b"prompt,answer\na,1\n"),
    ("d.json", b'[\n{"prompt": "a", "answer": "1"},\n'),
])
def test_not_utf8_names_the_line(tmp_path, tok, name, head):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + head + b"caf\xe9 au lait\n")  # Latin-1 e-acute after a byte-order mark
    line = head.count(b"\n") + 1
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg == (f"cannot read {path}: line {line} is not UTF-8 text (byte 0xe9 at column 4: invalid "
                   "continuation byte); save the file as UTF-8, or fix that line")


def test_not_utf8_in_a_gsm8k_source(tmp_path):
    from edgerl.data.prompts import prepare_gsm8k
    src = tmp_path / "g.jsonl"
    src.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "\xff", "answer": "#### 2"}\n')
    want = f"cannot read {src}: line 2 is not UTF-8 text (byte 0xff at column 15"
    with pytest.raises(DataError, match=re.escape(want)):
        prepare_gsm8k(tmp_path / "o.parquet", source=src)
    assert not (tmp_path / "o.parquet").exists()


# --- 9. module edges -------------------------------------------------------------------------------------

def _edgerl_imports(module: str) -> set[str]:
    """Modules of edgerl (dotted, under edgerl.) that `module` imports anywhere in its file, lazily inside
    functions too."""
    import ast
    import edgerl
    tree = ast.parse((Path(edgerl.__file__).parent / (module.replace(".", "/") + ".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgerl."):
            found.add(node.module[len("edgerl."):])
        elif isinstance(node, ast.Import):
            found.update(a.name[len("edgerl."):] for a in node.names if a.name.startswith("edgerl."))
    return found


def test_data_modules_import_in_one_direction():
    """data.files reads files and knows no task; data.builtin builds on it; data.prompts on both. No cycle,
    and no lazy import inside a function that hides one."""
    assert _edgerl_imports("data.files") == {"core.errors", "core.files"}
    assert _edgerl_imports("core.files") == {"core.errors"}
    assert _edgerl_imports("data.builtin") == {"data.files", "core.errors", "core.files"}
    assert _edgerl_imports("data.sampler") == {"core.errors"}
    assert _edgerl_imports("rewards.rules") == {"core.errors", "rewards.contain"}
    assert "data.prompts" not in (_edgerl_imports("data.builtin") | _edgerl_imports("data.files")
                                  | _edgerl_imports("rewards.rules"))


# --- the smaller siblings: types named as JSON names them, quotes, a lone message -----------------------

def test_json_values_are_named_by_their_json_type(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, "null"])
    assert f"{path}: line 2 is null, not an object" in error_of(cfg(path, answer_key="answer"), tok)
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a", "answer": "1"}, [1, 2]]')
    assert "row 1 (0-based; line 1) of the array is an array, not an object" in \
        error_of(cfg(path, answer_key="answer"), tok)


def test_one_message_instead_of_a_chat_list(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": user(), "answer": "4"}])
    assert "field 'prompt' is one message ({'role': 'user', 'content': 'What is 2 + 2?'}), not a chat list; " \
           "wrap it in a list: [{...}]" in error_of(cfg(path, answer_key="answer", default_source="math"), tok)


def test_non_finite_answer(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": NaN}\n')
    assert "field 'answer' is nan, which no answer can equal; give a finite number or a string" in \
        error_of(cfg(path, answer_key="answer", default_source="math"), tok)


def test_csv_quote_left_open_names_the_row_start(tmp_path, tok):
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer\nWhat is 1 + 1?,2\n"What is 2 + 2?,4\nWhat is 3 + 3?,6\n')
    msg = error_of(cfg(path, answer_key="answer", default_source="math"), tok)
    assert msg.startswith(f"{path}: the row starting on line 3 is not valid CSV (unexpected end of data); "
                          "check its quotes")
