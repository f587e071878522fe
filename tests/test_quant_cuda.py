"""A quantized frozen base (edgerl/quant.py) on a CUDA GPU: NF4 projections replayed from CUDA graphs
(the rollout engine's decode step), fp32 compute against the dequantized weight (the Pascal path),
the peaks while loading, the transient bytes of one layer, FSDP2 with CPU offload around resident
quantized weights, and LLM.int8. Skipped without CUDA or bitsandbytes."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                       reason="a quantized base needs bitsandbytes (pip install bitsandbytes)"),
]

CUDA = torch.device("cuda", 0)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def skip_without_bf16(dtype) -> None:
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 compute needs CC >= 8.0")


def capture(fn, static_x: torch.Tensor):
    """Warm `fn` up on a side stream, then capture one call in a CUDA graph; returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = fn(static_x)
    return graph, static_y


@pytest.mark.parametrize("compute", DTYPES)
def test_nf4_decode_step_replays_from_a_cuda_graph(compute):
    """Batch 16, one token each (the decode step's projection input): a Linear4bit alone and wrapped by
    peft's LoRA layer replay with fresh inputs and give the eager results and dequantized W x (+ B A x)."""
    skip_without_bf16(compute)
    from peft import LoraConfig, get_peft_model
    from edgerl.models.quant import dequantized_weight, quantize_linear
    torch.manual_seed(0)
    layer = quantize_linear(torch.nn.Linear(2048, 5632, bias=True), "nf4", compute, CUDA)
    model = torch.nn.Sequential()
    model.add_module("proj", quantize_linear(torch.nn.Linear(2048, 1536), "nf4", compute, CUDA))
    model.is_loaded_in_4bit = True
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["proj"]))
    torch.nn.init.normal_(model.proj.lora_B["default"].weight, std=0.02)
    A, B, s = (model.proj.lora_A["default"].weight, model.proj.lora_B["default"].weight,
               model.proj.scaling["default"])
    for fn, ref in ((layer, lambda x: F.linear(x, dequantized_weight(layer, compute), layer.bias)),
                    (model, lambda x: F.linear(x, dequantized_weight(model.proj.base_layer, compute),
                                               model.proj.base_layer.bias)
                     + (s * (x.float() @ A.T) @ B.T).to(compute))):
        static_x = torch.zeros(16, 1, 2048, device=CUDA, dtype=compute)
        graph, static_y = capture(fn, static_x)
        for seed in range(3):
            x = torch.randn(16, 1, 2048, device=CUDA, dtype=compute, generator=torch.Generator(CUDA).manual_seed(seed))
            static_x.copy_(x)
            graph.replay()
            with torch.no_grad():
                eager = fn(x)
            torch.testing.assert_close(static_y, eager, **TOL[compute])  # cuBLAS may pick another algorithm
            torch.testing.assert_close(static_y.float(), ref(x).float(), **TOL[compute])


@pytest.mark.parametrize("tokens", [1, 3, 16, 2048])
@pytest.mark.parametrize("shape", [(200, 131), (160, 96), (4096, 1024)])
def test_fp32_compute_is_the_dequantized_weight_times_x(tokens, shape):
    """The Pascal recipe on the GPU: fused kernels for few tokens, dequantize + F.linear for many; both
    equal the NF4 weight decoded the slow way (including row widths the CPU kernel gets wrong)."""
    from test_quant_on_cpu import nf4_reference
    from edgerl.models.quant import quantize_linear
    torch.manual_seed(1)
    inp, out = shape
    layer = quantize_linear(torch.nn.Linear(inp, out, bias=True), "nf4", torch.float32, CUDA)
    w = nf4_reference(layer).to(CUDA)
    x = torch.randn(tokens, inp, device=CUDA)
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, w, layer.bias), rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_()
    g = torch.randn(tokens, out, device=CUDA)
    layer(xg).backward(g)
    torch.testing.assert_close(xg.grad, g @ w, rtol=1e-5, atol=1e-5)


def test_loading_peaks_on_cuda(tmp_path):
    """Device: the quantized model plus about one full-precision tensor; host: no full-precision model."""
    from test_quant_on_cpu import make_model, measure_in_subprocess
    big = make_model(tmp_path / "big", layers=8, hidden=1024, inter=2816, vocab=512, tied=False)
    warm = make_model(tmp_path / "warm", layers=1, hidden=64, inter=128, vocab=512, tied=False)
    fp32 = (big / "model.safetensors").stat().st_size
    largest = 1024 * 2816 * 4
    for quant in ("nf4", "int8"):
        r = measure_in_subprocess(big, quant, "cuda", warm)
        assert r["device_final"] <= 1.02 * r["model_bytes"] + 2**20, r
        assert r["device_peak"] <= r["device_final"] + 2 * largest + 8 * 2**20, r
        assert r["host_peak"] < 0.25 * fp32, r


