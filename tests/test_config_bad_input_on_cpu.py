"""Bad config input: numbers out of range, files that are folders or not UTF-8, and errors that name
where the bad value came from (the file, the --set, or the CLI option standing for one)."""

import re
import typing

import pytest

from edgerl.config.schema import RANGES, ConfigError
from edgerl.config.load import load_config


@pytest.mark.parametrize("item,message", [
    ("train.lr=-1e-6", "train.lr must be > 0, got -1e-06; a negative rate climbs the loss"),
    ("train.critic_lr=-1", "train.critic_lr must be > 0, got -1.0"),
    ("train.critic_lr=0", "train.critic_lr must be > 0, got 0.0"),
    ("train.max_grad_norm=0", "train.max_grad_norm must be > 0, got 0.0; gradients are scaled down to this norm"),
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0, got -0.1"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1], got 1.5"),
    ("train.warmup_ratio=1", "train.warmup_ratio must be in [0, 1), got 1.0"),
    ("train.betas=[0.9, 1.0]", "train.betas needs two values in [0, 1)"),
    ("train.steps=-1", "train.steps must be 0 to 1000000000, got -1"),
    ("algo.gamma=1.01", "algo.gamma must be in [0, 1], got 1.01"),
    ("algo.lam=-0.5", "algo.lam must be in [0, 1], got -0.5"),
    ("algo.clip_low=1", "algo.clip_low must be in [0, 1), got 1.0"),
    ("algo.clip_high=-0.2", "algo.clip_high must be >= 0, got -0.2"),
    ("algo.value_clip=0", "algo.value_clip must be > 0, got 0.0"),
    ("algo.kl_target=0", "algo.kl_target must be > 0, got 0.0"),
    ("algo.kl_horizon=0", "algo.kl_horizon must be 1 to 1000000000000, got 0"),
    ("algo.kl_coef=-0.1", "algo.kl_coef must be >= 0, got -0.1"),
    ("rollout.top_k=-1", "rollout.top_k must be 0 to 1048576, got -1"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
    ("rollout.temperature=0", "rollout.temperature must be > 0, got 0.0; for near-greedy sampling"),
    ("data.num_examples=0", "data.num_examples must be 1 to 1000000, got 0"),
    ("data.difficulty=5", "data.difficulty must be 1 to 4, got 5"),
    ("plan.memory_gib=-1", "plan.memory_gib must be > 0, got -1.0"),
    ("plan.headroom_gib=-1", "plan.headroom_gib must be >= 0, got -1.0"),
    ("plan.rollout_batch=0", "plan.rollout_batch must be 1 to 65536, got 0"),
    ("plan.score_micro_batch=-2", "plan.score_micro_batch must be 1 to 65536, got -2"),
    ("plan.rollout_memory_share=1.5", "plan.rollout_memory_share must be in (0, 1], got 1.5"),
    ("run.save_every=-1", "run.save_every must be 0 to 1000000000, got -1"),
    ("train.lr=nan", "train.lr must be a finite number, got nan"),
    ("reward.model_coef=inf", "reward.model_coef must be a finite number, got inf"),
    ("train.betas=[0.9, nan]", "train.betas must hold finite numbers"),
])
def test_numbers_out_of_range_name_the_key_the_bound_and_the_set(item, message):
    with pytest.raises(ConfigError) as e:
        load_config(sets=[item])
    assert message in str(e.value)
    key = item.split("=")[0]
    assert str(e.value).endswith(f"({key} from --set {item})"), str(e.value)


def test_every_range_is_checked_and_the_defaults_are_inside():
    cfg = load_config()   # the defaults pass
    for key, (spec, _) in RANGES.items():
        section, name = key.split(".")
        tp = typing.get_type_hints(type(getattr(cfg, section)))[name]
        bad = float(spec[1:-1].split(",")[0]) - 1   # one below the lower bound
        if int in (tp, *typing.get_args(tp)):
            bad = int(bad)
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be "):
            load_config(sets=[f"{key}={bad}"])


def test_every_integer_key_has_a_finite_range_checked_before_anything_runs():
    """Python's integers have no bound; every integer key has one (RANGES), and one past it is refused
    while the config is read (train.seed=10**23 once failed inside torch, mid-run)."""
    import dataclasses
    from edgerl.config.schema import Config
    cfg = load_config()
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(type(getattr(cfg, section.name)))
        for f in dataclasses.fields(getattr(cfg, section.name)):
            if int not in (hints[f.name], *typing.get_args(hints[f.name])):
                continue
            key = f"{section.name}.{f.name}"
            spec = RANGES.get(key) or f.metadata.get("range")   # [plan] keys: the decision table's row
            assert spec, f"{key} is an integer without a range in RANGES (or its decision's row)"
            hi = float(spec[0][1:-1].split(",")[1])
            assert hi != float("inf"), f"{key} has no upper bound"
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be \d+ to {int(hi)}, got "):
                load_config(sets=[f"{key}={int(hi) + 1}"])
    with pytest.raises(ConfigError, match=r"^train.seed must be 0 to 4294967295, got 99999999999999999999999"):
        load_config(sets=["train.seed=99999999999999999999999"])


