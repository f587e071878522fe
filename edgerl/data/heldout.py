"""Held-out prompts for the evaluation (`eval.data`), read and checked like the training data (the
columns and the length limit of data.*), before the run folder is written.

    a file                  as it is
    an HF dataset           eval.split, or its 'test' split, else 'validation' (an error naming its splits
                            when it has neither)
    builtin:arithmetic      problems generated with another seed than the training ones, any problem whose
                            prompt is also a training prompt left out (and counted)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from edgerl.config.schema import Config
from edgerl.core.errors import DataError
from edgerl.data.builtin import BUILTIN_PREFIX
from edgerl.data.prompts import DataReport, Prompt, load_prompts

# the training problems of builtin:arithmetic are generated with seed 0 (session.prepare)
HELDOUT_SEED = 1
BUILTIN_EVAL_PROMPTS = 256   # problems of a built-in task evaluated when eval.max_prompts is unset

_SPLITS = ("test", "validation")


def eval_split(path: str, split: Optional[str]) -> Optional[str]:
    """The split to evaluate: eval.split, or for an HF dataset its 'test' split, else 'validation'.
    None for files and built-in tasks (they have no splits)."""
    if split is not None or path.startswith(BUILTIN_PREFIX) or Path(path).expanduser().is_file():
        return split
    try:
        import datasets
        names = list(datasets.get_dataset_split_names(path))
    except Exception:   # offline, or not a dataset: loading it says why in one line
        return "test"
    for name in _SPLITS:
        if name in names:
            return name
    raise DataError(f"eval.data {path!r} has no test or validation split (its splits: {', '.join(names)}); "
                    "choose one with eval.split")


def load_eval_prompts(cfg: Config, tokenizer, train: list[Prompt], log: Optional[Callable[[str], None]] = print,
                      tools: Optional[list[dict]] = None) -> tuple[list[Prompt], DataReport]:
    """The held-out prompts of cfg.eval (DataError for a bad file or row, naming it as eval.data); `tools`:
    the schemas the chat template renders (rollout.tools)."""
    e = cfg.eval
    assert e.data is not None
    split = eval_split(e.data, e.split)
    builtin = e.data.startswith(BUILTIN_PREFIX)
    limit = e.max_prompts or (BUILTIN_EVAL_PROMPTS if builtin else None)
    dc = dataclasses.replace(cfg.data, path=e.data, split=split or "test", shuffle=False)
    if builtin:   # more than needed: those that are also training problems are left out below
        dc = dataclasses.replace(dc, num_examples=2 * (limit or BUILTIN_EVAL_PROMPTS) + 16)
        seed = HELDOUT_SEED if split in (None, "test") else 0
    else:
        seed = 0
    try:
        prompts, report = load_prompts(dc, tokenizer, seed=seed, log=None, tools=tools)
    except DataError as err:
        raise DataError(f"eval.data: {err}") from None
    dropped: dict[str, int] = dict(report.filtered)
    if builtin and seed == HELDOUT_SEED:
        seen = {p.text for p in train}
        kept = [p for p in prompts if p.text not in seen]
        if len(kept) < len(prompts):
            dropped["also training prompts"] = len(prompts) - len(kept)
        prompts = kept
    if limit is not None and len(prompts) > limit:
        prompts = prompts[:limit]
    if not prompts:
        raise DataError(f"eval.data {e.data!r}: no prompt is left to evaluate ({', '.join(dropped) or 'empty'})")
    report = DataReport(report.source + (f" [{split}]" if split and not builtin else ""), report.rows_read,
                        len(prompts), dropped)
    if log is not None:
        log(f"eval: {report.source}: {len(prompts)} prompts"
            + "".join(f"; dropped {n}: {why}" for why, n in dropped.items()))
    return prompts, report
