"""The static engine with the decode step captured in a CUDA graph, against its eager path, HF generate
and a full-forward recomputation: fused and module projections, graphs kept across weight syncs,
release/restore of the weights under kept graphs, LoRA adapters, and the Triton decode backends
(triton-attention, triton-layers; CC >= 7.0 with triton). Tiny models: seconds per test."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from edgerl.rollout import HFGenerateEngine, SamplingParams, StaticCacheEngine
from rollout_helpers import (PROMPTS, check_decode_attention_rope, decode_attention_cases, decode_attention_reference,
                             logprob_gap, next_token_logits, perturbed, recompute_logprobs, tiny_llama, tiny_qwen2,
                             with_lora)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

BUILD = {"llama": tiny_llama, "qwen2": tiny_qwen2}


def greedy(n, eos=()):
    return SamplingParams(max_new_tokens=n, greedy=True, eos_token_ids=tuple(eos))


def engines(model, max_batch=8, max_seq_len=128, **kw):
    return (StaticCacheEngine(model, max_batch, max_seq_len, cuda_graphs=True, **kw),
            StaticCacheEngine(model, max_batch, max_seq_len, cuda_graphs=False, **kw))


def triton_reason():
    if torch.cuda.get_device_capability() < (7, 0):
        return "the Triton decode kernels need CC >= 7.0"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the Triton decode kernels need triton installed"
    return ""


needs_triton = pytest.mark.skipif(torch.cuda.is_available() and bool(triton_reason()),
                                  reason=triton_reason() if torch.cuda.is_available() else "requires CUDA")


def with_sdpa(engine):
    """The torch backend's 16-bit attention (SDPA) on an fp32 model: its code path, checked against HF here."""
    engine.dec.backend.sdpa = True
    return engine


@pytest.mark.parametrize("projections,backend", [("fused", "torch"), ("modules", "torch"), ("fused", "torch-sdpa"),
                                                  pytest.param("fused", "triton-attention", marks=needs_triton)])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_graph_greedy_equals_eager_and_hf_fp32(name, projections, backend):
    model = BUILD[name](device="cuda")
    graph, eager = engines(model, projections=projections, backend=backend.removesuffix("-sdpa"))
    if backend == "torch-sdpa":
        graph, eager = with_sdpa(graph), with_sdpa(eager)
    assert graph.dec.proj[0].kind == projections
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(40))
    got = graph.generate(PROMPTS, 2, greedy(40))
    assert got.response_ids == eager.generate(PROMPTS, 2, greedy(40)).response_ids
    assert got.response_ids == ref.response_ids
    assert got.info["capture_s"] > 0 and graph.describe().startswith("static engine: static KV cache + CUDA graph")
    # Per-row EOS: a token some rows emit and others do not.
    counts = {}
    for r in ref.response_ids:
        for t in set(r[:-2]):
            counts[t] = counts.get(t, 0) + 1
    eos = next(t for t, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c < len(ref.response_ids))
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(40, [eos]))
    got = graph.generate(PROMPTS, 2, greedy(40, [eos]))
    assert got.response_ids == ref.response_ids and got.truncated == ref.truncated
    assert any(not t for t in got.truncated)


def test_graph_stops_early_when_all_rows_are_done():
    model = tiny_llama(device="cuda")
    graph, _ = engines(model, max_seq_len=256)
    first = graph.generate(PROMPTS, 1, greedy(3)).response_ids
    eos = sorted({r[1] for r in first})
    got = graph.generate(PROMPTS, 1, greedy(200, eos))
    assert got.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(200, eos)).response_ids
    assert not any(got.truncated) and got.info["decode_steps"] <= 48   # checks lag by up to 2 x 16 steps


def test_graph_chunks_capture_one_graph_per_batch_size():
    model = tiny_qwen2(device="cuda")
    graph, _ = engines(model, max_batch=3)
    got = graph.generate(PROMPTS, 2, greedy(20))
    assert got.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(20)).response_ids
    assert sorted(m.rows for m in graph._graphs) == [2, 3]


