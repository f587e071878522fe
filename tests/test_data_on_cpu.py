"""Data loading, validation, chat templates, the built-in task, GSM8K preparation and the sampler."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from edgerl.config.schema import DataConfig
from edgerl.data.prompts import DataError, check_data, load_prompts, prepare_gsm8k
from edgerl.data.builtin import GSM8K_INSTRUCTION, generate_arithmetic

from conftest import GSM8K, need_tokenizer  # noqa: E402
GSM8K_TRAIN = GSM8K / "train.jsonl"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(need_tokenizer()))


@pytest.fixture
def tok_no_template(tok):
    import copy
    t = copy.deepcopy(tok)
    t.chat_template = None
    return t


def cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **kw)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def verl_rows(n=3):
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? {GSM8K_INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}", "question": f"{i}+{i}"}}
            for i in range(n)]


def simple_rows(n=4):
    return [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(n)]


# --- verl format ----------------------------------------------------------------------------------

def test_verl_parquet_read_as_is(tmp_path, tok):
    path = tmp_path / "train.parquet"
    table = pa.Table.from_pylist(verl_rows(3))
    assert pa.types.is_struct(table.schema.field("reward_model").type)  # nested, as verl writes it
    assert pa.types.is_list(table.schema.field("prompt").type)
    pq.write_table(table, path)
    prompts, report = load_prompts(cfg(path), tok)
    assert [p.ground_truth for p in prompts] == ["0", "2", "4"]
    assert {p.data_source for p in prompts} == {"openai/gsm8k"}
    assert prompts[1].extra == {"split": "train", "index": 1, "answer": "#### 2", "question": "1+1"}
    assert [p.row for p in prompts] == [0, 1, 2]
    assert prompts[2].raw_prompt == verl_rows(3)[2]["prompt"]
    msgs = verl_rows(3)[2]["prompt"]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompts[2].text == want and want.endswith("<|im_start|>assistant\n")
    assert list(prompts[2].input_ids) == tok(want, add_special_tokens=False)["input_ids"]
    assert list(prompts[2].input_ids) == list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert report.rows_read == report.rows_kept == 3 and report.filtered == {}


def test_plain_text_gets_template_and_system_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", simple_rows(2))
    c = cfg(path, answer_key="answer", default_source="gsm8k", system_prompt="Be brief.")
    prompts, _ = load_prompts(c, tok)
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 1 plus 1?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert prompts[1].text == want and "Be brief." in want and "SmolLM" not in want
    assert prompts[1].data_source == "gsm8k" and prompts[1].ground_truth == "2"
    assert prompts[1].raw_prompt == "What is 1 plus 1?"


def test_chat_template_never_and_always(tmp_path, tok, tok_no_template):
    path = write_jsonl(tmp_path / "d.jsonl", simple_rows(2))
    prompts, _ = load_prompts(cfg(path, answer_key="answer", default_source="gsm8k",
                                  chat_template="never"), tok)
    assert prompts[0].text == "What is 0 plus 0?"
    assert list(prompts[0].input_ids) == tok("What is 0 plus 0?")["input_ids"]
    with pytest.raises(DataError, match="chat_template='always' but the tokenizer has no chat template"):
        load_prompts(cfg(path, answer_key="answer", default_source="gsm8k", chat_template="always"),
                     tok_no_template)
    # auto without a template: text as is
    prompts, _ = load_prompts(cfg(path, answer_key="answer", default_source="gsm8k"), tok_no_template)
    assert prompts[1].text == "What is 1 plus 1?"
    with pytest.raises(DataError, match="system_prompt"):
        load_prompts(cfg(path, answer_key="answer", default_source="gsm8k", system_prompt="x"),
                     tok_no_template)


def test_chat_list_without_template_is_an_error(tmp_path, tok_no_template):
    path = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(2)), path)
    with pytest.raises(DataError, match=r"row 0 \(0-based\) is a chat list.*tokenizer with a chat template"):
        load_prompts(cfg(path), tok_no_template)


def test_bos_is_not_added_twice():
    """A tokenizer whose post-processor adds BOS and whose template writes it too: one BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "user", ":"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    t.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    assert t("hello")["input_ids"] == [1, 3]  # the tokenizer does add BOS by itself
    rows = [{"prompt": "hello world", "answer": "1"}]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = write_jsonl(Path(d) / "x.jsonl", rows)
        (p,), _ = load_prompts(cfg(path, answer_key="answer", default_source="gsm8k"), t)
        assert p.input_ids == (1, 5, 6, 3, 4)
        (p,), _ = load_prompts(cfg(path, answer_key="answer", default_source="gsm8k", chat_template="never"), t)
        assert p.input_ids == (1, 3, 4)


