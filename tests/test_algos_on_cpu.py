"""edgerl.algos against slow references written with plain Python loops over rows and tokens.

Masks are ragged (prefix of ones) with a fully masked row, a length-1 row and a full row; B and T
are not powers of two. Masked positions hold large garbage so a function that reads them fails.
"""

import math
import statistics

import pytest
import torch

from edgerl import algos

SEEDS = [0, 1, 2]
GARBAGE = 1e4  # finite (gradients pass through masked positions) but far off the valid values


def ragged_mask(B, T, gen, as_bool=False):
    lengths = torch.randint(0, T + 1, (B,), generator=gen).tolist()
    lengths[1], lengths[2], lengths[3] = 0, 1, T  # empty row, one-token row, full row
    m = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    return m.bool() if as_bool else m


def rand(B, T, gen, mask=None, scale=1.0):
    x = torch.randn(B, T, generator=gen, dtype=torch.float64) * scale
    if mask is not None:
        x = torch.where(mask.bool(), x, torch.full_like(x, GARBAGE))
    return x


def valid(mask):
    """Per row, the list of valid token indices."""
    return [[t for t, v in enumerate(row) if v] for row in mask.tolist()]


def close(a, b, tol=1e-9):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), f"max abs diff {(a - b).abs().max().item()}"


def scatter(values_per_row, mask):
    """Rows of values for the valid tokens -> (B, T) list of lists with 0 elsewhere."""
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for b, idx in enumerate(valid(mask)):
        for t, v in zip(idx, values_per_row[b]):
            out[b][t] = v
    return out


def ref_vals(x, mask):
    xs = x.tolist()
    return [xs[b][t] for b, idx in enumerate(valid(mask)) for t in idx]


def ref_mean(vals):
    return sum(vals) / len(vals) if vals else 0.0


def ref_var(vals, unbiased):
    n = len(vals)
    if n - (1 if unbiased else 0) <= 0:
        return 0.0
    mu = ref_mean(vals)
    return sum((v - mu) ** 2 for v in vals) / (n - 1 if unbiased else n)


def ref_whiten(x, mask, shift_mean=True, eps=1e-8):
    vals = ref_vals(x, mask)
    mu, var = ref_mean(vals), ref_var(vals, True)
    xs = x.tolist()
    rows = [[(xs[b][t] - mu) / math.sqrt(var + eps) + (0.0 if shift_mean else mu) for t in idx]
            for b, idx in enumerate(valid(mask))]
    return scatter(rows, mask)


def ref_aggregate(loss, mask, mode):
    ls = loss.tolist()
    rows = [[ls[b][t] for t in idx] for b, idx in enumerate(valid(mask))]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / n if n else 0.0
    if mode == "seq-mean-token-mean":
        return ref_mean([sum(r) / len(r) for r in nonempty])
    if mode == "seq-mean-token-sum":
        return ref_mean([sum(r) for r in nonempty])
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in rows) / (mask.shape[0] * mask.shape[1])
    raise AssertionError(mode)


# ----------------------------------------------------------------------------- masked statistics

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("as_bool", [False, True])
def test_masked_stats_match_loops(seed, as_bool):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(9, 13, gen, as_bool)
    x = rand(9, 13, gen, mask)
    x[~mask.bool()] = float("inf")  # forward stats must not read masked positions at all
    vals = ref_vals(x, mask)
    close(algos.masked_sum(x, mask), sum(vals))
    close(algos.masked_mean(x, mask), ref_mean(vals))
    xs = x.tolist()
    close(algos.masked_mean(x, mask, dim=1),
          [ref_mean([xs[b][t] for t in idx]) for b, idx in enumerate(valid(mask))])
    cols = [[xs[b][t] for b in range(9) if mask[b, t]] for t in range(13)]
    close(algos.masked_mean(x, mask, dim=0), [ref_mean(c) for c in cols])
    close(algos.masked_var(x, mask), ref_var(vals, True))
    close(algos.masked_var(x, mask, unbiased=False), ref_var(vals, False))
    close(algos.masked_whiten(x, mask), ref_whiten(x, mask))
    close(algos.masked_whiten(x, mask, shift_mean=False), ref_whiten(x, mask, shift_mean=False))
    w = algos.masked_whiten(x, mask)
    close(algos.masked_mean(w, mask), 0.0, tol=1e-9)
    close(algos.masked_var(w, mask), 1.0, tol=1e-6)


