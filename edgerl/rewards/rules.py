"""Rewards: rule rewards (gsm8k, math, the built-in arithmetic task), user functions, batch scoring.

Every reward function has verl's custom-reward signature, called with keyword arguments as
verl's reward manager calls it:

    fn(data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict | None)
        -> float | dict

A dict must hold a "score" key (the reward); its other numeric keys are logged as reward
components. `default_compute_score` dispatches on data_source like verl's function of that name.
A learned reward model (HF sequence classification) is in `edgerl.rewards.model`.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union
from edgerl.core.errors import RewardError
from edgerl.rewards.contain import UserFunction, call_user, check_result

RewardResult = Union[float, dict]
RewardFn = Callable[..., RewardResult]

SIGNATURE = ("fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) "
             "-> float | dict with a 'score' key")
VERL_CALL = dict(data_source="", solution_str="", ground_truth="", extra_info=None)  # checked at load




# --- gsm8k: verl/utils/reward_score/gsm8k.py --------------------------------------------------

# verl only looks at the end of the response: regexes on long strings are slow, and the final
# answer is at the end. 300 characters is verl's constant.
_SOLUTION_CLIP_CHARS = 300
_GSM8K_STRICT = re.compile("#### (\\-?[0-9\\.\\,]+)")
_GSM8K_FLEXIBLE = re.compile("(\\-?[0-9\\.\\,]+)")


def gsm8k_extract(solution_str: str, method: str = "strict") -> Optional[str]:
    """verl's gsm8k `extract_solution`, behaviour for behaviour.

    Only the last 300 characters are searched. strict: the last `#### <number>` match (exactly one
    space after ####), with ',' and '$' removed ('$' cannot occur in the match: '#### $72' finds
    nothing). flexible: the last run of digits, '.' and ',' (with an optional leading '-') that is
    not '.'; nothing is stripped, so 'is 72.' extracts '72.', '1,000' stays '1,000' (neither equals
    '72' / '1000': verl scores them format_score), and a lone ',' counts as a run ('Hi, there'
    extracts ',', so it scores format_score rather than 0).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    final_answer = None
    for final_answer in reversed(_GSM8K_FLEXIBLE.findall(solution_str)):
        if final_answer not in ("", "."):
            break
    # as in verl: when every match is '.', the loop ends on '.', which then scores format_score
    return final_answer


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's gsm8k `compute_score`: `score` on an exact string match of the extracted answer, else
    `format_score` (0.0 by default, although verl's docs mention 0.1), and 0 if nothing is found."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


# --- math: numeric answers --------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent or unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def _normalize(ans: str) -> str:
    s = ans.strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\$", ""), ("$", ""),
                     ("\\%", ""), ("%", ""), ("^\\circ", ""), ("^{\\circ}", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), (" ", "")):
        s = s.replace(old, new)
    s = re.sub(r"\\text\{\s*[^}]*\}$", "", s)  # trailing units such as \text{ cm}
    return s.rstrip(".")


def parse_number(ans: str) -> Optional[float]:
    """A number from an answer string: '1,234', '-3.5', '3/4', '\\frac{3}{4}', '-\\frac34', '$5', '50\\%'."""
    s = _normalize(ans)
    m = re.fullmatch(r"(-?)\\frac\{?(-?\d+(?:\.\d+)?)\}?\{?(-?\d+(?:\.\d+)?)\}?", s)
    if m is None:
        m = re.fullmatch(r"(-?)(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", s)
    if m is not None:
        num, den = float(m.group(2)), float(m.group(3))
        if den == 0:
            return None
        return (-1 if m.group(1) else 1) * num / den
    if "," in s:
        if not _THOUSANDS.match(s):
            return None  # '1,2' is a pair, not one thousand two hundred
        s = s.replace(",", "")
    try:
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def math_extract(solution_str: str) -> Optional[str]:
    """The answer of a response: the last \\boxed{...}, else the last number in the text."""
    boxed = last_boxed(solution_str)
    if boxed is not None:
        return boxed
    found = _NUMBER.findall(solution_str)
    return found[-1] if found else None


