"""The training loop on a CUDA GPU: bf16 with the Triton kernel and CUDA-graph rollout, fp16 with the
gradient scaler, PPO, and a P40 emulated under a memory cap. Skipped without CUDA."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

FAST = ["rollout.max_new_tokens=16", "train.prompts_per_step=2", "rollout.n_samples=4", "run.tensorboard=false",
        "data.num_examples=64", "train.lr=1e-4", "train.steps=3", "run.save_every=0"]


def train(model_dir: Path, run_dir: Path, *sets: str):
    from edgerl.train.metrics import read_metrics
    from conftest import prepare_trainer
    t = prepare_trainer(model_dir, run_dir, [*FAST, *sets])
    t.run()
    return t.plan, t, read_metrics(run_dir)


def finite(rows, key):
    return all(isinstance(r.get(key), float) and math.isfinite(r[key]) for r in rows)


def test_bf16_grpo_with_triton_and_graphs(tiny_llama, tmp_path):
    plan, t, rows = train(tiny_llama, tmp_path / "run")
    assert plan.dtype.compute == "bf16" and plan.kernel_backend == "triton" and plan.rollout_engine == "static"
    assert "graph" in t.engine.describe().lower(), t.engine.describe()
    if torch.cuda.get_device_capability() >= (8, 0):   # the plan runs the Triton decode layers there
        assert plan.decode_backend == "triton-layers" and "Triton layers" in t.engine.describe(), t.engine.describe()
    assert all(r["rollout/logprob_diff"] < 2e-2 for r in rows), [r["rollout/logprob_diff"] for r in rows]
    assert finite(rows, "actor/pg_loss") and finite(rows, "actor/grad_norm")
    assert rows[-1]["memory/peak_allocated_gib"] > 0


def test_fp16_uses_the_gradient_scaler(tiny_llama, tmp_path):
    plan, t, rows = train(tiny_llama, tmp_path / "run", 'plan.dtype="fp16"')
    assert plan.dtype.grad_scaler and t.state.loop.scaler is not None
    assert finite(rows, "actor/grad_norm") and t.state.loop.scaler.get_scale() > 0


def test_ppo_with_critic(tiny_qwen, tmp_path):
    plan, t, rows = train(tiny_qwen, tmp_path / "run", 'algo.advantage="gae"', "rollout.n_samples=2")
    assert finite(rows, "critic/vf_loss")


def test_p40_emulation_through_the_cli(tiny_llama, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgerl.cli", "train", "--profile", "p40", "--model", str(tiny_llama),
           "--out", str(run), *sum((["--set", s] for s in FAST), [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "emulating Tesla P40" in out.stdout and "speed is NOT emulated" in out.stdout
    plan = json.loads((run / "plan.json").read_text())["plan"]
    assert plan["dtype"]["compute"] == "fp32" and plan["kernel_backend"] == "torch"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["memory/peak_reserved_gib"] < 24


@pytest.mark.parametrize("resident", [True, False])
def test_a_resident_engine_captures_its_graph_once(tiny_llama, tmp_path, resident):
    plan, t, rows = train(tiny_llama, tmp_path / "run", f"plan.rollout_resident={str(resident).lower()}")
    assert plan.rollout_resident == resident and plan.rollout_engine == "static"
    # synced in place, a resident engine replays the graph captured at step 1; a released one re-captures
    assert [r["rollout/captures"] for r in rows] == ([1.0, 0.0, 0.0] if resident else [1.0, 1.0, 1.0])
    assert finite(rows, "actor/grad_norm")
    assert all(r["rollout/logprob_diff"] < 2e-2 for r in rows), [r["rollout/logprob_diff"] for r in rows]


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("name", ["adamw-bf16", "adamw-bf16-sr"])
def test_bf16_training_state_on_cuda(tiny_llama, tmp_path, name, offload):
    """The bf16 optimizers train on the GPU with the fused step; with parameter offload the weights and
    state live in host memory and the step streams them through the GPU."""
    sets = [f'plan.optimizer="{name}"'] + (["plan.param_offload=true"] if offload else [])
    plan, t, rows = train(tiny_llama, tmp_path / "run", *sets)
    optim = t.state.actor.optim
    assert plan.dtype.param == "bf16" and type(optim).__name__ == "AdamWBF16"
    assert {p.dtype for p in t.actor.parameters()} == {torch.bfloat16}
    assert optim.uses_fused(t.device)
    assert plan.param_offload == offload and (optim.step_device == t.device if offload else optim.step_device is None)
    if offload:
        p = next(iter(t.actor.parameters()))
        assert p.to_local().device.type == "cpu" and optim.state[p]["exp_avg"].to_local().is_pinned()
    assert finite(rows, "actor/grad_norm") and finite(rows, "actor/pg_loss")


@pytest.fixture(scope="module")
def tiny_llama_head32(tmp_path_factory):
    """Heads of 32 (2 query heads over 1 KV head): a size the CUDA C decode kernels take (the tiny default's
    16 is not), so an fp32 QLoRA plan decodes through them and the fused NF4 kernel."""
    from conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-head32"), num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_qlora_rollout_runs_the_quantized_actor_in_a_graph(tiny_llama_head32, tmp_path, dtype):
    pytest.importorskip("bitsandbytes", reason="the quantized base needs bitsandbytes")
    plan, t, rows = train(tiny_llama_head32, tmp_path / "run", "lora.enabled=true", "lora.rank=4",
                          'plan.base_dtype="nf4"', f'plan.dtype="{dtype}"', "algo.kl_coef=0.01")
    assert plan.base_dtype == "nf4" and plan.rollout_engine == "static" and not t.engine.needs_weights
    # fp32 compute (a P40's) decodes through the CUDA C kernels and the fused NF4 kernel; the trainer scores
    # through bitsandbytes
    assert (plan.decode_backend == "cuda-c") == (dtype == "fp32")
    assert ("14 NF4 layers through the fused kernel" in t.engine.describe()) == (dtype == "fp32"), \
        t.engine.describe()
    assert finite(rows, "actor/grad_norm") and finite(rows, "actor/kl")
    # the log-probs the engine sampled with are the trainer's own on the same 4-bit weights
    tol = 1e-4 if dtype == "fp32" else 5e-2
    assert all(r["rollout/logprob_diff"] < tol for r in rows), [r["rollout/logprob_diff"] for r in rows]


OUTSIDE = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import pynvml, torch
from conftest import prepare_trainer
model, run, resume, sets = {model!r}, Path({run!r}), {resume!r}, {sets!r}
t = prepare_trainer(Path(model), run, sets, resume=Path(resume) if resume else None)
t.run()
torch.cuda.synchronize()
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
used = next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()), None)
free, total = torch.cuda.mem_get_info()
print(json.dumps({{"outside": None if not used else used - torch.cuda.memory_reserved(), "step": t.step,
                  "device_outside": total - free - torch.cuda.memory_reserved()}}))
"""


