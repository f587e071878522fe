"""LoRA groups (edgerl/rollout/lora_group.py): a layer's q/k/v and gate/up LoRA layers as one product, checked on the
CPU with the kernels' slow references standing in for the CUDA kernels (tests/test_lora_group_cuda.py runs the
kernels): the stacked outputs against each layer's own base and adapter, the adapters copied again after they
change, the stacked bases as views of one tensor, and the calls the group leaves to the modules."""

import pytest
import torch
from torch import nn

from edgerl.kernels import fp32_mm, nf4
from edgerl.models import quant_decode
from edgerl.rollout.lora_group import LoraGroup, groupable
from edgerl.rollout.decode_cuda_c import route_linear, route_lora
from edgerl.rollout.projections import ModuleProjections

HIDDEN, HEADS, KV, INTER, RANK = 256, 4, 2, 512, 8


def lora_model(bias: bool, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV,
                      intermediate_size=INTER, num_hidden_layers=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    if not bias:
        for n in ("q_proj", "k_proj", "v_proj"):
            getattr(model.model.layers[0].self_attn, n).bias = None
    return model, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def randomize_adapters(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=g) * 0.1)


def fp32_layer(monkeypatch, bias=True):
    """A peft layer over fp32 bases routed to the few-row kernel, whose CUDA call is its float64 reference here."""
    from peft import get_peft_model
    model, cfg = lora_model(bias)
    peft_model = get_peft_model(model, cfg).eval()
    randomize_adapters(peft_model, 1)
    layer = peft_model.base_model.model.model.layers[0]
    for m in layer.modules():
        if hasattr(m, "lora_A"):
            route_linear(m.base_layer, fp32_mm.linear)
            route_lora(m, fp32_mm.linear)
    monkeypatch.setattr(fp32_mm, "takes", lambda x, w, b=None: not torch.is_grad_enabled() and
                        fp32_mm.MIN_ROWS <= x.numel() // x.shape[-1] <= fp32_mm.MAX_ROWS)
    monkeypatch.setattr(fp32_mm, "fp32_matmul",
                        lambda x, w, b=None, ks=None, lora=None: fp32_mm.reference(x, w, b, lora).float())
    return peft_model, layer


def nf4_layer(monkeypatch):
    """A peft layer over NF4 bases (bitsandbytes' CPU quantizer) as `quant_decode.enable` leaves them, the kernel's
    CUDA call its reference here."""
    pytest.importorskip("bitsandbytes")
    from peft import get_peft_model
    from edgerl.models.quant import quantize_linear
    model, cfg = lora_model(bias=True)
    layer = model.model.layers[0]
    for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                         (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
        for n in names:
            setattr(owner, n, quantize_linear(getattr(owner, n), "nf4", torch.float32, "cpu"))
    peft_model = get_peft_model(model, cfg).eval()
    randomize_adapters(peft_model, 2)
    for m in layer.modules():
        if type(m).__name__ == "Linear4bit":
            m.__class__ = quant_decode._decode_class(type(m))
            m.decode_rows = 16
    monkeypatch.setattr(type(layer.self_attn.q_proj.base_layer), "takes",
                        lambda self, x: not torch.is_grad_enabled() and x.numel() // x.shape[-1] <= self.decode_rows)
    monkeypatch.setattr(nf4, "nf4_matmul", lambda x, p, st, bias=None, lora=None: nf4.reference(x, p, st, bias, lora))
    return peft_model, layer


def stack(proj):
    """What decode backend cuda-c does (`decode_cuda_c.group_note`): a LoraGroup for each stackable group."""
    for key, layers in proj.stackable().items():
        assert groupable(layers) == "", key
        proj.groups[key] = LoraGroup(layers)


def expected(mods, x, weight_of):
    """Each layer's base product and adapter in float64, side by side."""
    out = []
    for m in mods:
        w, b = weight_of(m.base_layer), m.base_layer.bias
        a, bb, s = m.lora_A["default"].weight, m.lora_B["default"].weight, m.scaling["default"]
        y = x.double() @ w.double().T + (b.double() if b is not None else 0)
        out.append(y + s * (x.double() @ a.double().T) @ bb.double().T)
    return torch.cat(out, dim=-1)


def dense_weight(base):
    return base.weight


def nf4_weight(base):
    import bitsandbytes as bnb
    return bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).float()


@pytest.mark.parametrize("kind", ["fp32", "nf4"])
def test_a_group_computes_each_layers_product_and_adapter(monkeypatch, kind):
    model, layer = fp32_layer(monkeypatch) if kind == "fp32" else nf4_layer(monkeypatch)
    weight_of = dense_weight if kind == "fp32" else nf4_weight
    proj = ModuleProjections(layer)
    before = {id(m): weight_of(m.base_layer).clone() for m in proj._all}
    stack(proj)
    assert sorted(proj.groups) == ["gate_up", "qkv"]
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        q, k, v = proj.qkv_parts(x)
        gate, up = proj.gate_up(x)
    qkv = [proj.q_proj, proj.k_proj, proj.v_proj]
    assert [t.shape[-1] for t in (q, k, v)] == [HEADS * 64, KV * 64, KV * 64]
    tol = 1e-5 * (1 if kind == "fp32" else 10)
    assert torch.allclose(torch.cat([q, k, v], -1).double(), expected(qkv, x, weight_of), atol=tol, rtol=tol)
    assert torch.allclose(torch.cat([gate, up], -1).double(), expected([proj.gate_proj, proj.up_proj], x, weight_of),
                          atol=tol, rtol=tol)
    # the bases are views of the stacked tensors, with the values they had: bitsandbytes' own forward still works
    g = proj.groups["qkv"]
    assert proj.q_proj.base_layer.weight.data_ptr() == g.weight.data_ptr() and proj.intact()
    for m in proj._all:
        assert torch.equal(weight_of(m.base_layer), before[id(m)])


def test_the_adapters_are_copied_again_before_each_rollout(monkeypatch):
    model, layer = fp32_layer(monkeypatch)
    proj = ModuleProjections(layer)
    stack(proj)
    x = torch.randn(3, HIDDEN)
    randomize_adapters(model, 7)   # a training step changed them
    qkv = [proj.q_proj, proj.k_proj, proj.v_proj]
    with torch.no_grad():
        stale = torch.cat(proj.qkv_parts(x), -1).double()
        proj.sync()
        fresh = torch.cat(proj.qkv_parts(x), -1).double()
    want = expected(qkv, x, dense_weight)
    assert not torch.allclose(stale, want, atol=1e-4) and torch.allclose(fresh, want, atol=1e-5, rtol=1e-5)


def test_a_base_moved_off_its_stacked_storage_is_stacked_again(monkeypatch):
    model, layer = fp32_layer(monkeypatch)
    proj = ModuleProjections(layer)
    stack(proj)
    k = proj.k_proj.base_layer
    with torch.no_grad():
        k.weight.data = k.weight.data.clone() * 2   # `model.to(...)` or a load gives a parameter new storage
    assert not proj.intact()
    proj.refuse()
    assert proj.intact()
    x = torch.randn(2, HIDDEN)
    with torch.no_grad():
        got = torch.cat(proj.qkv_parts(x), -1).double()
    assert torch.allclose(got, expected([proj.q_proj, proj.k_proj, proj.v_proj], x, dense_weight), atol=1e-5)


def test_calls_the_kernels_do_not_take_go_to_the_modules(monkeypatch):
    model, layer = fp32_layer(monkeypatch)
    proj = ModuleProjections(layer)
    stack(proj)
    calls = []
    monkeypatch.setattr(LoraGroup, "__call__", lambda self, x, _o=LoraGroup.__call__: calls.append(1) or _o(self, x))
    x = torch.randn(40, HIDDEN)   # the prefill's rows
    with torch.no_grad():
        q, k, v = proj.qkv_parts(x)
    assert calls == [1] and proj.groups["qkv"](x) is None
    assert torch.allclose(q, proj.q_proj(x)) and torch.allclose(v, proj.v_proj(x))
    x = torch.randn(4, HIDDEN, requires_grad=True)   # training: peft's own path keeps the adapters' gradients
    assert proj.groups["qkv"](x) is None
    with torch.no_grad(), model.disable_adapter():   # the adapters off (a reference forward): peft's path
        assert proj.groups["gate_up"](torch.randn(4, HIDDEN)) is None


def test_groupable_says_why_not():
    model, cfg = lora_model(bias=False)
    from peft import get_peft_model
    layer = get_peft_model(model, cfg).base_model.model.model.layers[0]
    at = layer.self_attn
    assert "not all NF4 layers or fp32 layers routed" in groupable([at.q_proj, at.k_proj, at.v_proj])
    assert "not every layer is a peft LoRA layer" in groupable([at.q_proj, nn.Linear(4, 4)])
    assert "a group stacks 2 or 3" in groupable([at.q_proj])


def test_a_group_built_in_training_mode_with_dropout_waits_for_eval(monkeypatch):
    """Dropout acts only while training: the group is built either way, and a call in training mode goes to peft."""
    model, layer = fp32_layer(monkeypatch)
    for m in layer.modules():
        if hasattr(m, "lora_dropout"):
            m.lora_dropout["default"] = nn.Dropout(0.1)
    model.train()
    proj = ModuleProjections(layer)
    stack(proj)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        assert proj.groups["qkv"](x) is None
        model.eval()
        got = torch.cat(proj.qkv_parts(x), -1).double()
    assert torch.allclose(got, expected([proj.q_proj, proj.k_proj, proj.v_proj], x, dense_weight), atol=1e-5)
