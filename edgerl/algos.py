"""Pure tensor math for PPO, GRPO and kin: masked statistics, token rewards, KL estimators and
controllers, advantage estimators, losses and their aggregation.

Conventions: B sequences, T response tokens. `mask` is (B, T), float or bool, 1 for real response
tokens; it is read as a 0/1 mask (any non-zero counts as 1). The n samples of one prompt are
contiguous (B = prompts x n). Forward results never read values at masked positions (selection
uses `torch.where`, not multiplication, so even inf there cannot leak in), and every (B, T) output
is 0 there; gradients do flow through elementwise ops at masked positions, so inputs that carry
grad should stay finite there. A row with no valid token never produces NaN. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]   # sums a tensor over processes

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def _check(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Checks every given tensor has mask's shape; returns the mask as bool."""
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; "
                             f"pass {name} as (B, T) aligned with the response mask")
    return mask.bool()


# ----------------------------------------------------------------------------- masked statistics

def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """x, mask: same shape. Sum of x over valid elements (all, or along `dim`)."""
    z = torch.where(mask.bool(), x, 0.0)
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """x, mask: same shape. Mean over valid elements (scalar, or reduced along `dim`); 0 where
    there is no valid element."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """x, mask: same shape. Scalar variance over all valid elements; unbiased divides by n - 1
    (Bessel, as verl/TRL). 0 when there are fewer than 2 (unbiased) or 1 valid elements."""
    n = mask.bool().sum().to(x.dtype)
    sq = masked_sum((x - masked_mean(x, mask)) ** 2, mask)
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8, reduce: Reduce = None) -> torch.Tensor:
    """x, mask: same shape. (x - mean) / sqrt(var + eps) with mean and unbiased var over the valid
    elements; shift_mean=False adds the mean back (scale only). 0 at masked positions.
    reduce: a function summing a tensor over the processes that share the batch (None: this one),
    so the statistics are those of the whole batch."""
    if reduce is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=True)
    else:
        m = mask.bool()
        n = reduce(m.sum().to(torch.float64))
        mean = (reduce(masked_sum(x, m).to(torch.float64)) / n.clamp(min=1)).to(x.dtype)
        sq = reduce(masked_sum((x - mean) ** 2, m).to(torch.float64))
        var = torch.where(n > 1, sq / (n - 1).clamp(min=1), torch.zeros_like(sq)).to(x.dtype)
    w = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        w = w + mean
    return torch.where(mask.bool(), w, torch.zeros_like(w))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values, returns, mask: (B, T). Scalar 1 - var(returns - values) / var(returns) over valid
    tokens (biased variances), for logging the critic. NaN when var(returns) is 0 (undefined)."""
    m = _check(mask, values=values, returns=returns)
    var_y = masked_var(returns, m, unbiased=False)
    ev = 1 - masked_var(returns - values, m, unbiased=False) / var_y.clamp(min=torch.finfo(var_y.dtype).tiny)
    return torch.where(var_y > 0, ev, torch.full_like(ev, float("nan")))


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    # fp16/bf16 log-softmax over a large vocabulary loses the small log-probs PPO ratios depend on
    return x.to(torch.promote_types(x.dtype, torch.float32))


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits: (B, T, V), tokens: (B, T) int. Returns log p(token): (B, T) in float32 or wider.
    Plain reference; it materialises a (B, T, V) float32 log-softmax, the step's memory peak."""
    lp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits: (B, T, V). Returns the entropy of softmax(logits) per position: (B, T)."""
    lp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    return -(lp.exp() * lp).sum(-1)


# ----------------------------------------------------------------------------- rewards and KL

def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """logp, ref_logp: (B, T) log-probs of the sampled tokens under the sampling policy and the
    reference. Per-token estimate of KL(policy || ref) (Schulman, "Approximating KL divergence"):
      k1 = logp - ref_logp                       (unbiased, high variance, can be negative)
      k2 = 0.5 * (logp - ref_logp)^2             (biased, low variance, >= 0)
      k3 = exp(ref - logp) - (ref - logp) - 1    (unbiased, low variance, >= 0)
    k3 is clamped as verl's "low_var_kl" (verl/trainer/ppo/core_algos.py, kl_penalty_forward): the
    log-ratio to [-20, 20] before exp, so one token far off the reference cannot overflow fp32
    (exp(89) is inf), and the estimate itself to [-10, 10]. Where k3 would exceed 10 (a log-ratio
    above about 2.6 or below -11) the value is 10 and its gradient is 0, as in verl; without that
    clamp the gradient exp(d) - 1 reaches about e^20. Returns (B, T)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "k3":
        d = (ref_logp - logp).clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator kind={kind!r}; choose one of {KL_KINDS}")


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0) -> torch.Tensor:
    """scores: (B,), mask: (B, T), kl: optional (B, T) per-token KL estimate. Returns (B, T):
    each score on its row's last valid token, minus kl_coef * kl on every valid token ("KL in
    reward", as verl/OpenRLHF). A row with no valid token gets all zeros: its score is dropped."""
    m = _check(mask, kl=kl)
    if scores.shape != (m.shape[0],):
        raise ValueError(f"scores has shape {tuple(scores.shape)}; expected ({m.shape[0]},), "
                         "one scalar per sequence")
    pos = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, pos + 1, 0).amax(dim=1) - 1  # -1 for an empty row: matches no position
    r = torch.where(pos[None] == last[:, None], scores[:, None], 0.0)
    if kl is not None and kl_coef != 0.0:
        r = r - kl_coef * torch.where(m, kl, torch.zeros_like(kl))
    return r


