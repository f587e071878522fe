"""The static engine's turn loop (rollout/turns_static.py) against a full recompute of the conversation, fp32
on the CPU: every turn the engine decodes from its KV cache, with what followed the earlier turns prefilled
into it, equals greedy decoding by the model's forward over the whole conversation so far, token for token;
its log-probs equal the forward's. Rows of different prompt lengths, turns that end by a stop token or at
their limit, continuations of different lengths, episodes that end at different rounds, more rows than
the engine decodes at once, sliding windows, Qwen3's and Gemma 3's layers."""

from __future__ import annotations

import random

import pytest
import torch

from edgerl.rollout import SamplingParams, StaticCacheEngine
from edgerl.rollout.episodes import by_recompute
from rollout_helpers import PROMPTS, tiny_gemma3, tiny_llama, tiny_qwen3

MODELS = {"llama": lambda: tiny_llama(tied=True),
          "qwen3-window": lambda: tiny_qwen3(5, use_sliding_window=True, sliding_window=5, max_window_layers=1),
          "gemma3": lambda: tiny_gemma3()}


class Script:
    """A driver with a fixed script: row r takes turns[r] turns of at most limits[r][k] tokens each, and
    after each turn but its last receives conts[r][k] (its own tokens; the engine treats them as any
    context). A turn cut at its limit continues as well, so both ways a turn ends are exercised."""

    def __init__(self, n: int, seed: int, vocab: int, turn_tokens: int = 7) -> None:
        rnd = random.Random(seed)
        self.turn_tokens = turn_tokens   # the longest turn: the engine's prefill between turns holds rows x this
        self.turns = [rnd.randint(1, 3) for _ in range(n)]
        self.limits = [[rnd.randint(1, 7) for _ in range(t)] for t in self.turns]
        self.conts = [[[rnd.randrange(3, vocab) for _ in range(rnd.randint(1, 9))] for _ in range(t)]
                      for t in self.turns]
        self.got: list[list] = [[] for _ in range(n)]
        self.logprobs: list[list] = [[] for _ in range(n)]

    def limit(self, r: int) -> int:
        k = len(self.got[r])
        return self.limits[r][k] if k < self.turns[r] else 0

    def ended(self, r, tokens, logprobs, truncated) -> None:
        assert len(tokens) <= self.limits[r][len(self.got[r])]
        self.got[r].append(list(tokens))
        self.logprobs[r].append(list(logprobs))

    def next(self, r):
        k = len(self.got[r])
        return None if k >= self.turns[r] else self.conts[r][k - 1]


@torch.no_grad()
def reference(model, prompt: list[int], script: Script, r: int, eos: tuple[int, ...]):
    """Greedy decoding by the model's forward over the whole conversation for each token: the turns, and
    the log-probs of their tokens."""
    seq, turns, lps = list(prompt), [], []
    for k in range(script.turns[r]):
        turn, lp = [], []
        for _ in range(script.limits[r][k]):
            logits = model(torch.tensor([seq + turn])).logits[0, -1].float()
            tok = int(logits.argmax())
            lp.append(float(torch.log_softmax(logits, -1)[tok]))
            turn.append(tok)
            if tok in eos:
                break
        turns.append(turn)
        lps.append(lp)
        seq += turn + (script.conts[r][k] if k + 1 < script.turns[r] else [])
    return turns, lps


def stop_tokens(model, prompts) -> tuple[int, ...]:
    """Two tokens greedy decoding emits early in some rows: turns then end by a stop token as well."""
    with torch.no_grad():
        firsts = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    return tuple(sorted(set(firsts)))[:2]


@pytest.mark.parametrize("name, turn_tokens", [(n, 7) for n in sorted(MODELS)] + [("llama", 1), ("gemma3", 1)])
def test_turns_from_the_kv_cache_equal_a_full_recompute(name, turn_tokens):
    """turn_tokens 1: what follows each turn is prefilled one row at a time (a group of rows holds at most
    rows x turn_tokens tokens), into rows past the first as well."""
    model = MODELS[name]()
    prompts = [p for p in PROMPTS for _ in range(2)]   # 8 rows, decoded 3 at a time
    vocab = model.config.vocab_size
    eos = stop_tokens(model, PROMPTS)
    script = Script(len(prompts), seed=sum(map(ord, name)), vocab=min(vocab, 500), turn_tokens=turn_tokens)
    # the budget (3 turns of 7 and 2 continuations of 9) and one turn more: the sizing the trainer gives it
    eng = StaticCacheEngine(model, 3, max(map(len, prompts)) + 3 * 7 + 2 * 9 + 7, cuda_graphs=False)
    params = SamplingParams(max_new_tokens=7, greedy=True, eos_token_ids=eos, pad_token_id=0)
    info = eng.generate_turns(prompts, params, None, script)
    assert info["rounds"] >= 3 and info["chunks"] == 3
    repacks = info["rounds"] - info["chunks"]   # each chunk's last round ends its episodes: no prefill after it
    assert info["extend_groups"] >= repacks and (turn_tokens > 1 or info["extend_groups"] > repacks)
    stopped = truncated = 0
    for r, p in enumerate(prompts):
        turns, lps = reference(model, p, script, r, eos)
        assert script.got[r] == turns, (r, script.got[r], turns)
        for got, want in zip(script.logprobs[r], lps):
            assert got == pytest.approx(want, abs=1e-4)
        stopped += sum(t[-1] in eos for t in turns)
        truncated += sum(t[-1] not in eos for t in turns)
    assert stopped and truncated   # both ways a turn ends were decoded
    assert torch.isfinite(eng.dec.cache).all()


def test_the_same_turns_through_a_recompute_each_turn():
    """The engine's plain generate over the conversation so far (any engine's way) gives the same turns."""
    model = MODELS["llama"]()
    eos = stop_tokens(model, PROMPTS)
    params = SamplingParams(max_new_tokens=9, greedy=True, eos_token_ids=eos, pad_token_id=0)
    runs = []
    for turns in (True, False):
        script = Script(len(PROMPTS), seed=7, vocab=500)
        eng = StaticCacheEngine(model, 8, 128, cuda_graphs=False)
        if turns:
            eng.generate_turns(PROMPTS, params, None, script)
        else:
            by_recompute(eng, PROMPTS, params, None, script)
        runs.append(script.got)
    assert runs[0] == runs[1]


def test_a_wrong_continuation_in_the_cache_changes_the_log_probs():
    """The comparison can fail: a cache that missed what followed a turn gives other log-probs."""
    model = MODELS["llama"]()
    params = SamplingParams(max_new_tokens=6, greedy=True, eos_token_ids=(), pad_token_id=0)
    script = Script(1, seed=3, vocab=500)
    script.turns, script.limits, script.conts = [2], [[6, 6]], [[[11, 12, 13, 14], [0]]]
    StaticCacheEngine(model, 1, 64, cuda_graphs=False).generate_turns([PROMPTS[0]], params, None, script)
    other = Script(1, seed=3, vocab=500)
    other.turns, other.limits, other.conts = [2], [[6, 6]], [[[11, 12, 13, 15], [0]]]
    _, lps = reference(model, PROMPTS[0], other, 0, ())
    assert max(abs(a - b) for a, b in zip(script.logprobs[0][1], lps[1])) > 1e-3
