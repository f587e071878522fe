"""Long responses on the CPU: attention without an L x L mask (rolled rows, chunked query rows),
against slow references (each row alone through HF's own forward; SDPA over the whole sequence)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from edgerl.models import attention
from edgerl.models.load import PolicyHead, ValueModel, enable_checkpointing
from rollout_helpers import PROMPTS, tiny_llama, tiny_qwen2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import benchlib as bl  # noqa: E402   (glibc's in-use bytes and their peak over aten ops)


def _rows(lens: list[int], R: int = 9, seed: int = 0):
    """Left-padded PROMPTS followed by right-padded random responses of the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    W = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(lens), W + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        p = PROMPTS[i % len(PROMPTS)]
        ids[i, W - len(p):W] = torch.tensor(p)
        ids[i, W:W + n] = torch.randint(3, 500, (n,), generator=g)
        mask[i, W - len(p):W + n] = 1
    return ids, mask, W - 1, ids[:, W:], mask[:, W:].bool()


def _head(model, chunk: int = 0) -> PolicyHead:
    return PolicyHead(model, SimpleNamespace(kernel_backend="torch", logprob_chunk=16, kernel_tiles=None,
                                             share_prompts=False, attention_chunk=chunk))


def _alone(model, ids, mask, start, T):
    """Slow reference: each row without its padding through HF's own forward (logits, log_softmax)."""
    out = torch.zeros(ids.shape[0], T, dtype=torch.float64)
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        first = int(real.nonzero()[0])
        row = ids[b, real][None]
        logits = model(input_ids=row).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        for t in range(T):
            col = start + t - first            # hidden column predicting response token t
            if start + 1 + t < ids.shape[1] and real[start + 1 + t]:
                out[b, t] = lp[col, ids[b, start + 1 + t]]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [0, 3])
def test_rolled_forward_equals_each_row_alone(arch, chunk):
    """The trainer's forward (rows rolled to column 0, no mask; chunk > 0: 3 query rows at a time) gives
    every real response token the log-prob HF's own forward gives the row alone."""
    model = (tiny_llama() if arch == "llama" else tiny_qwen2()).to(torch.float64)
    ids, mask, start, targets, rmask = _rows([9, 4, 1, 7])
    with torch.no_grad():
        lp, _ = _head(model, chunk)(ids, mask, targets, start, 1.0)
        ref = _alone(model, ids, mask, start, targets.shape[1])
    torch.testing.assert_close(lp[rmask].double(), ref[rmask], rtol=0, atol=2e-6)   # log-probs come back in fp32


def test_the_forward_hands_no_mask_to_attention(monkeypatch):
    """No (B, 1, L, L) mask reaches attention: every layer's call takes the causal path."""
    model = tiny_llama().to(torch.float64)
    head = _head(model)
    seen = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **k: seen.append(a[0].shape) or real(*a, **k))
    ids, mask, start, targets, _ = _rows([9, 4, 1])
    with torch.no_grad():
        head(ids, mask, targets, start, 1.0)
    assert len(seen) == model.config.num_hidden_layers and seen[0][2] == ids.shape[1]


