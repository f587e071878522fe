"""Input that once reached the user as a traceback or as another error than its own: model names the Hub
refuses, a home folder of no user, a float past fp32, and the Python entry given the wrong types. Each is
one line with exit status 2 from the CLI, and the same message as an edgerl error from `edgerl.prepare`."""

from __future__ import annotations

import pytest
from test_hostile_input_on_cpu import one_line, run

import edgerl
from edgerl.core.errors import ConfigError

CPU = ["--set", 'run.profile="cpu"']


@pytest.mark.parametrize("model,text", [
    ("Qwén/Möдель", "unknown model 'Qwén/Möдель'"),
    ("a/..", "unknown model 'a/..'"),
    ("~nosuchuser/x", "model.path ~nosuchuser/x: there is no user 'nosuchuser' on this machine"),
])
def test_a_model_name_the_hub_refuses_or_a_home_of_no_user_is_one_line(model, text, tmp_path):
    one_line(run("train", "--model", model, "--out", tmp_path / "r", *CPU), text)
    assert not (tmp_path / "r").exists()


def test_a_float_past_fp32_is_refused_with_its_range(tmp_path):
    one_line(run("train", "--out", tmp_path / "r", *CPU, "--set", "algo.clip_high=1e39"),
             "algo.clip_high must be >= 0 and at most 3.403e+38, the largest 32-bit float")
    with pytest.raises(ConfigError, match="algo.clip_high must be >= 0 and at most 3.403e"):
        edgerl.prepare(None, out=tmp_path / "r", log=None, **{"algo.clip_high": 1e39})


@pytest.mark.parametrize("args,kwargs,text", [
    ((123,), {}, "prepare(123): the config is a TOML file's path, a Config, a dict of sections"),
    (([1],), {}, "(got list)"),
    (({1, 2},), {}, "(got set)"),
    ((None,), {"train": {"steps": {1}}}, "prepare(train.steps={1}): a config value is a number"),
    ((None,), {"log": 3}, "prepare(log=3): give a function that takes one line of text"),
    ((None,), {"out": 5}, "prepare(out=5): give a folder's path"),
])
def test_the_python_entry_raises_edgerl_errors_for_the_wrong_types(args, kwargs, text):
    with pytest.raises(ConfigError) as e:
        edgerl.prepare(*args, **kwargs)
    assert text in str(e.value)


def test_log_none_is_silent(tiny_llama, tmp_path, capsys):
    with edgerl.prepare(None, out=tmp_path / "r", log=None, **{"model.path": str(tiny_llama), "run.profile": "cpu",
                                                              "data.num_examples": 8}):
        pass
    assert capsys.readouterr().out == ""