def math_score(solution_str: str, ground_truth: str, rel_tol: float = 1e-6) -> float:
    """1.0 when the response's answer equals the ground truth, else 0.0.

    Both sides are parsed as numbers (fractions, thousands separators, $ and % handled) and compared
    with `rel_tol` (absolute below 1); when either is not a number, normalised strings are compared
    (so '\\frac{\\pi}{2}' still matches itself). A ground truth holding \\boxed{...} is unboxed first.
    """
    if ground_truth is None:
        raise ValueError("the math reward needs a ground truth; this row has none (check data.answer_key)")
    truth = last_boxed(ground_truth) or ground_truth
    pred = math_extract(solution_str)
    if pred is None:
        return 0.0
    a, b = parse_number(pred), parse_number(truth)
    if a is not None and b is not None:
        return float(abs(a - b) <= rel_tol * max(1.0, abs(b)))
    return float(_normalize(pred) == _normalize(truth))


# --- the built-in arithmetic task ---------------------------------------------------------------

def arithmetic_extract(solution_str: str) -> tuple[Optional[str], bool]:
    """(answer, marked): gsm8k strict extraction first (last '#### <number>' in the last 300
    characters), else gsm8k flexible (the last number); `marked` says the strict form was found."""
    strict = gsm8k_extract(solution_str, "strict")
    if strict is not None:
        return strict, True
    return gsm8k_extract(solution_str, "flexible"), False


_DECIMAL = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def arithmetic_truth(ground_truth: Any) -> Optional[float]:
    """The ground truth of an arithmetic row as a number: an integer or a decimal ('12', '3.5',
    '-4', '1,200'); None when it is not one ('seven', '1e3', 'nan': no answer could equal it)."""
    s = str(ground_truth).strip()
    return float(s.replace(",", "")) if _DECIMAL.fullmatch(s) else None


def arithmetic_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    """{'score': 1.0 if the answer equals the numeric ground truth else 0.0, 'marker': 1.0 if it
    came from the '#### <number>' form}. Unlike gsm8k the comparison is numeric ('12.', '12.0',
    '1,200' count; a decimal ground truth such as 3.5 works as well as the built-in task's
    integers), and an unmarked answer (the last number) earns full credit too: a 135M model
    rarely writes the marker at first, and the task is to learn arithmetic; 'marker' is logged so
    the format can be watched."""
    if ground_truth is None:
        raise ValueError("the arithmetic reward needs a ground truth; this row has none")
    truth = arithmetic_truth(ground_truth)
    if truth is None:
        raise ValueError(f"the arithmetic reward needs a number as the ground truth, got {ground_truth!r}")
    answer, marked = arithmetic_extract(solution_str)
    value = None
    if answer is not None:
        try:
            value = float(answer.replace(",", "").rstrip("."))
        except ValueError:
            value = None
    return {"score": float(value is not None and value == truth), "marker": float(marked)}


# --- dispatch -----------------------------------------------------------------------------------

_BUILTIN: dict[str, Callable[[str, Any], RewardResult]] = {
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "math": math_score,
    "edgerl/arithmetic": arithmetic_score,
}
# short names accepted in data.default_source
ALIASES = {"gsm8k": "openai/gsm8k", "arithmetic": "edgerl/arithmetic"}
KNOWN_SOURCES = tuple(_BUILTIN) + tuple(ALIASES)


def _unknown_source(data_source: str) -> RewardError:
    return RewardError(f"no built-in reward for data_source {data_source!r}; known: "
                       f"{', '.join(KNOWN_SOURCES)}. For other data, pass your own function with "
                       f"--reward path/to/file.py:fn, where {SIGNATURE}")


