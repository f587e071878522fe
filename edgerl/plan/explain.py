"""Tables for the documentation, produced by the same `plan()` that makes the decisions.

`fits_table()` is README's "what fits where"; `decision_table()` is docs/guide.md's "Why these decisions".
`tests/test_readme_on_cpu.py` checks that each document holds exactly this text, so the documentation
cannot drift from the code. `python -m edgerl.plan.explain [fits|decisions]` prints them.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from edgerl.device.device import GiB, Software
from edgerl.device.profiles import device_from_profile, get_profile, list_profiles
from edgerl.device.wheels import BUILDS
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import PlanError, Task, plan

# A fixed software stack, so the tables do not depend on what the machine that prints them has: the torch that
# scripts/setup.sh installs, from the cu126 index, whose wheels carry code for every card in the tables
# (Maxwell to Hopper), with triton, peft and bitsandbytes (the NF4 base); no flash-attn, no vLLM. The other
# versions are those setup installed with it when this was written; the plan reads only which are present.
REFERENCE_TORCH = "2.13.0"
_CU126 = next(b for b in BUILDS if b.tag == "cu126")
REFERENCE_SOFTWARE = Software(python="3.11", torch=REFERENCE_TORCH, torch_cuda="12.6", arch_list=_CU126.archs,
                              libs=(("torch", REFERENCE_TORCH), ("triton", "3.9.0"), ("transformers", "5.24.0"),
                                    ("peft", "0.21.2"), ("bitsandbytes", "0.50.2")))
REFERENCE_TASK = Task(prompt_len=256, response_len=512, prompts_per_step=8, samples_per_prompt=8, algo="grpo",
                      kl=True, lora=False)
HOST_RAM = 64 * GiB
SOFTWARE_NOTE = (f"torch {REFERENCE_TORCH[:4]} cu126 with triton, peft and bitsandbytes, no flash-attn or vLLM, "
                 f"{HOST_RAM // GiB} GiB host RAM")

# The cards people train on second hand or in free tiers, and a few current ones for contrast.
FITS_CARDS = ("m40", "p40", "p100", "gtx1080ti", "gtx1660super", "t4", "rtx2080ti", "v100-16gb", "v100-32gb",
              "rtx3090", "rtx4090", "l4", "a100-80gb")
# (catalogue model, LoRA): full fine-tuning of the small ones, LoRA (on a 16-bit or NF4 base) of the large ones.
FITS_RUNS = (("qwen2.5-0.5b", False), ("qwen2.5-1.5b", False), ("llama-3.2-3b", False), ("qwen2.5-7b", True),
             ("llama-3.1-8b", True))


def _cell(p) -> str:
    parts = [f"{p.base_dtype} base"] if p.lora else []
    parts.append(f"mb {p.micro_batch}")
    parts += [label for on, label in ((p.grad_checkpointing, "ckpt"), (p.swap_models, "swap"),
                                      (p.optimizer_offload or p.param_offload, "offload")) if on]
    parts.append(f"{p.memory.total / GiB:.1f} GiB")
    return ", ".join(parts)


def fits_table() -> str:
    """Markdown: per card, what the plan does with each model (or that nothing fits)."""
    head = " | ".join(f"{m} {'LoRA' if lora else 'full'}" for m, lora in FITS_RUNS)
    lines = [f"GRPO, {REFERENCE_TASK.effective_batch()}, prompt {REFERENCE_TASK.prompt_len} + response "
             f"{REFERENCE_TASK.response_len} tokens; {SOFTWARE_NOTE} (`python -m edgerl.plan.explain fits` prints "
             "this table):", "",
             f"| GPU | memory | compute | {head} |",
             "|---|---|---|" + "---|" * len(FITS_RUNS)]
    for name in FITS_CARDS:
        prof = get_profile(name)
        dev = device_from_profile(prof, REFERENCE_SOFTWARE, HOST_RAM)
        cells, compute = [], "-"
        for model, lora in FITS_RUNS:
            try:
                p = plan(dev, CATALOGUE[model], replace(REFERENCE_TASK, lora=lora))
            except PlanError:
                cells.append("does not fit")
                continue
            compute = p.dtype.compute
            cells.append(_cell(p))
        lines.append(f"| {prof.display} | {dev.total_memory / GiB:.1f} GiB | {compute} | {' | '.join(cells)} |")
    return "\n".join(lines)


def decision_table() -> str:
    """Markdown: one row per profile with the dtype, attention, kernel, rollout correction and memory decisions."""
    model = "qwen2.5-0.5b"
    m = CATALOGUE[model]
    task = replace(REFERENCE_TASK, lora=None)   # LoRA only where full fine-tuning cannot fit
    lines = [f"Plans for {model} GRPO, {task.effective_batch()}, prompt {task.prompt_len} + response "
             f"{task.response_len} tokens, LoRA only where full fine-tuning does not fit; {SOFTWARE_NOTE} "
             "(`python -m edgerl.plan.explain decisions` prints this table):", "",
             "| GPU | dtype | attention | log-prob kernel | rollout correction | memory fit | why (dtype) |",
             "|---|---|---|---|---|---|---|"]
    for prof in list_profiles():
        dev = device_from_profile(prof, REFERENCE_SOFTWARE, HOST_RAM)
        try:
            p = plan(dev, m, task)
        except PlanError as e:
            lines.append(f"| {prof.name} | - | - | - | - | does not fit: {str(e).splitlines()[0][:60]} | |")
            continue
        fit = [f"micro-batch {p.micro_batch}"]
        if p.grad_checkpointing:
            fit.append("checkpointing")
        if p.swap_models:
            fit.append("swap models")
        if p.optimizer_offload:
            fit.append("optimizer offload")
        if p.param_offload:
            fit.append("param offload")
        if p.lora:
            fit.append(f"LoRA r={p.lora['rank']}")
        fit.append(f"{p.memory.total / GiB:.1f}/{p.memory.budget / GiB:.1f} GiB")
        lines.append(f"| {prof.name} | {p.dtype.name} | {p.attention} | {p.kernel_backend} | {p.rollout_correction} | "
                     f"{', '.join(fit)} | {p.reasons['dtype']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "fits"
    if which not in ("fits", "decisions"):
        print("usage: python -m edgerl.plan.explain [fits|decisions]", file=sys.stderr)
        sys.exit(2)
    print(fits_table() if which == "fits" else decision_table())
