"""Decode backend `torch`: the decode step's layers as torch's own ops, on every device.

What the plan picks where no edgerl kernel runs: the CPU, fp16 on Volta and Turing (no Triton below CC
8.0; cuBLAS reaches their tensor cores), and any model or GPU the kernels do not take. On a GPU the
static engine replays the step from a CUDA graph. Attention reads the first S columns of the cache it is
handed (the engine's span: the columns written so far, rounded up) and is baddbmm/softmax/bmm in fp32 and
SDPA in 16 bits: a 16-bit baddbmm rounds the scores to 16 bits before the softmax, where HF's SDPA forward
(what training runs) keeps them in fp32, and a 16-bit bmm agreed with HF's argmax on far fewer tokens
than SDPA did (docs/lab-log.md, 2026-12-01).
"""

from __future__ import annotations

import math

import torch

from .decode_step import LayerStep, sdpa
from .decoder import StaticDecoder


class Backend:
    name = "torch"
    # Attention reads the first S cache columns it is handed (the engine's span: every column written so
    # far, rounded up); the kernels read each row's visible columns only and take the whole cache.
    reads_span = True

    def __init__(self, dec: StaticDecoder) -> None:
        self.dec = dec
        self.sdpa = dec.dtype != torch.float32   # else baddbmm, softmax and bmm
        self.note = f"torch ops ({'SDPA' if self.sdpa else 'baddbmm/softmax/bmm'} attention)"

    def hide(self, first: torch.Tensor, col: torch.Tensor, S: int) -> torch.Tensor:
        """One additive mask for all layers of an attention span (columns first[b] .. col visible of the
        cache's first S columns), so each layer's scores are a single baddbmm: (B, 1, 1, S), or
        (B*KVH, 1, S) for baddbmm."""
        dec, B = self.dec, first.shape[0]
        cols = dec.cols[:S]
        hidden = (cols[None, :] < first[:, None]) | (cols[None, :] > col)               # (B, S)
        zero = torch.zeros((), device=first.device, dtype=dec.dtype)
        bias = torch.where(hidden, -math.inf, zero)[:, None, None, :]                   # (B, 1, 1, S)
        return bias if self.sdpa else bias.expand(B, dec.n_kv, 1, S).reshape(B * dec.n_kv, 1, S)

    def first(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None

    def layer(self, x: torch.Tensor, d: torch.Tensor | None, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, hidden) residual stream; d: the previous layer's MLP output, not yet added (None for the
        first layer); the layer's q/k norms (Qwen3, Gemma 3) and Gemma's post-attention and post-MLP norms where
        `step.norms` has them. Returns (x, d)."""
        dec, proj, n = self.dec, step.proj, step.norms
        if d is not None:
            x = x + d
        B = x.shape[0]
        qkv = proj.qkv(dec.norm(x, n.ln1, n.eps1))                                  # (B, N)
        if n.qk is not None:
            dec.qk_norm(qkv, n.qk)
        o = proj.o(self.attend(qkv, step).reshape(B, dec.q_width))
        x = x + (o if n.post is None else dec.norm(o, n.post[0], n.post[2]))
        m = proj.down(dec.mlp_hidden(x, proj, n.ln2, n.eps2))
        return x, (m if n.post is None else dec.norm(m, n.post[1], n.post[2]))

    def last(self, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return x + d

    def attend(self, qkv: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """The new token's rotary embedding, its k and v written into cache column step.col, and attention over
        the cache's columns step.kv holds (the first S: the engine passes the span it attends over). Returns the
        output heads, (B, KVH, G, D) or (B*KVH, G, D)."""
        dec, B, kv, mask, col = self.dec, qkv.shape[0], step.kv, step.hide, step.col
        dec.rotate(qkv, step.cos, step.sin)
        # k and v sit side by side after q: one copy puts both in the cache column.
        kv.index_copy_(3, col, qkv[:, dec.q_width:].view(B, 2, dec.n_kv, 1, dec.head_dim).transpose(0, 1))
        if self.sdpa:   # q (B, KVH, G, D): each KV head attends for its G query heads
            q = qkv[:, :dec.q_width].view(B, dec.n_kv, dec.group, dec.head_dim)
            return sdpa(q, kv[0], kv[1], mask, dec.scaling, False)
        # GQA without repeat_kv: query heads grouped under their KV head (head h uses KV head h // G)
        BK, S, D = B * dec.n_kv, kv.shape[3], dec.head_dim
        q = qkv[:, :dec.q_width].reshape(BK, dec.group, D)                              # (B*KVH, G, D)
        s = torch.baddbmm(mask, q, kv[0].reshape(BK, S, D).transpose(1, 2), alpha=dec.scaling)
        # HF: softmax in fp32, then cast. A 16-bit softmax computes in fp32 and rounds once: the same
        # values, one kernel fewer.
        p = torch.softmax(s, -1, dtype=torch.float32 if s.dtype == torch.float32 else None)
        return torch.bmm(p, kv[1].reshape(BK, S, D))                                    # (B*KVH, G, D)
