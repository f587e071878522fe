"""plan() table-driven over fake devices, the memory search, overrides, and the no-fit message."""

import dataclasses
import re

import pytest

from edgerl.device.device import GiB, MiB, Software
from edgerl.plan.memory import packed_tokens, Setting, estimate
from edgerl.plan.modelspec import CATALOGUE, resolve
from edgerl.plan.plan import PlanError, Task, plan
from edgerl.device.profiles import device_from_profile, get_profile
from fakes import fake_probe

SMALL = Task(prompt_len=256, response_len=256, prompts_per_step=2, samples_per_prompt=8)

# device, extra libs -> dtype, attention, kernel backend, rollout engine, decode backend
TABLE = [
    ("P40", {}, "fp32", "sdpa", "torch", "static", "cuda-c"),
    ("P100", {}, "fp32", "sdpa", "torch", "static", "cuda-c"),
    ("V100", {}, "fp16-mixed", "sdpa", "torch", "static", "cuda-c"),    # Triton's tl.dot has no tensor-core path < 8.0
    ("T4", {}, "fp16-mixed", "sdpa", "torch", "static", "cuda-c"),
    ("GTX1660", {}, "fp16-mixed", "sdpa", "torch", "static", "cuda-c"),
    ("3090", {}, "bf16-mixed", "sdpa", "triton", "static", "triton-layers"),
    ("3090", {"flash_attn": "2.7.4"}, "bf16-mixed", "flash_attention_2", "triton", "static", "triton-layers"),
    ("A100", {"vllm": "0.10.1"}, "bf16-mixed", "sdpa", "triton", "vllm", None),
    ("H100", {"triton": None}, "bf16-mixed", "sdpa", "torch", "static", "torch"),
    ("P40", {"vllm": "0.10.1", "flash_attn": "2.7.4"}, "fp32", "sdpa", "torch", "static", "cuda-c"),
    ("T4", {"vllm": "0.10.1"}, "fp16-mixed", "sdpa", "torch", "vllm", None),
    ("H100", {"flash_attn": "2.7.4"}, "bf16-mixed", "flash_attention_2", "triton", "static", "triton-layers"),
    (None, {}, "fp32", "sdpa", "torch", "static", "torch"),
]


@pytest.mark.parametrize("key,libs,dtype,attention,kernel,engine,backend", TABLE)
def test_decisions_per_device(key, libs, dtype, attention, kernel, engine, backend):
    dev = fake_probe(key, **libs).primary
    p = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL)
    assert (p.dtype.name, p.attention, p.kernel_backend, p.rollout_engine, p.decode_backend) == \
        (dtype, attention, kernel, engine, backend)
    assert p.dtype.grad_scaler == (dtype == "fp16-mixed")
    assert set(p.reasons) >= set(p.DECISIONS)
    assert all(p.reasons[k] for k in p.DECISIONS), "every decision carries a reason"
    assert p.memory.fits and p.memory.total <= p.memory.budget
    if kernel == "triton":
        assert p.kernel_tiles["smem_bytes"] <= dev.smem_per_block_optin


# device, extra libs, overrides -> decode backend, words the reason must hold
DECODE_BACKEND = [
    ("H100", {}, {}, "triton-layers", "five kernels per layer"),
    ("3090", {}, {}, "triton-layers", "reads only the cache columns each row sees"),
    ("H100", {"triton": None}, {}, "torch", "triton is not installed"),
    ("T4", {}, {}, "cuda-c", "fp16 on sm_75: edgerl's CUDA C layer kernels"),
    ("T4", {}, {}, "cuda-c", "Triton supports CC 8.0 and up"),
    ("V100", {}, {}, "cuda-c", "fp16 on sm_70"),
    ("3090", {}, {"dtype": "bf16"}, "triton-layers", "five kernels per layer"),
    ("P40", {}, {}, "cuda-c", "CUDA C layer kernels"),
    ("H100", {}, {"dtype": "fp32"}, "cuda-c", "fp32 on sm_90"),
    ("A100", {"vllm": "0.10.1"}, {}, None, "the vllm engine runs its own decode step"),
    (None, {}, {}, "torch", "CPU: torch's ops"),
]