def test_masked_stats_degenerate_masks_give_zero_not_nan():
    x = torch.tensor([[3.0, float("nan")], [float("inf"), 5.0]])
    empty = torch.zeros(2, 2)
    one = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    for m in (empty, one):
        for v in (algos.masked_mean(x, m), algos.masked_var(x, m), algos.masked_whiten(x, m).sum()):
            assert torch.isfinite(v)
    assert algos.masked_mean(x, one).item() == 3.0
    assert algos.masked_var(x, one).item() == 0.0  # unbiased with n = 1: defined as 0
    assert algos.masked_var(x, one, unbiased=False).item() == 0.0
    assert algos.masked_mean(x, empty, dim=1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("seed", SEEDS)
def test_explained_variance(seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(7, 10, gen)
    ret, v = rand(7, 10, gen, mask), rand(7, 10, gen, mask, 0.5)
    rv, vv = ref_vals(ret, mask), ref_vals(v, mask)
    expect = 1 - ref_var([a - b for a, b in zip(rv, vv)], False) / ref_var(rv, False)
    close(algos.explained_variance(v, ret, mask), expect)
    close(algos.explained_variance(ret, ret, mask), 1.0)
    assert math.isnan(algos.explained_variance(v, torch.ones_like(ret), mask).item())


def test_logprobs_and_entropy_from_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, 7, (3, 5), generator=gen)
    lp, ent = algos.logprobs_from_logits(logits, tokens), algos.entropy_from_logits(logits)
    for b in range(3):
        for t in range(5):
            row = logits[b, t].tolist()
            z = sum(math.exp(v) for v in row)
            p = [math.exp(v) / z for v in row]
            assert abs(lp[b, t].item() - math.log(p[tokens[b, t]])) < 1e-9
            assert abs(ent[b, t].item() + sum(q * math.log(q) for q in p)) < 1e-9


# ----------------------------------------------------------------------------- rewards and KL

@pytest.mark.parametrize("seed", SEEDS)
def test_token_level_rewards(seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(9, 11, gen)
    mask[4] = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.float64)  # not a prefix
    scores = torch.randn(9, generator=gen, dtype=torch.float64)
    kl = rand(9, 11, gen, mask)
    for coef in (0.0, 0.05):
        got = algos.token_level_rewards(scores, mask, kl=kl, kl_coef=coef)
        expect = []
        for b, idx in enumerate(valid(mask)):
            row = [0.0] * 11
            for t in idx:
                row[t] -= coef * kl[b, t].item()
            if idx:
                row[idx[-1]] += scores[b].item()
            expect.append(row)
        close(got, expect)
    close(algos.token_level_rewards(scores, mask).sum(), scores[mask.any(1)].sum())
    with pytest.raises(ValueError, match="one scalar per sequence"):
        algos.token_level_rewards(scores[:-1], mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_elementwise(seed):
    gen = torch.Generator().manual_seed(seed)
    logp, ref = rand(6, 9, gen), rand(6, 9, gen)
    for kind, f in [("k1", lambda a, r: a - r), ("k2", lambda a, r: 0.5 * (a - r) ** 2),
                    ("k3", lambda a, r: min(10.0, math.exp(r - a) - (r - a) - 1))]:  # verl clamps k3 at 10
        got = algos.kl_estimate(logp, ref, kind)
        close(got, [[f(a, r) for a, r in zip(ra, rr)] for ra, rr in zip(logp.tolist(), ref.tolist())])
    k3 = algos.kl_estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and (k3 == 10.0).any() and (k3 < 10.0).any()  # both sides of the clamp
    with pytest.raises(ValueError, match="k1"):
        algos.kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_kl():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    true_kl = sum(a * math.log(a / b) for a, b in zip(p.tolist(), q.tolist()))
    x = torch.multinomial(p, 200_000, replacement=True)
    logp, ref = p.log()[x][None], q.log()[x][None]
    for kind in ("k1", "k3"):
        assert abs(algos.kl_estimate(logp, ref, kind).mean().item() - true_kl) < 0.01, kind


def test_adaptive_kl_sequence_by_hand():
    c = algos.AdaptiveKL(0.1, target=6.0, horizon=10000)
    steps = [  # (current_kl, n_steps, expected value after the update, worked by hand)
        (9.0, 256, 0.1 * (1 + 0.2 * 256 / 10000)),           # 9/6-1 = 0.5, clipped to 0.2: 0.100512
        (6.0, 256, 0.100512),                                 # on target: unchanged
        (3.0, 512, 0.100512 * (1 - 0.2 * 512 / 10000)),       # -0.5 clipped to -0.2: 0.09948275712
        (6.6, 1000, 0.09948275712 * 1.01),                     # error 0.1, 0.1*1000/10000 = 0.01
        # error 5.7/6 - 1 = -0.05, times 2000/10000 = -0.01
        (torch.tensor(5.7, dtype=torch.float64), 2000, 0.09948275712 * 1.01 * 0.99),
    ]
    for kl, n, expect in steps:
        c.update(kl, n)
        assert abs(c.value - expect) < 1e-10, (kl, n, c.value, expect)
    assert abs(c.value - 0.0994728088443) < 1e-12
    d = algos.AdaptiveKL(1.0, 1.0, 1.0)
    d.load_state_dict(c.state_dict())
    assert d.state_dict() == c.state_dict() == {"value": c.value, "target": 6.0, "horizon": 10000.0}
    with pytest.raises(KeyError, match="target"):
        d.load_state_dict({"value": 0.1})
    with pytest.raises(ValueError, match="horizon > 0"):
        algos.AdaptiveKL(0.1, 6.0, 0)
    f = algos.FixedKL(0.05)
    f.update(100.0, 10_000)
    assert f.value == 0.05
    g = algos.FixedKL(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.05


# ----------------------------------------------------------------------------- advantages

def ref_gae_row(r, v, gamma, lam):
    """Textbook backward GAE over one sequence's valid tokens; value 0 after the last."""
    n, adv, last = len(r), [0.0] * len(r), 0.0
    for t in reversed(range(n)):
        next_v = v[t + 1] if t + 1 < n else 0.0
        delta = r[t] + gamma * next_v - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 1.0), (1.0, 0.0), (0.5, 0.7)])
