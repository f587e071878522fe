"""Chunked token log-probs and entropy in plain torch, and the slab backward both backends share.

The torch path runs everywhere (CPU, Pascal, any float dtype). It is the reference the Triton path is
tested against and the fallback where Triton cannot run. It computes in fp32 (fp64 for fp64 inputs).
A 16-bit weight is upcast a vocabulary tile at a time (`vocab_tile`), never whole: an fp32 copy of a
Llama-3.1-8B head alone is 2.1 GB, a seventh of a T4. The forward runs an online log-sum-exp over the
tiles; the backward takes its slabs a tile of columns at a time.

Shapes: h (N, H), w (V, H), targets (N,) int64; per-token vectors (N,) float32.
z = (h @ w.T) / temperature, lse = logsumexp(z), mz = sum_j softmax(z)_j z_j, entropy = lse - mz.
"""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation whatever the input dtype; fp64 inputs keep fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def vocab_tile(chunk: int, vocab: int, hidden: int) -> int:
    """Vocabulary rows of a 16-bit weight upcast at once: the tile's fp32 copy (tile x H x 4 bytes) and its
    chunk x tile logits and exp (x 8) stay within the chunk x V x 8 bytes of the whole-vocabulary chunk:
    tile = V chunk / (chunk + H), whole multiples of 128 from 256 on."""
    t = max(1, vocab * chunk // (chunk + hidden))
    return min(vocab, t - t % 128 if t >= 256 else t)


def forward_stats_torch(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, inv_temp: float,
                        chunk: int, compute_entropy: bool):
    """Returns logp, entropy (or None) as (N,) float32, and lse, mz (or None) as (N,) in the compute
    dtype, for the backward.

    Works on chunk x V logits at a time: the chunk's logits and one more tile of that shape
    (exp) are the only temporaries that scale with the vocabulary. A weight in another dtype than the
    compute dtype (16 bits) goes through `_forward_tiles` instead, with no whole copy of it.
    """
    cd = compute_dtype(h.dtype)
    if w.dtype != cd:
        return _forward_tiles(h, w, targets, inv_temp, chunk, compute_entropy, cd)
    n = h.shape[0]
    w_c = w
    f32, acc = dict(dtype=torch.float32, device=h.device), dict(dtype=cd, device=h.device)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **acc)
    ent = torch.empty(n, **f32) if compute_entropy else None
    mz = torch.empty(n, **acc) if compute_entropy else None
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        z = torch.mm(h[r0:r1].to(cd), w_c.t())
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        m = z.amax(dim=1, keepdim=True)
        z.sub_(m)  # z - m <= 0: exp cannot overflow however large the logits
        e = torch.exp(z)
        s = e.sum(dim=1)
        log_s = s.log()
        logp[r0:r1] = z.gather(1, targets[r0:r1, None]).squeeze(1) - log_s
        lse[r0:r1] = m.squeeze(1) + log_s
        if compute_entropy:
            # entropy = log s - sum e (z - m) / s, both terms relative to m: no cancellation of large numbers
            t = e.mul_(z).sum(dim=1)
            ent_c = log_s - t / s
            ent[r0:r1] = ent_c
            mz[r0:r1] = lse[r0:r1] - ent_c
    return logp, ent, lse, mz


