"""edgerl's RL math against verl's own: literal transcriptions of verl's functions
(verl/trainer/ppo/core_algos.py and verl/trainer/ppo/rollout_corr_helper.py, commit b178a3c of
volcengine/verl) and slow plain-Python references, values and gradients; and `recommend --format verl`
against a transcription of verl's defaults (verl/trainer/config/_generated_ppo_trainer.yaml, same commit)."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edgerl import algos, correction
from edgerl.config.load import load_config
from edgerl.config.schema import Config, ConfigError
from edgerl.config.export import verl_overrides

SEEDS = [0, 1, 2]
VERL_TOL = 1e-7  # verl's seq-mean-token-mean divides by (tokens + 1e-8): a relative 1e-8 off the exact mean


def close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), f"max abs diff {(a - b).abs().max().item()}"


# --- verl, transcribed line for line (torch only; verl_F.masked_mean/masked_sum inlined) -------------

def verl_masked_sum(values, mask, axis=None):
    return (values * mask).sum(axis=axis) if axis is not None else (values * mask).sum()


def verl_masked_mean(values, mask, axis=None):
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) if axis is not None else mask.sum()).clamp(min=1e-8)


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        # For numerical stability
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    """agg_loss with dp_size=1 and no global batch info (one process, one micro-batch)."""
    if loss_agg_mode == "token-mean":
        return verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    raise ValueError(loss_agg_mode)


def verl_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                             rollout_is_weights=None):
    clip_ratio_low, clip_ratio_high, clip_ratio_c = config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(),
                                         response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, pg_clipfrac_lower


def verl_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - config.clip_ratio_low,
                                           1 + config.clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    return pg_loss, pg_clipfrac


def verl_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                           rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_clipfrac = verl_masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac


# rollout_corr_helper.py: the IS weights (compute_rollout_correction_weights without its metrics and batch
# normalisation, which edgerl does not do), the rejection mask for the two options edgerl's mis uses (token_k1,
# seq_sum_k1, with the threshold given as one number: lower = 1/upper), and compute_offpolicy_metrics' k3_kl
SAFETY_BOUND = 20.0


def verl_rollout_correction_weights(log_ratio, response_mask, rollout_is="token", rollout_is_threshold=2.0):
    if rollout_is == "token":
        log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        rollout_is_weights = torch.exp(log_ratio_safe)
    elif rollout_is == "sequence":
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(log_ratio)
    else:
        raise ValueError(rollout_is)
    rollout_is_weights = rollout_is_weights * response_mask
    rollout_is_weights = rollout_is_weights.clamp(max=rollout_is_threshold)
    return rollout_is_weights.detach()


def verl_rollout_rejection_mask(log_ratio, response_mask, option_name, rollout_rs_threshold):
    upper = float(str(rollout_rs_threshold))
    lower = float(str(1.0 / float(str(rollout_rs_threshold))))
    lower_log, upper_log = math.log(lower), math.log(upper)
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token_k1 = -log_ratio_safe
    response_mask_bool = response_mask.bool()
    combined_mask = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    if option_name == "token_k1":
        per_token_stat = token_k1
        token_keep_bool = (per_token_stat >= lower_log) & (per_token_stat <= upper_log)
    elif option_name == "seq_sum_k1":
        seq_stat = verl_masked_sum(token_k1, response_mask, axis=-1)
        seq_keep_bool_direct = (seq_stat >= lower_log) & (seq_stat <= upper_log)
        token_keep_bool = seq_keep_bool_direct.unsqueeze(-1).expand_as(response_mask_bool)
    else:
        raise ValueError(option_name)
    token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
    combined_mask = combined_mask * token_keep_mask
    return (response_mask * combined_mask).to(dtype=response_mask.dtype)


def verl_k3_kl(old_log_prob, rollout_log_prob, response_mask):
    log_ratio = old_log_prob - rollout_log_prob
    k3_kl_matrix = torch.exp(log_ratio) - log_ratio - 1
    return verl_masked_mean(k3_kl_matrix, response_mask)


# --- cases ---------------------------------------------------------------------------------------

def case(seed, B=9, T=8, spread=0.6):
    """Ragged masks with an empty row, a one-token row and a full row; one advantage per sequence
    on some rows (GRPO) and per token on others (GAE); masked positions zero, as verl's tensors."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen).tolist()
    lengths[1], lengths[2], lengths[3] = 0, 1, T
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    logp[3, :3] = old[3, :3] + math.log(5.0)  # far outside every clip range
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T).clone()
    adv[5:] = torch.randn(B - 5, T, generator=gen, dtype=torch.float64)
    adv[3, :3] = torch.tensor([-1.0, -0.5, 2.0], dtype=torch.float64)
    return logp * mask, old * mask, adv * mask, mask


