"""The static engine's turn loop on a GPU: decode steps replayed from CUDA graphs, through each decode
backend that runs here, against a full recompute of the conversation (fp32, token for token)."""

from __future__ import annotations

import pytest
import torch

from edgerl.rollout import SamplingParams, StaticCacheEngine
from edgerl.rollout.decoder import DecodeKernelUnavailable
from rollout_helpers import PROMPTS, tiny_llama, tiny_qwen3
from test_agents_engine_on_cpu import Script, reference, stop_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


@pytest.mark.parametrize("backend", ["torch", "triton-attention", "triton-layers", "cuda-c"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_turns_with_graphs_equal_a_full_recompute(backend, name):
    model = (tiny_llama(tied=True) if name == "llama" else tiny_qwen3()).cuda()
    prompts = [p for p in PROMPTS for _ in range(2)]
    eos = stop_tokens(model.cpu(), PROMPTS)
    model.cuda()
    try:
        eng = StaticCacheEngine(model, 3, max(map(len, prompts)) + 3 * 7 + 2 * 9 + 7, cuda_graphs=True, backend=backend)
    except DecodeKernelUnavailable as e:
        pytest.skip(str(e))
    script = Script(len(prompts), seed=11, vocab=500)
    params = SamplingParams(max_new_tokens=7, greedy=True, eos_token_ids=eos, pad_token_id=0)
    info = eng.generate_turns(prompts, params, None, script)
    assert info["captures"] > 0 and info["rounds"] >= 3
    cpu = model.cpu()
    for r, p in enumerate(prompts):
        turns, _ = reference(cpu, p, script, r, eos)
        assert script.got[r] == turns, (r, script.got[r], turns)