class FixedKL:
    """Constant KL coefficient; `update` is a no-op so it is interchangeable with AdaptiveKL."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _need_keys(state, ("value",), "FixedKL")
        self.value = float(state["value"])


class AdaptiveKL:
    """Proportional KL controller (Ziegler et al. 2019, as in TRL/verl):
    error = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKL needs init_coef >= 0, target > 0 and horizon > 0; got "
                             f"init_coef={init_coef}, target={target}, horizon={horizon}")
        self.value, self.target, self.horizon = float(init_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """current_kl: float or 0-d tensor, the measured KL; n_steps: samples since last update."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _need_keys(state, ("value", "target", "horizon"), "AdaptiveKL")
        self.value, self.target, self.horizon = (float(state[k]) for k in ("value", "target", "horizon"))


def _need_keys(state: dict, keys: tuple[str, ...], who: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"{who}.load_state_dict: checkpoint state lacks {missing} (has {sorted(state)}); "
                       f"was it saved by a different KL controller type?")


# ----------------------------------------------------------------------------- advantages

@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float, whiten: bool = False, reduce: Reduce = None) -> tuple[torch.Tensor, torch.Tensor]:
    """token_rewards, values, mask: (B, T). Returns advantages, returns: (B, T), no gradient.
    delta_t = r_t + gamma * V_next - V_t; A_t = delta_t + gamma * lam * A_next, where "next" is
    the next *valid* token (masked tokens in between are skipped, as verl does for multi-turn
    observation tokens) and V, A are 0 after a row's last valid token. returns = A + V (taken
    before whitening). whiten=True whitens advantages over all valid tokens (verl/TRL default).
    Both outputs are 0 at masked positions."""
    m = _check(mask, token_rewards=token_rewards, values=values)
    B, T = m.shape
    adv = torch.zeros_like(values)
    next_v = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_a = torch.zeros_like(next_v)
    for t in reversed(range(T)):  # a loop over T is inherent: each step depends on the next
        a = token_rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a
        valid = m[:, t]
        next_a = torch.where(valid, a, next_a)
        next_v = torch.where(valid, values[:, t], next_v)
        adv[:, t] = torch.where(valid, a, torch.zeros_like(a))
    returns = torch.where(m, adv + values, torch.zeros_like(adv))
    return (masked_whiten(adv, m, reduce=reduce) if whiten else adv), returns


def _groups(scores: torch.Tensor, mask: torch.Tensor, n_samples: int) -> torch.Tensor:
    """Validates scores (B,) against mask (B, T) and returns scores viewed as (B/n, n)."""
    B = mask.shape[0]
    if scores.shape != (B,):
        raise ValueError(f"scores has shape {tuple(scores.shape)}; expected ({B},) to match mask")
    if n_samples < 1 or B % n_samples:
        raise ValueError(f"batch of {B} sequences is not a whole number of groups of "
                         f"n_samples={n_samples}; B must equal prompts x n_samples")
    return scores.reshape(B // n_samples, n_samples)


@torch.no_grad()
def grpo_advantages(scores: torch.Tensor, mask: torch.Tensor, n_samples: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """scores: (B,), mask: (B, T), groups of n_samples contiguous rows. Returns (B, T):
    (score - group mean) / (group std + eps) on every valid token, 0 elsewhere. The std is
    torch.std, i.e. unbiased (n - 1), matching verl. norm_by_std=False is Dr. GRPO (no division).
    A group of identical scores gives exactly 0 (stats in float64). A group of size 1 gives 0
    (verl instead passes the raw score through with mean 0, std 1; with no other sample there is
    no baseline to compare to)."""
    # Group stats in float64, and groups of identical scores set to exactly 0: in float32 a group
    # of eight 0.7s has a mean and std off by an ulp, and dividing by (std + 1e-6) turns that into a
    # spurious, same-signed advantage of about 0.056 on every sample.
    g = _groups(scores, mask, n_samples).double()
    adv = g - g.mean(dim=1, keepdim=True)
    if norm_by_std and n_samples > 1:  # torch.std of one element is NaN; adv is already 0 then
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    adv = torch.where((g.amax(1) == g.amin(1))[:, None], 0.0, adv).to(scores.dtype)
    return torch.where(mask.bool(), adv.reshape(-1, 1), 0.0)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, mask: torch.Tensor, n_samples: int) -> torch.Tensor:
    """scores: (B,), mask: (B, T), groups of n_samples contiguous rows. Returns (B, T):
    score_i - mean of the other n - 1 scores of its group (Ahmadian et al. 2024), on valid tokens."""
    if n_samples < 2:
        raise ValueError(f"rloo needs n_samples >= 2 (a leave-one-out baseline needs another "
                         f"sample of the same prompt); got n_samples={n_samples}")
    g = _groups(scores, mask, n_samples)
    adv = g - (g.sum(dim=1, keepdim=True) - g) / (n_samples - 1)
    return torch.where(mask.bool(), adv.reshape(-1, 1), 0.0)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor,
                            gamma: float = 1.0, reduce: Reduce = None) -> tuple[torch.Tensor, torch.Tensor]:
    """token_rewards, mask: (B, T). REINFORCE++ (Hu 2025): G_t = sum over later valid tokens
    k >= t of gamma^(number of valid tokens between) * r_k, then advantages = G whitened over all
    valid tokens of the batch (unbiased var, eps 1e-8). Returns advantages, returns (= G): (B, T),
    0 at masked positions. For prefix masks this equals verl's
    compute_reinforce_plus_plus_outcome_advantage."""
    m = _check(mask, token_rewards=token_rewards)
    ret = torch.zeros_like(token_rewards)
    running = torch.zeros(m.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(m.shape[1])):
        g = token_rewards[:, t] + gamma * running
        running = torch.where(m[:, t], g, running)
        ret[:, t] = torch.where(m[:, t], g, torch.zeros_like(g))
    return masked_whiten(ret, m, reduce=reduce), ret


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an advantage estimator may read. mask, token_rewards, values: (B, T); scores: (B,),
    the sequence scores (grpo and rloo read these only, so a KL-in-reward penalty reaches them when
    the caller passes scores = token_rewards.sum(-1), as verl does); n_samples: group size."""
    mask: torch.Tensor
    scores: torch.Tensor
    token_rewards: torch.Tensor
    values: torch.Tensor | None = None
    n_samples: int = 1
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    whiten: bool = True
    reduce: Reduce = None       # sums over the processes sharing the batch, for batch-wide statistics


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: fn(AdvantageInputs) -> (advantages (B, T), returns (B, T) or None)."""
    name: str
    fn: Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]
    critic: bool        # needs values from a learned critic (and trains it on the returns)
    groups: bool        # compares the samples of one prompt: needs n_samples >= 2
    verl_name: str      # algorithm.adv_estimator in verl


ESTIMATORS: dict[str, Estimator] = {}


def estimator(name: str, *, critic: bool = False, groups: bool = False, verl_name: str | None = None):
    """Register an advantage estimator under `name` (the value of algo.advantage). Adding one is this
    decorator on a function of AdvantageInputs, and a test against a slow reference."""
    def register(fn):
        ESTIMATORS[name] = Estimator(name, fn, critic, groups, verl_name or name)
        return fn
    return register


def _need(name: str, **kw) -> None:
    for k, v in kw.items():
        if v is None:
            raise ValueError(f"advantage estimator {name!r} needs {k}=...; it was not given")


@estimator("gae", critic=True)
def _gae(x: AdvantageInputs):
    _need("gae", values=x.values)
    return gae(x.token_rewards, x.values, x.mask, x.gamma, x.lam, whiten=x.whiten, reduce=x.reduce)


@estimator("grpo", groups=True)
def _grpo(x: AdvantageInputs):
    return grpo_advantages(x.scores, x.mask, x.n_samples, norm_by_std=x.norm_by_std), None


@estimator("rloo", groups=True)
def _rloo(x: AdvantageInputs):
    return rloo_advantages(x.scores, x.mask, x.n_samples), None


@estimator("reinforce++", verl_name="reinforce_plus_plus")
def _reinforce_pp(x: AdvantageInputs):
    return reinforce_pp_advantages(x.token_rewards, x.mask, x.gamma, reduce=x.reduce)


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered estimator `name` on `inputs`. Returns advantages (B, T) and returns (B, T) or
    None (returns train the critic; only gae and reinforce++ define them)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name].fn(inputs)


# ----------------------------------------------------------------------------- losses

def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """loss_mat, mask: (B, T). Returns a scalar. With n_b = valid tokens of row b, s_b = their sum,
    R = rows with n_b > 0 (fully masked rows are skipped in seq-means, never NaN):
      token-mean:              sum_b s_b / sum_b n_b           (0 if no valid token)
      seq-mean-token-mean:     mean over b in R of s_b / n_b   (0 if R is empty)
      seq-mean-token-sum:      mean over b in R of s_b         (0 if R is empty)
      seq-mean-token-sum-norm: sum_b s_b / (B * T)             (Dr. GRPO; T = mask.shape[1], the
                               padded max length, a constant, so no length bias. verl's mode of
                               that name divides by T only, i.e. B times larger.)"""
    m = _check(mask, loss_mat=loss_mat)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, m) / (m.shape[0] * m.shape[1])
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_seq = masked_sum(loss_mat, m, dim=1)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / m.sum(1).clamp(min=1).to(per_seq.dtype)
        return masked_mean(per_seq, m.any(dim=1))
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")


def batch_counts(mask: torch.Tensor) -> tuple[float, float, float]:
    """mask: (B, T). (valid tokens, rows with a valid token, rows): what `aggregate` divides by."""
    m = mask.bool()
    return float(m.sum()), float(m.any(dim=1).sum()), float(m.shape[0])


def accumulation_weight(part_mask: torch.Tensor, whole: tuple[float, float, float], mode: str) -> float:
    """The share of a micro-batch (part_mask, (b, T)) in the loss of the batch it belongs to, whose
    `batch_counts` are `whole`: sum over micro-batches of weight x aggregate(part) equals
    aggregate(whole batch) for every mode (the batch may span several processes)."""
    tokens, rows, n = batch_counts(part_mask)
    if mode == "token-mean":
        return tokens / max(1.0, whole[0])
    if mode == "seq-mean-token-sum-norm":
        return n / whole[2]
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return rows / max(1.0, whole[1])
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logp (with grad), old_logp, advantages, mask: (B, T). PPO clipped surrogate per token:
      r = exp(logp - old_logp)  (log-ratio clamped to [-20, 20] as verl, against overflow)
      l = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))   (clip_high > clip_low is DAPO's
                                                                    clip-higher)
      dual clip (Ye et al. 2020), only where A < 0: l = min(l, -A * dual_clip), i.e. bounded by
      dual_clip * |A|; dual_clip must be > 1.
    Returns aggregate(l, mask, agg) and stats (0-d detached tensors): clip_frac = share of valid
    tokens where the clipped branch is strictly larger; dual_clip_frac = share of valid tokens where
    the dual-clip bound replaced l (0 without dual clip); approx_kl = masked mean of k3 KL(old||new)
    = r - 1 - log r; ratio_mean = masked mean of r. `weights` (B, T), detached: each token's l is multiplied
    by its weight before aggregation (the rollout correction, edgerl/correction.py; verl's
    `rollout_is_weights`), as in every policy loss here."""
    m = _check(mask, old_logp=old_logp, advantages=advantages, logp=logp, weights=weights)
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, "
                         f"clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss of negative-advantage tokens at "
                         f"dual_clip * |A|, above the clipped surrogate); got {dual_clip}. "
                         "Use e.g. 3.0, or None to disable")
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(l1, l2)
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        dual = (advantages < 0) & (loss_mat > l3)
        loss_mat = torch.where(dual, l3, loss_mat)
    stats = _ratio_stats(logp, old_logp, ratio, l2 > l1, dual, m)
    return aggregate(_weighted(loss_mat, weights), m, agg), stats