def test_csv_and_json_array_and_nested_key(tmp_path, tok):
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("question,solution\n\"What is 2, plus 2?\",4\nWhat is 3 plus 3?,6\n")
    prompts, _ = load_prompts(cfg(csv_path, prompt_key="question", answer_key="solution",
                                  default_source="math"), tok)
    assert [p.ground_truth for p in prompts] == ["4", "6"] and "2, plus 2" in prompts[0].text
    js = tmp_path / "d.json"
    js.write_text(json.dumps([{"q": "hi", "meta": {"gt": 5}, "data_source": "math"},
                              {"q": "yo", "meta": {"gt": 2.0}, "data_source": "math"}]))
    prompts, _ = load_prompts(cfg(js, prompt_key="q", answer_key="meta.gt"), tok)
    assert [p.ground_truth for p in prompts] == ["5", "2"]
    lines_json = tmp_path / "lines.json"  # JSON lines under a .json name, as HF writes them
    lines_json.write_text('{"q": "a", "meta": {"gt": 1}, "data_source": "math"}\n'
                          '{"q": "b", "meta": {"gt": 3}, "data_source": "math"}\n')
    prompts, _ = load_prompts(cfg(lines_json, prompt_key="q", answer_key="meta.gt"), tok)
    assert [p.ground_truth for p in prompts] == ["1", "3"]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [{"q": "a"}]}, indent=2))
    with pytest.raises(DataError, match=r"holds one JSON object \(data\), not rows"):
        load_prompts(cfg(wrapped, prompt_key="q"), tok)


def test_hf_loader_on_a_local_dataset_folder(tmp_path, tok):
    folder = tmp_path / "myset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", simple_rows(3))
    prompts, report = load_prompts(cfg(folder, answer_key="answer", default_source="gsm8k"), tok)
    assert len(prompts) == 3 and report.source.startswith("HF dataset")


def test_unknown_name_names_both_possibilities(tmp_path, tok, monkeypatch):
    import datasets
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        load_prompts(cfg("nobody-xyz/no-such-dataset"), tok)
    msg = str(e.value)
    assert "neither an existing file" in msg and "datasets.load_dataset" in msg and "HF_DATASETS_OFFLINE" in msg
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(cfg(tmp_path / "missing.parquet"), tok)


# --- bad data -------------------------------------------------------------------------------------

def test_missing_column_suggests_case_insensitive_match(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"Prompt": "hi", "answer": "1"}])
    with pytest.raises(DataError) as e:
        load_prompts(cfg(path, answer_key="answer", default_source="gsm8k"), tok)
    msg = str(e.value)
    assert str(path) in msg and "no column 'prompt'" in msg
    assert "available columns: Prompt, answer" in msg and "did you mean 'Prompt'" in msg


def test_missing_answer_column_suggests_answer(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", simple_rows(2))
    with pytest.raises(DataError, match=r"no column 'reward_model'.*did you mean 'answer'"):
        load_prompts(cfg(path, default_source="gsm8k"), tok)


def test_no_answer_column_when_answer_key_is_empty(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, {"prompt": "yo"}])
    with pytest.raises(DataError, match="data.answer_key='' if the data has no reference answers"):
        load_prompts(cfg(path, default_source="rm"), tok)
    prompts, _ = load_prompts(cfg(path, answer_key="", default_source="rm"), tok)
    assert [p.ground_truth for p in prompts] == [None, None]
    assert check_data(cfg(path, answer_key="", default_source="rm"), tok).answer_key == "(none)"


