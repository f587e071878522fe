"""The rollout correction (`algo.rollout_correction`, edgerl/correction.py): its weights and metrics against
slow plain-Python loops, the plan's decision on fake devices, the config and export keys, and two short
training runs on the CPU. verl's own formulas are checked in tests/test_verl_parity_on_cpu.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import edgerl.config.target
from edgerl import algos, correction
from edgerl.cli.main import app
from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError, PlanError
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import Task, plan
from edgerl.train.step_metrics import rollout_metrics
from fakes import fake_probe

CPU = torch.device("cpu")


def ragged(seed: int, B: int = 12, T: int = 10, spread: float = 1.0):
    """old and sampled log-probs with token log-ratios of about +-spread, and a mask with an empty row, a
    one-token row and a full row; garbage (even inf) where the mask is 0."""
    g = torch.Generator().manual_seed(seed)
    sampled = -torch.rand(B, T, generator=g) * 3
    old = sampled + torch.randn(B, T, generator=g) * spread
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1 % B], lengths[-1] = 0, 1, T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    old = torch.where(mask.bool(), old, torch.tensor(float("inf")))
    return old, sampled, mask


# --- slow references: plain Python over each row ------------------------------------------------------

def ref_weights(old, sampled, mask, mode, level, C):
    """Row by row in floats: (weights, cut) as lists of lists."""
    W, CUT = [], []
    for b in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[b, t] > 0]
        d = {t: float(old[b, t]) - float(sampled[b, t]) for t in valid}
        clamp = lambda x: min(20.0, max(-20.0, x))   # noqa: E731
        w, cut = [0.0] * old.shape[1], [False] * old.shape[1]
        if level == "sequence":
            rho = math.exp(clamp(sum(d.values())))
            inside = 1 / C <= math.exp(sum(clamp(x) for x in d.values())) <= C
        for t in valid:
            if level == "token":
                rho = math.exp(clamp(d[t]))
                inside = 1 / C <= rho <= C
            if mode == "tis":
                w[t], cut[t] = min(rho, C), rho > C
            else:
                w[t], cut[t] = (min(rho, C), False) if inside else (0.0, True)
        W.append(w)
        CUT.append(cut)
    return torch.tensor(W, dtype=torch.float64), torch.tensor(CUT)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("C", [2.0, 3.0])
def test_weights_match_the_plain_loop(seed, mode, level, C):
    old, sampled, mask = ragged(seed)
    w, cut = correction.weights(old, sampled, mask, mode, level, C)
    rw, rcut = ref_weights(old, sampled, mask, mode, level, C)
    torch.testing.assert_close(w.double(), rw, rtol=1e-5, atol=1e-7)
    assert torch.equal(cut, rcut)
    assert w.isfinite().all() and not w[mask == 0].any()
    units = mask.bool() if level == "token" else mask.bool().any(1)
    flags = cut if level == "token" else cut.any(1)
    assert flags[units].any() and not flags[units].all(), "the case must hold units both cut and kept"


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 7), (2, 5)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_odd_shapes_and_empty_masks(shape, level):
    old, sampled = torch.randn(shape), torch.randn(shape)
    for mask in (torch.ones(shape), torch.zeros(shape)):
        for mode in ("tis", "mis"):
            w, cut = correction.weights(old, sampled, mask, mode, level, 2.0)
            rw, rcut = ref_weights(old, sampled, mask, mode, level, 2.0)
            torch.testing.assert_close(w.double(), rw, rtol=1e-5, atol=1e-7)
            assert torch.equal(cut, rcut) and w.shape == shape


def test_equal_log_probs_weigh_one_and_huge_gaps_stay_finite():
    old, _, mask = ragged(3)
    same = torch.where(mask.bool(), old, 0.0)
    for level in ("token", "sequence"):
        w, cut = correction.weights(same, same, mask, "mis", level, 2.0)
        assert torch.equal(w, mask) and not cut.any()
    far = torch.full((2, 4), 500.0)
    w, cut = correction.weights(far, -far, torch.ones(2, 4), "tis", "sequence", 2.0)
    assert torch.equal(w, torch.full((2, 4), 2.0)) and cut.all()
    assert correction.k3(far, -far, torch.ones(2, 4)).isfinite().all()


@pytest.mark.parametrize("args, message", [
    (("bis", "token", 2.0), "choose one of tis, mis"), (("tis", "row", 2.0), "choose one of token, sequence"),
    (("mis", "token", 1.0), "must be > 1"), (("tis", "token", float("nan")), "must be > 1")])
def test_bad_arguments_are_named(args, message):
    old, sampled, mask = ragged(0)
    with pytest.raises(ValueError, match=message):
        correction.weights(old, sampled, mask, *args)
    with pytest.raises(ValueError, match="sampled_logp has shape"):
        correction.weights(old, sampled[:, :3], mask, "tis")


@pytest.mark.parametrize("mode, level", [("tis", "token"), ("mis", "sequence"), ("none", "token")])
def test_step_metrics_match_the_plain_loop(mode, level):
    old, sampled, mask = ragged(4)
    out = rollout_metrics(old, sampled, mask, mode, level, 2.0, CPU)
    k3s = [math.exp(float(old[b, t] - sampled[b, t])) - float(old[b, t] - sampled[b, t]) - 1
           for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    assert out["rollout/k3_kl"] == pytest.approx(sum(k3s) / len(k3s), rel=1e-5)
    if mode == "none":
        assert set(out) == {"rollout/k3_kl"}
        return
    rw, rcut = ref_weights(old, sampled, mask, mode, level, 2.0)
    units = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    if level == "sequence":   # one unit per row with a token: its first token carries the row's values
        units = [(b, 0) for b in range(mask.shape[0]) if mask[b, 0]]
    ws, cuts = [float(rw[u]) for u in units], [bool(rcut[u]) for u in units]
    assert out["rollout_corr/weight_mean"] == pytest.approx(sum(ws) / len(ws), rel=1e-5)
    assert out["rollout_corr/weight_max"] == pytest.approx(max(ws), rel=1e-6)
    share = out["rollout_corr/truncated" if mode == "tis" else "rollout_corr/masked"]
    assert share == pytest.approx(sum(cuts) / len(cuts)) and 0 < share < 1


def test_the_weights_scale_each_tokens_policy_loss():
    """ppo token-mean by hand: mean over valid tokens of w_t * max(-A r, -A clip(r))."""
    old, sampled, mask = ragged(5)
    g = torch.Generator().manual_seed(9)
    logp = torch.where(mask.bool(), old, 0.0) + 0.1 * torch.randn(mask.shape, generator=g)
    adv = torch.randn(mask.shape, generator=g)
    old0 = torch.where(mask.bool(), old, 0.0)
    w, _ = correction.weights(old, sampled, mask, "tis", "token", 2.0)
    loss, _ = algos.policy_loss(logp, old0, adv, mask, weights=w)
    terms = []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                r = math.exp(float(logp[b, t] - old0[b, t]))
                a = float(adv[b, t])
                terms.append(float(w[b, t]) * max(-a * r, -a * min(max(r, 0.8), 1.2)))
    assert float(loss) == pytest.approx(sum(terms) / len(terms), rel=1e-5)


# --- the plan's decision ------------------------------------------------------------------------------

# device, extra libs, [plan] overrides, algo.rollout_correction -> value, words the reason holds
DECISION = [
    (None, {}, {}, None, "none", "off: the engine decodes in fp32 through torch's ops"),
    ("P40", {}, {"decode_backend": "torch"}, None, "none", "off: the engine decodes in fp32"),
    ("P40", {}, {}, None, "tis", "the engine decodes through edgerl's cuda-c kernels"),
    ("T4", {}, {}, None, "tis", "the engine decodes in fp16 through edgerl's cuda-c kernels"),
    ("V100", {}, {"decode_backend": "torch"}, None, "tis", "the engine decodes in fp16, the trainer"),
    ("3090", {}, {}, None, "tis", "in bf16 through edgerl's triton-layers kernels"),
    ("A100", {"vllm": "0.10.1"}, {}, None, "tis", "vLLM samples in bf16"),
    ("T4", {}, {}, "none", "none", "asked for with algo.rollout_correction=none"),
    (None, {}, {}, "mis", "mis", "0 outside [1/2, 2]"),
    ("T4", {}, {"rollout_engine": "hf-generate"}, None, "none", "does not report the log-probs"),
]


@pytest.mark.parametrize("key, libs, overrides, asked, value, words", DECISION)
def test_the_plan_decides_where_the_numerics_differ(key, libs, overrides, asked, value, words):
    p = plan(fake_probe(key, **libs).primary, CATALOGUE["qwen2.5-0.5b"], Task(rollout_correction=asked), overrides)
    assert p.rollout_correction == value and words in p.reasons["rollout_correction"], p.reasons["rollout_correction"]


def test_a_correction_without_sampled_log_probs_is_refused():
    with pytest.raises(PlanError, match="algo.rollout_correction=tis .* hf-generate engine does not report"):
        plan(fake_probe("T4").primary, CATALOGUE["qwen2.5-0.5b"], Task(rollout_correction="tis"),
             {"rollout_engine": "hf-generate"})


runner = CliRunner()


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None))


def test_recommend_shows_pins_and_exports_it(no_gpu, tmp_path):
    r = runner.invoke(app, ["recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b"])
    assert r.exit_code == 0, r.output
    assert any("rollout correction" in ln and "tis" in ln for ln in r.stdout.splitlines())
    r = runner.invoke(app, ["recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--format", "toml", "--out",
                            str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert 'rollout_correction = "tis"  # the engine decodes in fp16' in (tmp_path / "run.toml").read_text()
    assert load_config(tmp_path / "run.toml").algo.rollout_correction == "tis"
    r = runner.invoke(app, ["recommend", "--gpu", "rtx3090", "--model", "qwen2.5-0.5b", "--format", "verl",
                            "--set", "algo.rollout_correction=mis", "--set", "algo.rollout_correction_level=sequence"])
    assert r.exit_code == 0, r.output
    for line in ("algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_rs=seq_sum_k1",
                 "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                 "actor_rollout_ref.rollout.calculate_log_probs=True"):
        assert line in r.stdout, line
    assert "keeps it in the loss's denominator" in r.stdout


@pytest.mark.parametrize("setting, message", [
    ("algo.rollout_correction=bis", "algo.rollout_correction"),
    ("algo.rollout_correction_threshold=1", "algo.rollout_correction_threshold must be > 1, got 1"),
    ("algo.rollout_correction_level=row", "algo.rollout_correction_level")])
def test_bad_settings_are_one_line(no_gpu, setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [setting])
    r = runner.invoke(app, ["recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--set", setting])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and message.split()[0] in lines[0], r.output


# --- training on the CPU --------------------------------------------------------------------------------

REWARDS = Path(__file__).with_name("reward_fns.py")
FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=32", "train.lr=1e-3", "train.steps=2", "run.save_every=0",
        "run.export_final=false", f'reward.function="{REWARDS}:vowel_share"']


def _train(monkeypatch, model, run, *sets, shift: float = 0.0):
    """Two steps; `shift` adds noise of that size to the engine's sampled log-probs, as a rollout engine
    with other numerics would. Returns the trainer, its metrics and the weights each policy loss was given."""
    from conftest import prepare_trainer
    from edgerl.train import trainer
    from edgerl.train.metrics import read_metrics
    t = prepare_trainer(model, run, [*FAST, *sets])
    seen, real_loss = [], trainer.algos.compute_policy_loss

    def loss(*args):
        seen.append(args[-1])
        return real_loss(*args)
    monkeypatch.setattr(trainer.algos, "compute_policy_loss", loss)
    if shift:
        real, g = t.engine.generate, torch.Generator().manual_seed(0)

        def generate(*args, **kwargs):
            batch = real(*args, **kwargs)
            batch.logprobs = [[x + shift * float(torch.randn((), generator=g)) for x in row] for row in batch.logprobs]
            return batch
        t.engine.generate = generate
    t.run()
    return t, read_metrics(run), seen


def test_off_on_the_cpu_logs_the_gap_only(tiny_llama, tmp_path, monkeypatch):
    t, rows, seen = _train(monkeypatch, tiny_llama, tmp_path / "run")
    assert t.plan.rollout_correction == "none" and seen and all(w is None for w in seen)
    assert all(0 <= r["rollout/k3_kl"] < 1e-6 for r in rows), [r["rollout/k3_kl"] for r in rows]
    assert not any(k.startswith("rollout_corr/") for r in rows for k in r)


@pytest.mark.parametrize("mode, level, extra", [
    ("tis", "token", ["algo.kl_coef=0"]),                               # rows of uniform groups skipped
    ("mis", "sequence", ["train.mini_batch=4", "algo.dynamic_sampling=true"])])   # a scoring pass; redraws
def test_training_with_a_correction_logs_its_weights(tiny_llama, tmp_path, monkeypatch, mode, level, extra):
    t, rows, seen = _train(monkeypatch, tiny_llama, tmp_path / "run", f"algo.rollout_correction={mode}",
                           f"algo.rollout_correction_level={level}", *extra, shift=0.5)
    assert t.plan.rollout_correction == mode and len(rows) == 2
    assert seen and all(w is not None for w in seen)   # every policy loss was weighted
    assert any(((w != 1) & (w != 0)).any() for w in seen) and max(float(w.max()) for w in seen) <= 2.0
    share = f"rollout_corr/{'truncated' if mode == 'tis' else 'masked'}"
    for r in rows:
        for key in ("rollout_corr/weight_mean", "rollout_corr/weight_max", share, "rollout/k3_kl",
                    "actor/pg_loss", "actor/grad_norm"):
            assert isinstance(r.get(key), float) and math.isfinite(r[key]), (key, r.get(key))
        assert 0 < r["rollout_corr/weight_max"] <= 2.0 and r["rollout/k3_kl"] > 1e-3
    assert any(r[share] > 0 for r in rows), [r[share] for r in rows]
