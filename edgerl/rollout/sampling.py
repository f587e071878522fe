"""Sampling on the device without host synchronisation, so it can sit inside a captured CUDA graph.

Order and semantics follow HF's logits warpers (temperature, then top-k, then top-p), so the
sampled distribution is the one HF `generate` samples from. Draws use the Gumbel-max trick
(argmax(logits + Gumbel noise) is a sample of softmax(logits)) on `torch.rand` from an explicit
generator. `torch.multinomial` cannot be captured: for one sample it validates the probabilities
with `.item()` (ATen Distributions.cpp, "probability tensor contains either inf, nan or element < 0"),
a host sync per token; internally it then does this same Gumbel argmax.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """scaled: (B, V) fp32 logits / T. top_k: 0 = off (a Python int: it fixes a shape);
    top_p: None = off, else a (1,) tensor in (0, 1]. Returns (B, V) with removed tokens at -inf."""
    if top_k > 0:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if top_p is not None:
        # HF TopPLogitsWarper: ascending sort, drop the low tail whose mass is <= 1 - top_p, keep the top token.
        sorted_logits, order = torch.sort(scaled, descending=False, dim=-1)
        remove = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p)
        remove[:, -1] = False
        scaled = scaled.masked_fill(remove.scatter(1, order, remove), -math.inf)
    return scaled


def sample(logits: torch.Tensor, temperature: torch.Tensor, *, greedy: bool, top_k: int,
           top_p: Optional[torch.Tensor], generator: Optional[torch.Generator],
           noise_rows: Optional[torch.Tensor] = None, noise_total: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (B, V) fp32; temperature: (1,) tensor. Returns (tokens (B,) long, log-probs (B,) fp32)
    where the log-prob is log_softmax(logits / T) at the token: the full tempered softmax, before
    top-k/top-p, which is what the trainer recomputes. `noise_rows` (B,) and `noise_total`: the rows are
    rows `noise_rows` of a batch of `noise_total` (finished rows dropped), and draw the noise those rows
    would draw in it: the samples do not depend on which other rows are still decoding."""
    scaled = logits / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    if greedy:
        tok = logits.argmax(-1)
    else:
        kept = filter_logits(scaled, top_k, top_p)
        if noise_rows is not None:
            u = torch.rand((noise_total, kept.shape[1]), generator=generator, device=kept.device,
                           dtype=torch.float32)[noise_rows]
        else:
            u = torch.rand(kept.shape, generator=generator, device=kept.device, dtype=torch.float32)
        # -log(-log(u)): u == 0 gives -inf noise (never chosen), u < 1 always so the noise is finite above.
        tok = (kept - torch.log(-torch.log(u))).argmax(-1)
    return tok, logp_all.gather(-1, tok[:, None])[:, 0]
