"""The one table of dtype names: edgerl's short names and what torch, vLLM and verl call them.

Plans, configs and reasons speak of "fp32", "fp16", "bf16" (and, for a frozen quantized base,
"int8" and "nf4"); every translation goes through this table. `edgerl.kernels` keeps its own two
lines for the same names because it imports nothing from edgerl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class DtypeName:
    name: str                  # edgerl's name
    bytes: float               # storage bytes per element (nf4: half a byte, before its constants)
    torch: Optional[str]       # attribute of the torch module; None for quantized storage
    hf: Optional[str]          # what verl / HF configs write
    quantized: bool = False


DTYPES: dict[str, DtypeName] = {d.name: d for d in (
    DtypeName("fp32", 4, "float32", "float32"),
    DtypeName("fp16", 2, "float16", "float16"),
    DtypeName("bf16", 2, "bfloat16", "bfloat16"),
    DtypeName("int8", 1, None, None, quantized=True),
    DtypeName("nf4", 0.5, None, None, quantized=True),
)}
FLOAT_NAMES = ("fp32", "fp16", "bf16")


def nbytes(name: str) -> float:
    """Storage bytes per element of `name`."""
    return DTYPES[name].bytes


def torch_dtype(name: str) -> Any:
    """The torch dtype for a float name ('fp32' -> torch.float32)."""
    import torch
    spec = DTYPES[name]
    if spec.torch is None:
        raise ValueError(f"{name} is a quantized storage format, not a torch dtype")
    return getattr(torch, spec.torch)


def name_of(dtype: Any) -> str:
    """edgerl's name for a torch dtype (torch.bfloat16 -> 'bf16')."""
    text = str(dtype).removeprefix("torch.")
    for d in DTYPES.values():
        if d.torch == text:
            return d.name
    raise ValueError(f"no edgerl name for {dtype}")


def hf_name(name: str) -> str:
    """The name vLLM's `dtype=` and verl's overrides take ('bf16' -> 'bfloat16')."""
    spec = DTYPES[name]
    if spec.hf is None:
        raise ValueError(f"{name} has no HF/vLLM dtype name")
    return spec.hf


def with_dtype(load: Any, *args: Any, dtype: Any, **kwargs: Any) -> Any:
    """Call a transformers loader (`from_pretrained`, `from_config`) with `dtype=`, or with the older
    `torch_dtype=` where the installed transformers (< 4.56) does not know the new name."""
    try:
        return load(*args, dtype=dtype, **kwargs)
    except TypeError:
        return load(*args, torch_dtype=dtype, **kwargs)
