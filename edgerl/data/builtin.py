"""Generated and prepared tasks: the built-in arithmetic word problems, and GSM8K in verl's format.

Both produce rows in verl's parquet schema, so the rest of edgerl reads them the same way as a
user's verl files:

    {"data_source": str, "prompt": [{"role": "user", "content": str}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": str}, "extra_info": {...}}
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Callable

from edgerl.data.files import RawTable, json_line, read_text, text_lines
from edgerl.core.errors import DataError
from edgerl.core.files import output_file, write_atomically

ARITHMETIC_SOURCE = "edgerl/arithmetic"
GSM8K_SOURCE = "openai/gsm8k"

# verl examples/data_preprocess/gsm8k.py, verbatim: the GSM8K reward (strict mode) looks for
# "#### <number>", and this sentence is what asks the model for it.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# The built-in task asks for the same "#### <number>" marker as GSM8K, so a model that learns the
# format here carries it over. Wording chosen by measurement on SmolLM2-135M-Instruct (its
# embedded Q4_1 GGUF weights, greedy decoding, 80 new tokens, 24 level-1 problems each, SmolLM2
# chat template; counts are answers whose last number is right / responses containing "#### "):
#   'Give the final answer as a number after "####".'                  13/24 right, 5/24 marked
#   the same + ', like this: #### 0'                                     8/24 right, 11/24 marked,
#                                                                        every marked answer wrong
#   'End your reply with the answer in the form "#### <number>".'       5/24 right, 14/24 marked
#   'Answer with the number only.'                                      10/24 right, 5/24 marked
#   verl's GSM8K sentence ("Let's think step by step ...")               5/24 right, 2/24 marked
#                                                                        (long answers, cut at 80 tokens)
# Asking harder for the marker costs correctness at this size, so the reward for this task
# (edgerl.rewards.rules.arithmetic_score) also accepts an unmarked last number.
ARITHMETIC_INSTRUCTION = 'Give the final answer as a number after "####".'

NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Lena", "Kofi", "Yuki", "Maria", "Ben"]
OBJECTS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "balloons",
           "oranges", "stamps", "shells", "toy cars"]
CONTAINERS = ["boxes", "bags", "packs", "baskets", "jars"]

# Sentence templates per operation; numbers are drawn per level in _problem.
_ADD = [
    "{name} has {a} {obj} and buys {b} more. How many {obj} does {name} have now?",
    "There are {a} {obj} on the table. {name} puts {b} more {obj} on the table. "
    "How many {obj} are on the table now?",
    "{name} collected {a} {obj} on Monday and {b} {obj} on Tuesday. "
    "How many {obj} did {name} collect in total?",
    "{name} had {a} {obj}. A friend gave {name} {b} more. How many {obj} does {name} have now?",
]
_SUB = [
    "{name} had {a} {obj} and gave {b} of them to a friend. How many {obj} does {name} have left?",
    "A shop had {a} {obj}. It sold {b} of them. How many {obj} does the shop have left?",
    "There were {a} {obj} in a basket. {name} took {b} of them. How many {obj} are in the basket now?",
]
_MUL = [
    "{name} buys {a} {box} with {b} {obj} in each. How many {obj} does {name} buy?",
    "There are {a} {box} and each one holds {b} {obj}. How many {obj} are there in total?",
    "{name} gets {b} {obj} every day for {a} days. How many {obj} does {name} get in total?",
]
_TWO_OPS: list[tuple[str, Callable[[int, int, int], int], str]] = [
    ("{name} buys {a} {box} with {b} {obj} in each, and then finds {c} more {obj}. "
     "How many {obj} does {name} have?", lambda a, b, c: a * b + c, "{a} * {b} + {c}"),
    ("{name} buys {a} {box} with {b} {obj} in each, and then gives {c} {obj} to a friend. "
     "How many {obj} does {name} have left?", lambda a, b, c: a * b - c, "{a} * {b} - {c}"),
    ("{name} has {a} {obj}, buys {b} more, and then gives away {c}. "
     "How many {obj} does {name} have now?", lambda a, b, c: a + b - c, "{a} + {b} - {c}"),
    ("{name} has {a} {obj}. Then {b} friends each give {name} {c} more {obj}. "
     "How many {obj} does {name} have now?", lambda a, b, c: a + b * c, "{a} + {b} * {c}"),
]


def _fill(template: str, rng: random.Random, **nums: int) -> str:
    return template.format(name=rng.choice(NAMES), obj=rng.choice(OBJECTS),
                           box=rng.choice(CONTAINERS), **nums)


def _problem(level: int, rng: random.Random) -> tuple[str, int, str]:
    """One problem at `level`: (question, integer answer, the expression that gives it)."""
    if level == 1:  # one-digit sums
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return _fill(rng.choice(_ADD), rng, a=a, b=b), a + b, f"{a} + {b}"
    if level == 2 or (level == 3 and rng.random() < 1 / 3):  # two-digit addition / subtraction
        if rng.random() < 0.5:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            return _fill(rng.choice(_ADD), rng, a=a, b=b), a + b, f"{a} + {b}"
        a = rng.randint(20, 99)
        b = rng.randint(10, a - 1)  # answers stay positive
        return _fill(rng.choice(_SUB), rng, a=a, b=b), a - b, f"{a} - {b}"
    if level == 3:  # multiplication (two thirds of level 3)
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return _fill(rng.choice(_MUL), rng, a=a, b=b), a * b, f"{a} * {b}"
    if level == 4:  # two operations
        i = rng.randrange(len(_TWO_OPS))
        template, op, expr = _TWO_OPS[i]
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        if i == 1:
            c = rng.randint(1, a * b - 1)  # a*b - c stays positive
        elif i == 2:
            a, b = rng.randint(10, 60), rng.randint(2, 30)
            c = rng.randint(1, a + b - 1)
        elif i == 3:
            a, c = rng.randint(2, 30), rng.randint(2, 9)
        else:
            c = rng.randint(1, 20)
        return _fill(template, rng, a=a, b=b, c=c), op(a, b, c), expr.format(a=a, b=b, c=c)
    raise ValueError(f"arithmetic difficulty must be 1 to 4, got {level}")


def arithmetic_prompt(question: str) -> str:
    """The user message of a built-in problem: the question, a newline, the answer instruction."""
    return f"{question}\n{ARITHMETIC_INSTRUCTION}"


def generate_arithmetic(n: int, difficulty: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """`n` seeded arithmetic word problems at `difficulty` (1..4) as verl-format rows.

    The same (n, difficulty, seed) gives the same rows; row i does not depend on n, so a longer
    set starts with the shorter one. The answer is a positive integer, stored as a string in
    reward_model.ground_truth (as verl stores GSM8K's).
    """
    if not 1 <= difficulty <= 4:
        raise ValueError(f"arithmetic difficulty must be 1 to 4, got {difficulty}")
    if n < 1:
        raise ValueError(f"number of arithmetic problems must be at least 1, got {n}")
    rows = []
    for i in range(n):
        # one generator per row (seeded from seed, difficulty, i): rows are independent of n
        rng = random.Random(f"edgerl-arithmetic/{seed}/{difficulty}/{i}")
        question, answer, expression = _problem(difficulty, rng)
        rows.append({
            "data_source": ARITHMETIC_SOURCE,
            "prompt": [{"role": "user", "content": arithmetic_prompt(question)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": i, "difficulty": difficulty, "expression": expression,
                           "question": question, "seed": seed},
        })
    return rows


BUILTIN_PREFIX = "builtin:"


def read_builtin(path: str, difficulty: int, num_examples: int, seed: int) -> RawTable:
    """The rows of 'builtin:arithmetic' (data.path) as a table, like a file's."""
    name = path[len(BUILTIN_PREFIX):]
    if name != "arithmetic":
        raise DataError(f"unknown built-in task {path!r}; the built-in task is 'builtin:arithmetic'")
    try:
        rows = generate_arithmetic(num_examples, difficulty, seed)
    except ValueError as e:
        raise DataError(f"{path}: {e} (data.difficulty / data.num_examples)") from None
    return RawTable(source=f"{path} (difficulty {difficulty}, {num_examples} problems, seed {seed})",
                    columns=list(rows[0]), rows=rows, name=path, kind="builtin")


# --- GSM8K -----------------------------------------------------------------------------------

_GSM8K_ANSWER = re.compile("#### (\\-?[0-9\\.\\,]+)")  # verl's extract_solution regex


def gsm8k_ground_truth(answer: str) -> str:
    """The number after '#### ' in a GSM8K answer, commas stripped (verl's extract_solution)."""
    match = _GSM8K_ANSWER.search(answer)
    if match is None:
        raise ValueError("no '#### <number>' line in the answer")
    return match.group(0).split("#### ")[1].replace(",", "")


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One GSM8K example as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def _read_gsm8k_jsonl(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        raise DataError(f"--from {path} is a folder; give the GSM8K JSONL file, e.g. {path / 'train.jsonl'}")
    if not path.exists():
        raise DataError(f"cannot read --from {path}: no such file (looked for {path.resolve()})")
    examples = []
    for lineno, line in enumerate(text_lines(read_text(path)), start=1):
        if not line.strip():
            continue
        try:
            obj = json_line(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg}, column {e.colno})") from None
        except ValueError as e:
            raise DataError(f"{path}: line {lineno} {e}") from None
        for key in ("question", "answer"):
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                raise DataError(f"{path}: line {lineno} has no string '{key}' field; GSM8K lines "
                                'look like {"question": ..., "answer": "... #### 72"}')
        examples.append(obj)
    if not examples:
        raise DataError(f"{path} holds no GSM8K examples")
    return examples


def _load_gsm8k_hub(split: str) -> list[dict[str, Any]]:

    try:
        import datasets
        ds = datasets.load_dataset(GSM8K_SOURCE, "main", split=split)
    except Exception as e:  # network, missing split, offline mode: say what to do instead
        raise DataError(f"cannot load {GSM8K_SOURCE} (config 'main', split '{split}') from the HF "
                        f"hub: {type(e).__name__}: {e}. Without network (or with HF_DATASETS_OFFLINE=1) "
                        "pass a local GSM8K JSONL file with --from") from None
    return [{"question": ex["question"], "answer": ex["answer"]} for ex in ds]


def prepare_gsm8k(out_path: str | Path, source: str | Path | None = None,
                  split: str = "train", overwrite: bool = False) -> tuple[Path, int]:
    """Write GSM8K as verl-compatible parquet at `out_path`; return (the file written, rows).

    `source` None reads `openai/gsm8k` (config 'main', `split`) from the HF hub; otherwise a local
    GSM8K JSONL (`{"question", "answer"}` per line). Row i gets extra_info.index = i, the position
    in the source split, as verl's `map(..., with_indices=True)` does. `out_path` without a suffix
    gets '.parquet'; its folder must exist; an existing file is replaced only with `overwrite`.
    The file appears whole or not at all (written beside it, then renamed).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    # checked before the (possibly downloaded) source is read: a bad --out fails at once
    out = output_file(out_path, (".parquet",), option="--out", overwrite=overwrite)
    examples = _load_gsm8k_hub(split) if source is None else _read_gsm8k_jsonl(Path(source))
    rows = []
    for i, ex in enumerate(examples):
        try:
            rows.append(gsm8k_row(ex["question"], ex["answer"], split, i))
        except ValueError as e:
            where = source if source is not None else f"{GSM8K_SOURCE}[{split}]"
            raise DataError(f"{where}: example {i} (0-based): {e}") from None
    table = pa.Table.from_pylist(rows)
    write_atomically(out, lambda tmp: pq.write_table(table, tmp))
    return out, len(rows)