def test_raw_gsm8k_answers_are_caught(tmp_path, tok):
    rows = [{"question": "q", "answer": "3 + 4 = 7\n#### 7"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"row 0 .*holds a whole GSM8K solution.*edgerl data prepare gsm8k"):
        load_prompts(cfg(path, prompt_key="question", answer_key="answer", default_source="gsm8k"), tok)


def test_missing_data_source_needs_default(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", simple_rows(2))
    with pytest.raises(DataError, match="data.default_source"):
        load_prompts(cfg(path, answer_key="answer"), tok)


def test_null_in_a_row_names_row_line_and_field(tmp_path, tok):
    rows = simple_rows(4)
    rows[2]["prompt"] = None
    path = write_jsonl(tmp_path / "d.jsonl", rows[:1] + [""] + rows[1:])  # a blank line shifts lines
    with pytest.raises(DataError) as e:
        load_prompts(cfg(path, answer_key="answer", default_source="gsm8k"), tok)
    assert "1 bad row" in str(e.value)
    assert "row 2 (0-based; line 4): field 'prompt' is null" in str(e.value)


def test_wrong_types_name_rows_and_fields(tmp_path, tok):
    rows = verl_rows(6)
    rows[1]["prompt"] = 42
    rows[4]["reward_model"]["ground_truth"] = [1, 2]
    rows[5]["prompt"] = [{"role": "user"}]
    # parquet cannot hold an int and a list in one column; JSON lines keep per-row types
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_prompts(cfg(path), tok)
    msg = str(e.value)
    assert "3 bad row(s)" in msg
    assert "row 1 (0-based; line 2): field 'prompt' is a number (42); expected a string or a chat list" in msg
    assert "row 4 (0-based; line 5): field 'reward_model.ground_truth' is an array ([1, 2])" in msg
    assert "row 5 (0-based; line 6): field 'prompt' message 0 of the chat list" in msg


def test_null_in_parquet_row(tmp_path, tok):
    rows = verl_rows(3)
    rows[2]["reward_model"]["ground_truth"] = None
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"row 2 \(0-based\): field 'reward_model.ground_truth' is null"):
        load_prompts(cfg(path), tok)


def test_missing_nested_key_lists_keys(tmp_path, tok):
    rows = verl_rows(2)
    rows[1]["reward_model"] = {"style": "rule", "truth": "2"}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"row 1 .*'reward_model.ground_truth' is missing \(it has style, truth\)"):
        load_prompts(cfg(path), tok)


def test_empty_files(tmp_path, tok):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"e.jsonl is empty \(0 bytes\)"):
        load_prompts(cfg(empty), tok)
    blank = tmp_path / "b.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(DataError, match="b.jsonl has no rows"):
        load_prompts(cfg(blank), tok)
    pq_empty = tmp_path / "e.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(1)).slice(0, 0), pq_empty)
    with pytest.raises(DataError, match="e.parquet has no rows"):
        load_prompts(cfg(pq_empty), tok)
    csv_header_only = tmp_path / "h.csv"
    csv_header_only.write_text("prompt,answer\n")
    with pytest.raises(DataError, match="h.csv has no rows"):
        load_prompts(cfg(csv_header_only), tok)


def test_unreadable_files(tmp_path, tok, monkeypatch):
    fake = tmp_path / "fake.parquet"
    fake.write_text("this is not parquet")
    with pytest.raises(DataError, match=r"cannot read .*fake.parquet as parquet"):
        load_prompts(cfg(fake), tok)
    utf16 = tmp_path / "bin.jsonl"
    utf16.write_bytes('{"prompt": "hi"}\n'.encode("utf-16"))
    with pytest.raises(DataError, match=r"bin.jsonl: it is UTF-16 text .*save it as UTF-8"):
        load_prompts(cfg(utf16), tok)
    other = tmp_path / "d.txt"
    other.write_text("x")
    with pytest.raises(DataError, match=r"unsupported file type '.txt'"):
        load_prompts(cfg(other), tok)
    good = write_jsonl(tmp_path / "locked.jsonl", simple_rows(1))

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(DataError, match=r"cannot read .*locked.jsonl: permission denied"):
        load_prompts(cfg(good), tok)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads files whatever their permissions; covered by the monkeypatched case")
