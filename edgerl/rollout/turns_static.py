"""The static engine's turn loop for episodes (engine_static.StaticCacheEngine.generate_turns): each row's
KV cache lives through its episode, and what follows a turn (the tools' results, an observation, the
template's header of the next turn) is prefilled into it, so no part of a conversation is computed twice.

Every decoding row writes the same cache column at a step (the decode step's one `col`, which its CUDA
graph and kernels read), and its first column is `start[row]`. A round decodes one turn for every live
row: rows whose turn ended keep stepping on padding (their tools already running: the driver starts a
row's calls the moment its turn is seen to end) until every row has ended its turn or reached its limit.
Then the driver hands over what follows each turn (or ends the episode), and the rows are packed again:
the live ones move to the front and each row's columns shift so that all of them end at one column E,
the longest row's length (K and V keep their rotary positions: a row's start moves with its columns).
The new tokens (the turn's end-of-turn token, which no step has fed yet, then the continuation) are
prefilled into the columns before E by `StaticDecoder.extend`, which reads the row's cached columns, and
the next turn's first token is sampled from the last column's logits.

Rows align at the longest, so a row may decode up to one turn past its budget's end column: the engine's
max_seq_len is the longest prompt + the episode budget + one turn (rollout.max_new_tokens), and the plan
counts that cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import torch

from .base import SamplingParams, cut_at_eos
from .static_mode import CHECK_EVERY, Mode


def run_turns(eng, prompts: list[list[int]], params: SamplingParams, generator, driver) -> dict:
    """Every episode of `driver` on engine `eng` (a StaticCacheEngine), `max_batch` rows at a time."""
    for r, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {r} is empty; every prompt needs at least one token")
        if len(p) + driver.limit(r) > eng.max_seq_len:
            raise ValueError(f"prompt {r} has {len(p)} tokens + a turn of {driver.limit(r)} > the engine's "
                             f"max_seq_len {eng.max_seq_len}")
    need, eos, info = eng._begin(len(prompts), params, generator)
    info.update(rounds=0, extend_s=0.0, extend_groups=0, logprobs=True)
    mode = Mode(rows=0, full=0, greedy=params.greedy, top_k=0 if params.greedy else params.top_k,
                 top_p=not params.greedy and params.top_p < 1.0, eos=eos, pad=params.pad_token_id,
                 span=eng.dec.cache_len)
    was_training = eng.model.training
    eng.model.eval()   # LoRA dropout must not act while generating
    try:
        for first in range(0, len(prompts), need):
            rows = list(range(first, min(len(prompts), first + need)))
            if eng.device.type == "cuda":
                with torch.cuda.device(eng.device):
                    _chunk(eng, prompts, rows, mode, driver, info)
            else:
                _chunk(eng, prompts, rows, mode, driver, info)
            info["chunks"] += 1
    finally:
        eng.model.train(was_training)
    return info


def _chunk(eng, prompts: list[list[int]], rows: list[int], mode, driver, info: dict) -> None:
    s, dec, cuda = eng._state, eng.dec, eng.device.type == "cuda"
    B = len(rows)
    cap = B * driver.turn_tokens   # tokens a prefill between turns holds at once: one turn for each row
    chunk = [list(prompts[r]) for r in rows]
    mode = replace(mode, rows=B, full=B)
    t0 = time.perf_counter()
    width = max(len(p) for p in chunk)
    ids = torch.full((B, width), mode.pad, dtype=torch.long)
    for i, p in enumerate(chunk):   # left padding: every prompt ends at column width - 1
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
    s.start[:B].copy_(torch.tensor([width - len(p) for p in chunk], dtype=torch.long))
    s.orig[:B].copy_(torch.arange(B))
    s.done.fill_(False)
    s.step.zero_()
    logits = eng._prefill(chunk, ids, width, B)
    mode = replace(mode, span=eng._span(width))
    eng._emit(logits, mode)   # the first turn's token 0 comes from the prompt's last column
    s.col.fill_(width)
    if cuda:
        torch.cuda.synchronize(eng.device)
    info["prefill_s"] += time.perf_counter() - t0
    order, end = rows, width   # the episode row each decoding row is; the column the next step writes
    while True:
        limits = [driver.limit(r) for r in order]
        if end + max(limits) - 1 > dec.cache_len:
            raise ValueError(f"the static engine's cache of {dec.cache_len} columns has no room for a turn of "
                             f"{max(limits)} tokens after column {end}; build it with max_seq_len = the longest prompt "
                             "+ the episode budget + one turn")
        turns = _decode_turn(eng, mode, order, limits, end, driver, info)
        info["rounds"] += 1
        after = [driver.next(r) for r in order]   # waits for each row's tools
        live = [i for i, c in enumerate(after) if c is not None]
        if not live:
            return
        t0 = time.perf_counter()
        mode, end, groups = _repack(eng, mode, live, turns, after, end, cap)
        info["extend_groups"] += groups
        if cuda:
            torch.cuda.synchronize(eng.device)
        order = [order[i] for i in live]
        info["extend_s"] += time.perf_counter() - t0


def _decode_turn(eng, mode, order: list[int], limits: list[int], end: int, driver, info: dict) -> list[list[int]]:
    """Decode one turn for every row (token 0 already sampled); each row's turn goes to `driver.ended` as
    soon as it is seen to end (on CUDA every CHECK_EVERY steps, one look late). Returns the turns."""
    s, cuda, m = eng._state, eng.device.type == "cuda", mode.rows
    t0 = time.perf_counter()
    graph = eng._captured(mode, info) if eng.cuda_graphs else None
    turns: list = [None] * m
    steps, pending = 1, deque()

    def report(i: int) -> None:
        toks, lps = s.out_tok[i, :steps].tolist(), s.out_logp[i, :steps].tolist()
        turn, cut = cut_at_eos(toks, mode.eos, limits[i])
        turns[i] = turn
        driver.ended(order[i], turn, lps[:len(turn)], cut)

    def look(flags: list[bool], at: int) -> bool:
        """Report the rows seen done; True when every row is done or at its limit."""
        for i, f in enumerate(flags):
            if turns[i] is None and (f or at >= limits[i]):
                report(i)
        return all(t is not None for t in turns)

    while steps < max(limits):
        flags = None
        if not cuda:
            flags = s.done[:m].tolist()
        elif steps % CHECK_EVERY == 0:
            buf = torch.empty(m, dtype=torch.bool, pin_memory=True)
            buf.copy_(s.done[:m], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            pending.append((buf, ev))
            if len(pending) > 1:
                old, old_ev = pending.popleft()
                old_ev.synchronize()
                flags = old.tolist()
        if flags is not None and look(flags, steps):
            break
        if end + steps - 1 >= mode.span:   # this step writes column end + steps - 1: a wider span
            mode = replace(mode, span=eng._span(end + steps - 1))
            graph = eng._captured(mode, info) if eng.cuda_graphs else None
            info["spans"] += 1
        if graph is not None:
            graph.replay()
        else:
            eng._step(mode)
        steps += 1
        info["row_steps"] += m
    look(s.done[:m].tolist(), steps)   # the rows still out: done now, or at their limit
    info["decode_steps"] += steps - 1
    info["decode_s"] += time.perf_counter() - t0
    return turns


def _repack(eng, mode, live: list[int], turns: list[list[int]], after: list, end: int, cap: int):
    """Move the live rows to the front, each ending at one column E; prefill what follows each turn (`cap`:
    tokens one prefill holds at most); sample the next turn's token 0. Returns (mode, E, the prefills run)."""
    s, dec = eng._state, eng.dec
    starts = s.start[:mode.rows].tolist()
    kept, add = [], []
    for i in live:
        # columns [start, end + len(turn) - 1) hold the row so far; the turn's last token (its end) was never fed
        kept.append(end + len(turns[i]) - 1 - starts[i])
        add.append([turns[i][-1]] + list(after[i]))
    E = max(k + len(a) for k, a in zip(kept, add))
    new_starts = [E - k - len(a) for k, a in zip(kept, add)]
    for j, i in enumerate(live):   # j <= i: a row moves onto one already moved or gone
        dec.move_columns(i, j, starts[i], kept[j], new_starts[j])
    n = len(live)
    idx = torch.tensor(live, device=eng.device)
    s.orig[:n] = s.orig[idx]
    s.start[:n].copy_(torch.tensor(new_starts, dtype=torch.long))
    M = max(len(a) for a in add)
    ids = torch.full((n, M), mode.pad, dtype=torch.long)
    fresh = torch.zeros((n, M), dtype=torch.bool)
    for j, a in enumerate(add):
        ids[j, M - len(a):] = torch.tensor(a, dtype=torch.long)
        fresh[j, M - len(a):] = True
    # in groups of rows of at most `cap` tokens together (the plan's memory model counts that much:
    # edgerl/plan/memory.py, turn_prefill_tokens); a row longer than that goes alone
    per = max(1, cap // M)
    ids, fresh = ids.to(eng.device), fresh.to(eng.device)
    parts = [dec.extend(ids[r:r + per], s.start[r:min(n, r + per)], E - M, fresh[r:r + per], row0=r)
             for r in range(0, n, per)]
    logits = parts[0] if len(parts) == 1 else torch.cat(parts)
    mode = replace(mode, rows=n, span=eng._span(E))
    s.done.fill_(False)
    s.step.zero_()
    eng._emit(logits, mode)
    s.col.fill_(E)
    return mode, E, len(parts)
