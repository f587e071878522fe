"""One step's experience: the rollout as padded tensors, with log-probs, values and advantages.

Layout: prompts are left-padded to P columns and responses right-padded to R, so every row's
response starts at column P. The hidden state at column P - 1 + t predicts response token t,
hence `start = P - 1` for the log-prob and value passes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch

from edgerl import algos
from edgerl.rollout.base import RolloutBatch


@dataclass
class Experience:
    input_ids: torch.Tensor          # (B, P + R)
    attention_mask: torch.Tensor     # (B, P + R)
    response_ids: torch.Tensor       # (B, R)
    response_mask: torch.Tensor      # (B, R) float, 1 on real response tokens
    start: int                       # P - 1
    scores: torch.Tensor             # (B,)
    sampled_logp: Optional[torch.Tensor] = None   # (B, R) the engine's own log-probs, when it reports them
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx: torch.Tensor | slice) -> "Experience":
        """The same experience restricted to some rows."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx] if isinstance(v, torch.Tensor) else v
        return Experience(**out)

    def trimmed(self) -> "Experience":
        """The same rows without the response columns after their last real token (at least one kept):
        a micro-batch of responses that ended early (EOS) computes no padding."""
        R = self.response_ids.shape[1]
        real = self.response_mask.sum(0).nonzero()
        keep = max(1, int(real[-1]) + 1) if len(real) else 1
        if keep == R:
            return self
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                v = v[:, :v.shape[1] - (R - keep)]   # (B, P + R) and (B, R) alike lose the last R - keep columns
            out[f.name] = v
        return Experience(**out)

    def to(self, device: torch.device) -> "Experience":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def pad_batch(batch: RolloutBatch, pad_id: int, scores: list[float]) -> Experience:
    P = max(len(p) for p in batch.prompt_ids)
    R = max(1, max(len(r) for r in batch.response_ids))
    B = len(batch)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):P] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, P:P + len(r)] = 1
    sampled = None
    if batch.logprobs is not None:
        sampled = torch.zeros((B, R), dtype=torch.float32)
        for i, lp in enumerate(batch.logprobs):
            sampled[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    response_mask = mask[:, P:].float()   # the model attends to every token; it learns from its own only
    if batch.loss_mask is not None:   # episodes: the tools' and the environment's tokens are context
        for i, lm in enumerate(batch.loss_mask):
            response_mask[i, :len(lm)] *= torch.tensor(lm, dtype=torch.float32)
    return Experience(input_ids=ids, attention_mask=mask, response_ids=ids[:, P:].clone(),
                      response_mask=response_mask, start=P - 1,
                      scores=torch.tensor(scores, dtype=torch.float32), sampled_logp=sampled)


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def token_micro_batches(exp: Experience, tokens: Optional[int], size: int) -> list[slice]:
    """Consecutive slices of `exp`'s rows that hold at most `tokens` tokens each once trimmed (rows x
    (prompt width + the slice's longest response); at least one row per slice). Full-length responses
    give slices of tokens // (P + R) rows; responses that ended early (EOS) let more rows share one.
    `tokens` None: slices of `size` rows."""
    n = len(exp)
    if tokens is None or n == 0:   # no rows (every group of the mini-batch uniform): no micro-batch
        return micro_batches(n, size)
    width = exp.start + 1
    real = exp.response_mask.bool()
    cols = torch.arange(real.shape[1])
    lens = torch.where(real, cols + 1, 0).amax(1).clamp(min=1).tolist()   # each row's last real column + 1
    out, first, longest = [], 0, 0
    for i, n_i in enumerate(lens):
        if i > first and (i - first + 1) * (width + max(longest, n_i)) > tokens:
            out.append(slice(first, i))
            first, longest = i, 0
        longest = max(longest, n_i)
    out.append(slice(first, n))
    return out


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T) -> (B, width) with zeros after column T (a trimmed micro-batch's per-token values)."""
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def policy_logprobs(head: Callable, exp: Experience, micro: int, temperature: float,
                    device: torch.device, tokens: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy (B, R) of the responses under `head` (a PolicyHead), no gradients, in
    micro-batches of at most `tokens` tokens (`micro` rows when None)."""
    logps, ents = [], []
    R = exp.response_ids.shape[1]
    for sl in token_micro_batches(exp, tokens, micro):
        part = exp.rows(sl).trimmed()
        logp, ent = head(part.input_ids.to(device), part.attention_mask.to(device), part.response_ids.to(device),
                         part.start, temperature)
        logps.append(pad_columns(logp.float().cpu(), R))
        ents.append(pad_columns(ent.float().cpu(), R))
    return torch.cat(logps), torch.cat(ents)


@torch.no_grad()
def critic_values(critic: Callable, exp: Experience, micro: int, device: torch.device,
                  tokens: Optional[int] = None) -> torch.Tensor:
    vals = []
    R = exp.response_ids.shape[1]
    for sl in token_micro_batches(exp, tokens, micro):
        part = exp.rows(sl).trimmed()
        v = critic(part.input_ids.to(device), part.attention_mask.to(device), part.start,
                   part.response_ids.shape[1])
        vals.append(pad_columns(v.float().cpu(), R))
    return torch.cat(vals)


def advantages(exp: Experience, algo_cfg, n_samples: int, kl_coef: float, reduce=None) -> Experience:
    """Fill advantages/returns with the configured estimator; the KL enters the token rewards when
    `kl_in == 'reward'`. `reduce` sums over the processes sharing the step (batch-wide statistics)."""
    mask = exp.response_mask
    kl = None
    if kl_coef > 0 and algo_cfg.kl_in == "reward" and exp.ref_logp is not None:
        kl = algos.kl_estimate(exp.old_logp, exp.ref_logp, algo_cfg.kl_estimator)
    token_rewards = algos.token_level_rewards(exp.scores, mask, kl, kl_coef if kl is not None else 0.0)
    inputs = algos.AdvantageInputs(
        mask=mask, scores=token_rewards.sum(-1) if kl is not None else exp.scores, token_rewards=token_rewards,
        values=exp.values, n_samples=n_samples, gamma=algo_cfg.gamma, lam=algo_cfg.lam,
        norm_by_std=algo_cfg.norm_adv_by_std, whiten=True, reduce=reduce)
    adv, ret = algos.compute_advantages(algo_cfg.advantage, inputs)
    return replace(exp, advantages=adv, returns=ret)
