"""fp16 that cannot overflow silently, in a run: the calibration before the first step, and the stop when
steps keep going non-finite.

Before the first step of a plan that would compute in fp16 (its `fp16_check` decision is "at start"), the
model's real weights run in fp32 on a few training prompts (edgerl/models/activations.py); the record is
cached per model (edgerl/plan/fp16.py) and the run is planned again with it: fp32 where a site comes within
the safety factor of fp16's maximum, or a one-line refusal where fp32 does not fit.

During training, a step whose rollout holds a NaN or infinite sampled log-prob trains on nothing (the
engine's samples are garbage from that token on), as does an update whose loss or gradient norm is not
finite (edgerl/train/update.py). Each such step counts towards train.max_bad_steps in a row; then the run
stops with one line naming the first non-finite site of the trainer's own forward of those rows (or, where
that forward is finite, what the calibration measured) and the setting that avoids it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from edgerl.config.schema import Config
from edgerl.config.target import Target, plan_for
from edgerl.core.errors import ConfigError, TrainingError
from edgerl.data.prompts import Prompt
from edgerl.models.activations import calibrate, first_nonfinite, local_folder
from edgerl.models.backbone import decoder_layers
from edgerl.plan.fp16 import CALIBRATION_PROMPTS, FP16_MAX, LIMIT, Peak, write_cached
from edgerl.plan.plan import Plan
from edgerl.rollout.base import RolloutBatch
from edgerl.train.experience import Experience, pad_batch


def calibrated(cfg: Config, target: Target, plan: Plan, prompts: list[Prompt], device: torch.device,
               log: Callable[[str], None]) -> Plan:
    """`plan`, or, where it asks for a calibration at start, the plan made again with the model's record."""
    if plan.fp16_check != "calibrate at start":
        return plan
    ids = [list(p.input_ids) for p in prompts[:CALIBRATION_PROMPTS]]
    log(f"fp16 check: {cfg.model.path} runs in fp32 on {len(ids)} training prompts to find each layer's largest "
        "activation (once per model: the result is cached)")
    t0 = time.perf_counter()
    record = calibrate(cfg.model.path, ids, device, cfg.model.trust_remote_code)
    try:
        cached = f"cached in {write_cached(local_folder(cfg.model.path), record)}"
    except ConfigError as e:   # a read-only cache folder: this run still uses the record
        cached = f"not cached: {e}"
    new = plan_for(cfg, target, replace(plan.model, activations=record), world_size=plan.task.world_size)
    w = record.worst()
    log(f"fp16 check ({time.perf_counter() - t0:.1f} s, {cached}): the largest activation is {w.describe()}'s, "
        f"{w.value:.3g} (fp16 holds {FP16_MAX:.0f}; the plan keeps fp16 below {LIMIT:.0f}); the run computes in "
        f"{new.dtype.compute}" + (f": {new.reasons['dtype']}" if new.dtype.compute != plan.dtype.compute else ""))
    return new


def nonfinite_rows(batch: RolloutBatch) -> list[int]:
    """This process's rollout rows with a NaN or infinite sampled log-prob (none where the engine reports no
    log-probs: transformers' generate raises on a NaN distribution instead, see `sampler_failed`)."""
    if batch.logprobs is None:
        return []
    return [i for i, row in enumerate(batch.logprobs) if not all(math.isfinite(x) for x in row)]


def sampler_failed(e: BaseException) -> bool:
    """Whether a rollout raised because the distribution it sampled from held NaN or inf (torch.multinomial's
    check, which transformers' generate meets)."""
    return isinstance(e, RuntimeError) and "probability tensor contains either" in str(e)