@pytest.mark.parametrize("ckpt", [False, True])
def test_rolled_and_chunked_gradients_equal_the_unchunked_ones(ckpt):
    """Gradients through the chunked attention (each chunk recomputed in the backward) equal those of the
    fused path, with and without layer checkpointing."""
    grads = []
    for chunk in (0, 4):
        model = tiny_llama().to(torch.float64)
        if ckpt:
            enable_checkpointing(model)
        model.train()
        ids, mask, start, targets, rmask = _rows([9, 4, 1, 7])
        lp, ent = _head(model, chunk)(ids, mask, targets, start, 0.8)
        ((lp * rmask).sum() + 0.1 * (ent * rmask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize("L,chunk,heads,kv", [(37, 8, 4, 2), (16, 16, 2, 2), (33, 5, 6, 3), (1, 4, 2, 1)])
def test_chunked_causal_attention_equals_sdpa_over_the_whole_sequence(L, chunk, heads, kv):
    g = torch.Generator().manual_seed(L)
    q = torch.randn(2, heads, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = attention.causal_attention(q, k, v, 0.3, chunk)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    rep = heads // kv
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=True, scale=0.3)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=0, atol=1e-12)


def test_roll_left_refuses_holes_in_a_row():
    ids = torch.arange(6)[None]
    with pytest.raises(ValueError, match="contiguous"):
        attention.roll_left(ids, torch.tensor([[0, 1, 0, 1, 1, 0]]))
    rolled, lead = attention.roll_left(ids, torch.tensor([[0, 0, 1, 1, 1, 0]]))
    assert lead.tolist() == [2] and rolled[0, :3].tolist() == [2, 3, 4]


def test_critic_values_equal_the_masked_forward():
    model = tiny_llama().to(torch.float64)
    critic = ValueModel(model).to(torch.float64)
    ids, mask, start, targets, rmask = _rows([9, 4, 1, 7])
    with torch.no_grad():
        v = critic(ids, mask, start, targets.shape[1])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = critic.lm.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        ref = critic.value_head(h[:, start:start + targets.shape[1]]).squeeze(-1)
    torch.testing.assert_close(v[rmask], ref[rmask].float(), rtol=0, atol=1e-6)   # values come back in fp32


def test_offloaded_layer_inputs_give_the_same_gradients_and_leave_the_device():
    """Checkpointed layers whose inputs wait on the host (here a clone: the CPU has no pinned copy) give the
    gradients of plain checkpointing; after the forward no layer input is held on the device, and a forward
    without a backward (a skipped micro-batch) does not confuse the next one."""
    from edgerl.models import offload
    from edgerl.models.load import decoder_layers
    grads, held = [], None
    for off in (False, True):
        model = tiny_llama().to(torch.float64)
        enable_checkpointing(model)
        if off:
            held = offload.enable(decoder_layers(model), torch.device("cpu"))
        model.train()
        ids, mask, start, targets, rmask = _rows([9, 4, 1, 7])
        head = _head(model)
        if off:
            head(ids, mask, targets, start, 0.8)          # no backward: its inputs are dropped at the next forward
        lp, ent = head(ids, mask, targets, start, 0.8)
        if off:
            assert len(held.held) == model.config.num_hidden_layers
            assert all(h.gpu is None and h.host is not None for h in held.held)
        ((lp * rmask).sum() + 0.1 * (ent * rmask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert held.held == []   # the backward took every input back
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)


def _eos_tokens(model, prompts, n=48):
    """Tokens a sampled rollout emits often enough that rows finish at different steps."""
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    import collections
    eng = StaticCacheEngine(model, 16, 96, cuda_graphs=False)
    out = eng.generate(prompts, 4, SamplingParams(max_new_tokens=n, temperature=1.5), torch.Generator().manual_seed(3))
    counts = collections.Counter(t for r in out.response_ids for t in r)
    return tuple(t for t, _ in counts.most_common(12))[4:12]


@pytest.mark.parametrize("greedy", [False, True])
def test_dropping_finished_rows_keeps_every_response_and_log_prob(greedy):
    """Rows that finished (EOS) leave the decode batch; the rollout is the one the engine gives when it
    decodes every row to the end: the same tokens and the same log-probs, row by row (to fp32 rounding: a
    smaller batch's matmuls may round differently)."""
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    model = tiny_llama(seed=5)
    if greedy:   # greedy samples of one prompt are alike: distinct prompts, and EOS at different steps of each
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (10,), generator=g)]
        free = StaticCacheEngine(model, 16, 96, cuda_graphs=False).generate(
            prompts, 1, SamplingParams(max_new_tokens=48, greedy=True), None).response_ids
        eos = tuple({r[3 + 4 * i] for i, r in enumerate(free[:7])})
        samples = 1
    else:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
        eos, samples = _eos_tokens(model, prompts), 4
    params = SamplingParams(max_new_tokens=48, temperature=1.3, top_k=50, top_p=0.95, eos_token_ids=eos,
                            pad_token_id=0, greedy=greedy)
    runs = []
    for drop in (False, True):
        eng = StaticCacheEngine(model, 16, 96, cuda_graphs=False)
        eng.drop_finished = drop
        runs.append(eng.generate(prompts, samples, params, torch.Generator().manual_seed(11)))
    ref, got = runs
    assert got.info["compactions"] >= 1 and got.info["row_steps"] < ref.info["row_steps"]
    lens = [len(r) for r in ref.response_ids]
    assert min(lens) < 48 and len(set(lens)) > 2            # rows finished at different steps
    assert got.response_ids == ref.response_ids and got.truncated == ref.truncated
    for a, b in zip(got.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-6)


