"""The built-in tools, named in `rollout.tools` by their names here. They run in the tool worker
(host.py), confined as a user's tool is; their signatures and docstrings are their schemas."""

from __future__ import annotations

import ast
import operator
import os
import select
import subprocess
import sys
import time
from pathlib import Path

# set by host.py at setup: the worker's scratch folder, the time one call may take, the output kept
SETTINGS = {"folder": ".", "timeout_s": 10.0, "max_chars": 4000}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000        # 9**9**9 would compute for hours: exponents stay small
MAX_MAGNITUDE = 10 ** 100  # numbers beyond this are an error, not a 10,000-digit answer


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large (at most {MAX_EXPONENT})")
        out = _BINARY[type(node.op)](left, right)
        if isinstance(out, complex):
            raise ValueError("the result is not a real number")
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return out
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic; use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses, e.g. (12 + 30) * 4 / 3.

    Args:
        expression: the arithmetic expression to evaluate
    """
    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as an arithmetic expression") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))   # 84 / 2 is 42, as a person writes it
    return repr(value)


# The child interpreter of `python`: confined like the worker (its Landlock rules are inherited; the audit
# hook is not, so it is installed again), then it runs the program read from stdin as __main__.
_CHILD = ("import sys\nfrom edgerl.agents.guard import audit_writes\naudit_writes(sys.argv[1])\n"
          "src = sys.stdin.read()\nsys.argv = ['tool']\n"
          "exec(compile(src, '<tool>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})\n")


def _bounded(seconds: float) -> None:
    """In the program's process before it starts: killed when the worker dies (a worker stopped mid-call takes
    its session's processes with it, and this one leads its own), and at a CPU time a little past the call's."""
    import ctypes
    import resource
    import signal
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    cpu = int(seconds) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def python(code: str) -> str:
    """Run a Python program in a fresh interpreter and return what it prints (standard output and errors).

    Args:
        code: the Python program; print the values you want to see
    """
    folder = SETTINGS["folder"]
    limit = max(1.0, float(SETTINGS["timeout_s"]) - 1.0)   # the child stops before the call's own limit
    keep = int(SETTINGS["max_chars"]) * 4 + 4096          # bytes read at most (UTF-8 is up to 4 per character)
    root = str(Path(__file__).resolve().parents[2])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": root, "HOME": folder, "TMPDIR": folder,
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen([sys.executable, "-s", "-c", _CHILD, folder], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=folder, env=env,
                            start_new_session=True, preexec_fn=lambda: _bounded(limit))
    try:
        proc.stdin.write(str(code).encode("utf-8", "replace"))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out, cut, deadline = bytearray(), False, time.monotonic() + limit
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the program did not finish within {limit:g} s")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            if len(out) < keep:
                out += chunk[:keep - len(out)]
            else:
                cut = True   # keep reading (and dropping) so the program is not blocked on a full pipe
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:   # it closed its output and ran on
            raise TimeoutError(f"the program did not finish within {limit:g} s") from None
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                proc.kill()
            proc.wait()
        proc.stdout.close()
    text = out.decode("utf-8", "replace")
    if proc.returncode and proc.returncode < 0:
        text += f"\n(the program was killed by signal {-proc.returncode})"
    return text + ("\n(more output was cut)" if cut else "")


BUILTIN_TOOLS = {"calculator": calculator, "python": python}
