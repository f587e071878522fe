"""Decode backend `cuda-c`: fp32 or fp16 decode layers through edgerl's CUDA C kernels (NVRTC), on any CUDA GPU.

Pascal has no Triton and no torch.compile, and in fp32 a decode layer of torch's ops is about 18 small
kernels besides its matmuls. `edgerl/kernels/decode_cuda.py` does that work in three per layer: the residual
add with the RMS norm, the rotary embedding with the cache write and attention over the columns each
row sees, and SiLU * up. Over an NF4 base (QLoRA) the projections' matmuls of up to `NF4_DECODE_ROWS`
rows also go through edgerl's fused NF4 kernel (`models/quant_decode.py`: it reads the 4-bit codes once,
where bitsandbytes writes and reads a dequantized fp32 copy of each weight): docs/benchmarks.md, fp32 decode
kernels and Fused NF4 decode kernel. In fp32 the fused projections' and the logits' matmuls of a few rows go through
edgerl's few-row kernel (`kernels/fp32_mm.py`: it streams the weights; cuBLAS's fp32 GEMM at 16 rows read them at
a fraction of the bandwidth): docs/benchmarks.md, fp32 decode matmuls.

The plan picks it for fp32 plans, and for fp16 plans where edgerl's Triton kernels cannot run (Volta and Turing,
below their CC 8.0), against torch's ops in the same CUDA graph and bitsandbytes' NF4 matmuls:
docs/benchmarks.md, fp16 decode kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgerl.kernels.tiles import NF4_DECODE_ROWS

from .decode_torch import Backend as TorchOps
from .decode_step import DecodeKernelUnavailable, LayerStep
from .decoder import StaticDecoder


def use_fp32_mm(dec: StaticDecoder) -> str:
    """The fused projections' and the logits' matmuls of `dec` through `fp32_mm.linear` (a decode step's few rows
    through the streaming kernel, the prefill's many rows through cuBLAS); compiles the kernel first (a one-line
    error). Returns the note."""
    from edgerl.kernels import fp32_mm
    from edgerl.kernels.nvrtc import KernelUnavailable
    try:
        for n in fp32_mm.decode_kernels(dec.max_batch):
            fp32_mm._kernel(n, dec.device)
    except (KernelUnavailable, RuntimeError, OSError) as e:
        raise DecodeKernelUnavailable(f"decode backend 'cuda-c' cannot run here: the fp32 decode matmul kernel: "
                                      f"{type(e).__name__}: {str(e).strip()[:400]}") from None
    fused, bases = set_matmul(dec, fp32_mm.linear)
    if fused:
        return "fp32 projections and logits through the few-row matmul kernel"
    return (f"the logits and the {bases} LoRA layers (their fp32 base matmuls and adapters) through the few-row "
            "matmul kernel" if bases else
            "the logits through the few-row matmul kernel (projections called as modules: cuBLAS)")


def set_matmul(dec: StaticDecoder, mm=None) -> tuple[int, int]:
    """The matmul of `dec`'s fused projections, of the plain fp32 base layers of its peft LoRA layers, and of its
    logits: `mm(x, weight, bias)`, or None for torch's own (F.linear; the modules' and lm_head's forward). Where
    `mm` is `fp32_mm.linear`, the LoRA layers' adapters are added in the same kernel (`route_lora`). Returns how
    many layers' projections are fused and how many LoRA layers' base layers take `mm`."""
    fused = [p for p in dec.proj if p.kind == "fused"]
    for p in fused:
        p.mm = mm or F.linear
    dec.head_mm = mm
    layers = [m for p in dec.proj if p.kind == "modules" for m in lora_layers(p)]
    for m in layers:
        route_linear(m.base_layer, mm)
        route_lora(m, mm)
    return len(fused), len(layers)


def lora_layers(proj) -> list[torch.nn.Module]:
    """The peft LoRA layers over a plain fp32 `nn.Linear` among a layer's module projections (`ModuleProjections`):
    the layers a LoRA plan over an fp32 base multiplies the most bytes in."""
    return [m for m in proj.modules() if hasattr(m, "lora_A")
            and type(getattr(m, "base_layer", None)) in (torch.nn.Linear, MatmulLinear)
            and m.base_layer.weight.dtype == torch.float32]


class MatmulLinear(torch.nn.Linear):
    """`nn.Linear` whose forward is `self.mm(x, weight, bias)` (fp32_mm.linear: a decode step's few rows through
    the streaming kernel, everything else, training included, through F.linear as before). The same module,
    weights and state dict: `route_linear` swaps the class, and back."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.mm(input, self.weight, self.bias)


def route_linear(m: torch.nn.Linear, mm=None) -> None:
    """`m`'s forward through `mm` (a MatmulLinear), or with None back to `nn.Linear`'s own."""
    if mm is None:
        if type(m) is MatmulLinear:
            m.__class__ = torch.nn.Linear
            del m.mm
    else:
        m.__class__ = MatmulLinear
        m.mm = mm


