"""Calling code edgerl did not write (a reward function, a reward model's forward) so that it cannot
take the run down.

`call_user(fn, who, sample, *args, **kwargs)` is the one way in:
- any exception or exit of the code (any BaseException: SystemExit, a KeyboardInterrupt it raises
  itself, ...) becomes one RewardError naming `who` and `sample`; the trainer then saves the last
  completed step and stops (exit 2);
- SIGINT and SIGTERM are honoured at once, even while the code hangs: they raise `Interrupted`, and the
  trainer saves the last completed step and stops (exit 130);
- a time limit stops code that hangs, with the same guarantees as an exception.

A `UserFunction` (a reward function loaded from a file) runs in a process of its own (started with
`python -m edgerl.rewards.worker`): only a process can be stopped in the middle of anything, including
one C call that never returns to Python (9**9**9 on a model's output), `os._exit` or a crash, and a
library's own SIGALRM timer (math_verify's) works there. Any other callable runs in this process: on
the main thread under an interval timer (SIGALRM) and with raising signal handlers, elsewhere
unguarded. `check_result` checks what a reward returned: type, and range (|r| <= MAX_ABS_REWARD).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from edgerl.core.errors import RewardError

# Rewards, advantages and value targets are float32 tensors: squares of values above ~1e19 overflow
# (3.4e38), and the mean of a batch loses the small differences GRPO compares long before that.
# A reward of a million is far beyond any sane scale, and a scaled reward trains the same.
MAX_ABS_REWARD = 1e6
# Importing a reward file may import torch or a tokenizer: allow a slow disk at least this long.
IMPORT_TIMEOUT_S = 300.0

Sample = Union[str, Callable[[], str]]


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while user code ran; the code was stopped. A BaseException, so that
    user code catching Exception cannot swallow it. `signal` is the signal's name."""

    def __init__(self, signal_name: str, who: str):
        super().__init__(f"{signal_name} received while {who} ran")
        self.signal, self.who = signal_name, who


class _TimeUp(BaseException):
    """The in-process timer fired (a BaseException for the same reason as Interrupted)."""


def _text(sample: Sample) -> str:
    return sample() if callable(sample) else sample


def _short(s: str, n: int = 200) -> str:
    s = " ".join(s.split())  # one line
    return s if len(s) <= n else s[:n - 3] + "..."


def describe(e: BaseException, where: Optional[str] = None) -> str:
    """What the code did, in a phrase: 'exited with sys.exit(3)', "KeyError: 'x' (at f.py:12)". The
    place is the last line run in the file `where` (the user's), else the last line run."""
    if isinstance(e, SystemExit):
        what = f"exited with sys.exit({e.code!r})"
    elif isinstance(e, KeyboardInterrupt):
        what = "raised KeyboardInterrupt itself (no Ctrl-C was pressed)"
    else:
        try:
            msg = str(e)
        except Exception:  # a user exception whose __str__ fails
            msg = "(its message could not be printed)"
        what = type(e).__name__ + (f": {_short(msg)}" if msg else "")
    place, tb = None, e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if (where is None and not name.startswith("<")) or name == where:
            place = f"{Path(name).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return what + (f" (at {place})" if place else "")


def _failure(who: str, sample: Sample, why: str) -> RewardError:
    return RewardError(f"{who} failed on {_text(sample)}: {why}")


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_raise(who: str) -> Iterator[list[str]]:
    """While the block runs on the main thread, SIGINT and SIGTERM raise Interrupted at once (the
    trainer's own handlers only ask the step to finish, which code that hangs never does). Yields the
    names of the signals received, so that code which swallowed the exception is still stopped."""
    got: list[str] = []
    if not _on_main_thread():
        yield got
        return

    def handler(signum: int, _frame: Any) -> None:
        got.append(signal.Signals(signum).name)
        raise Interrupted(got[-1], who)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _alarm(timeout_s: Optional[float]) -> Iterator[list[bool]]:
    """SIGALRM raises _TimeUp after timeout_s and every 0.5 s after, should the code swallow one (main
    thread, Unix). Yields a flag list that says whether it fired."""
    fired: list[bool] = []
    if timeout_s is None or not _on_main_thread() or not hasattr(signal, "setitimer"):
        yield fired
        return

    def handler(_signum: int, _frame: Any) -> None:
        fired.append(True)
        raise _TimeUp()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.5)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)