def test_the_kv_cache_holds_the_rows_a_call_decodes():
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    eng = StaticCacheEngine(tiny_llama(), 16, 64, cuda_graphs=False)
    eng.generate([PROMPTS[0]], 3, SamplingParams(max_new_tokens=4, greedy=True), None)
    assert eng.dec.cache.shape[2] == 3
    eng.generate([PROMPTS[0]], 5, SamplingParams(max_new_tokens=4, greedy=True), None)   # more rows: a new cache
    assert eng.dec.cache.shape[2] == 5


# --- attention over the columns written so far (torch's ops) -----------------------------------------

def test_a_span_is_above_every_column_a_step_writes_and_within_the_cache():
    """span_for: a multiple of 16 above the written column, never past the cache; under CUDA graphs spans of
    at least SPAN_MIN columns, at most SPANS of them (each is a captured graph), one below 2 x SPAN_MIN."""
    from edgerl.rollout.engine_static import SPAN_MIN, SPANS, span_for, span_step
    for cache_len in (16, 96, 304, 576, 1008, 1024, 1088, 2112, 4352, 8448, 16448, 33024):
        for graphs in (False, True):
            step = span_step(cache_len, graphs)
            assert step % 16 == 0 and step >= (min(SPAN_MIN, cache_len) if graphs else 16)
            spans = sorted({span_for(col, cache_len, step) for col in range(cache_len)})
            assert all(s % 16 == 0 and s <= cache_len for s in spans) and spans[-1] == cache_len
            assert all(col < span_for(col, cache_len, step) for col in range(cache_len))
            if graphs:
                widths = [b - a for a, b in zip([0] + spans, spans)]
                assert len(spans) <= SPANS and (min(widths) >= SPAN_MIN or len(spans) == 1), (cache_len, spans)
                assert (len(spans) == 1) == (cache_len < 2 * SPAN_MIN), (cache_len, spans)
    assert span_step(4352, True) == 544 and span_step(2112, True) == 528 and span_step(1008, True) == 1008
    assert span_for(0, 4352, 544) == 544 and span_for(543, 4352, 544) == 544 and span_for(544, 4352, 544) == 1088
    assert span_for(4351, 4352, 544) == 4352