@pytest.mark.parametrize("key,libs,forced,backend,words", DECODE_BACKEND)
def test_one_decode_backend_per_card_class(key, libs, forced, backend, words):
    dev = fake_probe(key, **libs).primary
    p = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, forced)
    assert p.decode_backend == backend and words in p.reasons["decode_backend"]
    if backend is None:   # the static engine's setting: refused for another engine
        with pytest.raises(PlanError, match="plan.decode_backend=torch is the static engine's"):
            plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, forced | {"decode_backend": "torch"})
        return
    torch_ops = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, forced | {"decode_backend": "torch"})
    assert torch_ops.decode_backend == "torch" and "asked for" in torch_ops.reasons["decode_backend"]
    for other in ("triton-layers", "triton-attention", "cuda-c"):
        if other == backend or (backend == "triton-layers" and other == "triton-attention"):
            continue   # where the layers run, the attention kernel alone runs too
        with pytest.raises(PlanError, match=f"plan.decode_backend={other} is not possible: .*; use {backend}"):
            plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, forced | {"decode_backend": other})
    if backend == "triton-layers":
        alone = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, forced | {"decode_backend": "triton-attention"})
        assert alone.decode_backend == "triton-attention"


def test_triton_layers_need_a_silu_mlp_and_16_bits():
    dev = fake_probe("H100").primary
    gelu = dataclasses.replace(CATALOGUE["qwen2.5-0.5b"], hidden_act="gelu_pytorch_tanh")
    p = plan(dev, gelu, SMALL)
    assert p.decode_backend == "triton-attention" and "activation is gelu_pytorch_tanh" in p.reasons["decode_backend"]
    with pytest.raises(PlanError, match=r"activation is gelu_pytorch_tanh, .*; use triton-attention"):
        plan(dev, gelu, SMALL, {"decode_backend": "triton-layers"})
    with pytest.raises(PlanError, match="fp32 compute"):
        plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, {"dtype": "fp32", "decode_backend": "triton-layers"})


def test_the_activation_is_read_from_the_config():
    from edgerl.plan.modelspec import from_hf_config
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 128}
    assert from_hf_config(cfg, "x", "test").hidden_act == "silu"   # HF's LlamaConfig default
    assert from_hf_config({**cfg, "hidden_act": "gelu"}, "x", "test").hidden_act == "gelu"


def test_the_triton_decode_kernels_need_a_power_of_two_head_size():
    dev = fake_probe("H100").primary
    odd = dataclasses.replace(CATALOGUE["qwen2.5-0.5b"], head_dim=96)
    p = plan(dev, odd, SMALL)
    assert p.decode_backend == "torch" and "head size 96 is not a power of two" in p.reasons["decode_backend"]


def test_the_decode_attention_kernel_must_fit_the_shared_memory():
    """16-bit blocks at head size 256 need 60 KB of shared memory even in one stage: on a GPU whose blocks
    may have 48 KB the kernel is refused at planning time, not at the first decode step; an sm_86 block's
    99 KB holds them."""
    wide = dataclasses.replace(CATALOGUE["qwen2.5-0.5b"], head_dim=256)
    small = dataclasses.replace(fake_probe("3090").primary, smem_per_block_optin=48 * 1024)
    p = plan(small, wide, SMALL)
    assert p.decode_backend == "torch" and "needs more shared memory per block than this GPU's 48 KB" in \
        p.reasons["decode_backend"]
    with pytest.raises(PlanError, match="needs more shared memory per block than this GPU's 48 KB"):
        plan(small, wide, SMALL, {"decode_backend": "triton-attention"})
    assert plan(fake_probe("3090").primary, wide, SMALL).decode_backend == "triton-layers"


