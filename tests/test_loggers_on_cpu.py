"""run.loggers: wandb and MLflow through fakes of their modules (no network), a resumed run logging into the same
wandb/MLflow run, TensorBoard's text tab for samples, run.tensorboard mapped onto run.loggers, and a missing
package as one line naming the extra."""

from __future__ import annotations

import json
import sys
import types

import pytest

from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError
from edgerl.train.loggers import check_installed
from edgerl.train.metrics import MetricsWriter, read_samples


class Recorder:
    def __init__(self):
        self.calls: list[tuple] = []


def fake_wandb(rec: Recorder) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    class Run:
        def __init__(self, id):
            self.id = id or "wb-1"

        def log(self, values, step=None):
            rec.calls.append(("log", step, values))

        def finish(self):
            rec.calls.append(("finish",))

    def init(**kw):
        rec.calls.append(("init", kw))
        return Run(kw.get("id"))

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data
    mod.init, mod.Table = init, Table
    return mod


def fake_mlflow(rec: Recorder) -> types.ModuleType:
    mod = types.ModuleType("mlflow")

    class Info:
        def __init__(self, run_id):
            self.run_id = run_id

    class ActiveRun:
        def __init__(self, run_id):
            self.info = Info(run_id)
    mod.set_experiment = lambda name: rec.calls.append(("experiment", name))
    mod.start_run = lambda run_id=None, run_name=None: (rec.calls.append(("start", run_id, run_name)),
                                                          ActiveRun(run_id or "ml-1"))[1]
    mod.log_params = lambda params: rec.calls.append(("params", params))
    mod.log_metrics = lambda values, step=None: rec.calls.append(("metrics", step, values))
    mod.log_text = lambda text, path: rec.calls.append(("text", path, json.loads(text)))
    mod.end_run = lambda: rec.calls.append(("end",))
    return mod


@pytest.fixture
def fakes(monkeypatch):
    wb, ml = Recorder(), Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wb))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(ml))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    return wb, ml


def test_wandb_and_mlflow_get_metrics_and_samples(fakes, tmp_path):
    wb, ml = fakes
    run = tmp_path / "run"
    w = MetricsWriter(run, resume=False, log=None, loggers=["jsonl", "wandb", "mlflow"], samples=True,
                      config={"train": {"lr": 1e-6}}, project=None)
    assert w.note == "wandb run wb-1; MLflow run ml-1"
    w.write(1, {"reward/mean": 0.5, "eval/pass@4": 0.25, "note": "text", "bad": float("nan")})
    w.write_samples(1, "train", [{"prompt": "p", "response": "r", "reward": 1.0, "ground_truth": "4"}])
    w.close()
    init = wb.calls[0][1]
    assert init["project"] == "edgerl" and init["name"] == "run" and init["config"] == {"train": {"lr": 1e-6}}
    assert ("log", 1, {"reward/mean": 0.5, "eval/pass@4": 0.25}) in wb.calls
    table = next(c[2]["samples/train"] for c in wb.calls if c[0] == "log" and "samples/train" in c[2])
    assert table.data == [[1, "p", "r", 1.0, "4"]]
    assert wb.calls[-1] == ("finish",)
    assert ml.calls[0] == ("experiment", "from-env") and ml.calls[1] == ("start", None, "run")
    assert ("params", {"train.lr": "1e-06"}) in ml.calls
    assert ("metrics", 1, {"reward/mean": 0.5, "eval/pass_at_4": 0.25}) in ml.calls   # MLflow's key rules
    assert any(c[0] == "text" and c[1] == "samples/train-step-000001.json" for c in ml.calls)
    assert json.loads((run / "loggers.json").read_text()) == {"wandb": "wb-1", "mlflow": "ml-1"}
    assert read_samples(run)[0]["kind"] == "train"


def test_a_resumed_run_logs_into_the_same_runs(fakes, tmp_path):
    wb, ml = fakes
    run = tmp_path / "run"
    run.mkdir()
    (run / "loggers.json").write_text(json.dumps({"wandb": "abc", "mlflow": "def"}))
    w = MetricsWriter(run, resume=True, log=None, loggers=["wandb", "mlflow"], project="mine")
    w.close()
    assert wb.calls[0][1]["id"] == "abc" and wb.calls[0][1]["project"] == "mine"
    assert ("start", "def", None) in ml.calls and not any(c[0] == "params" for c in ml.calls)


