"""The `vllm` engine on a CUDA GPU (CC >= 7.0, the CUDA build of vllm): the same log-prob and
weight-sync checks as tests/test_vllm_on_cpu.py, with CUDA graphs and sleep mode on, which the
CPU build cannot exercise. Skips with a reason anywhere else."""

from __future__ import annotations

import copy

import pytest
import torch

from edgerl.rollout.base import SamplingParams
from edgerl.rollout.engine_vllm import VLLMEngine
from vllm_check import PROMPTS, max_diff, needs_platform, perturb, sample, write_tiny_llama

# fp32 on the GPU: vLLM's workers set torch's fp32 matmul precision to "highest" (no TF32), so what is
# left is summation order (cuBLAS and vLLM's attention kernels vs the HF reference on the CPU).
TOL = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    needs_platform("cuda")
    if torch.cuda.get_device_capability() < (7, 0):
        pytest.skip("requires CUDA with CC >= 7.0 for vLLM")
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = write_tiny_llama(folder)   # the reference stays on the CPU, in fp32
    engine = VLLMEngine(folder, dtype="fp32", gpu_memory_utilization=0.2, max_model_len=128,
                        max_num_seqs=16, seed=0, enable_sleep=True)
    return engine, model


def test_logprobs_equal_hf_recomputation_with_cuda_graphs(setup):
    engine, model = setup
    assert not engine.enforce_eager and "CUDA graphs" in engine.describe()
    for t in (1.0, 0.7):
        assert max_diff(model, sample(engine, t), t) < TOL


def test_greedy_equals_hf_generate(setup):
    from edgerl.rollout.engine_hf_generate import HFGenerateEngine
    engine, model = setup
    params = SamplingParams(max_new_tokens=12, greedy=True)
    ref = HFGenerateEngine(model, batch_size=8).generate(PROMPTS, 1, params)
    assert engine.generate(PROMPTS, 1, params).response_ids == ref.response_ids


def test_release_frees_memory_and_sync_after_sleep_lands(setup):
    engine, model = setup
    assert engine.sleep_mode and "sleep level 1" in engine.describe()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.release()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    # 0.2 of the GPU minus a ~2 MB model is nearly all KV cache: most of it must come back
    assert freed > 0.5 * 0.2 * torch.cuda.mem_get_info()[1], f"sleep freed only {freed / 2**30:.2f} GiB"
    before = copy.deepcopy(model)
    perturb(model)
    try:
        engine.sync_weights(model.named_parameters())   # wakes the weights first
        b = sample(engine, seed=9)                      # wakes the KV cache
        assert max_diff(model, b, 1.0) < TOL
        assert max_diff(before, b, 1.0) > 100 * TOL
    finally:
        engine.release()
        engine.sync_weights(before.named_parameters())
        model.load_state_dict(before.state_dict())
    assert max_diff(model, sample(engine, seed=9), 1.0) < TOL