def _forward_tiles(h, w, targets, inv_temp, chunk, compute_entropy, cd):
    """forward_stats_torch for a 16-bit weight: vocabulary tiles (`vocab_tile`) upcast once each, every
    chunk of tokens against each, with a running maximum m, sum s = sum exp(z - m) and, for the entropy,
    u = sum exp(z - m) (z - m), rescaled when m grows; the target's logit is picked up in its tile."""
    n, vocab = h.shape[0], w.shape[0]
    chunk = min(chunk, n)
    tile = vocab_tile(chunk, vocab, h.shape[1])
    acc = dict(dtype=cd, device=h.device)
    m, s, zt = torch.empty(n, **acc), torch.empty(n, **acc), torch.empty(n, **acc)
    u = torch.empty(n, **acc) if compute_entropy else None
    for c0 in range(0, vocab, tile):
        c1 = min(vocab, c0 + tile)
        w_t = w[c0:c1].to(cd)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            z = torch.mm(h[r0:r1].to(cd), w_t.t())
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            local = targets[r0:r1] - c0
            inside = (local >= 0) & (local < c1 - c0)
            picked = z.gather(1, local.clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
            zt[r0:r1] = picked if c0 == 0 else torch.where(inside, picked, zt[r0:r1])
            mt = z.amax(dim=1)
            if c0 == 0:
                m_new = mt
            else:
                m_old = m[r0:r1]
                m_new = torch.maximum(m_old, mt)
                scale = torch.exp(m_old - m_new)   # <= 1: the sums so far, relative to the new maximum
            z.sub_(m_new[:, None])
            e = torch.exp(z)
            se = e.sum(dim=1)
            ue = e.mul_(z).sum(dim=1) if compute_entropy else None
            if c0 == 0:
                s[r0:r1] = se
                if compute_entropy:
                    u[r0:r1] = ue
            else:
                if compute_entropy:   # sum e (z - m_new) = scale (u + (m_old - m_new) s) over the tiles before
                    u[r0:r1] = scale * (u[r0:r1] + (m_old - m_new) * s[r0:r1]) + ue
                s[r0:r1] = scale * s[r0:r1] + se
            m[r0:r1] = m_new
        del w_t
    log_s = s.log()
    lse = m + log_s
    logp = (zt - lse).float()
    if not compute_entropy:
        return logp, None, lse, None
    ent_c = log_s - u / s
    return logp, ent_c.float(), lse, lse - ent_c


def grad_logits_torch(h_c, w_cols, targets, lse, mz, dlogp, dent, inv_temp, r0, r1, c0, c1):
    """d(loss)/d(logits) for rows [r0, r1) x vocabulary [c0, c1), in h_c's dtype; w_cols: the weight's rows
    c0 .. c1 in h_c's dtype.

    With z = logits / T: d logp/dz_j = onehot_j - p_j and d entropy/dz_j = -p_j (z_j - mz), so
    G_j = [dlogp * onehot_j - p_j (dlogp + dent (z_j - mz))] / T. Temporaries: z and p.
    """
    z = torch.mm(h_c[r0:r1], w_cols.t())
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    p = torch.sub(z, lse[r0:r1, None]).exp_()
    if dent is not None:
        coef = z.sub_(mz[r0:r1, None]).mul_(dent[r0:r1, None])
        if dlogp is not None:
            coef.add_(dlogp[r0:r1, None])
    else:
        coef = dlogp[r0:r1, None]
    g = p.mul_(coef).neg_()
    if dlogp is not None:
        local = targets[r0:r1] - c0
        inside = (local >= 0) & (local < c1 - c0)
        add = torch.where(inside, dlogp[r0:r1], 0.0).to(g.dtype)
        g.scatter_add_(1, local.clamp(0, c1 - c0 - 1)[:, None], add[:, None])
    if inv_temp != 1.0:
        g.mul_(inv_temp)
    return g


def slab_shape(n_tokens: int, vocab: int, chunk: int) -> tuple[int, int]:
    """(rows, cols) of the backward's grad-logits slabs: at most chunk x vocab elements each.

    One of the two gradients gets a contribution from every slab along one axis and must be summed
    in fp32; we sum the smaller one. N <= V (the usual case): slabs span all tokens and a vocabulary
    slice, grad_W slices are written once and grad_h (N x H) is summed. N > V: slabs span `chunk`
    tokens and the whole vocabulary, grad_h rows are written once and grad_W (V x H) is summed.
    """
    if chunk >= n_tokens:
        return n_tokens, vocab
    if n_tokens <= vocab:
        cols = max(1, chunk * vocab // n_tokens)
        if cols >= 256:
            cols -= cols % 128  # whole vocabulary tiles for the Triton kernel
        return n_tokens, min(cols, vocab)
    return chunk, vocab


def backward_tiles(h_c, w, targets, lse, mz, dlogp, dent, inv_temp, chunk: int, need_h: bool, need_w: bool):
    """grad_h (N, H) and grad_w (V, H) in fp32 on the torch path for a 16-bit weight w: vocabulary tiles of
    `vocab_tile` rows upcast once each (the outer loop), slabs of at most chunk + H / 2 tokens inside, so a
    slab's grad-logits and its one temporary (x 8 bytes) and the tile's fp32 copy stay within chunk x V x 8
    bytes. grad_h is summed over the tiles, grad_w (where needed) over the slabs, in fp32. h_c: h in fp32."""
    n, hid = h_c.shape
    vocab = w.shape[0]
    chunk = min(chunk, n)
    cols, rows = vocab_tile(chunk, vocab, hid), min(n, chunk + hid // 2)
    grad_h = torch.empty(n, hid, dtype=h_c.dtype, device=h_c.device) if need_h else None
    grad_w = torch.empty(vocab, hid, dtype=h_c.dtype, device=h_c.device) if need_w else None
    for c0 in range(0, vocab, cols):
        c1 = min(vocab, c0 + cols)
        w_t = w[c0:c1].to(h_c.dtype)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            g = grad_logits_torch(h_c, w_t, targets, lse, mz, dlogp, dent, inv_temp, r0, r1, c0, c1)
            if need_h:
                _accumulate(grad_h[r0:r1], g, w_t, first=c0 == 0)
            if need_w:
                _accumulate(grad_w[c0:c1], g.t(), h_c[r0:r1], first=r0 == 0)
            del g
        del w_t
    return grad_h, grad_w


def _accumulate(dst, a, b, first: bool):
    """dst (fp32 or fp64) = or += a @ b. 16-bit a, b: the matmul accumulates in fp32 inside, then
    its (rows x H) result is rounded once to the input dtype before the fp32 sum."""
    if a.dtype == dst.dtype:
        if first:
            torch.mm(a, b, out=dst)
        else:
            dst.addmm_(a, b)
    elif first:
        dst.copy_(torch.mm(a, b))
    else:
        dst.add_(torch.mm(a, b))


def backward_slabs(h_mm, w_mm, produce, rows: int, cols: int, need_h: bool, need_w: bool,
                   h_dtype: torch.dtype, w_dtype: torch.dtype):
    """grad_h (N, H) = G @ W and grad_w (V, H) = G.T @ h, with G produced one slab at a time.

    produce(r0, r1, c0, c1) returns the grad-logits slab in h_mm's dtype; h_mm, w_mm are the matmul
    operands (the inputs themselves, or their fp32 copies on the torch path). A gradient that gets
    a single contribution per row (column) block is written directly; otherwise it is summed in fp32.
    """
    n, hid = h_mm.shape
    v = w_mm.shape[0]
    acc = torch.float64 if h_mm.dtype == torch.float64 else torch.float32
    one_col, one_row = cols >= v, rows >= n
    grad_h = grad_w = None
    if need_h:
        grad_h = torch.empty(n, hid, dtype=h_mm.dtype if one_col else acc, device=h_mm.device)
    if need_w:
        grad_w = torch.empty(v, hid, dtype=w_mm.dtype if one_row else acc, device=w_mm.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            g = produce(r0, r1, c0, c1)
            if need_h:
                if one_col:
                    torch.mm(g, w_mm, out=grad_h[r0:r1])
                else:
                    _accumulate(grad_h[r0:r1], g, w_mm[c0:c1], first=c0 == 0)
            if need_w:
                if one_row:
                    torch.mm(g.t(), h_mm, out=grad_w[c0:c1])
                else:
                    _accumulate(grad_w[c0:c1], g.t(), h_mm[r0:r1], first=r0 == 0)
            del g
    if grad_h is not None:
        grad_h = grad_h.to(h_dtype)
    if grad_w is not None:
        grad_w = grad_w.to(w_dtype)
    return grad_h, grad_w
