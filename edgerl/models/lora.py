"""LoRA through peft: the adapter on a frozen base, the reference as the disabled adapter, merged weights.

The actor under LoRA is the same `PolicyHead` as with full fine-tuning; its `lm` is the HF model
with peft's LoRA layers injected (parameter names `...q_proj.base_layer.weight` and
`...q_proj.lora_A.default.weight`). The `PeftModel` that owns them is kept beside the module tree
(not registered, so FSDP2 and the state dict see each parameter once) for `disable_adapter()`.

- Reference log-probs: the actor's own forward inside peft's `disable_adapter()`: the frozen base,
  no second copy of the weights.
- The rollout copy and the merged export read `merged_weights()`: the plain HF parameter names,
  with W + scale * B @ A (in fp32) for every adapted linear layer.
- Checkpoints and the final adapter are peft's format (adapter_config.json +
  adapter_model.safetensors), so `PeftModel.from_pretrained(base, folder)` loads them.

FSDP2 with a frozen base: `fully_shard` accepts parameters with requires_grad=False and different
original dtypes in one group as long as the trainable ones share a dtype (torch's
`_init_mp_dtypes`); the adapter is fp32 (peft's `autocast_adapter_dtype`), the base fp32, fp16 or bf16,
and `MixedPrecisionPolicy(param_dtype=compute)` casts each unsharded layer to the compute dtype.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from edgerl.core.errors import ModelError

ADAPTER = "default"  # peft's adapter name; it is stripped from the saved keys


def apply_lora(lm: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str],
               base_path: str = ""):
    """Inject LoRA layers into `lm` in place (every other weight frozen); returns the PeftModel.
    `lm` stays the module the caller holds: peft wraps it, it does not copy it."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ModelError(f"LoRA needs peft ({e}): pip install 'edgerl[lora]' (or peft), or --set "
                         "lora.enabled=false") from None
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                     bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_path or None)
    try:
        peft_model = get_peft_model(lm, cfg)  # adapters in fp32 even on a half-precision base
    except ValueError as e:
        raise ValueError(f"lora.target_modules={list(targets)}: {e}") from None
    if peft_model.base_model.model is not lm:  # pragma: no cover - peft contract
        raise RuntimeError("peft copied the model instead of wrapping it")
    return peft_model


def attach(head: nn.Module, peft_model) -> None:
    """Keep `peft_model` on `head` outside the module tree (FSDP2 and state_dict must not see it twice)."""
    object.__setattr__(head, "_peft", peft_model)


def peft_of(head: nn.Module):
    """The PeftModel of a LoRA head, or None for full fine-tuning."""
    return head.__dict__.get("_peft")


@contextlib.contextmanager
def adapter_disabled(head: nn.Module):
    """Inside: `head` computes with the frozen base alone (peft's disable_adapter())."""
    peft_model = peft_of(head)
    if peft_model is None:
        raise ValueError("adapter_disabled() needs a LoRA model; this one trains every weight")
    with peft_model.disable_adapter():
        yield head


class ReferencePolicy:
    """The reference policy of a LoRA run: the actor with its adapter disabled, called like a PolicyHead.

    The base never changes, so this is exactly the initial policy, without a second copy of it."""

    def __init__(self, actor: nn.Module) -> None:
        if peft_of(actor) is None:
            raise ValueError("ReferencePolicy needs a LoRA actor")
        self.actor = actor

    def __call__(self, *args: Any, **kwargs: Any):
        with adapter_disabled(self.actor):
            return self.actor(*args, **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _lora_layers(lm: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in lm.named_modules() if isinstance(m, LoraLayer)}


def merged_weights(lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain HF name, full tensor) for every parameter of a LoRA-injected `lm`; each adapted linear
    layer yields W + scale * B @ A computed in fp32. Tied weights appear once, as in the plain model."""
    from edgerl.models.quant import dequantized_weight, is_quantized_linear
    layers = _lora_layers(lm)
    names = {id(p): n for n, p in lm.named_parameters()}
    for name, p in lm.named_parameters():
        if names[id(p)] != name or ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, _full(p)
            continue
        owner, leaf = name.split(".base_layer.")
        t = _full(p)
        if leaf == "weight":
            layer = layers[owner]
            if getattr(layer, "fan_in_fan_out", False):
                raise NotImplementedError(f"{owner}: fan_in_fan_out (Conv1D) layers are not merged by edgerl")
            base = layer.get_base_layer()
            if is_quantized_linear(base):  # packed codes: the merge needs the weight they stand for
                t = dequantized_weight(base, torch.float32)
            t = t.float()
            for a in layer.active_adapters:
                A, B = _full(layer.lora_A[a].weight).float(), _full(layer.lora_B[a].weight).float()
                t = t + layer.scaling[a] * (B @ A)
        yield f"{owner}.{leaf}", t


def adapter_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter in peft's saved format (keys without the adapter name), full tensors on the CPU."""
    from peft import get_peft_model_state_dict
    peft_model = peft_of(head)
    sd = {f"base_model.model.{n}": _full(p).cpu() for n, p in head.lm.named_parameters() if ".lora_" in n}
    return get_peft_model_state_dict(peft_model, state_dict=sd, adapter_name=ADAPTER)


def _from_peft_key(key: str) -> str:
    """'base_model.model.X.lora_A.weight' -> 'lm.X.lora_A.default.weight' (the head's own name)."""
    inner = key.removeprefix("base_model.model.")
    for part in (".lora_A.", ".lora_B."):
        if part in inner:
            return "lm." + inner.replace(part, f"{part}{ADAPTER}.")
    return "lm." + inner


def load_adapter_state(head: nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """Load a peft-format adapter state into a LoRA head (FSDP2-sharded or not); every adapter weight
    must be present and every key must name one."""
    load_trainable(head, {_from_peft_key(k): v for k, v in sd.items()}, where)


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors (CPU) of the parameters that train: the adapter (and a critic's value head)."""
    return {n: _full(p).cpu() for n, p in module.named_parameters() if p.requires_grad}


def load_trainable(module: nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """Set the trainable parameters of `module` from full tensors; a missing or unknown name is an error."""
    from edgerl.models.full_state import set_full_model_state
    want = {n for n, p in module.named_parameters() if p.requires_grad}
    missing, unknown = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or unknown:
        raise ValueError(f"{where}: the adapter does not match this model ({len(missing)} weights missing, e.g. "
                         f"{missing[:2]}; {len(unknown)} unknown, e.g. {unknown[:2]}); was it saved with other "
                         "lora.rank / lora.target_modules or another model?")
    set_full_model_state(module, sd, strict=False)


def adapter_config_json(head: nn.Module) -> bytes:
    """adapter_config.json as peft writes it."""
    with tempfile.TemporaryDirectory() as tmp:
        peft_of(head).peft_config[ADAPTER].save_pretrained(tmp)
        return (Path(tmp) / "adapter_config.json").read_bytes()


def save_adapter(head: nn.Module, out: Path, state: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """Write `out/adapter_config.json` and `out/adapter_model.safetensors` (peft's format)."""
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = adapter_state(head) if state is None else state
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_bytes(adapter_config_json(head))
    return out