def grads(fn, logp):
    lp = logp.clone().requires_grad_(True)
    out = fn(lp)
    loss = out[0] if isinstance(out, tuple) else out
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


# --- k3 ("low_var_kl") ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, verl_name", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_estimators_equal_verls_values_and_gradients(kind, verl_name):
    # log-ratios from -30 to 30: both clamps of k3 (d beyond +-20, and k3 above 10) are crossed
    d = torch.linspace(-30, 30, 241, dtype=torch.float64)
    ref = torch.full_like(d, -2.0)
    logp = ref - d
    ours, g_ours = grads(lambda lp: algos.kl_estimate(lp, ref, kind).sum(), logp)
    theirs, g_theirs = grads(lambda lp: verl_kl_penalty_forward(lp, ref, verl_name).sum(), logp)
    close(ours, theirs)
    close(g_ours, g_theirs)
    if kind == "k3":
        k3 = algos.kl_estimate(logp, ref, "k3")
        over = k3 >= 10.0
        assert over.sum() > 100 and (~over).sum() > 20
        assert (g_ours[over] == 0).all()   # where k3 is clamped at 10, no gradient (was up to e^20)
        assert g_ours.abs().max() < 13     # |d k3/d logp| = |e^d - 1| below the clamp, where d < 2.61


def test_kl_loss_through_edgerl_matches_verls_kl_loss():
    logp, old, adv, mask = case(0, spread=3.0)   # wide: some tokens exceed the k3 clamp
    ref = old
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        m = mask.clone()
        m[1] = 0
        ours = grads(lambda lp: algos.kl_loss(lp, ref, m, "k3", mode), logp)
        theirs = grads(lambda lp: verl_agg_loss(verl_kl_penalty_forward(lp, ref, "low_var_kl"), m, mode), logp)
        close(ours[0], theirs[0], VERL_TOL)
        close(ours[1], theirs[1], VERL_TOL)


# --- policy losses --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("clips", [(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
def test_ppo_equals_verl_vanilla(seed, mode, clips):
    """edgerl's dual clip off is verl's clip_ratio_c at the exported never-binding bound."""
    from edgerl.config.export import VERL_NO_DUAL_CLIP
    lo, hi, dc = clips
    logp, old, adv, mask = case(seed)
    cfg = SimpleNamespace(clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=dc or VERL_NO_DUAL_CLIP)
    algo = settings("ppo", lo, hi, dc, mode)
    ours = grads(lambda lp: algos.compute_policy_loss("ppo", lp, old, adv, mask, algo), logp)
    theirs = grads(lambda lp: verl_policy_loss_vanilla(old, lp, adv, mask, mode, cfg), logp)
    close(ours[0], theirs[0], VERL_TOL)
    close(ours[1], theirs[1], VERL_TOL)
    _, stats = algos.compute_policy_loss("ppo", logp, old, adv, mask, algo)
    _, clipfrac, lower = verl_policy_loss_vanilla(old, logp, adv, mask, mode, cfg)
    close(stats["clip_frac"], clipfrac)
    close(stats["dual_clip_frac"], lower)
    if dc is not None:
        assert lower > 0  # the planted tokens meet the dual clip
    else:
        assert lower == 0