def route_lora(layer: torch.nn.Module, mm=None) -> None:
    """`layer` (peft's LoRA layer) as a `LoraMatmul` subclass of its own class where `mm` is set (a decode step's
    few rows take the base matmul and the adapter in one call of the few-row kernel), or back to its class."""
    from edgerl.models.quant_decode import adapter_class
    routed = type(layer).__name__ == "LoraMatmul"
    if mm is None and routed:
        layer.__class__ = type(layer).__mro__[1]
    elif mm is not None and not routed:
        layer.__class__ = adapter_class(type(layer), "LoraMatmul", _lora_matmul,
                                        "peft's LoRA layer over a plain fp32 base: a decode step's few rows take the "
                                        "base matmul and the adapter in the few-row kernel (decode_cuda_c)")


def _lora_matmul(layer: torch.nn.Module, x: torch.Tensor) -> "torch.Tensor | None":
    """The LoRA layer's output through one call of the few-row kernel, or None where peft's path must run: the
    base is not routed there, the rows are not a decode step's, or the adapter is not one the kernel adds
    (`plain_adapter`: a variant, dropout, or gradients to keep)."""
    from edgerl.kernels import fp32_mm
    from edgerl.models.quant_decode import plain_adapter
    base = layer.base_layer
    if type(base) is MatmulLinear and base.mm is fp32_mm.linear and fp32_mm.takes(x, base.weight, base.bias):
        ab = plain_adapter(layer, fp32_mm.MAX_RANK)
        if ab is not None:
            return fp32_mm.fp32_matmul(x, base.weight, base.bias, lora=ab)
    return None


def group_note(dec: StaticDecoder) -> str:
    """Stack each layer's LoRA q/k/v and gate/up into one product (`lora_group.LoraGroup`, set in the layer's
    `ModuleProjections.groups`) where the bases now go to the few-row kernels; the note says how many and, for the
    first group that could not be, why."""
    from .lora_group import LoraGroup, groupable
    mods = [p for p in dec.proj if p.kind == "modules" and any(hasattr(m, "lora_A") for m in p.modules())]
    if not mods:
        return ""
    why = []
    for p in mods:
        for key, layers in p.stackable().items():
            w = groupable(layers)
            if w:
                why.append(f"{key}: {w}")
            else:
                p.groups[key] = LoraGroup(layers)
    stacked = sum(len(p.groups) for p in mods)
    return (f"; LoRA q/k/v and gate/up stacked: {stacked} of {2 * len(mods)} groups"
            + (f" (not {why[0]})" if why else ""))


class Backend(TorchOps):
    name = "cuda-c"
    reads_span = False   # the whole cache: the kernel reads each row's visible columns only

    def __init__(self, dec: StaticDecoder) -> None:
        from edgerl.kernels import decode_cuda
        from edgerl.models.quant_decode import enable, nf4_layers
        super().__init__(dec)
        why = dec.fused_norms_reason() or decode_cuda.unavailable_reason(dec.device, dec.head_dim, dec.dtype, dec.group,
                                                                         dec.cache_dtype)
        if why:
            raise DecodeKernelUnavailable(f"decode backend 'cuda-c' cannot run here: {why}")
        self.kernels = decode_cuda
        self.cache_dtypes = decode_cuda.CACHE_TYPES   # the caches its attention reads under each compute dtype
        self.note = "CUDA C layer kernels"
        if dec.dtype == torch.float32:   # the projections' and the logits' few-row matmuls: fp32_mm's stream
            self.note += "; " + use_fp32_mm(dec)
        if nf4_layers(dec.model):   # compiles and checks the NF4 kernel first (a one-line error)
            n, left = enable(dec.model, NF4_DECODE_ROWS)
            self.note += f"; {n} NF4 layers through the fused kernel" + "".join(
                f"; {k} left to bitsandbytes: {why}" for why, k in left.items())
        self.note += group_note(dec)

    def hide(self, first: torch.Tensor, col: torch.Tensor, S: int) -> torch.Tensor:
        return first   # rope_attend reads only the columns first[b] .. col of each row (a window: its first column)

    def layer(self, x: torch.Tensor, d: torch.Tensor | None, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and norm in one kernel, q, k and v straight from their projections into the
        rotary + cache write + attention kernel, the second add and norm in one, SiLU * up in one. Qwen3's
        per-head q/k norms, where `step.norms` has them, run as torch's ops between the projections and the
        kernel; there are no post norms here (`StaticDecoder.fused_norms_reason`)."""
        k, B, dec, proj, n, kv = self.kernels, x.shape[0], self.dec, step.proj, step.norms, step.kv
        x, h = k.add_rms_norm(x, d, n.ln1, n.eps1)
        q, kk, v = proj.qkv_parts(h)
        if n.qk is not None:   # before the kernel rotates
            q = dec.norm(q.unflatten(-1, (dec.n_heads, dec.head_dim)), n.qk[0], n.qk[2]).flatten(-2)
            kk = dec.norm(kk.unflatten(-1, (dec.n_kv, dec.head_dim)), n.qk[1], n.qk[2]).flatten(-2)
        o = k.rope_attend(q, kk, v, step.cos.view(B, -1), step.sin.view(B, -1), kv[0], kv[1], step.hide, step.col,
                          dec.scaling, flag=dec.overflow)
        x, h = k.add_rms_norm(x, proj.o(o), n.ln2, n.eps2)
        gate, up = proj.gate_up(h)
        return x, proj.down(k.silu_mul(gate, up) if dec.silu else dec.act(gate) * up)
