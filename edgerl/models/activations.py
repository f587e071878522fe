"""How large a model's activations get, and where they first stop being finite: the calibration forward
behind the plan's fp16 decision (edgerl/plan/fp16.py) and the probe behind the training loop's overflow
stop (edgerl/train/overflow.py). Both watch the same places with forward hooks: each decoder layer's output
(the residual stream) and the input and output of every linear layer inside it, grouped by the sub-module
that holds it (attention, MLP): the MLP's down projection's input is the activation times the up projection,
the product that overflows fp16 first in Gemma 3.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from edgerl.core.errors import ModelError
from edgerl.models.backbone import backbone, decoder_layers
from edgerl.plan.fp16 import ActivationRecord, Peak, now

_GROUPS = (("attn", "attention"), ("attention", "attention"), ("mlp", "MLP"), ("feed_forward", "MLP"),
           ("ffn", "MLP"))
RESIDUAL = "residual stream"


def site_of(name: str) -> str:
    """The site a linear layer belongs to, from its name inside the decoder layer ("self_attn.q_proj")."""
    head = name.split(".")[0]
    return next((site for key, site in _GROUPS if key in head.lower()), head)


def _first(x: Any) -> Optional[torch.Tensor]:
    x = x[0] if isinstance(x, (tuple, list)) and x else x
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _linears(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The layer's linear layers that hold no other (nn.Linear and its bitsandbytes subclasses; under LoRA, the
    base layer and the adapter's two inside peft's wrapper)."""
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear) and not any(isinstance(c, nn.Linear) for c in mod.children()):
            yield name, mod


@contextlib.contextmanager
def watched(layers: nn.ModuleList, see: Callable[[int, str, torch.Tensor], None]) -> Iterator[None]:
    """Call `see(layer index, site, tensor)` on every watched tensor while the block runs, in the order the
    forward computes them."""
    handles = []

    def on_linear(i: int, site: str):
        def hook(_mod, args, out):
            for t in (_first(args), _first(out)):
                if t is not None:
                    see(i, site, t)
        return hook

    def on_layer(i: int):
        def hook(_mod, _args, out):
            t = _first(out)
            if t is not None:
                see(i, RESIDUAL, t)
        return hook

    try:
        for i, layer in enumerate(layers):
            for name, mod in _linears(layer):
                handles.append(mod.register_forward_hook(on_linear(i, site_of(name))))
            handles.append(layer.register_forward_hook(on_layer(i)))
        yield
    finally:
        for h in handles:
            h.remove()


# --- the calibration forward ------------------------------------------------------------------------------

