"""Groups and length: uniform groups, the rows the update skips (the same weights as computing them), DAPO's
dynamic sampling and its soft overlong penalty against plain loops, and algo.overlong=mask."""

from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import prepare_trainer
from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError
from edgerl.train.groups import overlong_penalty, rows_with_gradient, skip_policy, uniform_groups
from edgerl.train.metrics import read_metrics

FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "rollout.n_samples=4", "run.loggers=[]",
        "data.num_examples=64", "train.lr=1e-3", "algo.kl_coef=0", "run.save_every=0", "run.export_final=false"]


def test_uniform_groups_against_a_loop():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 4):
        scores = torch.randint(0, 2, (n * 7,), generator=g).float().tolist()
        want = []
        for start in range(0, len(scores), n):
            first = scores[start]
            want.append(all(s == first for s in scores[start:start + n]))
        assert uniform_groups(scores, n) == want


def test_overlong_penalty_against_dapos_formula():
    for limit, buffer, factor in ((16, 4, 1.0), (10, 10, 0.5), (8, 1, 2.0)):
        for n in range(limit + 1):
            expected = min(-(n - (limit - buffer)) / buffer * factor, 0.0)   # verl's DAPO reward manager
            assert overlong_penalty([n], limit, buffer, factor)[0] == pytest.approx(expected)


def test_rows_with_gradient():
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 1], [1, 1, 0]])
    assert rows_with_gradient(adv, mask).tolist() == [False, True, False, False]


@pytest.mark.parametrize("sets, on", [
    ([], True),
    (["algo.kl_coef=0.01"], False),
    (["algo.kl_coef=0.01", "algo.kl_in=reward"], True),
    (["algo.entropy_coef=0.01"], False),
    (["lora.enabled=true", "lora.dropout=0.1"], False),
    (["algo.skip_uniform_groups=false"], False),
])
def test_skipping_only_where_it_changes_nothing(sets, on):
    assert skip_policy(load_config(None, ["algo.kl_coef=0", *sets]), world=1)[0] is on
    assert skip_policy(load_config(None, ["algo.kl_coef=0"]), world=2)[0] is False


@pytest.fixture
def mixed_reward(tmp_path):
    f = tmp_path / "mixed.py"
    f.write_text(textwrap.dedent('''
        def mixed(data_source, solution_str, ground_truth, extra_info=None):
            """Odd answers: the same score for every sample (a uniform group); even: a score that varies."""
            if int(ground_truth) % 2:
                return 0.5
            letters = [c for c in solution_str.lower() if c.isalpha()]
            return sum(c in "aeiou" for c in letters) / max(1, len(letters))
    '''))
    return f"{f}:mixed"


def _weights(t) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in t.actor.state_dict().items()}


def test_skipping_uniform_groups_trains_the_same_weights(tiny_llama, tmp_path, mixed_reward):
    sets = [*FAST, "train.steps=3", "train.prompts_per_step=4", "train.mini_batch=8",
            f'reward.functions=["{mixed_reward}"]']
    runs = {}
    for skip in (True, False):
        t = prepare_trainer(tiny_llama, tmp_path / str(skip), [*sets, f"algo.skip_uniform_groups={str(skip).lower()}"])
        t.run()
        runs[skip] = (_weights(t), read_metrics(tmp_path / str(skip)))
    (w1, m1), (w0, m0) = runs[True], runs[False]
    assert sum(r["batch/skipped_sequences"] for r in m1) > 0 and "batch/skipped_sequences" not in m0[0]
    assert [r["batch/uniform_groups"] for r in m1] == [r["batch/uniform_groups"] for r in m0]
    assert [r["reward/mean"] for r in m1] == [r["reward/mean"] for r in m0]
    # the kept rows' micro-batches are trimmed and summed in another order: fp32 rounding, which Adam can magnify
    # on an element whose gradient is near zero (one of 3M moved 1.5e-6 of a 1e-3 step)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-5, atol=1e-5, msg=k)
    assert any(not torch.equal(w0[k], v) for k, v in _weights(
        prepare_trainer(tiny_llama, tmp_path / "fresh", [*sets, "train.steps=0"])).items())   # training moved them


