"""token_logprobs_and_entropy: per-token log-prob of the target and entropy, without (N, V) logits.

Forward: an online log-sum-exp over the vocabulary; saves only h, W, targets and two (N,) vectors
(lse and mz = sum_j p_j z_j). Backward: recomputes the logits slab by slab (slab_shape), turns them
into grad-logits G from BOTH outputs' gradients, and accumulates grad_h = G @ W, grad_W = G.T @ h.
"""
from __future__ import annotations

import math

import torch

from . import chunked
from . import triton_impl
from .tiles import TORCH_BYTES_PER_LOGIT, Tiles, choose_chunk

BACKENDS = ("auto", "torch", "triton")
# Temporaries scaling with the vocabulary stay under this by default (chunk=None); the planner
# passes its own chunk from choose_chunk(n_tokens, vocab, budget_bytes).
DEFAULT_BUDGET_BYTES = 32 * 2**20  # bounds the chunk x V temporaries of one slab (bench: bench_logprobs.py)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'triton' on CUDA with CC >= 8.0 and triton importable, else 'torch'.
    'triton' on a setup that cannot run it raises, naming the reason; it never falls back."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < triton_impl.AUTO_MIN_CC:
            return "torch"
        return "torch" if triton_impl.unavailable_reason(device, dtype) else "triton"
    why = triton_impl.unavailable_reason(device, dtype)
    if why:
        raise RuntimeError(f"backend='triton' cannot run: {why}. Use backend='torch' (runs everywhere) "
                           f"or backend='auto'.")
    return "triton"


class _TokenLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, inv_temp, backend, chunk, tiles, compute_entropy):
        if backend == "triton":
            logp, ent, lse, mz = triton_impl.forward_stats_triton(h, w, targets, inv_temp, tiles, compute_entropy)
        else:
            logp, ent, lse, mz = chunked.forward_stats_torch(h, w, targets, inv_temp, chunk, compute_entropy)
        ctx.save_for_backward(h, w, targets, lse, mz)
        ctx.cfg = (inv_temp, backend, chunk, tiles)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its work is skipped
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogp, dent):
        h, w, targets, lse, mz = ctx.saved_tensors
        inv_temp, backend, chunk, tiles = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (dlogp is None and dent is None) or not (need_h or need_w):
            return (None,) * 8
        dlogp = None if dlogp is None else dlogp.reshape(-1).float().contiguous()
        dent = None if dent is None else dent.reshape(-1).float().contiguous()
        rows, cols = chunked.slab_shape(h.shape[0], w.shape[0], chunk)
        if backend == "triton":
            h_mm, w_mm = h, w

            def produce(r0, r1, c0, c1):
                return triton_impl.grad_logits_triton(h, w, targets, lse, mz, dlogp, dent, inv_temp, tiles,
                                                      r0, r1, c0, c1)
        else:
            cd = chunked.compute_dtype(h.dtype)
            h_mm, w_mm = h.to(cd), w
            lse_c, mz_c = lse.to(cd), None if mz is None else mz.to(cd)
            dl_c, de_c = (None if x is None else x.to(cd) for x in (dlogp, dent))
            if w.dtype != cd:   # 16 bits: the weight upcast a vocabulary tile at a time, never whole
                grad_h, grad_w = chunked.backward_tiles(h_mm, w, targets, lse_c, mz_c, dl_c, de_c, inv_temp, chunk,
                                                        need_h, need_w)
                return (None if grad_h is None else grad_h.to(h.dtype), None if grad_w is None else grad_w.to(w.dtype),
                        None, None, None, None, None, None)

            def produce(r0, r1, c0, c1):
                return chunked.grad_logits_torch(h_mm, w_mm[c0:c1], targets, lse_c, mz_c, dl_c, de_c, inv_temp,
                                                 r0, r1, c0, c1)
        grad_h, grad_w = chunked.backward_slabs(h_mm, w_mm, produce, rows, cols, need_h, need_w, h.dtype, w.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _check_inputs(hidden, weight, targets, temperature, chunk):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 or hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden: expected a float tensor (..., H), got "
                        f"{getattr(hidden, 'dtype', type(hidden))} of shape {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight: expected shape (V, {hidden.shape[-1]}) to match hidden's last "
                         f"dimension, got {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"lm_head_weight is {weight.dtype} but hidden is {hidden.dtype}; cast one to the "
                        f"other's dtype first (weight.to(hidden.dtype) keeps the gradient flowing to the weight)")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"hidden on {hidden.device}, lm_head_weight on {weight.device}, targets on "
                         f"{targets.device}: move them to one device")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets: expected token ids (int64), got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r}: must be a finite number > 0")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk={chunk!r}: expected a positive number of tokens, or None to choose one")
    return float(temperature)