def ref_gspo(logp, old, adv, mask, lo, hi):
    """Slow and obvious: per sequence, s = exp(mean log-ratio) (log clamped above at 10); per token
    max(-A s, -A clip(s)); the loss is the mean over non-empty sequences of their token means. The
    gradient on token t of sequence b: -A_bt s_b / (n_b x rows) where the unclipped branch is
    active and the log-ratio is not clamped, else 0."""
    rows = [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    full = [b for b, idx in enumerate(rows) if idx]
    total, grad, clipped, n_tok = 0.0, torch.zeros_like(logp), 0, 0
    for b in full:
        idx = rows[b]
        mean_lr = sum(logp[b, t].item() - old[b, t].item() for t in idx) / len(idx)
        s = math.exp(min(mean_lr, 10.0))
        seq = 0.0
        for t in idx:
            a = adv[b, t].item()
            l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
            seq += max(l1, l2)
            clipped += l2 > l1
            n_tok += 1
            if l1 >= l2 and mean_lr <= 10.0:
                grad[b, t] = -a * s / (len(idx) * len(full))
        total += seq / len(idx)
    return total / len(full), grad, clipped / n_tok


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clips", [(3e-4, 4e-4), (0.2, 0.2), (0.05, 0.1)])
def test_gspo_matches_slow_reference_and_verl(seed, clips):
    lo, hi = clips
    logp, old, adv, mask = case(seed, spread=0.05)  # sequence ratios near 1: both branches occur
    logp[4, 0] = old[4, 0] + 200.0 * mask[4].sum()  # one sequence whose log-ratio passes the clamp at 10
    loss, g = grads(lambda lp: algos.gspo_loss(lp, old, adv, mask, lo, hi), logp)
    ref_loss, ref_g, ref_frac = ref_gspo(logp, old, adv, mask, lo, hi)
    close(loss, ref_loss)
    close(g, ref_g)
    _, stats = algos.gspo_loss(logp, old, adv, mask, lo, hi)
    close(stats["clip_frac"], ref_frac)
    cfg = SimpleNamespace(clip_ratio_low=lo, clip_ratio_high=hi)
    theirs, g_theirs = grads(lambda lp: verl_policy_loss_gspo(old, lp, adv, mask, cfg), logp)
    close(loss, theirs, VERL_TOL)
    close(g, g_theirs, VERL_TOL)
    close(stats["clip_frac"], verl_policy_loss_gspo(old, logp, adv, mask, cfg)[1])


def ref_cispo(logp, old, adv, mask, lo, hi, mode):
    """Slow and obvious: per token w = clip(exp(clamp(logp - old, +-20)), 1 - lo, 1 + hi), loss
    -w A logp, gradient -w A (w is a constant), both weighted as the aggregation weighs the token."""
    rows = [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    n_tok, full = sum(map(len, rows)), [b for b, idx in enumerate(rows) if idx]
    total, grad, clipped = 0.0, torch.zeros_like(logp), 0
    for b in full:
        for t in rows[b]:
            r = math.exp(min(max(logp[b, t].item() - old[b, t].item(), -20.0), 20.0))
            w = min(max(r, 1 - lo), 1 + hi)
            clipped += w != r
            weight = {"token-mean": 1 / n_tok, "seq-mean-token-mean": 1 / (len(full) * len(rows[b])),
                      "seq-mean-token-sum": 1 / len(full)}[mode]
            total += weight * -w * adv[b, t].item() * logp[b, t].item()
            grad[b, t] = weight * -w * adv[b, t].item()
    return total, grad, clipped / n_tok


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("clips", [(1.0, 0.2), (0.2, 0.28), (10.0, 0.2)])
def test_cispo_matches_slow_reference_and_verl(seed, mode, clips):
    lo, hi = clips
    logp, old, adv, mask = case(seed)
    loss, g = grads(lambda lp: algos.cispo_loss(lp, old, adv, mask, lo, hi, agg=mode), logp)
    ref_loss, ref_g, ref_frac = ref_cispo(logp, old, adv, mask, lo, hi, mode)
    close(loss, ref_loss)
    close(g, ref_g)
    _, stats = algos.cispo_loss(logp, old, adv, mask, lo, hi, agg=mode)
    close(stats["clip_frac"], ref_frac)
    assert 0 < ref_frac < 1
    cfg = SimpleNamespace(clip_ratio_low=lo, clip_ratio_high=hi)
    theirs, g_theirs = grads(lambda lp: verl_policy_loss_cispo(old, lp, adv, mask, mode, cfg), logp)
    close(loss, theirs, VERL_TOL)
    close(g, g_theirs, VERL_TOL)


def test_on_policy_gradients_agree():
    """At ratio 1 (one update per step) CISPO's gradient is PPO's, and GSPO's is PPO's averaged per
    sequence, when the advantage is one per sequence (GRPO): all three are -A d logp."""
    logp, _, adv, mask = case(1)
    adv = adv[:, :1].expand_as(adv) * mask
    old = logp.detach()
    for mode in ("token-mean", "seq-mean-token-mean"):
        g_ppo = grads(lambda lp: algos.policy_loss(lp, lp.detach(), adv, mask, agg=mode), logp)[1]
        g_cispo = grads(lambda lp: algos.cispo_loss(lp, lp.detach(), adv, mask, agg=mode), logp)[1]
        close(g_ppo, g_cispo)
    g_ppo = grads(lambda lp: algos.policy_loss(lp, lp.detach(), adv, mask, agg="seq-mean-token-mean"), logp)[1]
    g_gspo = grads(lambda lp: algos.gspo_loss(lp, old, adv, mask), logp)[1]
    close(g_ppo, g_gspo)


def settings(loss, clip_low=None, clip_high=None, dual_clip=None, agg=None):
    """The config's algo section a loss reads its settings from."""
    from edgerl.config.schema import AlgoConfig
    return AlgoConfig(policy_loss=loss, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, loss_agg=agg)


def test_policy_loss_bad_arguments():
    logp, old, adv, mask = case(0)
    with pytest.raises(ValueError, match="gspo has no dual clip"):
        algos.compute_policy_loss("gspo", logp, old, adv, mask, settings("gspo", dual_clip=3.0))
    with pytest.raises(ValueError, match="agg must be 'seq-mean-token-mean'"):
        algos.compute_policy_loss("gspo", logp, old, adv, mask, settings("gspo", agg="token-mean"))
    with pytest.raises(ValueError, match="cispo has no dual clip"):
        algos.compute_policy_loss("cispo", logp, old, adv, mask, settings("cispo", dual_clip=3.0))
    with pytest.raises(ValueError, match=f"choose one of {', '.join(algos.POLICY_LOSSES)}"):
        algos.compute_policy_loss("grpo", logp, old, adv, mask, settings("ppo"))


# --- rollout correction ---------------------------------------------------------------------------------

def rollout_case(seed):
    """case()'s log-probs as the trainer's old ones and the rollout engine's: token log-ratios of about
    +-0.6, three of row 3 at log 5 (past every threshold), an empty row and a one-token row."""
    logp, old, _, mask = case(seed)
    return logp, old, mask


def verl_correction(trainer, rollout, mask, mode, level, cap):
    """verl's weights for edgerl's mode: tis is rollout_is at the level; mis adds rollout_rs at the same level
    and threshold, whose rejected tokens edgerl weighs 0 (verl takes them out of the response mask)."""
    log_ratio = trainer - rollout
    w = verl_rollout_correction_weights(log_ratio, mask, level, cap)
    if mode == "mis":
        kept = verl_rollout_rejection_mask(log_ratio, mask, "token_k1" if level == "token" else "seq_sum_k1", cap)
        return w * kept, kept
    return w, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [2.0, 3.0])
def test_rollout_correction_weights_equal_verls(seed, mode, level, cap):
    trainer, rollout, mask = rollout_case(seed)
    ours, cut = correction.weights(trainer, rollout, mask, mode, level, cap)
    theirs, kept = verl_correction(trainer, rollout, mask, mode, level, cap)
    close(ours, theirs)
    if mode == "mis":
        assert torch.equal(cut, (kept == 0) & mask.bool()) and cut.any() and (~cut & mask.bool()).any()
    else:
        ratio = verl_rollout_correction_weights(trainer - rollout, mask, level, 1e30)   # verl's, before the cap
        assert torch.equal(cut, ratio > cap) and cut.any()
    close(algos.masked_mean(correction.k3(trainer, rollout, mask), mask), verl_k3_kl(trainer, rollout, mask))


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])   # the losses verl has
@pytest.mark.parametrize("mode, level", [("tis", "token"), ("tis", "sequence"), ("mis", "token"), ("mis", "sequence")])
def test_policy_losses_weighted_by_the_correction_equal_verls(loss, mode, level):
    """Values and gradients of each loss with the weights, against verl's `pg_losses * rollout_is_weights`."""
    from edgerl.config.export import VERL_NO_DUAL_CLIP
    logp, old, adv, mask = case(1)
    rollout = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=old.dtype) * mask
    w, _ = correction.weights(old, rollout, mask, mode, level, 2.0)
    theirs_w, kept = verl_correction(old, rollout, mask, mode, level, 2.0)
    own = algos.POLICY_LOSSES[loss]
    lo, hi, agg = own.clip_low, own.clip_high, own.agg or "token-mean"
    cfg = SimpleNamespace(clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=VERL_NO_DUAL_CLIP)
    verl = {"ppo": lambda lp, m: verl_policy_loss_vanilla(old, lp, adv, m, agg, cfg, theirs_w),
            "gspo": lambda lp, m: verl_policy_loss_gspo(old, lp, adv, m, cfg, theirs_w),
            "cispo": lambda lp, m: verl_policy_loss_cispo(old, lp, adv, m, agg, cfg, theirs_w)}[loss]
    ours = grads(lambda lp: algos.compute_policy_loss(loss, lp, old, adv, mask, settings(loss), w), logp)
    theirs = grads(lambda lp: verl(lp, mask), logp)
    close(ours[0], theirs[0], VERL_TOL)
    close(ours[1], theirs[1], VERL_TOL)
    unweighted = algos.compute_policy_loss(loss, logp, old, adv, mask, settings(loss))[0]
    assert abs(float(ours[0] - unweighted)) > 1e-6   # the weights change the loss
    if mode == "mis" and agg == "token-mean":
        # verl's rejection shrinks the response mask, edgerl's keeps the rejected tokens at weight 0: with
        # token-mean the two differ by the kept share of the tokens, and only by that
        dropped = verl(logp, kept)[0]
        close(ours[0] * mask.sum(), dropped * kept.sum(), VERL_TOL)


