"""Tools and environments (edgerl/agents): the built-in tools, the tool-call formats, the continuation a
chat template renders after a turn, and hostile tools in the contained worker: each ends its call with an
error the model reads (or stops the run with one line), and the worker serves the next call."""

from __future__ import annotations

import os
import time

import pytest

from agent_helpers import HOSTILE_TOOLS, LLAMA3_LIKE_TEMPLATE, QWEN25_TEMPLATE, QWEN3_LIKE_TEMPLATE, tool_tokenizer
from conftest import need_tokenizer
from edgerl.agents.builtin import calculator
from edgerl.agents.calls import Continuations, ToolCall, parse_calls, tool_format, tool_messages
from edgerl.agents.host import as_text
from edgerl.agents.toolbox import GRACE_S, Limits, ToolBox
from edgerl.core.errors import ToolError


@pytest.mark.parametrize("expr, want", [("(12 + 30) * 4 / 3", "56"), ("7 / 2", "3.5"), ("-2 ** 3", "-8"),
                                        ("17 // 5 + 17 % 5", "5"), ("0.1 + 0.2", "0.30000000000000004")])
def test_calculator_computes_arithmetic(expr, want):
    assert calculator(expr) == want == str(eval(expr) if not float(eval(expr)).is_integer() else int(eval(expr)))


@pytest.mark.parametrize("expr, words", [("9 ** 9 ** 9", "too large"), ("__import__('os')", "not arithmetic"),
                                         ("1 / 0", "division"), ("2 +", "cannot read"), ("10 ** 200", "too large")])
def test_calculator_refuses_what_is_not_small_arithmetic(expr, words):
    with pytest.raises((ValueError, ZeroDivisionError), match=words):
        calculator(expr)


def test_results_become_text_or_a_type_error():
    assert as_text("ok", 10) == "ok" and as_text(3, 10) == "3" and as_text({"a": [1, 2]}, 100) == '{"a": [1, 2]}'
    assert as_text("x" * 25, 10) == "x" * 10 + "\n[... 15 more characters cut]"
    for bad in (object(), {"a": object()}, float("nan"), b"bytes"):
        with pytest.raises(TypeError, match="return a string"):
            as_text(bad, 10)


def test_hermes_calls_are_parsed_and_bad_ones_answered():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": oops}</tool_call><tool_call>{"name": "calculator", "arguments": [1]}')
    calls = parse_calls(text, "hermes")
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "2+3"}, True), ("python", {"code": "print(1)"}, True)]
    assert "not valid JSON" in calls[2].error and "must be a JSON object" in calls[3].error
    assert parse_calls("The answer is 5.", "hermes") == []


def test_llama3_calls_are_parsed():
    assert parse_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}', "llama3") == [
        ToolCall("calculator", {"expression": "1+1"})]
    two = parse_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "llama3")
    assert [(c.name, c.arguments) for c in two] == [("a", {}), ("b", {"x": 1})]
    assert parse_calls("The answer is 5.", "llama3") == [] and parse_calls("{broken", "llama3")[0].error


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's tokenizer; a test may set its chat_template (it is put back after)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(need_tokenizer())
    own = tok.chat_template
    yield tok
    tok.chat_template = own


def test_a_template_without_tool_support_is_refused_in_one_line(smol):
    with pytest.raises(ToolError, match="has no tool support") as e:   # SmolLM2's template never reads `tools`
        tool_format(smol, "smollm2")
    assert "\n" not in str(e.value)
    smol.chat_template = None
    with pytest.raises(ToolError, match="has no chat template"):
        tool_format(smol, "smollm2")
    smol.chat_template = QWEN25_TEMPLATE
    assert tool_format(smol, "q") == "hermes"
    smol.chat_template = LLAMA3_LIKE_TEMPLATE
    assert tool_format(smol, "l") == "llama3"


def test_a_tool_capable_tokenizer_is_saved_with_its_template(tmp_path):
    from transformers import AutoTokenizer
    tool_tokenizer(need_tokenizer(), tmp_path)
    assert tool_format(AutoTokenizer.from_pretrained(tmp_path), "tiny") == "hermes"


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, QWEN3_LIKE_TEMPLATE], ids=["qwen2.5", "qwen3-like"])
def test_the_continuation_is_what_the_template_renders_after_the_turn(smol, template):
    """prompt + the model's turn + the continuation == the template's rendering of the whole conversation
    (where the template renders earlier turns as it rendered them then; Qwen3's changes the last one)."""
    tok = smol
    tok.chat_template = template
    cont = Continuations(tok)
    msgs = tool_messages([ToolCall("calculator", {"expression": "2+3"})] * 2, ["5", "5"])
    tail = cont.text(msgs)
    assert tail == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n5\n</tool_response>" \
                   "<|im_end|>\n<|im_start|>assistant\n"
    user = [{"role": "user", "content": "What is 2+3?"}]
    turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": turn}] + msgs, tokenize=False,
                                    add_generation_prompt=True)
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert whole == prompt + turn + "<|im_end|>" + tail
    ids = tok(prompt + turn + "<|im_end|>", add_special_tokens=False)["input_ids"] + cont.tokens(msgs)
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]


