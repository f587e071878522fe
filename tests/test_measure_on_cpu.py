"""edgerl.measure on the CPU: the arithmetic with a fake clock, the result check, the cache, the CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch

from edgerl import measure as M
from edgerl.measure import Item, Measurements, MiB

TINY = dict(sizes=(64,), copy_bytes=1 * MiB)


class FakeClock:
    """Runs the work for real but reports `per_call` seconds for it, and advances `now` by as much."""
    def __init__(self, per_call=0.004):
        self.t, self.per_call, self.calls = 0.0, per_call, 0

    def now(self):
        return self.t

    def time(self, fn, host=False):
        fn()
        d = self.per_call[self.calls] if isinstance(self.per_call, list) else self.per_call
        self.calls += 1
        self.t += d
        return d


def sample(uuid="58b3fdb6-aaaa-bbbb-cccc-0123456789ab", torch_version="2.11.0+cu130", **kw) -> Measurements:
    base = dict(
        kind="cuda", name="NVIDIA H200", uuid=uuid, cc=(9, 0), torch=torch_version, cuda="13.0",
        date="2026-12-01T10:00:00+00:00",
        fp32_matmul=Item(51.2, "ok", "TF32 off", "n=8192", 0.0215, 30),
        fp16_matmul=Item(712.4, "ok", "", "n=8192", 0.00154, 30),
        bf16_matmul=Item(705.0, "ok", "", "n=8192", 0.00156, 30),
        memory_copy=Item(4100.0, "ok", "", "512 MiB", 0.000262, 30),
        h2d_pinned=Item(50.0, "ok", "", "256 MiB", 0.00537, 30),
        d2h_pinned=Item(40.0, "ok", "", "256 MiB", 0.00671, 30),
        h2d_pageable=Item(note="not asked for (pageable=False)"),
        d2h_pageable=Item(note="not asked for (pageable=False)"),
        budget_s=30.0, elapsed_s=4.2)
    base.update(kw)
    return Measurements(**base)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path))
    return tmp_path / "bench"


# --- arithmetic with a fake clock -----------------------------------------------------------------

def test_tflops_and_gbs_from_a_fake_clock():
    m = M.measure("cpu", clock=FakeClock(0.004), **TINY)
    # 2 n^3 flops for an n x n matmul: 2 * 64**3 = 524288 flop in 4 ms = 1.31072e8 flop/s
    assert m.fp32_matmul.value == pytest.approx(1.31072e-4)
    assert m.fp32_matmul.size == "n=64" and m.fp32_matmul.seconds == pytest.approx(0.004)
    # a 1 MiB copy reads 1 MiB and writes 1 MiB: 2097152 bytes in 4 ms = 0.524288 GB/s
    assert m.memory_copy.value == pytest.approx(0.524288)
    assert m.memory_copy.size == "1 MiB"


def test_median_ignores_outliers_and_warmup():
    clock = FakeClock([5.0, 0.001, 0.009, 0.004])  # a slow first call (warmup), then three timed ones
    sec, reps = M.time_call(clock, lambda: None, budget_s=1.0)
    assert (sec, reps) == (0.004, 3)


def test_repeats_fit_the_budget():
    # one warmup call of 0.125 s leaves 1.25 s of a 1.375 s budget: 10 repeats
    clock = FakeClock(0.125)
    assert M.time_call(clock, lambda: None, budget_s=1.375, warmup_s=0.0) == (0.125, 10)
    assert clock.calls == 11
    assert M.time_call(FakeClock(0.01), lambda: None, budget_s=10.0, max_repeats=30)[1] == 30
    assert M.time_call(FakeClock(0.5), lambda: None, budget_s=0.1)[1] == 3   # never fewer than 3


def test_warmup_runs_until_its_time_is_spent():
    clock = FakeClock(0.25)
    _, reps = M.time_call(clock, lambda: None, budget_s=0.0, warmup_s=1.0)
    assert clock.calls - reps == 4


def test_budget_skips_what_it_cannot_reach():
    # 0.5 s per call: the fp32 item alone (size probe, warmup, 3 repeats) spends the 2 s budget
    m = M.measure("cpu", budget_s=2.0, clock=FakeClock(0.5), **TINY)
    assert m.fp32_matmul.status == "ok"
    for k in ("bf16_matmul", "memory_copy"):
        assert getattr(m, k).status == "skipped" and "budget of 2 s" in getattr(m, k).note


# --- the result check ------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong", [lambda a, b, out: torch.matmul(a, b.t(), out=out),
                                   lambda a, b, out: out.zero_(),
                                   lambda a, b, out: torch.mul(torch.matmul(a, b), 1.05, out=out)],
                         ids=["transposed", "zeros", "five-percent-off"])
def test_a_wrong_matmul_is_reported_wrong_not_fast(wrong):
    m = M.measure("cpu", clock=FakeClock(0.001), matmul=wrong, **TINY)
    for it in (m.fp32_matmul, m.bf16_matmul):
        assert it.status == "wrong" and it.value is None and it.usable is None
        assert "not counted" in it.note
    assert m.fp32_tflops is None and m.fp16_speedup() is None
    assert "fp32 matmul WRONG RESULTS" in M.summary(m)[1]


def run_on_cpu(cc, matmul=None):
    mm = matmul or (lambda a, b, out: torch.matmul(a, b, out=out))
    return M._Run(torch, "cpu", cc, FakeClock(0.001), mm, 1 << 30, (64,), 0, 0)


def test_fp16_path_checked_like_the_others():
    assert M._matmul_item(run_on_cpu((7, 5)), "fp16", 1.0)["fp16_matmul"].status == "ok"
    # right in the top rows, sign-flipped below: a kernel broken in some tiles only must not pass
    half_wrong = lambda a, b, out: out.copy_(torch.cat([torch.matmul(a[:32], b), -torch.matmul(a[32:], b)]))
    assert M._matmul_item(run_on_cpu((7, 5), half_wrong), "fp16", 1.0)["fp16_matmul"].status == "wrong"


def test_bf16_below_cc8_is_marked_emulated():
    it = M._matmul_item(run_on_cpu((7, 5)), "bf16", 1.0)["bf16_matmul"]
    assert it.status == "emulated" and it.value > 0 and it.usable is None and "sm_75" in it.note
    assert M._matmul_item(run_on_cpu((8, 0)), "bf16", 1.0)["bf16_matmul"].status == "ok"


def test_fp32_measurement_restores_tf32_settings():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        seen = []
        def spy(a, b, out):
            seen.append(torch.get_float32_matmul_precision())
            return torch.matmul(a, b, out=out)
        M.measure("cpu", clock=FakeClock(0.001), matmul=spy, **TINY)
        assert "highest" in seen and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


# --- the real CPU measurement --------------------------------------------------------------------

def test_cpu_measurement_runs_quickly():
    t = time.perf_counter()
    m = M.measure("cpu", budget_s=10.0, item_s=0.5, sizes=(64, 128), copy_bytes=4 * MiB)
    assert time.perf_counter() - t < 10.0 and m.elapsed_s < 10.0
    assert m.kind == "cpu" and m.cc is None and m.uuid.startswith("cpu-")
    assert m.fp32_matmul.status == "ok" and m.fp32_tflops > 0 and m.fp32_matmul.repeats >= 3
    assert m.memory_copy.status == "ok" and m.memory_gbs > 0
    assert m.bf16_matmul.status in ("ok", "failed")  # a CPU without bf16 matmul fails with a note
    assert m.fp16_matmul.status == "skipped" and "CPU" in m.fp16_matmul.note
    assert m.h2d_pinned.status == "skipped" and "no CUDA device" in m.h2d_pinned.note
    assert m.h2d_gbs is None and m.offload_seconds(1e9) is None


def test_import_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, edgerl.measure; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- helpers and summary ---------------------------------------------------------------------------

def test_speedups_and_offload_seconds():
    m = sample()
    assert m.fp16_speedup() == pytest.approx(712.4 / 51.2)
    assert m.bf16_speedup() == pytest.approx(705.0 / 51.2)
    assert m.offload_seconds(2e9) == pytest.approx(0.04)            # 2 GB at 50 GB/s
    assert m.offload_seconds(2e9, "d2h") == pytest.approx(0.05)     # at 40 GB/s
    assert m.offload_seconds(2e9, "round_trip") == pytest.approx(0.09)
    with pytest.raises(ValueError, match="round_trip"):
        m.offload_seconds(1, "sideways")
    t4 = sample(cc=(7, 5), bf16_matmul=Item(12.0, "emulated", "sm_75: emulated"))
    assert t4.bf16_tflops is None and t4.bf16_speedup() is None and t4.bf16_matmul.value == 12.0


def test_summary_lines():
    lines = M.summary(sample(bf16_matmul=Item(12.0, "emulated", "sm_75: no bf16 hardware")))
    assert lines[0] == "NVIDIA H200 (sm_90), torch 2.11.0+cu130, CUDA 13.0, measured 2026-12-01 in 4.2 s"
    assert lines[1] == ("fp32 matmul 51.2 TFLOP/s, fp16 (fp32 accumulate) 712 TFLOP/s, "
                        "bf16 12.0 TFLOP/s (emulated, not used)")
    assert lines[2] == "device memory 4100 GB/s (copy: read + write)"
    assert lines[3] == "host to device 50.0 GB/s, device to host 40.0 GB/s (pinned)"
    assert lines[4:] == ["  bf16: sm_75: no bf16 hardware",
                         "  host to device (pageable): not asked for (pageable=False)",
                         "  device to host (pageable): not asked for (pageable=False)"]


# --- JSON and the cache ----------------------------------------------------------------------------

def test_json_round_trip():
    m = sample()
    back = Measurements.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back == m and back.cc == (9, 0) and isinstance(back.fp32_matmul, Item)


def test_cache_is_keyed_by_normalized_uuid(cache):
    m = sample()
    path = M.save(m)
    assert path == cache / "58b3fdb6-aaaa-bbbb-cccc-0123456789ab.json"
    assert M.load_cached("GPU-58B3FDB6-aaaa-bbbb-cccc-0123456789ab") == m   # NVML's spelling
    assert M.load_cached("GPU-11111111-aaaa-bbbb-cccc-0123456789ab") is None
    M.save(sample(uuid="11111111-aaaa-bbbb-cccc-0123456789ab", name="NVIDIA A100"))
    assert M.load_cached("58b3fdb6-aaaa-bbbb-cccc-0123456789ab").name == "NVIDIA H200"


def test_corrupted_cache_is_ignored_with_a_note(cache, caplog):
    uuid = "58b3fdb6-aaaa-bbbb-cccc-0123456789ab"
    cache.mkdir(parents=True)
    for text in ('{"version": 1, "kind": "cu', '[1, 2]', json.dumps({**sample().to_dict(), "fp32_matmul": 3})):
        (cache / f"{uuid}.json").write_text(text)
        m, note = M.read_cached(uuid)
        assert m is None and "unreadable" in note and "--bench" in note
    with caplog.at_level(logging.WARNING, logger="edgerl.measure"):
        assert M.load_cached(uuid) is None
    assert "unreadable" in caplog.text


@pytest.mark.parametrize("change, check, expect", [
    (dict(version=0), {}, "format version 0"),
    (dict(uuid="99999999-aaaa-bbbb-cccc-0123456789ab"), {}, "it holds GPU 99999999"),
    ({}, dict(torch_version="2.12.0+cu126"), "measured with torch 2.11.0+cu130"),
    (dict(date="2020-01-01T00:00:00+00:00"), dict(max_age_days=90), "days ago (limit 90)"),
])
def test_stale_cache_is_ignored_with_a_note(cache, change, check, expect):
    uuid = "58b3fdb6-aaaa-bbbb-cccc-0123456789ab"
    cache.mkdir(parents=True)
    (cache / f"{uuid}.json").write_text(json.dumps({**sample().to_dict(), **change}))
    m, note = M.read_cached(uuid, **check)
    assert m is None and expect in note
    if change.get("date"):  # without the age limit the same file is fine
        assert M.read_cached(uuid)[0] is not None


def test_save_is_atomic(cache, monkeypatch):
    M.save(sample())
    real_dump = json.dump

    def dies_halfway(obj, f, **kw):
        f.write('{"version": 1, "kind": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        M.save(sample(name="half written"))
    monkeypatch.setattr(json, "dump", real_dump)
    assert M.load_cached("58b3fdb6-aaaa-bbbb-cccc-0123456789ab").name == "NVIDIA H200"
    assert [p.name for p in cache.iterdir()] == ["58b3fdb6-aaaa-bbbb-cccc-0123456789ab.json"]


def test_main_prints_json_and_saves(cache, monkeypatch, capsys):
    monkeypatch.setattr(M, "measure", lambda device, budget_s, pageable: sample())
    assert M.main(["--json"]) == 0
    out = capsys.readouterr()
    assert Measurements.from_dict(json.loads(out.out)) == sample() and "saved" in out.err
    assert M.load_cached(sample().uuid) == sample()
    monkeypatch.setattr(M, "measure", lambda device, budget_s, pageable: sample(fp16_matmul=Item(status="wrong")))
    assert M.main(["--no-save"]) == 1
    assert "fp16 (fp32 accumulate) WRONG RESULTS" in capsys.readouterr().out
