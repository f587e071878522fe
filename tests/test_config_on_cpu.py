"""The run config: types, closest-key errors, cross-field rules, TOML round trip."""

import pytest

from edgerl.config.schema import Config, ConfigError, to_toml
from edgerl.config.load import load_config, parse_set


def test_defaults_validate_and_floats_stay_floats():
    cfg = load_config(sets=["train.warmup_ratio=0.03", "train.lr=1", "algo.kl_coef=0"])
    assert cfg.train.warmup_ratio == 0.03 and isinstance(cfg.train.warmup_ratio, float)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # an int is accepted for a float
    assert isinstance(cfg.algo.kl_coef, float)


@pytest.mark.parametrize("item,message", [
    ("train.lrr=1e-6", "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
    ("rolout.n_samples=4", "unknown config key 'rolout'; did you mean 'rollout'?"),
    ("train.steps=1.5", "--set train.steps=1.5: expected int, got 1.5"),
    ("train.steps=true", "--set train.steps=true: expected int, got True"),
    ("rollout.temperature=hot", "--set rollout.temperature=hot: expected float, got 'hot'"),
    ("algo.advantage=grp", "'grp' is not one of 'gae', 'grpo', 'rloo', 'reinforce++'; did you mean 'grpo'?"),
    ("rollout.n_samples=1", "grpo needs rollout.n_samples >= 2"),
    ("train.mini_batch=5", "train.mini_batch=5 must divide the 16 sequences per step"),
    ("algo.dual_clip=0.5", "algo.dual_clip must be > 1"),
    ("train=3", "'train' is a section"),
    ("noequals", "expected key=value"),
])
def test_errors_say_what_to_do(item, message):
    with pytest.raises(ConfigError) as e:
        load_config(sets=[item])
    assert message in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "run.toml"
    bad.write_text("[train]\nlr = 1e-6\nstepz = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz' in .*run.toml; did you mean 'train.steps'"):
        load_config(bad)
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_set_overrides_file_and_parses_values(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nlr = 1e-6\n[data]\npath = "a.parquet"\n')
    cfg = load_config(f, ["train.lr=2e-6", "data.path=b.jsonl", "lora.target_modules=['q_proj', 'v_proj']",
                          "algo.dual_clip=none", "run.out_dir=/tmp/x"])
    assert cfg.train.lr == 2e-6 and cfg.data.path == "b.jsonl"
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.algo.dual_clip is None
    assert parse_set("a.b=grpo") == (["a", "b"], "grpo")


def test_toml_round_trip(tmp_path):
    cfg = load_config(sets=["algo.advantage=gae", "rollout.n_samples=1", "train.lr=3e-6", "lora.enabled=true",
                            "plan.dtype=fp16", "data.system_prompt=\"Be brief.\\nThink.\""])
    text = to_toml(cfg)
    f = tmp_path / "rt.toml"
    f.write_text(text)
    assert load_config(f) == cfg


def test_effective_batch_line():
    cfg = load_config(sets=["train.prompts_per_step=8", "rollout.n_samples=8", "train.mini_batch=16"])
    assert cfg.effective_batch().startswith("8 prompts x 8 samples = 64 sequences per step; mini-batch 16 -> 4 update(s)")


def test_every_key_is_documented_and_printed_by_edgerl_config():
    import dataclasses
    from typer.testing import CliRunner
    from edgerl.cli.main import app
    keys = [(s.name, f) for s in dataclasses.fields(Config) for f in dataclasses.fields(s.type if isinstance(
        s.type, type) else type(getattr(Config(), s.name)))]
    assert len(keys) > 50
    assert all(f.metadata.get("doc") for _, f in keys)
    res = CliRunner().invoke(app, ["config", "--set", "train.lr=3e-6"])
    assert res.exit_code == 0, res.output
    for section, f in keys:
        assert f"{f.name} = " in res.output or f"# {f.name} = (unset)" in res.output, (section, f.name)
    assert load_config(sets=["train.lr=3e-6"]) == _reload(res.output)


def _reload(text: str):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(text)
    return load_config(fh.name)