def test_tensorboard_gets_samples_in_its_text_tab(tmp_path):
    pytest.importorskip("tensorboard")
    w = MetricsWriter(tmp_path / "run", resume=False, log=None, loggers=["tensorboard"], samples=True)
    w.write_samples(3, "eval", [{"prompt": "a|b", "response": "line\nbreak", "reward": 0.5, "ground_truth": "1"}])
    w.write(3, {"reward/mean": 1.0})
    w.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "samples/eval/text_summary" in acc.Tags()["tensors"]
    text = acc.Tensors("samples/eval/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "a\\|b" in text and "line<br>break" in text


def test_a_missing_package_names_its_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install 'edgerl\\[mlflow\\]'"):
        check_installed(["jsonl", "tensorboard", "mlflow"])


def test_missing_wandb_stops_train_in_one_line_before_writing(tiny_llama, tmp_path, monkeypatch):
    import importlib.util
    from typer.testing import CliRunner
    from edgerl.cli.main import app
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--model", str(tiny_llama), "--out", str(out), "--set", 'run.profile="cpu"',
                                 "--set", 'run.loggers=["jsonl", "wandb"]'])
    assert r.exit_code == 2 and "pip install 'edgerl[wandb]'" in r.output and "Traceback" not in r.output
    assert not out.exists()


@pytest.mark.parametrize("sets, loggers", [
    ([], ["jsonl", "tensorboard"]),
    (["run.tensorboard=false"], ["jsonl"]),
    (['run.loggers=["jsonl"]', "run.tensorboard=true"], ["jsonl", "tensorboard"]),
    (['run.loggers=["wandb"]'], ["wandb"]),
])
def test_run_tensorboard_maps_onto_run_loggers(sets, loggers):
    cfg = load_config(None, sets)
    assert cfg.run.loggers == loggers and cfg.run.tensorboard is None


@pytest.mark.parametrize("value, message", [
    ('["wandbb"]', "'wandbb' is not one of 'jsonl', 'tensorboard', 'wandb', 'mlflow'; did you mean 'wandb'?"),
    ('["wandb", "wandb"]', "run.loggers names 'wandb' twice"),
    ('"wandb"', "expected a list"),
])
def test_bad_loggers(value, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"run.loggers={value}"])
    assert message in str(e.value)


def test_a_damaged_ids_file_starts_new_runs_and_says_so(fakes, tmp_path):
    wb, _ = fakes
    run = tmp_path / "run"
    run.mkdir()
    (run / "loggers.json").write_text("{not json")
    notes: list[str] = []
    MetricsWriter(run, resume=True, log=notes.append, loggers=["wandb"]).close()
    assert wb.calls[0][1]["id"] is None and any("loggers.json is unreadable" in n for n in notes)
    assert json.loads((run / "loggers.json").read_text()) == {"wandb": "wb-1"}


@pytest.mark.parametrize("text", ['["wb-1"]', '{"wandb": 3}', "7"])
def test_an_ids_file_of_another_shape_starts_new_runs_and_says_so(fakes, tmp_path, text):
    wb, _ = fakes
    (tmp_path / "loggers.json").write_text(text)
    notes: list[str] = []
    MetricsWriter(tmp_path, resume=True, log=notes.append, loggers=["wandb"]).close()
    assert wb.calls[0][1]["id"] is None and any("loggers.json is unreadable" in n for n in notes)


def test_wandb_errors_at_start_and_while_logging_are_one_line(fakes, tmp_path, monkeypatch):
    """wandb's own exceptions (no network, a project name it refuses) name wandb and the way on."""
    from edgerl.core.errors import TrainingError

    class CommError(Exception):
        pass

    def no_network(**kw):
        raise CommError("Network error (ConnectionError), entering retry loop.\nfailed")
    monkeypatch.setattr(sys.modules["wandb"], "init", no_network)
    with pytest.raises(ConfigError, match=r"^run.loggers: wandb could not start a run in project 'a/b\?c' \(CommError: "
                                          r"Network error \(ConnectionError\), entering retry loop. failed\); check the "
                                          r"network, or log offline \(WANDB_MODE=offline\), or remove wandb"):
        MetricsWriter(tmp_path, log=None, loggers=["wandb"], project="a/b?c")
    monkeypatch.setattr(sys.modules["wandb"], "init", fake_wandb(Recorder()).init)
    w = MetricsWriter(tmp_path / "b", log=None, loggers=["wandb"])

    def dropped(values, step=None):
        raise CommError("connection reset")
    w.loggers[0].run.log = dropped
    with pytest.raises(TrainingError, match=r"^run.loggers: wandb failed to log step 3 \(CommError: connection reset\); "
                                            "metrics.jsonl holds every step"):
        w.write(3, {"reward/mean": 1.0})
    w.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == [3]
