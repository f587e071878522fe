"""What the trainer and a reward worker (edgerl.rewards.worker) say to each other: data, never code.

A message is a header, `ERW1`, the request id (8 bytes) and the body's length (4 bytes, big-endian),
then the body: JSON of a tree made by `to_data`, which `from_data` turns back into Python values.
Nothing in it can run code when it is read (pickle can: a reply whose `__reduce__` calls os._exit
would end the trainer). The tree holds null, true, false, numbers, strings and lists as themselves;
every JSON object is a tag with one key:

    {"dict": [[key, value], ...]}       a dict (keys: str, int, float, bool or None)
    {"float": "nan" | "inf" | "-inf"}   a float JSON cannot write
    {"bigint": bits, "negative": b}     an integer too large for a float (10**400): read as BigInt
    {"bytes": "<base64>"}               bytes
    {"object": type name, "repr": r}    a value that is none of these (a worker's reply only): Opaque

A worker converts what a user's function returns with `to_data(value, user=True)`: a numpy array or
a torch tensor by its `tolist()` (a 0-d one is its number), a numpy scalar, a Fraction or anything else
with `__index__` or `__float__` by that, a value of any other type as an Opaque naming it. The trainer
sends only data (`user=False`: anything else is refused). `read_message` reads a whole message
before a deadline, so a false length, a torn message or a process that stopped writing cannot block
past it; anything that is not a message of this grammar is a ProtocolError saying what.
"""

from __future__ import annotations

import base64
import json
import math
import os
import select
import struct
import time
from typing import Any, Callable, Optional

HEADER = struct.Struct(">4sQI")
MAGIC = b"ERW1"
MAX_BODY = 64 << 20     # bytes: a batch of 65536 scores is about 1.5 MB of JSON
MAX_DEPTH = 64          # nesting of lists and dicts; a reward is a number or a dict of numbers
_POLL_S = 0.5           # a wait without a deadline wakes this often, so that signal handlers run


class ProtocolError(Exception):
    """A message that is not what the protocol allows; the text says what it was."""


class TimedOut(Exception):
    """The deadline passed before the whole message was read or written."""


class PeerGone(Exception):
    """The other process ended (end of file, a closed pipe, or it exited while a child of it held the pipe)."""


class BigInt:
    """An integer too large for a float, as a reply carries it: its size, not its digits."""

    def __init__(self, bits: int, negative: bool):
        self.bits, self.negative = bits, negative

    def bit_length(self) -> int:
        return self.bits

    def __float__(self) -> float:
        raise OverflowError("int too large to convert to float")

    def __repr__(self) -> str:
        return f"{'-' if self.negative else ''}<an integer of {self.bits} bits>"


class Opaque:
    """A value of a type the protocol does not carry (an object, a function), by its type's name and
    its repr (as the worker printed it, shortened)."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return self.text


def type_name(x: Any) -> str:
    """The name of x's type, as the user's code made it (an Opaque's own)."""
    return x.type_name if isinstance(x, Opaque) else type(x).__name__


def _short(s: str, n: int = 120) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n - 3] + "..."


# --- values <-> trees ------------------------------------------------------------------------------

def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def _int(x: int) -> Any:
    try:
        float(x)
    except OverflowError:
        return {"bigint": x.bit_length(), "negative": x < 0}
    return x


def _key(k: Any, user: bool) -> Any:
    if k is None or isinstance(k, (str, bool)):
        return k
    if isinstance(k, int):
        return int(k)
    if isinstance(k, float) and math.isfinite(k):
        return float(k)
    if user:
        return _short(str(k), 200)   # a reward's component names are logged as text anyway
    raise ProtocolError(f"a dict key of type {type(k).__name__}, which is not a string or a number")


