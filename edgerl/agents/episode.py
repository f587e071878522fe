"""One rollout's episodes: each row's conversation as tokens (the model's and the context's), its turns,
tool calls and rewards, and the bookkeeping an engine's turn loop asks of it (`EpisodeDriver`).

An engine decodes a turn for every live row, then for each row calls `ended` (the driver parses the turn
and starts its tool calls or the environment's step at once, in the tool workers) and `next` (the driver
waits for them and returns the tokens that follow the turn, or None when the episode is over). `limit`
is how many tokens the row's next turn may take: rollout.max_new_tokens, within what is left of the
episode's budget (rollout.max_episode_tokens), which counts every token after the prompt, the model's and
the tools'.

An episode ends when the model's turn calls no tool (with tools) or the environment says done, at
rollout.max_turns model turns (the calls of the last turn are not run), when a turn reaches its token
limit without ending (truncated), or when the results would not fit the budget (truncated; they are not
appended).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from edgerl.agents.calls import Continuations, parse_calls, tool_messages


@dataclass
class Episode:
    """A row's episode. `tokens` follow the prompt; `mask` is 1 on the model's own tokens, 0 on the
    context's (tool results, observations, the template's headers); `logprobs` the sampler's, 0 on context."""
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)   # the conversation after the prompt, with roles
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    done: bool = False
    ended_by: str = ""    # "answer", "environment", "max_turns", "truncated", "budget"
    observation_tokens: int = 0   # an environment's first observation, added to the prompt (and the budget)

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    @property
    def context_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)

    def discounted_return(self, gamma: float) -> float:
        return sum(r * gamma ** k for k, r in enumerate(self.turn_rewards))


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int
    budget: int              # tokens after the prompt
    max_new_tokens: int      # one turn
    stop_ids: tuple[int, ...]
    tool_format: Optional[str]       # None: no tools
    environment: bool