# --- the config --------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss, clips, agg", [("ppo", (0.2, 0.2), "token-mean"),
                                              ("gspo", (3e-4, 4e-4), "seq-mean-token-mean"),
                                              ("cispo", (1.0, 0.2), "token-mean")])
def test_policy_loss_config_defaults(loss, clips, agg):
    cfg = load_config(None, [f"algo.policy_loss={loss}"])
    assert cfg.algo.clip_range() == clips and cfg.algo.loss_agg_mode() == agg
    cfg = load_config(None, [f"algo.policy_loss={loss}", "algo.clip_high=0.01"])
    assert cfg.algo.clip_range() == (clips[0], 0.01)


@pytest.mark.parametrize("sets, message", [
    (["algo.policy_loss=gspo", "algo.dual_clip=3.0"], "gspo has no dual clip"),
    (["algo.policy_loss=cispo", "algo.dual_clip=3.0"], "cispo has no dual clip"),
    (["algo.policy_loss=gspo", "algo.loss_agg=token-mean"], "leave algo.loss_agg unset or set it to seq-mean"),
    (["algo.policy_loss=grpo"], "algo.policy_loss"),
])
def test_policy_loss_config_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


# --- recommend --format verl against verl's defaults --------------------------------------------------

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
VERL_DEFAULTS = {  # _generated_ppo_trainer.yaml (and dp_actor.yaml for grad_clip) at b178a3c
    "algorithm.gamma": 1.0, "algorithm.lam": 1.0, "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    f"{A}.policy_loss.loss_mode": "vanilla", f"{A}.clip_ratio_low": 0.2, f"{A}.clip_ratio_high": 0.2,
    f"{A}.clip_ratio_c": 3.0, f"{A}.loss_agg_mode": "token-mean", f"{A}.entropy_coeff": 0,
    f"{A}.use_kl_loss": False, f"{A}.kl_loss_coef": 0.001, f"{A}.kl_loss_type": "low_var_kl",
    f"{A}.ppo_epochs": 1, f"{A}.grad_clip": 1.0, f"{A}.optim.lr": 1e-6, f"{A}.optim.weight_decay": 0.01,
    f"{A}.optim.betas": [0.9, 0.999], f"{A}.optim.lr_warmup_steps_ratio": 0.0,
    f"{A}.optim.lr_scheduler_type": "constant", f"{A}.optim.min_lr_ratio": 0.0,
    f"{R}.temperature": 1.0, f"{R}.top_p": 1, f"{R}.top_k": -1, f"{R}.ignore_eos": False,
    "critic.optim.lr": 1e-5, "critic.cliprange_value": 0.5, "critic.grad_clip": 1.0,
    "critic.optim.weight_decay": 0.01, "critic.optim.betas": [0.9, 0.999],
    "critic.optim.lr_warmup_steps_ratio": 0.0, "critic.optim.lr_scheduler_type": "constant",
    "critic.optim.min_lr_ratio": 0.0,
    f"{R}.calculate_log_probs": False, "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_is_threshold": 2.0, "algorithm.rollout_correction.rollout_rs": None,
    "algorithm.rollout_correction.rollout_rs_threshold": None, "algorithm.rollout_correction.bypass_mode": False,
    "algorithm.rollout_correction.rollout_is_batch_normalize": False,
}
VERL_KL = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _parse(v: str):
    if v in ("True", "False"):
        return v == "True"
    if v == "null":
        return None
    if v.startswith("["):
        return [_parse(x) for x in v[1:-1].split(",")]
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def verl_effective(cfg: Config) -> dict:
    """verl's setting of every key above once the exported overrides are applied."""
    from edgerl.config.target import plan_for, resolve_target
    from fakes import fake_probe
    target = resolve_target("rtx3090", probe_fn=lambda: fake_probe(None, torch_cuda=None))
    lines, _ = verl_overrides(cfg, plan_for(cfg, target))
    out = dict(VERL_DEFAULTS)
    for line in lines:
        key, _, value = line.partition("=")
        out[key.lstrip("+")] = _parse(value)
    return out


