"""What serves the tools and the environment inside a worker process (edgerl.rewards.worker, loaded there
through edgerl.rewards.contain like a reward function): `handle(request) -> reply`, both plain data
(dicts of strings, numbers, lists).

    {"op": "setup", ...}   load the tools and the environment class, confine the process (guard.py);
                           -> {"schemas": [...], "fences": str} or {"fatal": str}
    {"op": "call", "name", "arguments", "hidden"}   one tool call -> {"content": str} or {"error": str}
    {"op": "reset", "episode", "row"}   a new environment for an episode -> {"observation": str | None}
    {"op": "step", "episode", "text"}   -> {"observation": str | None, "reward": float, "done": bool}
    {"op": "close", "episode"}

A tool that raises, overruns its time (SIGALRM here; the trainer stops a process that does not answer),
returns something that is not text or runs out of memory answers {"error": ...}: the model reads it as the
call's result. What the tool prints goes nowhere (the model sees what it returns). {"fatal": ...} is the
user's mistake (a tool file that does not import, an environment that breaks its protocol): the run stops
with it. Errors say `timeout: true` when the time limit stopped the code.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

_STATE: dict[str, Any] = {"tools": {}, "env_class": None, "episodes": {}, "timeout_s": 10.0, "max_chars": 4000}


class _Overran(BaseException):
    """The call's time limit (a BaseException: a tool's `except Exception` cannot swallow it)."""


class Fatal(Exception):
    """The user's setup is wrong: the run stops with this message."""


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _describe(e: BaseException) -> str:
    try:
        msg = str(e)
    except Exception:
        msg = "(its message could not be printed)"
    if isinstance(e, SystemExit):
        return f"the tool called sys.exit({e.code!r})"
    return type(e).__name__ + (f": {_short(msg)}" if msg else "")


def _load(spec: str, what: str) -> Any:
    """The object `name` of `path.py:name`."""
    path_s, _, name = spec.rpartition(":")
    path = Path(path_s)
    module_name = f"edgerl_user_tool_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"not a Python file: {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        except BaseException as e:  # noqa: B036 - a file that exits or raises anything at import
            sys.modules.pop(module_name, None)
            raise Fatal(f"{what} {spec!r}: importing {path} failed: {_describe(e)}") from None
    if not hasattr(module, name):
        raise Fatal(f"{what} {spec!r}: {path} has no {name!r}")
    return getattr(module, name)


def hidden_parameters(fn: Callable) -> list[str]:
    """A tool's keyword-only parameters: filled from the data row (verl's extra_info.tools_kwargs), never
    shown to the model."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def schema_of(fn: Callable, spec: str) -> dict:
    """transformers' JSON schema of `fn` (its name, docstring and type hints), its keyword-only parameters
    left out."""
    from transformers.utils import get_json_schema
    hidden = set(hidden_parameters(fn))
    target = fn
    if hidden:   # the schema of the visible signature: a stand-in function with it
        import typing
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        visible = [p for p in sig.parameters.values() if p.name not in hidden]

        def target(*args, **kwargs):   # noqa: ANN202 - never called
            raise AssertionError
        target.__name__, target.__doc__ = fn.__name__, fn.__doc__
        target.__signature__ = sig.replace(parameters=visible)
        target.__annotations__ = {k: v for k, v in hints.items() if k not in hidden}
    try:
        return get_json_schema(target)
    except Exception as e:
        raise Fatal(f"rollout.tools {spec!r}: its schema cannot be read from its signature and docstring "
                    f"({_short(str(e), 200)}); give every model-facing parameter a type hint and a line in the "
                    "docstring's Args: section (transformers' get_json_schema)") from None


def _setup(req: dict) -> dict:
    if req.get("schemas"):   # imported before the memory limit applies (the first worker alone reads schemas)
        from transformers.utils import get_json_schema  # noqa: F401
    from edgerl.agents import builtin
    from edgerl.agents.guard import confine
    folder = req["folder"]
    builtin.SETTINGS.update(folder=folder, timeout_s=req["timeout_s"], max_chars=req["max_chars"])
    _STATE.update(timeout_s=float(req["timeout_s"]), max_chars=int(req["max_chars"]))
    sys.dont_write_bytecode = True
    os.chdir(folder)
    os.environ.update(HOME=folder, TMPDIR=folder)
    null = os.open(os.devnull, os.O_WRONLY)   # what a tool prints goes nowhere (never the trainer's terminal)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    fences = confine(folder, int(req["memory_mb"]), int(req["file_mb"]))   # before the user's files import
    for spec in req["tools"]:
        fn = builtin.BUILTIN_TOOLS.get(spec) or _load(spec, "rollout.tools")
        if not callable(fn):
            raise Fatal(f"rollout.tools {spec!r} is a {type(fn).__name__}, not a function")
        name = getattr(fn, "__name__", spec)
        if name in _STATE["tools"]:
            raise Fatal(f"rollout.tools names two tools called {name!r}; each tool needs its own name")
        hidden = set(hidden_parameters(fn))
        schema = schema_of(fn, spec) if req.get("schemas") else None
        try:
            visible = {p for p in inspect.signature(fn).parameters if p not in hidden}
        except (TypeError, ValueError):
            visible = set()
        _STATE["tools"][name] = (fn, schema, visible, hidden)
    if req.get("environment"):
        cls = _load(req["environment"], "rollout.environment")
        missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
        if missing or not callable(cls):
            raise Fatal(f"rollout.environment {req['environment']!r} has no {' or '.join(missing) or 'constructor'}; "
                        "an environment is a class with reset(row) and step(text) (docs/agents.md)")
        _STATE["env_class"] = cls
    return {"schemas": [t[1] for t in _STATE["tools"].values()], "fences": fences}


def _limited(fn: Callable[[], Any]) -> Any:
    """fn() under the call's time limit: SIGALRM raises _Overran, again every 0.5 s should the code catch it."""
    def fire(_signum, _frame):
        raise _Overran()
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, _STATE["timeout_s"], 0.5)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def as_text(value: Any, max_chars: int) -> str:
    """What a tool returned, as the text the model reads: a string as it is, a number or JSON-like data as
    JSON; anything else is a TypeError. Text past `max_chars` is cut, with a note saying how much."""
    if isinstance(value, str):
        text = str.__str__(value)
    elif isinstance(value, bool) or value is None or (isinstance(value, (int, float)) and math.isfinite(value)):
        text = json.dumps(value)
    elif isinstance(value, (dict, list, tuple, int, float)):
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the tool returned a value of type {type(value).__name__} that is not JSON data "
                            f"({_short(str(e), 80)}); "
                            "return a string") from None
    else:
        raise TypeError(f"the tool returned a value of type {type(value).__name__}, not text; return a string")
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"
    return text


