"""A quantized frozen base (edgerl/quant.py) on the CPU: loading tensor by tensor and its memory,
bitsandbytes' and transformers' own quantization, fp32 compute against slow references, byte counts,
LoRA through peft, FSDP2 with the quantized weights ignored, and the 16-bit export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("bitsandbytes", reason="a quantized base needs bitsandbytes (pip install bitsandbytes)")

from edgerl.core.errors import ModelError  # noqa: E402
from edgerl.models.quant import (dequantized_state_dict, dequantized_weight, dequantized_weights, load_quantized_lm,  # noqa: E402
                          quantize_linear, quantized_bytes, quantized_params)

QUANTS = ["nf4", "int8"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The NF4 code book of the QLoRA paper (appendix E), indexed by the 4-bit code.
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def make_model(out: Path, arch: str = "llama", dtype=torch.float32, tied: bool = True, layers: int = 2,
               hidden: int = 64, inter: int = 192, vocab: int = 300, shard: str | None = None) -> Path:
    """A random llama/qwen2-shape model (qwen2: biases on q/k/v) saved as safetensors, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=inter, tie_word_embeddings=tied,
                  max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    model.to(dtype).save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("q-llama"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """Untied, biased q/k/v, stored in fp16 so that an fp16-stored base holds exactly its values."""
    return make_model(tmp_path_factory.mktemp("q-qwen"), arch="qwen2", dtype=torch.float16, tied=False)


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def plain_model(folder: Path, state: dict[str, torch.Tensor] | None = None):
    """The plain transformers model in fp32, from the folder or from the given weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if state is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def ids(vocab: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- slow references


def nf4_reference(layer) -> torch.Tensor:
    """The NF4 weight decoded the obvious way: two codes per byte (high nibble first), each block of 64
    scaled by its absmax, the absmax itself = second-level code x fp32 scale (per 256 blocks) + offset."""
    qs = layer.weight.quant_state
    out, inp = qs.shape
    n = out * inp
    packed = layer.weight.data.view(torch.uint8).reshape(-1).long().cpu()   # the reference runs on the CPU
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n]
    block = torch.arange(math_ceil(n, 64))
    absmax = qs.state2.code.cpu()[qs.absmax.long().cpu()] * qs.state2.absmax.cpu()[block // 256] + torch.as_tensor(qs.offset).cpu()
    values = torch.tensor(NF4)[codes] * absmax[torch.arange(n) // 64]
    return values.reshape(out, inp)


def math_ceil(a: int, b: int) -> int:
    return -(-a // b)


def int8_reference(layer) -> torch.Tensor:
    """int8 rows times their scale / 127."""
    cb = layer.weight.CB if layer.weight.CB is not None else layer.state.CB
    scb = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    return cb.double() * scb.double()[:, None] / 127.0


def llm_int8_reference(x: torch.Tensor, layer, threshold: float = 6.0) -> torch.Tensor:
    """LLM.int8 as bitsandbytes defines it: activations cast to fp16, entries >= threshold zeroed, each
    row scaled to [-127, 127] in fp32 and rounded; int8 x int8 products summed exactly and rescaled;
    the columns holding an outlier multiplied in the input's precision by the dequantized weight
    columns instead. Sums in float64."""
    cb = layer.weight.CB if layer.weight.CB is not None else layer.state.CB
    scb = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    x2 = x.reshape(-1, x.shape[-1])
    h = x2.half()
    outlier = h.abs() >= threshold
    cols = outlier.any(0)
    rowmax = h.masked_fill(outlier, 0).abs().amax(1).float()
    ca = torch.round(h.masked_fill(outlier, 0).float() * (127.0 / rowmax[:, None])).double()  # scaled in fp32
    ca[:, cols] = 0
    out = (ca @ cb.double().T) * rowmax.double()[:, None] * scb.double()[None, :] / 127.0 ** 2
    out = out + x2[:, cols].double() @ (cb[:, cols].double() * scb.double()[:, None] / 127.0).T
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out.reshape(*x.shape[:-1], -1)


def stored_bytes(layer) -> int:
    """Every tensor a quantized layer's weight keeps, by nbytes."""
    import bitsandbytes as bnb
    if isinstance(layer, bnb.nn.Linear4bit):
        qs = layer.weight.quant_state
        return sum(t.nbytes for t in (layer.weight.data, qs.absmax, qs.code, qs.offset, qs.state2.absmax,
                                      qs.state2.code))
    return sum(t.nbytes for t in (layer.weight.data, layer.weight.SCB))


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_loader_quantizes_like_bitsandbytes_itself(quant, arch, request):
    """Every decoder projection holds the bytes bitsandbytes' own Linear4bit/Linear8bitLt .to() makes."""
    import bitsandbytes as bnb
    folder = request.getfixturevalue(arch)
    lm = load_quantized_lm(folder, quant, torch.float32, "cpu")
    weights = checkpoint(folder)
    kind = bnb.nn.Linear4bit if quant == "nf4" else bnb.nn.Linear8bitLt
    for i, layer in enumerate(lm.model.layers):
        for name, module in layer.named_modules():
            if not name.endswith("_proj"):
                continue
            assert isinstance(module, kind), name
            w = weights[f"model.layers.{i}.{name}.weight"]
            if quant == "nf4":
                own = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compress_statistics=True, quant_type="nf4")
                own.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=True,
                                               quant_type="nf4")
                own = own.to("cpu")
                a, b = module.weight.quant_state, own.weight.quant_state
                assert torch.equal(module.weight.data, own.weight.data), name
                for t, u in ((a.absmax, b.absmax), (a.code, b.code), (a.offset, b.offset),
                             (a.state2.absmax, b.state2.absmax), (a.state2.code, b.state2.code)):
                    assert torch.equal(t, u), name
                assert (a.blocksize, a.state2.blocksize, a.quant_type) == (64, 256, "nf4")
            else:
                own = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=False, has_fp16_weights=False)
                own.load_state_dict({"weight": w.clone()})
                own = own.to("cpu")
                assert torch.equal(module.weight.data, own.weight.data) and module.weight.dtype == torch.int8
                assert torch.equal(module.weight.SCB, own.weight.SCB), name