@pytest.mark.parametrize("sets", [
    [],
    ["algo.advantage=gae", "algo.kl_in=reward", "algo.kl_target=0.02", "algo.kl_estimator=k1",
     "algo.entropy_coef=0.01", "train.weight_decay=0.1", "train.lr_schedule=cosine", "train.warmup_ratio=0.1",
     "train.min_lr_ratio=0.1", "rollout.top_k=50", "rollout.stop_at_eos=false", "algo.lam=0.9"],
    ["algo.policy_loss=gspo", "algo.kl_coef=0", "algo.gamma=0.99"],
    ["algo.policy_loss=cispo", "algo.clip_high=0.28", "algo.advantage=rloo", "algo.kl_estimator=k2"],
    ["algo.dual_clip=3.0", "algo.clip_high=0.28", "algo.norm_adv_by_std=false", "algo.loss_agg=seq-mean-token-sum",
     "rollout.temperature=0.7", "rollout.top_p=0.9", "train.max_grad_norm=0.5", "train.betas=[0.9, 0.95]"],
    ["algo.rollout_correction=mis", "algo.rollout_correction_level=sequence", "algo.rollout_correction_threshold=3.0"],
    ["algo.rollout_correction=mis"],
    ["algo.rollout_correction=none"],
])
def test_verl_export_trains_like_edgerl(sets):
    cfg = load_config(None, sets + ["model.path=qwen2.5-0.5b"])
    a, t, r = cfg.algo, cfg.train, cfg.rollout
    v = verl_effective(cfg)
    lo, hi = a.clip_range()
    expect = {
        "algorithm.adv_estimator": algos.ESTIMATORS[a.advantage].verl_name,
        "algorithm.gamma": a.gamma, "algorithm.lam": a.lam, "algorithm.norm_adv_by_std_in_grpo": a.norm_adv_by_std,
        f"{A}.policy_loss.loss_mode": algos.POLICY_LOSSES[a.policy_loss].verl_name,
        f"{A}.clip_ratio_low": lo, f"{A}.clip_ratio_high": hi, f"{A}.loss_agg_mode": a.loss_agg_mode(),
        f"{A}.entropy_coeff": a.entropy_coef, f"{A}.ppo_epochs": t.ppo_epochs, f"{A}.grad_clip": t.max_grad_norm,
        f"{A}.optim.lr": t.lr, f"{A}.optim.weight_decay": t.weight_decay, f"{A}.optim.betas": t.betas,
        f"{A}.optim.lr_warmup_steps_ratio": t.warmup_ratio, f"{A}.optim.lr_scheduler_type": t.lr_schedule,
        f"{A}.optim.min_lr_ratio": t.min_lr_ratio,
        f"{R}.temperature": r.temperature, f"{R}.top_p": r.top_p, f"{R}.top_k": r.top_k if r.top_k else -1,
        f"{R}.ignore_eos": not r.stop_at_eos,
        f"{A}.use_kl_loss": a.kl_coef > 0 and a.kl_in == "loss",
        "algorithm.use_kl_in_reward": a.kl_coef > 0 and a.kl_in == "reward",
    }
    for key, want in expect.items():
        assert v[key] == want, (key, v[key], want)
    if a.kl_coef > 0:
        estimator_key = f"{A}.kl_loss_type" if a.kl_in == "loss" else "algorithm.kl_penalty"
        coef_key = f"{A}.kl_loss_coef" if a.kl_in == "loss" else "algorithm.kl_ctrl.kl_coef"
        assert VERL_KL[v[estimator_key]] == a.kl_estimator and v[coef_key] == a.kl_coef
        if a.kl_in == "reward":
            assert v["algorithm.kl_ctrl.type"] == ("adaptive" if a.kl_target else "fixed")
            if a.kl_target:
                assert v["algorithm.kl_ctrl.target_kl"] == a.kl_target
                assert v["algorithm.kl_ctrl.horizon"] == a.kl_horizon
    if a.policy_loss == "ppo":  # verl always applies its dual clip; off must mean a bound that never binds
        c = v[f"{A}.clip_ratio_c"]
        assert c == a.dual_clip if a.dual_clip is not None else c > math.exp(20.0)
    # the rtx3090 plans bf16, so the rollout correction is tis unless the config says otherwise
    mode, level, cap = a.rollout_correction or "tis", a.rollout_correction_level, a.rollout_correction_threshold
    rc = "algorithm.rollout_correction"
    assert v[rc + ".bypass_mode"] is False and v[rc + ".rollout_is_batch_normalize"] is False
    if mode == "none":
        assert v[rc + ".rollout_is"] is None and v[rc + ".rollout_rs"] is None
    else:
        assert v[f"{R}.calculate_log_probs"] is True
        assert (v[rc + ".rollout_is"], v[rc + ".rollout_is_threshold"]) == (level, cap)
        rs = {"token": "token_k1", "sequence": "seq_sum_k1"}[level] if mode == "mis" else None
        assert (v[rc + ".rollout_rs"], v[rc + ".rollout_rs_threshold"]) == (rs, cap if rs else None)
    if algos.ESTIMATORS[a.advantage].critic:
        for key, want in {"critic.optim.lr": t.critic_lr, "critic.cliprange_value": a.value_clip,
                          "critic.grad_clip": t.max_grad_norm, "critic.optim.weight_decay": t.weight_decay,
                          "critic.optim.betas": t.betas, "critic.optim.lr_warmup_steps_ratio": t.warmup_ratio,
                          "critic.optim.lr_scheduler_type": t.lr_schedule,
                          "critic.optim.min_lr_ratio": t.min_lr_ratio}.items():
            assert v[key] == want, (key, v[key], want)