def _timed_out(who: str, sample: Sample, timeout_s: float, how: str) -> RewardError:
    return RewardError(f"{who} did not return within reward.timeout_s={timeout_s:g} s on {_text(sample)}; {how}. "
                       "Make it faster, or raise reward.timeout_s")


def call_user(fn: Callable[..., Any], who: str, sample: Sample, *args: Any, timeout_s: Optional[float] = None,
              passthrough: tuple[type[BaseException], ...] = (), **kwargs: Any) -> Any:
    """fn(*args, **kwargs), contained: returns its result, or raises RewardError naming `who` (e.g.
    "reward function f in /x/f.py") and `sample` (text, or a function giving it only on failure), or
    Interrupted on SIGINT/SIGTERM. `timeout_s` bounds the call (None: no bound); a UserFunction
    carries its own (reward.timeout_s) unless one is given. Exceptions of the `passthrough` types
    (e.g. torch.OutOfMemoryError, which the trainer turns into advice) are raised as they are."""
    if isinstance(fn, UserFunction):
        return fn.call(who, sample, args, kwargs, fn.timeout_s if timeout_s is None else timeout_s)
    with signals_raise(who) as got, _alarm(timeout_s) as fired:
        try:
            result = fn(*args, **kwargs)
        except Interrupted:
            raise
        except _TimeUp:
            raise _timed_out(who, sample, timeout_s or 0.0, "it was stopped") from None
        except passthrough:
            raise
        except BaseException as e:
            if fired:  # the code caught the timer's exception and failed otherwise
                raise _timed_out(who, sample, timeout_s or 0.0, "it was stopped") from None
            raise _failure(who, sample, describe(e)) from e
    if got:  # the code swallowed Interrupted and returned
        raise Interrupted(got[0], who)
    if fired:
        raise _timed_out(who, sample, timeout_s or 0.0, "it swallowed the stop and returned late")
    return result


# --- what a reward returned -----------------------------------------------------------------------

def _number(x: Any, what: str) -> float:
    """float(x) for a reward value, or ValueError saying why it is not one."""
    if isinstance(x, (str, bytes)) or x is None:
        raise ValueError(f"{what} {_short(repr(x), 60)}; expected a float or a dict with a 'score' key")
    try:
        value = float(x)
    except OverflowError:
        bits = x.bit_length() if isinstance(x, int) else None
        size = f"an integer of {bits} bits" if bits is not None else f"a {type(x).__name__}"
        raise ValueError(f"{what} {size}, too large for a float; a reward must lie within "
                         f"+-{MAX_ABS_REWARD:g}") from None
    except (TypeError, ValueError):
        try:
            shown = _short(repr(x), 60)
        except Exception:
            shown = "(unprintable)"
        raise ValueError(f"{what} {type(x).__name__} {shown}, not a number") from None
    return value


def _in_range(value: float, what: str, nan_ok: bool = False) -> float:
    if math.isnan(value) and nan_ok:
        return value
    if not math.isfinite(value):
        raise ValueError(f"{what} a non-finite score {value}")
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"{what} {value:g}, outside +-{MAX_ABS_REWARD:g}, the range a reward may take (edgerl "
                         "computes advantages in float32, where larger values overflow or lose precision); "
                         "scale it down")
    return value


def check_result(res: Any) -> tuple[float, dict[str, float]]:
    """(score, other numeric keys) of what a reward function returned: a number, or a dict with a
    'score'. Raises ValueError saying what is wrong: no 'score', not a number, an integer too large
    for a float, a non-finite score, or |score| > MAX_ABS_REWARD. Components must be numbers in the
    same range, or NaN (logged as missing)."""
    extra: dict[str, float] = {}
    if isinstance(res, dict):
        if "score" not in res:
            keys = ", ".join(_short(str(k), 40) for k in list(res)[:20])
            raise ValueError(f"the result dict has no 'score' key (keys: {keys})")
        for k, v in res.items():
            if k != "score" and isinstance(v, (int, float)):
                extra[str(k)] = _in_range(_number(v, f"returned component {k!r} ="), f"returned component {k!r} =",
                                          nan_ok=True)
        res = res["score"]
    return _in_range(_number(res, "returned"), "returned"), extra


# --- a function in a process of its own -------------------------------------------------------------

