"""Resuming a run on another number of processes (torchrun with gloo on the CPU): the weights and optimizer
state re-shard from the checkpoint's full state dicts and the prompt order continues, so 2 steps on 2
processes then 2 on 1 (and 1 then 2) train as 4 steps on one process. Rollouts are greedy (top_k=1) so that
the per-rank sampling streams, which a change of world size restarts, do not change what is generated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONPATH": str(HERE.parent)}
SETS = ["run.profile=\"cpu\"", "train.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=6",
        "rollout.top_k=1", "data.num_examples=32", "run.tensorboard=false", "run.export_final=false",
        "run.save_every=1", "train.lr=1e-3"]


def train(model: Path, n: int, *extra: str) -> subprocess.CompletedProcess:
    """A new run (--out) with SETS, or a resumed one (--resume) with its own config.toml."""
    sets = [] if "--resume" in extra else sum((["--set", s] for s in SETS), [])
    args = ["-m", "edgerl.cli", "train", "--model", str(model), *sets, *extra]
    if n > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900, env=ENV)


def rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from edgerl.train import checkpoint
    tensors, _, _ = checkpoint.load(run / "checkpoints" / f"step-{step:06d}")
    return tensors["actor"]


def ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 1), (1, 2), (2, 4)])
def test_resume_on_another_world_size_trains_as_one_process(tiny_llama, tmp_path, first, second):
    batch = ["--set", f"train.prompts_per_step={max(first, second)}"]   # whole prompts on every rank
    straight = tmp_path / "straight"
    ok(train(tiny_llama, 1, "--steps", "4", "--out", str(straight), *batch))
    run = tmp_path / "changed"
    ok(train(tiny_llama, first, "--steps", "2", "--out", str(run), *batch))
    again = train(tiny_llama, second, "--steps", "4", "--resume", str(run))
    ok(again)
    assert f"resumed on {second} process(es) from a checkpoint written by {first}" in again.stdout
    a, b = rows(straight), rows(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["dist/world_size"] for r in b] == [first, first, second, second]
    for ra, rb in zip(a, b):   # the same prompts, the same greedy responses, the same updates
        assert rb["reward/mean"] == ra["reward/mean"] and rb["response/length_mean"] == ra["response/length_mean"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-3, abs=1e-5), (rb["step"], key)
    wa, wb = weights(straight, 4), weights(run, 4)
    for name, w in wa.items():
        torch.testing.assert_close(wb[name], w, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_world_size_the_batch_does_not_split_over_is_refused_on_resume(tiny_llama, tmp_path):
    run = tmp_path / "run"
    ok(train(tiny_llama, 1, "--steps", "1", "--out", str(run), "--set", "train.prompts_per_step=3"))
    res = train(tiny_llama, 2, "--steps", "2", "--resume", str(run))
    assert res.returncode != 0   # torchrun reports its workers' exit 2 as its own 1
    assert res.stderr.count("does not split") == 1          # one line, from rank 0
    assert "train.prompts_per_step=3 does not split over 2 GPUs" in res.stderr
    assert [r["step"] for r in rows(run)] == [1]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_two_processes(tiny_llama, tmp_path):
    """Two torchrun agents as two "nodes" (c10d rendezvous on localhost, one process each), as a user
    starts them on two machines: one run folder, one log, the same training as one node with two."""
    one_node = tmp_path / "one-node"
    ok(train(tiny_llama, 2, "--steps", "2", "--out", str(one_node)))
    run, port = tmp_path / "two-nodes", free_port()
    args = ["-m", "edgerl.cli", "train", "--model", str(tiny_llama), *sum((["--set", s] for s in SETS), []),
            "--steps", "2", "--out", str(run)]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=edgerl-test",
                                f"--node-rank={node}", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=ENV) for node in (0, 1)]
    outs = [a.communicate(timeout=900) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, out[-2000:] + err[-3000:]
    import re
    printed = [m.group(1) for out, _ in outs for m in map(re.compile(r"step\s+(\d+)\s+reward").match,
                                                           out.splitlines()) if m]
    assert printed == ["1", "2"]          # rank 0 alone prints, on its node
    a, b = rows(one_node), rows(run)
    assert [r["dist/world_size"] for r in b] == [2, 2]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (rb["step"], key)
    for name, w in weights(one_node, 2).items():
        torch.testing.assert_close(weights(run, 2)[name], w, rtol=1e-5, atol=1e-7, msg=name)


def _two_agents(model: Path, run: Path, per_node: list[list[str]]) -> list[tuple[int, str, str]]:
    port = free_port()
    base = ["-m", "edgerl.cli", "train", "--model", str(model), *sum((["--set", s] for s in SETS), []),
            "--steps", "1", "--out", str(run)]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=edgerl-bad",
                                f"--node-rank={node}", *base, *extra], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV) for node, extra in enumerate(per_node)]
    return [(a.returncode, *a.communicate(timeout=900)) for a in agents if a.wait(timeout=900) is not None]


@pytest.mark.slow
def test_nodes_started_with_different_configs_stop_with_one_line(tiny_llama, tmp_path):
    run = tmp_path / "run"
    results = _two_agents(tiny_llama, run, [[], ["--set", "train.lr=0.5"]])
    assert all(code != 0 for code, _, _ in results)
    lines = [ln for _, _, err in results for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "rank 1 of 2 was started with another config than rank 0" in lines[0]
    assert "train.lr" in lines[0]
    assert not run.exists()                     # nothing written


def test_ranks_that_disagree_are_named():
    from edgerl.core.errors import ConfigError, RunDirError
    from edgerl.train.session import check_ranks_agree
    view = {"config": "[train]\nlr = 1e-06\n", "plan": "{}", "decisions": {"dtype": "fp32"}, "device": "P40",
            "unreadable": None}
    check_ranks_agree([view, dict(view)])
    with pytest.raises(ConfigError, match=r"rank 1 of 2 plans differently from rank 0 \(dtype; its GPU: RTX 3090"):
        check_ranks_agree([view, view | {"plan": "{x}", "decisions": {"dtype": "bf16"}, "device": "RTX 3090"}])
    with pytest.raises(ConfigError, match=r"differs in train.lr"):
        check_ranks_agree([view, view | {"config": "[train]\nlr = 0.5\n"}])
    with pytest.raises(RunDirError, match=r"rank 1 of 3 cannot read /r/meta.json: .* every machine mounts"):
        check_ranks_agree([view, view | {"unreadable": "/r/meta.json"}, view])
