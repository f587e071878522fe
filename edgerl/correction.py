"""Rollout correction: importance weights of the trainer's log-probs against the rollout engine's, for the
policy loss (`algo.rollout_correction`, docs/rollout-correction.md).

The engine samples with its own numerics (16-bit compute, CUDA graphs, Triton or CUDA C kernels, vLLM), so
the distribution it sampled from, pi_rollout, is not quite the trainer's pi_old. With the per-token log-ratio
    d_t = old_logp_t - sampled_logp_t                 (log pi_old / pi_rollout)
the ratio is rho_t = exp(d_t) per token (level "token"), or one per sequence, the product of its token
ratios, rho_b = exp(sum_t d_t) (level "sequence"), each log clamped to [-20, 20] before exp as verl does.
  tis (truncated importance sampling):  w = min(rho, C)
  mis (masked importance sampling):     w = min(rho, C) where the unit lies inside [1/C, C], else 0
C is the threshold. The weights multiply each token's policy loss, detached, as verl's
`rollout_is_weights` do. mis is verl's truncated weights at the same level together with its rejection
filter (`token_k1` or `seq_sum_k1` with the default lower bound 1/C); a masked token keeps its place in the
loss's denominator with weight 0, as in TRL and ms-swift (verl drops it from the response mask).

Same conventions as edgerl.algos: (B, T) tensors, `mask` 1 on real response tokens; every output is 0 at
masked positions, and a row with no valid token gives no NaN. Imports torch only.
"""

from __future__ import annotations

import math

import torch

MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence")
SAFETY_BOUND = 20.0   # log-ratios are clamped to +-20 before exp (e^20 ~ 4.9e8), as verl's


def _check(old_logp: torch.Tensor, sampled_logp: torch.Tensor, mask: torch.Tensor, mode: str, level: str,
           threshold: float) -> None:
    if mode not in MODES[1:]:
        raise ValueError(f"rollout correction {mode!r}: choose one of {', '.join(MODES[1:])}")
    if level not in LEVELS:
        raise ValueError(f"rollout correction level {level!r}: choose one of {', '.join(LEVELS)}")
    if not threshold > 1.0:
        raise ValueError(f"rollout correction threshold must be > 1 (weights are capped at it, and mis keeps "
                         f"[1/threshold, threshold]); got {threshold}")
    for name, t in (("old_logp", old_logp), ("sampled_logp", sampled_logp)):
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}")


@torch.no_grad()
def weights(old_logp: torch.Tensor, sampled_logp: torch.Tensor, mask: torch.Tensor, mode: str,
            level: str = "token", threshold: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (B, T), cut (B, T) bool): the correction weights (fp32, or the inputs' dtype if wider), 0 at
    masked positions, and where the cap bit (tis: the ratio was above C) or the unit was masked (mis). At the
    sequence level every token of a sequence carries its sequence's weight and flag."""
    _check(old_logp, sampled_logp, mask, mode, level, threshold)
    m = mask.bool()
    d = _log_ratio(old_logp, sampled_logp, m)
    if level == "token":
        log_rho = d
        # verl's token_k1 filter reads the clamped token log-ratio
        log_kept = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    else:
        log_rho = d.sum(1, keepdim=True).expand_as(d)
        # verl's seq_sum_k1 filter sums the clamped token log-ratios; the weight clamps the sum
        log_kept = d.clamp(-SAFETY_BOUND, SAFETY_BOUND).sum(1, keepdim=True).expand_as(d)
    rho = torch.exp(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    w = rho.clamp(max=threshold)
    if mode == "tis":
        cut = rho > threshold
    else:
        # as verl compares: -log_ratio against log(lower) and log(upper), lower = 1/C
        k1 = -log_kept
        cut = ~((k1 >= math.log(1.0 / threshold)) & (k1 <= math.log(threshold)))
        w = torch.where(cut, 0.0, w)
    return torch.where(m, w, 0.0), cut & m


def per_unit(x: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, unit mask): `x` (B, T) per token (level token), or one value per sequence (level sequence:
    its tokens' mean, which for a per-sequence quantity is that quantity) with the rows that have a token."""
    m = mask.bool()
    if level == "token":
        return x, m
    count = m.sum(1)
    x = x if x.is_floating_point() else x.float()
    return torch.where(m, x, 0.0).sum(1) / count.clamp(min=1), count > 0


def k3(old_logp: torch.Tensor, sampled_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): k3 = rho - log rho - 1 with rho = pi_old / pi_rollout per token (0 at masked positions), whose
    mean estimates KL(pi_rollout || pi_old) over the engine's samples (verl's `rollout_corr/k3_kl`); the log
    is clamped to [-20, 20] so that a blow-up reads as a large number, not inf."""
    d = _log_ratio(old_logp, sampled_logp, mask.bool()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(d) - d - 1


def _log_ratio(old_logp: torch.Tensor, sampled_logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """old - sampled in at least fp32 (the trainer's log-probs may be 16-bit), 0 at masked positions."""
    dtype = torch.promote_types(torch.promote_types(old_logp.dtype, sampled_logp.dtype), torch.float32)
    return torch.where(m, old_logp.to(dtype) - sampled_logp.to(dtype), 0.0)