def test_verl_export_says_what_verl_cannot_match():
    from edgerl.config.export import verl_algorithm
    cfg = load_config(None, ["algo.kl_target=0.02", "algo.loss_agg=seq-mean-token-sum-norm", "train.warmup_ratio=0.1"])
    _, caveats = verl_algorithm(cfg, critic=False)
    text = " ".join(caveats)
    assert "KL loss keeps actor.kl_loss_coef=0.001 fixed" in text
    assert "seq-mean-token-sum-norm" in text and "warm-up" in text
    assert verl_algorithm(load_config(None, []), critic=False)[1] == []


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_policy_losses_train_in_the_loop(tiny_llama, tmp_path, loss):
    """Wired into the update: two epochs (so the ratios leave 1 and the clips act), finite metrics."""
    from conftest import prepare_trainer
    from edgerl.train.metrics import read_metrics
    t = prepare_trainer(tiny_llama, tmp_path / "run", [
        'run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=64", "train.lr=1e-3", "train.steps=1", "train.ppo_epochs=2",
        "run.save_every=0", "run.export_final=false", f"algo.policy_loss={loss}",
        f'reward.function="{Path(__file__).with_name("reward_fns.py")}:vowel_share"'])  # scores that vary
    t.run()
    row = read_metrics(tmp_path / "run")[-1]
    for key in ("actor/pg_loss", "actor/clip_frac", "actor/approx_kl", "actor/ratio_mean", "actor/grad_norm"):
        assert math.isfinite(row[key]), (key, row[key])
    assert row["actor/approx_kl"] > 0  # the second epoch saw moved log-probs


