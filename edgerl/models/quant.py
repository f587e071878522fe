"""A frozen base stored in 4 or 8 bits (QLoRA): loaded tensor by tensor, counted byte by byte,
exported in 16 bits.

`load_quantized_lm` builds the HF causal LM from its config with every parameter on the meta
device, then walks the safetensors checkpoint one tensor at a time: the tensor is read through a
memory map, moved to `device`, quantized there and its full-precision copy freed. Every nn.Linear
of the decoder layers becomes a bitsandbytes layer (q/k/v/o/gate/up/down on llama, qwen2, mistral):

    nf4   Linear4bit: NF4 codes in blocks of 64 with double quantization (QLoRA's format)
    int8  Linear8bitLt(has_fp16_weights=False): LLM.int8, one fp32 scale per output row

Embeddings, norms and the LM head stay in `storage_dtype`, the quantized layers' biases in the
compute dtype (bitsandbytes casts a bias of another dtype in place at the first forward).

Memory while loading, with Q the quantized model's final size (`quantized_bytes` per layer plus the
float parameters), t_max the largest checkpoint tensor in its own dtype and q_max its result:

    device  Q + t_max + q_max (+ the nested absmax of that tensor): one tensor is full-size at a time
    host    one tensor's cast copy at most (t_max); reads are memory-mapped, so the file's pages are
            clean page cache (reclaimable), never anonymous memory.
On the CPU device = host, and bitsandbytes' CPU quantizers (torch ops, not fused kernels) hold about
two more fp32-sized temporaries of the tensor being quantized: Q + ~3 t_max (fp32), measured in
tests/test_quant_on_cpu.py.

Compute dtype. bitsandbytes dequantizes each weight to the compute dtype and multiplies in it:
fp32 on Pascal (Linear4bit(compute_dtype=torch.float32) is exact dequantize + F.linear in fp32),
fp16 on Turing, bf16 on Ampere and newer. int8 differs: LLM.int8 quantizes the activations to int8
as well (row-wise, after a cast to fp16; columns holding an |x| >= 6 are multiplied in the input's
precision), and its int8 matmul needs CC >= 7.5: a P40 or P100 cannot run it. On the CPU,
bitsandbytes' training-mode int8 forward is dequantize + F.linear instead, so eval and train outputs
differ there by the activation rounding. `transient_bytes` is what one forward or backward of a
layer allocates on top.

FSDP2: pass `quantized_params(model)` as `ignored_params` to every `fully_shard` call. The quantized
weights then stay whole and resident on their device on every rank: never sharded, gathered or
offloaded (FSDP2's mixed precision casts floating-point parameters only, so they are not cast either).
Managed by FSDP2 they would become DTensors: int8 layers then fail (their row scales live on the
weight object), nf4 layers are all-gathered at every forward and re-wrapped by bitsandbytes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import nn

from edgerl.plan.dtypes import with_dtype
from edgerl.core.errors import ModelError
# the byte counts are pure arithmetic the planner uses without torch: they live with the memory model
from edgerl.plan.memory import NESTED_BLOCK, NF4_BLOCK, QUANTS, quantized_bytes, transient_bytes  # noqa: F401

INT8_THRESHOLD = 6.0  # LLM.int8's outlier threshold on activations (the paper's and HF's default)


class _DropKernelsNotice(logging.Filter):
    # bitsandbytes' CPU backend tries an optional AVX512-bf16 kernel from the `kernels` package at
    # import and logs a warning when it is absent. That kernel only serves the bf16 inference path
    # disabled below, so it is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


def require_bitsandbytes():
    """The bitsandbytes module, or a ModelError that says how to install it."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropKernelsNotice) for f in log.filters):
        log.addFilter(_DropKernelsNotice())
    try:
        import bitsandbytes
    except ImportError as e:
        raise ModelError(f"a quantized base (nf4/int8) needs bitsandbytes ({e}): pip install bitsandbytes "
                         "(or pip install 'edgerl[bnb]'), or store the base in a float dtype "
                         "(plan.base_dtype=fp16)") from None
    return bitsandbytes


def _check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant={quant!r}: choose one of {', '.join(QUANTS)}")


# ---------------------------------------------------------------------------- bytes


# ---------------------------------------------------------------------------- layers


def is_quantized_linear(module: nn.Module) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # never imported, so no bitsandbytes layer exists (and none is imported to ask)
        return False
    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def quantized_params(model: nn.Module) -> set[nn.Parameter]:
    """The quantized weights of `model` (pass as fully_shard's `ignored_params`)."""
    return {m.weight for m in model.modules() if is_quantized_linear(m)}