@pytest.mark.parametrize("dtype,atol,mean_tol", [(torch.float32, 1e-4, 1e-5), (torch.bfloat16, 0.15, 0.03)])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_graph_sampled_logprobs_match_full_forward(name, dtype, atol, mean_tol):
    model = BUILD[name](dtype=dtype, device="cuda")
    graph, _ = engines(model)
    params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, eos_token_ids=(7,))
    out = graph.generate(PROMPTS, 4, params, generator=torch.Generator().manual_seed(0))
    ref = recompute_logprobs(model, out.prompt_ids, out.response_ids, 0.8)
    got = torch.tensor([x for row in out.logprobs for x in row])
    want = torch.tensor([x for row in ref for x in row])
    assert got.shape == want.shape and torch.isfinite(got).all()
    diff = (got - want).abs()
    assert diff.max() <= atol and diff.mean() <= mean_tol, (diff.max(), diff.mean())


def test_bf16_graph_equals_bf16_eager_and_mostly_hf():
    model = tiny_llama(dtype=torch.bfloat16, device="cuda")
    graph, eager = engines(model)
    got = graph.generate(PROMPTS, 2, greedy(24)).response_ids
    assert got == eager.generate(PROMPTS, 2, greedy(24)).response_ids   # same kernels, captured or not
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(24)).response_ids
    # bf16 rounding differs between this decoder and HF's SDPA path; the first tokens should agree.
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= len(ref) - 1


def test_graph_sampling_seeds_and_live_top_p():
    model = tiny_qwen2(device="cuda")
    graph, _ = engines(model)
    p = SamplingParams(max_new_tokens=16, temperature=2.0, top_p=0.9)
    a = graph.generate(PROMPTS, 2, p, generator=torch.Generator().manual_seed(3))
    b = graph.generate(PROMPTS, 2, p, generator=torch.Generator().manual_seed(3))
    c = graph.generate(PROMPTS, 2, p, generator=torch.Generator().manual_seed(4))
    assert a.response_ids == b.response_ids and a.response_ids != c.response_ids
    n_graphs = len(graph._graphs)
    # top_p lives in a tensor: a new value reaches the captured graph without a new capture.
    p2 = SamplingParams(max_new_tokens=16, temperature=2.0, top_k=4, top_p=0.3)
    out = graph.generate(PROMPTS, 2, p2, generator=torch.Generator().manual_seed(5))
    p3 = SamplingParams(max_new_tokens=16, temperature=2.0, top_k=4, top_p=0.6)
    graph.generate(PROMPTS, 2, p3, generator=torch.Generator().manual_seed(5))
    assert len(graph._graphs) == n_graphs + 1          # top_k is baked in (one more), top_p is not
    for r, lg in zip(out.response_ids, next_token_logits(model, out.prompt_ids, out.response_ids)):
        allowed = torch.isfinite(TopPLogitsWarper(0.3)(None, TopKLogitsWarper(4)(None, lg / 2.0)))
        assert all(allowed[t, tok] for t, tok in enumerate(r))


def test_graph_sees_synced_weights_and_survives_release():
    model = tiny_llama(device="cuda")
    graph, _ = engines(model)
    before = graph.generate(PROMPTS, 1, greedy(16)).response_ids
    source = tiny_llama()
    with torch.no_grad():
        for q in source.parameters():
            q.add_(0.05 * torch.randn_like(q))
    graph.sync_weights(source.named_parameters())       # CPU tensors, copied in place
    after = graph.generate(PROMPTS, 1, greedy(16)).response_ids
    assert after != before
    assert after == HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(16)).response_ids
    graph.release()
    assert not graph._graphs and graph.dec.cache is None
    assert graph.generate(PROMPTS, 1, greedy(16)).response_ids == after


def test_graph_kept_across_sync_and_rollouts():
    model = tiny_qwen2(device="cuda")
    graph, _ = engines(model)
    first = graph.generate(PROMPTS, 2, greedy(24))
    assert first.info["captures"] == 1
    captured = dict(graph._graphs)
    pool = graph.memory_bytes()["graph_pool"]
    assert pool > 0
    source = perturbed(lambda: tiny_qwen2())
    graph.sync_weights(source.state_dict().items())      # CPU tensors, copied in place into the fused views
    second = graph.generate(PROMPTS, 2, greedy(24))
    assert second.info["captures"] == 0 and not second.info["graphs_dropped"]
    assert all(graph._graphs[m] is g for m, g in captured.items())   # the same graph objects, replayed
    assert second.response_ids != first.response_ids
    assert second.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(24)).response_ids
    assert graph.memory_bytes()["graph_pool"] == pool
    graph.release()
    assert graph.memory_bytes() == {"kv_cache": 0, "state": 0, "graph_pool": 0}


