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
library's own SIGALRM timer (math_verify's) works there. It leads a process group of its own, stopped
whole, and speaks edgerl.rewards.wire (data, never pickle: a reply cannot run code here; the time limit
covers reading all of it). Any other callable runs in this process: on
the main thread under an interval timer (SIGALRM) and with raising signal handlers, elsewhere
unguarded. `check_result` checks what a reward returned: type, and range (|r| <= MAX_ABS_REWARD).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from edgerl.core.errors import RewardError
from edgerl.rewards import wire

# Rewards, advantages and value targets are float32 tensors: squares of values above ~1e19 overflow
# (3.4e38), and the mean of a batch loses the small differences GRPO compares long before that.
# A reward of a million is far beyond any sane scale, and a scaled reward trains the same.
MAX_ABS_REWARD = 1e6
# what a reward's reply holds as a number (wire.BigInt: an integer too large for a float, refused by the checks)
NUMBERS = (int, float, wire.BigInt)
# Importing a reward file may import torch or a tokenizer: allow a slow disk at least this long.
IMPORT_TIMEOUT_S = 300.0

Sample = Union[str, Callable[[], str]]


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while user code ran; the code was stopped. A BaseException, so that
    user code catching Exception cannot swallow it. `signal` is the signal's name; `elsewhere`: it
    reached another rank (torchrun), which said so (see other_ranks)."""

    def __init__(self, signal_name: str, who: str, elsewhere: bool = False):
        super().__init__(f"{signal_name} received while {who} ran")
        self.signal, self.who, self.elsewhere = signal_name, who, elsewhere


def _nowhere() -> Optional[str]:
    return None


# Under torchrun a signal may reach one rank only. The trainer sets this (other_ranks) to a function
# returning the signal another rank announced, or None: a call waiting on a reward function's process
# stops then too, as Interrupted, instead of waiting for code that may never return.
_elsewhere: Callable[[], Optional[str]] = _nowhere


def other_ranks(announced: Optional[Callable[[], Optional[str]]]) -> None:
    """Watch `announced` (edgerl.train.ranks.stopped_elsewhere) while waiting on a worker; None: stop."""
    global _elsewhere
    _elsewhere = announced or _nowhere


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
        bits = x.bit_length() if isinstance(x, (int, wire.BigInt)) else None
        size = f"an integer of {bits} bits" if bits is not None else f"a {wire.type_name(x)}"
        raise ValueError(f"{what} {size}, too large for a float; a reward must lie within "
                         f"+-{MAX_ABS_REWARD:g}") from None
    except (TypeError, ValueError):
        try:
            shown = _short(repr(x), 60)
        except Exception:
            shown = "(unprintable)"
        raise ValueError(f"{what} {wire.type_name(x)} {shown}, not a number") from None
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
            if k != "score" and isinstance(v, NUMBERS):
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


_LIVE: "weakref.WeakSet[UserFunction]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """The trainer is exiting: stop every worker still running, with its process group (a child a
    reward function left would otherwise hold the terminal's or a pipe's other end)."""
    for f in list(_LIVE):
        try:
            f.close()
        except Exception:
            pass


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
        self._request = 0
        self._start()
        limit = max(timeout_s or 0.0, IMPORT_TIMEOUT_S)
        reply = self._exchange(self.who, {"op": "load", "path": str(path), "name": name, "spec": spec,
                                          "sys_path": list(sys.path), "call_with": call_with, "signature": signature},
                               f"the import of {path.name}", limit,
                               f"importing {path} took longer than {limit:g} s, so its process was stopped; does the "
                               "file run something at import that does not end?")
        if reply[0] == "error" and len(reply) == 2 and isinstance(reply[1], str):
            self.close()
            raise RewardError(reply[1])
        loaded = reply[1] if reply[0] == "ok" and len(reply) == 2 else False
        if loaded is not None and not (isinstance(loaded, list) and len(loaded) == 2 and loaded[0] in ("verl", "trl")
                                       and (loaded[1] is None or isinstance(loaded[1], list))):
            self.close()
            raise self._malformed(self.who, f"the import of {path.name}", f"an answer to the import of {_short(repr(reply), 80)}")
        # call_with="detect": (kind, keyword arguments) of its signature
        self.loaded = None if loaded is None else (loaded[0], None if loaded[1] is None else tuple(loaded[1]))

    def _start(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        root = str(Path(__file__).resolve().parents[2])   # the folder holding the edgerl package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        try:
            # stdin is not the user's: a function that reads it gets EOF, not the trainer's input. A session
            # of its own: what the function starts is in its process group, stopped with it (_kill)
            self._proc = subprocess.Popen([sys.executable, "-m", "edgerl.rewards.worker", str(to_r), str(from_w)],
                                          pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)
        except OSError as e:
            for fd in (to_r, to_w, from_r, from_w):
                os.close(fd)
            raise RewardError(f"--reward {self.spec!r}: cannot start a process for it ({e})") from None
        os.close(to_r)
        os.close(from_w)
        os.set_blocking(to_w, False)   # a write waits within the call's deadline (wire.write_message)
        self._to, self._from = to_w, from_r
        _LIVE.add(self)

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _kill(self) -> Optional[int]:
        """Stop the process and every process of its group now; returns its exit status."""
        if self._proc is None:
            return None
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        try:
            # the group is the worker's pid (start_new_session); that number stays taken while a member
            # lives, so this reaches no other process even after the worker itself has exited
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for fd in (self._to, self._from):
            try:
                os.close(fd)
            except OSError:
                pass
        return code

    def close(self) -> None:
        """Stop the process and its group (it holds nothing to save)."""
        self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:
            pass

    def _malformed(self, who: str, sample: Sample, what: str) -> RewardError:
        self._kill()
        return _failure(who, sample, f"its process sent {what}, which is not a reply the protocol allows (did the "
                                     "function write to a file descriptor it does not own, or fork?); its process was "
                                     "stopped")

    def _exchange(self, who: str, msg: dict, sample: Sample, timeout_s: Optional[float],
                  overran: Optional[str] = None) -> list:
        """Send `msg`, return the reply (a list, as the worker sends it), all within `timeout_s`."""
        if self._proc is None:
            raise RewardError(f"{who} cannot be called: its process was stopped earlier in this run")
        try:
            body = wire.encode(msg)
        except (wire.ProtocolError, RecursionError) as e:
            raise RewardError(f"{who}: the arguments for {_text(sample)} cannot be sent to its process "
                              f"({'they hold ' + str(e) if isinstance(e, wire.ProtocolError) else 'nested too deeply'})"
                              ) from None
        self._request += 1
        request = self._request

        def waiting() -> bool:   # between the polls of a wait: another rank's signal, or the process gone
            other = _elsewhere()
            if other is not None:
                raise Interrupted(other, who, elsewhere=True)
            return self._alive()
        with signals_raise(who):
            try:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                wire.write_message(self._to, request, body, deadline, waiting)
                answered, reply = wire.read_message(self._from, deadline, waiting)
            except Interrupted:
                self._kill()
                raise
            except wire.TimedOut:
                self._kill()
                if overran is not None:
                    raise RewardError(f"--reward {self.spec!r}: {overran}") from None
                raise _timed_out(who, sample, timeout_s or 0.0, "its process was stopped") from None
            except (wire.PeerGone, OSError):
                code = self._kill()
                raise RewardError(f"{who} ended its process on {_text(sample)} ({_exit_words(code)}); a "
                                  "reward function must return a value (os._exit, a crash and a kill end it)") \
                    from None
            except wire.ProtocolError as e:
                raise self._malformed(who, sample, str(e)) from None
        if answered != request:
            raise self._malformed(who, sample, f"an answer to request {answered} while request {request} waited")
        if not (isinstance(reply, list) and reply and reply[0] in ("ok", "error", "raised")):
            raise self._malformed(who, sample, f"an answer of the wrong shape ({_short(repr(reply), 80)})")
        return reply

    def call(self, who: str, sample: Sample, args: tuple, kwargs: dict, timeout_s: Optional[float]) -> Any:
        """One call, contained (call_user's way in): `who` and `sample` name it in any error."""
        reply = self._exchange(who, {"op": "call", "args": list(args), "kwargs": kwargs}, sample, timeout_s)
        if reply[0] == "ok" and len(reply) == 2:
            return reply[1]
        if reply[0] != "raised" or len(reply) != 4 or not isinstance(reply[1], str):
            raise self._malformed(who, sample, f"an answer of the wrong shape ({_short(repr(reply), 80)})")
        raise _failure(who, sample, _short(reply[1], 400)) from _builtin_exception(reply[2], reply[3])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_user(self, self.who, "a call", *args, **kwargs)

    def __repr__(self) -> str:
        return f"UserFunction({self.spec!r})"


def _builtin_exception(name: Any, args: Any) -> Optional[BaseException]:
    """The built-in exception a worker named (its class and arguments are data), to chain to the
    trainer's error; None for anything else."""
    cls = getattr(builtins, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, Exception) and isinstance(args, list)):
        return None
    try:
        return cls(*args)
    except Exception:
        return None