@functools.lru_cache(maxsize=None)
def cpu_nf4_decodes_rows_wrongly() -> bool:
    """Whether this machine's bitsandbytes CPU NF4 decoder gets a row of 160 (a multiple of 16, not of 64) wrong.

    bitsandbytes 0.50's AVX-512 CPU decoder indexes the block scales per row where the CUDA kernels (and its
    own scalar CPU path) index the flattened weight; which path runs depends on the CPU. Probed once: a 5 x 160
    weight quantized, decoded by bitsandbytes and by the obvious formula (code x absmax of its block of 64)."""
    import bitsandbytes.functional as bnbf
    w = torch.randn(5, 160, generator=torch.Generator().manual_seed(0))
    q, state = bnbf.quantize_4bit(w, blocksize=NF4_BLOCK, compress_statistics=False, quant_type="nf4")
    got = bnbf.dequantize_4bit(q, state)
    packed = q.view(torch.uint8).reshape(-1).long()
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:w.numel()]
    table = bnbf.get_4bit_type("nf4", device="cpu")
    ref = (table[codes] * state.absmax[torch.arange(w.numel()) // NF4_BLOCK]).reshape(w.shape)
    return not torch.equal(got, ref)


def _check_cpu_nf4(name: str, in_features: int, device: torch.device) -> None:
    # Refuse rather than compute with other weights than were loaded (see cpu_nf4_decodes_rows_wrongly).
    if (device.type == "cpu" and in_features % 16 == 0 and in_features % NF4_BLOCK != 0
            and cpu_nf4_decodes_rows_wrongly()):
        raise ModelError(f"{name}: in_features={in_features} is a multiple of 16 but not of 64, which bitsandbytes' "
                         "CPU NF4 kernel decodes wrongly on this CPU (its AVX-512 path); on the CPU use int8, a float "
                         "base (plan.base_dtype=fp32), or a model whose layer widths are multiples of 64")


def _empty_quantized(linear: nn.Linear, quant: str, compute_dtype: torch.dtype) -> nn.Linear:
    """A bitsandbytes layer of `linear`'s shape with its weight still on the meta device."""
    import bitsandbytes as bnb
    bias = linear.bias is not None
    if quant == "nf4":
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                                  compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                  device="meta")
        # On an AVX512-bf16 CPU, bitsandbytes repacks the weight in place at the first eval forward and
        # then multiplies in bf16 (and asserts out_features % 32 == 0). edgerl's CPU runs check what the
        # GPU computes, so they stay on the plain dequantize + F.linear path in the compute dtype.
        layer.support_avx512bf16_for_cpu = False
    else:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                    threshold=INT8_THRESHOLD, device="meta")
    return layer


def _set_quantized_weight(layer: nn.Module, t: torch.Tensor, device: torch.device,
                          compute_dtype: torch.dtype) -> None:
    """Move `t` to `device`, quantize it there into `layer` as bitsandbytes' own `.to(device)` does, and
    free the full-precision copy."""
    import bitsandbytes as bnb
    if isinstance(layer, bnb.nn.Linear4bit):
        w = t.to(device)  # quantized from the checkpoint's own dtype: no intermediate rounding
        packed, state = bnb.functional.quantize_4bit(w, blocksize=NF4_BLOCK, compress_statistics=True,
                                                     quant_type="nf4", quant_storage=torch.uint8)
        # The backward dequantizes to state.dtype and then casts to the gradient's dtype: recording the
        # compute dtype here makes it dequantize straight into it, the same weight the forward used
        # (a bf16 checkpoint would otherwise be rounded to bf16 in the backward only).
        state.dtype = compute_dtype
        layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=NF4_BLOCK,
                                         compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                         module=layer, bnb_quantized=True)
        layer.quant_state = state
    else:
        # LLM.int8 quantizes row-wise from fp16, as Int8Params._quantize does
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(t.to(device=device, dtype=torch.float16))
        layer.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)


