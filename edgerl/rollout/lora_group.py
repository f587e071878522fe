"""A decoder layer's LoRA layers that read the same input (q, k and v; gate and up) as one product in a decode step.

Under LoRA the static decoder calls each projection as its peft module (`rollout.projections.ModuleProjections`),
so a decode step multiplies q, k and v (and gate and up) apart: seven products a layer, each with its sum kernel,
where full fine-tuning runs four (`FusedProjections`). At a decode step's few rows the small ones (k and v, a
quarter of q or less) are bound by their latency more than by their bytes. A `LoraGroup` stacks a group's frozen
base weights into one (each layer's weight becomes a view of its rows, as `FusedProjections` does: one copy) and
their adapters into one A (the ranks one after another) and one B (each adapter's rows with its weight's), and the
few-row kernels (`edgerl.kernels.nf4` over an NF4 base, `edgerl.kernels.fp32_mm` over an fp32 one) compute the
group's outputs in one call: the products and the adapters' terms as each layer's own call computes them, each
output column taking its own layer's adapter (`nf4.lora_bounds`). An NF4 base stacks its 4-bit codes, its 8-bit
block scales and their fp32 scales as views too; the nested scales' offset, one per weight, becomes an offset per
nested block of the stacked weight.

The adapters train, so `sync()` copies each A and B into the group's own (which stay where they are: a captured
CUDA graph stays valid) before every rollout (`StaticDecoder.check_weights`). A call the kernels do not take (the
prefill's rows, gradients, an adapter peft would not add plainly: `quant_decode.plain_adapter`) returns None, and
the caller calls the modules themselves.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn

from edgerl.kernels import fp32_mm, nf4
from edgerl.models.quant_decode import active_adapter, lora_variant, plain_adapter

from .projections import _fuse, _views_of


def _nf4(layer: nn.Module) -> bool:
    return getattr(getattr(layer.base_layer, "weight", None), "quant_state", None) is not None


def groupable(layers: list[nn.Module]) -> str:
    """'' where `LoraGroup(layers)` can stack these peft LoRA layers and a decode step's call can take the kernels,
    else why not: bases of one kind routed to the few-row kernels (an NF4 `DecodeLinear4bit` of
    `quant_decode.enable`, or an fp32 `nn.Linear` routed to `fp32_mm.linear`), the same input width, dtype and
    device, a bias on all or none; one active adapter each, plain LoRA in fp32, of one rank and scale; three layers at
    most. (Each call checks the adapters again: `quant_decode.plain_adapter`.)"""
    if not 2 <= len(layers) <= 3:
        return f"{len(layers)} layers (a group stacks 2 or 3)"
    if not all(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in layers):
        return "not every layer is a peft LoRA layer"
    bases = [m.base_layer for m in layers]
    kinds = {type(b).__name__ for b in bases}
    if kinds == {"DecodeLinear4bit"}:
        states = [b.weight.quant_state for b in bases]
        why = next((w for b, st in zip(bases, states) if (w := nf4.weight_unsupported(b.weight.data, st))), "")
        if why:
            return why
        if not all(st.nested for st in states):
            return "a base's block scales are not nested (double quantization)"
        if len({(st.blocksize, st.state2.blocksize, st.shape[1], b.weight.device, b.compute_dtype, b.decode_rows)
                for b, st in zip(bases, states)}) > 1:
            return "the bases differ in block size, input width, device or compute dtype"
        first = states[0]
        if any(not torch.equal(st.code, first.code) or not torch.equal(st.state2.code, first.state2.code)
               for st in states[1:]):
            return "the bases' code tables differ"
        if any(st.absmax.numel() % st.state2.blocksize for st in states):
            return "a base's block scales do not fill whole nested blocks"
    elif kinds == {"MatmulLinear"}:
        if any(b.mm is not fp32_mm.linear for b in bases):
            return "the fp32 bases are not routed to the few-row kernel"
        if len({(b.weight.dtype, b.weight.device, b.in_features) for b in bases}) > 1:
            return "the bases differ in dtype, device or input width"
        if any(b.weight.requires_grad for b in bases):
            return "a base weight trains"
    else:
        return f"the bases are {sorted(kinds)}, not all NF4 layers or fp32 layers routed to the few-row kernels"
    if len({b.bias is None for b in bases}) > 1:
        return "only some of the bases have a bias"
    names = [active_adapter(m) for m in layers]
    for m, a in zip(layers, names):   # what a call checks again (`plain_adapter`: dropout while training, adapters off)
        if a is None:
            return "a layer has no single active adapter"
        if lora_variant(m, a):
            return "an adapter is a variant of LoRA (DoRA or another), which peft adds its own way"
        if m.lora_A[a].weight.dtype != torch.float32 or m.lora_B[a].weight.dtype != torch.float32:
            return f"an adapter is {m.lora_A[a].weight.dtype}, not fp32"
    shapes = {(m.lora_A[a].weight.shape[0], float(m.scaling[a])) for m, a in zip(layers, names)}
    if len(shapes) > 1:
        return "the adapters differ in rank or scale"
    rank = next(iter(shapes))[0]
    if rank * len(layers) > min(nf4.MAX_RANK, fp32_mm.MAX_RANK):
        return f"{len(layers)} adapters of rank {rank} pass the kernels' {nf4.MAX_RANK} rows of A"
    return ""


class LoraGroup:
    """Two or three peft LoRA layers over one input as one product in a decode step (see the module's docstring)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        why = groupable(layers)
        if why:
            raise ValueError(f"cannot stack these LoRA layers: {why}")
        self.layers = layers
        self.bases = [m.base_layer for m in layers]
        self.nf4 = _nf4(layers[0])
        self.widths = [b.out_features for b in self.bases]
        self.n = sum(self.widths)
        self.bounds = tuple(sum(self.widths[:i]) for i in range(1, len(self.widths)))
        name = active_adapter(layers[0])
        a0 = layers[0].lora_A[name].weight
        self.rank = a0.shape[0]
        self.scale = float(layers[0].scaling[name])
        dev = a0.device
        with torch.no_grad():
            self._restack()
            self.a = torch.zeros((self.rank * len(layers), a0.shape[1]), dtype=torch.float32, device=dev)
            self.b = torch.zeros((self.n, self.rank), dtype=torch.float32, device=dev)
        self.sync()

    # ---- the stacked base ----------------------------------------------------------------------------------------

    def _parts(self) -> list[list[torch.Tensor]]:
        if self.nf4:
            st = [b.weight.quant_state for b in self.bases]
            return [[b.weight for b in self.bases], [s.absmax for s in st], [s.state2.absmax for s in st]]
        return [[b.weight for b in self.bases]]

    def _restack(self) -> None:
        stacked = [_fuse(p) for p in self._parts()]   # each part a view of its rows
        biases = [b.bias for b in self.bases]
        self.bias = _fuse(biases) if biases[0] is not None else None
        if self.nf4:
            self.weight, qabs, abs2 = stacked
            states = [b.weight.quant_state for b in self.bases]
            first = states[0]
            offsets = torch.cat([s.offset.float().reshape(1).expand(s.state2.absmax.numel()) for s in states])
            # what nf4_matmul reads of a QuantState, for the stacked weight
            self.state = SimpleNamespace(
                quant_type="nf4", shape=torch.Size((self.n, first.shape[1])), blocksize=first.blocksize,
                nested=True, absmax=qabs, offset=None, block_offsets=offsets.contiguous(), code=first.code,
                dtype=first.dtype, state2=SimpleNamespace(absmax=abs2, code=first.state2.code,
                                                          blocksize=first.state2.blocksize))
        else:
            self.weight = stacked[0]
            self.state = None

    def intact(self) -> bool:
        """Whether every base tensor is still a view of the stacked one (`model.to(...)` or a new `.data` would
        leave the stacked copy stale)."""
        whole = [self.weight] + ([self.state.absmax, self.state.state2.absmax] if self.nf4 else [])
        return (all(_views_of(p, w) for p, w in zip(self._parts(), whole))
                and (self.bias is None or _views_of([b.bias for b in self.bases], self.bias)))

    @torch.no_grad()
    def refuse(self) -> None:
        """Stack the bases again from their current tensors (after `intact()` turned False)."""
        self._restack()

    def tensors(self) -> list[torch.Tensor]:
        out = [self.weight, self.a, self.b] + ([self.bias] if self.bias is not None else [])
        if self.nf4:
            out += [self.state.absmax, self.state.state2.absmax, self.state.block_offsets]
        return out

    # ---- the adapters --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self) -> None:
        """Copy each layer's A and B (their current values: they train) into the group's A and B."""
        r, at = self.rank, 0
        for i, m in enumerate(self.layers):
            name = active_adapter(m)
            a, b = m.lora_A[name].weight, m.lora_B[name].weight
            if hasattr(a, "full_tensor"):   # FSDP2's shard outside a rollout
                a, b = a.full_tensor(), b.full_tensor()
            self.a[i * r:(i + 1) * r].copy_(a)
            self.b[at:at + self.widths[i]].copy_(b)
            at += self.widths[i]

    # ---- the call ------------------------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The group's outputs side by side (..., N1 + N2 (+ N3)), or None where the kernels do not take the call
        (the caller then calls the modules)."""
        base = self.bases[0]
        if self.nf4:
            if type(base).__name__ != "DecodeLinear4bit" or not base.takes(x):
                return None
        elif type(base).__name__ != "MatmulLinear" or base.mm is not fp32_mm.linear \
                or not fp32_mm.takes(x, self.weight, self.bias):
            return None
        if any(plain_adapter(m, nf4.MAX_RANK) is None for m in self.layers):
            return None
        lora = (self.a, self.b, self.scale, self.bounds)
        if self.nf4:
            bias = self.bias.to(x.dtype) if self.bias is not None and self.bias.dtype != x.dtype else self.bias
            return nf4.nf4_matmul(x, self.weight, self.state, bias, lora)
        return fp32_mm.fp32_matmul(x, self.weight, self.bias, lora=lora)