def test_sdpa_training_attention_switches_cudnn_off_on_cuda_only():
    import torch
    from edgerl.train.session import apply_switches
    p = plan(fake_probe("H100").primary, CATALOGUE["qwen2.5-0.5b"], SMALL)
    assert p.attention == "sdpa" and "cuDNN's SDPA backend is switched off" in p.reasons["attention"]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        apply_switches(p, torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        apply_switches(p, torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# device, base dtype -> decode backend, whether its reason names the fused NF4 kernel
NF4_BASE = [
    ("P40", "nf4", "cuda-c", True),      # fp32: the CUDA C layers and the fused NF4 kernel
    ("T4", "nf4", "cuda-c", True),       # fp16: the same kernels, storing fp16
    ("3090", "nf4", "triton-attention", False),   # the Triton layers read fused plain weights
    ("T4", "int8", "cuda-c", False),     # bitsandbytes' int8 modules between the layer kernels
    ("P40", None, "cuda-c", False),      # an fp16 base under fp32 compute: no NF4 kernel
]


@pytest.mark.parametrize("key,base,backend,nf4", NF4_BASE)
def test_the_fused_nf4_kernel_is_the_cuda_c_backend_over_an_nf4_base(key, base, backend, nf4):
    dev = fake_probe(key, bitsandbytes="0.50.2").primary
    task = dataclasses.replace(SMALL, lora=True)
    p = plan(dev, CATALOGUE["qwen2.5-0.5b"], task, {"base_dtype": base} if base else None)
    assert p.rollout_engine == "static" and p.decode_backend == backend
    assert ("fused NF4 kernel" in p.reasons["decode_backend"]) == nf4
    if base in ("nf4", "int8"):
        assert "quantized base" in p.reasons["rollout_engine"]
    # fp32 (the P40): the few-row matmul takes the logits, and the projections only where the base is not quantized
    few_row = {"P40": "the logits'" if base else "the projections' and the logits' (under LoRA each layer's base matmul and adapter in one call)"}
    assert ("few-row matmul" in p.reasons["decode_backend"]) == (key in few_row)
    if key in few_row:
        assert few_row[key] in p.reasons["decode_backend"]
        assert ("projections'" in p.reasons["decode_backend"]) == (base is None)


@pytest.mark.parametrize("key,base,stacked", [("P40", "nf4", True), ("T4", "nf4", True), ("P40", "fp32", True),
                                              ("P40", "fp16", False), ("3090", "nf4", False), ("T4", "int8", False)])
def test_the_plan_counts_the_stacked_lora_adapters_where_cuda_c_stacks_them(key, base, stacked):
    """LoRA q/k/v and gate/up stacked for the decode step (edgerl/rollout/lora_group.py) hold those layers' adapters
    again in fp32, and over an NF4 base an fp32 offset per 16384 weights, in every phase."""
    from edgerl.plan.steps import stacked_adapter_bytes
    dev = fake_probe(key, bitsandbytes="0.50.2").primary
    m = CATALOGUE["qwen2.5-0.5b"]
    p = plan(dev, m, dataclasses.replace(SMALL, lora=True), {"base_dtype": base})
    got = {ph: comps.get("stacked adapters", 0) for ph, comps in p.memory.phases.items()}
    if not stacked:
        assert set(got.values()) == {0}
        return
    sh, rank = m.module_shapes(), p.lora["rank"]
    grouped = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    want = m.num_layers * rank * sum(sh[t][0] + sh[t][1] for t in grouped) * 4
    if base == "nf4":
        want += m.num_layers * sum(sh[t][0] * sh[t][1] for t in grouped) // 16384 * 4
    targets = p.lora["targets"]
    assert stacked_adapter_bytes(m, tuple(targets), rank, base) == want
    assert set(got.values()) == {want}, got
    # a group needs all its layers adapted: without v_proj, q/k/v is not stacked
    no_v = tuple(t for t in targets if t != "v_proj")
    gate_up = m.num_layers * rank * sum(sh[t][0] + sh[t][1] for t in ("gate_proj", "up_proj")) * 4
    if base == "nf4":
        gate_up += m.num_layers * sum(sh[t][0] * sh[t][1] for t in ("gate_proj", "up_proj")) // 16384 * 4
    assert stacked_adapter_bytes(m, no_v, rank, base) == gate_up


def test_blackwell_keeps_sdpa_unless_flash_attention_is_asked_for():
    from edgerl.device.device import device_from_spec
    from fakes import software
    dev = device_from_spec("cc=12.0,memory=31GiB,name=\"NVIDIA GeForce RTX 5090\"",
                           software(flash_attn="2.7.4"), 64 * GiB)
    p = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL)
    assert p.attention == "sdpa" and "Blackwell" in p.reasons["attention"]
    forced = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, {"attention": "flash_attention_2"})
    assert forced.attention == "flash_attention_2" and "no kernel image" in forced.reasons["attention"]