@pytest.mark.parametrize("lora", [False, True])
def test_a_resumed_run_holds_no_more_memory_outside_the_allocator(tiny_llama, tmp_path, lora):
    """A checkpoint's full state dicts load into a one-process run without a collective, so resuming does not
    create the process group's NCCL communicator, whose buffers (about 0.5 GiB) lie outside torch's allocator:
    the resumed process holds as much device memory outside the allocator as the fresh one (what NVML counts for
    the process, or else the device's used memory, less what torch reserved)."""
    sets = [s for s in FAST if not s.startswith(("train.steps", "run.save_every"))] + ["run.save_every=1"] + (
        ["lora.enabled=true"] if lora else [])
    run = tmp_path / "run"

    def outside(steps: int, resume: str = "") -> dict:
        code = OUTSIDE.format(tests=str(Path(__file__).parent), model=str(tiny_llama), run=str(run), resume=resume,
                              sets=[*sets, f"train.steps={steps}"])
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    fresh = outside(2)
    from edgerl.train import checkpoint
    resumed = outside(3, str(checkpoint.latest(run)))
    assert fresh["step"] == 2 and resumed["step"] == 3
    # NVML's figure for the process where it sees it (a PID namespace can hide it), else the device's used memory
    # (the test runs alone on its GPU)
    key = "outside" if fresh["outside"] is not None and resumed["outside"] is not None else "device_outside"
    print(f"outside the allocator ({key}): fresh {fresh[key] / 2**20:.0f} MiB, resumed {resumed[key] / 2**20:.0f} MiB")
    assert resumed[key] <= fresh[key] + 128 * 2**20, (fresh, resumed)