def _exit_words(code: Optional[int]) -> str:
    if code is None:
        return "it did not exit"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class UserFunction:
    """A function `name` of the file `path`, imported and called in a worker process (see the module
    docstring). Calls are contained as `call_user`'s; calling the object is `call_user(self, ...)`."""

    def __init__(self, spec: str, path: Path, name: str, timeout_s: Optional[float] = None,
                 call_with: Optional[dict[str, Any]] = None, signature: Optional[str] = None):
        """Start the process and import the function there; `call_with` (keyword arguments) must bind
        to its signature, else RewardError quoting `signature` (by default verl's, see rules.py)."""
        self.spec, self.path, self.name, self.timeout_s = spec, path, name, timeout_s
        self.who = f"reward function {name} in {path}"
        self._proc: Optional[subprocess.Popen] = None
        self._start()
        limit = max(timeout_s or 0.0, IMPORT_TIMEOUT_S)
        reply = self._exchange(self.who, ("load", str(path), name, spec, list(sys.path), call_with, signature),
                               f"the import of {path.name}", limit,
                               f"importing {path} took longer than {limit:g} s, so its process was stopped; does the "
                               "file run something at import that does not end?")
        if reply[0] != "ok":
            self.close()
            raise RewardError(reply[1])
        self.loaded = reply[1]   # call_with="detect": (kind, keyword arguments) of its signature

    def _start(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        root = str(Path(__file__).resolve().parents[2])   # the folder holding the edgerl package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        try:
            # stdin is not the user's: a function that reads it gets EOF, not the trainer's input
            self._proc = subprocess.Popen([sys.executable, "-m", "edgerl.rewards.worker", str(to_r), str(from_w)],
                                          pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            for fd in (to_r, to_w, from_r, from_w):
                os.close(fd)
            raise RewardError(f"--reward {self.spec!r}: cannot start a process for it ({e})") from None
        os.close(to_r)
        os.close(from_w)
        self._to, self._from = Connection(to_w, readable=False), Connection(from_r, writable=False)

    def _kill(self) -> Optional[int]:
        """Stop the process now; returns its exit status."""
        if self._proc is None:
            return None
        proc, self._proc = self._proc, None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        self._to.close()
        self._from.close()
        return code

    def close(self) -> None:
        """Stop the process (it holds nothing to save)."""
        self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:
            pass

    def _exchange(self, who: str, msg: tuple, sample: Sample, timeout_s: Optional[float],
                  overran: Optional[str] = None) -> tuple:
        if self._proc is None:
            raise RewardError(f"{who} cannot be called: its process was stopped earlier in this run")
        with signals_raise(who):
            try:
                try:
                    self._to.send(msg)
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    raise RewardError(f"{who}: the arguments for {_text(sample)} cannot be sent to its "
                                      f"process ({type(e).__name__}: {e})") from None
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                # short waits: the deadline is checked, and a signal handler runs, between them
                while not self._from.poll(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
                    if deadline is not None and time.monotonic() >= deadline:
                        self._kill()
                        if overran is not None:
                            raise RewardError(f"--reward {self.spec!r}: {overran}")
                        raise _timed_out(who, sample, timeout_s or 0.0, "its process was stopped")
                reply = self._from.recv_bytes()
            except Interrupted:
                self._kill()
                raise
            except (EOFError, OSError):
                code = self._kill()
                raise RewardError(f"{who} ended its process on {_text(sample)} ({_exit_words(code)}); a "
                                  "reward function must return a value (os._exit, a crash and a kill end it)") \
                    from None
        try:
            return pickle.loads(reply)
        except Exception as e:  # e.g. an instance of a class defined in the reward file
            raise _failure(who, sample, f"returned a value the trainer cannot read ({type(e).__name__}: "
                                        f"{_short(str(e), 80)}); return a float or a dict of floats") from None

    def call(self, who: str, sample: Sample, args: tuple, kwargs: dict, timeout_s: Optional[float]) -> Any:
        """One call, contained (call_user's way in): `who` and `sample` name it in any error."""
        reply = self._exchange(who, ("call", args, kwargs), sample, timeout_s)
        if reply[0] == "ok":
            return reply[1]
        cause = None
        if reply[2] is not None:
            try:
                cause = pickle.loads(reply[2])
            except Exception:
                cause = None
        raise _failure(who, sample, reply[1]) from cause

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_user(self, self.who, "a call", *args, **kwargs)

    def __repr__(self) -> str:
        return f"UserFunction({self.spec!r})"
