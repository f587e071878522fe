"""The training loop end to end on tiny random models: GRPO and PPO, learning, resume, signals, failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from edgerl.train import checkpoint
from edgerl.train.metrics import read_metrics
from edgerl.train.trainer import Trainer, TrainingError
from conftest import prepare_trainer

REWARDS = Path(__file__).with_name("reward_fns.py")
FAST = ["rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4", "run.tensorboard=false",
        "data.num_examples=64", "train.lr=1e-4"]


def make_trainer(model_dir: Path, run_dir: Path, *sets: str, resume: Path | None = None,
                 branch: bool = False) -> Trainer:
    return prepare_trainer(model_dir, run_dir, ['run.profile="cpu"', *FAST, *sets], resume=resume, branch=branch)


REQUIRED = ["reward/mean", "reward/std", "response/length_mean", "response/length_min", "response/length_max",
            "response/truncated", "actor/kl", "actor/entropy", "actor/pg_loss", "actor/clip_frac",
            "actor/approx_kl", "actor/grad_norm", "actor/lr", "perf/tokens_per_s", "perf/step_s",
            "time/rollout_s", "time/score_s", "time/update_s", "memory/host_rss_gib"]


def test_grpo_end_to_end_exports_a_loadable_model(tiny_llama, tmp_path):
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=2", "run.save_every=1")
    t.run()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for key in REQUIRED:
        assert key in rows[-1], key
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "run")] == ["step-000001", "step-000002"]
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    ours = dict(t.actor.lm.named_parameters())
    for name, p in exported.named_parameters():
        mine = ours[name]
        mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
        assert torch.equal(p, mine.detach()), name


def test_ppo_with_a_critic(tiny_qwen, tmp_path):
    t = make_trainer(tiny_qwen, tmp_path / "run", "train.steps=2", "algo.advantage=gae", "rollout.n_samples=2",
                     "algo.kl_in=reward", "train.mini_batch=2", "train.ppo_epochs=2")
    t.run()
    last = read_metrics(tmp_path / "run")[-1]
    for key in ("critic/vf_loss", "critic/explained_var", "critic/grad_norm", "actor/clip_frac"):
        assert key in last
    tensors, state, meta = checkpoint.load(checkpoint.latest(tmp_path / "run"))
    assert "critic" in tensors and "critic_optim" in state and meta["step"] == 2


def test_a_tiny_model_learns_a_simple_reward(char_model, tmp_path):
    t = make_trainer(char_model, tmp_path / "run", "train.steps=12", f'reward.function="{REWARDS}:share_of_a"',
                     f'data.path="{char_model / "prompts.jsonl"}"', 'data.answer_key=""', "data.chat_template=never",
                     "rollout.max_new_tokens=16", "rollout.stop_at_eos=false", "train.lr=1e-2",
                     "train.prompts_per_step=4", "rollout.n_samples=8", "algo.kl_coef=0", "run.save_every=0",
                     "run.export_final=false")
    start = time.time()
    t.run()
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "run")]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > max(0.2, 3 * first), f"reward did not rise: {rewards}"
    assert time.time() - start < 180  # well under a minute on an idle 2-core machine


def test_resume_continues_exactly(tiny_llama, tmp_path):
    sets = ["train.steps=4", "run.save_every=2", "run.export_final=false", "train.mini_batch=4"]
    make_trainer(tiny_llama, tmp_path / "straight", *sets).run()
    make_trainer(tiny_llama, tmp_path / "split", "train.steps=2", *sets[1:]).run()
    ck = checkpoint.latest(tmp_path / "split")
    assert ck.name == "step-000002"
    make_trainer(tiny_llama, tmp_path / "split", *sets, resume=ck).run()
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/entropy", "actor/kl",
                    "actor/grad_norm", "actor/lr"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_nan_loss_skips_updates_then_aborts(tiny_llama, tmp_path, monkeypatch):
    import edgerl.train.trainer as tr
    real = tr.algos.compute_policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats
    monkeypatch.setattr(tr.algos, "compute_policy_loss", nan_loss)
    # every row computed: a random model's rewards are all equal, and skipped rows would compute no loss
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=5", "train.max_bad_steps=2",
                     "algo.skip_uniform_groups=false")
    before = {k: v.detach().clone() for k, v in t.actor.state_dict().items()}
    with pytest.raises(TrainingError, match="NaN or infinite in 2 steps in a row"):
        t.run()
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["actor/skipped_updates"] == 1.0
    for k, v in t.actor.state_dict().items():  # skipped updates leave the weights alone
        assert torch.equal(v.detach(), before[k]), k


def test_a_kv_cache_overflow_in_the_rollout_saves_the_last_good_state(tiny_llama, tmp_path, monkeypatch):
    """A key or value past an fp16 KV cache's range stops the rollout (CacheOverflow) before the update: the steps
    done are kept (a checkpoint of step 1 here, with no periodic saves) and the message names the setting."""
    from edgerl.rollout.decode_step import CacheOverflow
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=3", "run.save_every=0")
    real = t.rollout

    def overflowing(prompts):
        if t.step == 1:
            raise CacheOverflow("the rollout wrote a key or value past float16's range into the KV cache; set "
                                "plan.kv_cache_dtype=fp32")
        return real(prompts)
    monkeypatch.setattr(t, "rollout", overflowing)
    with pytest.raises(CacheOverflow) as e:
        t.run()
    msg = str(e.value)
    assert "set plan.kv_cache_dtype=fp32" in msg and "saved the last good state (step 1)" in msg, msg
    _, state, _ = checkpoint.load(checkpoint.latest(tmp_path / "run"))
    assert state["train"]["step"] == 1


def test_out_of_memory_saves_the_last_good_state(tiny_llama, tmp_path, monkeypatch):
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=3", "run.save_every=0")
    real = t.step_once

    def step_then_oom():
        if t.step == 1:
            t.state.loop.sampler.next_batch()  # the failing step had already drawn its prompts
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real()
    monkeypatch.setattr(t, "step_once", step_then_oom)
    with pytest.raises(TrainingError) as e:
        t.run()
    msg = str(e.value)
    assert "out of memory in step 2" in msg and "the plan estimated" in msg and "Try --set" in msg
    assert "saved the last good state (step 1)" in msg
    _, state, _ = checkpoint.load(checkpoint.latest(tmp_path / "run"))
    assert state["train"]["step"] == 1
    # the data position is that of the last completed step, so a resume redoes step 2's prompts
    fresh = make_trainer(tiny_llama, tmp_path / "fresh", "train.steps=1", "run.save_every=0")
    fresh.state.loop.sampler.next_batch()
    assert state["train"]["sampler"] == fresh.state.loop.sampler.state_dict()


def test_out_of_memory_under_a_budget_says_the_budget_caps_the_allocator(tiny_llama, tmp_path, monkeypatch):
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=2", "run.save_every=0", "plan.memory_gib=20")

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(t, "step_once", oom)
    with pytest.raises(TrainingError, match=r"or raise plan.memory_gib=20 \(the allocator is capped at it\)"):
        t.run()


def test_reward_exceptions_name_the_sample(tiny_llama, tmp_path):
    from edgerl.rewards.rules import RewardError
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=1", f'reward.function="{REWARDS}:broken"')
    with pytest.raises(RewardError, match=r"sample 0 of the batch.*KeyError: 'expected_field'"):
        t.run()


@pytest.mark.slow
def test_sigterm_mid_run_leaves_a_loadable_checkpoint(tiny_llama, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgerl.cli", "train", "--model", str(tiny_llama), "--steps", "50",
           "--out", str(run), *sum((["--set", s] for s in FAST + ["run.save_every=0"]), [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step    1"):
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(seen) + out
    assert "SIGTERM received" in out and "resume with" in out
    ck = checkpoint.latest(run)
    tensors, state, meta = checkpoint.load(ck)
    assert 1 <= meta["step"] < 50 and "actor" in tensors
    t = make_trainer(tiny_llama, run, "train.steps=" + str(meta["step"] + 1), "run.save_every=0", resume=ck)
    t.run()
    assert t.step == meta["step"] + 1


@pytest.mark.parametrize("sets", [[], ["lora.enabled=true"], ['algo.advantage="gae"']])
def test_a_one_process_run_calls_no_collective(tiny_llama, tmp_path, monkeypatch, sets):
    """A single-GPU run's NCCL communicator is created lazily (models.init_distributed), so it costs no
    device memory only if nothing calls a collective: building the models, steps, checkpoints and the
    export. Counted at both levels a collective can pass: the process group's methods (torch.distributed's
    Python API) and the dispatcher (c10d and functional-collective ops, which DTensor and FSDP2 use)."""
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    seen: list[str] = []
    for name in ("allreduce", "allgather", "_allgather_base", "reduce_scatter", "_reduce_scatter_base", "broadcast",
                 "barrier", "gather", "scatter", "alltoall_base", "allreduce_coalesced",
                 "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
        orig = getattr(c10d.ProcessGroup, name)
        monkeypatch.setattr(c10d.ProcessGroup, name,
                            lambda self, *a, _o=orig, _n=name, **k: (seen.append(_n), _o(self, *a, **k))[1])

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "c10d" in func.namespace:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Collectives():
        t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=2", "run.save_every=1", *sets)
        t.run()
    assert (tmp_path / "run" / "final").is_dir() and len(checkpoint.checkpoints(tmp_path / "run")) == 2
    assert seen == [], seen
    # resuming loads the checkpoint's full state dicts: on one process, copied into the local shards, not
    # scattered over the group (which would create the communicator, about 0.5 GiB of device memory)
    with Collectives():
        t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=3", "run.save_every=1", *sets,
                         resume=checkpoint.latest(tmp_path / "run"))
        t.run()
    assert t.step == 3 and seen == [], seen
    with Collectives():   # the counting itself works: a collective on this group is seen
        dist.all_reduce(torch.ones(2))
    assert seen == ["allreduce", "c10d.allreduce_.default"], seen


def test_profile_step_records_that_step_and_never_overwrites_a_recording(tiny_llama, tmp_path):
    import json
    t = make_trainer(tiny_llama, tmp_path / "run", "train.steps=2", "run.profile_step=2", "run.save_every=0",
                     "run.export_final=false")
    t.run()
    folder = tmp_path / "run" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2.trace.json", "step-2.txt"]   # step 1 not recorded
    text = (folder / "step-2.txt").read_text()
    assert text.startswith("step 2 of 2 on cpu; plan: fp32") and "aten::" in text and "Self CPU" in text
    trace = json.loads((folder / "step-2.trace.json").read_text())
    assert any("aten::" in e.get("name", "") for e in trace["traceEvents"])
    before = (folder / "step-2.txt").read_bytes()
    with t._profiled(2):   # the same step recorded again (a resumed run): beside, not over, the first
        torch.ones(3).sum()
    assert (folder / "step-2.txt").read_bytes() == before and (folder / "step-2-2.txt").exists()


def test_a_negative_profile_step_is_refused(tiny_llama, tmp_path):
    from edgerl.core.errors import ConfigError
    with pytest.raises(ConfigError, match=r"run.profile_step"):
        make_trainer(tiny_llama, tmp_path / "run", "run.profile_step=-1")
    assert not (tmp_path / "run").exists()


def test_prepare_applies_the_plans_torch_switches(tiny_llama, tmp_path, monkeypatch):
    """session.prepare sets the plan's process-wide switches (cuDNN's SDPA off on CUDA) for every run."""
    from edgerl.train import session
    seen = []
    monkeypatch.setattr(session, "apply_switches", lambda plan, device: seen.append((plan.attention, device.type)))
    make_trainer(tiny_llama, tmp_path / "run", "train.steps=1")
    assert seen == [("sdpa", "cpu")]


def _agreed_on_two_ranks(rank: int, store: str, out: str) -> None:
    """Rank 1's rollout overflows its KV cache, rank 0's finishes: what `Trainer._agreed` raises on each."""
    import json
    import types
    import torch.distributed as dist
    from edgerl.rollout.decode_step import CacheOverflow
    from edgerl.train.trainer import Trainer
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        def rollout():
            if rank == 1:
                raise CacheOverflow("past float16's range; set plan.kv_cache_dtype=fp32")
            return 7
        try:
            got = {"returned": Trainer._agreed(types.SimpleNamespace(world=2, rank=rank), rollout)}
        except Exception as e:   # noqa: BLE001 - the test reads what each rank raised
            got = {"raised": type(e).__name__, "message": str(e)}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_a_kv_cache_overflow_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    """Under torchrun a rollout that overflowed on rank 1 alone raises the same CacheOverflow, naming the rank, on
    every rank at the same point (rank 0 does not wait for rank 1 at the next collective)."""
    import json
    import torch.multiprocessing as mp
    mp.spawn(_agreed_on_two_ranks, args=(str(tmp_path / "store"), str(tmp_path / "got")), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"got.{r}").read_text()) for r in (0, 1)]
    for g in got:
        assert g.get("raised") == "CacheOverflow", got
        assert g["message"] == "past float16's range; set plan.kv_cache_dtype=fp32 (on rank 1 of 2)", got
