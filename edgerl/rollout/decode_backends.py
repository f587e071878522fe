"""The decode backends by name: `plan.decode_backend`'s values (edgerl/plan/engines.py says when each can run
and which the plan picks) to the class that runs the decode step's layers (decode_step.py's interface).
Adding a backend is its file, its entry here and its entry in plan/engines.py's DECODE_BACKENDS (a test keeps
the two lists the same)."""

from __future__ import annotations

from .decode_cuda_c import Backend as CudaC
from .decode_step import BackendClass
from .decode_torch import Backend as TorchOps
from .decode_triton_attention import Backend as TritonAttention
from .decode_triton_layers import Backend as TritonLayers

DECODE_BACKENDS: dict[str, BackendClass] = {
    "torch": TorchOps,
    "triton-attention": TritonAttention,
    "triton-layers": TritonLayers,
    "cuda-c": CudaC,
}


def decode_backend(name: str) -> BackendClass:
    """The class of decode backend `name`, or a ValueError naming those there are."""
    if name not in DECODE_BACKENDS:
        raise ValueError(f"no decode backend {name!r}; choose one of {', '.join(DECODE_BACKENDS)}")
    return DECODE_BACKENDS[name]