# --- the registry -------------------------------------------------------------------------------------

def _reinforce_slow(logp, adv, mask, agg):
    """-A * logp aggregated, in plain loops: token-mean over every valid token, or the mean over rows of each
    row's token mean (rows without a valid token left out)."""
    rows = []
    for b in range(logp.shape[0]):
        terms = [-adv[b, t] * logp[b, t] for t in range(logp.shape[1]) if mask[b, t]]
        rows.append(terms)
    if agg == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / max(1, len(flat))
    assert agg == "seq-mean-token-mean", agg
    means = [sum(r) / len(r) for r in rows if r]
    return sum(means) / max(1, len(means))


@pytest.mark.parametrize("loss", sorted(algos.POLICY_LOSSES))
def test_every_registered_loss_is_the_policy_gradient_on_policy_and_documented(loss):
    """At ratio 1 (the log-probs the samples were drawn with) every policy loss's gradient is REINFORCE's under
    its aggregation, whatever it does once the policy moves; and docs/policy-losses.md has its row."""
    logp, _, adv, mask = case(2)
    algo = settings(loss)
    ours = grads(lambda lp: algos.compute_policy_loss(loss, lp, lp.detach(), adv, mask, algo), logp)[1]
    ref = grads(lambda lp: _reinforce_slow(lp, adv, mask, algo.loss_agg_mode()), logp)[1]
    close(ours, ref)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "policy-losses.md").read_text()
    assert f"| `{loss}`" in doc, f"docs/policy-losses.md has no row for the policy loss {loss}"


