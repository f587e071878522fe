"""Rule rewards (verl's gsm8k behaviour, math, arithmetic), dispatch, user functions, batch scoring,
and the sequence-classification reward model on a tiny random model."""

from __future__ import annotations

import math

import pytest

from edgerl.rewards.rules import (RewardError, RewardItem, arithmetic_score, check_sources,
                            default_compute_score, ground_truth_problem, gsm8k_extract, gsm8k_score,
                            load_reward_function, math_score, parse_number, score_batch)

from conftest import need_tokenizer  # noqa: E402


# --- gsm8k: verl's exact behaviour ------------------------------------------------------------------

@pytest.mark.parametrize("text, strict, flexible", [
    ("so the answer is #### 72", "72", "72"),
    ("I think she sold 72 clips", None, "72"),                  # flexible only
    ("#### 1,000", "1000", "1,000"),                            # strict strips ',', flexible does not
    ("####72", None, "72"),                                     # strict needs exactly '#### '
    ("#### 72.", "72.", "72."),                                 # trailing period is kept
    ("#### 5 then #### 72 and 9 more", "72", "9"),              # strict: last marker; flexible: last number
    ("#### $72", None, "72"),                                   # '$' is not in the number class
    ("#### -5", "-5", "-5"),
    ("Hello, world", None, ","),                                # a lone ',' is a 'number' in flexible
    ("The end.", None, "."),                                    # only '.' found: '.' comes back
    ("no digits at all", None, None),
])
def test_gsm8k_extract(text, strict, flexible):
    assert gsm8k_extract(text, "strict") == strict
    assert gsm8k_extract(text, "flexible") == flexible


def test_gsm8k_clips_to_last_300_chars():
    tail = " and that is all" * 20  # 320 characters without digits
    assert gsm8k_extract("#### 72" + tail, "strict") is None
    assert gsm8k_extract("#### 72" + tail[:290], "strict") == "72"  # 297 characters: inside the window
    assert gsm8k_score("#### 72" + tail, "72") == 0.0


def test_gsm8k_score_strict_vs_flexible_and_format_score():
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("the answer is 72", "72") == 0.0                      # strict finds nothing
    assert gsm8k_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k_score("the answer is 72.", "72", method="flexible") == 0.0  # '72.' != '72'
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1             # found but wrong
    assert gsm8k_score("no marker", "72", format_score=0.1) == 0.0           # nothing found: 0
    assert gsm8k_score("Hello, world", "72", method="flexible", format_score=0.1) == 0.1
    assert gsm8k_score("#### 1,000", "1000") == 1.0
    assert default_compute_score("openai/gsm8k", "the answer is 72", "72") == 0.0  # verl: strict
    assert isinstance(default_compute_score("openai/gsm8k", "#### 72", "72"), float)


# --- math --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, truth, want", [
    ("so \\boxed{72}", "72", 1.0),
    ("so \\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("the answer is 0.75", "\\frac{3}{4}", 1.0),
    ("the answer is 3/4", "0.75", 1.0),
    ("\\boxed{\\dfrac34}", "0.75", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("total: 1,234,567 dollars", "1234567", 1.0),
    ("\\boxed{\\$5.00}", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{0.3333}", "1/3", 0.0),               # 3e-5 off: beyond the tolerance (1e-6)
    ("\\boxed{0.3333333}", "1/3", 1.0),            # 3e-8 off: within it
    ("\\boxed{1000001}", "1000000", 1.0),          # relative above 1
    ("\\boxed{1000010}", "1000000", 0.0),
    ("\\boxed{1,2}", "12", 0.0),                   # a pair, not a thousands separator
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}", 1.0),  # not numbers: normalised strings
    ("\\boxed{x+1}", "x + 1", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box
    ("\\boxed{7 and it never closes", "7", 1.0),    # unclosed box: the last number
    ("no answer here", "7", 0.0),
    ("it is 8", "\\boxed{8}", 1.0),                # a boxed ground truth is unboxed
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
])
def test_math_score(response, truth, want):
    assert math_score(response, truth) == want
    assert default_compute_score("lighteval/MATH", response, truth) == want


def test_parse_number():
    assert parse_number("1,000") == 1000 and parse_number("3/4") == 0.75
    assert parse_number("\\frac{1}{0}") is None and parse_number("abc") is None
    assert parse_number("12.") == 12.0


# --- arithmetic --------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, score, marker", [
    ("3 + 5 = 8\n#### 8", 1.0, 1.0),
    ("Tom has 8 apples now.", 1.0, 0.0),            # flexible fallback gives full credit
    ("#### 8.", 1.0, 1.0),
    ("#### 8.0", 1.0, 1.0),
    ("#### 8 ... well, maybe 9", 1.0, 1.0),         # the marker wins over later numbers
    ("#### 9", 0.0, 1.0),
    ("Tom has 8 apples and 1 more is 9", 0.0, 0.0),
    ("I do not know", 0.0, 0.0),
    ("Hello, there.", 0.0, 0.0),
])
def test_arithmetic_score(response, score, marker):
    assert arithmetic_score(response, "8") == {"score": score, "marker": marker}
    assert default_compute_score("edgerl/arithmetic", response, "8") == {"score": score, "marker": marker}


