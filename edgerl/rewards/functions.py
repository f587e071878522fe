"""`reward.functions` with `reward.weights`: load each (a built-in name or 'path/to/file.py:fn'), call
it on a batch, check what it returned, and sum the weighted scores.

Two signatures are accepted for a user function; which one is read from its parameters, or from an
attribute `fn.reward_signature = "verl"` or `"trl"` that says it outright:

    verl, per sample:  fn(data_source, solution_str, ground_truth, extra_info) -> float | dict with 'score'
    TRL, batched:      fn(prompts, completions, **kwargs) -> list[float | None]

The batched call gets keyword arguments only: `prompts` (as the data holds them: strings or chat
lists), `completions` (strings, or [{"role": "assistant", "content": ...}] for chat prompts, as TRL
passes them), `completion_ids`, `ground_truth`, `data_source`, `extra_info`, and the answer column
again under its own name (data.answer_key 'solution' -> `solution=`). A function without **kwargs
gets only the arguments it names. A None in its list means "does not apply to this completion" (TRL's
convention): it adds nothing to the sum and is left out of that function's mean.

Every call into a reward function goes through `call_reward`; every result through the checks here,
so that a failure or a wrong return is one RewardError naming the function.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from edgerl.core.errors import RewardError
from edgerl.rewards.builtins import BUILTIN_REWARDS, RewardRow
from edgerl.rewards.contain import MAX_ABS_REWARD, NUMBERS
from edgerl.rewards.wire import type_name
from edgerl.rewards.rules import load_reward_function

VERL_SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict with a 'score' key"
TRL_SIGNATURE = "fn(prompts, completions, **kwargs) -> list[float]"
BATCHED_ARGS = ("prompts", "completions", "completion_ids", "ground_truth", "data_source", "extra_info")
RESERVED_NAMES = ("mean", "std", "model", "reward_model", "overlong_penalty")   # other reward/* metrics


@dataclass
class RewardFunction:
    name: str                 # reward/<name> in the metrics
    spec: str                 # as the config names it
    fn: Callable[..., Any]
    kind: str                 # "builtin" | "verl" | "trl"
    weight: float = 1.0
    accepts: Optional[tuple[str, ...]] = None   # trl: the keyword arguments it takes; None: any (**kwargs)

    def describe(self) -> str:
        how = {"builtin": "built-in", "verl": "verl's per-sample signature", "trl": "TRL's batched signature"}
        return f"{self.name} (weight {self.weight:g}; {how[self.kind]})"


@dataclass
class RewardScores:
    """Scores of a batch: the weighted sum per response, each function's own values (NaN where a
    batched function returned None) and the extra numeric keys of dict results."""
    total: list[float]
    by_function: dict[str, list[float]] = field(default_factory=dict)
    components: dict[str, list[float]] = field(default_factory=dict)


def call_reward(fn: Callable[..., Any], name: str, where: Callable[[], str], **kwargs: Any) -> Any:
    """The one place edgerl calls a reward function, through edgerl.rewards.contain.call_user: any
    exception or exit inside it becomes a RewardError naming the function and `where()` (the sample or the
    batch); a user's function runs in its own process under reward.timeout_s, and Ctrl-C or SIGTERM
    stops it at once (Interrupted)."""
    from edgerl.rewards.contain import UserFunction, call_user
    if isinstance(fn, UserFunction):
        return call_user(fn, f"reward function {name} in {fn.path}",
                         lambda: where().removeprefix("on ").removeprefix("for "),
                         **kwargs)
    try:   # edgerl's own built-ins, in this process
        return fn(**kwargs)
    except (Exception, SystemExit) as e:
        raise RewardError(f"reward function {name} failed {where()}: {type(e).__name__}: {e}") from e


# --- loading --------------------------------------------------------------------------------------

def _contained(spec: str, option: str, timeout_s: Optional[float], answer_arg: Optional[str]) -> Any:
    """`path/to/file.py:function` imported in a process of its own, its signature read there."""
    try:
        return load_reward_function(spec, timeout_s, "detect", (f"{option} {spec!r}", answer_arg), option)
    except RewardError as e:   # its messages name --reward; here the key is reward.functions[i]
        raise RewardError(str(e).replace(f"--reward {spec!r}", f"{option} {spec!r}")) from None


def signature_of(fn: Callable[..., Any], label: str, answer_arg: Optional[str] = None
                 ) -> tuple[str, Optional[tuple[str, ...]]]:
    """("verl" | "trl", the keyword arguments a batched function takes, None for **kwargs): from
    `fn.reward_signature` when set, else from the parameter names. RewardError when neither fits."""
    marker = getattr(fn, "reward_signature", None)
    if marker is not None and marker not in ("verl", "trl"):
        raise RewardError(f"{label}: reward_signature = {marker!r}; it must be 'verl' ({VERL_SIGNATURE}) or 'trl' "
                          f"({TRL_SIGNATURE})")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin without an inspectable signature: the marker decides
        return marker or "verl", None
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    kind = marker or ("verl" if "solution_str" in names else "trl" if "completions" in names else None)
    if kind is None:
        raise RewardError(f"{label} takes ({', '.join(params)}); a reward function takes verl's per-sample "
                          f"arguments, {VERL_SIGNATURE}, or TRL's batched ones, {TRL_SIGNATURE}: name its "
                          "parameters so, or set fn.reward_signature = 'verl' or 'trl'")
    given = ("data_source", "solution_str", "ground_truth", "extra_info") if kind == "verl" else \
        BATCHED_ARGS + ((answer_arg,) if answer_arg else ())
    needed = [n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
              and n not in given]
    if needed:
        raise RewardError(f"{label} needs the argument(s) {', '.join(needed)}, which edgerl does not pass; "
                          f"{'verl' if kind == 'verl' else 'a batched'} function gets {', '.join(given)}"
                          + ("" if kind == "verl" else " (by keyword)"))
    if kind == "verl":
        return kind, None
    keyword = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return kind, None if keyword else tuple(n for n in names if n in given)


def answer_argument(answer_key: str) -> Optional[str]:
    """The name a batched function gets the answer column under (data.answer_key's last part)."""
    last = answer_key.rsplit(".", 1)[-1] if answer_key else ""
    return last if last.isidentifier() and last not in BATCHED_ARGS + ("prompts", "completions") else None


def load_functions(specs: Sequence[str], weights: Optional[Sequence[float]], answer_key: str = "",
                   timeout_s: Optional[float] = None) -> list[RewardFunction]:
    """The reward functions of reward.functions / reward.weights, loaded and checked (RewardError). A
    user's function is imported and called in a process of its own (edgerl.rewards.contain.UserFunction),
    each call bounded by `timeout_s` (None: no bound); edgerl's built-ins run here."""
    out: list[RewardFunction] = []
    weights = list(weights) if weights is not None else [1.0] * len(specs)
    for i, (spec, w) in enumerate(zip(specs, weights)):
        if spec in BUILTIN_REWARDS:
            fn, kind, accepts, base = BUILTIN_REWARDS[spec][0], "builtin", None, spec
        else:
            option = f"reward.functions[{i}]"
            fn = _contained(spec, option, timeout_s, answer_argument(answer_key))
            base = spec.rpartition(":")[2]
            kind, accepts = fn.loaded
        name, k = base, 2
        while name in RESERVED_NAMES or name in (f.name for f in out):
            name, k = f"{base}_{k}", k + 1
        out.append(RewardFunction(name, spec, fn, kind, float(w), accepts))
    return out


# --- calling and checking --------------------------------------------------------------------------

def _excerpt(text: Any, n: int = 80) -> str:
    s = str(text)
    return repr(s if len(s) <= n else "..." + s[-n:])


def sample_text(i: int, row: RewardRow) -> str:
    return (f"on sample {i} of the batch (data_source {row.data_source!r}, response {_excerpt(row.response)}, "
            f"ground truth {_excerpt(row.ground_truth, 40)})")


def _per_sample(f: RewardFunction, rows: Sequence[RewardRow]) -> tuple[list[float], list[dict[str, float]]]:
    values, extras = [], []
    for i, row in enumerate(rows):
        where = lambda i=i, row=row: sample_text(i, row)   # noqa: E731  (built only for an error)
        if f.kind == "builtin":
            res = call_reward(f.fn, f.name, where, row=row)
        else:
            res = call_reward(f.fn, f.name, where, data_source=row.data_source, solution_str=row.response,
                              ground_truth=row.ground_truth, extra_info=row.extra)
        extra: dict[str, float] = {}
        if isinstance(res, dict):
            if "score" not in res:
                raise RewardError(f"reward function {f.name} returned a dict without a 'score' key (keys: "
                                  f"{', '.join(map(str, res))}) {where()}")
            # its other numeric keys are components: in the same range, or NaN (logged as missing)
            extra = {str(k): _number(v, f, where, f"component {str(k)!r} =", nan_ok=True) for k, v in res.items()
                     if k != "score" and isinstance(v, NUMBERS) and not isinstance(v, bool)}
            res = res["score"]
        values.append(_number(res, f, where))
        extras.append(extra)
    return values, extras


def _number(value: Any, f: RewardFunction, where: Callable[[], str], what: str = "", nan_ok: bool = False) -> float:
    """A value a function returned (`what` names a dict component) as a float within +-MAX_ABS_REWARD."""
    said = f"reward function {f.name} returned {what + ' ' if what else ''}"
    if isinstance(value, (str, bytes)) or value is None or not isinstance(value, NUMBERS) \
            and not hasattr(value, "__float__"):
        raise RewardError(f"{said}{type_name(value)} {_excerpt(value, 40)} {where()}; it must return a number")
    try:
        x = float(value)
    except OverflowError:
        raise RewardError(f"{said}an integer of {value.bit_length()} bits {where()}, too large for a float; return a "
                          f"number within +-{MAX_ABS_REWARD:g}") from None
    except (TypeError, ValueError) as e:
        raise RewardError(f"{said}{type_name(value)} {_excerpt(value, 40)} {where()}, not a number") from e
    if math.isnan(x) and nan_ok:
        return x
    if not math.isfinite(x):
        raise RewardError(f"{said}{x} {where()}; a reward must be a finite number")
    if abs(x) > MAX_ABS_REWARD:   # float32 rewards and their group statistics lose everything beyond it
        raise RewardError(f"{said}{x:g} {where()}; a reward must be within +-{MAX_ABS_REWARD:g} (scale it down: the "
                          "advantages are normalised anyway)")
    return x


def _batched(f: RewardFunction, rows: Sequence[RewardRow], answer_arg: Optional[str]) -> list[float]:
    chat = [isinstance(r.prompt, list) for r in rows]
    kwargs: dict[str, Any] = {
        "prompts": [r.prompt if r.prompt is not None else r.prompt_text for r in rows],
        "completions": [[{"role": "assistant", "content": r.response}] if c else r.response
                        for r, c in zip(rows, chat)],
        "completion_ids": [list(r.response_ids) for r in rows], "ground_truth": [r.ground_truth for r in rows],
        "data_source": [r.data_source for r in rows], "extra_info": [r.extra for r in rows]}
    if answer_arg:
        kwargs[answer_arg] = kwargs["ground_truth"]
    if f.accepts is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in f.accepts}
    n = len(rows)
    batch = lambda: f"on a batch of {n} completions"   # noqa: E731
    res = call_reward(f.fn, f.name, batch, **kwargs)
    # its process sent a numpy array or a tensor as a list (0-d: its one number; edgerl.rewards.wire)
    if not isinstance(res, (list, tuple)):
        what = (f"one number, {res!r} (a 0-d array or tensor is one number)," if isinstance(res, NUMBERS)
                else f"{type_name(res)} {_excerpt(res, 40)}")
        raise RewardError(f"reward function {f.name} returned {what} {batch()}; a "
                          f"batched function ({TRL_SIGNATURE}) returns one float per completion: a list, or a 1-d "
                          "array or tensor")
    if len(res) != n:
        raise RewardError(f"reward function {f.name} returned {len(res)} value(s) {batch()}; it must return one "
                          "per completion")
    return [math.nan if v is None else _number(v, f, lambda i=i: f"for completion {i} of a batch of {n}")
            for i, v in enumerate(res)]


