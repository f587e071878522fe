"""Fused, chunked token log-probabilities and entropy (installed as ``edgerl.kernels``).

Public API:
    token_logprobs_and_entropy(hidden, lm_head_weight, targets, temperature=1.0, *, backend="auto",
                               chunk=None, tiles=None, compute_entropy=True) -> (logprobs, entropy)
    naive_logprobs_and_entropy(hidden, lm_head_weight, targets, temperature=1.0)  # full-logits reference
    choose_tiles(smem_per_block_optin, dtype, hidden, vocab, *, cc=None) -> Tiles
    estimate_smem(block_n, block_v, block_k, num_stages, dtype) -> int
    choose_chunk(n_tokens, vocab, budget_bytes, *, bytes_per_logit=TORCH_BYTES_PER_LOGIT) -> int
    resolve_backend(backend, device, dtype) -> "torch" | "triton"

``tiles`` imports neither torch nor triton; triton is imported only when the triton backend runs.
"""
from .logprobs import DEFAULT_BUDGET_BYTES, resolve_backend, token_logprobs_and_entropy
from .reference import naive_logprobs_and_entropy
from .tiles import (SMEM_DEFAULT, TORCH_BYTES_PER_LOGIT, Tiles, choose_chunk, choose_tiles,
                    estimate_smem, make_tiles)

__all__ = [
    "DEFAULT_BUDGET_BYTES", "SMEM_DEFAULT", "TORCH_BYTES_PER_LOGIT", "Tiles",
    "choose_chunk", "choose_tiles", "estimate_smem", "make_tiles", "naive_logprobs_and_entropy",
    "resolve_backend", "token_logprobs_and_entropy",
]