@pytest.mark.parametrize("key,gain,dtype", [("P100", 2.0, "fp16-mixed"), ("P40", 0.9, "fp32"), ("P40", None, "fp32")])
def test_measured_fp16_speed_decides_below_cc7(key, gain, dtype):
    from edgerl.device.measured import Item, Measurements
    dev = fake_probe(key).primary
    if gain is not None:
        item = lambda v: Item(value=v, status="ok", note="")  # noqa: E731
        m = Measurements(kind="cuda", name=dev.name, uuid="gpu-x", cc=dev.cc, torch="2.7.1", cuda="12.6",
                         date="2026-12-01T00:00:00Z", fp32_matmul=item(10.0), fp16_matmul=item(10.0 * gain))
        dev = dataclasses.replace(dev, measured=m)
    p = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL)
    assert p.dtype.name == dtype
    assert ("measured by edgerl doctor --bench" in p.reasons["dtype"]) == (gain is not None)
    assert gain is not None or "from the table" in p.reasons["dtype"]


def test_plan_is_pure_and_deterministic():
    dev = fake_probe("T4").primary
    a = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL)
    b = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL)
    assert a == b and a.to_dict() == b.to_dict()


def test_never_bf16_by_emulation():
    for key in ("V100", "T4", "GTX1660"):
        dev = fake_probe(key).primary
        assert plan(dev, CATALOGUE["smollm2-135m"], SMALL).dtype.compute == "fp16"
        with pytest.raises(PlanError, match="only emulated"):
            plan(dev, CATALOGUE["smollm2-135m"], SMALL, {"dtype": "bf16"})


def test_impossible_overrides_are_clear_errors():
    p40 = fake_probe("P40").primary
    with pytest.raises(PlanError, match="flash_attention_2 is not possible.*CC >= 8.0"):
        plan(p40, CATALOGUE["smollm2-135m"], SMALL, {"attention": "flash_attention_2"})
    with pytest.raises(PlanError, match="triton is not possible.*CC >= 7.0"):
        plan(p40, CATALOGUE["smollm2-135m"], SMALL, {"kernel_backend": "triton"})
    with pytest.raises(PlanError, match="vllm is not possible"):
        plan(p40, CATALOGUE["smollm2-135m"], SMALL, {"rollout_engine": "vllm"})
    with pytest.raises(PlanError, match="adamw8bit is not possible.*bitsandbytes is not installed"):
        plan(p40, CATALOGUE["smollm2-135m"], SMALL, {"optimizer": "adamw8bit"})


def test_vllm_not_for_volta_on_cuda_12_8_builds():
    v100 = fake_probe("V100", vllm="0.10.1").primary
    v100 = dataclasses.replace(v100, software=dataclasses.replace(v100.software, torch_cuda="12.8"))
    p = plan(v100, CATALOGUE["smollm2-135m"], SMALL)
    assert p.rollout_engine == "static" and "start at sm_75" in p.reasons["rollout_engine"]


def test_search_goes_from_fast_to_frugal():
    m = CATALOGUE["qwen2.5-0.5b"]
    roomy = plan(fake_probe("A100").primary, m, SMALL)
    assert not roomy.grad_checkpointing and not roomy.param_offload and roomy.micro_batch == 16
    tight = plan(device_from_profile(get_profile("t4"), Software(), 64 * GiB), m,
                 dataclasses.replace(SMALL, response_len=1024, prompts_per_step=8))
    assert tight.grad_checkpointing, tight.reasons["grad_checkpointing"]
    assert tight.memory.fits
    # the faster setting before it (no checkpointing, micro-batch 4) does not fit
    with pytest.raises(PlanError):
        plan(tight.device, m, tight.task, {"grad_checkpointing": False, "micro_batch": 4})


