"""Episodes of several turns on any engine (edgerl/agents/episode.py holds the conversation's
bookkeeping): an engine with its own turn loop (`generate_turns`: the static engine keeps each row's KV
cache and prefills what follows a turn into it) runs it; any other engine generates each turn from the
whole conversation so far (`generate` on prompt + every earlier turn and result: the prefix is computed
again every turn, as TRL's tool loop does on HF generate).

The batch holds one sequence per episode: the prompt, then everything after it (the model's turns and the
context between them), with `loss_mask` 1 on the model's own tokens only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from .base import RolloutBatch, SamplingParams


def generate_episodes(engine, driver, params: SamplingParams, generator: Optional[torch.Generator] = None
                      ) -> RolloutBatch:
    """Every episode of `driver` (an agents.episode.EpisodeDriver) to its end, on `engine`."""
    t0 = time.perf_counter()
    prompts = driver.start()
    own = getattr(engine, "generate_turns", None)
    info = own(prompts, params, generator, driver) if own is not None else by_recompute(engine, prompts, params,
                                                                                       generator, driver)
    episodes = driver.finish()
    sampled = info.pop("logprobs", False)
    info.update(tool_wait_s=driver.wait_s, episode_s=time.perf_counter() - t0)
    return RolloutBatch(prompt_ids=[ep.prompt_ids for ep in episodes], response_ids=[ep.tokens for ep in episodes],
                        truncated=[ep.truncated for ep in episodes],
                        logprobs=[ep.logprobs for ep in episodes] if sampled else None, info=info,
                        loss_mask=[ep.mask for ep in episodes], episodes=episodes)


def by_recompute(engine, prompts: list[list[int]], params: SamplingParams, generator, driver) -> dict:
    """Each round, one turn for every live episode through `engine.generate` on its whole conversation so
    far (rows grouped by the tokens their turn may take)."""
    seqs = [list(p) for p in prompts]
    live = list(range(len(seqs)))
    info = {"engine": getattr(engine, "name", "?"), "rounds": 0, "logprobs": True}
    while live:
        out: dict[int, tuple[list[int], list[float], bool]] = {}
        groups: dict[int, list[int]] = {}
        for r in live:
            groups.setdefault(driver.limit(r), []).append(r)
        for limit, rows in sorted(groups.items()):
            if limit <= 0:
                continue
            batch = engine.generate([seqs[r] for r in rows], 1, dataclasses.replace(params, max_new_tokens=limit),
                                    generator)
            info["logprobs"] &= batch.logprobs is not None
            for i, r in enumerate(rows):
                out[r] = (batch.response_ids[i], batch.logprobs[i] if batch.logprobs is not None else [],
                          batch.truncated[i])
        for r in live:
            if r in out:
                driver.ended(r, *out[r])
        nxt = []
        for r in live:
            cont = driver.next(r)
            if cont is not None:
                seqs[r] += out[r][0] + cont
                nxt.append(r)
        live = nxt
        info["rounds"] += 1
    return info


class EpisodeRollout:
    """The run's episodes: `generate(prompts, n, params, generator)` as an engine's generate, but on prompt
    rows (an environment reads the row; tools read its extra_info.tools_kwargs). `toolbox`: the run's
    agents.toolbox.ToolBox; `tool_format`: the chat template's (None without tools)."""

    def __init__(self, engine, toolbox, tool_format: Optional[str], tokenizer, rollout_cfg) -> None:
        from edgerl.agents.calls import Continuations
        self.engine, self.box, self.tok, self.fmt = engine, toolbox, tokenizer, tool_format
        self.cfg = rollout_cfg
        self.cont = Continuations(tokenizer)
        self.episodes_started = 0

    def generate(self, prompts: list, n: int, params: SamplingParams, generator: Optional[torch.Generator] = None
                 ) -> RolloutBatch:
        from edgerl.agents.episode import EpisodeDriver, EpisodeSettings
        from edgerl.data.prompts import with_observation
        r = self.cfg
        settings = EpisodeSettings(max_turns=r.turns(), budget=r.response_tokens(), max_new_tokens=r.max_new_tokens,
                                   stop_ids=tuple(params.eos_token_ids), tool_format=self.fmt,
                                   environment=r.environment is not None)
        schemas = self.box.schemas or None
        driver = EpisodeDriver(prompts, n, settings, self.tok, self.cont, self.box,
                               lambda p, obs: with_observation(p, obs, self.tok, schemas), self.episodes_started)
        self.episodes_started += len(prompts) * n
        batch = generate_episodes(self.engine, driver, params, generator)
        batch.info.update(self.box.take_counts())
        return batch


