"""The decode-step attention kernel (edgerl/kernels/decode_attention.py) in Triton's CPU interpreter, against
a float64 reference, and the static engine running it (decode backend triton-attention) against its
torch backend. The cases run in a child
process with TRITON_INTERPRET=1 (see conftest.run_cases_under_triton_interpreter); the same kernel on
a GPU: tests/test_rollout_cuda.py."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from conftest import require_interpreter, run_cases_under_triton_interpreter
from rollout_helpers import (PROMPTS, check_decode_attention_rope, decode_attention_cases, decode_attention_reference,
                             tiny_llama, tiny_qwen2)

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
CASES = decode_attention_cases("cpu")


@pytest.fixture
def interpreted():
    require_interpreter(lambda: importlib.import_module("edgerl.kernels.decode_attention").kernel_module())


def test_cases_run_under_the_interpreter():
    if INTERPRETER:
        pytest.skip("this is the interpreter process itself")
    run_cases_under_triton_interpreter(__file__, "interp", at_least=2 * len(CASES) + 3)


@pytest.mark.parametrize("case", CASES, ids=["interp-" + c[0] for c in CASES])
def test_kernel_equals_the_float64_reference(interpreted, case):
    from edgerl.kernels.decode_attention import decode_attention
    _, q, k, v, start, col, tol = case
    scale = q.shape[-1] ** -0.5
    got = decode_attention(q, k, v, start, col, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    want = decode_attention_reference(q, k, v, start, col, scale)
    assert (got.double() - want).abs().max() <= tol
    # What the tolerance rules out: the same window one column wider (where there is a column to add).
    if int(start.min()) > 0:
        wider = decode_attention_reference(q, k, v, start - 1, col, scale)
        assert (wider - want).abs().max() > 4 * tol


@pytest.mark.parametrize("case", CASES, ids=["interp-rope-" + c[0] for c in CASES])
def test_rope_kernel_rotates_writes_the_column_and_attends(interpreted, case):
    # The interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest, and tests/test_rollout_cuda.py
    # checks the bf16 column bit for bit there).
    check_decode_attention_rope(case, bf16_exact=False)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["interp-llama", "interp-qwen2"])
def test_engine_with_the_kernel_equals_its_torch_backend_fp32(interpreted, build):
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    model = build()
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95)
    runs = []
    for backend in ("triton-attention", "torch"):
        eng = StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend=backend)
        assert f"decode backend {backend}" in eng.describe()
        greedy = eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=20, greedy=True)).response_ids
        sampled = eng.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(3))
        runs.append((greedy, sampled))
    (g2, s2) = runs[-1]
    for g1, s1 in runs[:-1]:
        assert g1 == g2 and s1.response_ids == s2.response_ids
        lp1 = torch.tensor([x for r in s1.logprobs for x in r])
        lp2 = torch.tensor([x for r in s2.logprobs for x in r])
        assert torch.allclose(lp1, lp2, atol=1e-4)


def test_interp_rope_kernel_refuses_inputs_of_the_wrong_rows(interpreted):
    """The kernel launches one program per cache row: a qkv or rotary table with fewer rows than the
    cache would be read past its end, so the op refuses it before launching."""
    from edgerl.kernels.decode_attention import decode_attention_rope
    B, KVH, G, D, S = 3, 2, 2, 16, 32
    k, v = torch.zeros((B, KVH, S, D)), torch.zeros((B, KVH, S, D))
    cos, sin = torch.ones((B, D)), torch.zeros((B, D))
    start, col = torch.zeros(B, dtype=torch.long), torch.tensor([4])
    qkv = torch.randn((B, (G + 2) * KVH * D))
    assert decode_attention_rope(qkv, cos, sin, k, v, start, col, D ** -0.5, G).shape == (B, KVH, G, D)
    for bad in (dict(qkv=qkv[:2]), dict(cos=cos[:2], sin=sin[:2])):
        args = dict(qkv=qkv, cos=cos, sin=sin) | bad
        with pytest.raises(ValueError, match="for each of the cache's 3 rows"):
            decode_attention_rope(args["qkv"], args["cos"], args["sin"], k, v, start, col, D ** -0.5, G)


def test_interp_engine_refuses_a_head_size_the_kernel_lacks(interpreted):
    from edgerl.rollout import StaticCacheEngine
    model = tiny_llama(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)   # head size 24
    with pytest.raises(ValueError, match="head size 24 is not a power of two"):
        StaticCacheEngine(model, 8, 64, cuda_graphs=False, backend="triton-attention")


def test_off_cuda_without_the_interpreter_the_engine_says_why():
    if INTERPRETER:
        pytest.skip("the interpreter runs the kernel on the CPU")
    pytest.importorskip("triton")
    from edgerl.rollout import StaticCacheEngine
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        StaticCacheEngine(tiny_llama(), 8, 64, cuda_graphs=False, backend="triton-attention")
