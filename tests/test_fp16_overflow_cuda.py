"""fp16 that cannot overflow silently, on a GPU in real fp16: the tiny Gemma-3-shaped model of
tests/test_fp16_overflow_on_cpu.py (layer 1's MLP scaled past fp16's 65504) trained under the T4 profile,
which plans fp16 compute (emulated on a bigger GPU: the T4's memory, dtype and kernel limits, not its speed).
The calibration streams the layers through the GPU and agrees with the CPU's; the run plans fp32 around the
layer and trains finite; the unscaled model trains in fp16; a run whose calibration missed the overflow stops
in one line naming the layer. Skipped without CUDA."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from edgerl.models.activations import calibrate, first_nonfinite
from edgerl.models.backbone import decoder_layers
from edgerl.plan import fp16
from edgerl.train.metrics import read_metrics
from test_fp16_overflow_on_cpu import FAST, LAYER, cache, models, prompt_ids, train  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
T4 = [s for s in FAST if not s.startswith("run.profile")] + ['run.profile="t4"']


def finite_rows(run: Path) -> list[dict]:
    rows = read_metrics(run)
    for row in rows:
        assert row["rollout/nonfinite_rows"] == 0 and row["actor/skipped_updates"] == 0, row
        assert all(v == v and abs(v) != float("inf") for v in row.values() if isinstance(v, float)), row
    return rows


def test_the_calibration_streams_the_layers_through_the_gpu_and_agrees_with_the_cpu(models):
    ids = prompt_ids(models.scaled)
    gpu = calibrate(str(models.scaled), ids, torch.device("cuda"))
    cpu = calibrate(str(models.scaled), ids, torch.device("cpu"))
    assert [(p.describe(), pytest.approx(p.value, rel=1e-3)) for p in gpu.peaks()] == \
        [(p.describe(), p.value) for p in cpu.peaks()]
    assert gpu.over()[0].describe() == f"layer {LAYER}'s MLP"


def test_the_gpus_fp16_forward_overflows_in_that_layer_and_its_fp32_one_does_not(models):
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([prompt_ids(models.scaled)[0]], device="cuda")
    half = AutoModelForCausalLM.from_pretrained(models.scaled, dtype=torch.float16).cuda()
    found = first_nonfinite(decoder_layers(half), lambda: half(ids))
    assert found is not None and found.describe() == f"layer {LAYER}'s MLP"
    full = AutoModelForCausalLM.from_pretrained(models.scaled, dtype=torch.float32).cuda()
    assert first_nonfinite(decoder_layers(full), lambda: full(ids)) is None


def run_t4(folder: Path, run: Path, *extra: str):
    return train(folder, run, *extra, base=T4)


def test_a_t4_run_of_the_overflowing_model_calibrates_and_trains_finite_in_fp32(models, tmp_path):
    r = run_t4(models.scaled, tmp_path / "run", "train.steps=2")
    assert r.exit_code == 0, r.output
    p = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert p["plan"]["dtype"]["compute"] == "fp32" and f"layer {LAYER}'s MLP" in p["reasons"]["dtype"]
    assert [row["step"] for row in finite_rows(tmp_path / "run")] == [1, 2]


def test_a_t4_run_of_the_unscaled_model_trains_finite_in_fp16(models, tmp_path):
    r = run_t4(models.plain, tmp_path / "run", "train.steps=2")
    assert r.exit_code == 0, r.output
    p = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert p["plan"]["dtype"]["compute"] == "fp16" and p["plan"]["fp16_check"] == "cached calibration"
    rows = finite_rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2] and all("actor/scaler_skips" in row for row in rows)


def test_a_t4_run_whose_calibration_missed_the_overflow_stops_in_one_line_naming_the_layer(models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(models.scaled, folder)
    fp16.write_cached(folder, fp16.ActivationRecord(layers=((("MLP", 1.0),),) * 3, embeddings=1.0, logits=1.0,
                                                    prompts=1, tokens=4, date=fp16.now()))
    r = run_t4(folder, tmp_path / "run", "train.steps=4", "train.max_bad_steps=2")
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert "NaN or infinite in 2 steps in a row" in last and f"layer {LAYER}'s MLP" in last, last
    assert last.endswith("--set plan.dtype=fp32")