# --- the worker -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def box(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "hostile.py").write_text(HOSTILE_TOOLS)
    names = "hang boom loud thing writer leave hog secret".split()
    tb = ToolBox(["calculator", "python"] + [f"{folder / 'hostile.py'}:{n}" for n in names], None,
                 Limits(timeout_s=2.0, memory_mb=512, max_chars=1000), workers=1, log=lambda s: None)
    yield tb, folder
    tb.close()
    assert not tb.folder.exists()


def call(tb, name, hidden=None, **args):
    return tb.request(0, {"op": "call", "name": name, "arguments": args, "hidden": hidden or {}})


def test_tool_schemas_come_from_signatures_and_docstrings(box):
    tb, _ = box
    by = {s["function"]["name"]: s["function"] for s in tb.schemas}
    assert by["calculator"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert by["secret"]["parameters"]["properties"].keys() == {"x"}   # keyword-only `answer` stays hidden
    assert "writes only beneath" in tb.fences


def test_builtin_tools_run_in_the_worker(box):
    tb, _ = box
    assert call(tb, "calculator", expression="6 * 7") == {"content": "42"}
    assert call(tb, "python", code="print(sum(range(10)))") == {"content": "45\n"}
    out = call(tb, "secret", hidden={"answer": "yes"}, x=3)["content"].split(":")
    assert out[:2] == ["3", "yes"] and int(out[2]) != os.getpid()   # in another process
    assert "has no argument 'answer'" in call(tb, "secret", x=3, answer="no")["error"]
    assert "there is no tool 'nope'" in call(tb, "nope")["error"]


def test_hostile_tools_end_their_call_with_an_error_the_model_reads(box):
    tb, folder = box
    outside = folder / "outside.txt"
    assert call(tb, "boom", x=1) == {"error": "KeyError: 'nope'"}
    assert "not text" in call(tb, "thing", x=1)["error"]
    loud = call(tb, "loud", x=1)["content"]
    assert loud.startswith("x" * 1000) and loud.endswith("more characters cut]") and len(loud) < 1100
    assert "write only beneath" in call(tb, "writer", path=str(outside))["error"] and not outside.exists()
    assert call(tb, "writer", path="mine.txt") == {"content": "wrote mine.txt"}
    assert "memory" in call(tb, "hog", x=1)["error"]
    py = call(tb, "python", code=f"open({str(outside)!r}, 'w').write('x')")["content"]
    assert "PermissionError" in py and not outside.exists()
    t0 = time.monotonic()
    assert "did not finish" in call(tb, "python", code="while True: pass")["error"]
    hung = call(tb, "hang", x=1)
    assert hung["timeout"] and "did not return within 2 s" in hung["error"]
    assert time.monotonic() - t0 < 2 + 2 + GRACE_S + 3
    left = call(tb, "leave", x=1)
    assert "ended its process" in left["error"] and left["restarted"] and not left["timeout"]
    assert call(tb, "calculator", expression="1 + 1") == {"content": "2"}   # the restarted worker serves on
    counts = tb.take_counts()
    assert counts["restarts"] == 2 and counts["timeouts"] == 2 and counts["errors"] >= 8


def test_a_tool_file_that_does_not_import_stops_the_run_in_one_line(tmp_path):
    (tmp_path / "bad.py").write_text("raise RuntimeError('broken at import')\n")
    with pytest.raises(ToolError, match="importing .*bad.py failed: RuntimeError: broken at import") as e:
        ToolBox([f"{tmp_path / 'bad.py'}:f"], None, Limits(), workers=1)
    assert "\n" not in str(e.value)


ENV = '''
class Guess:
    """Guess a number from 1 to 9 in up to three tries; the environment says higher or lower."""

    def reset(self, row):
        self.target = int(row["interaction_kwargs"]["target"])
        return None

    def step(self, text):
        guess = int("".join(c for c in text if c.isdigit()) or 0)
        if guess == self.target:
            return "correct", 1.0, True
        return ("higher" if guess < self.target else "lower"), 0.0, False


class Broken:
    def reset(self, row):
        return None

    def step(self, text):
        return "no reward"
'''


def test_an_environment_keeps_its_state_per_episode_in_the_worker(tmp_path):
    (tmp_path / "env.py").write_text(ENV)
    tb = ToolBox([], f"{tmp_path / 'env.py'}:Guess", Limits(timeout_s=2.0), workers=1, log=lambda s: None)
    try:
        for ep, target in ((0, 3), (1, 7)):
            assert tb.submit(ep, {"op": "reset", "episode": ep, "row": {"interaction_kwargs": {"target": target}}}
                             ).result() == {"observation": None}
        assert tb.submit(0, {"op": "step", "episode": 0, "text": "5"}).result() == \
            {"observation": "lower", "reward": 0.0, "done": False}
        assert tb.submit(1, {"op": "step", "episode": 1, "text": "7"}).result() == \
            {"observation": "correct", "reward": 1.0, "done": True}
    finally:
        tb.close()
    tb = ToolBox([], f"{tmp_path / 'env.py'}:Broken", Limits(timeout_s=2.0), workers=1, log=lambda s: None)
    try:
        tb.submit(0, {"op": "reset", "episode": 0, "row": {}}).result()
        with pytest.raises(ToolError, match=r"Broken.step returned 'no reward'; it must return \(observation, reward, done\)"):
            tb.submit(0, {"op": "step", "episode": 0, "text": "1"}).result()
    finally:
        tb.close()