def default_compute_score(data_source: str, solution_str: str, ground_truth: Optional[str],
                          extra_info: Optional[dict] = None) -> RewardResult:
    """The built-in rule reward for `data_source` (verl's names, plus 'gsm8k'/'arithmetic').

    Returns a float, or a dict with 'score' (arithmetic adds 'marker'). An unknown data_source raises
    RewardError listing the known ones.
    """
    fn = _BUILTIN.get(ALIASES.get(data_source, data_source))
    if fn is None:
        raise _unknown_source(data_source)
    res = fn(solution_str, ground_truth)
    return res if isinstance(res, dict) else float(res)


def ground_truth_problem(data_source: str, ground_truth: Optional[str]) -> Optional[str]:
    """Why the built-in reward of `data_source` could never give full credit against `ground_truth`
    (a phrase that follows "field 'answer' ..." for a present ground truth, a sentence for an
    absent one); None when it can, or when `data_source` has no built-in reward. The data loader
    asks this of every row, so a bad answer stops the run before training, not at its first step."""
    fn = _BUILTIN.get(ALIASES.get(data_source, data_source))
    if fn is None:
        return None
    if ground_truth is None:
        return (f"data_source {data_source!r} is scored against a reference answer, but there is none "
                "(data.answer_key=''); set data.answer_key to the answer column, or give these rows a "
                "data_source of your own and score them with --reward path/to/file.py:fn")
    if fn is gsm8k_score:
        if "#### " in ground_truth:
            return (f"holds a whole GSM8K solution ({_excerpt(ground_truth, 30)}); the gsm8k reward needs "
                    "the number alone: write the data with `edgerl data prepare gsm8k`")
        found = gsm8k_extract("#### " + ground_truth, "strict")
        if found != ground_truth:
            # verl's gsm8k reward compares text: the number after '#### ' in the response, commas
            # removed, must equal the ground truth exactly
            fix = f"write {found!r}" if found else "write the number alone, digits only, e.g. '72'"
            return (f"is {_excerpt(ground_truth, 30)}, which the gsm8k reward can never match: it compares "
                    f"the number after '#### ' in a response (commas removed) with it as text; {fix}")
    if fn is arithmetic_score and arithmetic_truth(ground_truth) is None:
        return (f"is {_excerpt(ground_truth, 30)}, which the arithmetic reward cannot compare: it "
                "compares numbers; write an integer or a decimal, such as 12 or 3.5")
    return None


def check_sources(data_sources: Iterable[str]) -> None:
    """Raise RewardError before training if any data_source has no built-in reward."""
    for source in sorted(set(data_sources)):
        if ALIASES.get(source, source) not in _BUILTIN:
            raise _unknown_source(source)


def load_reward_function(spec: str, timeout_s: Optional[float] = None, call_with: Any = None,
                         signature: Any = SIGNATURE, option: str = "--reward") -> UserFunction:
    """Load `path/to/file.py:fn` (the `--reward` option) into a process of its own, where every call
    runs contained (edgerl.rewards.contain: an exit, a hang past `timeout_s` seconds, a crash is one
    RewardError); check that fn accepts the keyword arguments `call_with` (None: verl's, with
    placeholder values), else a RewardError quoting `signature`."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s or not name or "/" in name or "\\" in name:
        raise RewardError(f"{option} {spec!r}: expected path/to/file.py:function_name")
    path = Path(path_s).expanduser()
    if not path.is_file():
        raise RewardError(f"{option} {spec!r}: no such file {path.resolve()}")
    return UserFunction(spec, path.resolve(), name, timeout_s, call_with, signature)


def import_function(spec: str, path_s: str, name: str, call_with: Optional[dict[str, Any]] = None,
                    signature: str = SIGNATURE) -> RewardFn:
    """Import `name` from the file `path_s` here (the worker process does; `load_reward_function` is
    the way in). Anything the import does, an exit included, becomes a RewardError."""
    path = Path(path_s)
    module_name = f"edgerl_user_reward_{abs(hash(str(path.resolve())))}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"not a Python file: {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # lets dataclasses/pickle in the user file find its module
        module_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: B036 - a file that exits or raises anything at import
        from edgerl.rewards.contain import describe
        sys.modules.pop(module_name, None)
        raise RewardError(f"--reward {spec!r}: importing {path} failed: {describe(e, str(path))}") from None
    if not hasattr(module, name):
        funcs = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module_name)
        raise RewardError(f"--reward {spec!r}: {path} has no '{name}'"
                          + (f"; functions defined there: {', '.join(funcs)}" if funcs else ""))
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"--reward {spec!r}: '{name}' in {path} is a {type(fn).__name__}, not a function")
    if call_with == "detect":   # reward.functions: the caller reads the signature (functions.signature_of)
        return fn
    try:
        inspect.signature(fn).bind(**(call_with if call_with is not None else VERL_CALL))
    except TypeError as e:
        which = "verl's keyword arguments" if call_with is None else f"the keyword arguments {', '.join(call_with)}"
        raise RewardError(f"--reward {spec!r}: '{name}' cannot be called with {which} ({e}); it must be "
                          f"{signature}") from None
    except ValueError:
        pass  # builtins without an inspectable signature: let the first call tell
    return fn


# --- batch scoring ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RewardItem:
    """One response to score: its prompt row's data_source, ground truth and extra_info, and the
    prompt's row in the data (named when the reward fails on it)."""
    data_source: str
    response: str
    ground_truth: Optional[str]
    extra: Optional[dict] = None
    row: Optional[int] = None