def quantize_linear(linear: nn.Linear, quant: str, compute_dtype: torch.dtype,
                    device: Optional[Union[str, torch.device]] = None) -> nn.Linear:
    """A bitsandbytes copy of `linear` on `device` (default: its own), quantized as the loader does;
    the bias is kept in the compute dtype."""
    require_bitsandbytes()
    _check_quant(quant)
    device = torch.device(device) if device is not None else linear.weight.device
    if quant == "nf4":
        _check_cpu_nf4(type(linear).__name__, linear.in_features, device)
    layer = _empty_quantized(linear, quant, compute_dtype)
    _set_quantized_weight(layer, linear.weight.detach(), device, compute_dtype)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().to(device=device, dtype=compute_dtype, copy=True),
                                  requires_grad=False)
    return layer


def dequantized_weight(layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight (out, in) that `layer`'s forward multiplies by, computed in fp32 and cast once to `dtype`."""
    import bitsandbytes as bnb
    if isinstance(layer, bnb.nn.Linear4bit):
        state = copy.copy(layer.weight.quant_state)  # shallow: only the output dtype differs
        state.dtype = torch.float32
        return bnb.functional.dequantize_4bit(layer.weight.data, state).to(dtype)
    if isinstance(layer, bnb.nn.Linear8bitLt):
        # the first forward moves CB/SCB from the weight to layer.state
        cb = layer.weight.CB if layer.weight.CB is not None else layer.state.CB
        scb = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
        if cb is None:
            cb = layer.weight.data
        return (cb.float() * scb.float().mul(1.0 / 127.0).unsqueeze(1)).to(dtype)  # bitsandbytes' own formula
    raise TypeError(f"{type(layer).__name__} is not a bitsandbytes Linear4bit or Linear8bitLt")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def dequantized_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain HF name, full tensor in `dtype`) for every parameter of `model`, one at a time, on the
    weights' device: quantized layers dequantized, FSDP2 shards gathered, peft's adapters left out
    (`.base_layer.` dropped from the names) and never merged. Tied weights appear once."""
    owners = {}
    for module in model.modules():
        for leaf, p in module.named_parameters(recurse=False):
            owners[id(p)] = (module, leaf)
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or ".lora_" in name:
            continue
        seen.add(id(p))
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        module, leaf = owners[id(p)]
        if leaf == "weight" and is_quantized_linear(module):
            yield plain, dequantized_weight(module, dtype)
        else:
            yield plain, _full(p).to(dtype)


def dequantized_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`dequantized_weights` collected on the CPU: what a 16-bit HF export of the base is made of."""
    return {name: t.cpu() for name, t in dequantized_weights(model, dtype)}


# ---------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device but real buffers (rotary
    frequencies and other non-persistent buffers are computed in __init__ and never saved)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: model.safetensors, or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelError(f"{index}: not a safetensors index ({e}); re-save the model with save_pretrained") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelError(f"{index} names {missing[0]} ({len(missing)} shards missing); download the whole folder")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelError(f"{folder} has no model.safetensors or model.safetensors.index.json; the quantized loader "
                     "reads safetensors only: load the model with transformers once and save_pretrained it")


def _local_folder(path: Union[str, Path]) -> Path:
    folder = Path(path)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise ModelError(f"cannot find model {str(path)!r} ({type(e).__name__}: {e}); offline, pass a local HF "
                         "folder") from None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ModelError(f"{type(model).__name__} has no .model.layers; the quantized loader handles llama-style "
                         "decoders (llama, qwen2, mistral, ...)")
    return layers


def _swap_linears(model: nn.Module, quant: str, compute_dtype: torch.dtype, only: Optional[Iterable[str]],
                  device: torch.device) -> list[str]:
    """Replace the nn.Linear modules of every decoder layer by bitsandbytes layers; returns their names."""
    wanted = set(only) if only is not None else None
    swapped = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear):
                if wanted is None or name.rsplit(".", 1)[-1] in wanted:
                    if quant == "nf4":
                        _check_cpu_nf4(f"model.layers.{i}.{name}", module.in_features, device)
                    parent, _, leaf = name.rpartition(".")
                    setattr(layer.get_submodule(parent), leaf, _empty_quantized(module, quant, compute_dtype))
                    swapped.append(f"model.layers.{i}.{name}")
                continue
            for pname, p in module.named_parameters(recurse=False):
                if p.dim() >= 2:
                    raise ModelError(f"model.layers.{i}.{name}.{pname} belongs to a {type(module).__name__}, not an "
                                     f"nn.Linear; {type(model).__name__} cannot be quantized by edgerl (use a float "
                                     "base: plan.base_dtype=fp16)")
    if not swapped:
        raise ModelError(f"{type(model).__name__}: no nn.Linear in its decoder layers to quantize")
    return swapped


