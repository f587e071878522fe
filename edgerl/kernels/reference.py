"""The naive reference: full logits, log_softmax, gather. For tests and benchmarks only.

Materialises (N, V) logits in fp32, their log-softmax and softmax, and autograd keeps them for the
backward: about 4 x N x V x 4 bytes at peak, which is what the chunked paths avoid.
"""
from __future__ import annotations

import torch


def naive_logprobs_and_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               temperature: float = 1.0, *, dtype: torch.dtype = torch.float32):
    """hidden (..., H), weight (V, H), targets (...) int64 -> logprobs, entropy (...) in `dtype`.

    logits = (hidden @ W.T) in the input dtype, then upcast to `dtype` and divided by temperature
    (what an HF model plus log_softmax does). Pass float64 inputs and dtype=torch.float64 for the
    exact reference the tests compare against.
    """
    logits = (hidden @ lm_head_weight.t()).to(dtype) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