def test_arithmetic_thousands():
    assert arithmetic_score("#### 1,200", "1200")["score"] == 1.0
    assert arithmetic_score("so 1,200", "1200")["score"] == 1.0


def test_arithmetic_decimal_ground_truth():
    assert arithmetic_score("#### 3.5", "3.5")["score"] == 1.0
    assert arithmetic_score("half of 7 is 3.50", "3.5")["score"] == 1.0
    assert arithmetic_score("#### 3", "3.5")["score"] == 0.0
    assert arithmetic_score("#### 1200", "1,200")["score"] == 1.0
    assert arithmetic_score("#### 12", " 12 ")["score"] == 1.0
    for bad in ("seven", "nan", "inf", "1e3", "1/2", "1,2"):
        with pytest.raises(ValueError, match="needs a number as the ground truth"):
            arithmetic_score("#### 1", bad)


def _best_score(source: str, truth: str) -> float:
    """The best reward any plain statement of `truth` (and of its digits) earns; 0 when the reward
    cannot even compare it."""
    digits = "".join(c for c in truth if c.isdigit() or c in "-.")
    best = 0.0
    for said in {truth, truth.replace(",", ""), digits}:
        for response in (f"#### {said}", f"The answer is {said}", f"\\boxed{{{said}}}"):
            try:
                res = default_compute_score(source, response, truth)
            except ValueError:
                return 0.0
            best = max(best, res["score"] if isinstance(res, dict) else res)
    return best


@pytest.mark.parametrize("source, truth", [
    (s, t) for s in ("gsm8k", "openai/gsm8k", "math", "arithmetic", "edgerl/arithmetic")
    for t in ("72", "-7", "3.5", "0.25", "1,000", "1000", "$5", "72 apples", " 72", "seven", "1/2",
              "\\frac{1}{2}", "3 + 4 = 7\n#### 7", "nan", "1e3")])
def test_ground_truth_check_agrees_with_the_reward(source, truth):
    """The load-time check refuses exactly the ground truths that no response could get full credit
    for: what it lets through trains, what it stops would have scored 0 (or failed) every time."""
    assert (ground_truth_problem(source, truth) is None) == (_best_score(source, truth) == 1.0)


def test_ground_truth_check_leaves_other_sources_alone():
    assert ground_truth_problem("my/task", "anything at all") is None
    assert ground_truth_problem("my/task", None) is None
    for source in ("gsm8k", "math", "arithmetic"):
        assert "data.answer_key=''" in ground_truth_problem(source, None)


# --- dispatch ----------------------------------------------------------------------------------------