def test_unreadable_by_permissions(tmp_path, tok):
    path = write_jsonl(tmp_path / "locked.jsonl", simple_rows(1))
    path.chmod(0)
    with pytest.raises(DataError, match="permission denied"):
        load_prompts(cfg(path), tok)


def test_broken_jsonl_line_is_named_one_based(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [simple_rows(1)[0], simple_rows(1)[0], '{"prompt": "x", '])
    with pytest.raises(DataError, match=r"d.jsonl: line 3 is not valid JSON"):
        load_prompts(cfg(path, answer_key="answer", default_source="gsm8k"), tok)


def _long_rows():
    rows = simple_rows(6)
    for i in (1, 4):
        rows[i]["prompt"] = "word " * 300
    return rows


def test_too_long_is_an_error_with_rows_and_count(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", _long_rows())
    with pytest.raises(DataError) as e:
        load_prompts(cfg(path, answer_key="answer", default_source="gsm8k", max_prompt_len=100), tok)
    msg = str(e.value)
    assert "2 prompt(s) longer than data.max_prompt_len=100 tokens (rows 1, 4, 0-based" in msg
    assert "on_too_long=filter" in msg


def test_too_long_filtered_and_counted(tmp_path, tok, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", _long_rows())
    c = cfg(path, answer_key="answer", default_source="gsm8k", max_prompt_len=100, on_too_long="filter")
    prompts, report = load_prompts(c, tok)
    assert [p.row for p in prompts] == [0, 2, 3, 5]
    assert report.rows_read == 6 and report.rows_kept == 4 and list(report.filtered.values()) == [2]
    out = capsys.readouterr().out
    assert "dropped 2 rows: longer than data.max_prompt_len=100 tokens (rows 1, 4, 0-based)" in out
    assert all(len(p.input_ids) <= 100 for p in prompts)


def test_check_data_summary(tmp_path, tok):
    rows = verl_rows(10)
    rows[3]["data_source"] = "lighteval/MATH"
    rows[7]["prompt"][0]["content"] = "long " * 200
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    s = check_data(cfg(path, max_prompt_len=100), tok)
    assert s.rows == 10 and s.sources == {"openai/gsm8k": 9, "lighteval/MATH": 1}
    assert s.columns == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    lengths = sorted(len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"])
                     for r in rows)
    assert s.length_percentiles["max"] == lengths[-1] > 200
    assert s.length_percentiles["p50"] == lengths[4]  # nearest rank: ceil(0.5 * 10) = 5th value
    assert s.length_percentiles["p90"] == lengths[8] and s.length_percentiles["p99"] == lengths[9]
    assert s.rows_over_limit == 1 and s.first_rows_over_limit == [7]


# --- the built-in task ----------------------------------------------------------------------------

def test_builtin_same_seed_same_problems(tok):
    a = generate_arithmetic(50, 2, seed=3)
    assert a == generate_arithmetic(50, 2, seed=3)
    assert a != generate_arithmetic(50, 2, seed=4)
    assert a[:20] == generate_arithmetic(20, 2, seed=3)  # row i does not depend on n
    prompts, report = load_prompts(DataConfig(difficulty=3, num_examples=64), tok, seed=1)
    assert len(prompts) == 64 and prompts[0].data_source == "edgerl/arithmetic"
    assert "difficulty 3, 64 problems, seed 1" in report.source


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_builtin_answers_match_the_numbers_in_the_question(level):
    rows = generate_arithmetic(300, level, seed=0)
    ops_seen, templates = set(), set()
    for r in rows:
        info, gt = r["extra_info"], r["reward_model"]["ground_truth"]
        expr = info["expression"]
        nums_q = [int(x) for x in re.findall(r"\d+", info["question"])]
        nums_e = [int(x) for x in re.findall(r"\d+", expr)]
        assert sorted(nums_q) == sorted(nums_e), (info["question"], expr)
        # slow, obvious evaluation of "a op b [op c]" with * before + and -
        toks = expr.split()
        vals, ops = [int(toks[0])], []
        for op, v in zip(toks[1::2], toks[2::2]):
            if op == "*":
                vals[-1] *= int(v)
            else:
                vals.append(int(v)), ops.append(op)
        total = vals[0]
        for op, v in zip(ops, vals[1:]):
            total = total + v if op == "+" else total - v
        assert gt == str(total) and total >= 1
        ops_seen.add(tuple(t for t in toks if t in "+-*"))
        templates.add(re.sub(r"\d+", "N", info["question"].split(".")[0])[:12])
        assert r["prompt"][0]["content"].startswith(info["question"])
        assert r["prompt"][0]["content"] == info["question"] + '\nGive the final answer as a number after "####".'
        assert r["data_source"] == "edgerl/arithmetic"
    digits = [int(x) for r in rows for x in re.findall(r"\d+", r["extra_info"]["expression"])]
    if level == 1:
        assert ops_seen == {("+",)} and max(digits) <= 9
    if level == 2:
        assert ops_seen == {("+",), ("-",)} and min(digits) >= 10 and max(digits) <= 99
    if level == 3:
        assert ("*",) in ops_seen and ("+",) in ops_seen
    if level == 4:
        assert all(len(o) == 2 for o in ops_seen) and len(ops_seen) == 4
    assert len(templates) >= 3  # several sentence patterns per level


# --- GSM8K preparation ----------------------------------------------------------------------------

def test_prepare_gsm8k_matches_verl_rule(tmp_path, tok):
    (tmp_path / "gsm8k").mkdir()
    out = tmp_path / "gsm8k" / "train.parquet"
    written, n = prepare_gsm8k(out, source=GSM8K_TRAIN, split="train")
    assert written == out
    src = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines() if line.strip()]
    table = pq.read_table(out)
    rows = table.to_pylist()
    assert n == len(rows) == len(src) == 42   # tests/data's sample: the first 40 rows, then rows 345 and 5715
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    for i, (row, ex) in enumerate(zip(rows, src)):
        final = ex["answer"].strip().splitlines()[-1]
        assert final.startswith("#### ")
        assert row["reward_model"] == {"style": "rule", "ground_truth": final[5:].replace(",", "")}
        assert row["prompt"] == [{"role": "user", "content": ex["question"] + " " + GSM8K_INSTRUCTION}]
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["extra_info"] == {"split": "train", "index": i, "answer": ex["answer"],
                                     "question": ex["question"]}
    # hand-checked rows
    assert rows[0]["reward_model"]["ground_truth"] == "72"
    assert rows[0]["prompt"][0]["content"].endswith(
        "April and May? Let's think step by step and output the final answer after \"####\".")
    assert rows[40]["reward_model"]["ground_truth"] == "1080"   # "#### 1,080"
    assert rows[41]["reward_model"]["ground_truth"] == "-7"     # "#### -7"
    # and edgerl reads its own output as verl-format data
    prompts, _ = load_prompts(cfg(out), tok)
    assert len(prompts) == 42 and prompts[40].ground_truth == "1080"
    assert prompts[40].extra["index"] == 40


def test_prepare_gsm8k_bad_source(tmp_path):
    bad = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"example 0 \(0-based\): no '#### <number>'"):
        prepare_gsm8k(tmp_path / "o.parquet", source=bad)
    broken = write_jsonl(tmp_path / "h.jsonl", [{"question": "q", "answer": "#### 1"}, "{oops"])
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        prepare_gsm8k(tmp_path / "o.parquet", source=broken)