@pytest.mark.parametrize("quant", QUANTS)
def test_loader_matches_transformers_bitsandbytes_config(quant, qwen):
    """transformers' own BitsAndBytesConfig loading (offline, on the CPU) stores the same bytes and
    computes the same logits."""
    pytest.importorskip("accelerate", reason="transformers' bitsandbytes loading needs accelerate")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    cfg = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32) if quant == "nf4"
           else BitsAndBytesConfig(load_in_8bit=True))
    hf = AutoModelForCausalLM.from_pretrained(qwen, quantization_config=cfg, device_map="cpu", dtype=torch.float32)
    mine = load_quantized_lm(qwen, quant, torch.float32, "cpu")
    theirs = dict(hf.named_modules())
    for name, module in mine.named_modules():
        if name.endswith("_proj"):
            other = theirs[name]
            assert torch.equal(module.weight.data, other.weight.data), name
            if quant == "nf4":
                assert torch.equal(module.weight.quant_state.absmax, other.weight.quant_state.absmax)
                assert torch.equal(module.weight.quant_state.state2.absmax, other.weight.quant_state.state2.absmax)
                other.support_avx512bf16_for_cpu = False  # as edgerl's layers: fp32 compute, no bf16 repacking
            else:
                assert torch.equal(module.weight.SCB, other.weight.SCB)
    torch.testing.assert_close(logits(mine, ids()), logits(hf, ids()), rtol=0, atol=1e-5)


