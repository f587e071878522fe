"""LoRA groups (edgerl/rollout/lora_group.py) through the CUDA kernels: q/k/v and gate/up as one call of the few-row
fp32 kernel or of the NF4 kernel (fp32 and fp16), against each layer's own call of the same kernel, inside a CUDA
graph whose replays see the adapters copied after a change (the CPU tests check the same with the references)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the few-row kernels run on CUDA only", allow_module_level=True)

from edgerl.kernels import fp32_mm  # noqa: E402
from edgerl.models import quant_decode  # noqa: E402
from edgerl.rollout.decode_cuda_c import route_linear, route_lora  # noqa: E402
from edgerl.rollout.projections import ModuleProjections  # noqa: E402
from test_lora_group_on_cpu import HIDDEN, lora_model, randomize_adapters, stack  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def layer_on_cuda(kind: str, dtype: torch.dtype):
    from peft import get_peft_model
    model, cfg = lora_model(bias=True)
    layer = model.model.layers[0]
    if kind == "nf4":
        pytest.importorskip("bitsandbytes")
        from edgerl.models.quant import quantize_linear
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                setattr(owner, n, quantize_linear(getattr(owner, n), "nf4", dtype, "cuda"))
    model = model.cuda()
    peft_model = get_peft_model(model, cfg).eval()
    randomize_adapters(peft_model, 3)
    for m in peft_model.modules():   # the adapters stay fp32, as edgerl's LoRA keeps them
        if hasattr(m, "lora_A"):
            m.lora_A.float()
            m.lora_B.float()
    if kind == "nf4":
        quant_decode.enable(peft_model, 16)
    else:
        for m in layer.modules():
            if hasattr(m, "lora_A"):
                route_linear(m.base_layer, fp32_mm.linear)
                route_lora(m, fp32_mm.linear)
    return peft_model, layer


@pytest.mark.parametrize("kind,dtype", [("fp32", torch.float32), ("nf4", torch.float32), ("nf4", torch.float16)])
def test_a_group_equals_its_layers_calls_in_a_cuda_graph(kind, dtype):
    model, layer = layer_on_cuda(kind, dtype)
    apart, grouped = ModuleProjections(layer), ModuleProjections(layer)
    stack(grouped)
    assert sorted(grouped.groups) == ["gate_up", "qkv"]
    x = torch.randn(16, HIDDEN, device="cuda").to(dtype)

    def both():
        return (torch.cat(grouped.qkv_parts(x) + grouped.gate_up(x), -1),
                torch.cat(apart.qkv_parts(x) + apart.gate_up(x), -1))

    with torch.no_grad():
        both()   # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got, want = both()
        for seed in (4, 5):   # the adapters train between rollouts; the group copies them before the next
            randomize_adapters(model, seed)
            grouped.sync()
            x.copy_(torch.randn(16, HIDDEN, device="cuda").to(dtype))
            g.replay()
            torch.cuda.synchronize()
            scale = want.float().abs().max().item()
            assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale * (HIDDEN ** 0.5), seed
