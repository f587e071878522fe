"""edgerl.device.measure and edgerl.device.measured on the CPU: arithmetic with a fake clock, the result check,
the cache, the command line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch

from edgerl.device import measure as M
from edgerl.device.measure import Item, Measurements, MiB

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


def tf32_like(a, b, out):
    """fp32 matmul on inputs rounded to TF32's 10-bit mantissa, as cuBLAS does with TF32 on."""
    def r(x):
        return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32) if x.dtype == torch.float32 else x
    return torch.matmul(r(a), r(b), out=out)


def test_tf32_is_not_passed_off_as_fp32():
    it = M._matmul_item(run_on_cpu((8, 0), tf32_like), "fp32", 1.0)["fp32_matmul"]
    assert it.status == "wrong" and it.value is None


def test_fp32_precision_is_ieee_while_timing_and_restored_after():
    cu, mk = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    before = (cu.fp32_precision, mk.fp32_precision)
    cu.fp32_precision, mk.fp32_precision = "tf32", "bf16"
    try:
        seen = []
        def spy(a, b, out):
            seen.append((a.dtype, cu.fp32_precision, mk.fp32_precision))
            return torch.matmul(a, b, out=out)
        M.measure("cpu", clock=FakeClock(0.001), matmul=spy, **TINY)
        assert (torch.float32, "ieee", "ieee") in seen
        assert (cu.fp32_precision, mk.fp32_precision) == ("tf32", "bf16")
    finally:
        cu.fp32_precision, mk.fp32_precision = before


class LegacyTorch:
    """torch < 2.9: no fp32_precision; allow_tf32 mirrors the one global matmul precision."""
    def __init__(self, precision):
        self.precision = precision
        legacy = self

        class Matmul:
            allow_tf32 = property(lambda s: legacy.precision != "highest",
                                  lambda s, v: setattr(legacy, "precision", "high" if v else "highest"))
        self.backends = type("B", (), {"cuda": type("C", (), {"matmul": Matmul()})()})()

    def get_float32_matmul_precision(self):
        return self.precision

    def set_float32_matmul_precision(self, p):
        self.precision = p


@pytest.mark.parametrize("before", ["highest", "high", "medium"])
def test_legacy_torch_gets_highest_and_its_own_setting_back(before):
    t = LegacyTorch(before)
    with M.strict_fp32(t):
        assert t.precision == "highest" and t.backends.cuda.matmul.allow_tf32 is False
    assert t.precision == before


class CpuAsCuda:
    """torch with device "cuda:0" and pinned memory mapped to plain CPU tensors, so that the GPU-only
    items run their arithmetic and sizing here."""
    def __getattr__(self, name):
        return getattr(torch, name)

    def randn(self, *shape, device=None, **kw):
        return torch.randn(*shape, **kw)

    def empty(self, *shape, device=None, pin_memory=False, **kw):
        return torch.empty(*shape, **kw)

    def linspace(self, *args, device=None, **kw):
        return torch.linspace(*args, **kw)

    def Generator(self, device=None):
        return torch.Generator()


def gpu_run(mem_cap=1 << 30, l2=0, integrated=False, per_call=0.004):
    mm = lambda a, b, out: torch.matmul(a, b, out=out)
    return M._Run(CpuAsCuda(), "cuda:0", (9, 0), FakeClock(per_call), mm, mem_cap, (32, 64, 128),
                  copy_bytes=4 * MiB, transfer_bytes=4 * MiB, integrated=integrated, l2_bytes=l2)


def test_transfer_gbs_from_a_fake_clock():
    out = M._transfer_items(gpu_run(), pinned=True, budget_s=1.0)
    # 4 MiB = 4194304 bytes each way in 4 ms = 1.048576 GB/s (one direction, not read + write)
    for k in ("h2d_pinned", "d2h_pinned"):
        assert out[k].value == pytest.approx(1.048576) and out[k].size == "4 MiB"
        assert "page-locked" in out[k].note


def test_buffers_shrink_to_a_small_cards_free_memory():
    small = gpu_run(mem_cap=4 * MiB, l2=1 * MiB, integrated=True)   # e.g. a Jetson short of memory
    t = M._transfer_items(small, pinned=False, budget_s=1.0)["h2d_pageable"]
    assert t.size == "2 MiB" and "integrated GPU" in t.note and "pageable" in t.note
    c = M._copy_item(small, 1.0)["memory_copy"]
    assert c.size == "2 MiB" and "2.0x the L2 cache" in c.note
    # three fp32 64 x 64 matrices take 48 KiB; with a 50 KiB cap n stops at 64 even though 128 is listed
    assert M._matmul_item(gpu_run(mem_cap=50 * 1024, per_call=1e-6), "fp32", 1.0)["fp32_matmul"].size == "n=64"
    none = M._matmul_item(gpu_run(mem_cap=1024), "fp32", 1.0)["fp32_matmul"]
    assert none.status == "skipped" and "does not fit" in none.note


def test_matmul_size_stops_growing_when_the_next_would_not_fit_the_budget():
    # 0.05 s per call: the next size would need ~8 x 0.05 x 6 = 2.4 s of a 1 s share, so n stays at 32
    assert M._matmul_item(gpu_run(per_call=0.05), "fp32", 1.0)["fp32_matmul"].size == "n=32"
    assert M._matmul_item(gpu_run(per_call=1e-6), "fp32", 1.0)["fp32_matmul"].size == "n=128"


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
    code = "import sys, edgerl.device.measure, edgerl.device.measured; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
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
    no_value = {**sample().to_dict()["bf16_matmul"], "value": None}
    for text in ('{"version": 1, "kind": "cu', '[1, 2]', json.dumps({**sample().to_dict(), "fp32_matmul": 3}),
                 json.dumps({**sample().to_dict(), "bf16_matmul": no_value}),
                 json.dumps({**sample().to_dict(), "cc": "90"})):
        (cache / f"{uuid}.json").write_text(text)
        m, note = M.read_cached(uuid)
        assert m is None and "unreadable" in note and "--bench" in note
    with caplog.at_level(logging.WARNING, logger="edgerl.device.measured"):
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


def test_cached_or_measured_reuses_a_fresh_file_and_remeasures_a_stale_one(cache, monkeypatch):
    uuid = sample().uuid
    monkeypatch.setattr(M, "device_uuid", lambda device=None: uuid)
    measured = []
    monkeypatch.setattr(M, "measure", lambda device, **kw: measured.append(device) or sample(
        torch_version=torch.__version__, name="measured now"))
    M.save(sample(torch_version=torch.__version__, name="from the cache"))
    m, where = M.cached_or_measured("cuda:0")
    assert m.name == "from the cache" and where.startswith("cached in") and measured == []
    m, where = M.cached_or_measured("cuda:0", refresh=True)
    assert m.name == "measured now" and measured == ["cuda:0"] and "saved to" in where
    M.save(sample(torch_version="2.0.0"))                       # another torch: stale
    m, where = M.cached_or_measured("cuda:0")
    assert m.name == "measured now" and "measured with torch 2.0.0" in where
    assert M.load_cached(uuid).name == "measured now"