def test_ppo_counts_the_critic_and_kl0_drops_the_reference():
    dev = fake_probe("A100").primary
    m = CATALOGUE["qwen2.5-0.5b"]
    grpo = plan(dev, m, SMALL, {"micro_batch": 4})
    ppo = plan(dev, m, dataclasses.replace(SMALL, algo="gae", critic=True), {"micro_batch": 4})
    nokl = plan(dev, m, dataclasses.replace(SMALL, kl=False), {"micro_batch": 4})
    P = m.n_params()
    # the critic adds fp32 weights, gradients and Adam moments (4 + 4 + 8 bytes per parameter)
    assert ppo.memory.phases["update"]["other models"] - grpo.memory.phases["update"]["other models"] == P * 16
    assert "other models" not in nokl.memory.phases["update"]


def test_memory_formulas_by_hand():
    m = CATALOGUE["smollm2-135m"]
    P = m.n_params()
    s = Setting(compute_bytes=2, base_bytes=4, grad_checkpointing=False, swap_models=False,
                optimizer_offload=False, param_offload=False, micro_batch=2, score_micro_batch=4,
                rollout_batch=8, logprob_chunk=256, logit_bytes=8, eager_attention=False, reference=True)
    e = estimate(m, s, prompt_len=100, response_len=28, budget=100 * GiB)
    L = 128
    u = e.phases["update"]
    assert u["master weights"] == P * 4 and u["gradients"] == P * 4 and u["optimizer state"] == P * 8
    assert u["other models"] == P * 2
    per_layer_token = 2 * (5 * 576 + 3 * 576 + 3 * 192 + 3 * 1536)   # the MLP keeps gate, up, product
    assert u["activations"] == 2 * L * 30 * per_layer_token
    # the chunk's logits (8 bytes each on the torch path) and the 2 x 28 response tokens' hidden states with
    # their fp32 gradient
    assert u["log-prob pass"] == 256 * 49152 * 8 + 2 * 28 * 576 * (2 + 4)
    assert u["backward workspace"] == 2 * L * 3 * 1536 * 2          # one layer's MLP gradients
    # 128 columns (a multiple of 16) and 12 bytes a column of per-row token and log-prob buffers
    assert e.phases["rollout"]["KV cache"] == 8 * L * 2 * 30 * 192 * 2 + 8 * L * 12
    assert u["CUDA context"] == 880 * MiB   # measured on an H200 (memory.Calibration)
    ck = estimate(m, dataclasses.replace(s, grad_checkpointing=True), 100, 28, 100 * GiB)
    assert ck.phases["update"]["activations"] == 2 * L * (30 * 576 * 2 + per_layer_token)
    eager = estimate(m, dataclasses.replace(s, eager_attention=True), 100, 28, 100 * GiB)
    assert eager.phases["update"]["activations"] - u["activations"] == 2 * L * 30 * 2 * 2 * 9 * L
    # shared prompts: a micro-batch of 2 samples of one prompt computes 100 + 2 x 28 tokens; scoring 4 rows
    # of prompts shared by 2 computes 2 prompts
    shared = estimate(m, dataclasses.replace(s, prompt_share=2, update_share=2), 100, 28, 100 * GiB)
    assert shared.phases["update"]["activations"] == (100 + 2 * 28) * 30 * per_layer_token
    no_grad = 2 * (5 * 576 + 4 * 1536)   # one layer's most at once: its MLP
    assert e.phases["score"]["activations"] == 4 * L * no_grad
    assert shared.phases["score"]["activations"] == (2 * 100 + 4 * 28) * no_grad
    assert [packed_tokens(r, 8, 64, 256) for r in (1, 2, 3, 8, 12, 16)] == [
        320, 64 + 512, 2 * 64 + 768, 64 + 2048, 3 * 64 + 12 * 256, 2 * 64 + 4096]   # 12: up to 3 prompts
    # the rollout's prefill: every row's prompt (hidden 576, MLP 1536, 2 bytes), or each distinct prompt
    # once where the static engine shares it (8 rows of 4 samples each: 2 prompts)
    per_prefill_token = (4 * 576 + 3 * 1536) * 2
    assert e.phases["rollout"]["prefill activations"] == 8 * 100 * per_prefill_token
    once = estimate(m, dataclasses.replace(s, prefill_share=4), 100, 28, 100 * GiB)
    assert once.phases["rollout"]["prefill activations"] == 2 * 100 * per_prefill_token