def to_data(x: Any, user: bool = False, depth: int = 0) -> Any:
    """The tree of `x` (see the module docstring). `user`: x came from user code (a worker's reply),
    so a value of another type becomes an Opaque, and methods of x (tolist, __float__) may run;
    otherwise such a value is a ProtocolError naming its type."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"a value nested deeper than {MAX_DEPTH} levels")
    if x is None or isinstance(x, (bool, str)):
        return str(x) if isinstance(x, str) and type(x) is not str else x
    if isinstance(x, int):
        return _int(int(x))
    if isinstance(x, float):
        return _float(float(x))
    if isinstance(x, (list, tuple)):
        return [to_data(v, user, depth + 1) for v in x]
    if isinstance(x, dict):
        return {"dict": [[_key(k, user), to_data(v, user, depth + 1)] for k, v in x.items()]}
    if isinstance(x, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(x)).decode("ascii")}
    if not user:
        raise ProtocolError(f"a value of type {type(x).__name__}, which is not data (numbers, strings, bytes, lists, "
                            "dicts)")
    if callable(getattr(x, "tolist", None)):    # a numpy array or scalar, a torch tensor
        return to_data(x.tolist(), user, depth + 1)
    if hasattr(x, "__index__"):
        return _int(x.__index__())
    if hasattr(x, "__float__") and not isinstance(x, complex):
        return _float(float(x))
    try:
        text = _short(repr(x))
    except Exception:
        text = "(its repr failed)"
    return {"object": _short(type(x).__name__, 80), "repr": text}


def _tag(d: dict, depth: int) -> Any:
    if len(d) == 1 and isinstance(d.get("dict"), list):
        out = {}
        for pair in d["dict"]:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ProtocolError("a dict entry that is not a [key, value] pair")
            k = pair[0]
            if not (k is None or isinstance(k, (str, int, float))):
                raise ProtocolError(f"a dict key that is a {type(k).__name__}")
            out[k] = from_data(pair[1], depth + 1)
        return out
    if len(d) == 1 and d.get("float") in ("nan", "inf", "-inf"):
        return float(d["float"])
    if set(d) == {"bigint", "negative"} and type(d["bigint"]) is int and d["bigint"] > 0 \
            and isinstance(d["negative"], bool):
        return BigInt(d["bigint"], d["negative"])
    if len(d) == 1 and isinstance(d.get("bytes"), str):
        try:
            return base64.b64decode(d["bytes"].encode("ascii"), validate=True)
        except ValueError:
            raise ProtocolError("bytes that are not base64") from None
    if set(d) == {"object", "repr"} and isinstance(d["object"], str) and isinstance(d["repr"], str):
        return Opaque(_short(d["object"], 80), _short(d["repr"]))
    raise ProtocolError(f"an object with the keys {_short(', '.join(map(str, d)), 80)}, which is no tag of the protocol")


def from_data(t: Any, depth: int = 0) -> Any:
    """The Python value of a tree; ProtocolError for anything outside the grammar."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"a value nested deeper than {MAX_DEPTH} levels")
    if t is None or isinstance(t, (bool, str, int)):
        return t
    if isinstance(t, float):
        if not math.isfinite(t):
            raise ProtocolError("a non-finite number written as a JSON literal")
        return t
    if isinstance(t, list):
        return [from_data(v, depth + 1) for v in t]
    if isinstance(t, dict):
        return _tag(t, depth)
    raise ProtocolError(f"a {type(t).__name__}")


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"the JSON literal {name}")


def encode(x: Any, user: bool = False) -> bytes:
    """A message body: JSON of to_data(x), at most MAX_BODY bytes (else ProtocolError)."""
    body = json.dumps(to_data(x, user), allow_nan=False, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if len(body) > MAX_BODY:
        raise ProtocolError(f"a value of {len(body) / 2 ** 20:.0f} MiB as JSON, more than the {MAX_BODY >> 20} MiB a "
                            "message may hold")
    return body


def decode(body: bytes) -> Any:
    try:
        tree = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError) as e:   # JSONDecodeError, an integer of too many digits
        raise ProtocolError(f"a body that is not JSON ({_short(str(e), 80)})") from None
    except RecursionError:
        raise ProtocolError(f"a value nested deeper than {MAX_DEPTH} levels") from None
    return from_data(tree)


# --- framing over a pipe ---------------------------------------------------------------------------

def _wait(fd: int, events: int, deadline: Optional[float], alive: Optional[Callable[[], bool]]) -> None:
    """Until fd is ready for `events` (select.POLLIN / POLLOUT); TimedOut past the deadline; PeerGone
    when `alive()` says the other process ended while nothing is ready."""
    poller = select.poll()
    poller.register(fd, events)
    while True:
        left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if left <= 0:
            raise TimedOut()
        if poller.poll(left * 1000):
            return   # ready, or an error / hang-up that the read or write reports
        if alive is not None and not alive():
            if poller.poll(0):
                return
            raise PeerGone()


def read_exactly(fd: int, n: int, deadline: Optional[float], alive: Optional[Callable[[], bool]] = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        _wait(fd, select.POLLIN, deadline, alive)
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise PeerGone()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message(fd: int, deadline: Optional[float] = None, alive: Optional[Callable[[], bool]] = None
                 ) -> tuple[int, Any]:
    """(request id, value) of the next message on fd, read whole before `deadline` (time.monotonic();
    None waits as long as it takes). TimedOut, PeerGone, or ProtocolError for anything else."""
    head = read_exactly(fd, HEADER.size, deadline, alive)
    magic, request, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"a message that does not begin with {MAGIC.decode()} (it began with {head[:8]!r})")
    if length > MAX_BODY:
        raise ProtocolError(f"a length of {length} bytes, more than the {MAX_BODY >> 20} MiB a message may hold")
    return request, decode(read_exactly(fd, length, deadline, alive))


def write_message(fd: int, request: int, body: bytes, deadline: Optional[float] = None,
                  alive: Optional[Callable[[], bool]] = None) -> None:
    """Write one message before `deadline`; on a non-blocking fd a reader that stopped reading cannot
    block the writer past it."""
    data = memoryview(HEADER.pack(MAGIC, request, len(body)) + body)
    while data:
        _wait(fd, select.POLLOUT, deadline, alive)
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            continue
        except BrokenPipeError:
            raise PeerGone() from None
        data = data[n:]