def test_dispatch_names_and_aliases():
    assert default_compute_score("gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("math", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("arithmetic", "#### 3", "3")["score"] == 1.0
    with pytest.raises(RewardError) as e:
        default_compute_score("my/data", "x", "1")
    msg = str(e.value)
    assert "'my/data'" in msg and "openai/gsm8k" in msg and "edgerl/arithmetic" in msg
    assert "--reward path/to/file.py:fn" in msg
    check_sources(["openai/gsm8k", "arithmetic"])
    with pytest.raises(RewardError, match="'other'"):
        check_sources(["openai/gsm8k", "other"])


# --- user functions ----------------------------------------------------------------------------------

USER_FILE = '''
import re

def my_reward(data_source, solution_str, ground_truth, extra_info=None):
    hit = float(solution_str.strip() == ground_truth)
    return {"score": hit, "length": float(len(solution_str)), "note": "text is not logged"}

def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("bad luck")

def two_args(a, b):
    return 0.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def test_load_reward_function_and_components(user_file):
    fn = load_reward_function(f"{user_file}:my_reward")
    items = [RewardItem("x", "42", "42"), RewardItem("x", "41", "42", {"i": 1})]
    scores, comps = score_batch(fn, items)
    assert scores == [1.0, 0.0] and comps == {"length": [2.0, 2.0]}


def test_load_reward_function_errors(user_file, tmp_path):
    with pytest.raises(RewardError, match="no such file"):
        load_reward_function(f"{tmp_path}/nope.py:fn")
    with pytest.raises(RewardError, match=r"has no 'missing'; functions defined there: boom, my_reward, two_args"):
        load_reward_function(f"{user_file}:missing")
    with pytest.raises(RewardError, match="is a int, not a function"):
        load_reward_function(f"{user_file}:NOT_A_FUNCTION")
    with pytest.raises(RewardError, match="cannot be called with verl's keyword arguments"):
        load_reward_function(f"{user_file}:two_args")
    with pytest.raises(RewardError, match="expected path/to/file.py:function_name"):
        load_reward_function(str(user_file))
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(RewardError, match="importing .*broken.py failed: SyntaxError"):
        load_reward_function(f"{broken}:f")


def test_reward_error_names_the_sample(user_file):
    fn = load_reward_function(f"{user_file}:boom")
    items = [RewardItem("openai/gsm8k", "x" * 500 + " #### 7", "7")]
    with pytest.raises(RewardError) as e:
        score_batch(fn, items)
    msg = str(e.value)
    assert "sample 0 of the batch" in msg and "'openai/gsm8k'" in msg and "#### 7" in msg
    assert "ground truth '7'" in msg and "ZeroDivisionError: bad luck" in msg
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert len(msg) < 400  # the response is excerpted, not dumped

    items = [RewardItem("openai/gsm8k", "#### 1", "1"), RewardItem("my/data", "resp", "2")]
    with pytest.raises(RewardError, match=r"sample 1 of the batch \(data_source 'my/data'") as e:
        score_batch(default_compute_score, items)
    assert isinstance(e.value.__cause__, RewardError)


@pytest.mark.parametrize("result, why", [
    ({"value": 1.0}, "no 'score' key"),
    (None, "returned None"),
    ("1.0", "returned '1.0'"),
    (float("nan"), "non-finite score"),
    ({"score": float("inf")}, "non-finite score"),
])
def test_bad_results_are_errors(result, why):
    def fn(data_source, solution_str, ground_truth, extra_info):
        return result
    with pytest.raises(RewardError, match=why):
        score_batch(fn, [RewardItem("s", "r", "g")])


def test_components_missing_in_some_results_are_nan():
    def fn(data_source, solution_str, ground_truth, extra_info):
        return {"score": 1.0, "a": 2} if solution_str == "x" else 0.5
    scores, comps = score_batch(fn, [RewardItem("s", "x", "g"), RewardItem("s", "y", "g")])
    assert scores == [1.0, 0.5] and comps["a"][0] == 2.0 and math.isnan(comps["a"][1])


def test_rule_rewards_need_a_ground_truth():
    with pytest.raises(RewardError, match="needs a ground truth"):
        score_batch(default_compute_score, [RewardItem("math", "\\boxed{1}", None)])


# --- reward model ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    tokenizer = need_tokenizer()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id, max_position_embeddings=256)
    model = LlamaForSequenceClassification(config)
    folder = tmp_path_factory.mktemp("rm")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _reference_scores(model, seqs):
    """Slow and obvious: each sequence alone, unpadded; the score head on the last hidden state."""
    import torch
    out = []
    with torch.no_grad():
        for seq in seqs:
            hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
            out.append(float(model.score(hidden)[0]))
    return out


def test_reward_model_batches_match_one_by_one(tiny_rm):
    from edgerl.rewards.model import RewardModel
    rm = RewardModel(str(tiny_rm), batch_size=2)
    prompts = ["What is 2 + 2?", "Say hi.", "Count to three.", [{"role": "user", "content": "Chat?"}], "x"]
    responses = ["4", "hi there, friend, how are you today?", "1 2 3", "yes", "y"]
    scores = rm.score(prompts, responses)
    assert len(scores) == 5 and len(set(scores)) == 5
    ref = _reference_scores(rm.model, rm.encode(prompts, responses))
    assert scores == pytest.approx(ref, abs=1e-5)
    text, special = rm.join("What is 2 + 2?", "4")
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n") and not special


def test_reward_model_without_template_and_pad_at_the_end(tiny_rm):
    from edgerl.rewards.model import RewardModel
    rm = RewardModel(str(tiny_rm), batch_size=3)
    rm.tokenizer.chat_template = None
    # SmolLM2's pad token is <|im_end|>: a response ending with it must be read at that token
    prompts, responses = ["Q: a", "Q: b", "Q: c"], ["short", "ends with pad<|im_end|>", "a longer one here"]
    assert rm.encode(prompts, responses)[1][-1] == rm.tokenizer.pad_token_id
    scores = rm.score(prompts, responses)
    assert scores == pytest.approx(_reference_scores(rm.model, rm.encode(prompts, responses)), abs=1e-5)
    assert rm.join("Q: a", "short") == ("Q: ashort", True)
    with pytest.raises(RewardError, match="no chat template"):
        rm.score([[{"role": "user", "content": "x"}]], ["y"])


def test_reward_model_errors(tmp_path):
    from edgerl.rewards.model import RewardModel
    with pytest.raises(RewardError, match="cannot load the reward model"):
        RewardModel(str(tmp_path / "missing"))
