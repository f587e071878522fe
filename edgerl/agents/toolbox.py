"""The run's tools and environment, served by worker processes (`edgerl.rewards.contain.UserFunction`
running host.py's `handle`), each confined to a scratch folder of its own (guard.py).

A worker serves one request at a time; requests go to it through a thread of its own, so tools run while
the engine decodes the other rows. An episode's requests all go to the same worker (an environment keeps
its state there). A worker that does not answer within the time limit (plus GRACE_S), or that ends, is
stopped and started again: the call gets an error message the model reads, and an environment's episode
on it ends. A user's mistake (a tool file that does not import, an environment that breaks its protocol)
is a ToolError: the run stops with that one line.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.core.errors import RewardError, ToolError

HOST = Path(__file__).resolve().with_name("host.py")
GRACE_S = 5.0         # beyond the call's own limit (SIGALRM in the worker) before the process is stopped
SETUP_TIMEOUT_S = 300.0   # the first worker imports transformers' schema helper and the user's tool files


@dataclass(frozen=True)
class Limits:
    """What one call may use: seconds, memory (MiB beyond the worker's own), file size (MiB), and the
    characters of its result the model reads (the rest is cut, with a note)."""
    timeout_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 64
    max_chars: int = 4000


class ToolBox:
    """tools: `rollout.tools` (built-in names or 'path.py:function'); environment: 'path.py:Class' or None.
    `schemas` are the tools' JSON schemas for the chat template; `fences` says how the workers are confined."""

    def __init__(self, tools: list[str], environment: Optional[str], limits: Limits, workers: int = 2,
                 log: Callable[[str], None] = print) -> None:
        self.tools, self.environment, self.limits, self.log = list(tools), environment, limits, log
        self.folder = Path(tempfile.mkdtemp(prefix="edgerl-tools-"))
        self._workers: list[Any] = [None] * max(1, workers)
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"edgerl-tool-{i}") for i in range(len(self._workers))]
        self._lock = threading.Lock()
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "restarts": 0, "seconds": 0.0}
        try:
            first = self._start(0, schemas=True)
            self.schemas: list[dict] = first["schemas"]
            self.fences: str = first["fences"]
            for i in range(1, len(self._workers)):
                self._start(i, schemas=False)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]

    def _start(self, i: int, schemas: bool) -> dict:
        from edgerl.rewards.contain import call_user
        from edgerl.rewards.rules import load_reward_function
        folder = self.folder / f"worker-{i}"
        folder.mkdir(exist_ok=True)
        try:
            fn = load_reward_function(f"{HOST}:handle", self.limits.timeout_s + GRACE_S, call_with={"request": {}},
                                      signature="handle(request)", option="rollout.tools")
            reply = call_user(fn, "the tool worker", "its setup", timeout_s=SETUP_TIMEOUT_S, request={
                "op": "setup", "tools": self.tools, "environment": self.environment, "folder": str(folder),
                "timeout_s": self.limits.timeout_s, "memory_mb": self.limits.memory_mb, "file_mb": self.limits.file_mb,
                "max_chars": self.limits.max_chars, "schemas": schemas})
        except RewardError as e:
            raise ToolError(f"the tool worker could not start: {e}") from None
        if "fatal" in reply:
            fn.close()
            raise ToolError(reply["fatal"])
        self._workers[i] = fn
        return reply

    def request(self, i: int, req: dict) -> dict:
        """One request to worker `i`, here (the caller's thread). A worker that overran or ended is started
        again and the request answers {"error": ..., "restarted": True}."""
        from edgerl.rewards.contain import call_user
        t0 = time.monotonic()
        what = f"tool {req.get('name')}" if req["op"] == "call" else f"environment {req['op']}"
        try:
            reply = call_user(self._workers[i], "the tool worker", what, request=req)
        except RewardError:
            overran = time.monotonic() - t0 >= self.limits.timeout_s + GRACE_S - 0.5
            self._workers[i].close()
            self._start(i, schemas=False)
            with self._lock:
                self.counts["restarts"] += 1
            why = (f"did not return within {self.limits.timeout_s:g} s; its process was stopped" if overran else
                   "ended its process without returning (an exit, a crash or a kill); the process was restarted")
            reply = {"error": f"the {what} {why}", "timeout": overran, "restarted": True}
        if "fatal" in reply:
            raise ToolError(reply["fatal"])
        if req["op"] == "call":
            with self._lock:
                self.counts["calls"] += 1
                self.counts["errors"] += "error" in reply
                self.counts["timeouts"] += bool(reply.get("timeout"))
                self.counts["seconds"] += time.monotonic() - t0
        return reply

    def submit(self, episode: int, req: dict) -> "Future[dict]":
        """The request on the episode's worker, in that worker's thread."""
        i = episode % len(self._workers)
        return self._threads[i].submit(self.request, i, req)

    def take_counts(self) -> dict[str, float]:
        """The counts since the last call (calls, errors, timeouts, restarts, seconds in tools), reset."""
        with self._lock:
            out = dict(self.counts)
            self.counts = {k: 0 if k != "seconds" else 0.0 for k in self.counts}
        return out

    def close(self) -> None:
        """Stop the threads and workers; remove the scratch folder (edgerl's own temporary folder)."""
        for t in self._threads:
            t.shutdown(wait=True, cancel_futures=True)
        for w in self._workers:
            if w is not None:
                w.close()
        self._workers = [None] * len(self._workers)
        shutil.rmtree(self.folder, ignore_errors=True)

    def describe(self) -> str:
        return (f"tools {', '.join(self.names) or 'none'}" + (f", environment {self.environment}" if self.environment
                else "") + f"; {len(self._workers)} worker process(es), {self.limits.timeout_s:g} s a call; {self.fences}")


def open_toolbox(rollout_cfg, tokenizer, model: str, chat_template: str, log: Callable[[str], None] = print
                 ) -> tuple[ToolBox, Optional[str]]:
    """The run's ToolBox and the chat template's tool-call format (None without tools), or a ToolError before
    the run when the model's chat template cannot take them."""
    from edgerl.agents.calls import template_text, tool_format
    r = rollout_cfg
    fmt = tool_format(tokenizer, model) if r.tools else None
    if not template_text(tokenizer) or chat_template == "never":
        raise ToolError("episodes of several turns: what comes between the model's turns is rendered by the chat "
                        f"template, and {model} has none (or data.chat_template=never); use a model with a chat template")
    if not r.stop_at_eos:
        raise ToolError("episodes of several turns need rollout.stop_at_eos=true: a turn ends at the EOS token")
    box = ToolBox(r.tools, r.environment, Limits(r.tool_timeout_s, r.tool_memory_mb, max_chars=r.tool_max_chars),
                  r.tool_workers, log)
    log(f"episodes: up to {r.turns()} turns and {r.response_tokens()} tokens after the prompt; {box.describe()}")
    return box, fmt
