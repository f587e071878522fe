"""The weights an export reads, one tensor at a time, under the plain HF model's names.

    HfWeights(folder)                 an HF folder's safetensors (one file or shards)
    HfWeights(ckpt, prefix="lm.")     a full fine-tuning checkpoint's actor.safetensors (the PolicyHead's names)
    LoraMerged(base, adapter)         base weights with a peft adapter merged in: W + (alpha / r) * B @ A, in fp32

Nothing holds the whole model: a 7B model is exported with the memory of its largest tensor, not of the
model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from edgerl.core.errors import ModelError


class HfWeights:
    """Tensors of the safetensors files in `folder` (only `files` when given), keys without `prefix`."""

    def __init__(self, folder: Path, prefix: str = "", files: Optional[list[Path]] = None) -> None:
        from safetensors import SafetensorError, safe_open
        self.folder = Path(folder)
        paths = files if files is not None else sorted(self.folder.glob("*.safetensors"))
        if not paths:
            raise ModelError(f"{self.folder} holds no .safetensors weights (a .bin-only model: re-save it with "
                             "save_pretrained(..., safe_serialization=True))")
        self._where: dict[str, tuple[Path, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: set[str] = set()
        for path in paths:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if prefix and not key.startswith(prefix):
                            continue
                        name = key[len(prefix):]
                        sl = f.get_slice(key)
                        self._where[name] = (path, key)
                        self._shapes[name] = tuple(sl.get_shape())
                        self.dtypes.add(sl.get_dtype())
            except (SafetensorError, OSError) as e:
                raise ModelError(f"{path} is damaged or cut short ({e}); export from another checkpoint, or "
                                 "download the model again") from None

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def load(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        path, key = self._where[name]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)


class LoraMerged:
    """`base`'s tensors with the peft adapter in `adapter` (adapter_config.json + adapter_model.safetensors)
    merged into every layer it adapts; the adapter's names must each match a base weight."""

    def __init__(self, base: HfWeights, adapter: Path) -> None:
        from safetensors.torch import load_file
        self.base = base
        adapter = Path(adapter)
        try:
            cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
            state = load_file(str(adapter / "adapter_model.safetensors"))
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read the LoRA adapter in {adapter} ({e}); export from another checkpoint")
        if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("fan_in_fan_out"):
            raise ModelError(f"{adapter}: rsLoRA, DoRA and fan_in_fan_out adapters are not merged by edgerl; merge "
                             "it with peft's merge_and_unload() and export that folder")
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        self.scale = alpha / rank   # peft's scaling without rsLoRA
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            owner = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = state.get(key.replace(".lora_A.", ".lora_B."))
            if b is None or f"{owner}.weight" not in base.names():
                raise ModelError(f"{adapter}: the adapter weight {key} has no matching "
                                 f"{'lora_B' if b is None else 'base weight ' + owner + '.weight'}; was it trained on "
                                 "another model?")
            self.pairs[f"{owner}.weight"] = (a, b)
        if not self.pairs:
            raise ModelError(f"{adapter}/adapter_model.safetensors holds no LoRA weights")

    def names(self) -> list[str]:
        return self.base.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def load(self, name: str) -> torch.Tensor:
        w = self.base.load(name)
        if name not in self.pairs:
            return w
        a, b = self.pairs[name]
        return w.float() + self.scale * (b.float() @ a.float())


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
