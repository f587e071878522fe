"""The process a user's reward function runs in: `python -m edgerl.rewards.worker FD_IN FD_OUT`,
started by `edgerl.rewards.contain.UserFunction`, which it answers over two pipes in the format of
edgerl.rewards.wire (data, never pickle), each reply carrying its request's id.

Requests: {"op": "load", path, name, spec, sys_path, call_with, signature} imports the function;
{"op": "call", args, kwargs} calls it. Replies: ["ok", value] and ["error", message] for a load;
["ok", value] or ["raised", what happened, the exception's class when it is a built-in one, its
arguments] for a call. Any exception or exit of the user's code is answered, never fatal; the
trainer stops this process (and its process group: it leads a session of its own, so the children
the function starts die with it) when a call overruns or the run ends. It ignores SIGINT and SIGTERM
(the trainer decides) and dies with the trainer. A process forked by the function that returns into
this loop exits at once, without answering: only the process the trainer started speaks.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from edgerl.rewards import wire


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the trainer dies, even mid-call (a hung call never reads the
    pipe's end-of-file). Elsewhere the end of file stops it between calls."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raised(e: BaseException, where: str) -> list:
    from edgerl.rewards.contain import describe
    what, name, args = describe(e, where), None, None
    if type(e).__module__ == "builtins" and not isinstance(e, (SystemExit, KeyboardInterrupt)):
        try:  # the trainer chains a new one to its error; a user-defined class has no meaning there
            args = wire.to_data(list(e.args))
            name = type(e).__name__
        except wire.ProtocolError:
            name = args = None
    return ["raised", what, name, args]


def _answer(fn: Any, msg: dict, where: str) -> list:
    try:
        value = fn(*msg["args"], **msg["kwargs"])
    except BaseException as e:  # noqa: B036 - the user's code may exit or raise anything
        return _raised(e, where)
    return ["ok", value]


def _load(msg: dict) -> tuple[Any, list]:
    from edgerl.rewards.rules import SIGNATURE, RewardError, import_function
    sys.path[:] = msg["sys_path"]  # the trainer's import path, so the file imports what it would there
    spec, path, name, call_with, signature = (msg[k] for k in ("spec", "path", "name", "call_with", "signature"))
    try:
        if call_with == "detect":   # reward.functions: verl's or TRL's signature, read here
            from edgerl.rewards.functions import signature_of
            label, answer_arg = signature
            fn = import_function(spec, path, name, "detect")
            return fn, ["ok", list(signature_of(fn, label, answer_arg))]
        return import_function(spec, path, name, call_with, signature or SIGNATURE), ["ok", None]
    except RewardError as e:
        return None, ["error", str(e)]


def _body(reply: list, me: int, where: str) -> bytes:
    """The reply as a message body; converting the value runs the user's code (tolist, __float__,
    __repr__), so a failure there is the function's, and a fork there exits as in serve."""
    try:
        body = wire.encode(reply, user=True)
    except wire.ProtocolError as e:
        body = wire.encode(["raised", f"returned {e}; return a float or a dict of floats", None, None])
    except BaseException as e:  # noqa: B036 - the value's own methods may raise or exit
        if os.getpid() != me:
            os._exit(0)
        from edgerl.rewards.contain import describe
        body = wire.encode(["raised", f"returned a {type(reply[1]).__name__} that cannot be read as a number "
                                      f"({describe(e, where)})", None, None])
    if os.getpid() != me:
        os._exit(0)
    return body


def serve(fd_in: int, fd_out: int) -> None:
    me = os.getpid()
    fn, where = None, ""
    while True:
        try:
            request, msg = wire.read_message(fd_in)
        except (wire.PeerGone, OSError):
            return  # the trainer closed the pipe
        if msg["op"] == "load":
            where = str(msg["path"])
            fn, reply = _load(msg)
        else:
            reply = _answer(fn, msg, where)
        if os.getpid() != me:   # a child the function forked, returning here: only the worker answers
            os._exit(0)
        try:
            wire.write_message(fd_out, request, _body(reply, me, where))
        except (wire.PeerGone, OSError):
            return


def main(argv: list[str]) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    _die_with_parent()
    try:
        serve(int(argv[0]), int(argv[1]))
    except BaseException:  # noqa: B036 - a request it cannot read: the trainer sees the process end
        os._exit(70)


if __name__ == "__main__":
    main(sys.argv[1:])
