"""The decode step's projection kernel (edgerl/kernels/decode_linear.py) in Triton's CPU interpreter, against
the torch ops it replaces (HF's RMS norm, F.linear, SiLU * up, the residual add), and the static engine
running its Triton layer against its torch layer. The cases run in a child process with
TRITON_INTERPRET=1 (see conftest.run_cases_under_triton_interpreter); the same kernel on a GPU:
tests/test_rollout_cuda.py."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import require_interpreter, run_cases_under_triton_interpreter

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

# (rows, K, N, tiles or None): rows past one block of 16, K not a multiple of BK, N not a multiple of BN;
# the last one computes W x^T (swap)
SHAPES = [(3, 48, 40, None), (16, 200, 72, None), (20, 96, 48, (16, 16, 32, 4, 1, 1)),
          (5, 64, 100, (16, 32, 16, 4, 1, 1, 1))]
KINDS = ["plain", "norm", "norm_bias", "norm_sumsq", "glu", "glu_bias", "glu_sumsq", "residual", "residual_bias"]
CASES = [(kind, s) for kind in KINDS for s in SHAPES]


@pytest.fixture
def interpreted():
    require_interpreter(lambda: importlib.import_module("edgerl.kernels.decode_linear").kernel_module())


def test_cases_run_under_the_interpreter():
    if INTERPRETER:
        pytest.skip("this is the interpreter process itself")
    run_cases_under_triton_interpreter(__file__, "interp", at_least=2 * len(CASES) + 2)


def reference(kind: str, x, w, ln, eps, b, res):
    """The torch ops the kernel replaces, in x's dtype, as HF's llama layer computes them."""
    h = x
    if kind.startswith(("norm", "glu")):
        v = x.float().pow(2).mean(-1, keepdim=True)
        h = ln * (x.float() * torch.rsqrt(v + eps)).to(x.dtype)
    y = F.linear(h, w, b if kind.endswith("bias") else None)
    if kind.startswith("glu"):
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if kind.startswith("residual"):
        y = res + y
    return y


def make(kind, rows, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_w = 2 * N if kind.startswith("glu") else N
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = (torch.randn(n_w, K, generator=g) / K ** 0.5).to(dtype)
    ln = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype)
    b = (0.1 * torch.randn(n_w, generator=g)).to(dtype)
    res = torch.randn(rows, N, generator=g).to(dtype)
    return x, w, ln, 1e-5, b, res


def sumsq_partials(x, parts=3):
    """x's rows' sums of squares as `parts` partial sums over column blocks, (parts, B) fp32."""
    return torch.stack([c.float().square().sum(-1) for c in x.chunk(parts, dim=-1)]).contiguous()


def run(kind, x, w, ln, eps, b, res, tiles):
    from edgerl.kernels.decode_linear import decode_linear
    normed = kind.startswith(("norm", "glu"))
    return decode_linear(x, w, norm=ln if normed else None, eps=eps, bias=b if kind.endswith("bias") else None,
                         residual=res if kind.startswith("residual") else None, glu=kind.startswith("glu"), tiles=tiles,
                         sumsq=sumsq_partials(x) if kind.endswith("sumsq") else None)


@pytest.mark.parametrize("case", CASES, ids=[f"interp-fp32-{k}-{s[0]}x{s[1]}x{s[2]}" for k, s in CASES])
def test_fp32_equals_the_torch_ops(interpreted, case):
    kind, (rows, K, N, tiles) = case
    args = make(kind, rows, K, N, torch.float32)
    got, want = run(kind, *args, tiles), reference(kind, *args)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("case", CASES, ids=[f"interp-bf16-{k}-{s[0]}x{s[1]}x{s[2]}" for k, s in CASES])
def test_bf16_is_within_rounding_of_the_torch_ops(interpreted, case):
    # The interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest: tests/test_rollout_cuda.py
    # checks the kernel there): each of the up to five roundings of a value (normed row, its weight, gate, SiLU,
    # product) truncates, so they add up to a few units in the last place, relative to the values' size.
    kind, (rows, K, N, tiles) = case
    args = make(kind, rows, K, N, torch.bfloat16, seed=1)
    got, want = run(kind, *args, tiles).float(), reference(kind, *args).float()
    assert (got - want).abs().max() <= 2 ** -4 * want.abs().max()


@pytest.mark.parametrize("tiles", [None, (16, 16, 32, 4, 1, 1), (16, 16, 16, 4, 1, 3)],
                         ids=["interp-default", "interp-narrow", "interp-split"])
def test_residual_product_returns_the_new_rows_sums_of_squares(interpreted, tiles):
    """return_sumsq: the (P, B) partials sum to the new rows' sums of squares, and a norm fed them gives what
    the norm computing its own gives (the next layer's q/k/v reads them)."""
    from edgerl.kernels.decode_linear import decode_linear
    x, w, ln, eps, b, res = make("residual", 20, 96, 80, torch.float32)
    out, ss = decode_linear(x, w, residual=res, return_sumsq=True, tiles=tiles)
    assert ss.dtype == torch.float32 and ss.shape[1] == 20
    if tiles is not None:
        assert ss.shape[0] == 80 // tiles[1]   # one partial per program along the output columns
    assert torch.allclose(ss.sum(0), out.square().sum(-1), rtol=1e-5)
    w2 = make("norm", 20, 80, 48, torch.float32, seed=4)[1]
    assert torch.allclose(decode_linear(out, w2, norm=ln[:80], eps=eps, sumsq=ss),
                          decode_linear(out, w2, norm=ln[:80], eps=eps), rtol=1e-5, atol=1e-6)


SPLITS = [("plain", (20, 200, 48, (16, 16, 32, 4, 1, 4))), ("residual", (20, 200, 48, (16, 16, 32, 4, 1, 4))),
          ("residual", (5, 96, 40, (16, 16, 16, 4, 1, 2))), ("plain", (3, 40, 24, (16, 16, 16, 4, 1, 4, 1))),
          ("residual_bias", (20, 200, 48, (16, 16, 32, 4, 1, 4))),
          # the norm before the product and SiLU(gate) * up after it, each slice normalising its columns
          ("norm_sumsq", (20, 200, 48, (16, 16, 32, 4, 1, 4))), ("norm", (3, 40, 24, (16, 16, 16, 4, 1, 2, 1))),
          ("glu", (20, 200, 48, (16, 16, 32, 4, 1, 3))), ("glu_bias", (5, 96, 40, (16, 16, 16, 4, 1, 2))),
          ("glu_sumsq", (16, 200, 72, (16, 32, 32, 4, 1, 4, 1)))]


@pytest.mark.parametrize("case", SPLITS, ids=[f"interp-split-{k}-{s[0]}x{s[1]}x{s[2]}-{s[3][-1]}" for k, s in SPLITS])
def test_split_product_equals_the_torch_ops_and_leaves_its_counters_zero(interpreted, case):
    from edgerl.kernels import decode_linear as dl
    kind, (rows, K, N, tiles) = case
    args = make(kind, rows, K, N, torch.float32)
    got, want = run(kind, *args, tiles), reference(kind, *args)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    assert int(dl._COUNTERS[got.device].abs().sum()) == 0   # ready for the next launch
    assert torch.equal(run(kind, *args, tiles), got)          # and it gives the same sums again


def test_interp_a_wrong_fused_part_is_caught(interpreted):
    """What the fp32 tolerance rules out: the norm weight left out, gate and up swapped."""
    x, w, ln, eps, b, res = make("glu", 16, 200, 72, torch.float32)
    got = run("glu", x, w, ln, eps, b, res, None)
    gate, up = w.chunk(2)
    swapped = reference("glu", x, torch.cat((up, gate)), ln, eps, b, res)
    unweighted = reference("glu", x, w, torch.ones_like(ln), eps, b, res)
    for wrong in (swapped, unweighted):
        assert (got - wrong).abs().max() > 100 * 1e-5


def test_interp_bad_shapes_are_refused_with_the_name(interpreted):
    from edgerl.kernels.decode_linear import decode_linear
    x, w, ln, eps, b, res = make("norm", 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="norm is"):
        decode_linear(x, w, norm=ln[:-1])
    with pytest.raises(ValueError, match="residual is"):
        decode_linear(x, w, residual=res.to(torch.bfloat16))
    with pytest.raises(ValueError, match="sumsq is"):
        decode_linear(x, w, norm=ln, sumsq=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="return_sumsq needs residual"):
        decode_linear(x, w, return_sumsq=True)


@pytest.mark.parametrize("build", ["tiny_llama", "tiny_qwen2"], ids=["interp-llama", "interp-qwen2"])
def test_engine_with_triton_layers_equals_its_torch_layers_fp32(interpreted, build):
    """The same greedy and sampled tokens, and log-probs, as the engine's torch projections around the same
    attention kernel (decode backend triton-attention; qwen2: biases on q, k and v)."""
    import rollout_helpers
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    model = getattr(rollout_helpers, build)()
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95)
    runs = []
    for backend in ("triton-layers", "triton-attention"):
        eng = StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend=backend)
        assert ("Triton layers" in eng.describe()) == (backend == "triton-layers")
        greedy = eng.generate(rollout_helpers.PROMPTS, 2, SamplingParams(max_new_tokens=20, greedy=True)).response_ids
        sampled = eng.generate(rollout_helpers.PROMPTS, 2, params, generator=torch.Generator().manual_seed(3))
        runs.append((greedy, sampled))
    (g1, s1), (g2, s2) = runs
    assert g1 == g2 and s1.response_ids == s2.response_ids
    lp1 = torch.tensor([x for r in s1.logprobs for x in r])
    lp2 = torch.tensor([x for r in s2.logprobs for x in r])
    assert torch.allclose(lp1, lp2, atol=1e-4)


def test_interp_engine_refuses_triton_layers_where_they_cannot_run(interpreted):
    from rollout_helpers import tiny_llama
    from edgerl.rollout import StaticCacheEngine
    from edgerl.rollout.decoder import DecodeKernelUnavailable
    with pytest.raises(DecodeKernelUnavailable, match="'triton-layers' cannot run here: it reads the fused projections"):
        StaticCacheEngine(tiny_llama(), 4, 32, cuda_graphs=False, projections="modules", backend="triton-layers")
    with pytest.raises(DecodeKernelUnavailable, match="'triton-layers' cannot run here: the MLP's activation is not SiLU"):
        StaticCacheEngine(tiny_llama(hidden_act="gelu"), 4, 32, cuda_graphs=False, backend="triton-layers")


def test_interp_the_layers_describe_themselves(interpreted):
    from rollout_helpers import tiny_llama
    from edgerl.rollout import StaticCacheEngine
    eng = StaticCacheEngine(tiny_llama(), 4, 32, cuda_graphs=False, backend="triton-layers")
    assert eng.dec.backend.name == "triton-layers" and "decode backend triton-layers: Triton layers" in eng.describe()