def score(functions: Sequence[RewardFunction], rows: Sequence[RewardRow], answer_key: str = "") -> RewardScores:
    """Every function on `rows`, checked, and their weighted sum (None/NaN of a batched function adds 0),
    which must lie within +-MAX_ABS_REWARD as each term does (RewardError naming the sample)."""
    total = [0.0] * len(rows)
    out = RewardScores(total)
    answer_arg = answer_argument(answer_key)
    for f in functions:
        if f.kind == "trl":
            values, extras = _batched(f, rows, answer_arg), []
        else:
            values, extras = _per_sample(f, rows)
        out.by_function[f.name] = values
        for i, v in enumerate(values):
            if not math.isnan(v):
                total[i] += f.weight * v
        for k in sorted({k for e in extras for k in e}):
            key = k if k not in out.components else f"{f.name}.{k}"
            out.components[key] = [e.get(k, math.nan) for e in extras]
    for i, t in enumerate(total):
        terms = [f"{f.weight:g} x {out.by_function[f.name][i]:g} ({f.name})" for f in functions
                 if not math.isnan(out.by_function[f.name][i])]
        check_total(t, " + ".join(terms) or "0", lambda i=i: sample_text(i, rows[i]), "reward.weights")
    return out


def check_total(total: float, terms: str, where: Callable[[], str], fix: str) -> None:
    """RewardError when a sample's weighted reward (`terms`, written out) is not finite or beyond
    +-MAX_ABS_REWARD: each term is within the bound, but weights or penalties can carry the sum past it."""
    if math.isfinite(total) and abs(total) <= MAX_ABS_REWARD:
        return
    raise RewardError(f"the weighted reward {total:g} = {terms} {where()} is outside +-{MAX_ABS_REWARD:g}, the range a "
                      f"reward may take (edgerl computes advantages in float32); lower {fix}")
