"""The recipes in examples/recipes (TOML files a user copies) and README's table of their plans.

Each recipe names its card in run.profile; the table plans each one on that card with the same fixed
software stack as README's "what fits where" (so it does not depend on the machine that prints it), and
`tests/test_recipes_on_cpu.py` checks that README holds exactly this text and that each plan fits.
`python -m edgerl.config.recipes` prints the table.
"""

from __future__ import annotations

from pathlib import Path

from edgerl.config.load import load_config
from edgerl.config.target import model_spec, overrides_from_config, task_from_config
from edgerl.device.device import GiB
from edgerl.device.profiles import device_from_profile, get_profile
from edgerl.plan.explain import HOST_RAM, REFERENCE_SOFTWARE, SOFTWARE_NOTE
from edgerl.plan.plan import Plan, plan

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "recipes"
# recipe -> the GPUs it is planned for under torchrun (one unless named here)
GPUS = {"grpo-qwen2.5-1.5b-2xp40.toml": 2}


def recipe_plan(path: Path) -> Plan:
    """`path`'s plan on its run.profile's card, with the reference software, for GPUS[path.name] GPUs."""
    cfg = load_config(path, [])
    prof = get_profile(cfg.run.profile)
    dev = device_from_profile(prof, REFERENCE_SOFTWARE, HOST_RAM)
    return plan(dev, model_spec(cfg), task_from_config(cfg, world_size=GPUS.get(path.name, 1)),
                overrides_from_config(cfg, prof))


def _what(p: Plan) -> str:
    parts = [p.dtype.name, f"LoRA r={p.lora['rank']} on an {p.base_dtype} base" if p.base_dtype == "nf4"
             else f"LoRA r={p.lora['rank']} on a {p.base_dtype} base" if p.lora else "full fine-tuning",
             f"micro-batch {p.micro_batch}"]
    parts += [label for on, label in ((p.grad_checkpointing, "checkpointing"), (p.swap_models, "swap"),
                                      (p.optimizer_offload or p.param_offload, "offload")) if on]
    return ", ".join(parts) + f"; rollout {p.rollout_engine} ({p.decode_backend})"


def recipe_table(folder: Path = FOLDER) -> str:
    lines = [f"Each recipe's plan on its card ({SOFTWARE_NOTE}; `python -m edgerl.config.recipes` prints this "
             "table):", "", "| recipe | card | task | the plan | memory per GPU |", "|---|---|---|---|---|"]
    for path in sorted(folder.glob("*.toml")):
        p = recipe_plan(path)
        t = p.task
        gpus = GPUS.get(path.name, 1)
        card = f"{gpus} x {p.device.name}" if gpus > 1 else p.device.name
        task = (f"{p.model.name}, {t.algo}, {t.prompts_per_step} x {t.samples_per_prompt}, "
                f"{t.prompt_len} + {t.response_len} tokens")
        if t.episodes:   # docs/agents.md
            r = load_config(path, []).rollout
            task += f" per episode of {r.turns()} turns with {', '.join(r.tools or [r.environment])}"
        lines.append(f"| [{path.name}](examples/recipes/{path.name}) | {card} | {task} | {_what(p)} | "
                     f"{p.memory.total / GiB:.1f} of {p.memory.budget / GiB:.1f} GiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(recipe_table())