def test_gae_matches_textbook_loop(seed, gamma, lam):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(9, 12, gen)
    if seed == 2:  # a non-prefix row: masked tokens between valid ones are skipped
        mask[5] = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0], dtype=torch.float64)
    r, v = rand(9, 12, gen, mask), rand(9, 12, gen, mask)
    adv, ret = algos.gae(r, v, mask, gamma, lam)
    rows_a, rows_r = [], []
    for b, idx in enumerate(valid(mask)):
        rr, vv = [r[b, t].item() for t in idx], [v[b, t].item() for t in idx]
        a = ref_gae_row(rr, vv, gamma, lam)
        rows_a.append(a)
        rows_r.append([x + y for x, y in zip(a, vv)])
    close(adv, scatter(rows_a, mask))
    close(ret, scatter(rows_r, mask))
    if lam == 1.0:  # Monte Carlo: returns are the discounted reward-to-go, values cancel
        mc = []
        for b, idx in enumerate(valid(mask)):
            rr = [r[b, t].item() for t in idx]
            mc.append([sum(gamma ** (k - t) * rr[k] for k in range(t, len(rr))) for t in range(len(rr))])
        close(ret, scatter(mc, mask), tol=1e-8)
    adv_w, ret_w = algos.gae(r, v, mask, gamma, lam, whiten=True)
    close(adv_w, ref_whiten(adv, mask))
    close(ret_w, ret)


def ref_groups(scores, n):
    s = scores.tolist()
    return [s[i:i + n] for i in range(0, len(s), n)]


def broadcast(per_seq, mask):
    return scatter([[a] * len(idx) for a, idx in zip(per_seq, valid(mask))], mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [3, 5])
def test_grpo_and_rloo_match_loops(seed, n):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    B = 15
    mask = ragged_mask(B, 7, gen)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    scores[n:2 * n] = 0.7  # a group of identical scores: std 0
    scores[-1] = scores[-2]  # ties inside a group
    grpo, drgrpo, rloo = [], [], []
    for g in ref_groups(scores, n):
        mu, sd = statistics.mean(g), statistics.stdev(g)  # stdev: unbiased, as torch.std
        grpo += [(s - mu) / (sd + 1e-6) for s in g]
        drgrpo += [s - mu for s in g]
        rloo += [s - (sum(g) - s) / (n - 1) for s in g]
    close(algos.grpo_advantages(scores, mask, n), broadcast(grpo, mask))
    close(algos.grpo_advantages(scores, mask.bool(), n, norm_by_std=False), broadcast(drgrpo, mask))
    close(algos.rloo_advantages(scores, mask, n), broadcast(rloo, mask))
    same = algos.grpo_advantages(scores, mask, n)[n:2 * n]
    assert torch.isfinite(same).all() and (same == 0).all()