@pytest.mark.parametrize("arch,step", [("llama", 16), ("llama", 48), ("qwen2", 32), ("gemma3", 16)])
def test_attention_over_spans_gives_the_whole_caches_rollout(arch, step):
    """torch's ops attend over the cache columns written so far, widened a span at a time, instead of the
    whole cache: the rollout (sampled, rows finishing at EOS and leaving the batch, Gemma's sliding window
    hiding early columns) is the one the whole cache gives, token for token, log-probs to fp32 rounding."""
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    from rollout_helpers import tiny_gemma3
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}[arch](seed=5)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    params = SamplingParams(max_new_tokens=56, temperature=1.3, top_k=50, top_p=0.95,
                            eos_token_ids=_eos_tokens(model, prompts), pad_token_id=0)
    runs, read = [], []
    for span in (0, step):
        eng = StaticCacheEngine(model, 16, 80, cuda_graphs=False)
        assert eng.span_step == 16   # eager: 16 columns a span
        eng.span_step = span         # 0: the whole cache at every step
        seen, attend = set(), eng.dec.backend.attend
        eng.dec.backend.attend = lambda qkv, step, _f=attend, _s=seen: _s.add(step.kv.shape[3]) or _f(qkv, step)
        runs.append(eng.generate(prompts, 4, params, torch.Generator().manual_seed(11)))
        read.append(sorted(seen))
    ref, got = runs
    W = max(len(p) for p in prompts)
    cols = range(W, W + 55)          # the columns decode steps 1..55 write
    assert read[0] == [80] and read[1] == sorted({min(80, (c // step + 1) * step) for c in cols})
    assert ref.info["spans"] == 0 and got.info["spans"] == len(read[1]) - 1 >= 1
    assert got.info["compactions"] >= 1 and min(len(r) for r in ref.response_ids) < 56
    assert got.response_ids == ref.response_ids and got.truncated == ref.truncated
    for a, b in zip(got.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_decode_step_over_a_span_equals_the_step_over_the_whole_cache(dtype):
    """One decode step of the torch backend (baddbmm in fp32, SDPA in 16 bits) over the first 32 cache
    columns against the same step over all 96, after a prefill of ragged prompts: the same logits, and
    the same cache column written."""
    from edgerl.rollout.decode_backends import DECODE_BACKENDS
    from edgerl.rollout.decoder import StaticDecoder
    model = tiny_llama(seed=3).to(dtype)
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 2, 7]
    W = max(lens)
    ids = torch.zeros(len(lens), W, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, W - n:] = torch.randint(3, 500, (n,), generator=g)
    start = torch.tensor([W - n for n in lens])
    tok = torch.randint(3, 500, (len(lens),), generator=g)
    out = []
    for span in (None, 32):
        dec = StaticDecoder(model, 4, 96, backend=DECODE_BACKENDS["torch"])
        dec.allocate()
        dec.prefill(ids, start)
        for t in range(12):   # columns W .. W + 11 < 32
            logits = dec.decode(tok, torch.tensor([W + t]), start, span)
        out.append((logits, dec.cache.clone()))
    (ref, ref_cache), (got, got_cache) = out
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)


# --- micro-batches by tokens ------------------------------------------------------------------------

def _exp(lens: list[int], P: int = 4, R: int = 10):
    from edgerl.train.experience import Experience
    B = len(lens)
    rmask = torch.zeros(B, R)
    for i, n in enumerate(lens):
        rmask[i, :n] = 1
    ids = torch.arange(B * (P + R)).view(B, P + R)
    mask = torch.cat([torch.ones(B, P), rmask], 1).long()
    return Experience(input_ids=ids, attention_mask=mask, response_ids=ids[:, P:], response_mask=rmask,
                      start=P - 1, scores=torch.zeros(B), old_logp=torch.randn(B, R))


def test_token_micro_batches_against_a_slow_greedy_packing():
    """Consecutive rows while rows x (prompt + the slice's longest response) stays within the budget."""
    from edgerl.train.experience import token_micro_batches
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        lens = torch.randint(1, 11, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        budget = int(torch.randint(14, 80, (1,), generator=g))
        got = token_micro_batches(_exp(lens), budget, 99)
        want, cur = [], []
        for i, n in enumerate(lens):
            if cur and (len(cur) + 1) * (4 + max([lens[j] for j in cur] + [n])) > budget:
                want.append(slice(cur[0], cur[-1] + 1))
                cur = []
            cur.append(i)
        want.append(slice(cur[0], cur[-1] + 1))
        assert got == want
    # full-length responses: exactly budget // (P + R) rows each, as sequence micro-batches
    assert token_micro_batches(_exp([10] * 8), 3 * 14, 99) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert token_micro_batches(_exp([10] * 8), None, 3) == [slice(0, 3), slice(3, 6), slice(6, 8)]


def test_a_trimmed_micro_batch_keeps_every_real_token():
    e = _exp([3, 5, 2]).trimmed()
    assert e.response_ids.shape[1] == 5 and e.input_ids.shape[1] == 4 + 5 and e.old_logp.shape == (3, 5)
    full = _exp([10, 2])
    assert full.trimmed() is full


def test_the_update_by_tokens_takes_the_step_the_update_by_rows_takes():
    """The accumulated gradient of a mini-batch does not depend on how its rows are split and trimmed."""
    from edgerl.train.update import Learner, run_update
    from edgerl.train.optim import StateOffload
    ids, mask, start, targets, rmask = _rows([20, 18, 2, 1, 1, 2], R=20)
    from edgerl.train.experience import Experience
    exp = Experience(input_ids=ids, attention_mask=mask, response_ids=targets, response_mask=rmask.float(),
                     start=start, scores=torch.zeros(6), advantages=torch.randn(6, targets.shape[1]))
    grads = []
    for tokens in (None, 2 * ids.shape[1]):
        model = tiny_llama().to(torch.float64)
        head = _head(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.0)
        seen = []

        def loss_fn(part, epoch, head=head, seen=seen):
            seen.append(part.response_ids.shape)
            lp, _ = head(part.input_ids, part.attention_mask, part.response_ids, part.start, 1.0)
            return -(lp * part.advantages * part.response_mask).sum() / part.response_mask.sum(), {}
        learner = Learner("actor", head, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0),
                          StateOffload(optim, False, False))
        captured = {}
        real_step = optim.step

        def step(*a, captured=captured, model=model, **k):
            captured.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return real_step(*a, **k)
        optim.step = step
        run_update(learner, exp, loss_fn, mini=6, epochs=1, micro=2, agg="token-mean", gen=torch.Generator(),
                   device=torch.device("cpu"), max_grad_norm=1e9, scaler=None, tokens=tokens)
        grads.append(captured)
        if tokens:   # the last four rows are short: they share one micro-batch, trimmed to 2 response columns
            assert [tuple(s) for s in seen] == [(2, 20), (4, 2)]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-9, atol=1e-12, msg=n)


def test_a_mini_batch_whose_rows_are_all_left_out_steps_on_zero_gradients():
    """Every group of the step uniform (algo.skip_uniform_groups): no micro-batch by tokens or by rows,
    and the optimizer steps on zero gradients as it would after computing rows of zero loss."""
    from edgerl.train.experience import Experience, token_micro_batches
    from edgerl.train.optim import StateOffload
    from edgerl.train.update import Learner, run_update
    assert token_micro_batches(_exp([3, 5]).rows(torch.tensor([], dtype=torch.long)), 40, 2) == []
    ids, mask, start, targets, rmask = _rows([4, 3, 2, 1], R=4)
    exp = Experience(input_ids=ids, attention_mask=mask, response_ids=targets, response_mask=rmask.float(),
                     start=start, scores=torch.zeros(4), advantages=torch.zeros(4, targets.shape[1]))
    for tokens in (None, 2 * ids.shape[1]):
        model = tiny_llama().to(torch.float64)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        learner = Learner("actor", _head(model), optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0),
                          StateOffload(optim, False, False))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        calls = []
        out = run_update(learner, exp, lambda part, epoch: calls.append(part) or (None, {}), mini=4, epochs=1,
                         micro=2, agg="token-mean", gen=torch.Generator(), device=torch.device("cpu"),
                         max_grad_norm=1.0, scaler=None, keep=torch.zeros(4, dtype=torch.bool), tokens=tokens)
        assert calls == [] and out.skipped == 0 and out.grad_norms == [0.0]
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# --- the longest response, recommend, and a refusal that names it -------------------------------------

def _p40():
    from edgerl.device.profiles import device_from_profile, get_profile
    from fakes import fake_probe
    sw = fake_probe(None, torch_cuda=None, bitsandbytes="0.50.2").software
    return device_from_profile(get_profile("p40"), sw, 64 * 2**30)


def test_the_longest_response_is_the_last_length_that_plans():
    """Binary search against a slow scan: every multiple of 64 up to the answer plans, the next does not."""
    from edgerl.core.errors import PlanError
    from edgerl.plan.plan import STEP, longest_response
    from edgerl.plan.modelspec import CATALOGUE
    from edgerl.plan.plan import plan
    from edgerl.plan.task import Task
    dev, model = _p40(), CATALOGUE["qwen2.5-1.5b"]
    task = Task(prompt_len=64, response_len=256, prompts_per_step=2, samples_per_prompt=8, lora=False)
    o = {"param_offload": False}   # else FSDP2's CPU offload fits any length on a host with 64 GiB
    n, context = longest_response(dev, model, task, o)
    assert 0 < n < context
    for k in (n - STEP, n):
        plan(dev, model, dataclasses_replace(task, response_len=k), o)
    with pytest.raises(PlanError):
        plan(dev, model, dataclasses_replace(task, response_len=n + STEP), o)


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_recommend_shows_the_longest_response_and_refuses_past_it(monkeypatch):
    import re
    from typer.testing import CliRunner
    import edgerl.config.target
    from edgerl.cli.main import app
    from fakes import fake_probe
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None, bitsandbytes="0.50.2"))
    args = ["recommend", "--gpu", "p40", "--model", "qwen2.5-1.5b", "--prompt-len", "64", "--samples", "8",
            "--prompts", "2", "--no-lora", "--set", "plan.param_offload=false"]
    r = CliRunner().invoke(app, args + ["--response-len", "1024"])
    assert r.exit_code == 0, r.stdout
    m = re.search(r"longest response that fits: (\d+) tokens", r.stdout)
    assert m, r.stdout
    n = int(m.group(1))
    past = CliRunner().invoke(app, args + ["--response-len", str(n + 64)])
    assert past.exit_code == 2
    assert f"the longest response that fits this task here: {n} tokens" in past.output
    assert f"--set rollout.max_new_tokens={n}" in past.output


