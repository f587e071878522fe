"""What a step does with its groups (the n samples of one prompt, contiguous rows) and with responses cut
at the length limit, before the update:

    uniform_groups      groups whose rewards are all equal: under grpo and rloo their advantages are 0
    rows_with_gradient  the rows the update must compute (any non-zero advantage on a response token)
    Drawn / select      DAPO's dynamic sampling: keep the informative groups of several draws
    overlong_penalty    DAPO's soft length penalty
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from edgerl.rollout.base import RolloutBatch
from edgerl.train import ranks


def uniform_groups(scores: Sequence[float], n: int) -> list[bool]:
    """scores: B = groups x n values, groups contiguous. True for each group whose n scores are equal."""
    if n < 1 or len(scores) % n:
        raise ValueError(f"{len(scores)} scores are not whole groups of {n}")
    return [len(set(scores[g * n:(g + 1) * n])) == 1 for g in range(len(scores) // n)]


def rows_with_gradient(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """advantages, mask: (B, T). (B,) bool: rows with a non-zero advantage on a valid token. The others
    add exactly nothing to a policy-gradient loss (when it has no other term), so the update may skip them."""
    return ((advantages != 0) & mask.bool()).any(dim=1)


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, buffer: int, factor: float) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per response of `lengths` tokens:
    0 up to max_new_tokens - buffer, then falling linearly to -factor at max_new_tokens."""
    start = max_new_tokens - buffer
    return [-factor * min(1.0, (n - start) / buffer) if n > start else 0.0 for n in lengths]


@dataclass
class Drawn:
    """What one or more draws of prompts produced, group by group: the prompts (one per group), their
    responses, the total reward per response, each reward function's values and the dict components."""
    prompts: list[Any]
    batch: RolloutBatch
    scores: list[float]
    by_function: dict[str, list[float]] = field(default_factory=dict)
    components: dict[str, list[float]] = field(default_factory=dict)

    def extend(self, other: "Drawn") -> "Drawn":
        b, o = self.batch, other.batch
        logprobs = b.logprobs + o.logprobs if b.logprobs is not None and o.logprobs is not None else None
        info = dict(b.info)
        for k, v in o.info.items():   # timings add up over the draws
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(info.get(k), (int, float)):
                info[k] = info[k] + v
        both = lambda x, y: x + y if x is not None and y is not None else None   # noqa: E731
        batch = RolloutBatch(b.prompt_ids + o.prompt_ids, b.response_ids + o.response_ids, b.truncated + o.truncated,
                             logprobs, info, both(b.loss_mask, o.loss_mask), both(b.episodes, o.episodes))
        def joined(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
            nan = float("nan")   # a key one draw's results lack (a dict key, say) is NaN on its rows
            return {k: a.get(k, [nan] * len(self.scores)) + b.get(k, [nan] * len(other.scores)) for k in {**a, **b}}
        return Drawn(self.prompts + other.prompts, batch, self.scores + other.scores,
                     joined(self.by_function, other.by_function), joined(self.components, other.components))

    def select(self, groups: Sequence[int], n: int) -> "Drawn":
        """The groups of these indices, in this order."""
        rows = [g * n + j for g in groups for j in range(n)]
        b = self.batch

        def pick(xs):
            return [xs[i] for i in rows]
        batch = RolloutBatch(pick(b.prompt_ids), pick(b.response_ids), pick(b.truncated),
                             pick(b.logprobs) if b.logprobs is not None else None, dict(b.info),
                             pick(b.loss_mask) if b.loss_mask is not None else None,
                             pick(b.episodes) if b.episodes is not None else None)
        return Drawn([self.prompts[g] for g in groups], batch, pick(self.scores),
                     {k: pick(v) for k, v in self.by_function.items()}, {k: pick(v) for k, v in self.components.items()})


def fill_with_informative(drawn: Drawn, n: int, need: int) -> tuple[Drawn, int]:
    """`need` groups of `drawn`: the informative ones first (in draw order), then uniform ones to make up
    the number. Returns them and how many are informative."""
    uniform = uniform_groups(drawn.scores, n)
    informative = [g for g, u in enumerate(uniform) if not u]
    rest = [g for g, u in enumerate(uniform) if u]
    chosen = (informative + rest)[:need]
    return drawn.select(chosen, n), min(len(informative), need)


def draw(one: Callable[[], Drawn], n: int, max_extra: int, device: torch.device) -> tuple[Drawn, dict[str, float]]:
    """DAPO's dynamic sampling: call `one()` (a draw of this process's share of the next prompts,
    rolled out and scored) until every process holds as many informative groups as one draw has prompts,
    or `max_extra` more draws were made; keep the informative groups first. Every process draws the same
    number of times."""
    drawn = one()
    need, extra = len(drawn.prompts), 0

    def informative(d: Drawn) -> int:
        return sum(not u for u in uniform_groups(d.scores, n))
    while extra < max_extra and ranks.any_rank(informative(drawn) < need, device):
        drawn = drawn.extend(one())
        extra += 1
    final, kept = fill_with_informative(drawn, n, need)
    total, = ranks.sum_floats([float(kept)], device)
    return final, {"batch/extra_draws": float(extra), "batch/informative_groups": total}


def skip_policy(cfg, world: int) -> tuple[bool, str]:
    """Whether the update may leave out rows whose loss is exactly 0 (algo.skip_uniform_groups), and why
    (one line for the run log). Only where the result is the same as computing them."""
    a = cfg.algo
    if not a.skip_uniform_groups:
        return False, "update: every row computed (algo.skip_uniform_groups=false)"
    why = None
    if a.kl_coef > 0 and a.kl_in == "loss":
        why = f"algo.kl_coef={a.kl_coef:g} puts a KL term on every row"
    elif a.entropy_coef:
        why = f"algo.entropy_coef={a.entropy_coef:g} puts an entropy term on every row"
    elif cfg.lora.enabled is not False and cfg.lora.dropout > 0:
        why = f"lora.dropout={cfg.lora.dropout:g} draws random masks for every row"
    elif world > 1:
        why = "under torchrun every process runs the same passes (FSDP2's collectives)"
    if why:
        return False, f"update: every row computed, also those of uniform groups: {why}"
    return True, ("update: rows whose advantages are all 0 (groups whose rewards are all equal) are left out of "
                  "the forward and backward passes; the result is the same")