def test_dynamic_sampling_keeps_informative_groups(tiny_llama, tmp_path, mixed_reward):
    t = prepare_trainer(tiny_llama, tmp_path / "run", [*FAST, "train.steps=2", "train.prompts_per_step=4",
                                                       f'reward.functions=["{mixed_reward}"]',
                                                       "algo.dynamic_sampling=true", "algo.max_extra_draws=6"])
    t.run()
    rows = read_metrics(tmp_path / "run")
    for r in rows:
        assert r["batch/sequences"] == 16
        assert r["batch/informative_groups"] == 4 - r["batch/uniform_groups"]
        assert r["batch/extra_draws"] <= 6
    assert any(r["batch/extra_draws"] > 0 for r in rows)   # about half the problems have odd answers
    assert t.state.loop.sampler.state_dict()["pos"] == 4 * (2 + sum(int(r["batch/extra_draws"]) for r in rows))


def test_overlong_mask_leaves_cut_responses_out_of_the_loss(tiny_llama, tmp_path):
    notes: list[str] = []
    t = prepare_trainer(tiny_llama, tmp_path / "run", [*FAST, "train.steps=1", "train.prompts_per_step=2",
                                                       "rollout.stop_at_eos=false", "algo.overlong=mask",
                                                       'reward.functions=["format"]', "algo.advantage=rloo"],
                        log=notes.append)
    before = _weights(t)
    t.run()
    (row,) = read_metrics(tmp_path / "run")
    assert row["response/truncated"] == 1.0 and row["batch/skipped_sequences"] == 8
    for k, v in _weights(t).items():   # every response was cut: nothing to learn from
        assert torch.equal(v, before[k]), k
    said = [n for n in notes if n.startswith("step 1: all 8 responses were cut at rollout.max_new_tokens=8")]
    assert len(said) == 1 and "this step learns nothing from its rollouts; raise rollout.max_new_tokens" in said[0]


def test_soft_penalty_is_logged_and_added(tiny_llama, tmp_path):
    t = prepare_trainer(tiny_llama, tmp_path / "run", [*FAST, "train.steps=1", "train.prompts_per_step=2",
                                                       "rollout.stop_at_eos=false", "algo.overlong=soft_penalty",
                                                       "algo.overlong_buffer=4", "algo.overlong_penalty=0.5"])
    t.run()
    (row,) = read_metrics(tmp_path / "run")
    assert row["reward/overlong_penalty_mean"] == pytest.approx(-0.5)   # every response reached the limit
    assert row["reward/mean"] == pytest.approx(row["reward/answer"] - 0.5)


@pytest.mark.parametrize("sets, message", [
    (["algo.dynamic_sampling=true", "algo.advantage=gae"], "algo.dynamic_sampling keeps groups"),
    (['algo.overlong="clip"'], "'clip' is not one of 'none', 'mask', 'soft_penalty'"),
    (["algo.overlong_buffer=0"], "algo.overlong_buffer must be 1 to 1048576, got 0"),
    (["algo.overlong_buffer=2000"], "algo.overlong_buffer=2000 is longer than rollout.max_new_tokens=1024"),
    (["algo.max_extra_draws=-1"], "algo.max_extra_draws must be 0 to 1000, got -1"),
    (["algo.skip_uniform_groups=1"], "expected bool"),
])
def test_bad_group_settings(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert message in str(e.value)


def test_draws_join_and_select_whole_groups():
    from edgerl.rollout.base import RolloutBatch
    from edgerl.train.groups import Drawn, fill_with_informative

    def drawn(tag: str, scores: list[float], comp: dict) -> Drawn:
        k = len(scores)
        batch = RolloutBatch([[0]] * k, [[i] for i in range(k)], [False] * k, None, {"decode_s": 1.0})
        return Drawn([f"{tag}{g}" for g in range(k // 2)], batch, scores, {"answer": list(scores)}, comp)
    a = drawn("a", [1.0, 1.0, 0.0, 1.0], {})                     # groups of 2: a0 uniform, a1 informative
    b = drawn("b", [0.0, 1.0, 0.5, 0.5], {"marker": [1.0] * 4})  # b0 informative, b1 uniform
    both = a.extend(b)
    assert both.prompts == ["a0", "a1", "b0", "b1"] and both.batch.info["decode_s"] == 2.0
    marker = both.components["marker"]   # NaN where draw a had no marker
    assert all(x != x for x in marker[:4]) and marker[4:] == [1.0] * 4
    chosen, informative = fill_with_informative(both, 2, 3)
    assert chosen.prompts == ["a1", "b0", "a0"] and informative == 2
    assert chosen.scores == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0] and chosen.by_function["answer"] == chosen.scores
