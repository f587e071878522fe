"""The decode-layer kernels (edgerl/kernels/decode_cuda.py, NVRTC) in fp32 and fp16 against float64 references, and
the static engine through them against HF and against its own torch path, on a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from edgerl.rollout import HFGenerateEngine, SamplingParams, StaticCacheEngine
from rollout_helpers import PROMPTS, logprob_gap, tiny_llama, with_lora

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def kernels(dtype=torch.float32):
    from edgerl.kernels import decode_cuda
    why = decode_cuda.unavailable_reason(torch.device("cuda"), 64, dtype, 1)
    if why:
        pytest.fail(f"the decode kernels do not build on this GPU: {why}")
    return decode_cuda


DTYPES = [torch.float32, torch.float16]
# (rtol, atol) against float64: fp32 to rounding; fp16 rounds each output, and an intermediate or two where the
# eager fp16 ops round, to fp16 (2^-11 relative each)
NORM_TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3)}
ATTN_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}
# against torch's own ops in the same dtype: in fp16 up to two ulps (2^-10 relative each), where a sum in
# another order moves an intermediate across a rounding boundary
EAGER_TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3)}


def randn(*shape, g, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 64), (16, 960), (3, 4096), (5, 3584), (2, 4097)])
@pytest.mark.parametrize("with_d", [True, False])
def test_add_rms_norm_equals_the_reference(rows, width, with_d, dtype):
    k = kernels(dtype)
    g = torch.Generator(device="cuda").manual_seed(rows * width)
    x = randn(rows, width, g=g, dtype=dtype, scale=3)
    d = randn(rows, width, g=g, dtype=dtype) if with_d else None
    w = randn(width, g=g, dtype=dtype)
    xo, y = k.add_rms_norm(x, d, w, 1e-5)
    assert xo.dtype == y.dtype == dtype
    rxo, ry = k.reference_add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(xo, x + d if with_d else x)   # the residual add rounds as torch's does
    rtol, atol = NORM_TOL[dtype]
    torch.testing.assert_close(y.double(), ry, rtol=rtol, atol=atol)
    # and as the engine's eager path computes it
    want = w * torch.nn.functional.rms_norm(xo, (width,), eps=1e-5)
    rtol, atol = EAGER_TOL[dtype]
    torch.testing.assert_close(y, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width,wide", [(16, 14336, True), (3, 100, False), (1, 1, False)])
def test_silu_mul_equals_the_reference_and_torch(rows, width, wide, dtype):
    k = kernels(dtype)
    g = torch.Generator(device="cuda").manual_seed(width)
    both = randn(rows, 2 * width, g=g, dtype=dtype, scale=4)
    gate, up = (both[:, :width], both[:, width:]) if wide else (both[:, :width].contiguous(),
                                                               both[:, width:].contiguous())
    y = k.silu_mul(gate, up)
    assert y.dtype == dtype
    rtol, atol = NORM_TOL[dtype]
    torch.testing.assert_close(y.double(), k.reference_silu_mul(gate, up), rtol=rtol, atol=atol / 2)
    rtol, atol = (1e-6, 1e-7) if dtype == torch.float32 else EAGER_TOL[dtype]
    torch.testing.assert_close(y, torch.nn.functional.silu(gate) * up, rtol=rtol, atol=atol)


CASES = [   # rows, KV heads, query heads per KV head, head size, cache length, column written
    (4, 2, 2, 32, 64, 40),
    (16, 8, 4, 128, 336, 300),    # the Llama-3.1-8B head layout, two softmax tiles
    (3, 1, 8, 64, 1040, 1030),    # five tiles
    (2, 4, 7, 128, 80, 9),
    (5, 2, 1, 256, 32, 31),
    (2, 3, 3, 64, 528, 257),      # a second tile of one column
]


SPLIT_CASES = [   # as CASES, and the slice of columns each block of the split kernel attends over
    (16, 2, 6, 128, 2112, 2100, 512),   # Qwen2.5-1.5B's heads at 16 rows, five slices
    (3, 4, 7, 128, 1040, 1030, 300),    # Qwen2.5-7B's heads, slices that are not whole tiles
    (2, 1, 8, 64, 1040, 511, 256),      # the new column the last of a slice, later slices empty
    (2, 3, 3, 64, 528, 512, 512),       # the new column alone in the second slice
    (4, 2, 2, 32, 64, 40, 16),
    (2, 2, 1, 256, 600, 599, 100),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES + SPLIT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_rope_attend_equals_the_reference_and_writes_the_engines_cache_column(case, dtype):
    """Whole (one block per row and KV head) and split into slices of columns merged by a second kernel: the
    rows' windows start anywhere up to the new column, so slices begin at different columns per row. In fp16
    the reference rotates in fp16 with torch's ops (as the engine does), so the cache column is bit for bit."""
    B, KVH, G, D, S, col = case[:6]
    split = case[6] if len(case) > 6 else S
    k = kernels(dtype)
    g = torch.Generator(device="cuda").manual_seed(S + col)
    H = KVH * G
    qkv = randn(B, (H + 2 * KVH) * D, g=g, dtype=dtype)   # the parts as views of one output
    q, kk, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    ang = torch.rand(B, D // 2, device="cuda", generator=g) * 6
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    kc = randn(B, KVH, S, D, g=g, dtype=dtype)
    vc = randn(B, KVH, S, D, g=g, dtype=dtype)
    start = torch.randint(0, col + 1, (B,), device="cuda", generator=g)
    start[0] = 0
    start[-1] = col   # a row that sees only the new column
    colt = torch.tensor([col], device="cuda")
    rk, rv = kc.clone(), vc.clone()
    want, _ = k.reference_rope_attend(q, kk, v, cos, sin, rk, rv, start, colt, D ** -0.5)
    o = k.rope_attend(q, kk, v, cos, sin, kc, vc, start, colt, D ** -0.5, split_columns=split)
    assert o.dtype == dtype
    assert torch.equal(kc, rk) and torch.equal(vc, rv)   # the new column bit for bit, every other one untouched
    rtol, atol = ATTN_TOL[dtype]
    torch.testing.assert_close(o.double(), want, rtol=rtol, atol=atol)
    if split < S:   # and the whole kernel on the same inputs agrees with the split one to rounding
        whole = k.rope_attend(q, kk, v, cos, sin, kc.clone(), vc.clone(), start, colt, D ** -0.5, split_columns=S)
        torch.testing.assert_close(o, whole, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quantum", [64, 8])
@pytest.mark.parametrize("col", [0, 7, 64, 65, 700, 2047])
def test_rope_attend_by_default_spreads_each_rows_columns_over_the_grids_slices(monkeypatch, col, quantum, dtype):
    """The engine's default grid (`slices`: two blocks for each SM) over a 2048-column cache: at every column each
    row's columns [start, col] are cut into the grid's slices (multiples of `quantum` columns), the rows starting
    anywhere, so short rows take fewer slices than long ones; the merged output equals the float64 reference and
    the unsplit kernel's to rounding, and the new column is written once."""
    k = kernels(dtype)
    monkeypatch.setattr(k, "SLICE_COLUMNS", quantum)
    B, KVH, G, D, S = 4, 2, 3, 64, 2048
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert k.slices(B, KVH, S, sms) > 1
    g = torch.Generator(device="cuda").manual_seed(col + quantum)
    H = KVH * G
    q, kk, v = randn(B, (H + 2 * KVH) * D, g=g, dtype=dtype).split([H * D, KVH * D, KVH * D], dim=-1)
    ang = torch.rand(B, D // 2, device="cuda", generator=g) * 6
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    kc, vc = randn(B, KVH, S, D, g=g, dtype=dtype), randn(B, KVH, S, D, g=g, dtype=dtype)
    start = torch.randint(0, col + 1, (B,), device="cuda", generator=g)
    start[0], start[-1] = 0, col
    colt = torch.tensor([col], device="cuda")
    rk, rv = kc.clone(), vc.clone()
    want, _ = k.reference_rope_attend(q, kk, v, cos, sin, rk, rv, start, colt, D ** -0.5)
    o = k.rope_attend(q, kk, v, cos, sin, kc, vc, start, colt, D ** -0.5)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    rtol, atol = ATTN_TOL[dtype]
    torch.testing.assert_close(o.double(), want, rtol=rtol, atol=atol)
    whole = k.rope_attend(q, kk, v, cos, sin, kc.clone(), vc.clone(), start, colt, D ** -0.5, split_columns=S)
    torch.testing.assert_close(o, whole, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES + SPLIT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_rope_attend_over_an_fp16_cache_under_fp32(case):
    """fp32 q, k and v over fp16 caches (plan.kv_cache_dtype=fp16): the new column rounded as torch's cast rounds
    it, the attention over the rounded cache the float64 reference's to fp32 rounding, and against the fp32 cache
    it stands for within the bound its rounding allows: each cached value moves by at most 2^-11 of itself, so a
    score moves by at most e = 2^-11 scale sum_i |q_i k_i|, the weights' sum of changes is at most e^(2e) - 1, and
    the output moves by at most (e^(2e) - 1 + 2^-11) max |v| (the measured error is printed beside the bound)."""
    B, KVH, G, D, S, col = case[:6]
    split = case[6] if len(case) > 6 else S
    k = kernels()
    g = torch.Generator(device="cuda").manual_seed(S + col + 1)
    H, scale = KVH * G, D ** -0.5
    qkv = randn(B, (H + 2 * KVH) * D, g=g, dtype=torch.float32)
    q, kk, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    ang = torch.rand(B, D // 2, device="cuda", generator=g) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)
    kc32, vc32 = randn(B, KVH, S, D, g=g, dtype=torch.float32), randn(B, KVH, S, D, g=g, dtype=torch.float32)
    start = torch.randint(0, col + 1, (B,), device="cuda", generator=g)
    start[0] = 0
    colt = torch.tensor([col], device="cuda")
    kc, vc = kc32.half(), vc32.half()
    rk, rv = kc.clone(), vc.clone()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    want, _ = k.reference_rope_attend(q, kk, v, cos, sin, rk, rv, start, colt, scale)
    o = k.rope_attend(q, kk, v, cos, sin, kc, vc, start, colt, scale, split_columns=split, flag=flag)
    assert o.dtype == torch.float32 and int(flag) == 0
    assert torch.equal(kc, rk) and torch.equal(vc, rv)   # the new column as torch's fp32 -> fp16 cast rounds it
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)
    # against the fp32 cache it stands for
    full, kr = k.reference_rope_attend(q, kk, v, cos, sin, kc32.clone(), vc32.clone(), start, colt, scale)
    qh = q[:, :H * D].double().reshape(B, H, D)
    qr = qh * cos.double()[:, None] + torch.cat((qh[..., D // 2:], qh[..., :D // 2]), -1) * sin.double()[:, None]
    keys = torch.cat((kc32.double(), kr.double()[:, :, None]), 2).abs()            # every column's |k|, the new one too
    e = 2.0 ** -11 * scale * torch.einsum("bhgd,bhsd->bhgs", qr.abs().reshape(B, KVH, G, D), keys).max()
    bound = (torch.exp(2 * e) - 1 + 2.0 ** -11) * torch.cat((vc32.flatten(), v.flatten())).abs().max().double()
    err = (o.double() - full).abs().max()
    print(f"fp16 cache against fp32: max error {float(err):.2e}, bound {float(bound):.2e}")
    assert err <= bound + 1e-5, (float(err), float(bound))


def test_rope_attend_over_an_fp16_cache_flags_a_value_past_its_range():
    k = kernels()
    B, KVH, G, D, S = 2, 2, 2, 64, 96
    g = torch.Generator(device="cuda").manual_seed(3)
    q, kk, v = (randn(B, n * D, g=g, dtype=torch.float32) for n in (KVH * G, KVH, KVH))
    cs = torch.ones(B, D, device="cuda")
    kc, vc = torch.zeros(B, KVH, S, D, device="cuda", dtype=torch.float16), \
        torch.zeros(B, KVH, S, D, device="cuda", dtype=torch.float16)
    start, colt = torch.zeros(B, dtype=torch.long, device="cuda"), torch.tensor([5], device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    k.rope_attend(q, kk, v, cs, cs * 0, kc, vc, start, colt, 0.1, flag=flag)
    assert int(flag) == 0
    v[1, 7] = 7e4   # past fp16's 65504
    k.rope_attend(q, kk, v, cs, cs * 0, kc, vc, start, colt, 0.1, flag=flag)
    assert int(flag) == 1
    with pytest.raises(ValueError, match="needs flag"):
        k.rope_attend(q, kk, v, cs, cs * 0, kc, vc, start, colt, 0.1)


def test_engine_over_an_fp16_cache_samples_near_the_fp32_one_and_stops_on_an_overflow():
    """The engine with plan.kv_cache_dtype=fp16 under fp32: its sampled log-probs against the full fp32 forward,
    and a model whose values pass fp16's range stops the rollout with the setting to change."""
    from edgerl.rollout.decoder import CacheOverflow
    model = with_lora(wide_llama(max_position_embeddings=512))
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, projections="modules", backend="cuda-c",
                               cache_dtype=torch.float16)
    assert engine.dec.cache_dtype == torch.float16 and "in float16" in engine.describe()
    params = SamplingParams(max_new_tokens=280, temperature=0.8, top_p=0.95)
    out = engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    assert engine.dec.cache.dtype == torch.float16
    diff = logprob_gap(model, out, 0.8)
    print(f"fp16 cache: log-prob gap to the fp32 forward max {float(diff.max()):.2e} mean {float(diff.mean()):.2e}")
    assert diff.max() <= 2e-2 and diff.mean() <= 2e-3, (diff.max(), diff.mean())
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            layer.self_attn.v_proj.base_layer.weight.mul_(1e6)
    with pytest.raises(CacheOverflow, match="plan.kv_cache_dtype=fp32"):
        engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="needs decode backend cuda-c"):
        StaticCacheEngine(wide_llama(), 8, 300, cuda_graphs=True, backend="torch", cache_dtype=torch.float16)


def test_rope_attend_refuses_inputs_it_would_misread():
    k = kernels()
    kc = torch.zeros(2, 2, 16, 64, device="cuda")
    q, kv = torch.zeros(2, 4 * 64, device="cuda"), torch.zeros(2, 2 * 64, device="cuda")
    cs, start, col = torch.zeros(2, 64, device="cuda"), torch.zeros(2, dtype=torch.long, device="cuda"), \
        torch.tensor([3], device="cuda")
    with pytest.raises(ValueError, match="k has 1 rows, the cache 2"):
        k.rope_attend(q, kv[:1], kv, cs, cs, kc, kc.clone(), start, col, 0.1)
    with pytest.raises(ValueError, match="cos must be contiguous fp32"):
        k.rope_attend(q, kv, kv, cs[:, :32], cs, kc, kc.clone(), start, col, 0.1)
    with pytest.raises(ValueError, match="head size 48"):
        k.rope_attend(q, kv, kv, cs, cs, torch.zeros(2, 2, 16, 48, device="cuda"),
                      torch.zeros(2, 2, 16, 48, device="cuda"), start, col, 0.1)


def wide_llama(**kw):
    """Heads of 32 (G = 2) or 64 (G = 4): sizes the kernels take (the tests' usual tiny llama has 16)."""
    fields = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    return tiny_llama(device="cuda", **{**fields, **kw})


def greedy(n):
    return SamplingParams(max_new_tokens=n, greedy=True, eos_token_ids=(2,))   # HF generate stops at the model's EOS


@pytest.mark.parametrize("projections", ["fused", "modules"])
@pytest.mark.parametrize("shape", [{}, dict(num_attention_heads=2, num_key_value_heads=1, hidden_size=128)],
                         ids=["d32g2", "d64g2"])
def test_engine_through_the_kernels_equals_hf_and_the_bmm_path(projections, shape):
    model = wide_llama(**shape)
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, projections=projections, backend="cuda-c")
    bmm = StaticCacheEngine(model, 8, 300, cuda_graphs=True, projections=projections, backend="torch")
    assert engine.dec.backend.name == "cuda-c" and "decode backend cuda-c: CUDA C layer kernels" in engine.describe()
    got = engine.generate(PROMPTS, 2, greedy(40))
    assert got.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(40)).response_ids
    assert got.response_ids == bmm.generate(PROMPTS, 2, greedy(40)).response_ids
    eager = StaticCacheEngine(model, 8, 300, cuda_graphs=False, projections=projections, backend="cuda-c")
    assert eager.generate(PROMPTS, 2, greedy(40)).response_ids == got.response_ids


def test_engine_sampled_logprobs_through_the_kernels_match_the_full_forward_past_a_softmax_tile():
    """280 new tokens: the later steps attend over more than one tile of 256 columns."""
    model = with_lora(wide_llama(max_position_embeddings=512))
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, projections="modules", backend="cuda-c")
    params = SamplingParams(max_new_tokens=280, temperature=0.8, top_p=0.95)
    out = engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    assert max(len(r) for r in out.response_ids) == 280
    diff = logprob_gap(model, out, 0.8)
    assert diff.max() <= 1e-4 and diff.mean() <= 1e-5, (diff.max(), diff.mean())


def test_engine_through_the_split_attention_equals_hf_and_the_bmm_path(monkeypatch):
    """Slices of 32 columns: from the 33rd column on, every decode step's attention is split and merged, inside
    the CUDA graph (whose grid is fixed at capture)."""
    from edgerl.kernels import decode_cuda
    monkeypatch.setattr(decode_cuda, "SPLIT_COLUMNS", 32)
    model = wide_llama()
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, backend="cuda-c")
    bmm = StaticCacheEngine(model, 8, 300, cuda_graphs=True, backend="torch")
    got = engine.generate(PROMPTS, 2, greedy(60))
    assert got.response_ids == HFGenerateEngine(model, 8).generate(PROMPTS, 2, greedy(60)).response_ids
    assert got.response_ids == bmm.generate(PROMPTS, 2, greedy(60)).response_ids


def test_engine_refuses_the_cuda_c_backend_in_bf16():
    with pytest.raises(ValueError, match="decode backend 'cuda-c' cannot run here: .*fp32 or fp16 only"):
        StaticCacheEngine(wide_llama().to(torch.bfloat16), 2, 64, cuda_graphs=True, backend="cuda-c")


@pytest.mark.parametrize("split", [None, 32], ids=["whole", "split32"])
def test_engine_in_fp16_through_the_kernels_matches_the_full_forward_as_the_torch_path_does(monkeypatch, split):
    """fp16, what a Volta or Turing plan computes in: the sampled tokens' log-probs against the full forward's
    (HF's fp16 SDPA path) stay within what fp16 rounding moves the torch backend's own (120 new tokens: the
    later steps attend over more than one tile, and split into slices of 32 columns, several)."""
    from edgerl.kernels import decode_cuda
    if split:
        monkeypatch.setattr(decode_cuda, "SPLIT_COLUMNS", split)
    model = wide_llama(max_position_embeddings=512, dtype=torch.float16)
    engine = StaticCacheEngine(model, 8, 300, cuda_graphs=True, backend="cuda-c")
    torch_ops = StaticCacheEngine(model, 8, 300, cuda_graphs=True, backend="torch")
    assert "decode backend cuda-c: CUDA C layer kernels" in engine.describe()
    params = SamplingParams(max_new_tokens=120, temperature=0.8, top_p=0.95)
    diffs = []
    for e in (engine, torch_ops):
        out = e.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
        assert max(len(r) for r in out.response_ids) == 120
        diffs.append(logprob_gap(model, out, 0.8))
    ours, theirs = diffs
    assert ours.max() <= max(0.05, 2 * theirs.max()) and ours.mean() <= max(0.005, 2 * theirs.mean()), \
        (ours.max(), ours.mean(), theirs.max(), theirs.mean())