def test_what_stays_float(qwen, llama):
    import bitsandbytes as bnb
    lm = load_quantized_lm(qwen, "nf4", torch.float32, "cpu", storage_dtype=torch.float16)
    for name, p in lm.named_parameters():
        assert not p.requires_grad and not p.is_meta, name
        if name.endswith("_proj.weight"):
            assert isinstance(p, bnb.nn.Params4bit) and p.dtype == torch.uint8, name
        elif name.endswith("_proj.bias"):
            assert p.dtype == torch.float32, name  # the compute dtype: bitsandbytes would cast it in place
        else:
            assert p.dtype == torch.float16, name  # embeddings, norms, the untied head
    assert lm.lm_head.weight.dtype == torch.float16 and not lm.training
    assert len(quantized_params(lm)) == 2 * 7
    tied = load_quantized_lm(llama, "int8", torch.float32, "cpu")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    inv = tied.model.rotary_emb.inv_freq
    assert inv.dtype == torch.float32 and torch.equal(inv, plain_model(llama).model.rotary_emb.inv_freq)


def test_sharded_checkpoint_and_only_some_projections(tmp_path):
    import bitsandbytes as bnb
    folder = make_model(tmp_path / "sharded", layers=3, hidden=128, inter=256, shard="200KB")
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 2
    lm = load_quantized_lm(folder, "nf4", torch.float32, "cpu", modules=["q_proj", "v_proj"])
    attn, mlp = lm.model.layers[2].self_attn, lm.model.layers[2].mlp
    assert isinstance(attn.q_proj, bnb.nn.Linear4bit) and isinstance(attn.v_proj, bnb.nn.Linear4bit)
    assert type(attn.k_proj) is torch.nn.Linear and type(mlp.down_proj) is torch.nn.Linear
    plain = plain_model(folder)
    assert torch.equal(mlp.down_proj.weight, plain.model.layers[2].mlp.down_proj.weight)
    torch.testing.assert_close(dequantized_weight(attn.q_proj), nf4_reference(attn.q_proj), rtol=0, atol=0)


# ---------------------------------------------------------------------------- memory while loading


def rss_anon() -> int:
    """Anonymous resident memory of this process: what it allocated, not the file pages it maps."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Samples `rss_anon()` every 0.2 ms in a thread; torch and bitsandbytes release the GIL in their kernels."""

    def __init__(self) -> None:
        self.base = self.peak = rss_anon()
        self.samples = 0
        self._stop = False

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss_anon())
            self.samples += 1
            time.sleep(0.0002)

    def __enter__(self) -> "PeakSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def model_bytes(model) -> int:
    """Bytes of every parameter, with a quantized layer's constants (`stored_bytes`)."""
    from edgerl.models.quant import is_quantized_linear
    quantized = {id(m.weight) for m in model.modules() if is_quantized_linear(m)}
    total = sum(stored_bytes(m) for m in model.modules() if is_quantized_linear(m))
    return total + sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values() if id(p) not in quantized)


