"""reward.functions with reward.weights: built-ins (answer, format, math-verify where installed), user functions
with verl's per-sample or TRL's batched signature, the weighted sum, and every wrong return as one error naming
the function."""

from __future__ import annotations

import math
import textwrap

import pytest

from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError, RewardError
from edgerl.rewards import builtins
from edgerl.rewards.builtins import RewardRow, think_format
from edgerl.rewards.functions import load_functions, score


def row(response: str, truth: str | None = "4", source: str = "arithmetic", prompt=None, prompt_text: str = "q"):
    return RewardRow(source, prompt if prompt is not None else "q", prompt_text, response, (1, 2), truth, {"i": 1})


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "rw.py"
    f.write_text(textwrap.dedent('''
        import sys
        def per_sample(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}
        def batched(prompts, completions, **kwargs):
            return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
        def uses_solution(completions, solution):
            return [float(s == "4") for s in solution]
        def marked(**kw):
            return 0.5 if kw["solution_str"] else 0.0
        marked.reward_signature = "verl"
        def marked_trl(*args, **kw):
            return [0.25] * len(kw["completions"])
        marked_trl.reward_signature = "trl"
        def some_none(prompts, completions, **kw):
            return [None if i % 2 else 1.0 for i in range(len(completions))]
        def short(prompts, completions, **kw):
            return [1.0]
        def text(prompts, completions, **kw):
            return "1.0"
        def nan(prompts, completions, **kw):
            return [float("nan")] * len(completions)
        def word(prompts, completions, **kw):
            return ["high"] * len(completions)
        def exits(prompts, completions, **kw):
            sys.exit(3)
        def nan_sample(data_source, solution_str, ground_truth, extra_info):
            return float("inf")
        def unknown(x, y):
            return 1.0
        def needs_more(prompts, completions, secret):
            return [1.0]
        def array(prompts, completions, **kw):
            import numpy
            return numpy.ones(len(completions))
    '''))
    return f


@pytest.mark.parametrize("response, prompt_text, want", [
    ("<think>2 + 2 is 4</think> The answer is 4.", "q", 1.0),
    ("  <think>\nsum\n</think>\n#### 4", "q", 1.0),
    ("<think></think> 4", "q", 0.0),                        # no reasoning
    ("<think>2 + 2</think>", "q", 0.0),                     # no answer after it
    ("The answer is 4", "q", 0.0),                          # no block
    ("<think>a</think> b <think>c</think> d", "q", 0.0),    # two blocks
    ("<think>a <think>b</think> c", "q", 0.0),              # nested opening
    ("2 + 2 is 4</think> 4", "...assistant\n<think>\n", 1.0),   # the template opened the block
    ("2 + 2 is 4</think> 4", "q", 0.0),
])
def test_format_reward(response, prompt_text, want):
    assert think_format(row(response, prompt_text=prompt_text)) == want


def test_answer_scores_math_with_math_verify_where_installed_else_its_own(monkeypatch):
    math_row = row("so x = \\boxed{\\frac{1}{2}}", truth="0.5", source="math")
    assert builtins.answer(math_row) == 1.0   # both scorers read 1/2 = 0.5
    monkeypatch.setattr(builtins, "math_verify_version", lambda: None)
    assert "pip install 'edgerl[math]'" in builtins.math_scorer()
    assert builtins.answer(row("\\boxed{\\sqrt{4}}", truth="2", source="math")) == 0.0   # own: no sqrt
    monkeypatch.undo()
    if builtins.math_verify_version() is None:
        pytest.skip("math-verify is not installed (pip install 'edgerl[math]')")
    assert builtins.math_scorer().startswith("math-verify")
    assert builtins.answer(row("\\boxed{\\sqrt{4}}", truth="2", source="math")) == 1.0   # math-verify simplifies


def test_the_weighted_sum_and_each_functions_values(user_file):
    fns = load_functions(["answer", f"{user_file}:per_sample", "format"], [1.0, 0.5, 0.25])
    assert [f.name for f in fns] == ["answer", "per_sample", "format"]
    assert [f.kind for f in fns] == ["builtin", "verl", "builtin"]
    rows = [row("#### 4"), row("4"), row("<think>x</think> 5")]
    res = score(fns, rows)
    for i, r in enumerate(rows):   # the sum, written out
        a = builtins.answer(r)["score"]
        p = float(r.response.strip() == r.ground_truth)
        f = think_format(r)
        assert res.total[i] == pytest.approx(1.0 * a + 0.5 * p + 0.25 * f)
    assert res.by_function["per_sample"] == [0.0, 1.0, 0.0]
    assert res.components["length"] == [6.0, 1.0, 18.0] and "marker" in res.components


