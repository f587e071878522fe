"""Shared prompts: a micro-batch's forward computes each distinct prompt once.

A GRPO group's samples share their prompt, so a micro-batch of B rows (prompt width W, response
width R) holds G <= B distinct prompts. Packed, the forward runs on one row of G*W + B*R tokens
instead of B*(W+R): every projection and MLP sees each prompt token once. Attention keeps its
per-sequence meaning: each prompt attends causally within itself; each response attends to its
group's prompt keys, then causally to its own. The answer is the unpacked forward's, up to rounding:
`tests/test_packing_on_cpu.py` checks log-probs and gradients against it.

HF models route attention through `AttentionInterface`: edgerl's wrapper under "sdpa"
(edgerl/models/attention.py) attends packed rows (which carry an `edgerl_layout` keyword). A packed forward passes `Layout.sentinel` as its 4-D
attention mask, which HF passes through as it is; a model whose layers do not hand the keyword on
to attention would reach the wrapper with the sentinel and no layout, and that is an error, never a
silently wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

@dataclass
class Layout:
    """Where a packed row's tokens come from. Row i of the micro-batch is group `group_of[i]`'s prompt
    (packed at [g*W, (g+1)*W)) followed by its own response (at [G*W + i*R, G*W + (i+1)*R))."""
    groups: int
    width: int                   # prompt columns W (left-padded)
    rows: int                    # B
    resp: int                    # response columns R
    group_of: torch.Tensor       # (B,) long
    first_row: torch.Tensor      # (G,) long: the first row of each group (where its prompt is read)
    prompt_keys: torch.Tensor    # (G, W) bool: real prompt tokens
    resp_keys: torch.Tensor      # (B, R) bool: real response tokens
    sentinel: torch.Tensor       # (1, 1, 1, 1): the 4-D mask a packed forward passes
    allowed_prompt: Optional[torch.Tensor] = None   # (G, 1, W, W) bool, built once for every layer
    allowed_resp: Optional[torch.Tensor] = None     # (B, 1, R, W + R) bool

    @property
    def tokens(self) -> int:
        return self.groups * self.width + self.rows * self.resp


def plan_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> Optional[Layout]:
    """The layout of rows (B, W + R) whose first `width` columns are the prompt; None when no two rows
    share a prompt (packing would save nothing)."""
    B = input_ids.shape[0]
    key = torch.cat([input_ids[:, :width], attention_mask[:, :width].to(input_ids.dtype)], 1)
    uniq, group_of = torch.unique(key, dim=0, return_inverse=True)
    G = uniq.shape[0]
    if G == B:
        return None
    first = torch.full((G,), B, dtype=torch.long, device=input_ids.device)
    first.scatter_reduce_(0, group_of, torch.arange(B, device=input_ids.device), "amin")
    mask = attention_mask.bool()
    lay = Layout(G, width, B, input_ids.shape[1] - width, group_of, first, mask[first, :width], mask[:, width:],
                 torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device))
    lay.allowed_prompt, lay.allowed_resp = _masks(lay)
    return lay


def _masks(lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """What each query sees. A prompt query: the real keys of its prompt up to itself. A response query:
    its group's real prompt keys, then its own real keys up to itself. A padding query sees itself as
    well, so its (unused) row stays finite, as the rollout's prefill does."""
    W, R, B, dev = lay.width, lay.resp, lay.rows, lay.group_of.device
    eye_w, eye_r = torch.eye(W, dtype=torch.bool, device=dev), torch.eye(R, dtype=torch.bool, device=dev)
    causal_w, causal_r = eye_w.new_ones(W, W).tril(), eye_r.new_ones(R, R).tril()
    prompt = (causal_w & lay.prompt_keys[:, None, :]) | eye_w                          # (G, W, W)
    own = (causal_r & lay.resp_keys[:, None, :]) | eye_r                               # (B, R, R)
    resp = torch.cat([lay.prompt_keys[lay.group_of][:, None, :].expand(B, R, W), own], -1)
    return prompt[:, None], resp[:, None]


def packed_index(lay: Layout, device: torch.device) -> torch.Tensor:
    """(B, W + R): the packed position of every column of every row."""
    cols = torch.arange(lay.width + lay.resp, device=device)
    prompt = lay.group_of[:, None] * lay.width + cols[None, :lay.width]
    resp = lay.groups * lay.width + torch.arange(lay.rows, device=device)[:, None] * lay.resp + cols[None, :lay.resp]
    return torch.cat([prompt, resp], 1)


def pack(lay: Layout, rows: torch.Tensor) -> torch.Tensor:
    """(B, W + R, ...) per-row values -> (1, G*W + B*R, ...): each group's prompt once, then the responses."""
    return torch.cat([rows[lay.first_row, :lay.width].flatten(0, 1), rows[:, lay.width:].flatten(0, 1)], 0)[None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: Optional[float],
            dropout: float) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:   # grouped-query attention: each KV head serves q.shape[1] / k.shape[1] heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, scale: Optional[float],
                     dropout: float = 0.0) -> torch.Tensor:
    """q (1, H, T, D), k and v (1, KVH, T, D) of a packed row -> (1, T, H, D), HF's attention output layout:
    each prompt attends within itself, each response to its group's prompt keys and its own (`_masks`)."""
    G, W, B, R = lay.groups, lay.width, lay.rows, lay.resp
    GW = G * W

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = t[0, :, :GW].unflatten(1, (G, W)).transpose(0, 1)          # (G, h, W, D)
        r = t[0, :, GW:].unflatten(1, (B, R)).transpose(0, 1)          # (B, h, R, D)
        return p, r

    (qp, qr), (kp, kr), (vp, vr) = split(q), split(k), split(v)
    op = _attend(qp, kp, vp, lay.allowed_prompt, scale, dropout)
    g = lay.group_of
    orr = _attend(qr, torch.cat([kp[g], kr], 2), torch.cat([vp[g], vr], 2), lay.allowed_resp, scale, dropout)
    out = torch.cat([op.transpose(0, 1).flatten(1, 2), orr.transpose(0, 1).flatten(1, 2)], 1)   # (H, T, D)
    return out.permute(1, 0, 2)[None].contiguous()
