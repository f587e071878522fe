"""The process a user's reward function runs in: `python -m edgerl.rewards.worker FD_IN FD_OUT`,
started by `edgerl.rewards.contain.UserFunction`, which it answers over two pipes.

Requests: ("load", path, name, spec, sys.path, call_with, signature) imports the function; ("call", args, kwargs) calls it.
Replies: ("ok", value), ("error", message) for a load, ("raised", what happened, the pickled
exception when it is a built-in one) for a call. Any exception or exit of the user's code is answered,
never fatal; the trainer stops this process when a call overruns or the run ends. It ignores SIGINT
and SIGTERM (a Ctrl-C reaches the whole process group: the trainer decides) and dies with the trainer.
"""

from __future__ import annotations

import pickle
import signal
import sys
from multiprocessing.connection import Connection


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the trainer dies, even mid-call (a hung call never reads the
    pipe's end-of-file). Elsewhere the end of file stops it between calls."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raised(e: BaseException, where: str) -> tuple:
    from edgerl.rewards.contain import describe
    what, exc = describe(e, where), None
    if type(e).__module__ == "builtins" and not isinstance(e, (SystemExit, KeyboardInterrupt)):
        try:  # the trainer chains it to its error; a user-defined class would not unpickle there
            exc = pickle.dumps(e.with_traceback(None))
        except Exception:
            exc = None
    return ("raised", what, exc)


def serve(inbox: Connection, outbox: Connection) -> None:
    from edgerl.rewards.rules import SIGNATURE, RewardError, import_function
    fn, where = None, ""
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return  # the trainer closed the pipe
        if msg[0] == "load":
            _, path, name, spec, path_list, call_with, signature = msg
            sys.path[:] = path_list  # the trainer's import path, so the file imports what it would there
            where = str(path)
            try:
                if call_with == "detect":   # reward.functions: verl's or TRL's signature, read here
                    from edgerl.rewards.functions import signature_of
                    label, answer_arg = signature
                    fn = import_function(spec, path, name, "detect")
                    reply: tuple = ("ok", signature_of(fn, label, answer_arg))
                else:
                    fn = import_function(spec, path, name, call_with, signature or SIGNATURE)
                    reply = ("ok", None)
            except RewardError as e:
                reply = ("error", str(e))
        else:
            _, args, kwargs = msg
            try:
                reply = ("ok", fn(*args, **kwargs))
            except BaseException as e:  # noqa: B036 - the user's code may exit or raise anything
                reply = _raised(e, where)
        try:
            outbox.send(reply)
        except Exception as e:  # the value cannot be pickled
            outbox.send(("raised", f"returned a {type(reply[1]).__name__}, which cannot be sent back to the trainer "
                                   f"({type(e).__name__}); return a float or a dict of floats", None))


def main(argv: list[str]) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    _die_with_parent()
    serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False))


if __name__ == "__main__":
    main(sys.argv[1:])