def test_batched_functions_get_trl_arguments(user_file):
    fns = load_functions([f"{user_file}:batched", f"{user_file}:uses_solution"], None, answer_key="solution")
    assert [f.kind for f in fns] == ["trl", "trl"] and fns[1].accepts == ("completions", "solution")
    chat = [{"role": "user", "content": "q"}]
    res = score(fns, [row("abc", prompt=chat), row("de")], answer_key="solution")
    assert res.by_function["batched"] == [3.0, 2.0]   # a chat prompt's completion is a message list
    assert res.by_function["uses_solution"] == [1.0, 1.0]


def test_signature_by_marker_and_none_means_not_applicable(user_file):
    fns = load_functions([f"{user_file}:marked", f"{user_file}:marked_trl"], None)
    assert [f.kind for f in fns] == ["verl", "trl"]
    assert score(fns, [row("a")]).total == [0.75]
    fns = load_functions([f"{user_file}:some_none", f"{user_file}:array"], [2.0, 1.0])
    res = score(fns, [row("a"), row("b"), row("c")])
    assert res.total == [3.0, 1.0, 3.0]
    assert res.by_function["some_none"][0] == 1.0 and math.isnan(res.by_function["some_none"][1])


@pytest.mark.parametrize("fn, message", [
    ("short", "reward function short returned 1 value(s) on a batch of 2 completions; it must return one per"),
    ("text", "reward function text returned str '1.0' on a batch of 2 completions; a batched function"),
    ("nan", "reward function nan returned nan for completion 0 of a batch of 2; a reward must be a finite"),
    ("word", "reward function word returned str 'high' for completion 0"),
    ("exits", "rw.py failed on a batch of 2 completions: exited with sys.exit(3) (at rw.py:"),
    ("nan_sample", "reward function nan_sample returned inf on sample 0 of the batch"),
])
def test_a_wrong_return_is_one_error_naming_the_function(user_file, fn, message):
    (f,) = load_functions([f"{user_file}:{fn}"], None)
    with pytest.raises(RewardError) as e:
        score([f], [row("a"), row("b")])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec, message", [
    (":unknown", "takes (x, y); a reward function takes verl's per-sample arguments"),
    (":needs_more", "needs the argument(s) secret, which edgerl does not pass"),
    (":missing", "has no 'missing'; functions defined there:"),
])
def test_a_function_edgerl_cannot_call_is_refused_at_load(user_file, spec, message):
    with pytest.raises(RewardError, match="reward.functions\\[0\\]") as e:
        load_functions([f"{user_file}{spec}"], None)
    assert message in str(e.value)


def test_names_stay_unique_and_clear_of_other_reward_metrics(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    for f in (a, b):
        f.write_text("def mean(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    fns = load_functions([f"{a}:mean", f"{b}:mean"], None)
    assert [f.name for f in fns] == ["mean_2", "mean_3"]


@pytest.mark.parametrize("sets, message", [
    (['reward.functions=["anwser"]'], "did you mean 'answer'?"),
    (['reward.functions=["answer", "format"]', "reward.weights=[1.0]"], "reward.weights has 1 value(s) for 2"),
    (["reward.functions=[]"], "reward.functions is empty"),
    (['reward.function="x.py:f"', 'reward.functions=["format"]'], "reward.function and reward.functions are both"),
    (['reward.weights=[nan]'], "must hold finite numbers"),
    (['reward.functions="answer"'], "expected a list"),
])
def test_bad_reward_settings(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert message in str(e.value)


def test_reward_function_is_reward_functions_of_one():
    cfg = load_config(None, ['reward.function="x.py:f"'])
    assert cfg.reward.functions == ["x.py:f"] and cfg.reward.function is None


def test_a_bad_reward_file_stops_train_before_writing(tiny_llama, tmp_path, user_file):
    from typer.testing import CliRunner
    from edgerl.cli.main import app
    out = tmp_path / "run"
    for spec in (f"{user_file}:unknown", f"{tmp_path}/none.py:f"):
        r = CliRunner().invoke(app, ["train", "--model", str(tiny_llama), "--out", str(out), "--set",
                                     'run.profile="cpu"', "--set", f'reward.functions=["answer", "{spec}"]'])
        assert r.exit_code == 2 and "reward.functions[1]" in r.output and "Traceback" not in r.output, r.output
        assert not out.exists()
