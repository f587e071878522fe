"""The step time estimate (edgerl/plan/timing.py): within 30% of every step measured alone on a Hopper GPU, the
table in docs/benchmarks.md is the code's, and `recommend` prints it."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from edgerl.device.device import Software
from edgerl.device.profiles import device_from_profile, get_profile
from edgerl.plan import timing
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import plan
from edgerl.plan.task import Task

REPO = Path(__file__).resolve().parents[1]
SW = Software(python="3.11", torch="2.7.1+cu126", torch_cuda="12.6", arch_list=("sm_61", "sm_75", "sm_86"),
              libs=(("torch", "2.7.1"), ("transformers", "4.55.0"), ("triton", "3.3.1"), ("bitsandbytes", "0.50.2")))


def _check_module():
    spec = importlib.util.spec_from_file_location("step_time_check", REPO / "bench" / "step_time_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plan(card: str, model: str = "qwen2.5-0.5b", **task):
    return plan(device_from_profile(get_profile(card), SW, 64 << 30), CATALOGUE[model], Task(**task))


def test_every_measured_row_within_30_percent():
    rows = _check_module().estimates()
    assert len(rows) >= 8
    for r in rows:
        err = sum(r["estimate"]) / sum(r["measured"]) - 1
        assert abs(err) <= 0.30, (r["row"], err)


def test_the_benchmarks_table_is_the_codes():
    table = _check_module().table()
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    assert table in doc, "docs/benchmarks.md, Step time estimate: regenerate with python bench/step_time_check.py"


def test_time_grows_with_work_and_falls_with_the_card():
    p40, t4 = _plan("p40"), _plan("t4")
    long = _plan("p40", response_len=1024)
    a, b = timing.for_plan(p40), timing.for_plan(long)
    assert b.rollout_s > 2 * a.rollout_s and b.total_s > a.total_s
    assert timing.for_plan(_plan("rtx4090")).total_s < timing.for_plan(t4).total_s
    big = timing.for_plan(_plan("p40", model="qwen2.5-1.5b"))
    assert big.update_s > a.update_s and big.rollout_s > a.rollout_s


def test_decode_reads_weights_and_cache_once_per_step():
    """The rollout is R decode steps of the per-step time: the roofline's bytes at the stated shares (the P40's
    KV cache in fp16 under fp32 compute: 2 bytes a value, read at the backend's share of the bandwidth)."""
    p = _plan("p40", response_len=512, prompts_per_step=2, samples_per_prompt=4)
    assert p.kv_cache_dtype == "fp16"
    r = timing.rates(p.device, "fp32")
    m = p.model
    w, kv, f = timing.DECODE["cuda-c" if p.decode_backend == "cuda-c" else p.decode_backend]
    rows = p.rollout_batch
    cached = p.task.prompt_len + p.task.response_len / 2
    N = timing.matmul_params(m)
    expect = (N * 4 / (r.bandwidth_gbs * 1e9 * w)
              + rows * m.kv_bytes_per_token(2) * cached / (r.bandwidth_gbs * 1e9 * kv)
              + 2 * N * rows / (r.fp32_tflops * 1e12 * f) + timing.GRAPH_STEP_S + timing.GRAPH_LAYER_S * m.num_layers)
    assert timing.decode_step_s(p.model, p.values, r, rows, cached) == pytest.approx(expect)


def test_unknown_rates_and_the_cpu_say_so():
    p = _plan("p40")
    bare = replace(p.device, memory_bandwidth_gbs=None, fp32_tflops=None, fp16_tflops=None, name="Some GPU",
                   source="spec")
    assert timing.for_plan(replace(p, device=bare)) is None
    assert "not known" in timing.line(replace(p, device=bare))
    assert "CPU" in timing.line(_plan("cpu"))


def test_recommend_prints_the_step_time(tmp_path):
    from typer.testing import CliRunner
    from edgerl.cli.main import app
    res = CliRunner().invoke(app, ["recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b"])
    assert res.exit_code == 0, res.output
    assert "expected step time on Tesla P40:" in res.output and "rollout" in res.output
    res = CliRunner().invoke(app, ["recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--format", "json"])
    doc = json.loads(res.output)
    assert doc["step_time"]["total_s"] > 0 and doc["step_time"]["card"] == "Tesla T4"


def test_the_terms_the_search_weighs_by_hand():
    """What moving checkpointed inputs to host memory, freeing the decode graphs and a micro-batch that leaves SMs
    idle add, against the formulas written out."""
    p = _plan("p40", model="qwen2.5-1.5b", response_len=512, prompts_per_step=2, samples_per_prompt=8)
    m, task = p.model, p.task
    r = timing.rates(p.device, "fp32")
    v = dict(p.values, grad_checkpointing=True, activation_offload=False, rollout_resident=True, rollout_engine="static",
             micro_batch=16)
    base = timing.phases(m, task, v, r)
    # activation offload: 2 copies of tokens x layers x hidden x 4 bytes over PCIe, less what the matmuls hide
    tokens = task.local_sequences * (task.prompt_len + task.response_len)
    moved = 2 * tokens * m.num_layers * m.hidden_size * 4 / (r.pcie_gbs * 1e9)
    N = timing.matmul_params(m)
    matmuls = (3 + 1) * 2 * N * tokens / (r.matmul_tflops * 1e12 * timing.MATMUL)
    off = timing.phases(m, task, dict(v, activation_offload=True), r)
    assert off[2] - base[2] == pytest.approx(max(0.0, moved - matmuls))
    slow = replace(r, pcie_gbs=0.01)              # a link too slow to hide: the copies show
    assert timing.phases(m, task, dict(v, activation_offload=True), slow)[2] > timing.phases(m, task, v, slow)[2]
    # freeing the engine between steps: each pass captures its graph again (two warm-up steps and the capture)
    freed = timing.phases(m, task, dict(v, rollout_resident=False), r)
    passes = -(-task.local_sequences // v["rollout_batch"])
    assert freed[0] - base[0] == pytest.approx(passes * 3 * timing.EAGER_LAYER_S * m.num_layers)
    # a micro-batch of one short sequence fills fewer output tiles than the card has SMs: they wait
    assert timing.under_filled(64, 1536, r.sm_count) == pytest.approx(r.sm_count / (1 * 12))
    assert timing.under_filled(16 * 576, 1536, r.sm_count) == 1.0
    assert timing.under_filled(64, 1536, 0) == 1.0
