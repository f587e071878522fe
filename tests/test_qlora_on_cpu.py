"""A quantized frozen base (QLoRA) end to end on the CPU through bitsandbytes' CPU backend: one copy of
the weights for training, reference and rollout; the rollout's log-probs equal the trainer's; a merged
export in 16 bits that transformers loads; the plan's search reaching NF4 when a float base does not fit."""

from __future__ import annotations

import json

import pytest
import torch

from edgerl.device.device import GiB, Software
from edgerl.train.metrics import read_metrics
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import Task, plan
from edgerl.device.profiles import device_from_profile, get_profile
from test_trainer_on_cpu import REWARDS, make_trainer

pytest.importorskip("bitsandbytes", reason="the quantized base needs bitsandbytes (pip install bitsandbytes)")
pytest.importorskip("peft", reason="LoRA needs peft")

QLORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", 'plan.base_dtype="nf4"',
         f'reward.function="{REWARDS}:vowel_share"', "train.lr=1e-2"]


@pytest.fixture(scope="module")
def qlora_run(tiny_llama, tmp_path_factory):
    run = tmp_path_factory.mktemp("qlora")
    t = make_trainer(tiny_llama, run, *QLORA, "train.steps=2", "run.save_every=1", "algo.kl_coef=0.01")
    base = {n: p.detach().clone() for n, p in t.actor.lm.named_parameters() if not p.requires_grad}
    t.run()
    return t, run, base


def test_one_copy_of_the_weights_serves_rollout_reference_and_training(qlora_run):
    t, run, base = qlora_run
    import bitsandbytes as bnb
    q = t.actor.lm.model.layers[0].self_attn.q_proj
    assert isinstance(q.get_base_layer(), bnb.nn.Linear4bit)
    assert t.plan.base_dtype == "nf4" and t.plan.memory.phases["rollout"].get("generation weights", 0) == 0
    assert not t.engine.needs_weights and t.engine.engine.model is t.actor.lm   # no rollout copy
    assert "no copy" in t.engine.describe()
    for n, p in t.actor.lm.named_parameters():       # the frozen base never changed
        if n in base:
            assert torch.equal(p.detach(), base[n]), n
    rows = read_metrics(run)
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    # the engine's sampled log-probs are the trainer's recomputation on the same quantized weights
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in rows), [r["rollout/logprob_diff"] for r in rows]
    assert all(r["actor/kl"] >= 0 for r in rows)


def test_merged_export_is_16_bit_and_loads(qlora_run, tiny_llama):
    from transformers import AutoModelForCausalLM
    t, run, _ = qlora_run
    folder = run / "final"
    cfg = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes <= {torch.float16, torch.bfloat16}, dtypes
    assert cfg.get("quantization_config") is None
    from edgerl.models.lora import merged_weights
    merged = dict(merged_weights(t.actor.lm))
    for name, p in model.named_parameters():   # the adapted, dequantized weights, rounded once to 16 bits
        torch.testing.assert_close(p.float(), merged[name].float().to(p.dtype).float(), rtol=0, atol=0, msg=name)
    assert (run / "final-adapter" / "adapter_model.safetensors").exists()


def test_resume_with_a_quantized_base_continues_exactly(tiny_llama, tmp_path):
    sets = [*QLORA, "train.steps=4", "run.save_every=2", "run.export_final=false"]
    make_trainer(tiny_llama, tmp_path / "straight", *sets).run()
    make_trainer(tiny_llama, tmp_path / "split", *sets, "train.steps=2").run()
    from edgerl.train import checkpoint
    make_trainer(tiny_llama, tmp_path / "split", *sets, resume=checkpoint.latest(tmp_path / "split")).run()
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_the_plan_goes_to_nf4_when_a_float_base_does_not_fit():
    bnb = Software(torch="2.7.1", torch_cuda="12.6", libs=(("bitsandbytes", "0.50.2"),))
    task = Task(prompt_len=128, response_len=256, prompts_per_step=2, samples_per_prompt=8, lora=True)
    p40 = device_from_profile(get_profile("p40"), bnb, 128 * GiB)
    p = plan(p40, CATALOGUE["qwen2.5-7b"], task)
    assert p.base_dtype == "nf4" and not p.param_offload and p.memory.fits
    assert "did not fit" in p.reasons["base_dtype"] and "one copy of the weights" in p.reasons["base_dtype"]
    assert "generation weights" not in p.memory.phases["rollout"]
    assert p.memory.phases["update"]["dequantization"] > 0
    small = plan(p40, CATALOGUE["qwen2.5-0.5b"], task)
    assert small.base_dtype == "fp16"            # a float base that fits comes first
    without = Software(torch="2.7.1", torch_cuda="12.6")
    with pytest.raises(Exception, match="pip install bitsandbytes"):   # the no-fit message names the way out
        plan(device_from_profile(get_profile("p40"), without, 128 * GiB), CATALOGUE["qwen2.5-7b"], task)
    with pytest.raises(Exception, match="LLM.int8's matmul needs CC >= 7.5"):
        plan(p40, CATALOGUE["qwen2.5-7b"], task, {"base_dtype": "int8"})
    with pytest.raises(Exception, match="only LoRA has"):
        plan(p40, CATALOGUE["qwen2.5-7b"], Task(lora=False), {"base_dtype": "nf4"})


@pytest.mark.parametrize("name", ["adamw-bf16", "adamw-bf16-sr"])
def test_bf16_training_state_through_the_trainer(tiny_llama, tmp_path, name):
    """bf16 weights and AdamW state (no fp32 masters): the model is stored in bf16, the optimizer is the
    compensated one, the plan counts its bytes, and a resume continues exactly."""
    sets = [f'plan.optimizer="{name}"', f'reward.function="{REWARDS}:vowel_share"', "train.lr=1e-3",
            "run.save_every=2", "run.export_final=false"]
    t = make_trainer(tiny_llama, tmp_path / "straight", *sets, "train.steps=4")
    assert type(t.state.actor.optim).__name__ == "AdamWBF16" and t.plan.dtype.param == "bf16"
    assert {p.dtype for p in t.actor.parameters()} == {torch.bfloat16}
    from edgerl.plan.memory import OPTIMIZERS
    n = sum(p.numel() for p in t.actor.parameters())
    assert t.plan.memory.phases["update"]["optimizer state"] == n * OPTIMIZERS[name].state
    t.run()
    make_trainer(tiny_llama, tmp_path / "split", *sets, "train.steps=2").run()
    from edgerl.train import checkpoint
    make_trainer(tiny_llama, tmp_path / "split", *sets, "train.steps=4",
                 resume=checkpoint.latest(tmp_path / "split")).run()
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)


def test_a_damaged_checkpoint_is_one_error_naming_the_file(tiny_llama, tmp_path):
    import shutil
    from edgerl.core.errors import ModelError
    from edgerl.models.quant import load_quantized_lm
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelError, match=r"model.safetensors cannot be read .*download the model again"):
        load_quantized_lm(broken, "nf4", torch.float32, torch.device("cpu"))