def test_the_plan_counts_a_shared_prefill_only_where_the_static_engine_runs():
    dev = fake_probe("3090").primary
    hf = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL)
    generate = plan(dev, CATALOGUE["qwen2.5-0.5b"], SMALL, {"rollout_engine": "hf-generate"})
    assert hf.rollout_engine == "static" and generate.rollout_engine == "hf-generate"
    rows = hf.rollout_batch
    assert generate.rollout_batch == rows and rows % SMALL.samples_per_prompt == 0
    a = hf.memory.phases["rollout"]["prefill activations"]
    b = generate.memory.phases["rollout"]["prefill activations"]
    assert b == a * SMALL.samples_per_prompt


def test_no_fit_says_what_would_fit():
    dev = device_from_profile(get_profile("p40"), Software(), 64 * GiB)
    task = Task(prompt_len=256, response_len=512, prompts_per_step=8, samples_per_prompt=8)
    with pytest.raises(PlanError) as e:
        plan(dev, CATALOGUE["llama-3.2-3b"], task)
    msg = str(e.value)
    assert "does not fit on Tesla P40" in msg and "What would fit" in msg
    assert "--set lora.enabled=true" in msg
    assert "a bigger GPU" in msg


def test_lora_auto_turns_on_only_when_full_does_not_fit():
    dev = device_from_profile(get_profile("p40"), Software(), 64 * GiB)
    task = Task(prompt_len=256, response_len=512, prompts_per_step=8, samples_per_prompt=8, lora=None)
    small = plan(dev, CATALOGUE["qwen2.5-0.5b"], task)
    assert small.lora is None and small.reasons["lora"] == "full fine-tuning fits"
    big = plan(dev, CATALOGUE["llama-3.2-3b"], task)
    assert big.lora and big.lora["rank"] == 16 and "does not fit" in big.reasons["lora"]
    assert big.lora["params"] == CATALOGUE["llama-3.2-3b"].lora_params(16, big.lora["targets"])


def test_model_shapes_match_published_parameter_counts():
    # published sizes (millions); tied embeddings counted once
    expected = {"qwen2.5-0.5b": 494, "qwen2.5-1.5b": 1544, "qwen2.5-3b": 3086, "qwen2.5-7b": 7616,
                "llama-3.2-1b": 1236, "llama-3.2-3b": 3213, "llama-3.1-8b": 8030,
                "smollm2-135m": 135, "smollm2-360m": 362, "smollm2-1.7b": 1711}
    for name, millions in expected.items():
        assert abs(CATALOGUE[name].n_params() / 1e6 - millions) / millions < 0.01, name


def test_model_from_hf_folder(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "tie_word_embeddings": False}))
    m = resolve(str(tmp_path))
    assert m.qkv_bias and m.num_kv_heads == 2 and not m.tie_embeddings
    assert m.n_params() == 2 * 1000 * 64 + 2 * m.layer_params() + 64


@pytest.mark.parametrize("forced", [None, "adamw-bf16", "adamw-bf16-sr"])
def test_optimizer_reason_names_the_optimizer_the_plan_counts(forced):
    """A plan on bf16 weights (chosen at a tight budget, or asked for) says so in its optimizer reason,
    with the state bytes the memory model counts, not fp32 AdamW's."""
    dev = fake_probe("H100").primary
    m = CATALOGUE["smollm2-1.7b"]
    task = dataclasses.replace(SMALL, prompt_len=64)
    o = {"optimizer": forced} if forced else {"memory_gib": 18.46}
    p = plan(dev, m, task, o)
    assert p.optimizer == (forced or "adamw-bf16-sr")
    state = {"adamw-bf16": "6 bytes", "adamw-bf16-sr": "4 bytes"}[p.optimizer]
    why = p.reasons["optimizer"]
    assert "bf16 moments" in why and state in why and "fp32 moments" not in why, why
    assert ("asked for" in why) == bool(forced)


