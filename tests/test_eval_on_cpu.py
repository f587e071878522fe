"""Held-out evaluation: accuracy, mean@k and pass@k against plain loops, the held-out built-in task, evaluation
while training (at step 0, every N steps and at the end, training unchanged by it), samples.jsonl, the plot's
panel, `edgerl eval`, and hostile input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import prepare_trainer
from edgerl.cli.main import app
from edgerl.config.load import load_config
from edgerl.core.errors import ConfigError
from edgerl.data.prompts import Prompt
from edgerl.rewards.functions import load_functions
from edgerl.rollout.base import RolloutBatch, SamplingParams
from edgerl.train.evaluate import due, evaluate, on_engine
from edgerl.train.metrics import plot, read_metrics, read_samples

FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.loggers=[]", "data.num_examples=64", "train.lr=1e-4", "algo.kl_coef=0"]


class Words:
    """A tokenizer whose token i decodes to WORDS[i]."""
    def __init__(self, words):
        self.words = words

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(self.words[i] for i in row) for row in ids]


class Scripted:
    """An engine answering prompt p's j-th sample with script[p][j] (greedy: script[p][0])."""
    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, n, params, generator=None):
        self.calls.append((len(prompts), n, params.greedy))
        rows = [p for p in prompts for _ in range(n)]
        resp = [[self.script[p[0]][0 if params.greedy else j]] for p in prompts for j in range(n)]
        return RolloutBatch(rows, resp, [False] * len(resp))


def test_accuracy_mean_and_pass_at_k_match_plain_loops():
    words = [f"#### {v}" for v in range(10)]
    truths = ["3", "5", "7"]
    script = {0: [3, 1, 3, 2], 1: [1, 2, 4, 6], 2: [7, 7, 7, 7]}   # token t answers "#### t"
    prompts = [Prompt(i, f"q{i}", (i,), truths[i], "arithmetic") for i in range(3)]
    res = evaluate(on_engine(Scripted(script)), Words(words), prompts, load_functions(["answer"], None), SamplingParams(8), 4,
                   0, 10, torch.device("cpu"), keep=2)
    correct = [[str(script[p][j]) == truths[p] for j in range(4)] for p in range(3)]
    assert res.metrics["eval/accuracy"] == pytest.approx(sum(c[0] for c in correct) / 3)
    assert res.metrics["eval/mean@4"] == pytest.approx(sum(sum(c) / 4 for c in correct) / 3)
    assert res.metrics["eval/pass@4"] == pytest.approx(sum(any(c) for c in correct) / 3)
    assert res.metrics["eval/prompts"] == 3
    assert [s["correct"] for s in res.samples] == [1.0, 0.0] and res.samples[0]["response"] == "#### 3"


def test_evaluation_is_due_at_the_start_every_n_steps_and_at_the_end():
    assert [s for s in range(11) if due(s, 4, 10)] == [0, 4, 8, 10]
    assert [s for s in range(11) if due(s, 0, 10)] == [0, 10]


def test_the_builtin_heldout_set_leaves_out_training_problems(tiny_llama):
    from edgerl.data.heldout import load_eval_prompts
    from edgerl.data.prompts import load_prompts
    from edgerl.models.load import load_tokenizer
    tok = load_tokenizer(str(tiny_llama))
    cfg = load_config(None, ['eval.data="builtin:arithmetic"', "eval.max_prompts=40", "data.num_examples=2000"])
    train, _ = load_prompts(cfg.data, tok, seed=0, log=None)
    notes: list[str] = []
    held, report = load_eval_prompts(cfg, tok, train, notes.append)
    texts = {p.text for p in train}
    assert len(held) == 40 and not any(p.text in texts for p in held)
    assert report.filtered.get("also training prompts", 0) > 0   # level-1 sums repeat: some are dropped, counted
    assert notes and "dropped" in notes[0]


@pytest.fixture(scope="module")
def evaluated_run(tiny_llama, tmp_path_factory):
    """Two steps with an evaluation at 0, 1 and 2, and the same two steps without."""
    base = tmp_path_factory.mktemp("eval")
    sets = [*FAST, "train.steps=2", "run.save_every=1", "run.export_final=false"]
    t = prepare_trainer(tiny_llama, base / "with", [*sets, 'eval.data="builtin:arithmetic"', "eval.every=1",
                                                    "eval.samples=2", "eval.max_prompts=6", "run.log_samples=3"])
    seen: list[int] = []
    t.run(lambda step, stats: seen.append(step))
    prepare_trainer(tiny_llama, base / "without", sets).run()
    return base, seen