class EpisodeDriver:
    """The episodes of `prompts` x `n` rows (the n rows of a prompt contiguous). `toolbox`: the ToolBox (or
    None without tools and environment); `first_ids(prompt, observation)`: the prompt's tokens with an
    environment's first observation added to its last user message."""

    def __init__(self, prompts: list[Any], n: int, settings: EpisodeSettings, tokenizer: Any,
                 continuations: Continuations, toolbox: Any, first_ids: Callable[[Any, str], list[int]],
                 first_episode: int = 0) -> None:
        self.s, self.tok, self.cont, self.box = settings, tokenizer, continuations, toolbox
        self.rows = [p for p in prompts for _ in range(n)]
        self.first_ids = first_ids
        self.ids = [first_episode + r for r in range(len(self.rows))]   # the toolbox's episode numbers
        self.episodes = [Episode(list(p.input_ids)) for p in self.rows]
        self._pending: list[Optional[tuple[str, Any]]] = [None] * len(self.rows)
        self.wait_s = 0.0   # time `next` waited for tools and environments

    # --- the start ---------------------------------------------------------------------------------------

    def start(self) -> list[list[int]]:
        """Each row's prompt tokens; an environment is reset first (its first observation joins the prompt,
        and its tokens count against the episode's budget)."""
        if not self.s.environment:
            return [ep.prompt_ids for ep in self.episodes]
        futures = [self.box.submit(i, {"op": "reset", "episode": i, "row": _row(p)}) for i, p in zip(self.ids, self.rows)]
        for r, (f, p) in enumerate(zip(futures, self.rows)):
            obs = f.result()["observation"]
            if obs:
                ep = self.episodes[r]
                ids = self.first_ids(p, obs)
                ep.messages.append({"role": "user", "content": obs, "first_observation": True})
                ep.observation_tokens = len(ids) - len(ep.prompt_ids)
                ep.prompt_ids = ids
        return [ep.prompt_ids for ep in self.episodes]

    def _used(self, ep: Episode) -> int:
        return len(ep.tokens) + ep.observation_tokens

    @property
    def turn_tokens(self) -> int:
        """The longest turn (rollout.max_new_tokens): the static engine prefills what follows turns in
        groups of rows of at most rows x this many tokens, as the plan's memory model counts."""
        return self.s.max_new_tokens

    def limit(self, r: int) -> int:
        """Tokens the row's next turn may take (0: it takes none)."""
        ep = self.episodes[r]
        return 0 if ep.done else max(0, min(self.s.max_new_tokens, self.s.budget - self._used(ep)))

    # --- a turn ended ------------------------------------------------------------------------------------

    def ended(self, r: int, tokens: list[int], logprobs: list[float], truncated: bool) -> None:
        """The row's turn: `tokens` (ending with a stop token unless truncated) and their log-probs. Starts
        its tool calls or the environment's step."""
        ep = self.episodes[r]
        ep.tokens += tokens
        ep.mask += [1] * len(tokens)
        ep.logprobs += list(logprobs[:len(tokens)]) + [0.0] * (len(tokens) - len(logprobs))
        ep.turns += 1
        body = tokens[:-1] if tokens and tokens[-1] in self.s.stop_ids else tokens
        text = self.tok.decode(body, skip_special_tokens=False)
        ep.messages.append({"role": "assistant", "content": text})
        if truncated:
            return self._end(ep, "truncated", truncated=True)
        if self.s.environment:
            self._pending[r] = ("env", self.box.submit(self.ids[r], {"op": "step", "episode": self.ids[r], "text": text}))
            return
        calls = parse_calls(text, self.s.tool_format) if self.s.tool_format else []
        if not calls:
            return self._end(ep, "answer")
        if ep.turns >= self.s.max_turns:
            return self._end(ep, "max_turns")
        hidden = self.rows[r].extra.get("tools_kwargs") or {}
        futures: list[Any] = []
        for c in calls:
            if c.error is not None:
                futures.append(f"error: {c.error}")
                continue
            kw = hidden.get(c.name) or {}
            extra = {**(kw.get("create_kwargs") or {}), **(kw.get("execute_kwargs") or {})} if isinstance(kw, dict) else {}
            futures.append(self.box.submit(self.ids[r], {"op": "call", "name": c.name, "arguments": c.arguments,
                                                         "hidden": extra}))
        self._pending[r] = ("tools", (calls, futures))

    def _end(self, ep: Episode, why: str, truncated: bool = False) -> None:
        ep.done, ep.ended_by, ep.truncated = True, why, truncated

    # --- what follows it ---------------------------------------------------------------------------------

    def next(self, r: int) -> Optional[list[int]]:
        """The tokens before the row's next turn (waiting for its tools), or None: the episode is over."""
        import time
        ep, pending = self.episodes[r], self._pending[r]
        self._pending[r] = None
        if ep.done or pending is None:
            ep.done = True
            return None
        t0 = time.perf_counter()
        kind, what = pending
        if kind == "env":
            reply = what.result()
            ep.turn_rewards.append(reply["reward"])
            if reply["done"]:
                self.wait_s += time.perf_counter() - t0
                return self._end(ep, "environment")
            if ep.turns >= self.s.max_turns:
                self.wait_s += time.perf_counter() - t0
                return self._end(ep, "max_turns")
            messages = [{"role": "user", "content": reply["observation"] or ""}]
        else:
            calls, futures = what
            results = [self._result(f, ep) for f in futures]
            messages = tool_messages(calls, results)
        self.wait_s += time.perf_counter() - t0
        cont = self.cont.tokens(messages)
        if self._used(ep) + len(cont) >= self.s.budget:   # no room for the results and a turn after them
            return self._end(ep, "budget", truncated=True)
        ep.tokens += cont
        ep.mask += [0] * len(cont)
        ep.logprobs += [0.0] * len(cont)
        ep.messages += messages
        return cont

    def _result(self, f: Any, ep: Episode) -> str:
        ep.tool_calls += 1
        if isinstance(f, str):   # a call that could not be read
            ep.tool_errors += 1
            return f
        reply = f.result()
        if "error" in reply:
            ep.tool_errors += 1
            return f"error: {reply['error']}"
        return reply["content"]

    def finish(self) -> list[Episode]:
        """The episodes; the environments' state in the workers is dropped."""
        if self.s.environment:
            for f in [self.box.submit(i, {"op": "close", "episode": i}) for i in self.ids]:
                f.result()
        return self.episodes


def _row(p: Any) -> dict:
    """What an environment's reset sees of a prompt row (plain data)."""
    extra = dict(p.extra or {})
    return {"prompt": p.raw_prompt, "ground_truth": p.ground_truth, "data_source": p.data_source,
            "extra_info": extra, "interaction_kwargs": extra.get("interaction_kwargs") or {}}