def test_a_step_of_more_sequences_than_edgerl_plans_for_is_refused_with_the_limit():
    with pytest.raises(ConfigError, match=r"train.prompts_per_step=20000 x rollout.n_samples=4 = 80000 sequences per "
                                          r"step, more than the 65536 edgerl plans for"):
        load_config(sets=["train.prompts_per_step=20000"])
    with pytest.raises(ConfigError, match=r"^train.prompts_per_step must be 1 to 65536, got 100000000"):
        load_config(sets=["train.prompts_per_step=100000000"])


def test_lr_zero_is_refused_with_its_own_reason():
    """A zero rate would run every step (rollouts, rewards, backward passes) and change nothing while
    the metrics look like a normal run: refused, saying so, apart from the negative case."""
    with pytest.raises(ConfigError) as e:
        load_config(sets=["train.lr=0"])
    msg = str(e.value)
    assert msg.startswith("train.lr = 0 would run every step") and "without changing a weight" in msg
    assert "1e-6" in msg and msg.endswith("(train.lr from --set train.lr=0)")


def test_a_value_from_the_file_names_the_file_not_a_set(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_text('[train]\nlr = "abc"\n')
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"train.lr in {f}: expected float, got 'abc'")
    assert "--set" not in str(e.value)
    # the same bad value given with --set names the --set, and never the file
    with pytest.raises(ConfigError) as e:
        load_config(f, ["train.lr=abc"])
    assert str(e.value).startswith("--set train.lr=abc: expected float, got 'abc'")
    assert "cfg.toml" not in str(e.value)
    # a rule broken by a file value names the file; by a --set, the --set
    f.write_text("[train]\nlr = -1.0\n")
    with pytest.raises(ConfigError, match=rf"must be > 0, got -1.0; .*\(train.lr from {f}\)$"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"\(train.lr from --set train.lr=-2\)$"):
        load_config(f, ["train.lr=-2"])
    # an option standing for a --set is named as the user typed it
    with pytest.raises(ConfigError, match=r"\(train.steps from --steps -3\)$"):
        load_config(f, [("train.steps=-3", "--steps -3")])
    with pytest.raises(ConfigError, match=r"^--steps x: expected int"):
        load_config(None, [("train.steps=x", "--steps x")])


def test_a_rule_over_two_keys_names_where_each_came_from(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_text("[train]\nprompts_per_step = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, ["rollout.n_samples=2", "train.mini_batch=4"])
    assert "train.mini_batch=4 must divide the 6 sequences per step" in str(e.value)
    assert str(e.value).endswith("(train.mini_batch from --set train.mini_batch=4)")
    with pytest.raises(ConfigError) as e:
        load_config(f, ["rollout.n_samples=1"])
    assert str(e.value).endswith("(rollout.n_samples from --set rollout.n_samples=1)")


def test_unknown_keys_and_sections_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set rolout.n_samples=4: unknown config key 'rolout'; did you mean "
                                          r"'rollout'\?"):
        load_config(sets=["rolout.n_samples=4"])
    f = tmp_path / "cfg.toml"
    f.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError, match=rf"^unknown config key 'train.stepz' in {f}; did you mean 'train.steps'"):
        load_config(f)
    with pytest.raises(ConfigError) as e:
        load_config(sets=["train=5"])
    assert str(e.value).startswith("--set train=5: 'train' is a section ([train] in a config file), not a value")
    assert "--set train.KEY=VALUE" in str(e.value)
    f.write_text("train = 5\n")
    with pytest.raises(ConfigError, match=rf"^'train' in {f} is a section; write it as \[train\]"):
        load_config(f)


def test_a_config_path_that_is_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a folder; give the .toml file"):
        load_config(tmp_path)


def test_a_config_file_that_is_not_utf8_names_the_line(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_bytes(b"[train]\nlr = 1e-6\n# caf\xe9 au lait\nsteps = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"config file {f}, line 3, column 6: byte 0xe9 is not UTF-8")
    assert "save the file as UTF-8" in str(e.value)


def test_a_utf8_bom_is_accepted(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_bytes("\ufeff[train]\nsteps = 3\n".encode())
    assert load_config(f).train.steps == 3
