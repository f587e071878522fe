"""A step's metrics over the global batch: every rank's share gathered, statistics summed over ranks
(all ranks call these functions; with one process they are plain means)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from edgerl import algos, correction
from edgerl.train import ranks
from edgerl.train.experience import Experience
from edgerl.rollout.base import RolloutBatch


def global_mean(x: torch.Tensor, mask: torch.Tensor, device: torch.device) -> float:
    """Masked mean over the global batch (every rank's share)."""
    total, count = ranks.sum_floats([float(algos.masked_sum(x.float(), mask)), float(mask.bool().sum())], device)
    return total / max(count, 1.0)


def global_max(x: torch.Tensor, mask: torch.Tensor, device: torch.device) -> float:
    """Largest valid element over the global batch (every rank's share); nan when there is none."""
    m = mask.bool()
    mine = float(x[m].max()) if m.any() else -math.inf
    top = ranks.max_floats([mine], device)[0]
    return top if math.isfinite(top) else float("nan")


def rollout_metrics(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, mode: str, level: str,
                    threshold: float, device: torch.device) -> dict[str, float]:
    """The rollout engine's sampled log-probs against the trainer's old ones (B, T), over the global batch:
    rollout/k3_kl, the k3 estimate of KL(pi_rollout || pi_old) per token; under a rollout correction, the
    weights' mean and max per unit (token, or sequence at the sequence level) and the share of units whose
    ratio was capped (tis: rollout_corr/truncated) or masked (mis: rollout_corr/masked)."""
    out = {"rollout/k3_kl": global_mean(correction.k3(old, sampled, mask), mask, device)}
    if mode == "none":
        return out
    w, cut = correction.weights(old, sampled, mask, mode, level, threshold)
    w_unit, units = correction.per_unit(w, mask, level)
    cut_unit, _ = correction.per_unit(cut, mask, level)
    out["rollout_corr/weight_mean"] = global_mean(w_unit, units, device)
    out["rollout_corr/weight_max"] = global_max(w_unit, units, device)
    out["rollout_corr/truncated" if mode == "tis" else "rollout_corr/masked"] = global_mean(cut_unit, units, device)
    return out


def global_explained_variance(exp: Experience, device: torch.device) -> float:
    """1 - var(returns - values) / var(returns) over the global batch's valid tokens (biased)."""
    m = exp.response_mask.bool()
    y, r = exp.returns.double(), (exp.returns - exp.values).double()
    n, sy, syy, sr, srr = ranks.sum_floats([float(m.sum()), *(float(algos.masked_sum(t, m)) for t in
                                                              (y, y * y, r, r * r))], device)
    if n == 0:
        return float("nan")
    var_y, var_r = syy / n - (sy / n) ** 2, srr / n - (sr / n) ** 2
    return 1 - var_r / var_y if var_y > 0 else float("nan")


def step_metrics(batch: RolloutBatch, scores: list[float], components: dict[str, list[float]],
                 stats: dict[str, float], times: dict[str, float], step_s: float,
                 device: torch.device, by_function: Optional[dict[str, list[float]]] = None) -> dict[str, Any]:
    """Rewards (the total, each reward function's mean as reward/<name>, the components of dict results),
    lengths and speed of the global batch, the update's `stats` and the phase `times`."""
    by_function = by_function or {}
    shares = ranks.gather({"scores": scores, "lengths": [len(r) for r in batch.response_ids],
                           "truncated": list(batch.truncated), "components": components, "functions": by_function})
    scores = [x for sh in shares for x in sh["scores"]]
    lengths = [x for sh in shares for x in sh["lengths"]]
    truncated = [x for sh in shares for x in sh["truncated"]]
    components = {k: [x for sh in shares for x in sh["components"].get(k, [])] for k in components}
    functions = {k: [x for sh in shares for x in sh["functions"].get(k, [])] for k in by_function}
    tokens = sum(lengths)
    sc = torch.tensor(scores)
    out = {"reward/mean": sc.mean().item(), "reward/std": sc.std().item() if len(sc) > 1 else 0.0,
           **{f"reward/{k}": _nanmean(v) for k, v in functions.items()},
           **{f"reward/{k}_mean": _nanmean(v) for k, v in components.items()},
           "response/length_mean": sum(lengths) / len(lengths), "response/length_min": min(lengths),
           "response/length_max": max(lengths), "response/truncated": sum(truncated) / len(truncated),
           **stats, "perf/step_s": step_s, "perf/tokens_per_s": tokens / step_s,
           "perf/rollout_tokens_per_s": tokens / max(times["time/rollout_s"], 1e-9), **times,
           "dist/world_size": ranks.world(), "batch/sequences": len(scores)}
    for key in ("captures", "capture_s", "prefill_s", "decode_s"):   # what the engine reports about itself
        if isinstance(batch.info.get(key), (int, float)):
            out[f"rollout/{key}"] = float(batch.info[key])
    if device.type == "cuda":
        out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    try:
        import psutil
        out["memory/host_rss_gib"] = psutil.Process().memory_info().rss / 2**30
    except ImportError:  # pragma: no cover
        pass
    return out


def _nanmean(xs: list[float]) -> float:
    vals = [x for x in xs if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else float("nan")