def build_skeleton(config, dtype: torch.dtype, attention: str, trust_remote_code: bool) -> nn.Module:
    """The causal LM of `config` with every parameter on the meta device (its buffers real), for a loader
    that reads the weights itself (here, and the fp16 calibration's edgerl/models/activations.py)."""
    from transformers import AutoModelForCausalLM
    with _parameters_on_meta():
        return with_dtype(AutoModelForCausalLM.from_config, config, dtype=dtype, attn_implementation=attention,
                          trust_remote_code=trust_remote_code)


def _load_file(file: Path, safe_open, model: nn.Module, owners: dict, tied: set, device: torch.device,
               compute_dtype: torch.dtype, storage: torch.dtype) -> None:
    """Read one safetensors file tensor by tensor into `model`'s meta skeleton, quantizing projections."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for key in f.keys():
            name = key if key in owners or key in tied else f"model.{key}"  # saved without the prefix
            if name in tied or key.endswith("rotary_emb.inv_freq"):
                continue  # the same tensor as its tied partner; rotary frequencies come from the config
            if name not in owners:
                raise ModelError(f"{file}: tensor {key!r} has no place in {type(model).__name__}; load the "
                                 "checkpoint with transformers once and save_pretrained it")
            module, leaf = owners[name]
            t = f.get_tensor(key)  # a view of the memory-mapped file: no host copy yet
            expected = module.weight.shape if is_quantized_linear(module) and leaf == "weight" \
                else module._parameters[leaf].shape
            if tuple(t.shape) != tuple(expected):
                raise ModelError(f"{file}: {key} has shape {tuple(t.shape)}, the config says {tuple(expected)}")
            if is_quantized_linear(module) and leaf == "weight":
                _set_quantized_weight(module, t, device, compute_dtype)
            else:
                dtype = compute_dtype if is_quantized_linear(module) else storage
                # copy=True: a CPU parameter must own its memory, not the file's map
                module._parameters[leaf] = nn.Parameter(t.to(device=device, dtype=dtype, copy=True),
                                                        requires_grad=False)
            del t


def load_quantized_lm(path: Union[str, Path], quant: str, compute_dtype: torch.dtype,
                      device: Union[str, torch.device], attention: str = "sdpa",
                      storage_dtype: Optional[torch.dtype] = None, trust_remote_code: bool = False,
                      modules: Optional[Iterable[str]] = None) -> nn.Module:
    """The causal LM at `path` (an HF folder with safetensors) on `device`, its decoder layers' linear
    weights quantized to `quant` ("nf4" or "int8") and computed in `compute_dtype`; every other
    parameter in `storage_dtype` (default: the compute dtype). `modules` limits quantization to those
    leaf names (e.g. ["q_proj", "v_proj"]). All parameters are frozen; the model is in eval mode.
    Peak memory: see the module docstring."""
    require_bitsandbytes()
    _check_quant(quant)
    from safetensors import safe_open
    from transformers import AutoConfig
    device = torch.device(device)
    storage = storage_dtype or compute_dtype
    folder = _local_folder(path)
    files = checkpoint_files(folder)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = build_skeleton(config, storage, attention, trust_remote_code)
    _swap_linears(model, quant, compute_dtype, modules, device)
    owners = {name: (module, leaf) for module_name, module in model.named_modules()
              for leaf, _ in module.named_parameters(recurse=False)
              for name in [f"{module_name}.{leaf}" if module_name else leaf]}
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - \
        {n for n, _ in model.named_parameters()}
    from safetensors import SafetensorError
    for file in files:
        try:
            _load_file(file, safe_open, model, owners, tied, device, compute_dtype, storage)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            if isinstance(e, ModelError) or "out of memory" in str(e).lower():
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"{file} cannot be read ({first}); it may be damaged or cut short: download the "
                             "model again, or re-save it with save_pretrained") from None
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelError(f"{folder}: the checkpoint has no tensor for {missing[:3]} ({len(missing)} missing); is it "
                         f"a complete {type(model).__name__} checkpoint?")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    # peft wraps the bitsandbytes layers only when the model says it is quantized; transformers then
    # refuses a dtype cast of the whole model, which would turn the packed bytes into numbers.
    from transformers.utils.quantization_config import QuantizationMethod
    model.is_loaded_in_4bit = quant == "nf4"
    model.is_loaded_in_8bit = quant == "int8"
    model.quantization_method = QuantizationMethod.BITS_AND_BYTES
    return model.eval()