def test_kept_graph_after_release_and_restore_of_the_weights():
    """models.release_weights/restore_weights may put the weights elsewhere; the engine must notice and
    capture again rather than replay a graph that reads freed memory."""
    from edgerl.models.load import release_weights, restore_weights
    model = tiny_llama(device="cuda")
    graph, _ = engines(model)
    graph.generate(PROMPTS, 1, greedy(16))
    before = [p.data_ptr() for p in model.parameters()]
    release_weights(model)
    blocker = torch.empty(sum(p.numel() for p in model.parameters()), device="cuda")   # takes the freed memory
    restore_weights(model)
    source = perturbed(tiny_llama)
    graph.sync_weights(source.named_parameters())
    out = graph.generate(PROMPTS, 1, greedy(16))
    moved = [p.data_ptr() for p in model.parameters()] != before
    assert out.info["graphs_dropped"] == moved and out.info["captures"] == int(moved)
    assert out.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 1, greedy(16)).response_ids
    del blocker


def test_lora_modules_in_a_graph_equal_peft_generate():
    model = with_lora(tiny_llama(7)).to("cuda")
    graph, _ = engines(model)
    assert graph.dec.proj[0].kind == "modules"
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(24)).response_ids
    assert graph.generate(PROMPTS, 2, greedy(24)).response_ids == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_spans_in_graphs_give_the_whole_caches_rollout(dtype):
    """torch's ops attend over the columns written so far, a graph per span (spans of 32 columns here: a new
    graph captured mid-rollout, beside the graphs for fewer rows once rows finish), against the whole cache in
    one graph. fp32 (baddbmm): the same sampled tokens and log-probs; fp16 (SDPA): every sampled log-prob as
    close to a full forward's as the whole cache's are."""
    model = tiny_llama(seed=5, dtype=dtype, device="cuda")
    params = SamplingParams(max_new_tokens=120, temperature=1.3, top_p=0.95, eos_token_ids=(7, 11, 13))
    outs = []
    for spans in (False, True):
        eng = StaticCacheEngine(model, 8, 160, cuda_graphs=True, spans=spans)
        if spans:
            eng.span_step = 32
        outs.append(eng.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0)))
    whole, got = outs
    assert whole.info["spans"] == 0 and got.info["spans"] >= 3 and got.info["captures"] >= 4
    if dtype == torch.float32:
        assert got.response_ids == whole.response_ids
        for a, b in zip(got.logprobs, whole.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
    ours, theirs = logprob_gap(model, got, 1.3), logprob_gap(model, whole, 1.3)
    assert ours.max() <= max(2e-4, 2 * theirs.max()) and ours.mean() <= max(2e-5, 2 * theirs.mean()), \
        (ours.max(), ours.mean(), theirs.max(), theirs.mean())

def test_step_times_with_cuda_events():
    eng = StaticCacheEngine(tiny_llama(device="cuda"), 8, 64, cuda_graphs=True, time_steps=True)
    out = eng.generate(PROMPTS, 1, greedy(12))
    assert len(out.info["step_ms"]) == out.info["decode_steps"] == 11 and min(out.info["step_ms"]) > 0


@needs_triton
@pytest.mark.parametrize("backend", ["triton-attention", "triton-layers"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_triton_graph_equals_eager_and_hf_fp32(name, backend):
    model = BUILD[name](device="cuda")
    graph = StaticCacheEngine(model, 8, 128, cuda_graphs=True, backend=backend)
    eager = StaticCacheEngine(model, 8, 128, cuda_graphs=False)
    check_greedy_equals_eager_and_hf_across_a_sync(name, model, graph, eager)


def check_greedy_equals_eager_and_hf_across_a_sync(name, model, graph, eager):
    """The graph's greedy tokens are the eager engine's and HF generate's, captured once; after a weight sync
    the kept graph gives HF generate's tokens for the new weights without capturing again."""
    got = graph.generate(PROMPTS, 2, greedy(40))
    assert got.info["captures"] == 1
    ref = HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(40)).response_ids
    assert got.response_ids == eager.generate(PROMPTS, 2, greedy(40)).response_ids == ref
    source = perturbed(lambda: BUILD[name]())
    graph.sync_weights(source.state_dict().items())
    again = graph.generate(PROMPTS, 2, greedy(40))
    assert again.info["captures"] == 0
    assert again.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(40)).response_ids


def check_sampled_logprobs_bf16(model, graph):
    """Sampled tokens' log-probs within bf16 rounding of a full forward over the same tokens."""
    params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, eos_token_ids=(7,))
    out = graph.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    ref = recompute_logprobs(model, out.prompt_ids, out.response_ids, 0.8)
    got = torch.tensor([x for row in out.logprobs for x in row])
    want = torch.tensor([x for row in ref for x in row])
    diff = (got - want).abs()
    assert got.shape == want.shape and diff.max() <= 0.15 and diff.mean() <= 0.03, (diff.max(), diff.mean())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton-attention", marks=needs_triton),
                                     pytest.param("triton-layers", marks=needs_triton)])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_graph_sampled_logprobs_bf16_per_backend(name, backend):
    if backend != "torch" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 products need CC >= 8.0")
    model = BUILD[name](dtype=torch.bfloat16, device="cuda")
    graph = StaticCacheEngine(model, 8, 128, cuda_graphs=True, backend=backend)
    assert f"decode backend {backend}" in graph.describe()
    check_sampled_logprobs_bf16(model, graph)


