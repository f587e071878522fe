"""The rollout's decode step over an NF4 base through one fused kernel (`edgerl.kernels.nf4`).

bitsandbytes' `Linear4bit` multiplies a few rows by dequantizing the whole weight to the compute dtype
and running a GEMM on the copy; for the rows of a decode step that is most of the step's time
(docs/benchmarks.md, Fused NF4 decode kernel). `enable(model, rows)` turns each NF4 `Linear4bit`
of the model into a `DecodeLinear4bit`, the same module (same weight, state dict and peft wrapping)
whose forward sends inputs of at most `rows` rows, outside autograd, to the fused kernel, and
everything else (training, scoring, prefill) to bitsandbytes as before. The kernel computes the same
fp32 products as bitsandbytes' fp32 path, summed in another order. The peft LoRA layer around each
such layer becomes a `DecodeLoraLinear4bit`, which in the same decode steps adds its adapter inside
the kernel (x A^T as more rows of the weight, scale (x A^T) B^T in the kernel's last sum).

The plan decides (decode backend `cuda-c` over an NF4 base: rollout/decode_cuda_c.py calls `enable`);
`enable` compiles the kernel for the device first, so a machine where NVRTC cannot build it fails at
the start of training with one line naming the setting, not in the middle of a rollout.
"""

from __future__ import annotations

import torch
from torch import nn

from edgerl.core.errors import TrainingError

_classes: dict[type, type] = {}


def _decode_class(base: type) -> type:
    """A subclass of bitsandbytes' Linear4bit (cached) whose forward takes the fused kernel for few rows."""
    cls = _classes.get(base)
    if cls is not None:
        return cls
    from edgerl.kernels.nf4 import input_unsupported, nf4_matmul

    def takes(self, x: torch.Tensor) -> bool:
        # the weight's side was checked by `enable` (and nf4_matmul checks both again)
        state = getattr(self.weight, "quant_state", None)
        rows = x.numel() // max(x.shape[-1], 1)
        return not (state is None or rows > self.decode_rows or (torch.is_grad_enabled() and x.requires_grad)
                    or (self.compute_dtype is not None and x.dtype != self.compute_dtype)
                    or input_unsupported(x))

    def fused(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return nf4_matmul(x, self.weight.data, self.weight.quant_state, bias, lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(self, x) if takes(self, x) else base.forward(self, x)

    cls = _classes[base] = type("DecodeLinear4bit", (base,), {
        "forward": forward, "takes": takes, "fused": fused,
        "__doc__": "bitsandbytes' Linear4bit; a few rows outside autograd take the fused NF4 kernel "
                   "(edgerl.models.quant_decode)"})
    return cls


def _lora_class(wrapper: type) -> type:
    """A subclass of peft's LoRA layer over a 4-bit base (cached) whose forward, when its base takes the
    kernel and one plain LoRA adapter is active, computes the adapter inside the kernel: x A^T with the
    weight's own rows, scale (x A^T) B^T in its last sum, where peft runs six more kernels (A, B, a clone
    of the base output, the scale, the add, a cast) on each projection of each layer. (x A^T as a cuBLAS
    matmul of its own cost more: docs/lab-log.md, 2026-12-01, NF4 kernel versions.)"""
    from edgerl.kernels.nf4 import MAX_RANK

    def fast(self, x: torch.Tensor) -> "torch.Tensor | None":
        base = self.base_layer
        if type(base).__name__ == "DecodeLinear4bit" and base.takes(x):
            ab = plain_adapter(self, MAX_RANK)
            if ab is not None:
                return base.fused(x, ab)
        return None

    return adapter_class(wrapper, "DecodeLoraLinear4bit", fast,
                         "peft's LoRA layer over a 4-bit base; a decode step adds the adapter inside the fused NF4 "
                         "kernel (edgerl.models.quant_decode)")


_adapter_classes: dict[tuple[type, str], type] = {}


def adapter_class(wrapper: type, name: str, fast, doc: str) -> type:
    """A subclass `name` of peft's LoRA layer class `wrapper` (cached) whose forward returns `fast(self, x)`
    where that gives a tensor (a kernel that adds the adapter in the base layer's call), else peft's own
    forward; a call with more arguments than x always takes peft's. `type(m).__mro__[1]` is peft's class again."""
    cls = _adapter_classes.get((wrapper, name))
    if cls is None:
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if not args and not kwargs:
                y = fast(self, x)
                if y is not None:
                    return y
            return wrapper.forward(self, x, *args, **kwargs)
        cls = _adapter_classes[(wrapper, name)] = type(name, (wrapper,), {"forward": forward, "__doc__": doc})
    return cls


def active_adapter(layer: nn.Module) -> "str | None":
    """The name of a peft LoRA layer's one active adapter, or None (none, or several)."""
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    return names[0] if len(names) == 1 else None


def lora_variant(layer: nn.Module, name: str) -> bool:
    """Whether adapter `name` of a peft LoRA layer is a variant of LoRA (DoRA or another), which peft adds its own
    way."""
    return name in getattr(layer, "lora_variant", {}) or bool(getattr(layer, "use_dora", {}).get(name, False))


def plain_adapter(layer: nn.Module, max_rank: int) -> "tuple[torch.Tensor, torch.Tensor, float] | None":
    """(A, B, scale) of a peft LoRA layer's one active adapter where a kernel can add it as peft would (plain LoRA:
    no DoRA or other variant, no dropout acting, fp32 A and B, rank <= max_rank, no gradient to keep), else None
    (peft's own path)."""
    if layer.disable_adapters or layer.merged:
        return None
    a = active_adapter(layer)
    if a is None or lora_variant(layer, a):   # DoRA and the rest: peft's own path
        return None
    drop = layer.lora_dropout[a]
    if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0:
        return None
    A, B = layer.lora_A[a].weight, layer.lora_B[a].weight
    if A.dtype != torch.float32 or B.dtype != torch.float32 or A.shape[0] > max_rank:
        return None
    if torch.is_grad_enabled() and (A.requires_grad or B.requires_grad):   # training: the adapter's gradients
        return None
    return A, B, layer.scaling[a]


def nf4_layers(model: nn.Module) -> list[nn.Module]:
    import sys
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)
            and getattr(getattr(m.weight, "quant_state", None), "quant_type", "nf4") == "nf4"]