def measure(folder: str, quant: str, device: str, warm: str) -> dict:
    """Run in a fresh process: peaks while loading `folder` (after loading `warm`, a tiny model of the
    same architecture, so imports and first-call caches are not counted)."""
    load_quantized_lm(warm, "nf4" if quant == "copy" else quant, torch.float32, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before_device = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    with PeakSampler() as host:
        if quant == "copy":  # the approach the loader avoids: every tensor read into memory first
            from safetensors import safe_open
            with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
                everything = {k: f.get_tensor(k).clone() for k in f.keys()}
            size = sum(t.nbytes for t in everything.values())
        else:
            model = load_quantized_lm(folder, quant, torch.float32, device)
            size = model_bytes(model)
    out = {"host_peak": host.peak - host.base, "samples": host.samples, "model_bytes": size}
    if device.startswith("cuda"):
        out["device_peak"] = torch.cuda.max_memory_allocated() - before_device
        out["device_final"] = torch.cuda.memory_allocated() - before_device
    return out


def measure_in_subprocess(folder: Path, quant: str, device: str, warm: Path) -> dict:
    # A fixed mmap threshold makes glibc return every large freed block at once instead of keeping it
    # in the heap, so resident memory follows what is allocated.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, "measure", str(folder), quant, device, str(warm)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> tuple[Path, Path]:
    """~100M parameters in fp32 (~400 MB, big enough to see) with a small vocabulary, and a tiny twin."""
    root = tmp_path_factory.mktemp("q-mid")
    big = make_model(root / "big", layers=8, hidden=1024, inter=2816, vocab=512, tied=False)
    warm = make_model(root / "warm", layers=1, hidden=64, inter=128, vocab=512, tied=False)
    return big, warm


@pytest.mark.slow
@pytest.mark.parametrize("quant", QUANTS)
def test_loading_holds_one_tensor_at_a_time(quant, mid_model):
    """On the CPU the device is the host: the peak is the quantized model plus what quantizing the
    largest tensor needs (bitsandbytes' CPU quantizer holds ~2 fp32-sized temporaries of it), never
    the full-precision model; the memory-mapped reads add no anonymous memory."""
    big, warm = mid_model
    fp32 = (big / "model.safetensors").stat().st_size
    largest = 1024 * 2816 * 4
    r = measure_in_subprocess(big, quant, "cpu", warm)
    assert r["samples"] > 200, r  # the sampler ran throughout the load
    assert r["host_peak"] <= r["model_bytes"] + 3 * largest + 4 * 2**20, r
    assert r["host_peak"] < 0.35 * fp32, r
    control = measure_in_subprocess(big, "copy", "cpu", warm)  # the sampler does see a full copy
    assert control["host_peak"] >= 0.95 * fp32, control


# ---------------------------------------------------------------------------- compute


SHAPES = [(200, 131), (77, 45), (192, 33), (64, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
def test_nf4_forward_and_backward_are_dequantize_then_linear(shape, compute):
    """Pascal's path is compute=fp32: the weight dequantized in fp32, F.linear in fp32, exactly; the
    backward multiplies by the same weight (also for a weight quantized from bf16)."""
    torch.manual_seed(1)
    inp, out = shape
    lin = torch.nn.Linear(inp, out, bias=True)
    if compute == torch.float32:
        lin = lin.to(torch.bfloat16)  # quantized from bf16 values, computed in fp32
    layer = quantize_linear(lin, "nf4", compute)
    w = nf4_reference(layer)
    torch.testing.assert_close(dequantized_weight(layer, torch.float32), w, rtol=0, atol=0)
    x = torch.randn(3, 5, inp)
    expect = F.linear(x.to(compute), w.to(compute), lin.bias.to(compute))
    for mode in ("eval", "train"):
        getattr(layer, mode)()
        with torch.no_grad():
            got = layer(x.to(compute))
        assert got.dtype == compute
        torch.testing.assert_close(got, expect, **({"rtol": 0, "atol": 0} if compute == torch.float32 else {}))
    if compute == torch.float32:
        xg = x.clone().requires_grad_()
        g = torch.randn(3, 5, out)
        layer(xg).backward(g)
        torch.testing.assert_close(xg.grad, g @ w, rtol=1e-6, atol=1e-6)
        assert layer.weight.grad is None


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_forward_is_llm_int8_and_training_on_cpu_is_dequantize_then_linear(shape):
    """LLM.int8 (eval, and every mode on a GPU) rounds the activations to int8 too, outlier columns
    excepted; bitsandbytes' CPU training path is the dequantized weight times x in fp32."""
    torch.manual_seed(2)
    inp, out = shape
    lin = torch.nn.Linear(inp, out, bias=True)
    layer = quantize_linear(lin, "int8", torch.float32)
    x = torch.randn(4, 3, inp)
    x[:, :, 0] = 9.0  # an outlier column (>= 6): computed in full precision
    layer.eval()
    with torch.no_grad():
        got = layer(x)
    # atol: bitsandbytes' CPU rescaling multiplies by 6.200124e-05 where 1 / 127**2 = 6.2000124e-05,
    # 1.8e-5 too much on the int8 part of each output (~1 here)
    torch.testing.assert_close(got.double(), llm_int8_reference(x, layer), rtol=0, atol=5e-5)
    w = int8_reference(layer)
    plain = F.linear(x.double(), w, lin.bias.double())
    assert (got.double() - plain).abs().max() > 2e-3  # the activation rounding is real
    layer.train()
    xg = x.clone().requires_grad_()
    got = layer(xg)
    torch.testing.assert_close(got.double(), plain, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    torch.testing.assert_close(xg.grad.double(), w.sum(0).expand_as(xg), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dequantized_weight(layer), w.float())  # computed in fp32


# ---------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("shape", [(64, 64), (200, 131), (77, 45), (1024, 2816), (4096, 333)])
def test_quantized_bytes_are_the_stored_tensors(quant, shape):
    inp, out = shape
    layer = quantize_linear(torch.nn.Linear(inp, out, bias=False), quant, torch.float32)
    assert quantized_bytes(inp, out, quant) == stored_bytes(layer)


def test_quantized_bytes_per_parameter_of_a_7b_projection():
    """The ratios the memory model relies on, for llama-2-7B's MLP projection (11008 x 4096)."""
    n = 11008 * 4096
    constants = 4 * 256 + 4 * 16 + 4  # the two code tables and the offset, per layer
    assert quantized_bytes(4096, 11008, "nf4") / n == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256) + constants / n,
                                                                    rel=1e-9)
    assert quantized_bytes(4096, 11008, "int8") / n == pytest.approx(1 + 4 / 4096, rel=1e-9)


# ---------------------------------------------------------------------------- LoRA through peft


def lora_model(folder: Path, quant: str, storage=torch.float32):
    from edgerl.models.lora import apply_lora
    lm = load_quantized_lm(folder, quant, torch.float32, "cpu", storage_dtype=storage)
    torch.manual_seed(3)
    return lm, apply_lora(lm, 4, 8.0, 0.0, PROJECTIONS)


def train_steps(lm, steps: int, batch: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = lm(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("quant", QUANTS)
def test_lora_on_the_quantized_base(quant, qwen):
    """peft wraps the bitsandbytes layers; only the adapter gets gradients; the adapter disabled is the
    quantized base (the reference policy); the adapted model equals dequantized W + scale B A."""
    from peft.tuners.lora import bnb as lora_bnb
    lm, peft_model = lora_model(qwen, quant)
    q_proj = lm.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, lora_bnb.Linear4bit if quant == "nf4" else lora_bnb.Linear8bitLt)
    base = {n: p.data.clone() for n, p in lm.named_parameters() if ".lora_" not in n}
    lm.train()  # LLM.int8 on the CPU computes differently in eval: compare in one mode throughout
    batch = ids()
    loss = lm(input_ids=batch, labels=batch).loss
    loss.backward()
    with_grad = {n for n, p in lm.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_" in n for n in with_grad)
    assert all(lm.get_parameter(n).grad.abs().sum() > 0 for n in with_grad if "lora_B" in n)
    lm.zero_grad()
    train_steps(lm, 2, batch)
    for n, p in lm.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p.data, base[n]), n
    fresh = load_quantized_lm(qwen, quant, torch.float32, "cpu").train()
    with peft_model.disable_adapter():
        torch.testing.assert_close(logits(lm, batch), logits(fresh, batch), rtol=0, atol=0)
    # the slow way: a plain transformers model with W = dequantized W + scale * B @ A, in float64
    merged = dequantized_state_dict(lm, torch.float64)
    for name, module in lm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            A, B = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
            assert B.abs().sum() > 0
            merged[f"{name}.weight"] = merged[f"{name}.weight"] + module.scaling["default"] * (B @ A)
    ref = plain_model(qwen, merged).double()
    with torch.no_grad():
        want = ref(input_ids=batch).logits
    torch.testing.assert_close(logits(lm, batch).double(), want, rtol=0, atol=1e-4)


def test_lora_layer_is_base_plus_scaled_adapter():
    """One adapted layer at odd sizes: dequantized W x + b + scale B A x."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(4)
    model = torch.nn.Sequential()
    model.add_module("proj", quantize_linear(torch.nn.Linear(77, 45), "nf4", torch.float32))
    model.is_loaded_in_4bit = True
    peft_model = get_peft_model(model, LoraConfig(r=3, lora_alpha=5, target_modules=["proj"]))
    layer = model.proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(6, 77)
    A, B, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    w = nf4_reference(layer.base_layer)
    expect = F.linear(x, w, layer.base_layer.bias) + s * (x @ A.T) @ B.T
    torch.testing.assert_close(model(x), expect, rtol=1e-5, atol=1e-5)
    with peft_model.disable_adapter():
        torch.testing.assert_close(model(x), F.linear(x, w, layer.base_layer.bias), rtol=0, atol=0)


# ---------------------------------------------------------------------------- FSDP2


def shard_like_edgerl(lm, ignored: str | None) -> None:
    """What edgerl.models.load.shard does (per decoder layer, then the root; fp32 compute over an fp16
    base), with FSDP2 ignoring the quantized weights ("quantized") or every frozen parameter ("frozen")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from edgerl.models.load import init_distributed
    init_distributed(torch.device("cpu"))
    kwargs = {"mesh": init_device_mesh("cpu", (1,)),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
    if ignored == "quantized":
        kwargs["ignored_params"] = quantized_params(lm)
    elif ignored == "frozen":
        kwargs["ignored_params"] = {p for p in lm.parameters() if not p.requires_grad}
    for layer in lm.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(lm, **kwargs)


@pytest.mark.parametrize("ignored", ["quantized", "frozen"])
@pytest.mark.parametrize("quant", QUANTS)
def test_fsdp2_trains_the_adapter_and_leaves_the_quantized_base_alone(quant, ignored, qwen):
    """FSDP2 (one-process gloo group) with ignored_params: the quantized weights stay whole, in place and
    unchanged; forward, backward with checkpointing and AdamW steps equal the unwrapped model's. With
    every frozen parameter ignored, FSDP2 manages the adapter alone (the float base then has to be
    stored in the compute dtype: mixed precision does not cast what FSDP2 ignores)."""
    from torch.distributed.tensor import DTensor
    from edgerl.models.load import enable_checkpointing
    lm, _ = lora_model(qwen, quant, storage=torch.float16 if ignored == "quantized" else torch.float32)
    ref, _ = lora_model(qwen, quant, storage=torch.float32)  # the fp16 checkpoint's values, in fp32
    enable_checkpointing(lm)
    frozen = {n: (p, p.data_ptr(), p.data.clone()) for n, p in lm.named_parameters() if n.endswith("base_layer.weight")}
    shard_like_edgerl(lm, ignored=ignored)
    lm.train()
    ref.train()
    batch = ids(seed=5)
    mine, theirs = train_steps(lm, 3, batch), train_steps(ref, 3, batch)
    assert mine == pytest.approx(theirs, rel=1e-5) and mine[-1] < mine[0]
    params = dict(lm.named_parameters())
    for n, (p, ptr, value) in frozen.items():
        assert params[n] is p and not isinstance(p, DTensor) and p.data_ptr() == ptr, n
        assert torch.equal(p.data, value), n
    assert all(isinstance(p, DTensor) for n, p in params.items() if ".lora_" in n)
    assert all(isinstance(p, DTensor) == (ignored == "quantized") for n, p in params.items() if "norm" in n)
    for n, p in ref.named_parameters():
        if ".lora_" in n:
            torch.testing.assert_close(params[n].full_tensor(), p.detach(), rtol=1e-4, atol=1e-6)
    exported = dequantized_state_dict(lm, torch.float32)  # gathers the sharded float weights
    for n, t in dequantized_state_dict(ref, torch.float32).items():
        assert torch.equal(exported[n], t), n


def test_fsdp2_held_unsharded_for_rollout(qwen):
    """For a decode loop (CUDA graphs need fixed addresses): with every FSDP2 module unsharded and kept
    so, repeated forwards neither move nor re-gather a parameter and compute what the sharded model does."""
    from torch.distributed.fsdp import FSDPModule
    lm, _ = lora_model(qwen, "nf4", storage=torch.float16)
    shard_like_edgerl(lm, ignored="quantized")
    want = logits(lm.eval(), ids())
    fsdp = [m for m in lm.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.set_reshard_after_forward(False)
        m.unshard()
    first = logits(lm, ids())
    where = {n: p.data_ptr() for n, p in lm.named_parameters()}
    second = logits(lm, ids())
    assert where == {n: p.data_ptr() for n, p in lm.named_parameters()}
    assert torch.equal(first, want) and torch.equal(second, want)
    assert lm.lm_head.weight.dtype == torch.float32  # unsharded in the compute dtype: a second copy
    for m in fsdp:
        m.reshard()


def test_without_ignored_params_fsdp2_takes_the_quantized_weights(qwen):
    """Why ignored_params: FSDP2 turns each quantized weight into a DTensor shard. int8 layers then fail
    (the int8 row scales live on the weight object); nf4 layers still run on one process because
    bitsandbytes re-attaches the quantization state at every unshard, but the base is then all-gathered
    per layer and forward, and no longer one resident tensor the rollout engine can read."""
    from torch.distributed.tensor import DTensor
    lm, _ = lora_model(qwen, "int8")
    shard_like_edgerl(lm, ignored=None)
    with pytest.raises(AttributeError, match="CB"):
        lm(input_ids=ids())
    lm, _ = lora_model(qwen, "nf4")
    shard_like_edgerl(lm, ignored=None)
    assert isinstance(lm.model.layers[0].self_attn.q_proj.base_layer.weight, DTensor)


# ---------------------------------------------------------------------------- 16-bit export


@pytest.mark.parametrize("quant", QUANTS)
def test_export_is_the_dequantized_base_in_16_bits(quant, llama, tmp_path):
    lm = load_quantized_lm(llama, quant, torch.float32, "cpu").train()  # train: int8's dequantized path on CPU
    sd32 = dequantized_state_dict(lm, torch.float32)
    plain = plain_model(llama)
    assert set(sd32) == {n for n, _ in plain.named_parameters()}  # plain HF names, tied weights once
    ref = nf4_reference if quant == "nf4" else int8_reference
    q = lm.model.layers[1].mlp.down_proj
    torch.testing.assert_close(sd32["model.layers.1.mlp.down_proj.weight"].double(), ref(q).double(),
                               rtol=0, atol=1e-7)
    exported = plain_model(llama, sd32)
    torch.testing.assert_close(logits(exported, ids()), logits(lm, ids()), rtol=0, atol=1e-5)
    sd16 = dequantized_state_dict(lm, torch.bfloat16)
    assert {t.dtype for t in sd16.values()} == {torch.bfloat16}
    for n, t in sd16.items():
        assert torch.equal(t, sd32[n].to(torch.bfloat16)), n
    exported.to(torch.bfloat16).save_pretrained(tmp_path / "out")
    n_params = sum(t.numel() for t in sd16.values())
    assert (tmp_path / "out" / "model.safetensors").stat().st_size < 2 * n_params + 100_000  # 16 bits a weight
    # after peft: the same names (".base_layer" dropped), the adapter left out, nothing merged
    from edgerl.models.lora import apply_lora
    apply_lora(lm, 4, 8.0, 0.0, PROJECTIONS)
    streamed = dict(dequantized_weights(lm, torch.bfloat16))
    assert set(streamed) == set(sd16) and all(torch.equal(streamed[n], sd16[n]) for n in sd16)


# ---------------------------------------------------------------------------- errors


def test_errors_name_the_file_and_the_fix(tmp_path, llama, monkeypatch):
    with pytest.raises(ModelError, match="no model.safetensors.*save_pretrained"):
        load_quantized_lm(tmp_path, "nf4", torch.float32, "cpu")
    sharded = make_model(tmp_path / "sharded", shard="200KB")
    next(sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelError, match="model.safetensors.index.json names .*model-"):
        load_quantized_lm(sharded, "nf4", torch.float32, "cpu")
    with pytest.raises(ValueError, match="quant='fp4': choose one of nf4, int8"):
        load_quantized_lm(llama, "fp4", torch.float32, "cpu")
    from safetensors.torch import save_file
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((llama / "config.json").read_text())
    save_file({**checkpoint(llama), "model.layers.0.mystery.weight": torch.zeros(2, 2)}, str(extra / "model.safetensors"))
    with pytest.raises(ModelError, match="model.safetensors: tensor 'model.layers.0.mystery.weight'"):
        load_quantized_lm(extra, "nf4", torch.float32, "cpu")


AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.xfail(AVX512, strict=True, reason="bitsandbytes 0.50's AVX-512 CPU NF4 decoder indexes block scales per row")
def test_bitsandbytes_cpu_nf4_decoder_on_rows_of_16k_not_64k():
    """Why the loader refuses such widths on an AVX-512 CPU; when this passes there, drop `_check_cpu_nf4`."""
    import bitsandbytes as bnb
    torch.manual_seed(0)
    w = torch.randn(5, 160)
    layer = bnb.nn.Linear4bit(160, 5, bias=False, compress_statistics=True, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
    layer = layer.to("cpu")
    torch.testing.assert_close(dequantized_weight(layer), nf4_reference(layer), rtol=0, atol=0)


def test_the_probe_agrees_with_the_decoder_on_this_cpu():
    from edgerl.models.quant import cpu_nf4_decodes_rows_wrongly
    import bitsandbytes as bnb
    torch.manual_seed(1)
    layer = bnb.nn.Linear4bit(160, 7, bias=False, compress_statistics=True, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(7, 160), requires_grad=False, compress_statistics=True,
                                     quant_type="nf4")
    layer = layer.to("cpu")
    wrong = not torch.equal(dequantized_weight(layer), nf4_reference(layer).float())
    assert cpu_nf4_decodes_rows_wrongly() == wrong


def test_cpu_nf4_refuses_widths_its_kernel_decodes_wrongly(tmp_path, monkeypatch):
    import edgerl.models.quant as quant
    decoder_wrong_here = quant.cpu_nf4_decodes_rows_wrongly()
    folder = make_model(tmp_path / "m", inter=160)
    monkeypatch.setattr(quant, "cpu_nf4_decodes_rows_wrongly", lambda: True)
    with pytest.raises(ModelError, match="model.layers.0.mlp.down_proj: in_features=160 .* int8"):
        load_quantized_lm(folder, "nf4", torch.float32, "cpu")
    lm = load_quantized_lm(folder, "int8", torch.float32, "cpu")  # int8 rows have no blocks
    assert lm.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    monkeypatch.setattr(quant, "cpu_nf4_decodes_rows_wrongly", lambda: False)  # a CPU whose decoder is right
    lm = load_quantized_lm(folder, "nf4", torch.float32, "cpu")
    down = lm.model.layers[0].mlp.down_proj
    if not decoder_wrong_here:  # loaded weights are the weights it multiplies by
        torch.testing.assert_close(dequantized_weight(down), nf4_reference(down).float(), rtol=0, atol=0)


def test_a_model_without_nn_linear_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="has no .model.layers"):
        load_quantized_lm(tmp_path, "nf4", torch.float32, "cpu")


def test_conv1d_projections_are_refused():
    from transformers.pytorch_utils import Conv1D
    from edgerl.models.quant import _swap_linears

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(12, 4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Layer()])
    with pytest.raises(ModelError, match=r"model.layers.0.c_attn.weight belongs to a Conv1D, not an nn.Linear"):
        _swap_linears(Model(), "nf4", torch.float32, None, torch.device("cpu"))


def test_missing_bitsandbytes_says_how_to_install(monkeypatch, llama):
    import builtins
    real = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(ModelError, match="pip install bitsandbytes"):
        load_quantized_lm(llama, "nf4", torch.float32, "cpu")


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "measure":
    print(json.dumps(measure(*sys.argv[2:])))