def _excerpt(text: Any, n: int = 80) -> str:
    s = str(text)
    return repr(s if len(s) <= n else "..." + s[-n:])


def sample_text(i: int, item: Any) -> str:
    """How an error names a sample: its place in the batch, its prompt's data row, what was scored."""
    row = getattr(item, "row", None)
    return (f"sample {i} of the batch ({'' if row is None else f'prompt row {row} of the data, '}data_source "
            f"{item.data_source!r}, response {_excerpt(item.response)}, ground truth {_excerpt(item.ground_truth, 40)})")


def _sample_error(i: int, item: Any, why: str) -> RewardError:
    return RewardError(f"reward failed on {sample_text(i, item)}: {why}")


def score_batch(reward_fn: RewardFn, items: Sequence[Any], timeout_s: Optional[float] = None
                ) -> tuple[list[float], dict[str, list[float]]]:
    """Score `items` (RewardItem or anything with data_source/response/ground_truth/extra).

    Returns (scores, components): components maps each extra numeric key of dict results to one value
    per item (NaN where an item's result lacks it). A user function is called through
    `edgerl.rewards.contain.call_user` (an exception, exit or overrun of `timeout_s` seconds is a
    RewardError naming the function and the sample, a signal raises Interrupted); edgerl's own
    `default_compute_score` is called directly, its errors naming the sample too. A result that is not
    a number or a dict with a 'score', or a score that is not finite or beyond +-MAX_ABS_REWARD, is a
    RewardError naming the sample; the original exception is chained.
    """
    scores: list[float] = []
    rows: list[dict[str, float]] = []
    who = getattr(reward_fn, "who", None) or f"reward function {getattr(reward_fn, '__qualname__', reward_fn)}"
    for i, item in enumerate(items):
        kw = dict(data_source=item.data_source, solution_str=item.response, ground_truth=item.ground_truth,
                  extra_info=item.extra)
        if reward_fn is default_compute_score:  # edgerl's own code: no timer, no signal handlers
            try:
                res = reward_fn(**kw)
            except Exception as e:
                raise _sample_error(i, item, f"{type(e).__name__}: {e}") from e
        else:
            res = call_user(reward_fn, who, lambda i=i, item=item: sample_text(i, item), timeout_s=timeout_s, **kw)
        try:
            value, extra = check_result(res)
        except ValueError as e:
            raise RewardError(f"{who} failed on {sample_text(i, item)}: {e}") from None
        scores.append(value)
        rows.append(extra)
    keys = sorted({k for r in rows for k in r})
    components = {k: [r.get(k, math.nan) for r in rows] for k in keys}
    return scores, components
