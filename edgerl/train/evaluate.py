"""Held-out evaluation on the rollout engine, in the rollout phase's memory: the engine generates
`plan.rollout_batch` sequences at a time, for prompts no longer than data.max_prompt_len and responses
no longer than rollout.max_new_tokens, the lengths the plan sized its KV cache for.

    eval/accuracy      greedy answers the data_source's rule gives full credit (gsm8k, math, arithmetic)
    eval/reward        the run's reward (reward.functions, weighted) of the greedy answers
    eval/mean@k        k sampled answers per prompt (eval.samples, at rollout.temperature): the share correct
    eval/pass@k        the share of prompts with at least one of the k correct
    eval/response_length, eval/truncated, eval/prompts, time/eval_s

Under torchrun each process evaluates every world-th prompt and the counts are summed. The sampled
answers draw from a generator seeded by (train.seed, step): training's own random state is untouched,
so a run with evaluation trains exactly as one without.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from edgerl.rewards.builtins import BUILTIN_REWARDS, RewardRow
from edgerl.rewards.functions import RewardFunction, load_functions, score
from edgerl.rewards.rules import KNOWN_SOURCES
from edgerl.rollout.base import SamplingParams
from edgerl.rollout.episodes import episode_sample
from edgerl.train import ranks


@dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)   # the first greedy answers of this process


def has_rule(sources: Sequence[str]) -> bool:
    """Every data_source has a built-in rule, so eval/accuracy is defined."""
    return all(s in KNOWN_SOURCES for s in sources)


def correct(rows: list[RewardRow]) -> list[float]:
    """1.0 where the row's rule ('answer') gives full credit, else 0.0."""
    answer = RewardFunction("answer", "answer", BUILTIN_REWARDS["answer"][0], "builtin")
    return [float(v >= 1.0) for v in score([answer], rows).by_function["answer"]]


def _rows(tokenizer, prompts: list[Any], response_ids: list[list[int]], n: int) -> list[RewardRow]:
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    group = [p for p in prompts for _ in range(n)]
    return [RewardRow(p.data_source, p.raw_prompt, p.text, t, tuple(r), p.ground_truth, p.extra)
            for p, t, r in zip(group, texts, response_ids)]


def evaluate(generate, tokenizer, prompts: list[Any], functions: list[RewardFunction], sampling: SamplingParams,
             samples: int, seed: int, step: int, device: torch.device, answer_key: str = "",
             keep: int = 0) -> EvalResult:
    """Evaluate the engine's current weights on `prompts` (every rank calls this with the same list).
    `generate(prompts, n, params, generator)`: the run's rollout (an engine's generate on the prompts' tokens,
    or the run's episodes). `keep`: sample rows to return for samples.jsonl."""
    t0 = time.perf_counter()
    rank, world = (torch.distributed.get_rank(), ranks.world()) if ranks.world() > 1 else (0, 1)
    mine = prompts[rank::world]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rule = has_rule([p.data_source for p in prompts])
    greedy = generate(mine, 1, dataclasses.replace(sampling, greedy=True), gen)
    rows = _rows(tokenizer, mine, greedy.response_ids, 1)
    scored = score(functions, rows, answer_key)
    acc = correct(rows) if rule else []
    share: dict[str, Any] = {"reward": scored.total, "acc": acc, "len": [len(r) for r in greedy.response_ids],
                             "cut": [float(t) for t in greedy.truncated],
                             "by": {k: [x for x in v if not math.isnan(x)] for k, v in scored.by_function.items()}}
    if samples > 0:
        sampled = generate(mine, samples, sampling, gen)
        ok = correct(_rows(tokenizer, mine, sampled.response_ids, samples)) if rule else []
        per_prompt = [ok[i * samples:(i + 1) * samples] for i in range(len(mine))] if rule else []
        share["mean"] = [sum(g) / samples for g in per_prompt]
        share["pass"] = [float(any(g)) for g in per_prompt]
    shares = ranks.gather(share)

    def flat(key: str) -> list[float]:
        return [x for sh in shares for x in sh.get(key, [])]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")
    out = {"eval/reward": mean(flat("reward")), "eval/response_length": mean(flat("len")),
           "eval/truncated": mean(flat("cut")), "eval/prompts": float(len(prompts))}
    if rule:
        out["eval/accuracy"] = mean(flat("acc"))
        if samples > 0:
            out[f"eval/mean@{samples}"] = mean(flat("mean"))
            out[f"eval/pass@{samples}"] = mean(flat("pass"))
    if len(functions) > 1:
        for name in scored.by_function:
            out[f"eval/reward/{name}"] = mean([x for sh in shares for x in sh["by"].get(name, [])])
    out["time/eval_s"] = time.perf_counter() - t0
    eps = greedy.episodes or [None] * len(rows)
    kept = [{"prompt": r.prompt_text, "response": r.response, "reward": s, "ground_truth": r.ground_truth,
             **({"correct": a} if rule else {}), **(episode_sample(e) if e is not None else {})}
            for r, s, a, e in zip(rows[:keep], scored.total, acc or [None] * len(rows), eps)]
    return EvalResult(out, kept)


def on_engine(engine):
    """`evaluate`'s generate on an engine: the prompts' tokens, one response each."""
    def generate(prompts, n, params, gen):
        return engine.generate([list(p.input_ids) for p in prompts], n, params, gen)
    return generate


def reward_functions(cfg) -> list[RewardFunction]:
    """The run's reward functions (reward.functions, reward.weights)."""
    return load_functions(cfg.reward.functions, cfg.reward.weights, cfg.data.answer_key,
                          cfg.reward.timeout_s or None)


def due(step: int, every: int, last: int) -> bool:
    """Evaluate after `step`: before the first (0), every `every` steps, and after the last."""
    return step == 0 or step == last or (every > 0 and step % every == 0)