def _weighted(loss_mat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return loss_mat if weights is None else loss_mat * weights.detach().to(loss_mat.dtype)


def _ratio_stats(logp: torch.Tensor, old_logp: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor,
                 dual: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics every policy loss reports (0-d, detached). approx_kl is k3 of the token ratios
    without kl_estimate's clamp of the estimate at 10: a diagnostic should show a blow-up."""
    with torch.no_grad():
        d = (logp.detach() - old_logp).clamp(-20.0, 20.0)
        return {"clip_frac": masked_mean(clipped.to(logp.dtype), m),
                "dual_clip_frac": masked_mean(dual.to(logp.dtype), m),
                "approx_kl": masked_mean(torch.exp(d) - d - 1, m),
                "ratio_mean": masked_mean(ratio.detach(), m)}


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, dual_clip: float | None = None,
              agg: str = "seq-mean-token-mean", weights: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logp (with grad), old_logp, advantages, mask: (B, T). GSPO (Zheng et al. 2025, "Group Sequence
    Policy Optimization"): one importance ratio per sequence, the geometric mean of its token ratios,
      s_b = exp(mean over the valid tokens t of row b of (logp - old_logp))
    and PPO's clipped surrogate on it, l = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high)), averaged
    per sequence (agg must be seq-mean-token-mean). As verl's compute_policy_loss_gspo, every token
    carries s_b in value with the gradient s_b * d logp_t (log s_bt = sg(log s_b) + logp_t - sg(logp_t)),
    so the per-sequence mean of the token gradients is d s_b; log s is clamped above at 10. The clip
    ranges are small because s is a per-token geometric mean (the paper uses 3e-4 and 4e-4); no dual
    clip. `weights` as policy_loss's. Returns (loss, stats as policy_loss; ratio_mean is the mean of s over valid
    tokens)."""
    m = _check(mask, old_logp=old_logp, advantages=advantages, logp=logp, weights=weights)
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, "
                         f"clip_high={clip_high}")
    if dual_clip is not None:
        raise ValueError("gspo has no dual clip; leave dual_clip unset")
    if agg != "seq-mean-token-mean":
        raise ValueError(f"gspo's ratio is one per sequence, so its loss is a mean over sequences: "
                         f"agg must be 'seq-mean-token-mean', got {agg!r}")
    seq_log = masked_sum(logp - old_logp, m, dim=1) / m.sum(1).clamp(min=1).to(logp.dtype)
    log_s = (logp - logp.detach() + seq_log.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    l1 = -advantages * s
    l2 = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(l1, l2)
    stats = _ratio_stats(logp, old_logp, s, l2 > l1, torch.zeros_like(m), m)
    return aggregate(_weighted(loss_mat, weights), m, agg), stats


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_low: float = 1.0, clip_high: float = 0.2, dual_clip: float | None = None,
               agg: str = "token-mean", weights: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logp (with grad), old_logp, advantages, mask: (B, T). CISPO (MiniMax-M1, 2025): REINFORCE with
    a clipped, stop-gradient importance weight, so that no token's gradient is dropped by the clip:
      r = exp(logp - old_logp)  (log-ratio clamped to [-20, 20])
      l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp
    as verl's compute_policy_loss_cispo. clip_low = 1 bounds r below at 0, i.e. not at all (the
    paper's choice); no dual clip. The loss value is -A * logp, not comparable to PPO's. `weights` as
    policy_loss's. Returns (aggregate(l, mask, agg), stats as policy_loss; clip_frac = share of valid tokens
    whose weight was clipped)."""
    m = _check(mask, old_logp=old_logp, advantages=advantages, logp=logp, weights=weights)
    if not (clip_low >= 0.0 and clip_high >= 0.0):
        raise ValueError(f"need clip_low >= 0 and clip_high >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None:
        raise ValueError("cispo has no dual clip; leave dual_clip unset")
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    loss_mat = -weight * advantages * logp
    stats = _ratio_stats(logp, old_logp, ratio, ratio.detach() != weight, torch.zeros_like(m), m)
    return aggregate(_weighted(loss_mat, weights), m, agg), stats


class LossSettings(Protocol):
    """What a policy loss reads from the config's algo section (edgerl.config.schema.AlgoConfig has it all): the
    clip range and the aggregation in effect (the ones set, else the loss's own from its registration), the dual
    clip. A loss that needs a setting of its own reads a field it adds to AlgoConfig."""
    dual_clip: float | None

    def clip_range(self) -> tuple[float, float]: ...

    def loss_agg_mode(self) -> str: ...


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: fn(logp, old_logp, advantages, mask, algo, weights) -> (loss, stats), `algo` the
    config's algo section (`LossSettings`), `weights` the rollout correction's (B, T) or None; with the clip range
    it uses when the config leaves it unset."""
    name: str
    fn: LossFn
    clip_low: float
    clip_high: float
    agg: str | None        # the aggregation the loss needs; None: any (algo.loss_agg, token-mean by default)
    dual_clip: bool        # takes a dual-clip bound
    verl_name: str         # actor.policy_loss.loss_mode in verl
    paper: str


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_loss(name: str, *, clip_low: float, clip_high: float, paper: str, agg: str | None = None,
                  dual_clip: bool = False, verl_name: str | None = None) -> Callable[[LossFn], LossFn]:
    """Register a policy loss under `name` (the value of algo.policy_loss), as verl's register_policy_loss does.
    Adding one is this decorator on a function of (logp, old_logp, advantages, mask, algo, weights), its test
    against a slow reference, and its row in docs/policy-losses.md; the config's choices, its defaults and
    checks, the trainer and the verl export read the registry."""
    def register(fn: LossFn) -> LossFn:
        POLICY_LOSSES[name] = PolicyLoss(name, fn, clip_low, clip_high, agg, dual_clip, verl_name or name, paper)
        return fn
    return register


@register_loss("ppo", clip_low=0.2, clip_high=0.2, dual_clip=True, verl_name="vanilla", paper="Schulman et al. 2017")
def _ppo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         algo: LossSettings, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lo, hi = algo.clip_range()
    return policy_loss(logp, old_logp, advantages, mask, lo, hi, algo.dual_clip, algo.loss_agg_mode(), weights)


@register_loss("gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean",
               paper="Zheng et al. 2025, arXiv:2507.18071")
def _gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          algo: LossSettings, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lo, hi = algo.clip_range()
    return gspo_loss(logp, old_logp, advantages, mask, lo, hi, algo.dual_clip, algo.loss_agg_mode(), weights)


@register_loss("cispo", clip_low=1.0, clip_high=0.2, paper="MiniMax 2025, arXiv:2506.13585")
def _cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           algo: LossSettings, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lo, hi = algo.clip_range()
    return cispo_loss(logp, old_logp, advantages, mask, lo, hi, algo.dual_clip, algo.loss_agg_mode(), weights)


def compute_policy_loss(name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, algo: LossSettings, weights: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered policy loss `name` with the settings of `algo` (the config's algo section), each token's
    loss multiplied by `weights` (the rollout correction) when given. Returns (loss, stats)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name].fn(logp, old_logp, advantages, mask, algo, weights)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2, agg: str = "token-mean"
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """values (with grad), old_values, returns, mask: (B, T). Clipped value loss per token:
      v_c = old_values + clip(values - old_values, -clip, clip)
      l = 0.5 * max((values - returns)^2, (v_c - returns)^2)    (clip=None: no clipping)
    Returns aggregate(l, mask, agg) and stats: vf_clip_frac = share of valid tokens where the
    clipped error is strictly larger; vf_mean = masked mean of values."""
    m = _check(mask, values=values, old_values=old_values, returns=returns)
    loss_mat = (values - returns) ** 2
    frac = torch.zeros((), dtype=values.dtype, device=values.device)
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"value clip must be > 0 or None (no clipping); got {clip}")
        v_c = old_values + (values - old_values).clamp(-clip, clip)
        l2 = (v_c - returns) ** 2
        frac = masked_mean((l2 > loss_mat).to(values.dtype).detach(), m)
        loss_mat = torch.maximum(loss_mat, l2)
    stats = {"vf_clip_frac": frac, "vf_mean": masked_mean(values.detach(), m)}
    return 0.5 * aggregate(loss_mat, m, agg), stats


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3",
            agg: str = "token-mean") -> torch.Tensor:
    """logp (with grad), ref_logp, mask: (B, T). "KL as a loss term" (GRPO): scalar
    aggregate(kl_estimate(logp, ref_logp, kind), mask, agg); add beta times it to the loss."""
    _check(mask, logp=logp, ref_logp=ref_logp)
    return aggregate(kl_estimate(logp, ref_logp, kind), mask, agg)


def entropy_loss(entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """entropy, mask: (B, T). Scalar aggregated entropy; subtract coef times it from the loss to
    reward exploration."""
    return aggregate(entropy, mask, agg)
