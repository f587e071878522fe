"""edgerl from Python: plan, train with a held-out evaluation, read the metrics.

    python examples/python_entry.py                 # the CPU demo, shortened to 4 steps
    python examples/python_entry.py --steps 24      # the whole demo
"""

import argparse
from pathlib import Path

import edgerl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", default=None, help="run folder (default: runs/<model>-<date>-<time>)")
args = parser.parse_args()

config = Path(__file__).with_name("demo-cpu.toml")
run = edgerl.prepare(config, out=args.out, train={"steps": args.steps},
                     **{"eval.every": max(1, args.steps // 2), "eval.max_prompts": 16})
print("plan:", run.plan.dtype.name, "micro-batch", run.plan.micro_batch, "| run folder:", run.run_dir)


def on_step(step: int, metrics: dict) -> None:
    shown = {k: round(v, 3) for k, v in metrics.items() if k in ("reward/mean", "eval/accuracy")}
    print(f"step {step}: {shown}")


run.train(on_step)
evals = [(r["step"], r["eval/accuracy"]) for r in run.metrics() if "eval/accuracy" in r]
print("held-out accuracy by step:", evals)