def test_out_of_memory_writes_oom_json_naming_the_phase_the_estimate_and_the_peak(tiny_llama, tmp_path, monkeypatch):
    import json
    from conftest import prepare_trainer
    from edgerl.train.trainer import TrainingError
    sets = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
            "run.tensorboard=false", "data.num_examples=64", "train.steps=2", "run.save_every=0"]
    t = prepare_trainer(tiny_llama, tmp_path / "run", sets)
    real = t.update

    def update_oom(exp, kl):
        if t.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has ...")
        return real(exp, kl)
    monkeypatch.setattr(t, "update", update_oom)
    with pytest.raises(TrainingError) as e:
        t.run()
    msg = str(e.value)
    est = t.plan.memory.phase_totals()["update"]
    from edgerl.plan.memory import fmt_bytes
    assert "out of memory in step 2, in the update phase" in msg and f"the plan estimated {fmt_bytes(est)}" in msg
    assert "tried to allocate 1.50 GiB" in msg and "that is a bug" in msg and "oom.json" in msg
    record = json.loads((tmp_path / "run" / "oom.json").read_text())
    assert record["phase"] == "update" and record["step"] == 2 and record["estimate_phase_bytes"] == est
    assert record["tried_to_allocate"] == "1.50 GiB" and "reserved_peak" in record["measured"]
    assert record["plan"]["micro_batch"] == t.plan.micro_batch
    assert not list((tmp_path / "run").glob(".oom.json-*"))   # written through a temporary file and a rename