@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3])
def test_grpo_identical_group_is_exactly_zero_in_float32(value):
    # float32 sums of eight 0.7s leave an ulp-sized deviation that (std + 1e-6) would blow up to ~0.06
    scores = torch.tensor([value] * 8 + [0.0, 1.0] * 4, dtype=torch.float32)
    mask = torch.ones(16, 3)
    a = algos.grpo_advantages(scores, mask, 8)
    assert a.dtype == torch.float32
    assert (a[:8] == 0).all()
    close(a[8:, 0], [-(0.5 / statistics.stdev([0.0, 1.0] * 4)), 0.5 / statistics.stdev([0.0, 1.0] * 4)] * 4,
          tol=1e-5)


def test_grpo_group_of_one_is_zero_and_bad_groups_are_errors():
    gen = torch.Generator().manual_seed(0)
    mask = ragged_mask(6, 5, gen)
    scores = torch.randn(6, generator=gen)
    for norm in (True, False):
        a = algos.grpo_advantages(scores, mask, 1, norm_by_std=norm)
        assert torch.isfinite(a).all() and (a == 0).all()
    with pytest.raises(ValueError, match="n_samples=4"):
        algos.grpo_advantages(scores, mask, 4)
    with pytest.raises(ValueError, match="n_samples >= 2"):
        algos.rloo_advantages(scores, mask, 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(seed, gamma):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(8, 10, gen)
    r = rand(8, 10, gen, mask)
    rtg = []
    for b, idx in enumerate(valid(mask)):
        rr, run, out = [r[b, t].item() for t in idx], 0.0, []
        for x in reversed(rr):
            run = x + gamma * run
            out.append(run)
        rtg.append(out[::-1])
    ret_ref = torch.tensor(scatter(rtg, mask), dtype=torch.float64)
    adv, ret = algos.reinforce_pp_advantages(r, mask, gamma)
    close(ret, ret_ref)
    close(adv, ref_whiten(ret_ref, mask))


def test_compute_advantages_dispatch():
    gen = torch.Generator().manual_seed(5)
    mask = ragged_mask(6, 5, gen)
    r, v = rand(6, 5, gen, mask), rand(6, 5, gen, mask)
    s = torch.randn(6, generator=gen, dtype=torch.float64)

    def inputs(**kw):
        return algos.AdvantageInputs(mask=mask, scores=s, token_rewards=r, **kw)
    a, ret = algos.compute_advantages("gae", inputs(values=v, gamma=0.9, lam=0.8, whiten=False))
    a2, ret2 = algos.gae(r, v, mask, 0.9, 0.8)
    close(a, a2)
    close(ret, ret2)
    a, ret = algos.compute_advantages("grpo", inputs(n_samples=3, norm_by_std=False))
    close(a, algos.grpo_advantages(s, mask, 3, norm_by_std=False))
    assert ret is None
    close(algos.compute_advantages("rloo", inputs(n_samples=2))[0], algos.rloo_advantages(s, mask, 2))
    close(algos.compute_advantages("reinforce++", inputs(gamma=0.9))[1], algos.reinforce_pp_advantages(r, mask, 0.9)[1])
    with pytest.raises(ValueError, match="needs values"):
        algos.compute_advantages("gae", inputs())
    with pytest.raises(ValueError, match="reinforce\\+\\+"):
        algos.compute_advantages("ppo", inputs())


def test_registry_says_which_estimators_need_a_critic_or_groups():
    assert {n for n, e in algos.ESTIMATORS.items() if e.critic} == {"gae"}
    assert {n for n, e in algos.ESTIMATORS.items() if e.groups} == {"grpo", "rloo"}
    assert algos.ESTIMATORS["reinforce++"].verl_name == "reinforce_plus_plus"


# ----------------------------------------------------------------------------- aggregation

def test_aggregate_hand_example_every_mode_differs():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [6.0, 99.0, 99.0, 99.0], [99.0] * 4])
    m = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    expect = {
        "token-mean": 16 / 5,                # (1+2+3+4+6) / 5 valid tokens
        "seq-mean-token-mean": (2.5 + 6) / 2,  # empty row skipped
        "seq-mean-token-sum": (10 + 6) / 2,  # empty row skipped
        "seq-mean-token-sum-norm": 16 / 12,  # B * T = 3 * 4, empty row counted
    }
    got = {mode: algos.aggregate(x, m, mode).item() for mode in algos.AGG_MODES}
    assert len(set(round(v, 6) for v in got.values())) == 4
    for mode in expect:
        assert abs(got[mode] - expect[mode]) < 1e-6, mode
    for mode in algos.AGG_MODES:
        assert algos.aggregate(x, torch.zeros_like(m), mode).item() == 0.0
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        algos.aggregate(x, m, "sum")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_aggregate_random(seed, mode):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(7, 9, gen)
    x = rand(7, 9, gen, mask)
    close(algos.aggregate(x, mask, mode), ref_aggregate(x, mask, mode))