@pytest.mark.parametrize("quant,compute", [("nf4", torch.float32), ("nf4", torch.float16), ("int8", torch.float16)])
def test_transient_bytes_bound_one_layer(quant, compute):
    """What one forward and one backward of a 4096 x 11008 layer allocate beyond input, output and
    gradient, against `transient_bytes` (2048 tokens: bitsandbytes' dequantize + F.linear path)."""
    if quant == "int8" and torch.cuda.get_device_capability() < (7, 5):
        pytest.skip("LLM.int8 needs CC >= 7.5")
    from edgerl.models.quant import quantize_linear, transient_bytes
    inp, out, tokens = 4096, 11008, 2048
    layer = quantize_linear(torch.nn.Linear(inp, out, bias=False), quant, compute, CUDA)
    x = torch.randn(tokens, inp, device=CUDA, dtype=compute, requires_grad=True)
    g = torch.randn(tokens, out, device=CUDA, dtype=compute)
    bound = transient_bytes(inp, out, quant, torch.finfo(compute).bits // 8)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = layer(x)
    forward = torch.cuda.max_memory_allocated() - base - y.nbytes
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(g)
    backward = torch.cuda.max_memory_allocated() - base - x.grad.nbytes
    print(f"{quant} {compute}: forward {forward / 2**20:.1f} MiB, backward {backward / 2**20:.1f} MiB, "
          f"transient_bytes {bound / 2**20:.1f} MiB")
    activations = tokens * (inp + out) * 4  # LLM.int8's int8 activations and int32 product, at most
    assert max(forward, backward) <= bound + (activations if quant == "int8" else 2**20)
    assert backward >= 0.9 * inp * out * torch.finfo(compute).bits // 8  # the dequantized weight is real


def test_fsdp2_offloads_around_resident_quantized_weights(tmp_path):
    """CPUOffloadPolicy moves what FSDP2 manages (adapter, norms, embeddings) to pinned host memory;
    the ignored quantized weights stay on the GPU and the step works."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from test_quant_on_cpu import PROJECTIONS, make_model, train_steps
    from edgerl.models.lora import apply_lora
    from edgerl.models.load import init_distributed
    from edgerl.models.quant import load_quantized_lm, quantized_params
    folder = make_model(tmp_path / "m", arch="qwen2", dtype=torch.float16, tied=False)
    init_distributed(CUDA)
    batch = torch.randint(0, 300, (2, 9), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    losses = []
    for offload in (False, True):
        lm = load_quantized_lm(folder, "nf4", torch.float32, CUDA, storage_dtype=torch.float16)
        torch.manual_seed(3)
        apply_lora(lm, 4, 8.0, 0.0, PROJECTIONS)
        kwargs = {"mesh": init_device_mesh("cuda", (1,)), "ignored_params": quantized_params(lm),
                  "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in lm.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(lm, **kwargs)
        lm.train()
        losses.append(train_steps(lm, 3, batch))
        assert all(p.device.type == "cuda" for p in quantized_params(lm))
        if offload:
            lora = [p for n, p in lm.named_parameters() if ".lora_" in n]
            assert lora and all(p.to_local().device.type == "cpu" for p in lora)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_llm_int8_on_cuda_matches_its_definition():
    """LLM.int8 on the GPU (CC >= 7.5): the same in eval and train, and equal to the slow reference."""
    if torch.cuda.get_device_capability() < (7, 5):
        pytest.skip("LLM.int8's int8 matmul needs CC >= 7.5")
    from test_quant_on_cpu import llm_int8_reference
    from edgerl.models.quant import quantize_linear
    torch.manual_seed(2)
    layer = quantize_linear(torch.nn.Linear(1024, 768, bias=True), "int8", torch.float16, CUDA)
    x = torch.randn(4, 7, 1024, device=CUDA, dtype=torch.float16)
    x[..., 5] = 9.0  # an outlier column
    with torch.no_grad():
        evaluated = layer.eval()(x)
        trained = layer.train()(x)
    torch.testing.assert_close(evaluated, trained, rtol=0, atol=0)
    ref = llm_int8_reference(x.float().cpu(), _cpu_view(layer))
    torch.testing.assert_close(evaluated.double().cpu(), ref, rtol=2e-3, atol=2e-3)


def _cpu_view(layer):
    """The int8 layer's CB/SCB/bias on the CPU, shaped as `llm_int8_reference` reads them."""
    import types
    cb = layer.weight.CB if layer.weight.CB is not None else layer.state.CB
    scb = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    return types.SimpleNamespace(weight=types.SimpleNamespace(CB=cb.cpu(), SCB=scb.cpu()),
                                 state=None, bias=None if layer.bias is None else layer.bias.float().cpu())