# --- the memory model's per-token terms against what the CPU allocates ------------------------------------

def _malloc_meter():
    used = bl.malloc_meter()
    if used is None:
        pytest.skip("needs glibc's mallinfo2 to read the bytes in use")
    return used


def _measured_policy(h, inter, layers, heads, kv, V, dtype, ckpt, train):
    """A seeded llama of these widths (tied embeddings, fused MLPs) with the trainer's policy head, and its spec."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from edgerl.models.swiglu import fuse_mlps
    from edgerl.plan.modelspec import ModelSpec
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(dtype)
    fuse_mlps(model.model.layers)
    if ckpt:
        enable_checkpointing(model)
    model.train(train)
    head = PolicyHead(model, SimpleNamespace(kernel_backend="torch", logprob_chunk=256, kernel_tiles=None,
                                             share_prompts=False, attention_chunk=0))
    return model, head, ModelSpec("t", "llama", V, h, layers, heads, kv, inter, True)


def _measured_setting(b: int, ckpt: bool, rows: int, **kw):
    """The plan's setting for `_measured_policy`'s micro-steps of `rows` rows (the torch log-prob path, no GPU)."""
    from edgerl.plan.memory import Setting
    return Setting(compute_bytes=b, base_bytes=b, grad_checkpointing=ckpt, swap_models=False, optimizer_offload=False,
                   param_offload=False, micro_batch=rows, score_micro_batch=rows, rollout_batch=rows,
                   logprob_chunk=256, logit_bytes=8, eager_attention=False, cuda=False, head_trains=True, **kw)


@pytest.mark.parametrize("phase,ckpt,dtype", [("update", True, torch.float32), ("update", False, torch.float32),
                                              ("score", False, torch.float32), ("update", True, torch.bfloat16),
                                              ("update", False, torch.bfloat16)])
def test_the_estimate_bounds_what_a_micro_step_allocates(phase, ckpt, dtype):
    """A micro-step of the trainer's forward (and backward) on the CPU, measured from glibc's in-use bytes,
    against the memory model's transient terms for it (activations, backward workspace, attention, log-prob
    pass): never below, and at most 25% above at these small widths (the log-prob chunk is a larger share
    of them than of a real model's)."""
    import gc
    from edgerl.plan.memory import estimate
    used = _malloc_meter()
    h, inter, layers, heads, kv, V, B, P, R = 128, 512, 4, 4, 2, 2048, 2, 32, 2048
    model, head, spec = _measured_policy(h, inter, layers, heads, kv, V, dtype, ckpt, train=phase == "update")
    ids = torch.randint(3, V, (B, P + R))
    mask = torch.ones_like(ids)
    targets = ids[:, P:]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)   # gradients exist from the first micro-step on: the plan counts them apart

    def step():
        if phase == "update":
            lp, ent = head(ids, mask, targets, P - 1, 1.0)
            (lp.sum() + ent.sum()).backward()
        else:
            with torch.no_grad():
                head(ids, mask, targets, P - 1, 1.0)
    step()
    gc.collect()
    measured = bl.peak_in_use(step, used)
    comps = estimate(spec, _measured_setting(dtype.itemsize, ckpt, B, logprob_upcast=True), P, R, 2**40).phases[phase]
    est = sum(comps.get(k, 0) for k in ("activations", "backward workspace", "attention workspace", "log-prob pass"))
    assert measured <= est <= 1.25 * measured, (phase, ckpt, measured, est)