def token_logprobs_and_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               temperature: float = 1.0, *, backend: str = "auto", chunk: int | None = None,
                               tiles: Tiles | None = None, compute_entropy: bool = True):
    """Log-prob of each target token and entropy of its distribution, softmax(hidden @ W.T / T).

    hidden (..., H) float (fp32/fp16/bf16; fp64 on the torch backend), lm_head_weight (V, H) of the
    same dtype (under autocast, both are cast to the autocast dtype as a matmul would be; tied or
    not: gradients accumulate into whatever tensor is passed), targets (...) int64
    in [0, V). Returns logprobs, entropy, both (...) float32; entropy is None if compute_entropy=False.
    Differentiable w.r.t. hidden and lm_head_weight through both outputs.

    backend: 'auto' | 'torch' | 'triton'. chunk: tokens per chunk; temporaries that scale with the
    vocabulary stay below about chunk x V elements (x 8 bytes on torch, x the input's element size on
    triton), default from choose_chunk with DEFAULT_BUDGET_BYTES. tiles: Triton tiles, default
    choose_tiles for the device. Peak extra memory (besides outputs and gradients): torch, the chunk's
    temporaries (a 16-bit W is upcast a vocabulary tile at a time, within them), and in the backward fp32
    copies of h and of grad_h for 16-bit inputs; triton, O(N) forward and one slab plus an fp32 (N, H)
    grad_h accumulator in the backward. The naive path needs about 16 x N x V bytes.
    """
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type) and hidden.dtype != lm_head_weight.dtype:
        # what a matmul does under autocast (fp32 master weight, bf16 activations): both to the
        # autocast dtype; the cast is differentiable, so gradients reach the fp32 parameter
        cast = torch.get_autocast_dtype(dev_type)
        hidden, lm_head_weight = hidden.to(cast), lm_head_weight.to(cast)
    temperature = _check_inputs(hidden, lm_head_weight, targets, temperature, chunk)
    lead, hid = hidden.shape[:-1], hidden.shape[-1]
    vocab = lm_head_weight.shape[0]
    h = hidden.reshape(-1, hid)
    if h.stride(1) != 1 or h.stride(0) != hid:
        h = h.contiguous()
    w = lm_head_weight if lm_head_weight.stride(1) == 1 else lm_head_weight.contiguous()
    tg = targets.reshape(-1).to(torch.int64).contiguous()
    n = h.shape[0]
    if n == 0:  # no tokens: empty outputs that still belong to the graph, so .backward() works
        zero = (h.sum() + w.sum()).float() * 0
        empty = torch.zeros(lead, dtype=torch.float32, device=h.device) + zero
        return empty, (empty.clone() if compute_entropy else None)
    lo, hi = torch.aminmax(tg)
    if ((lo < 0) | (hi >= vocab)).item():  # one device sync per call
        bad = int(((tg < 0) | (tg >= vocab)).nonzero()[0, 0])
        raise ValueError(f"targets[{bad}] (flattened) = {int(tg[bad])} is outside the vocabulary [0, {vocab}); "
                         f"mask padding positions with a valid id (e.g. 0) and drop them from the loss")
    resolved = resolve_backend(backend, h.device, h.dtype)
    if resolved == "triton":
        tiles = triton_impl.resolve_tiles(h, vocab, tiles)
        per_logit = triton_impl.slab_bytes_per_logit(h.dtype)
    else:
        per_logit = TORCH_BYTES_PER_LOGIT
    if chunk is None:
        chunk = choose_chunk(n, vocab, DEFAULT_BUDGET_BYTES, bytes_per_logit=per_logit)
    logp, ent = _TokenLogprobEntropy.apply(h, w, tg, 1.0 / temperature, resolved, chunk, tiles, compute_entropy)
    return logp.reshape(lead), (ent.reshape(lead) if ent is not None else None)
