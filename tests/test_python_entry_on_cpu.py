"""`import edgerl; run = edgerl.prepare(...); run.train()`: overrides as sections or dotted keys, user errors
raised before anything is written, and the example script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import edgerl
from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError, DataError

FAST = {"rollout.max_new_tokens": 8, "train.prompts_per_step": 2, "rollout.n_samples": 4, "run.loggers": [],
        "data.num_examples": 32, "algo.kl_coef": 0.0, "run.profile": "cpu", "run.export_final": False}


def test_prepare_then_train(tiny_llama, tmp_path):
    notes: list[str] = []
    run = edgerl.prepare(None, out=tmp_path / "run", log=notes.append, model={"path": str(tiny_llama)},
                         train={"steps": 2}, **FAST, **{"eval.data": "builtin:arithmetic", "eval.max_prompts": 4})
    assert run.config.train.steps == 2 and run.plan.micro_batch >= 1 and run.run_dir == tmp_path / "run"
    assert (tmp_path / "run" / "config.toml").exists()
    seen = []
    assert run.train(lambda step, m: seen.append(step)) == tmp_path / "run"
    assert seen == [0, 1, 2] and [r["step"] for r in run.metrics()] == [0, 1, 2]
    assert "eval/accuracy" in run.metrics()[-1]
    again = edgerl.prepare(resume=tmp_path / "run", log=notes.append, train={"steps": 3})   # continue it
    again.train()
    assert [r["step"] for r in again.metrics()] == [0, 1, 2, 3]


def test_a_config_object_or_dict(tiny_llama, tmp_path):
    cfg = load_config(None, [f'model.path="{tiny_llama}"', 'run.profile="cpu"'])
    with edgerl.prepare(cfg, out=tmp_path / "a", log=lambda s: None, train={"steps": 1}) as run:
        assert run.config.train.steps == 1 and run.config.model.path == str(tiny_llama)
    with edgerl.prepare({"model": {"path": str(tiny_llama)}, "run": {"profile": "cpu"}}, out=tmp_path / "b",
                        log=lambda s: None) as run:
        assert run.config.model.path == str(tiny_llama)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"train": {"stepz": 2}}, ConfigError, "prepare(train.stepz=2): unknown config key 'train.stepz'"),
    ({"train.lr": -1.0}, ConfigError, "train.lr must be > 0"),
    ({"steps": 3}, ConfigError, "give a section with a dict of its keys"),
    ({"data": {"path": "missing.jsonl"}}, DataError, "missing.jsonl does not exist"),
])
def test_user_errors_are_raised_before_anything_is_written(tiny_llama, tmp_path, kwargs, error, message):
    with pytest.raises(error) as e:
        edgerl.prepare(None, out=tmp_path / "run", log=lambda s: None,
                       **{"model.path": str(tiny_llama), "run.profile": "cpu"}, **kwargs)
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()


def test_import_edgerl_does_not_import_torch():
    code = "import sys, edgerl; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.slow
def test_the_example_script_runs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    from edgerl.core.errors import EmbeddedModelError
    from edgerl.models.embedded import embedded_folder
    try:
        embedded_folder("smollm2-135m-instruct")   # the demo's model, converted once into the cache
    except EmbeddedModelError as e:
        pytest.skip(str(e))
    out = subprocess.run([sys.executable, str(root / "examples" / "python_entry.py"), "--steps", "2", "--out",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "held-out accuracy by step: [(0," in out.stdout
    from edgerl.train.metrics import plot, read_samples
    samples = read_samples(tmp_path / "run")
    assert {(s["step"], s["kind"]) for s in samples} == {(0, "eval"), (1, "train"), (1, "eval"), (2, "train"),
                                                         (2, "eval")}
    assert plot(tmp_path / "run").stat().st_size > 0


@pytest.mark.parametrize("doc", ["docs/guide.md", "docs/python.md", "examples/python_entry.py"])
def test_the_documented_step_callback_takes_the_evaluation_before_training(doc, capsys):
    """Step 0 is the held-out evaluation before the first step: its metrics are eval/* only, with no
    reward/mean. Each documented `on_step` prints both kinds of step (it once raised KeyError at step 0)."""
    import re
    root = Path(__file__).resolve().parents[1]
    text = (root / doc).read_text()
    found = re.search(r"^def on_step\(.*?(?=\n\n)", text, re.S | re.M)
    assert found, f"{doc} has no on_step callback"
    scope: dict = {}
    exec(found.group(0), scope)
    scope["on_step"](0, {"eval/accuracy": 0.547, "eval/reward": 0.547, "eval/response_length": 20.0})
    scope["on_step"](1, {"reward/mean": 0.031, "loss/policy": 0.1, "eval/accuracy": 0.6})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "0.547" in out[0] and "0.031" in out[1], out