@pytest.mark.parametrize("micro_steps", [1, 2])
def test_one_micro_step_counts_the_gradients_as_the_backward_frees_the_inputs(micro_steps):
    """The update of one optimizer step on the CPU, checkpointed, the gradients None at its start (as after
    every step): with one micro-step the backward allocates a layer's gradients as it frees that layer's
    checkpointed input, and the model counts the larger of the two, not both; from the second micro-step on
    every gradient is whole beside every input. Measured from glibc's in-use bytes (the weights excluded),
    never above the estimate and at most 25% below it. The widths make the layers' gradients (9.4 MB) a
    quarter of the step: counting them whole beside the inputs with one micro-step was 28% over."""
    import gc
    from edgerl.plan.memory import estimate
    used = _malloc_meter()
    h, inter, layers, heads, kv, V, B, P, R = 128, 256, 16, 4, 2, 512, 1, 32, 2048
    model, head, spec = _measured_policy(h, inter, layers, heads, kv, V, torch.float32, ckpt=True, train=True)
    ids = torch.randint(3, V, (B, P + R))
    mask = torch.ones_like(ids)
    targets = ids[:, P:]

    def step():
        for _ in range(micro_steps):
            lp, ent = head(ids, mask, targets, P - 1, 1.0)
            (lp.sum() + ent.sum()).backward()

    step()   # warm the allocator's arenas
    model.zero_grad(set_to_none=True)
    gc.collect()
    measured = bl.peak_in_use(step, used)
    comps = estimate(spec, _measured_setting(4, True, B, mini_batch=B * micro_steps), P, R, 2**40).phases["update"]
    grads = "gradients beyond freed inputs" if micro_steps == 1 else "gradients"
    assert (grads in comps) and ("gradients" in comps) == (micro_steps > 1)
    est = sum(comps.get(k, 0) for k in (grads, "activations", "backward workspace", "attention workspace",
                                        "log-prob pass"))
    assert measured <= est <= 1.25 * measured, (micro_steps, measured, est, comps)
