"""The built-in reward functions that `reward.functions` names, beside the rules in `rules.py`:

    answer   each row's answer checked by its data_source's rule (gsm8k, math, arithmetic); math rows go
             through math-verify where it is installed (pip install 'edgerl[math]'), else edgerl's own
             normaliser (`rules.math_score`)
    format   1.0 for `<think>reasoning</think>` followed by an answer, else 0.0

Each takes one `RewardRow` and returns a float or a dict with a 'score' key (as verl's functions do).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from edgerl.rewards.rules import _BUILTIN, ALIASES, default_compute_score, math_score


@dataclass(frozen=True)
class RewardRow:
    """One response to score, with what any reward function may read."""
    data_source: str
    prompt: Union[str, list, None]       # the prompt as the data holds it (a string or a chat list)
    prompt_text: str                     # what the model read (chat template applied)
    response: str                        # decoded, special tokens removed
    response_ids: tuple[int, ...]
    ground_truth: Optional[str]
    extra: Optional[dict] = None


# --- math-verify ---------------------------------------------------------------------------------

def math_verify_version() -> Optional[str]:
    """math-verify's version when it is installed, else None."""
    if importlib.util.find_spec("math_verify") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("math-verify")
    except PackageNotFoundError:
        return "unknown version"


def math_verify_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when math-verify finds the response's answer equal to the ground truth, as verl's
    `reward_score/math_verify.py` calls it: the ground truth boxed and read as LaTeX, the response read
    as an expression or LaTeX. math-verify's own failures (a timeout, an expression it cannot parse)
    score 0.0, as in verl."""
    if ground_truth is None:
        raise ValueError("the math reward needs a ground truth; this row has none (check data.answer_key)")
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    # a response without an answer it can read is a 0, not a warning per response in the run log
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        score, _ = verify(["\\boxed{" + str(ground_truth) + "}"], [solution_str])
    except Exception:  # math-verify raises on what it cannot parse in time; verl scores that 0
        return 0.0
    return float(score)


def is_math_source(data_source: str) -> bool:
    """Rows of this data_source are scored by the math rule."""
    return _BUILTIN.get(ALIASES.get(data_source, data_source)) is math_score


def math_scorer() -> str:
    """Which scorer the math rule uses here, for the run log."""
    v = math_verify_version()
    return (f"math-verify {v}" if v else
            "edgerl's own normaliser (pip install 'edgerl[math]' to score with math-verify)")


# --- the built-ins ---------------------------------------------------------------------------------

def answer(row: RewardRow) -> Union[float, dict]:
    """The row's data_source rule (`rules.default_compute_score`); math rows by math-verify where installed."""
    if is_math_source(row.data_source) and math_verify_version() is not None:
        return math_verify_score(row.response, row.ground_truth)
    return default_compute_score(row.data_source, row.response, row.ground_truth, row.extra)


_THINK = re.compile(r"\s*<think>(?P<think>.*?)</think>(?P<answer>.*)", re.DOTALL)


def think_format(row: RewardRow) -> float:
    """1.0 when the response is one `<think>...</think>` block with some reasoning in it, followed by a
    non-empty answer; else 0.0. When the prompt itself ends with `<think>` (chat templates of reasoning
    models open the block for the model), the response is read as continuing it."""
    text = row.response
    if row.prompt_text.rstrip().endswith("<think>"):
        text = "<think>" + text
    m = _THINK.fullmatch(text)
    if m is None or "<think>" in m["think"] or "<think>" in m["answer"] or "</think>" in m["answer"]:
        return 0.0
    return float(bool(m["think"].strip()) and bool(m["answer"].strip()))


BuiltinFn = Callable[[RewardRow], Any]
# name -> (function, one line for docs and errors)
BUILTIN_REWARDS: dict[str, tuple[BuiltinFn, str]] = {
    "answer": (answer, "each row's answer checked by its data_source's rule (gsm8k, math, arithmetic)"),
    "format": (think_format, "1.0 for <think>reasoning</think> followed by an answer"),
}