def check_kernel(device: torch.device) -> None:
    """Compile and run the kernel once on `device` against its reference; TrainingError if it cannot. The
    reference's matmuls run in IEEE fp32 even where the process allows TF32 (whose 10-bit mantissa alone
    exceeds the bound on Ampere and newer)."""
    from edgerl.device.measure import strict_fp32
    with strict_fp32(torch):
        _compare_with_reference(device)


def _compare_with_reference(device: torch.device) -> None:
    from edgerl.kernels.nf4 import KernelUnavailable, nf4_matmul, reference, tensor_cores
    import bitsandbytes as bnb
    # fp16 plans multiply on tensor cores here (nf4_mma): checked too
    fp16 = device.type == "cuda" and tensor_cores(torch.float16, torch.cuda.get_device_capability(device))
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(40, 256, generator=g).to(device)
        packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        x = torch.randn(3, 256, generator=g).to(device)
        a, b = torch.randn(4, 256, generator=g).to(device), torch.randn(40, 4, generator=g).to(device)
        got, want = nf4_matmul(x, packed, state), reference(x, packed, state)
        got_l, want_l = nf4_matmul(x, packed, state, lora=(a, b, 0.5)), reference(x, packed, state, lora=(a, b, 0.5))
        if fp16:
            # fp16 plans multiply on tensor cores (the code table in fp16): within the output's rounding
            h = x.half()
            got_h, want_h = nf4_matmul(h, packed, state, lora=(a, b, 0.5)).float(), \
                reference(h, packed, state, lora=(a, b, 0.5), fp16_codes=True).float()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        raise
    except (KernelUnavailable, RuntimeError, OSError) as e:   # no NVRTC, an arch it cannot build, a failed launch
        raise TrainingError(f"the plan decodes through the fused NF4 kernel, which cannot run here: "
                            f"{type(e).__name__}: {str(e).strip()[:400]} (set plan.decode_backend=torch to use "
                            "bitsandbytes' own matmul)") from None
    err = max((got - want).abs().max().item(), (got_l - want_l).abs().max().item())
    ok = err <= 1e-4 * max(want.abs().max().item(), want_l.abs().max().item(), 1.0)
    if fp16:
        err_h = (got_h - want_h).abs().max().item()
        ok = ok and err_h <= 2e-3 * max(want_h.abs().max().item(), 1.0)
        err = max(err, err_h)
    if not ok:
        raise TrainingError(f"the fused NF4 kernel disagrees with its reference on "
                            f"{torch.cuda.get_device_name(device)} (max error {err:.3g}); set plan.decode_backend=torch "
                            "and report this GPU")


def enable(model: nn.Module, rows: int) -> tuple[int, dict[str, int]]:
    """Route decode steps of at most `rows` rows of every NF4 layer of `model` on a CUDA device to the
    fused kernel. Checks the kernel on their device first (`check_kernel`). Returns how many layers it
    took and, for the layers it left to bitsandbytes, how many for each reason."""
    from edgerl.kernels.nf4 import weight_unsupported
    layers = nf4_layers(model)
    left: dict[str, int] = {}
    on = []
    for m in layers:
        why = "not on a CUDA device" if m.weight.device.type != "cuda" else \
            weight_unsupported(m.weight.data, m.weight.quant_state)
        if why:
            left[why] = left.get(why, 0) + 1
        else:
            on.append(m)
    for d in {m.weight.device for m in on}:
        check_kernel(d)
    for m in on:
        if type(m).__name__ != "DecodeLinear4bit":
            m.__class__ = _decode_class(type(m))
        m.decode_rows = rows
    taken = {id(m) for m in on}
    for w in model.modules():   # peft's LoRA layers around them
        if id(getattr(w, "base_layer", None)) in taken and hasattr(w, "lora_A") \
                and type(w).__name__ != "DecodeLoraLinear4bit":
            w.__class__ = _lora_class(type(w))
    return len(on), left


def disable(model: nn.Module) -> None:
    """Back to bitsandbytes' and peft's own forward for every layer `enable` changed."""
    for m in model.modules():
        if type(m).__name__ in ("DecodeLinear4bit", "DecodeLoraLinear4bit"):
            m.__class__ = type(m).__mro__[1]