def probe(actor: Any, exp: Experience, rows: int, temperature: float, device: torch.device) -> Optional[Peak]:
    """The first non-finite site of the actor's forward (the trainer's own, in the plan's compute dtype) of
    the first `rows` rows of `exp`; None when it is finite. Every process must call it (FSDP2's gathers)."""
    part = exp.rows(slice(0, max(1, rows))).trimmed().to(device)
    actor.eval()
    return first_nonfinite(decoder_layers(actor.lm), lambda: actor(part.input_ids, part.attention_mask,
                                                                   part.response_ids, part.start, temperature))


def stop_message(what: str, steps: int, plan: Plan, found: Optional[Peak], cfg: Config, rollout: bool) -> str:
    """The one line that stops a run after `steps` non-finite steps in a row: `what` went NaN or infinite
    ("the rollout's log-probs were", "the loss was"; `rollout`: the engine's samples), where, and the setting
    that avoids it."""
    done = "nothing was trained on them" if rollout else "updates skipped"
    head = f"{what} NaN or infinite" + (f" in {steps} steps in a row ({done})" if steps > 1 else
                                         " (nothing was trained on it)")
    record = plan.model.activations
    if found is not None:
        where = f"the actor's {plan.dtype.compute} forward of those rows first goes non-finite in {found.describe()}"
        if record is not None:
            i = int(found.where.split()[-1])
            measured = dict(record.layers[i]).get(found.site) if i < len(record.layers) else None
            if measured is not None:
                where += f" (the fp32 calibration measured {measured:.3g} there)"
    else:
        where = f"the actor's {plan.dtype.compute} forward of those rows is finite, so " + (
            f"the rollout engine's {plan.decode_backend} decode step produced them" if rollout else
            "the reference model's or the critic's forward, or the backward, did")
        if record is not None and plan.dtype.compute == "fp16":
            w = record.worst()
            where += f"; the calibration's largest activation is {w.describe()}'s, {w.value:.3g}"
    if plan.dtype.compute == "fp16":
        fix = (f"fp16 holds at most {FP16_MAX:.0f}: train in fp32 with --set plan.dtype=fp32"
               + (" (or decode with torch's ops: --set plan.decode_backend=torch)" if found is None and rollout
                  else ""))
    else:
        fix = f"lower train.lr (now {cfg.train.lr:g}) or check the rewards"
    return f"{head}: {where}; {fix}"


def bad_step(t: Any, what: str, done: str, exp: Experience, rows: list[int], rollout: bool) -> None:
    """Count a step of the Trainer `t` that went non-finite (every rank calls it together); at train.max_bad_steps in a
    row, stop with one line naming the first non-finite site of the actor's forward of those rows (`rows` of
    `exp`, else its first) and the setting that avoids it."""
    lp, cfg = t.state.loop, t.cfg
    lp.bad_in_a_row += 1
    t.log(f"step {lp.step + 1}: {what} NaN or infinite ({done}; {lp.bad_in_a_row} step(s) in a row, the run stops "
          f"at {cfg.train.max_bad_steps})")
    if lp.bad_in_a_row >= cfg.train.max_bad_steps:
        part = exp.rows(torch.tensor(rows)) if rows else exp
        found = probe(t.actor, part, t.plan.micro_batch, cfg.rollout.temperature, t.device)
        raise TrainingError(stop_message(what, lp.bad_in_a_row, t.plan, found, cfg, rollout))


def sampling_stopped(t: Any, prompts: list[list[int]]) -> TrainingError:
    """The error that stops a run whose engine could not sample (transformers' generate met a NaN
    distribution): there is no rollout to skip, so the run stops at once, naming where the actor's forward of
    the prompts goes non-finite (one process only: under torchrun one rank alone cannot run FSDP2's gathers)."""
    exp = pad_batch(RolloutBatch(prompts, [p[-1:] for p in prompts], [False] * len(prompts)),
                    t.tokenizer.pad_token_id, [0.0] * len(prompts))
    found = probe(t.actor, exp, len(prompts), t.cfg.rollout.temperature, t.device) if t.world == 1 else None
    return TrainingError(stop_message("the rollout's token distribution was", 1, t.plan, found, t.cfg, rollout=True))