ENDINGS = ("answer", "environment", "max_turns", "truncated", "budget")


def episode_metrics(batch: RolloutBatch, sum_ranks: Optional[Callable[[list[float]], list[float]]] = None,
                    max_ranks: Optional[Callable[[list[float]], list[float]]] = None) -> dict[str, float]:
    """The step's episode statistics (rollout/...): turns, tool calls and their errors and timeouts, tokens by
    source, how episodes ended, the time spent waiting on tools. Under torchrun `sum_ranks` and `max_ranks`
    (element-wise over ranks; every rank calls both, in this order, whenever its batch has episodes) make
    them the whole batch's: means over every rank's episodes, counts and tool seconds summed, the longest
    episode, wait and turn loop of any rank."""
    eps = batch.episodes
    if eps is None:
        return {}
    info = batch.info
    rewards = [r for e in eps for r in e.turn_rewards]
    sums = [float(len(eps)), sum(e.turns for e in eps), sum(e.tool_calls for e in eps),
            sum(e.tool_errors for e in eps), info.get("timeouts", 0), info.get("restarts", 0),
            sum(e.model_tokens for e in eps), sum(e.context_tokens for e in eps), info.get("seconds", 0.0),
            sum(rewards), len(rewards), *(sum(e.ended_by == why for e in eps) for why in ENDINGS)]
    # the static engine's turn loop (rounds of turns, prefill of what follows a turn); -1 where it did not run
    maxes = [max((e.turns for e in eps), default=0), info.get("tool_wait_s", 0.0),
             *(info.get(k, -1.0) for k in ("rounds", "extend_s"))]
    sums = [float(v) for v in sums]
    maxes = [float(v) for v in maxes]
    if sum_ranks is not None:
        sums = sum_ranks(sums)
    if max_ranks is not None:
        maxes = max_ranks(maxes)
    n, turns, calls, errors, timeouts, restarts, model, context, tool_s, reward_sum, reward_n = sums[:11]
    if not n:
        return {}
    out = {"rollout/turns_mean": turns / n, "rollout/turns_max": maxes[0], "rollout/tool_calls_mean": calls / n,
           "rollout/tool_errors": errors, "rollout/tool_timeouts": timeouts, "rollout/tool_restarts": restarts,
           "rollout/model_tokens_mean": model / n, "rollout/context_tokens_mean": context / n,
           "rollout/tool_s": tool_s, "time/tool_wait_s": maxes[1]}
    for key, value in zip(("rounds", "extend_s"), maxes[2:]):
        if value >= 0:
            out[f"rollout/{key}"] = value
    for why, count in zip(ENDINGS, sums[11:]):
        out[f"rollout/ended_{why}"] = count / n
    if reward_n:
        out["reward/turn_mean"] = reward_sum / reward_n
    return out


def episode_sample(ep) -> dict:
    """What samples.jsonl shows of an episode besides its prompt and response: the conversation after the
    prompt with its roles (the model's turns, the tools' results, observations), and how it went."""
    return {"conversation": [dict(m) for m in ep.messages], "turns": ep.turns, "tool_calls": ep.tool_calls,
            "tool_errors": ep.tool_errors, "ended_by": ep.ended_by,
            **({"turn_rewards": list(ep.turn_rewards)} if ep.turn_rewards else {})}