def _call(req: dict) -> dict:
    name, args = req["name"], req["arguments"]
    if name not in _STATE["tools"]:
        return {"error": f"there is no tool {name!r}; the tools are {', '.join(_STATE['tools']) or 'none'}"}
    fn, _, known, hidden = _STATE["tools"][name]
    unknown = [k for k in args if k not in known]
    if unknown:
        return {"error": f"{name} has no argument {unknown[0]!r}; its arguments are {', '.join(sorted(known)) or 'none'}"}
    extra = req.get("hidden") or {}
    wrong = [k for k in extra if k not in hidden]
    if wrong:
        raise Fatal(f"the data row gives tool {name!r} the argument {wrong[0]!r} (extra_info.tools_kwargs), which is "
                    f"not one of its keyword-only parameters ({', '.join(sorted(hidden)) or 'none'})")
    try:
        return {"content": as_text(_limited(lambda: fn(**args, **extra)), _STATE["max_chars"])}
    except _Overran:
        return {"error": f"the tool did not return within {_STATE['timeout_s']:g} s; it was stopped", "timeout": True}
    except MemoryError:
        return {"error": "the tool ran out of its memory limit"}
    except TimeoutError as e:   # e.g. the python tool's program ran past its time
        return {"error": _describe(e), "timeout": True}
    except BaseException as e:  # noqa: B036 - a tool may raise or exit with anything: the model reads it
        return {"error": _describe(e)}


def _observation(value: Any, what: str) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    raise Fatal(f"{what} returned a {type(value).__name__} as its observation; return a string or None")


def _env(req: dict) -> dict:
    op, episode = req["op"], req["episode"]
    spec = type(_STATE["env_class"]).__name__ if _STATE["env_class"] is None else _STATE["env_class"].__name__
    try:
        if op == "reset":
            env = _limited(_STATE["env_class"])
            _STATE["episodes"][episode] = env
            return {"observation": _observation(_limited(lambda: env.reset(req["row"])), f"{spec}.reset")}
        env = _STATE["episodes"].get(episode)
        if env is None:
            raise Fatal(f"{spec}: episode {episode} has no environment (its worker was restarted)")
        out = _limited(lambda: env.step(req["text"]))
    except _Overran:
        raise Fatal(f"environment {spec}.{op} did not return within {_STATE['timeout_s']:g} s (rollout.tool_timeout_s)") \
            from None
    except Fatal:
        raise
    except BaseException as e:  # noqa: B036 - the environment is the user's code: its failure stops the run
        raise Fatal(f"environment {spec}.{op} failed on episode {episode}: {_describe(e)}") from None
    if not (isinstance(out, tuple) and len(out) == 3):
        raise Fatal(f"{spec}.step returned {_short(repr(out), 80)}; it must return (observation, reward, done)")
    obs, reward, done = out
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) or abs(reward) > 1e6:
        raise Fatal(f"{spec}.step returned the reward {_short(repr(reward), 60)}; it must be a finite number within +-1e6")
    if not isinstance(done, bool):
        raise Fatal(f"{spec}.step returned done={_short(repr(done), 60)}; it must be True or False")
    return {"observation": _observation(obs, f"{spec}.step"), "reward": float(reward), "done": done}


def handle(request: dict) -> dict:
    """One request (see the module docstring); never raises."""
    try:
        op = request["op"]
        if op == "setup":
            return _setup(request)
        if op == "call":
            return _call(request)
        if op in ("reset", "step"):
            return _env(request)
        if op == "close":
            _STATE["episodes"].pop(request["episode"], None)
            return {}
        return {"fatal": f"unknown request {op!r}"}
    except Fatal as e:
        return {"fatal": str(e)}
    except BaseException as e:  # noqa: B036 - e.g. a MemoryError while building a reply
        return {"fatal": f"the tool worker failed: {_describe(e)}"}