# ----------------------------------------------------------------------------- losses

def ref_policy_tokens(logp, old, adv, mask, cl, ch, dc):
    """Per valid token: (loss, clipped?, dual?, k3 KL(old||new)), plain floats."""
    out = {}
    for b, idx in enumerate(valid(mask)):
        for t in idx:
            a, lr = adv[b, t].item(), logp[b, t].item() - old[b, t].item()
            r = math.exp(lr)
            l1, l2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
            loss, dual = max(l1, l2), False
            if dc is not None and a < 0 and loss > -a * dc:
                loss, dual = -a * dc, True
            out[b, t] = (loss, l2 > l1, dual, r - 1 - lr, l1 >= l2 and not dual, r, a)
    return out


def policy_case(seed, B=9, T=8):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(B, T, gen)
    old = rand(B, T, gen, mask)
    logp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.6
    logp[3, :3] = old[3, :3] + math.log(5.0)  # row 3 is full; ratio 5 > dual_clip 3
    adv = rand(B, T, gen, mask)
    adv[3, :3] = torch.tensor([-1.0, -0.5, 2.0], dtype=torch.float64)  # two of them dual-clipped
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clips", [(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.1, 0.3, 3.0), (0.2, 0.2, 50.0)])
@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_policy_loss_value_stats_and_gradient(seed, clips, mode):
    torch.manual_seed(seed)
    cl, ch, dc = clips
    logp, old, adv, mask = policy_case(seed)
    tok = ref_policy_tokens(logp, old, adv, mask, cl, ch, dc)
    lp = logp.clone().requires_grad_(True)
    loss, stats = algos.policy_loss(lp, old, adv, mask, cl, ch, dc, agg=mode)
    loss_mat = torch.zeros_like(logp)
    for (b, t), v in tok.items():
        loss_mat[b, t] = v[0]
    close(loss, ref_aggregate(loss_mat, mask, mode))
    n = len(tok)
    close(stats["clip_frac"], sum(v[1] for v in tok.values()) / n)
    close(stats["dual_clip_frac"], sum(v[2] for v in tok.values()) / n)
    close(stats["approx_kl"], sum(v[3] for v in tok.values()) / n)
    close(stats["ratio_mean"], sum(v[5] for v in tok.values()) / n)
    if dc == 3.0:
        assert stats["dual_clip_frac"].item() >= 2 / n  # the planted tokens
    if dc == 50.0:  # bound never reached: identical to no dual clip
        assert stats["dual_clip_frac"].item() == 0.0
        close(loss, algos.policy_loss(logp, old, adv, mask, cl, ch, None, agg=mode)[0])
    # gradient: d loss / d logp = weight * (-A * r) on tokens where the unclipped branch is
    # active (and the dual bound is not), else 0; weight is the aggregation's token weight
    (grad,) = torch.autograd.grad(loss, lp)
    lengths = mask.sum(1).tolist()
    n_rows = sum(1 for x in lengths if x)
    expect = torch.zeros_like(logp)
    for (b, t), (_, _, _, _, active, r, a) in tok.items():
        w = {"token-mean": 1 / n, "seq-mean-token-mean": 1 / (n_rows * lengths[b]),
             "seq-mean-token-sum": 1 / n_rows, "seq-mean-token-sum-norm": 1 / logp.numel()}[mode]
        expect[b, t] = w * -a * r if active else 0.0
    close(grad, expect)
    if seed == 0:  # and a central finite difference on a few valid tokens, dual-clipped ones included
        for b, t in [(3, 0), (3, 1), (3, 2), (3, 4), (2, 0), (0, 1)]:
            if not mask[b, t]:
                continue
            h = 1e-6
            up, dn = logp.clone(), logp.clone()
            up[b, t] += h
            dn[b, t] -= h
            fd = (algos.policy_loss(up, old, adv, mask, cl, ch, dc, agg=mode)[0]
                  - algos.policy_loss(dn, old, adv, mask, cl, ch, dc, agg=mode)[0]) / (2 * h)
            assert abs(fd.item() - grad[b, t].item()) < 1e-6, (b, t)


