"""Frugal training on a CUDA GPU: 8-bit AdamW (bitsandbytes), LoRA on an fp16-stored base with fp32
compute (the Pascal recipe), optimizer state in pinned host memory. Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="8-bit AdamW requires bitsandbytes (pip install bitsandbytes)")

FAST = ["rollout.max_new_tokens=16", "train.prompts_per_step=2", "rollout.n_samples=4", "run.tensorboard=false",
        "data.num_examples=64", "train.lr=1e-3", "run.save_every=0"]
REWARD = f'reward.function="{Path(__file__).with_name("reward_fns.py")}:vowel_share"'


def trainer(model_dir: Path, run_dir: Path, *sets: str, resume: Path | None = None):
    from conftest import prepare_trainer
    return prepare_trainer(model_dir, run_dir, [*FAST, REWARD, *sets], resume=resume)


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


@needs_bnb
def test_adamw8bit_trains_and_resumes_exactly(tiny_llama, tmp_path):
    from edgerl.train import checkpoint
    from edgerl.train.metrics import read_metrics
    sets = ["plan.optimizer=adamw8bit", "train.steps=4", "run.save_every=2", "run.export_final=false"]
    t = trainer(tiny_llama, tmp_path / "straight", *sets)
    assert t.plan.optimizer == "adamw8bit" and type(t.state.actor.optim).__name__ == "LocalAdamW8bit"
    t.run()
    embed = t.actor.lm.model.embed_tokens.weight  # 49152 x 64: far above bitsandbytes' 4096-value minimum
    assert t.state.actor.optim.state[embed]["state1"].dtype == torch.uint8 and t.state.actor.optim.state[embed]["state1"].is_cuda
    rows = read_metrics(tmp_path / "straight")
    assert all(math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0 for r in rows)
    trainer(tiny_llama, tmp_path / "split", *sets[:-2], "train.steps=2", "run.save_every=2",
            "run.export_final=false").run()
    ck = checkpoint.latest(tmp_path / "split")
    trainer(tiny_llama, tmp_path / "split", *sets, resume=ck).run()
    for ra, rb in zip(rows, read_metrics(tmp_path / "split")):
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)


def test_lora_on_an_fp16_base_computes_in_fp32(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM
    t = trainer(tiny_llama, tmp_path / "run", "lora.enabled=true", "lora.rank=4", "plan.dtype=fp32",
                "plan.base_dtype=fp16", "train.steps=2", "run.export_final=true")
    base = {n: p for n, p in t.actor.named_parameters() if ".lora_" not in n}
    assert {p.dtype for p in base.values()} == {torch.float16}
    before = {n: local(p).clone() for n, p in base.items()}
    t.run()
    for n, p in base.items():
        assert torch.equal(local(p), before[n]), n
    ids = torch.randint(10, 1000, (2, 12), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref, _ = t.ref(ids, mask, ids[:, 6:], 5, 1.0)
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16).float().cuda().eval()
        logits = plain(input_ids=ids, attention_mask=mask).logits[:, 5:11].double()
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 6:, None]).squeeze(-1)
    torch.testing.assert_close(ref.double(), want, rtol=0, atol=1e-4)  # fp32 GEMMs: TF32 off by default
    assert (tmp_path / "run" / "final-adapter" / "adapter_model.safetensors").exists()


def test_optimizer_state_waits_in_pinned_host_memory(tiny_llama, tmp_path):
    t = trainer(tiny_llama, tmp_path / "run", "plan.optimizer_offload=true", "train.steps=2")
    assert t.state.actor.offload.enabled and t.state.actor.offload.pin
    t.run()
    assert t.state.actor.offload.offloaded and t.state.actor.offload.device_bytes() == 0
    assert t.state.actor.offload._host and all(h.is_pinned() for h in t.state.actor.offload._host.values())
    with t.state.actor.offload.resident():
        assert t.state.actor.offload.device_bytes() > 0
        assert all(s["exp_avg"].is_cuda for s in t.state.actor.optim.state.values())
