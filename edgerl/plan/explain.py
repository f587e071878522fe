"""The README's "why these decisions" table, produced by the same `plan()` that makes them.

`tests/test_readme_on_cpu.py` checks that the README holds exactly this text, so the
documentation cannot drift from the code.
"""

from __future__ import annotations

from edgerl.device.device import GiB, Software
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import PlanError, Task, plan
from edgerl.device.profiles import device_from_profile, list_profiles

# A fixed software stack, so the table does not depend on what the machine that prints it has.
REFERENCE_SOFTWARE = Software(python="3.11", torch="2.7.1", torch_cuda="12.6",
                              libs=(("torch", "2.7.1"), ("triton", "3.3.1"), ("transformers", "4.55.0")))
REFERENCE_MODEL = "qwen2.5-0.5b"
REFERENCE_TASK = Task(prompt_len=256, response_len=512, prompts_per_step=8, samples_per_prompt=8, algo="grpo",
                      kl=True, lora=None)
HOST_RAM = 64 * GiB


def decision_table() -> str:
    """Markdown: one row per profile with the dtype, attention, kernel and memory decisions."""
    m = CATALOGUE[REFERENCE_MODEL]
    lines = [f"Plans for {REFERENCE_MODEL} GRPO, {REFERENCE_TASK.effective_batch()}, prompt "
             f"{REFERENCE_TASK.prompt_len} + response {REFERENCE_TASK.response_len} tokens, torch 2.7 cu126 with "
             "triton, no flash-attn or vLLM installed, 64 GiB host RAM "
             "(`python -m edgerl.plan.explain` prints this table):", "",
             "| GPU | dtype | attention | log-prob kernel | memory fit | why (dtype) |",
             "|---|---|---|---|---|---|"]
    for prof in list_profiles():
        dev = device_from_profile(prof, REFERENCE_SOFTWARE, HOST_RAM)
        try:
            p = plan(dev, m, REFERENCE_TASK)
        except PlanError as e:
            lines.append(f"| {prof.name} | - | - | - | does not fit: {str(e).splitlines()[0][:60]} | |")
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
        lines.append(f"| {prof.name} | {p.dtype.name} | {p.attention} | {p.kernel_backend} | {', '.join(fit)} | "
                     f"{p.reasons['dtype']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(decision_table())