def test_policy_loss_rejects_bad_clips():
    logp, old, adv, mask = policy_case(0)
    for dc in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            algos.policy_loss(logp, old, adv, mask, dual_clip=dc)
    with pytest.raises(ValueError, match="clip_low"):
        algos.policy_loss(logp, old, adv, mask, clip_low=1.2)
    with pytest.raises(ValueError, match="advantages has shape"):
        algos.policy_loss(logp, old, adv[:, :-1], mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_loop(seed, clip, mode):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(9, 8, gen)
    old_v, ret = rand(9, 8, gen, mask), rand(9, 8, gen, mask)
    v = old_v + torch.randn(9, 8, generator=gen, dtype=torch.float64) * 0.3
    loss_mat, clipped = torch.zeros_like(v), []
    for b, idx in enumerate(valid(mask)):
        for t in idx:
            x, o, g = v[b, t].item(), old_v[b, t].item(), ret[b, t].item()
            e1 = (x - g) ** 2
            e2 = (o + min(max(x - o, -clip), clip) - g) ** 2 if clip is not None else e1
            loss_mat[b, t] = 0.5 * max(e1, e2)
            clipped.append(e2 > e1)
    loss, stats = algos.value_loss(v, old_v, ret, mask, clip=clip, agg=mode)
    close(loss, ref_aggregate(loss_mat, mask, mode))
    close(stats["vf_clip_frac"], sum(clipped) / len(clipped))
    if clip is not None:
        assert 0 < stats["vf_clip_frac"].item() < 1  # both branches exercised


@pytest.mark.parametrize("kind", algos.KL_KINDS)
def test_kl_and_entropy_losses(kind):
    gen = torch.Generator().manual_seed(11)
    mask = ragged_mask(7, 6, gen)
    logp, ref, ent = rand(7, 6, gen, mask, 0.3), rand(7, 6, gen, mask, 0.3), rand(7, 6, gen, mask).abs()
    f = {"k1": lambda a, r: a - r, "k2": lambda a, r: 0.5 * (a - r) ** 2,
         "k3": lambda a, r: math.exp(r - a) - (r - a) - 1}[kind]
    per_tok = torch.tensor([[f(a, r) for a, r in zip(ra, rr)] for ra, rr in zip(logp.tolist(), ref.tolist())],
                           dtype=torch.float64)
    for mode in algos.AGG_MODES:
        close(algos.kl_loss(logp, ref, mask, kind, mode), ref_aggregate(per_tok, mask, mode))
        close(algos.entropy_loss(ent, mask, mode), ref_aggregate(ent, mask, mode))


def test_everything_finite_with_empty_rows_float32():
    """A batch whose rows are all empty but one: no NaN anywhere, in float32 as trained."""
    mask = torch.zeros(4, 5)
    mask[2, :2] = 1
    x = torch.randn(4, 5)
    s = torch.tensor([1.0, 1.0, 0.0, 1.0])
    outs = [algos.gae(x, x, mask, 0.99, 0.95, whiten=True)[0], algos.grpo_advantages(s, mask, 2),
            algos.rloo_advantages(s, mask, 2), algos.reinforce_pp_advantages(x, mask)[0],
            algos.token_level_rewards(s, mask, x, 0.1)]
    lp = x.clone().requires_grad_(True)
    for mode in algos.AGG_MODES:
        loss, stats = algos.policy_loss(lp, x * 0.9, x, mask, dual_clip=3.0, agg=mode)
        outs += [loss, *stats.values(), *torch.autograd.grad(loss, lp)]
        vloss, vstats = algos.value_loss(lp, x, x * 2, mask, agg=mode)
        outs += [vloss, *vstats.values(), *torch.autograd.grad(vloss, lp), algos.kl_loss(lp, x, mask, "k3", mode)]
    for o in outs:
        assert torch.isfinite(o).all()