def test_evaluation_runs_at_step_0_each_step_and_leaves_training_unchanged(evaluated_run):
    base, seen = evaluated_run
    rows = read_metrics(base / "with")
    assert [r["step"] for r in rows] == [0, 1, 2] and seen == [0, 1, 2]
    for r in rows:
        for key in ("eval/accuracy", "eval/reward", "eval/mean@2", "eval/pass@2", "eval/prompts", "time/eval_s"):
            assert key in r, (r["step"], key)
    plain = read_metrics(base / "without")
    for a, b in zip(rows[1:], plain):   # the evaluation draws from its own generator
        for key in ("reward/mean", "response/length_mean", "actor/grad_norm"):
            assert a[key] == b[key], key
    samples = read_samples(base / "with")
    kinds = [(s["step"], s["kind"]) for s in samples]
    assert kinds == [(0, "eval")] * 3 + [(1, "train")] * 3 + [(1, "eval")] * 3 + [(2, "train")] * 3 + [(2, "eval")] * 3
    assert {"prompt", "response", "reward", "ground_truth"} <= set(samples[3])


def test_plot_shows_the_evaluation_panel(evaluated_run, tmp_path):
    base, _ = evaluated_run
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    titles: list[str] = []
    real = plt.subplots

    def spy(*a, **k):
        fig, axes = real(*a, **k)
        titles.append(axes)
        return fig, axes
    plt.subplots = spy
    try:
        path = plot(base / "with", tmp_path / "c.png")
    finally:
        plt.subplots = real
    assert path.stat().st_size > 0
    first = titles[0].flat[0]
    assert first.get_title() == "held-out evaluation"
    assert [ln.get_label() for ln in first.get_lines()] == ["accuracy", "mean@2", "pass@2"]


def test_edgerl_eval_a_run_and_a_model(evaluated_run, tiny_llama, tmp_path):
    base, _ = evaluated_run
    out = tmp_path / "res.json"
    r = CliRunner().invoke(app, ["eval", str(base / "with"), "--data", "builtin:arithmetic", "--max-prompts", "3",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["checkpoint"].endswith("step-000002") and res["metrics"]["eval/prompts"] == 3
    assert len(res["samples"]) == 3
    r = CliRunner().invoke(app, ["eval", str(tiny_llama), "--data", "builtin:arithmetic", "--max-prompts", "2",
                                 "--samples", "2", "--set", "rollout.max_new_tokens=4", "--set", 'run.profile="cpu"'])
    assert r.exit_code == 0, r.output
    assert "eval/pass@2" in r.output


@pytest.mark.parametrize("sets, message", [
    (['eval.data="nope/missing.jsonl"'], "eval.data: data file nope/missing.jsonl does not exist"),
    (["eval.every=2"], "eval.every is set but eval.data is not"),
    (['eval.data="builtin:arithmetic"', "eval.samples=-1"], "eval.samples must be 0 to 1024, got -1"),
    (['eval.data="builtin:arithmetic"', "eval.max_prompts=0"], "eval.max_prompts must be 1 to 1000000, got 0"),
    (['eval.data="builtin:nope"'], "unknown built-in task"),
    (['eval.data="builtin:arithmetic"', 'eval.every="often"'], "expected int"),
    (["run.log_samples=-1"], "run.log_samples must be 0 to 1000000, got -1"),
])
def test_hostile_eval_settings_are_one_line_exit_2_and_write_nothing(tiny_llama, tmp_path, sets, message):
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_llama), "--out", str(out), "--set", 'run.profile="cpu"']
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_eval_settings_without_data_are_refused():
    with pytest.raises(ConfigError, match="eval.samples is set but eval.data is not"):
        load_config(None, ["eval.samples=4"])


def test_an_empty_heldout_file_is_one_line(tiny_llama, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = CliRunner().invoke(app, ["eval", str(tiny_llama), "--data", str(empty), "--set", 'run.profile="cpu"'])
    assert r.exit_code == 2 and "eval.data" in r.output and "Traceback" not in r.output


def test_a_scripted_engine_sees_one_greedy_call_and_one_sampled_call():
    words = ["#### 1"]
    engine = Scripted({0: [0, 0]})
    evaluate(on_engine(engine), Words(words), [Prompt(0, "q", (0,), "1", "arithmetic")], load_functions(["answer"], None),
             SamplingParams(4), 2, 0, 0, torch.device("cpu"))
    assert engine.calls == [(1, 1, True), (1, 2, False)]


def test_the_greedy_params_keep_the_rollout_limits():
    p = SamplingParams(7, temperature=0.5, eos_token_ids=(2,))
    seen = []

    class Spy(Scripted):
        def generate(self, prompts, n, params, generator=None):
            seen.append(params)
            return super().generate(prompts, n, params, generator)
    evaluate(on_engine(Spy({0: [0]})), Words(["#### 1"]), [Prompt(0, "q", (0,), "1", "arithmetic")],
             load_functions(["answer"], None), p, 0, 0, 0, torch.device("cpu"))
    assert seen[0].greedy and seen[0].max_new_tokens == 7 and seen[0].eos_token_ids == (2,)



def test_a_damaged_samples_file_is_one_error_and_stays_as_it_was(tmp_path):
    from edgerl.core.errors import RunDirError
    from edgerl.train.metrics import MetricsWriter
    run = tmp_path / "run"
    run.mkdir()
    text = '{"step": 1, "kind": "train"}\nnot json\n{"step": 2, "kind": "train"}\n'
    (run / "samples.jsonl").write_text(text)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="samples.jsonl: line 2 is not a samples row"):
        MetricsWriter(run, resume=True, log=None, loggers=[], samples=True)
    assert (run / "samples.jsonl").read_text() == text


