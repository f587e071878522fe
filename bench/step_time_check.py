"""The step time estimate (edgerl/plan/timing.py) against the steps measured on an H100 and an H200, each run alone
on its GPU (docs/benchmarks.md, Step time estimate, where this table is printed):

    python bench/step_time_check.py          # the markdown table

Each row is a benchmark row as it ran: the card whose plan it made (its memory as the allocator's cap), the random-
weight widths (SmolLM2's vocabulary, llama layers), 2 prompts x 8 samples of exactly N new tokens (EOS ignored)
after prompts of at most 64 tokens, GRPO with the reference KL; the estimate takes the plan that card gets today
and the rates of the GPU that ran it (TF32 where the benchmark turned it on). No GPU is needed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

# row: (GPU that ran it, the card's plan, memory cap in GiB or None, widths, new tokens, "nf4" / None, TF32 on,
#       measured seconds (rollout, scoring, update), where: docs/benchmarks.md's table and call)
ROWS: dict[str, tuple[Any, ...]] = {
    "1.7B bf16 at TRL's memory": ("h200", "h200", 18.46, "1.7b", 256, None, False, (0.45, 0.11, 0.26),
                                  "Against TRL: 362M and 1.7B; 2026-12-02, ba86a27"),
    "1.7B bf16 at TRL's memory, H100": ("h100", "h100", 17.71, "1.7b", 256, None, False, (0.55, 0.14, 0.28),
                                        "Against TRL: 362M and 1.7B; 2026-12-06, 5e874ff"),
    "RTX 4090, 1.5B full, 2K": ("h200", "rtx4090", None, "1.5b", 2048, None, False, (4.22, 0.26, 1.00),
                                "Long responses; 2026-12-05, 7df79e4"),
    "P40, 1.5B full, 8K": ("h200", "p40", None, "1.5b", 8192, None, True, (71.8, 3.6, 18.4), "Long responses; 2026-12-04, b47b18a"),
    "P40, 7B NF4, 512": ("h200", "p40", None, "qwen7b", 512, "nf4", False, (6.8, 2.5, 6.4), "Long responses; 2026-12-04, b47b18a"),
    "P40, 7B NF4, 4K": ("h200", "p40", None, "qwen7b", 4096, "nf4", True, (57.4, 4.4, 18.5), "Long responses; 2026-12-04, b47b18a"),
    "P40, 7B NF4, 8K": ("h200", "p40", None, "qwen7b", 8192, "nf4", True, (128.0, 11.3, 49.3),
                        "Long responses; 2026-12-05, 7df79e4"),
    "T4, 8B NF4, 512": ("h100", "t4", None, "llama8b", 512, "nf4", False, (6.97, 0.40, 1.77), "Long responses; 2026-12-05, 739fe6b"),
    "T4, 8B NF4, 4K": ("h100", "t4", None, "llama8b", 4096, "nf4", False, (64.8, 2.56, 13.42),
                       "Long responses; 2026-12-06, a914690"),
    "T4, 8B NF4, 4K, the fixed order's plan": ("h100", "t4", None, "llama8b", 4096, "nf4", False, (87.11, 2.57, 13.44),
                                               "Long responses; 2026-12-06, a914690"),
}
# What a row ran where the card's plan is another today (the search by estimated step time replaced it): the
# estimate checks the setting that ran, and the table names today's beside it
RAN: dict[str, dict[str, Any]] = {
    "P40, 1.5B full, 8K": {"grad_checkpointing": True, "swap_models": True, "optimizer_offload": False,
                           "activation_offload": True, "optimizer": "adamw8bit", "micro_batch": 2, "rollout_batch": 8,
                           "score_micro_batch": 4, "kv_cache_dtype": "fp32"},
    # the fp32 plans' KV cache was stored in fp32 until the fp16 cache under fp32 compute
    "P40, 7B NF4, 512": {"kv_cache_dtype": "fp32"},
    "P40, 7B NF4, 4K": {"kv_cache_dtype": "fp32"},
    "P40, 7B NF4, 8K": {"kv_cache_dtype": "fp32"},
    # its stage's reference swap, which moves nothing under LoRA (the reference is the base): dropped since
    "T4, 8B NF4, 4K": {"swap_models": True},
    "T4, 8B NF4, 4K, the fixed order's plan": {"grad_checkpointing": True, "swap_models": False,
                                               "optimizer_offload": False, "activation_offload": True,
                                               "optimizer": "adamw", "micro_batch": 4, "rollout_batch": 8,
                                               "score_micro_batch": 8},
}
KNOBS = ("grad_checkpointing", "swap_models", "optimizer_offload", "activation_offload", "optimizer", "micro_batch",
         "rollout_batch", "score_micro_batch", "kv_cache_dtype")
# (hidden, layers, heads, KV heads, MLP, tied embeddings): bench/benchlib.py's SHAPES
SHAPES = {"1.7b": (2048, 24, 32, 32, 8192, True), "1.5b": (1536, 28, 12, 2, 8960, True),
          "qwen7b": (3584, 28, 28, 4, 18944, False), "llama8b": (4096, 32, 32, 8, 14336, False)}


# Rows that ran before the NF4 kernel's tensor-core path (fp16 from CC 7.5, 2026-12-07): estimated with the fp32
# kernel they ran (rates of unknown compute capability)
FP32_NF4_KERNEL = {"T4, 8B NF4, 512", "T4, 8B NF4, 4K", "T4, 8B NF4, 4K, the fixed order's plan"}


def estimates() -> list[dict[str, Any]]:
    from edgerl.device.device import Software
    from edgerl.device.profiles import device_from_profile, get_profile
    from edgerl.plan import timing
    from edgerl.plan.modelspec import ModelSpec
    from edgerl.plan.plan import plan
    from edgerl.plan.task import Task
    sw = Software(python="3.12", torch="2.11.0+cu130", torch_cuda="13.0", arch_list=("sm_80", "sm_90"),
                  libs=(("torch", "2.11.0"), ("transformers", "5.17.0"), ("triton", "3.6.0"),
                        ("bitsandbytes", "0.50.2")))
    out = []
    for name, (gpu, card, cap, shape, n, base, tf32, measured, where) in ROWS.items():
        h, layers, heads, kv, mlp, tied = SHAPES[shape]
        model = ModelSpec(shape, "llama", 49152, h, layers, heads, kv, mlp, tied, max_position=32768)
        task = Task(prompt_len=64, response_len=n, prompts_per_step=2, samples_per_prompt=8, kl=True, lora=bool(base))
        o: dict[str, Any] = {"memory_gib": cap} if cap else {}
        if base:
            o["base_dtype"] = base
        dev = device_from_profile(get_profile(card), sw, 128 << 30)
        today = plan(dev, model, task, o)
        p = plan(dev, model, task, {**o, **RAN.get(name, {})})
        ran_on = device_from_profile(get_profile(gpu), sw, 128 << 30)
        r = timing.rates(ran_on, p.dtype.compute, tf32=tf32)
        t = timing.estimate(p, replace(r, cc=(0, 0)) if name in FP32_NF4_KERNEL else r)
        changed = {k: getattr(today, k) for k in KNOBS if getattr(today, k) != getattr(p, k)}
        if name in FP32_NF4_KERNEL:
            changed["NF4 kernel"] = "on tensor cores"
        out.append({"row": name, "gpu": ran_on.name, "where": where, "measured": measured,
                    "estimate": (t.rollout_s, t.score_s, t.update_s), "decode": p.decode_backend,
                    "today": (timing.estimate(today, r).total_s, changed) if changed else None})
    return out


def today(t: Any, ran: float) -> str:
    """Today's plan for the row where it is not the one that ran: its estimate on the same GPU and what differs."""
    if t is None:
        return "the same"
    secs, changed = t
    what = ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in changed.items())
    return f"{secs:.2f} ({secs / ran - 1:+.0%}; {what})"


def table() -> str:
    lines = ["| row | ran on | measured s/step (rollout / scoring / update) | estimate | error | measured (table; date, commit) "
             "| today's plan: estimate |",
             "|---|---|---|---|---|---|---|"]
    for r in estimates():
        m, e = r["measured"], r["estimate"]
        err = sum(e) / sum(m) - 1
        lines.append(f"| {r['row']} | {r['gpu']} | {sum(m):.2f} ({' / '.join(f'{x:g}' for x in m)}) | "
                     f"{sum(e):.2f} ({' / '.join(f'{x:.2f}' for x in e)}) | {err:+.0%} | {r['where']} | "
                     f"{today(r['today'], sum(e))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