@pytest.mark.parametrize("triton,forced", [("3.3.1", None), (None, None), ("3.3.1", "torch")])
def test_optimizer_reason_says_how_the_bf16_step_runs(triton, forced):
    """The bf16 step is one fused kernel where the plan's kernels are Triton's, eager torch otherwise
    (triton missing, or plan.kernel_backend=torch); under parameter offload it streams host-held shards
    through the GPU."""
    dev = fake_probe("H100", triton=triton).primary
    m = CATALOGUE["smollm2-1.7b"]
    task = dataclasses.replace(SMALL, prompt_len=64)
    o = {"optimizer": "adamw-bf16-sr", **({"kernel_backend": forced} if forced else {})}
    p = plan(dev, m, task, o)
    off = plan(dev, m, task, {**o, "param_offload": True})
    assert off.param_offload and not p.param_offload
    fused = triton is not None and forced is None
    for q in (p, off):
        why = q.reasons["optimizer"]
        assert (q.kernel_backend == "triton") == fused
        assert ("one fused Triton kernel per parameter" in why) == fused, why
        assert ("eager torch" in why) == (not fused), why
        assert ("streams them through the GPU" in why) == q.param_offload, why


def test_rollout_share_is_of_the_devices_memory_under_a_budget():
    """vLLM's gpu_memory_utilization is a share of the whole GPU: a plan.memory_gib budget changes the
    bytes the rollout may take (the plan's estimate), not what the share is a share of."""
    dev = fake_probe("A100").primary
    m = CATALOGUE["qwen2.5-0.5b"]
    whole = plan(dev, m, SMALL)
    budget = plan(dev, m, SMALL, {"memory_gib": 10})
    for p in (whole, budget):
        rollout = p.memory.phase_totals()["rollout"]
        assert p.rollout_memory_share == pytest.approx(rollout / dev.total_memory, abs=1e-4)
    assert budget.rollout_memory_share * dev.total_memory <= 10 * GiB


def test_vllm_share_converts_an_emulated_profiles_share_to_this_gpu(monkeypatch):
    import types
    import torch
    from edgerl.rollout import vllm_share
    p40 = plan(device_from_profile(get_profile("p40"), Software(), 64 * GiB), CATALOGUE["qwen2.5-0.5b"], SMALL)
    real = 4 * p40.device.total_memory
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=real))
    got = vllm_share(p40, torch.device("cuda", 0))
    assert got * real == pytest.approx(p40.rollout_memory_share * p40.device.total_memory)   # the same bytes
    assert vllm_share(p40, torch.device("cpu")) == p40.rollout_memory_share


@pytest.mark.parametrize("change,why", [
    (dict(head_dim=96), "head size 96 is not one of 32, 64, 128, 256"),
    (dict(num_heads=32, num_kv_heads=2, head_dim=64), "16 query heads per KV head (at most 8)"),
])
def test_fp32_decode_layer_kernels_take_the_usual_heads_and_say_why_not(change, why):
    dev = fake_probe("P40").primary
    odd = dataclasses.replace(CATALOGUE["qwen2.5-0.5b"], **change)
    p = plan(dev, odd, SMALL)
    assert p.decode_backend == "torch" and why in p.reasons["decode_backend"]
    with pytest.raises(PlanError, match=re.escape(f"plan.decode_backend=cuda-c is not possible: {why}; use torch")):
        plan(dev, odd, SMALL, {"decode_backend": "cuda-c"})


def test_retired_and_renamed_keys_name_their_replacement():
    from edgerl.config.load import load_config
    from edgerl.core.errors import ConfigError
    for old in ("decode_attention=cuda", "rollout_compile=true", "cuda_graphs=false", "nf4_kernel=true"):
        with pytest.raises(ConfigError, match=f"--set plan.{old}: plan.{old.split('=')[0]} no longer exists; "
                                              ".*plan.decode_backend"):
            load_config(sets=[f"plan.{old}"])
    with pytest.raises(ConfigError, match="--set plan.rollout_engine=hf: 'hf' is now called 'static'.*"
                                          "set plan.rollout_engine=static"):
        load_config(sets=["plan.rollout_engine=hf"])
    assert load_config(sets=["plan.rollout_engine=static"]).plan.rollout_engine == "static"
    with pytest.raises(PlanError, match="plan.rollout_compile no longer exists"):
        plan(fake_probe("P40").primary, CATALOGUE["qwen2.5-0.5b"], SMALL, {"rollout_compile": True})