@needs_triton
@pytest.mark.parametrize("kind", ["norm", "norm_bias", "glu", "residual"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_linear_kernel_rounds_as_the_torch_ops(kind, dtype):
    """On a GPU the kernel rounds to nearest where the torch ops do: against the same ops in float64 its error
    is no larger than theirs (up to two more units in the last place of the outputs' typical size: an output
    near zero is a sum that cancelled, whose error is that of its terms), at the 360M shape's q/k/v width."""
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 products need CC >= 8.0")
    from test_decode_linear_on_cpu import make, reference, run
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in make(kind, 16, 960, 1600, dtype, seed=2)]
    got, want = run(kind, *args, None).double(), reference(kind, *args).double()
    exact = reference(kind, *[t.double() if isinstance(t, torch.Tensor) else t for t in args])
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10) * exact.abs().clamp(min=float(exact.abs().mean()))
    assert ((got - exact).abs() <= (want - exact).abs() + 2 * ulp).float().mean() >= 0.999
    assert ((got - want).abs() <= 2 * ulp).float().mean() >= 0.99


@needs_triton
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("kind, k, n", [("residual", 8192, 2048), ("glu_sumsq", 2048, 4096)],
                         ids=["down-1.7b", "gate_up-norm"])
def test_decode_linear_split_product_on_a_gpu(split, kind, k, n):
    """The split inner dimension at the 1.7B shape's down product, and at a gate/up product with its norm (each
    slice normalising its columns, the up partials summed beside the gate's): the same sums on every launch
    (the last program of a tile adds the partials in slice order), within fp32 rounding of the unsplit product,
    and its tile counters back at zero for the next launch."""
    from edgerl.kernels import decode_linear as dl
    from test_decode_linear_on_cpu import make, run
    dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in make(kind, 16, k, n, dtype, seed=5)]
    one = run(kind, *args, (16, 16, 512, 4, 2, 1))
    runs = [run(kind, *args, (16, 16, 512, 4, 2, split)) for _ in range(20)]
    torch.cuda.synchronize()
    assert all(torch.equal(r, runs[0]) for r in runs)
    assert int(dl._COUNTERS[args[0].device].abs().sum()) == 0
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10) * one.float().abs().clamp(min=1e-2)
    assert ((runs[0].float() - one.float()).abs() <= ulp).float().mean() >= 0.99


DA_CASES = decode_attention_cases("cuda") if torch.cuda.is_available() else []


@needs_triton
@pytest.mark.parametrize("case", DA_CASES, ids=[c[0] for c in DA_CASES])
def test_decode_attention_kernel_equals_the_float64_reference(case):
    from edgerl.kernels.decode_attention import decode_attention
    _, q, k, v, start, col, tol = case
    scale = q.shape[-1] ** -0.5
    got = decode_attention(q, k, v, start, col, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert (got.double().cpu() - decode_attention_reference(q, k, v, start, col, scale)).abs().max() <= tol


@needs_triton
@pytest.mark.parametrize("case", DA_CASES, ids=["rope-" + c[0] for c in DA_CASES])
def test_decode_attention_rope_kernel_equals_the_engine_and_the_reference(case):
    check_decode_attention_rope(case, bf16_exact=True)
