"""The rollout correction on a CUDA GPU: 16-bit plans turn it on (the engine decodes in 16 bits with CUDA graphs
and edgerl's kernels, the trainer scores with torch's ops), and two steps log finite weights. Skipped without
CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

FAST = ["rollout.max_new_tokens=16", "train.prompts_per_step=2", "rollout.n_samples=4", "run.tensorboard=false",
        "data.num_examples=64", "train.lr=1e-4", "train.steps=2", "run.save_every=0", "run.export_final=false"]


@pytest.mark.parametrize("sets, mode, level", [
    (['plan.dtype="fp16"'], "tis", "token"),                                     # the plan's default
    (['plan.dtype="bf16"', 'algo.rollout_correction="mis"', 'algo.rollout_correction_level="sequence"'],
     "mis", "sequence"),
])
def test_a_16_bit_plan_trains_with_the_correction_and_logs_its_weights(tiny_llama, tmp_path, sets, mode, level):
    from conftest import prepare_trainer
    from edgerl.train.metrics import read_metrics
    if "bf16" in sets[0] and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 needs CC >= 8.0")
    t = prepare_trainer(tiny_llama, tmp_path / "run", [*FAST, *sets])
    assert t.plan.rollout_correction == mode and t.plan.rollout_engine == "static"
    assert "the engine decodes in" in t.plan.reasons["rollout_correction"], t.plan.reasons["rollout_correction"]
    t.run()
    rows = read_metrics(tmp_path / "run")
    share = f"rollout_corr/{'truncated' if mode == 'tis' else 'masked'}"
    assert len(rows) == 2
    for r in rows:
        for key in ("rollout_corr/weight_mean", "rollout_corr/weight_max", share, "rollout/k3_kl", "actor/pg_loss",
                    "actor/grad_norm"):
            assert isinstance(r.get(key), float) and math.isfinite(r[key]), (key, r.get(key))
        assert 0 < r["rollout_corr/weight_max"] <= 2.0 and 0 <= r[share] <= 1
        # the engine's 16-bit log-probs are close to the trainer's: weights near 1, a small KL
        assert abs(r["rollout_corr/weight_mean"] - 1) < 0.1 and r["rollout/k3_kl"] < 1e-2, r
    print(f"\n{mode}/{level} on {torch.cuda.get_device_name()}: "
          + ", ".join(f"{k}={rows[-1][k]:.3g}" for k in ("rollout/k3_kl", "rollout_corr/weight_mean",
                                                         "rollout_corr/weight_max", share)))
