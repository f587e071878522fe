"""Which of edgerl's kernels a plan launches, and each checked against its torch reference on this device.

`plan_kernels(plan)` is the one place that maps the plan's decisions to the kernels a run launches and
to the setting that runs without each. `check_kernels` compiles and checks each of them at the plan's
dtype and the model's widths (`edgerl doctor --selftest`); `check_at_start` runs the same checks on small
inputs at the start of every `edgerl train` (well under a second once the kernels are compiled, which the
run needs anyway) and stops the run before its first step, with one line naming the kernel and the
setting, when one disagrees with its reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

from edgerl.core.errors import TrainingError
from edgerl.device.measure import strict_fp32
from edgerl.doctor.verdict import Verdict, within
from edgerl.plan.plan import Plan


@dataclass(frozen=True)
class KernelUse:
    key: str        # its check in kernel_refs.CHECKS
    label: str      # the kernel, as the user reads it
    avoid: str      # the setting that runs without it ('' when none does)
    where: str      # what runs on it
    cuda: bool      # needs a CUDA GPU (NVRTC); else Triton, which also runs in its CPU interpreter
    triton: bool = False


KERNELS = {
    "logprobs-torch": KernelUse("logprobs", "chunked log-probs and entropy (torch)", "",
                                "every forward's log-probs, scoring and the update", cuda=False),
    "logprobs-triton": KernelUse("logprobs", "fused log-prob and entropy kernel (Triton)", "plan.kernel_backend=torch",
                                 "every forward's log-probs, scoring and the update", cuda=False, triton=True),
    "decode-cuda": KernelUse("decode-cuda", "decode-layer kernels (CUDA C, NVRTC)", "plan.decode_backend=torch",
                             "the rollout's decode step", cuda=True),
    "decode-attention": KernelUse("decode-attention", "decode-attention kernel (Triton)", "plan.decode_backend=torch",
                                  "the rollout's decode step", cuda=False, triton=True),
    "decode-attention-rope": KernelUse("decode-attention-rope", "rotary decode-attention kernel (Triton)",
                                       "plan.decode_backend=torch", "the rollout's decode step", cuda=False,
                                       triton=True),
    "decode-linear": KernelUse("decode-linear", "decode-layer projections (Triton)",
                               "plan.decode_backend=triton-attention",
                               "the rollout's decode step", cuda=False, triton=True),
    "nf4": KernelUse("nf4", "NF4 decode matmul and LoRA adapter sum (CUDA C, NVRTC)", "plan.decode_backend=torch",
                     "the rollout's decode step over the 4-bit base", cuda=True),
    "adamw-bf16": KernelUse("adamw-bf16", "fused bf16 AdamW step (Triton)", "plan.kernel_backend=torch",
                            "the optimizer step", cuda=False, triton=True),
}


def plan_kernels(plan: Plan) -> list[str]:
    """The names (in KERNELS) of the kernels a run with this plan launches: the one mapping from the plan's
    decisions to edgerl's kernels (the trainer's own choices: models/load.py, rollout/__init__.py,
    train/trainer.py)."""
    out = ["logprobs-triton" if plan.kernel_backend == "triton" else "logprobs-torch"]
    backend = plan.decode_backend if plan.rollout_engine == "static" and plan.device.is_cuda else None
    if backend == "cuda-c":
        out.append("decode-cuda")
        if plan.base_dtype == "nf4":   # the cuda-c backend multiplies by an NF4 base through its fused kernel
            out.append("nf4")
    elif backend in ("triton-attention", "triton-layers"):
        out.append("decode-attention-rope")
        if backend == "triton-layers":
            out.append("decode-linear")
    if plan.optimizer.startswith("adamw-bf16") and plan.kernel_backend == "triton" and plan.device.is_cuda:
        out.append("adamw-bf16")   # the trainer's AdamWBF16(fused=...) follows the kernel backend on a GPU
    return out


def widths(plan: Plan, quick: bool):
    """The inputs' shapes: the model's widths (hidden, heads, head size, MLP) with a vocabulary slice and a
    short cache; at the start of training (`quick`) a few rows and one weight of each kind."""
    from edgerl.doctor.kernel_refs import Widths
    from edgerl.kernels import Tiles
    from edgerl.plan.dtypes import torch_dtype
    m = plan.model
    rows = max(1, min(plan.rollout_batch, 16 if quick else 32))
    vocab = 1024 if quick else 16384 if plan.device.is_cuda else 4096   # fp64 references: a CPU is slower
    return Widths(dtype=torch_dtype(plan.dtype.compute), hidden=m.hidden_size,
                  vocab=min(m.vocab_size, vocab), heads=m.num_heads, kv_heads=m.num_kv_heads,
                  head_dim=m.hd, intermediate=m.intermediate_size, qkv_bias=m.qkv_bias, rows=rows,
                  cache=64 if quick else 320, tokens=40 if quick else 256, chunk=16 if quick else 64,
                  lora_rank=(plan.lora or {}).get("rank", 8), params=4097 if quick else (1 << 20) + 17,
                  backend=plan.kernel_backend, tiles=Tiles(**plan.kernel_tiles) if plan.kernel_tiles else None,
                  full=not quick)


def skip_reason(use: KernelUse, device) -> Optional[str]:
    """Why the kernel cannot be checked on this torch device (None: it can)."""
    if device.type == "cuda":
        return None
    if use.cuda:
        return "needs a CUDA GPU (compiled with NVRTC for it)"
    if use.triton and not _interpreted(use.key):
        return "needs a GPU (Triton), or TRITON_INTERPRET=1 to run in Triton's CPU interpreter"
    return None


def _interpreted(key: str) -> bool:
    import importlib
    mod = {"logprobs": "edgerl.kernels.triton_impl", "decode-attention": "edgerl.kernels.decode_attention",
           "decode-attention-rope": "edgerl.kernels.decode_attention", "decode-linear": "edgerl.kernels.decode_linear",
           "adamw-bf16": "edgerl.kernels.adamw"}[key]
    try:
        m = importlib.import_module(mod)
        return bool((m.kernels_module() if hasattr(m, "kernels_module") else m.kernel_module()).INTERPRETED)
    except ImportError:
        return False


def check_one(name: str, plan: Plan, device, quick: bool = False) -> Verdict:
    """Kernel `name` (of KERNELS) against its reference at the plan's dtype and the model's widths."""
    from edgerl.doctor import kernel_refs
    use = KERNELS[name]
    why = skip_reason(use, device)
    if why:
        return Verdict(use.label, "skip", why, avoid=use.avoid)
    w = widths(plan, quick)
    if name.startswith("logprobs"):   # the named path, whichever the plan chose
        w = replace(w, backend=name.split("-")[1], tiles=w.tiles if name == "logprobs-triton" else None)
    if use.triton and device.type != "cuda":   # Triton's interpreter runs a program at a time: small widths
        w = replace(w, hidden=64, vocab=200, heads=4, kv_heads=2, head_dim=16, intermediate=96, rows=3, cache=40,
                    tokens=24, chunk=8, params=4097, tiles=None)
    t0 = time.perf_counter()
    import torch
    # IEEE fp32 matmuls for the check, also where a script allowed TF32: a kernel is checked for its logic;
    # TF32's 10-bit mantissa would fail fp32 tolerances on Ampere and newer (the plan's fp32 cards have none)
    with strict_fp32(torch):
        parts, error = kernel_refs.run(use.key, w, device)
    took = time.perf_counter() - t0
    shape = w.describe(use.key)
    if error:
        return Verdict(use.label, "fail", f"it cannot run here ({shape}): {error}", avoid=use.avoid, seconds=took)
    figures = {p.what: {"error": p.err, "tolerance": p.tol} for p in parts}
    bad = [p for p in parts if not within(p.err, p.tol)]
    worst = max(parts, key=lambda p: p.err / p.tol if p.tol else (0 if p.err == 0 else float("inf")))
    if bad:
        p = bad[0]
        return Verdict(use.label, "fail", f"{p.what} differs from its reference ({shape}): error {p.err:.3g} > "
                       f"tolerance {p.tol:.3g}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
                       figures, use.avoid, took)
    return Verdict(use.label, "pass", f"{len(parts)} outputs within tolerance ({shape}; nearest its bound: {worst.what} "
                   f"{worst.err:.2g} of {worst.tol:.2g})", figures, use.avoid, took)


def check_kernels(plan: Plan, device, quick: bool = False) -> list[Verdict]:
    """Every kernel of KERNELS: those the plan launches checked (or skipped with the reason), the others
    skipped as not launched, except Triton kernels that Triton's CPU interpreter runs (TRITON_INTERPRET=1),
    which are checked too."""
    used = plan_kernels(plan)
    out = [check_one(n, plan, device, quick) for n in used]
    for name, use in KERNELS.items():
        if name in used:
            continue
        if use.triton and device.type != "cuda" and _interpreted(use.key):
            v = check_one(name, plan, device, quick=True)
            v.detail = f"not launched by this plan; in Triton's CPU interpreter: {v.detail}"
            out.append(v)
        else:
            out.append(Verdict(use.label, "skip", "this plan does not launch it", avoid=use.avoid))
    return out


def check_at_start(plan: Plan, device) -> None:
    """The plan's kernels on small inputs before the first step; TrainingError naming the first that
    disagrees with its reference (or cannot run) and the setting that runs without it. Never a fallback."""
    for name in plan_kernels(plan):
        v = check_one(name, plan, device, quick=True)
        if v.status == "fail":
            avoid = f"; set {v.avoid} to run without it" if v.avoid else "; no setting runs without it"
            raise TrainingError(f"kernel check: the {v.name} is wrong on this device: {v.detail}{avoid}, and "
                                "please report it (edgerl doctor --selftest --json)")