def record_activations(lm: nn.Module, prompts: list[list[int]], device: torch.device,
                       stream: Optional[contextlib.AbstractContextManager] = None) -> ActivationRecord:
    """The largest absolute activation of every watched site over the prompts' tokens, computed in fp32 on
    `device`: all prompts as one right-padded batch, the padding's columns left out. `stream`: a context that
    brings each decoder layer to `device` for its turn (the model's other modules are there already)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, :len(p)] = 1
    ids, mask = ids.to(device), mask.to(device)
    real = mask.bool()
    layers = decoder_layers(lm)
    sites: list[dict[str, float]] = [{} for _ in layers]

    def largest(t: torch.Tensor) -> float:
        a = t.detach().float().abs()
        if a.dim() >= 2 and tuple(a.shape[:2]) == (B, L):   # (B, L, ...) over the real tokens only
            a = a.reshape(B, L, -1).amax(-1)[real]
        return float(a.max()) if a.numel() else 0.0

    def see(i: int, site: str, t: torch.Tensor) -> None:
        sites[i][site] = max(sites[i].get(site, 0.0), largest(t))

    embedded: list[float] = []
    emb_hook = lm.get_input_embeddings().register_forward_hook(lambda _m, _a, out: embedded.append(largest(out)))
    try:
        with torch.no_grad(), stream or contextlib.nullcontext(), watched(layers, see):
            hidden = backbone(lm)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            weight = lm.get_output_embeddings().weight
            logits = 0.0
            rows = hidden[real]                                       # (tokens, H)
            for k in range(0, rows.shape[0], 256):                    # the LM head's product, 256 tokens at a time
                logits = max(logits, float((rows[k:k + 256].float() @ weight.float().t()).abs().max()))
    finally:
        emb_hook.remove()
    return ActivationRecord(layers=tuple(tuple(sorted(s.items())) for s in sites), embeddings=max(embedded or [0.0]),
                            logits=logits, prompts=B, tokens=int(real.sum()), date=now())


def calibrate(path: str, prompts: list[list[int]], device: torch.device, trust_remote_code: bool = False,
              from_files: Optional[bool] = None) -> ActivationRecord:
    """Record the activations of the model at `path` on `prompts`, in fp32 on `device`. `from_files` (the
    default on a GPU): every module but the decoder layers on `device` in fp32, each layer read from the
    safetensors files onto it just before its turn and dropped after, so neither the GPU nor the host ever
    holds the whole model (a 7B QLoRA run on a T4 has neither room); checkpoints whose names do not map onto
    the model built from its config fall back to loading the model in host memory in its own dtype and
    moving each layer to `device` in fp32 for its turn. Otherwise the whole model is loaded in fp32."""
    from edgerl.models.load import load_causal_lm
    from_files = device.type == "cuda" if from_files is None else from_files
    lm, stream = None, None
    if from_files:
        try:
            lm, stream = _from_files(local_folder(path), device, trust_remote_code)
        except ModelError:
            pass
        if lm is None:   # eager attention: exact in fp32, and none of edgerl's attention wrappers is needed
            lm = load_causal_lm(path, "auto", "eager", trust_remote_code)
            stream = _streamed(lm, decoder_layers(lm), device)
    else:
        lm = load_causal_lm(path, torch.float32, "eager", trust_remote_code).to(device)
    lm.eval()
    try:
        return record_activations(lm, prompts, device, stream)
    finally:
        del lm
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _prefix(lm: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in lm.named_modules() if m is module)


def _from_files(folder: Path, device: torch.device, trust_remote_code: bool
                ) -> tuple[nn.Module, contextlib.AbstractContextManager]:
    """The model at `folder` built on the meta device, with every parameter outside the decoder layers read
    from its safetensors onto `device` in fp32, and the context that reads each layer's in for its turn.
    Raises ModelError where the checkpoint's names do not cover the model's parameters."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from edgerl.models.quant import build_skeleton, checkpoint_files
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    lm = build_skeleton(config, torch.float32, "eager", trust_remote_code)
    owners = {f"{mn}.{leaf}" if mn else leaf: (m, leaf) for mn, m in lm.named_modules()
              for leaf, _ in m.named_parameters(recurse=False)}
    tied = {n for n, _ in lm.named_parameters(remove_duplicate=False)} - {n for n, _ in lm.named_parameters()}
    where: dict[str, tuple[Path, str]] = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key if key in owners or key in tied else f"model.{key}"   # saved without the prefix
                if name not in tied and not key.endswith("rotary_emb.inv_freq"):
                    where[name] = (file, key)
    missing = [n for n in owners if n not in tied and n not in where]
    if missing or set(where) - set(owners):
        raise ModelError(f"{folder}: the checkpoint's names do not map onto {type(lm).__name__}")

    def load(names: list[str]) -> None:
        for file in {where[n][0] for n in names}:
            with safe_open(str(file), framework="pt", device="cpu") as f:   # memory-mapped: no host copy
                for n in (n for n in names if where[n][0] == file):
                    m, leaf = owners[n]
                    m._parameters[leaf] = nn.Parameter(f.get_tensor(where[n][1]).to(device, torch.float32),
                                                       requires_grad=False)

    layers = decoder_layers(lm)
    prefixes = [_prefix(lm, layer) + "." for layer in layers]
    load([n for n in where if not n.startswith(tuple(prefixes))])
    if getattr(lm.config, "tie_word_embeddings", False):
        lm.tie_weights()
    for m in lm.modules():
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = b.to(device)

    def drop(names: list[str]) -> None:
        for n in names:
            m, leaf = owners[n]
            m._parameters[leaf] = nn.Parameter(m._parameters[leaf].to("meta"), requires_grad=False)

    @contextlib.contextmanager
    def stream() -> Iterator[None]:
        handles = []
        for layer, prefix in zip(layers, prefixes):
            names = [n for n in where if n.startswith(prefix)]
            handles.append(layer.register_forward_pre_hook(lambda _m, _a, names=names: load(names)))
            handles.append(layer.register_forward_hook(lambda _m, _a, _o, names=names: drop(names)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
    return lm, stream()


@contextlib.contextmanager
def _streamed(lm: nn.Module, layers: nn.ModuleList, device: torch.device) -> Iterator[None]:
    """For a model in host memory: everything but the decoder layers moved to `device` in fp32 now; each layer
    moved there in fp32 just before it runs and back to the host in its own dtype after (exact: the host copy
    is the checkpoint's)."""
    in_layers = {id(t) for t in (*layers.parameters(), *layers.buffers())}
    moved: dict[int, torch.Tensor] = {}
    for mod in lm.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and id(p) not in in_layers:   # tied embeddings and head: moved once, still shared
                mod._parameters[key] = moved.setdefault(id(p), nn.Parameter(p.data.to(device, torch.float32),
                                                                             requires_grad=False))
        for key, b in list(mod._buffers.items()):
            if b is not None and id(b) not in in_layers:
                mod._buffers[key] = b.to(device, torch.float32) if b.is_floating_point() else b.to(device)
    handles = []
    for layer in layers:
        home = next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.float32)
        handles.append(layer.register_forward_pre_hook(lambda m, _a: m.to(device, torch.float32)))
        handles.append(layer.register_forward_hook(lambda m, _a, _o, home=home: m.to("cpu", home)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# --- where a forward first stops being finite -------------------------------------------------------------

def first_nonfinite(layers: nn.ModuleList, forward: Callable[[], Any]) -> Optional[Peak]:
    """Run `forward()` (no gradients) and return the first watched site whose tensor holds NaN or inf, in the
    order the forward computed them (a layer's sites before its output); None when every one was finite."""
    found: list[Peak] = []

    def see(i: int, site: str, t: torch.Tensor) -> None:
        if not found and not bool(torch.isfinite(t.detach()).all()):
            found.append(Peak(f"layer {i}", site, float("inf")))

    with torch.no_grad(), watched(layers, see):
        forward()
    return found[0] if found else None


def local_folder(path: str) -> Path:
    """The folder transformers loads for `path` (edgerl/models/load.py's model_source)."""
    from edgerl.models.load import model_source
    return Path(model_source(path))