def test_a_registered_loss_is_a_config_choice_and_trains_with_its_settings(tiny_llama, tmp_path, monkeypatch):
    """A new loss is its function under register_loss: the config accepts its name (and lists it when another is
    wrong), the trainer hands it the algo section, and a run trains with it."""
    from conftest import prepare_trainer
    from edgerl.config.schema import ConfigError
    from edgerl.train.metrics import read_metrics
    monkeypatch.setattr(algos, "POLICY_LOSSES", dict(algos.POLICY_LOSSES))
    seen = []

    @algos.register_loss("reinforce-test", clip_low=0.0, clip_high=0.0, paper="a test")
    def reinforce(logp, old_logp, advantages, mask, algo, weights=None):
        seen.append((algo.clip_range(), algo.loss_agg_mode(), algo.entropy_coef))
        return algos.aggregate(-advantages * logp, mask, algo.loss_agg_mode()), {}

    cfg = load_config(None, ["algo.policy_loss=reinforce-test", "algo.clip_high=0.5"])
    assert cfg.algo.clip_range() == (0.0, 0.5) and cfg.algo.loss_agg_mode() == "token-mean"
    with pytest.raises(ConfigError, match="algo.policy_loss: 'reinforce-tst' is not one of .*'reinforce-test'.*"
                                          "did you mean 'reinforce-test'"):
        load_config(None, ["algo.policy_loss=reinforce-tst"])
    t = prepare_trainer(tiny_llama, tmp_path / "run", [
        'run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=64", "train.steps=1", "run.save_every=0",
        "run.export_final=false", "algo.policy_loss=reinforce-test", "algo.clip_high=0.5", "algo.entropy_coef=0.01",
        f'reward.function="{Path(__file__).with_name("reward_fns.py")}:vowel_share"'])
    t.run()
    assert seen and set(seen) == {((0.0, 0.5), "token-mean", 0.01)}
    assert math.isfinite(read_metrics(tmp_path / "run")[-1]["actor/pg_loss"])