def test_resume_moves_later_samples_aside_and_drops_a_torn_line(tmp_path):
    from edgerl.train.metrics import MetricsWriter
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (0, 1, 2, 3)))
    (run / "samples.jsonl").write_text("".join(f'{{"step": {s}, "kind": "train"}}\n' for s in (1, 2, 3))
                                       + '{"step": 4, "ki')
    notes: list[str] = []
    w = MetricsWriter(run, resume=True, log=notes.append, loggers=[], samples=True)
    w.archive_after(2)
    w.write_samples(3, "train", [{"prompt": "p", "response": "r", "reward": 1.0}])
    w.close()
    assert [s["step"] for s in read_samples(run)] == [1, 2, 3]
    assert [json.loads(x)["step"] for x in (run / "samples.after-step-2.jsonl").read_text().splitlines()] == [3]
    assert any(n.startswith("samples: ignored line 4") for n in notes)


@pytest.mark.parametrize("args, message", [
    (["eval", "smollm2-135m-instruct"], "edgerl eval needs the held-out prompts: --data"),
    (["eval", "smollm2-135m-instruct", "--data", "builtin:arithmetic", "--out", "/no/such/folder/r.json"],
     "the folder /no/such/folder does not exist"),
])
def test_hostile_edgerl_eval_is_one_line(args, message):
    r = CliRunner().invoke(app, [*args, "--set", 'run.profile="cpu"'])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output


# --- edgerl eval: --out, verified checkpoints, the model it loads into, model paths as given ------------

def _eval(*args):
    return CliRunner().invoke(app, ["eval", *[str(a) for a in args]])


def test_eval_out_never_overwrites_without_force_nor_writes_into_a_run(evaluated_run, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(evaluated_run[0] / "with", run)
    mine = tmp_path / "results.json"
    mine.write_text('{"mine": 1}\n')
    r = _eval(run, "--data", "builtin:arithmetic", "--out", mine)
    assert r.exit_code == 2 and f"{mine} exists; pass --force to replace it" in r.output, r.output
    for inside in (run / "plan.json", run / "checkpoints" / "step-000002" / "meta.json", run / "new.json"):
        before = inside.read_bytes() if inside.exists() else None
        r = _eval(run, "--data", "builtin:arithmetic", "--out", inside, "--force")
        assert r.exit_code == 2 and f"is inside the run folder {run}" in " ".join(r.output.split()), r.output
        assert (inside.read_bytes() if inside.exists() else None) == before
    assert mine.read_text() == '{"mine": 1}\n'


def test_eval_verifies_the_checkpoint_as_resume_does(evaluated_run, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(evaluated_run[0] / "with", run)
    weights = run / "checkpoints" / "step-000002" / "actor.safetensors"
    data = bytearray(weights.read_bytes())
    data[5000] ^= 1
    weights.write_bytes(bytes(data))
    r = _eval(run, "--data", "builtin:arithmetic")
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"checkpoint {weights.parent} cannot be evaluated: {weights} is damaged" in said
    assert f"evaluate an earlier one: edgerl eval {run / 'checkpoints' / 'step-000001'}" in said


def test_eval_refuses_a_checkpoint_of_another_architecture(evaluated_run, tiny_qwen):
    r = _eval(evaluated_run[0] / "with", "--data", "builtin:arithmetic", "--set", f'model.path="{tiny_qwen}"')
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"does not fit the model it is loaded into ({tiny_qwen})" in said and "are not in it (e.g. " in said


def test_eval_takes_a_model_path_as_given_and_names_a_missing_one(tiny_llama, tmp_path):
    folder = tmp_path / 'm"x\tb'
    folder.mkdir()
    for f in tiny_llama.iterdir():
        (folder / f.name).symlink_to(f)
    out = tmp_path / "r.json"
    r = _eval(folder, "--data", "builtin:arithmetic", "--max-prompts", 1, "--set", "rollout.max_new_tokens=2",
              "--set", 'run.profile="cpu"', "--out", out)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["model"] == str(folder) and "training on the CPU" not in r.output
    r = _eval(tmp_path / "nonexistent")
    assert r.exit_code == 2 and f"model folder {tmp_path / 'nonexistent'} does not exist" in r.output, r.output
    assert "--data" not in r.output
