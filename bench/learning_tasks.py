"""The tasks of bench_learning.py: training prompts in the order both tools draw them, the held-out prompts, and
the scorer both use. Each is written as a verl-format JSONL that edgerl reads as data.path / eval.data and TRL
reads as its dataset, so the two see the same rows, in the same order, under the same chat template.

    arithmetic   edgerl's built-in task as the demo trains it (examples/demo-cpu.toml): level-1 problems, the
                 training set generated with seed 0 and drawn in edgerl's sampler order for train.seed, the
                 held-out problems generated with edgerl's held-out seed less any training prompt, the first 64
    gsm8k        GSM8K's format: verl's instruction ('Let's think step by step and output the final answer after
                 "####".') and verl's strict scoring (only '#### <number>' counts), on the built-in level-2
                 problems (two-digit sums and differences), each after one worked example that ends as GSM8K's
                 answers do, sampled at temperature 0.7, 96 new tokens. SmolLM2-135M-Instruct gives this task a
                 signal where the plainer forms give none (docs/benchmarks.md, Learning against TRL): real GSM8K
                 scores 0 of 64 held-out problems at step 0; level-2 problems with verl's instruction alone, 0 of
                 64, and no sampled training response earns a reward, so GRPO's advantages are all 0 and neither
                 tool would update. `--gsm8k-questions real` uses GSM8K's own problems instead (--gsm8k PATH: a
                 folder with train.jsonl and test.jsonl), with the same instruction and no example
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from edgerl.data.builtin import ARITHMETIC_SOURCE, GSM8K_INSTRUCTION, GSM8K_SOURCE, generate_arithmetic, gsm8k_row
from edgerl.data.heldout import HELDOUT_SEED
from edgerl.data.sampler import PromptSampler

TRAIN_PROBLEMS = 4096     # data.num_examples' default: the built-in training set


@dataclass(frozen=True)
class Task:
    name: str
    difficulty: int
    gsm8k_format: bool           # verl's GSM8K instruction and strict '####' scoring
    new_tokens: int
    steps: int = 24
    every: int = 12              # evaluations before step 1, after every `every` steps and after the last
    prompts_per_step: int = 8
    samples: int = 4
    lr: float = 1e-5
    eval_prompts: int = 64
    temperature: float = 1.0     # sampling (the held-out answers are greedy)
    shot: bool = False           # one worked example, in GSM8K's answer format, before each question


TASKS = {
    "arithmetic": Task("arithmetic", 1, False, 40),
    # verl's instruction asks for steps before the answer: 40 tokens cut most answers; at temperature 1 no sampled
    # response of 128 earned a reward at step 0, at 0.7 five did (4 of 32 groups held a reward difference)
    "gsm8k": Task("gsm8k", 2, True, 96, temperature=0.7, shot=True),
}


def smoke(task: Task) -> Task:
    """The same task at a size a CPU test runs in seconds: 2 steps of 2 prompts x 2 samples, 8 new tokens."""
    from dataclasses import replace
    return replace(task, new_tokens=8, steps=2, every=1, prompts_per_step=2, samples=2, eval_prompts=4)


# a level-2 problem in neither the training nor the held-out set (a test checks), answered as GSM8K answers end
SHOT = ("Question: A shop had 45 pencils. It sold 17 of them. How many pencils does the shop have left?\n"
        "Answer: The shop had 45 pencils and sold 17, so it has 45 - 17 = 28 pencils left.\n#### 28\n\n")


def _as_gsm8k(row: dict[str, Any], shot: bool) -> dict[str, Any]:
    """A built-in problem posed as GSM8K is (the question, a space, verl's instruction), after the worked
    example where `shot`; scored strictly."""
    q = row["extra_info"]["question"]
    text = (f"{SHOT}Question: {q}" if shot else q) + f" {GSM8K_INSTRUCTION}"
    return {**row, "data_source": GSM8K_SOURCE, "prompt": [{"role": "user", "content": text}]}


def _read_gsm8k(path: Path, split: str) -> list[dict[str, Any]]:
    file = path / f"{split}.jsonl"
    if not file.is_file():
        raise SystemExit(f"--gsm8k {path}: no {file.name} there; give a folder with GSM8K's train.jsonl and "
                         "test.jsonl (one {\"question\", \"answer\"} object a line)")
    rows = []
    for i, line in enumerate(file.read_text().splitlines()):
        if line.strip():
            ex = json.loads(line)
            rows.append(gsm8k_row(ex["question"], ex["answer"], split, i))
    return rows


def rows_of(task: Task, seed: int, gsm8k: Optional[Path] = None) -> tuple[list[dict], list[dict]]:
    """(training rows in the order they are drawn: steps x prompts_per_step of them, held-out rows)."""
    if gsm8k is not None:
        pool, test = _read_gsm8k(gsm8k, "train"), _read_gsm8k(gsm8k, "test")
        heldout = test[:task.eval_prompts]
    else:
        pool = generate_arithmetic(TRAIN_PROBLEMS, task.difficulty, 0)
        seen = {json.dumps(r["prompt"]) for r in pool}
        # as edgerl.data.heldout does for the built-in task: another seed, training prompts left out
        fresh = generate_arithmetic(2 * task.eval_prompts + 16, task.difficulty, HELDOUT_SEED)
        heldout = [r for r in fresh if json.dumps(r["prompt"]) not in seen][:task.eval_prompts]
        if task.gsm8k_format:
            pool, heldout = [_as_gsm8k(r, task.shot) for r in pool], [_as_gsm8k(r, task.shot) for r in heldout]
    sampler = PromptSampler(len(pool), task.prompts_per_step, seed=seed, shuffle=True, log=None)
    order = [i for _ in range(task.steps) for i in sampler.next_batch()]
    return [pool[i] for i in order], heldout


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return path


def prompt_ids(path: Path, tokenizer: Any) -> list[Any]:
    """The rows of `path` as edgerl tokenizes them (its chat template, no second BOS): edgerl's Prompt objects."""
    from edgerl.config.schema import DataConfig
    from edgerl.data.prompts import load_prompts
    prompts, _ = load_prompts(DataConfig(path=str(path), shuffle=False, max_prompt_len=1024), tokenizer, log=None)
    return prompts


def accuracy(tokenizer: Any, prompts: list[Any], response_ids: list[list[int]]) -> tuple[float, list[float]]:
    """edgerl's held-out scorer (eval/accuracy): the data_source's rule giving full credit, per prompt."""
    from edgerl.train.evaluate import _rows, correct
    ok = correct(_rows(tokenizer, prompts, response_ids, 1))
    return sum(ok) / len(ok), ok


def reward(data_source: str, text: str, ground_truth: str) -> float:
    """The training reward edgerl gives a response (reward.functions' default, 'answer'): the rule's score."""
    from edgerl.rewards.rules import default_compute_score
    r = default_compute_score(data_source, text, ground_truth)
    return float(r["score"] if isinstance(r, dict) else r)
