"""The static engine on SmolLM2-135M-Instruct's real weights on a GPU, as training runs it (decode step in CUDA
graphs), against HF, EOS on, for every decode backend in each dtype it computes in: greedy rows against HF
generate (equal, or apart only where HF's own logits nearly tie), the sampled log-probs against HF's forward on
the same tokens, and finished rows leaving the batch (tests/real_weights.py). The model folder:
$EDGERL_REAL_MODEL, else the embedded model's (bench/gpu_session.sh's tests-real stage converts the carried GGUF).

A backend that cannot run a dtype on this GPU is skipped with the decoder's reason; one that should run here
(the plan's own choice for some card: EXPECTED) and refuses fails."""

from __future__ import annotations

import pytest
import torch

import real_weights as rw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (backend, dtype) the plan picks on some card: torch everywhere; the Triton kernels in 16 bits from CC 7.0
# (bf16 from 8.0); the CUDA C kernels in fp32 and fp16 (edgerl/plan/engines.py)
EXPECTED = {("torch", d) for d in DTYPES} | {(b, d) for b in ("triton-attention", "triton-layers")
                                            for d in ("fp16", "bf16")} | {("cuda-c", "fp32"), ("cuda-c", "fp16")}
# greedy: the largest gap, in HF's own logits, between HF's token and the engine's where they differ; sampled
# log-probs: the largest and the mean gap to HF's forward (fp32 on the GPU: TF32 off, torch's default)
# (on the CPU, torch's kernels: fp32 every row equal, log-probs within 2.5e-5, mean 3.2e-6; bf16 5 of 8 rows equal,
# largest gap 0.19, log-probs within 0.21, mean 0.052; fp16 7 of 8, 0.016, 0.026 and 0.0043)
GREEDY_MARGIN = {"fp32": 2e-3, "fp16": 0.1, "bf16": 0.5}
LOGP_TOL = {"fp32": (1e-3, 1e-4), "fp16": (0.15, 0.01), "bf16": (0.75, 0.08)}


def runnable(backend: str, dtype: str) -> str:
    """Why (backend, dtype) is not expected to run on this GPU ('' when it is)."""
    if (backend, dtype) not in EXPECTED:
        return f"the plan never runs {backend} in {dtype}"
    cc = torch.cuda.get_device_capability()
    if backend.startswith("triton"):
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if cc < ((8, 0) if dtype == "bf16" else (7, 0)):
            return f"{backend} in {dtype} needs CC >= {'8.0' if dtype == 'bf16' else '7.0'}"
    return ""


@pytest.fixture(scope="module", params=sorted(DTYPES))
def loaded(request):
    model, tok = rw.load(DTYPES[request.param], "cuda")
    return request.param, model, rw.chat_prompts(tok, rw.SHORT + rw.LONG)


def engine_for(model, backend: str):
    from edgerl.rollout import StaticCacheEngine
    from edgerl.rollout.decoder import DecodeKernelUnavailable

    def make():
        return StaticCacheEngine(model, 8, 192, cuda_graphs=True, backend=backend)
    try:
        make()
    except DecodeKernelUnavailable as e:
        pytest.fail(f"{backend} should run here and refused: {e}")
    return make


@pytest.mark.parametrize("backend", ["torch", "triton-attention", "triton-layers", "cuda-c"])
def test_greedy_rows_with_eos_agree_with_hf_generate(loaded, backend):
    dtype, model, prompts = loaded
    if why := runnable(backend, dtype):
        pytest.skip(why)
    a = rw.check_greedy(model, engine_for(model, backend), prompts, 48, GREEDY_MARGIN[dtype])
    print(f"{backend} {dtype}: {a.equal_rows}/{a.rows} rows equal, {a.agreed_tokens}/{a.tokens} tokens before a "
          f"difference, largest gap {a.worst_margin:.4f}")
    if dtype == "fp32":
        assert a.equal_rows >= a.rows - 1, a


@pytest.mark.parametrize("backend", ["torch", "triton-attention", "triton-layers", "cuda-c"])
def test_sampled_logprobs_match_hf_forward(loaded, backend):
    dtype, model, prompts = loaded
    if why := runnable(backend, dtype):
        pytest.skip(why)
    gap = rw.check_sampled_logprobs(model, engine_for(model, backend)(), prompts, 32, 2, *LOGP_TOL[dtype])
    print(f"{backend} {dtype}: log-prob gap max {gap.max():.4f}, mean {gap.mean():.5f} over {gap.numel()} tokens")
