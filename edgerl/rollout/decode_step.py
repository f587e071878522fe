"""The decode backends' interface: what the static decoder (decoder.py) hands a backend at each decode step, and
what a backend provides (`DecodeBackend`). The backends are decode_torch.py, decode_triton_attention.py,
decode_triton_layers.py and decode_cuda_c.py; decode_backends.py names them (`DECODE_BACKENDS`).

A step for a few rows goes: `hide(first, col, S)` once per attention span (each row's first visible column ->
what the backend's attention reads to leave out the columns a row does not see: an additive mask for torch's
ops, the first visible column itself for a kernel that bounds its reads); `first(x)` on the embedded tokens;
`layer(x, d, step)` for each layer with that layer's `LayerStep`; `last(x, d)` for the final norm's input. `d`
is what one layer hands the next (the MLP output not yet added to the residual stream, or the rows' sums of
squares), whatever the backend makes of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

import torch
import torch.nn.functional as F

from edgerl.core.errors import TrainingError

from .arch import Layer
from .projections import FusedProjections, ModuleProjections

Projections = Union[FusedProjections, ModuleProjections]

_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA = _TORCH >= (2, 5)  # `enable_gqa=` of scaled_dot_product_attention


class DecodeKernelUnavailable(ValueError):
    """The decode backend asked for cannot run here (the message says why)."""


class CacheOverflow(TrainingError):
    """A key or value of the rollout did not fit the KV cache's narrower storage (the message says what to set)."""


@dataclass(frozen=True)
class LayerStep:
    """One layer's inputs at one decode step of B rows."""
    proj: Projections      # the layer's projections (projections.py: fused weights, or the modules themselves)
    norms: Layer           # its norms and attention variant (arch.py): ln1/eps1, ln2/eps2, qk, post, window, rope
    kv: torch.Tensor       # its KV cache, (2, B, KVH, S, D): the first S columns (the whole cache, or a span)
    cos: torch.Tensor      # the rotary table at each row's position, (B, 1, D)
    sin: torch.Tensor
    hide: torch.Tensor     # what `DecodeBackend.hide` returned for the layer's attention span
    col: torch.Tensor      # (1,): the cache column the new token goes to (every row's)


class DecodeBackend(Protocol):
    """A decode backend: built as `Backend(dec)` on a `StaticDecoder`, raising DecodeKernelUnavailable (naming
    why) where its kernels cannot run the device, dtype or architecture."""
    name: str              # plan.decode_backend's value
    note: str              # what it runs, for the log
    reads_span: bool       # its attention reads the first S columns it is handed (the engine hands it a span of
    #                        the columns written so far); False: the whole cache, each row's visible columns only

    def hide(self, first: torch.Tensor, col: torch.Tensor, S: int) -> torch.Tensor: ...

    def first(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def layer(self, x: torch.Tensor, d: Any, step: LayerStep) -> tuple[torch.Tensor, Any]: ...

    def last(self, x: torch.Tensor, d: Any) -> torch.Tensor: ...


class BackendClass(Protocol):
    """What DECODE_BACKENDS holds: a class built on the decoder it runs for (a decoder.StaticDecoder, which
    imports this module: hence Any)."""
    def __call__(self, dec: Any) -> DecodeBackend: ...


def sdpa(q, k, v, mask, scale, gqa: bool):
    """scaled_dot_product_attention with a mask; on CUDA on the memory-efficient or math backend only,
    the kernels every dtype was checked on against HF's forward (bench/bench_rollout.py). (A bf16
    mismatch once blamed on the backend choice was the rotary frequencies: see `model_inv_freq`.)"""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa) if _SDPA_GQA \
            else F.scaled_dot_product_attention(q, _repeat(k, q, gqa), _repeat(v, q, gqa), attn_mask=mask, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, _repeat(k, q, gqa), _repeat(v, q, gqa), attn_mask=mask, scale=scale)


def _repeat(kv: torch.Tensor, q: torch.Tensor, gqa: bool) -> torch.Tensor:
    """K or V (B, KVH, S, D) repeated to q's heads (B, H, ., D): HF's repeat_kv."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], 1) if gqa and q.shape[1] != kv.shape[1] else kv
