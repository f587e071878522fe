"""The benchmark harness on the CPU: model folders, result bookkeeping, and each script's --smoke end to
end (those are slow: about a minute each on two cores)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GSM8K, TOKENIZER, need_tokenizer

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))
import benchlib as bl  # noqa: E402

needs_tokenizer = pytest.mark.usefixtures("tokenizer")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def tokenizer():
    need_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def bench_data_folder(tmp_path_factory):
    """The benchmarks read the tokenizer and GSM8K from $EDGERL_SHARED/data (on a GPU machine, a copy of the
    full data): here a folder of links to the tests' own, for the benchmarks this file runs as processes and
    for the bench code it imports (whose default is the folder beside the clone)."""
    data = tmp_path_factory.mktemp("bench-data") / "data"
    data.mkdir()
    (data / "smollm2-tokenizer").symlink_to(TOKENIZER, target_is_directory=True)
    (data / "gsm8k").symlink_to(GSM8K, target_is_directory=True)
    ENV["EDGERL_SHARED"] = str(data.parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGERL_SHARED", str(data.parent))
        yield


@needs_tokenizer
def test_random_model_folder_loads_in_transformers_with_every_weight(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    out = bl.build_model("tiny", str(TOKENIZER), tmp_path / "m", "fp16", shard_bytes=3 * 2**20)
    assert (out / "model.safetensors.index.json").exists()      # written in two shards
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.dtype == torch.float16
    assert sum(p.numel() for p in model.parameters()) == bl.n_params("tiny")
    w = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(w.std().item() - bl.STD) < 0.002 and torch.equal(model.model.norm.weight, torch.ones(64).half())
    again = bl.build_model("tiny", str(TOKENIZER), tmp_path / "m2", "fp16", shard_bytes=3 * 2**20)
    assert (again / "model-00001-of-00002.safetensors").read_bytes() == \
        (out / "model-00001-of-00002.safetensors").read_bytes()   # seeded: the same folder every time


def test_results_are_merged_with_an_earlier_file_and_written_after_each_run(tmp_path):
    a = bl.Results(tmp_path / "r.json", {"script": "x"})
    a.put("one", {"status": "ok"})
    b = bl.Results(tmp_path / "r.json", {"argv": ["--only", "two"]})
    b.put("two", {"status": "timeout"})
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["runs"]) == {"one", "two"} and data["meta"] == {"script": "x", "argv": ["--only", "two"]}


def test_summary_of_an_edgerl_run_skips_step_one_and_compares_the_estimate():
    rows = [{"step": i, "perf/step_s": s, "response/length_mean": 256.0, "batch/sequences": 16,
             "memory/peak_allocated_gib": 3.0 + i, "memory/peak_reserved_gib": 4.0 + i}
            for i, s in ((1, 9.0), (2, 2.0), (3, 3.0))]
    plan_json = {"memory": {"total_bytes": 8 * bl.GiB, "peak_phase": "update", "phases": {"update": 8 * bl.GiB},
                            "components": {"CUDA context": 2**29}, "budget_bytes": 10 * bl.GiB},
                 "model": {"n_params": 1}, "plan": {}}
    out = bl.summarise_edgerl({"status": "ok", "rows": rows, "memory_end": {"outside_allocator_gib": 1.0}}, plan_json)
    assert out["median_step_s"] == 2.5 and out["tokens_per_s"] == pytest.approx(16 * 256 / 2.5)
    assert out["peak_reserved_gib"] == 7.0 and out["measured_gib"] == 8.0 and out["estimate_error"] == 0.0
    # a profiled step is left out of the medians (its time is the profiler's too), its peaks are not
    rows = [dict(r) for r in rows] + [{**rows[1], "step": 4, "perf/step_s": 2.2}]
    out = bl.summarise_edgerl({"status": "ok", "rows": rows}, plan_json, profiled=3)
    assert out["median_step_s"] == pytest.approx(2.1) and "step 3" in out["profiled_step"]
    assert out["peak_reserved_gib"] == 7.0


def test_frontier_items_and_the_resume_verdicts():
    import bench_multi
    import bench_vs_trl
    assert bench_vs_trl.budget_for("trl/2:adamw-bf16", {"measured_gib": 9.0}) == (4.5, "adamw-bf16", "")
    assert bench_vs_trl.budget_for("6", None) == (6.0, None, "")
    assert bench_vs_trl.budget_for("trl", {})[2].startswith("skipped")
    rows = [{"step": s, "reward/mean": 0.1 * s, "actor/kl": 0.0} for s in (1, 2, 3, 4)]
    assert bench_multi.compare(rows, rows)["verdict"].startswith("exact")
    late = [dict(r, **({"reward/mean": 9.0} if r["step"] == 4 else {})) for r in rows]
    assert "after the resume only" in bench_multi.compare(rows, late)["verdict"]
    early = [dict(r, **({"reward/mean": 9.0} if r["step"] == 1 else {})) for r in late]
    assert "before the resume too" in bench_multi.compare(rows, early)["verdict"]
    assert bench_multi.compare(rows, rows[:2])["verdict"].startswith("incomplete")


def test_decode_long_smoke_times_each_length_and_counts_the_cache_each_row_sees(tmp_path):
    """bench_decode_long.py --smoke: the engine's step at each cache column, eager on the CPU; the bytes are the
    weights plus rows x (column + 1) x layers x K and V x KV heads x head dim x 4 (an fp32 cache)."""
    out = tmp_path / "long.json"
    res = subprocess.run([sys.executable, str(BENCH / "bench_decode_long.py"), "--smoke", "--lengths", "48,16",
                          "--rows", "3", "--out", str(out)], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    recs = json.loads(out.read_text())["records"]
    assert [r["length"] for r in recs] == [16, 48]
    hidden, layers, heads, kv, _, _ = __import__("bench_decode_long").SMOKE_SHAPE
    for r in recs:
        assert r["ms_per_step"] > 0 and r["rows"] == 3
        assert r["kv_bytes"] == 3 * (r["length"] + 1) * layers * 2 * kv * (hidden // heads) * 4
        assert r["bytes"] == r["weight_bytes"]["total"] + r["kv_bytes"]


@pytest.mark.parametrize("base", [None, "lora"])
def test_decode_long_counts_a_steps_flops_by_its_layers_widths(base):
    """The FLOP floor's count, against the widths written out: per row and layer q, k, v, o, gate, up and down, the
    LM head once, under LoRA each adapter's A (r x in) and B (out x r) too; the attention 2 x 2 x head dim a column
    for each query head."""
    import torch
    from bench_decode_long import VOCAB, attention_flops, build, matmul_flops
    h, layers, heads, kv, mlp = 64, 2, 4, 2, 128
    model = build((h, layers, heads, kv, mlp, True), torch.float32, base, torch.device("cpu"), 64)
    hd = h // heads
    shapes = [(h, heads * hd), (h, kv * hd), (h, kv * hd), (heads * hd, h), (h, mlp), (h, mlp), (mlp, h)]
    per_layer = sum(i * o for i, o in shapes) + (sum(16 * (i + o) for i, o in shapes) if base else 0)
    assert matmul_flops(model, 3) == 2 * 3 * (layers * per_layer + h * VOCAB)
    assert attention_flops(model, 3, 99) == 2 * 2 * 3 * layers * heads * hd * 100


def test_decode_long_counts_a_tied_embedding_once_and_an_untied_input_embedding_not_at_all():
    import torch
    from bench_decode_long import build, weight_bytes
    widths = (64, 2, 4, 2, 128, True)
    tied = build(widths, torch.float32, None, torch.device("cpu"), 64)
    untied = build(widths[:5] + (False,), torch.float32, None, torch.device("cpu"), 64)
    every = lambda m: sum(p.numel() * 4 for p in m.parameters())   # noqa: E731
    assert weight_bytes(tied)["total"] == every(tied)              # the LM head reads the shared table whole
    emb = untied.get_input_embeddings().weight
    assert weight_bytes(untied)["total"] == every(untied) - emb.numel() * 4 == every(tied)
    assert weight_bytes(untied)["quantized"] == 0


def test_decode_long_counts_a_quantized_weight_once_under_its_lora_wrapper():
    """A 4-bit weight (its packed codes, absmax, and the nested absmax and code tables) counted once, though peft's
    LoRA layer shows its base layer's weight as its own: a stand-in with bitsandbytes' quant_state fields."""
    import types
    import torch
    from bench_decode_long import weight_bytes
    codes = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.uint8), requires_grad=False)
    codes.quant_state = types.SimpleNamespace(absmax=torch.zeros(16, dtype=torch.uint8), code=torch.zeros(16),
                                              state2=types.SimpleNamespace(absmax=torch.zeros(1), code=torch.zeros(256)))

    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = codes

    class Lora(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = Base()
            self.lora_A = torch.nn.Linear(32, 2, bias=False)

        @property
        def weight(self):
            return self.base_layer.weight

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.emb, self.head = Lora(), torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)

        def get_input_embeddings(self):
            return self.emb

        def get_output_embeddings(self):
            return self.head
    got = weight_bytes(Model())
    assert got["quantized"] == 32 * 16 + 16 + 16 * 4 + 4 + 256 * 4
    assert got["other"] == (2 * 32 + 10 * 4) * 4   # the adapter and the LM head; the untied input embedding not


def test_decode_long_refuses_bad_lengths_in_one_line():
    res = subprocess.run([sys.executable, str(BENCH / "bench_decode_long.py"), "--smoke", "--lengths", "2k"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2 and "--lengths takes comma-separated integers" in res.stderr
    assert "Traceback" not in res.stderr


def test_decode_long_runs_the_matmul_a_b_on_one_model_and_refuses_an_unknown_choice(tmp_path):
    out = tmp_path / "long.json"
    res = subprocess.run([sys.executable, str(BENCH / "bench_decode_long.py"), "--smoke", "--lengths", "16",
                          "--matmul", "plan,cublas,apart", "--out", str(out)], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert [r["backend"] for r in json.loads(out.read_text())["records"]] == [
        "torch", "torch (cuBLAS matmuls)", "torch (LoRA layers apart)"]
    res = subprocess.run([sys.executable, str(BENCH / "bench_decode_long.py"), "--smoke", "--matmul", "triton"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2 and "--matmul takes plan, cublas, apart or several" in res.stderr and "Traceback" not in res.stderr


def test_fp32_mm_bench_takes_the_products_of_a_shape_and_needs_a_gpu():
    import bench_fp32_mm
    layers, prods = bench_fp32_mm.products("1.5b")
    assert layers == 28 and prods == {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536),
                                      "down": (1536, 8960), "lm_head": (49152, 1536)}
    res = subprocess.run([sys.executable, str(BENCH / "bench_fp32_mm.py")], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


def test_gpu_session_script_parses_and_names_every_stage():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_session.sh")]).returncode == 0
    text = (BENCH / "gpu_session.sh").read_text()
    for stage in ("quick", "measure", "memory", "multi", "trl-core", "trl-qlora", "info", "tests", "fit", "rollout",
                  "agents-recipes", "agents-trl", "tests-agents", "fp32-mm"):
        assert f"        {stage})" in text, stage
    # a pair's suffix ($x, e.g. "_gpu1") glued to a variable of the stage's loop reads as one name ("$n_gpu1",
    # unset): every part's files would share one empty name
    glued = re.findall(r"\\\$[A-Za-z_][A-Za-z0-9_]*\$x", text)
    assert not glued, glued


def _smoke(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    res = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--work", str(tmp_path / "work"),
                          "--tokenizer", str(TOKENIZER), "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@needs_tokenizer
def test_bench_vs_trl_smoke_runs_both_sides(tmp_path):
    pytest.importorskip("trl")
    d = _smoke("bench_vs_trl.py", tmp_path, "--only", "362m-bf16", "--frontier", "0.5,trl/2",
               "--edgerl-set", "run.profile_step=2")
    runs = d["runs"]
    assert (tmp_path / "work" / "runs" / "362m-bf16_edgerl" / "profile" / "step-2.txt").exists()  # --edgerl-set
    assert runs["362m-bf16/trl"]["status"] == "ok" and runs["362m-bf16/trl"]["steps_done"] == 2
    assert runs["362m-bf16/edgerl"]["status"] == "ok" and runs["362m-bf16/edgerl"]["sequences_per_step"] == 16
    assert runs["362m-bf16/edgerl@0.5"]["plan"] and runs["362m-bf16/edgerl@0.5"]["budget_gib"] < 0.5
    assert runs["362m-bf16/edgerl@trl/2"]["status"].startswith("skipped")   # no device memory on the CPU
    assert d["check_failures"] == []


@pytest.mark.slow
@needs_tokenizer
def test_bench_memory_smoke_reads_the_plan_and_each_phase(tmp_path):
    d = _smoke("bench_memory.py", tmp_path, "--only", "362m-bf16-grpo", "362m-bf16-ppo")
    for name in ("362m-bf16-grpo", "362m-bf16-ppo"):
        r = d["runs"][name]
        assert r["status"] == "ok" and r["estimate_gib"] > 0 and set(r["phases"]) >= {"rollout", "score", "update"}


@pytest.mark.slow
@needs_tokenizer
def test_bench_multi_smoke_on_two_cpu_ranks(tmp_path):
    d = _smoke("bench_multi.py", tmp_path)
    assert d["runs"]["scale-2gpu"]["world_size"] == 2 and d["runs"]["scale-2gpu"]["sequences_per_step"] == 32
    assert d["runs"]["fit2-plan"]["plan_said_2_not_1"] is True and d["runs"]["fit2-run"]["status"] == "ok"
    assert d["resume"]["verdict"].startswith("exact")


def test_nf4_decode_profile_says_it_needs_a_gpu():
    """bench_nf4_decode.py times bitsandbytes' CUDA kernels: without a GPU it says so and exits 2."""
    out = subprocess.run([sys.executable, str(BENCH / "bench_nf4_decode.py")], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.parametrize("script", ["bench_decode_layer.py", "bench_decode_gemm.py", "bench_decode_cuda_attention.py",
                                    "bench_decode_long.py"])
def test_decode_benches_say_they_need_a_gpu(script):
    """The decode layer's and the decode products' benches time CUDA kernels: without a GPU each says so and
    exits 2."""
    out = subprocess.run([sys.executable, str(BENCH / script)], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]


def test_decode_layer_bench_refuses_a_tiles_file_without_a_sweep(tmp_path):
    """--tiles-from a JSON without swept products (or not the sweep's at all): one line naming the file, exit 2."""
    empty, other = tmp_path / "empty.json", tmp_path / "other.json"
    empty.write_text("[]")
    other.write_text('[{"model": "360m"}]')
    for f, says in ((empty, "no product in it has swept tiles"), (other, "not a bench_decode_gemm.py --sweep JSON")):
        out = subprocess.run([sys.executable, str(BENCH / "bench_decode_layer.py"), "--tiles-from", str(f)],
                             capture_output=True, text=True, env=ENV, timeout=300)
        assert out.returncode == 2 and says in out.stderr and str(f) in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


def test_bench_adamw_bf16_smoke_times_every_variant(tmp_path):
    out = tmp_path / "adamw.json"
    res = subprocess.run([sys.executable, str(BENCH / "bench_adamw_bf16.py"), "--smoke", "--device", "cpu",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    d = json.loads(out.read_text())
    assert [r["status"] for r in d["results"]] == ["ok"] * 4 and d["params"] > 0
    assert "| torch AdamW fp32, foreach |" in res.stdout


@needs_tokenizer
def test_a_random_model_of_any_family_is_built_from_its_config_with_every_weight(tmp_path):
    """bench_recipes' models: the names and shapes transformers builds for the config (here Qwen3, with its
    q/k norms and untied head), matrices drawn at the initializer's std, norms one."""
    import torch
    import transformers as tf
    cfg = tf.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    out = bl.build_model_from_config(cfg, str(TOKENIZER), tmp_path / "q3")
    model, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.q_norm.weight, torch.ones(16, dtype=torch.bfloat16))
    assert abs(model.lm_head.weight.float().std().item() - bl.STD) < 0.002


def test_the_context_is_the_processs_own_figure_not_the_shared_devices():
    """On a GPU that other runs share, the device's used memory less this allocator counts their memory too:
    the context comes from NVML's figure for this process, else from the plan's constant."""
    assert bl.own_context_gib({"process_used_end_gib": 21.78, "process_reserved_end_gib": 20.98,
                               "memory_end": {"outside_allocator_gib": 41.2}, "estimate_context_gib": 0.86}) \
        == (pytest.approx(0.80), "NVML, this process")
    assert bl.own_context_gib({"estimate_context_gib": 0.86}) == (0.86, "the plan's constant")
    assert bl.own_context_gib({})[0] is None


def test_bench_recipes_refuses_an_unknown_recipe_in_one_line():
    out = subprocess.run([sys.executable, str(BENCH / "bench_recipes.py"), "--only", "nope.toml"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 2 and "unknown recipe(s) nope.toml" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
@needs_tokenizer
def test_bench_recipes_smoke_trains_a_recipe_with_its_own_plan(tmp_path):
    d = _smoke("bench_recipes.py", tmp_path, "--only", "grpo-qwen3-4b-lora-t4.toml")
    r = d["runs"]["grpo-qwen3-4b-lora-t4.toml"]
    assert r["status"] == "ok" and r["steps"] == "1/1" and r["plan"]["lora"]["rank"] == 16
    assert r["raw"]["sequences_per_step"] == 32      # the recipe's 4 prompts x 8 samples


@pytest.mark.slow
@needs_tokenizer
def test_bench_long_resumable_rows_continue_their_run_in_the_next_call(tmp_path):
    """A row slower than one benchmark call runs over several: --resumable checkpoints every step, the next
    call continues the row's run folder up to --steps steps in all, and a row there already is not run again."""
    first = _smoke("bench_long.py", tmp_path, "--resumable", "--steps", "1")["runs"]["smoke"]
    (tmp_path / "out.json").unlink()
    second = _smoke("bench_long.py", tmp_path, "--resumable", "--steps", "2")["runs"]["smoke"]
    (tmp_path / "out.json").unlink()
    third = _smoke("bench_long.py", tmp_path, "--resumable", "--steps", "2")["runs"]["smoke"]
    assert first["status"] == second["status"] == "ok" and first["steps"] == second["steps"] == "1/1"
    assert [m["step"] for m in first["raw"]["metrics"]] == [1] and [m["step"] for m in second["raw"]["metrics"]] == [2]
    assert second["resumed_after_step"] == 1 and "resumed_after_step" not in first
    assert first["estimate_gib"] == pytest.approx(second["estimate_gib"])   # the same plan in both calls
    assert third["status"] == "done: its run folder holds 2 of 2 steps" and third["steps"] == "2/2"


def test_bench_vs_trl_runs_of_a_group_for_each_side_selection():
    """GROUP runs TRL, edgerl's plan, edgerl at each budget and TRL's other runs; GROUP:edgerl leaves out every
    TRL run and the budgets taken from TRL's memory; GROUP:trl keeps TRL's main run alone."""
    import bench_vs_trl as vs
    g = vs.GROUPS["llama8b-t4"]
    names = lambda runs: [n for n, _ in runs]   # noqa: E731
    assert names(vs.runs_of("llama8b-t4", g, ("trl", "8"))) == [
        "llama8b-t4/trl", "llama8b-t4/edgerl", "llama8b-t4/edgerl@trl", "llama8b-t4/edgerl@8", "llama8b-t4/trl-fp16"]
    assert names(vs.runs_of("llama8b-t4", g, ("trl", "8"), edgerl_only=True)) == [
        "llama8b-t4/edgerl", "llama8b-t4/edgerl@8"]
    assert vs.runs_of("llama8b-t4", g, ("trl", "8"), trl_only=True) == [("llama8b-t4/trl", g.trl)]
    assert vs.runs_of("qwen14b-p40", vs.GROUPS["qwen14b-p40"], (), trl_only=True) == []   # no TRL side


def test_bench_vs_trl_context_on_a_shared_gpu_is_never_the_devices():
    """On a GPU other runs share, the device's used memory counts them: a run's context is its own process's
    NVML figure, else the plan's constant; alone on the GPU the device's figure stands."""
    import bench_vs_trl as vs
    from edgerl.plan.memory import DEFAULT_CALIBRATION
    crowded = {"memory_end": {"outside_allocator_gib": 54.9}}
    assert vs.context_of(crowded, shared_gpu=False) == (54.9, "the device's used memory")
    ctx, how = vs.context_of(crowded, shared_gpu=True)
    assert ctx == pytest.approx(DEFAULT_CALIBRATION.cuda_context / bl.GiB) and "constant" in how
    own = {**crowded, "process_used_end_gib": 19.0, "process_reserved_end_gib": 18.2}
    assert vs.context_of(own, shared_gpu=True) == (pytest.approx(0.8), "NVML, this process")


def test_a_run_the_time_limit_stopped_is_never_reported_ok():
    """The limit's SIGTERM makes edgerl finish the step in flight, save and exit cleanly: the run is reported
    as stopped at the limit with the steps it holds, not as a finished run."""
    assert bl.run_status("timeout after 540 s", "stopped by SIGTERM after 2 step(s)", 2) == \
        "timeout after 540 s: stopped after 2 step(s)"
    assert bl.run_status("timeout after 540 s", "ok", 2) == "timeout after 540 s: stopped after 2 step(s)"
    assert bl.run_status("timeout after 540 s", "stopped by SIGTERM after 2 step(s)", 2, asked=3) == \
        "timeout after 540 s: stopped after 2 step(s)"
    assert bl.run_status("timeout after 316 s", "stopped by SIGTERM after 3 step(s)", 3, asked=3) == "ok"   # the last
    assert bl.run_status("timeout after 316 s", "stopped by SIGTERM after 2 step(s)", 2, asked=3, last=3) == "ok"
    assert bl.run_status("timeout after 316 s", "stopped by SIGTERM after 1 step(s)", 1, asked=3, last=2) == \
        "timeout after 316 s: stopped after 1 step(s)"   # a resumed run: steps 2 and 3 of 3, stopped after 2
    # killed by the SIGKILL (no status of its own) after its last step, while it saved: said so, not "ok"
    assert bl.run_status("timeout after 256 s", "timeout after 256 s", 2, asked=3, last=3) == \
        "timeout after 256 s: killed after its last step (3 of 3)"
    assert bl.run_status("timeout after 256 s", "timeout after 256 s", 1, asked=3, last=2) == \
        "timeout after 256 s after 1 step(s)"
    assert bl.run_status("ok", "ok", 3) == "ok"
    assert bl.run_status("exit 1", "out of memory", 1) == "out of memory after 1 step(s)"
    assert bl.run_status("exit 1", "out of memory", 0) == "out of memory"


def test_the_decode_step_profile_runs_one_step_of_the_engine():
    """bench_rollout.step_kernels (bench_nf4_decode's profile too) builds the engine's step mode and runs
    one eager step under the profiler: on the CPU its aten ops, on a GPU its kernels."""
    import bench_rollout
    from edgerl.rollout import SamplingParams, StaticCacheEngine
    sys.path.insert(0, str(REPO / "tests"))
    from rollout_helpers import PROMPTS, tiny_llama
    engine = StaticCacheEngine(tiny_llama(), 4, 64, cuda_graphs=False)
    engine.generate([PROMPTS[0]], 4, SamplingParams(max_new_tokens=4, greedy=True), None)
    events = bench_rollout.step_kernels(engine, len(PROMPTS[0]))
    names = {e.name for e in events}
    assert "aten::bmm" in names and "aten::baddbmm" in names, sorted(names)[:40]


FIRST_FIT_PINS = ("optimizer", "optimizer_offload", "micro_batch", "rollout_batch", "score_micro_batch")


def test_every_long_row_plans_what_its_name_says(tmp_path, monkeypatch):
    """Each bench_long row's own settings, planned for its card (its profile, the GPU machine's 128 GiB of host
    RAM) at the bench model's widths and vocabulary: it fits, LoRA rows train LoRA (on an NF4 base where
    named), full rows do not, and a -cuda-c row decodes through cuda-c; a -first-fit row pins what the search's
    fixed order picks for it (no card rates), which the search by estimated step time now replaces. A row that
    times something other than its name (LoRA left off, so full fine-tuning streamed over PCIe) is caught here,
    not on the GPU."""
    import bench_long
    from transformers import LlamaConfig
    from edgerl.config.load import load_config
    from edgerl.config.target import overrides_from_config, task_from_config
    from edgerl.device.device import Software
    from edgerl.device.profiles import device_from_profile, get_profile
    from edgerl.plan.modelspec import resolve
    from edgerl.plan.plan import plan
    software = Software(python="3.12", torch="2.11.0", torch_cuda="13.0", arch_list=("sm_75", "sm_80", "sm_90"),
                        libs=(("bitsandbytes", "0.50.2"), ("triton", "3.6.0")), machine="x86_64")
    fixed = []
    for name, (shape, profile, n, extra) in bench_long.ROWS.items():
        h, layers, heads, kv, mlp, tie = bl.SHAPES[shape]
        folder = tmp_path / shape
        LlamaConfig(vocab_size=49152, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=tie,
                    max_position_embeddings=32768).save_pretrained(folder)
        cfg = load_config(None, bench_long.row_sets(name, tmp_path, 3, True) + [f'model.path="{folder}"'])
        prof = get_profile(profile)
        p = plan(device_from_profile(prof, software, 128 * 2**30), resolve(str(folder)), task_from_config(cfg),
                 overrides_from_config(cfg, prof))
        v = p.values
        assert p.memory.fits and cfg.rollout.max_new_tokens == n, name
        lora = "lora" in name or "nf4" in name
        assert bool(v["lora"]) == lora and not (lora and v["param_offload"]), (name, v["lora"], v["param_offload"])
        assert (v["base_dtype"] == "nf4") == ("nf4" in name), (name, v["base_dtype"])
        # the plan's own choice below CC 8.0 in fp32 and fp16, the Triton layers on the 4090 (the attention kernel
        # alone over an NF4 base); torch's ops where asked
        triton = "triton-attention" if "nf4" in name else "triton-layers"
        want = "torch" if name.endswith("-torch") else triton if profile == "rtx4090" else "cuda-c"
        assert v["decode_backend"] == want, (name, v["decode_backend"])
        if name.endswith("-first-fit"):   # what the search's fixed order picks for the row it names, as pinned
            fixed.append((name, p, device_from_profile(prof, software, 128 * 2**30), resolve(str(folder)),
                          task_from_config(cfg), {k: w for k, w in overrides_from_config(cfg, prof).items()
                                                  if k not in FIRST_FIT_PINS}))
    assert len(fixed) == 2
    import edgerl.plan.timing as timing
    for name, p, device, model, task, free in fixed:
        monkeypatch.setattr(timing, "rates", lambda *a, **k: None)        # no card rates: the fixed order alone
        first = plan(device, model, task, free)
        monkeypatch.undo()
        weighed = plan(device, model, task, free)
        knobs = ("grad_checkpointing", "swap_models", "optimizer_offload", "activation_offload", "optimizer",
                 "micro_batch", "rollout_batch", "score_micro_batch")
        pinned = {k: getattr(p, k) for k in knobs}
        assert {k: getattr(first, k) for k in knobs if k != "swap_models"} == \
            {k: w for k, w in pinned.items() if k != "swap_models"}, name
        assert any(getattr(weighed, k) != pinned[k] for k in knobs), (name, "the search now picks the same plan")


def test_parallel_runs_start_while_their_caps_fit_the_device():
    """run_each in parallel with sizes: the runs going never hold more than the capacity together, every run
    runs, in order, and a run larger than the capacity runs alone."""
    import threading
    import time
    going, most, order, lock = {}, [0], [], threading.Lock()
    sizes = {"a": 15, "b": 15, "c": 32, "d": 24, "e": 15, "big": 50}

    def run(name):
        with lock:
            going[name] = sizes[name]
            most[0] = max(most[0], sum(going.values()))
            order.append(name)
        time.sleep(0.3)
        with lock:
            del going[name]
    bl.run_each(list(sizes), run, True, sizes, 40, stagger=0.05)
    assert order == list(sizes) and most[0] == 50   # "big" alone; before it, never above 40
    most[0] = 0
    bl.run_each(list(sizes)[:-1], run, True, sizes, 40, stagger=0.05)
    assert most[0] <= 40


def test_logprob_memory_bench_measures_the_torch_path(tmp_path):
    """bench_logprob_memory on the CPU: a frozen 16-bit head's pass holds no fp32 copy of the head; a trained
    one adds its gradient. A --tree without the kernels, or an --out in no folder, is one line, exit 2."""
    out = tmp_path / "lp.json"
    run = subprocess.run([sys.executable, str(BENCH / "bench_logprob_memory.py"), "--tokens", "64", "--vocab",
                          "4000", "--hidden", "64", "--chunk", "8", "--out", str(out)], capture_output=True,
                         text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rec = json.loads(out.read_text())
    head_fp32 = 4000 * 64 * 4 / 2**20
    assert rec["frozen"]["peak_extra_mib"] < head_fp32 / 2 < rec["trained"]["peak_extra_mib"], rec
    assert rec["frozen"]["logp_sum"] == rec["trained"]["logp_sum"]
    bad = subprocess.run([sys.executable, str(BENCH / "bench_logprob_memory.py"), "--tree", str(tmp_path)],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "no edgerl/kernels/logprobs.py there" in bad.stderr and "Traceback" not in bad.stderr
    nowhere = subprocess.run([sys.executable, str(BENCH / "bench_logprob_memory.py"), "--out",
                              str(tmp_path / "none" / "lp.json")], capture_output=True, text=True, env=ENV, timeout=300)
    assert nowhere.returncode == 2 and "no folder" in nowhere.stderr and "Traceback" not in nowhere.stderr


def test_bench_vs_trl_gives_trl_edgerls_allocator_settings():
    """TRL runs with the allocator settings edgerl's plan sets for itself (torch's out-of-memory message tells a user
    to set them); --trl-default-alloc adds a run with torch's own, where the variable is removed, not emptied."""
    import bench_vs_trl as vs
    import benchlib as bl
    assert vs.alloc_env("edgerl") == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert vs.alloc_env("default") == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None}
    g = vs.GROUPS["qwen7b-p40"]
    runs = dict(vs.runs_of("qwen7b-p40", g, (), trl_default=True))
    assert runs["qwen7b-p40/trl"].alloc == "edgerl"
    assert runs["qwen7b-p40/trl-default-alloc"].alloc == "default"
    assert list(dict(vs.runs_of("qwen7b-p40", g, (), trl_only=True, trl_default=True))) == [
        "qwen7b-p40/trl", "qwen7b-p40/trl-default-alloc"]
    import os
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            log = Path(d) / "env.log"
            status, rc, tail = bl.run_logged([sys.executable, "-c", "import os; print(os.environ.get("
                                              "'PYTORCH_CUDA_ALLOC_CONF', 'unset'))"], log, 30,
                                             vs.alloc_env("default"))
            assert rc == 0 and tail.strip() == "unset"
    finally:
        del os.environ["PYTORCH_CUDA_ALLOC_CONF"]


# ------------------------------------------------------------------------------------- bench_learning

def test_learning_tasks_draw_edgerls_order_and_keep_the_heldout_problems_apart():
    """The training rows are edgerl's built-in problems in its sampler's order for the seed (so TRL, given them
    unshuffled, sees the same prompts in the same order); the held-out problems are edgerl's held-out set (another
    seed, no training prompt); the gsm8k task asks with verl's instruction after one worked example and scores
    '#### <number>' only."""
    import learning_tasks as lt
    from edgerl.data.builtin import GSM8K_INSTRUCTION, generate_arithmetic
    from edgerl.data.sampler import PromptSampler
    task = lt.TASKS["arithmetic"]
    train, heldout = lt.rows_of(task, 1)
    pool = generate_arithmetic(lt.TRAIN_PROBLEMS, 1, 0)
    sampler = PromptSampler(len(pool), 8, seed=1, log=None)
    assert len(train) == 24 * 8 and train[:16] == [pool[i] for i in sampler.next_batch() + sampler.next_batch()]
    assert train != lt.rows_of(task, 2)[0] and lt.rows_of(task, 1)[0] == train   # seeded
    assert len(heldout) == 64 and not {r["extra_info"]["question"] for r in heldout} & \
        {r["extra_info"]["question"] for r in pool}
    g_train, g_heldout = lt.rows_of(lt.TASKS["gsm8k"], 0)
    assert {r["data_source"] for r in g_train + g_heldout} == {"openai/gsm8k"}
    text = g_train[0]["prompt"][0]["content"]
    assert text.startswith(lt.SHOT + "Question: ") and text.endswith(" " + GSM8K_INSTRUCTION)
    example = lt.SHOT.split("\n")[0].removeprefix("Question: ")   # the worked example is no problem of either set
    assert example not in {r["extra_info"]["question"] for r in generate_arithmetic(lt.TRAIN_PROBLEMS, 2, 0) + g_heldout}
    assert g_train[0]["extra_info"]["difficulty"] == lt.TASKS["gsm8k"].difficulty
    truth = g_train[0]["reward_model"]["ground_truth"]
    assert lt.reward("openai/gsm8k", f"so {truth}", truth) == 0.0 and lt.reward("openai/gsm8k", f"#### {truth}", truth) == 1.0
    assert lt.reward("edgerl/arithmetic", f"so {truth}", truth) == 1.0   # the built-in task takes the last number


def test_trls_settings_are_edgerls():
    """Every learning setting of TRL's side (learning_trl.trl_config) equals edgerl's (bench_learning.edgerl_sets,
    read as edgerl reads it): a change on one side only fails here."""
    import bench_learning as b
    import learning_tasks as lt
    from learning_trl import trl_config
    from edgerl.config.load import load_config
    task = lt.TASKS["arithmetic"]
    cfg = load_config(None, b.edgerl_sets(task, Path("t.jsonl"), Path("h.jsonl"), 2, "cpu"))
    spec = {"prompts_per_step": task.prompts_per_step, "samples": task.samples, "new_tokens": task.new_tokens,
            "steps": task.steps, "lr": task.lr, "seed": 2, "run_dir": "r", "temperature": task.temperature}
    t = trl_config(spec, cuda=False)
    r, a, tr = cfg.rollout, cfg.algo, cfg.train
    batch = tr.prompts_per_step * r.n_samples
    assert (t["num_generations"], t["per_device_train_batch_size"]) == (r.n_samples, batch)
    assert tr.mini_batch is None and tr.ppo_epochs == 1 and t["gradient_accumulation_steps"] == 1 \
        and t["steps_per_generation"] == 1 and t["num_iterations"] == 1   # one optimizer step per generation
    assert (t["max_steps"], t["max_completion_length"], t["learning_rate"]) == (tr.steps, r.max_new_tokens, tr.lr)
    assert (t["temperature"], t["top_p"], t["top_k"]) == (r.temperature, r.top_p, r.top_k) and r.stop_at_eos
    assert [t["adam_beta1"], t["adam_beta2"]] == tr.betas and t["weight_decay"] == tr.weight_decay
    assert t["max_grad_norm"] == tr.max_grad_norm and t["seed"] == tr.seed
    assert (t["lr_scheduler_type"], t["warmup_steps"]) == (tr.lr_schedule, 0) and tr.warmup_ratio == 0
    assert t["beta"] == a.kl_coef == 0 and (t["epsilon"], t["epsilon_high"]) == a.clip_range()
    assert (t["loss_type"], a.loss_agg_mode()) == ("dapo", "token-mean") and a.policy_loss == "ppo"
    assert t["scale_rewards"] == "group" and a.norm_adv_by_std and a.advantage == "grpo"
    assert t["mask_truncated_completions"] is False and a.overlong == "none" and not a.dynamic_sampling
    assert t["shuffle_dataset"] is False and cfg.data.shuffle is False


def _learning_record(tool, seed, accs, step_s):
    return {"task": "arithmetic", "tool": tool, "seed": seed, "status": "ok", "device": "cpu", "machine": "CPU",
            "versions": {"trl": "1.16.0"},
            "evals": [{"step": s, "accuracy": v} for s, v in zip((0, 12, 24), accs)],
            "steps": [{"step": i, "wall_s": step_s, "reward_mean": 0.5} for i in range(1, 25)]}


def test_learning_summary_finds_when_each_tool_reaches_trls_final_accuracy(tmp_path):
    """Mean and range over seeds at each evaluation; TRL's final mean is the target; a tool reaches it at the
    first evaluation whose mean is at least the target, after the training seconds summed to that step."""
    import bench_learning as b
    recs = [_learning_record("trl", 0, (0.5, 0.7, 0.8), 10.0), _learning_record("trl", 1, (0.5, 0.6, 0.9), 10.0),
            _learning_record("edgerl", 0, (0.5, 0.9, 0.9), 2.0), _learning_record("edgerl", 1, (0.5, 0.8, 0.9), 2.0)]
    for r in recs:
        (tmp_path / f"arithmetic_{r['tool']}_seed{r['seed']}.json").write_text(json.dumps(r))
    (tmp_path / "arithmetic_edgerl_seed2.json").write_text(json.dumps({**recs[2], "seed": 2, "status": "timeout"}))
    s = b.summarise(b.load_records([str(tmp_path)]))["arithmetic"]
    assert s["target"] == pytest.approx(0.85)
    assert s["edgerl"]["acc"][12] == (pytest.approx(0.85), 0.8, 0.9) and s["edgerl"]["seeds"] == [0, 1]
    assert s["edgerl"]["reach"] == (12, 24.0) and s["trl"]["reach"] == (24, 240.0)
    text = b.table({"arithmetic": s})
    assert "| edgerl | 2 | 0.500 (0.500-0.500) | 0.850 (0.800-0.900) | 0.900 (0.900-0.900) | 0.500 (0.500-0.500) | 2.00 | 48 " \
        "| step 12, 24 s |" in text
    worse = [_learning_record("edgerl", 0, (0.5, 0.6, 0.7), 2.0)] + recs[:2]
    assert "not reached" in b.table(b.summarise(worse))


def test_learning_records_name_the_commit_and_whether_the_code_differed_from_it(tmp_path, monkeypatch):
    """A result's commit is the code that ran: the checkout's HEAD, '+changes' when a tracked file was edited."""
    import bench_learning as b
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text("")
    git("add", "a.py", "pyproject.toml")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.setattr(b.bl, "REPO", tmp_path)
    (tmp_path / "untracked.json").write_text("{}")
    assert b.commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert b.commit() == head + "+changes"


@pytest.mark.slow
@needs_tokenizer
def test_bench_learning_smoke_trains_both_tools_and_plots_them_side_by_side(tmp_path):
    """--smoke: a tiny random model, 2 steps of each tool on the same rows; each run's JSON holds its steps and
    its evaluations before step 1, after 1 and after 2; TRL tokenized the prompts as edgerl did; the summary
    prints the table and `edgerl plot` draws both run folders on one figure."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl==1.16.0; CI leaves it out)")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(BENCH / "bench_learning.py"), "--smoke", "--seeds", "0", "--out",
                          str(out), "--work", str(tmp_path / "work"), "--tokenizer", str(TOKENIZER)],
                         capture_output=True, text=True, env=ENV, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    recs = {t: json.loads((out / f"arithmetic_{t}_seed0.json").read_text()) for t in ("edgerl", "trl")}
    for r in recs.values():
        assert r["status"] == "ok", r.get("error")
        assert [e["step"] for e in r["evals"]] == [0, 1, 2] and [s["step"] for s in r["steps"]] == [1, 2]
        assert all(s["wall_s"] > 0 and s["length_mean"] for s in r["steps"])
    assert recs["trl"]["prompt_ids_match"] is True and recs["trl"]["config"]["generation_batch_size"] == 4
    summary = subprocess.run([sys.executable, str(BENCH / "bench_learning.py"), "--summary", str(out)],
                             capture_output=True, text=True, env=ENV, timeout=300)
    assert summary.returncode == 0 and "| trl | 1 |" in summary.stdout, summary.stdout + summary.stderr
    from edgerl.train.metrics import plot
    assert plot([Path(recs["edgerl"]["run_dir"]), Path(recs["trl"]["run_dir"])], tmp_path / "both.png").exists()


@pytest.mark.slow
@needs_tokenizer
def test_bench_agents_smoke_runs_a_tool_recipe_and_the_rollout_group(tmp_path):
    """bench_agents' stand-in calls the calculator in every turn (random weights never would): the tool recipe
    and the edgerl side of the rollout comparison run episodes of several turns; TRL's side where installed."""
    d = _smoke("bench_agents.py", tmp_path)
    runs = d["runs"]
    recipe = next(r for name, r in runs.items() if name.endswith(".toml"))
    assert recipe["status"] == "ok" and recipe["steps"] == "1/1" and recipe["stand_in_calls"] >= 1
    for name in ("edgerl-static", "edgerl-hf-generate"):
        assert runs[name]["status"] == "ok" and runs[name]["turns_mean"] > 1 and runs[name]["tool_calls_mean"] > 0
        assert runs[name]["context_tokens_mean"] > 0 and runs[name]["rollout_s"] > 0
    assert runs["edgerl-static"]["rounds"] > 1   # the KV cache kept between turns
    assert runs["edgerl-static"]["step1_model_tokens_per_s"] > 0 and runs["edgerl-static"]["per_step"]
    assert runs["trl"]["status"].startswith(("ok", "not run: TRL is not installed")), runs["trl"]


def test_bench_agents_gives_trl_the_reward_edgerl_gets():
    """TRL's side of bench_agents scores an episode (its messages: the model's turns, their tool calls, the
    tool results) with the vowel share edgerl's side computes on the decoded episode: with a zero reward on
    one side only, that side's policy would keep its thinking length while the other's shrinks, and their
    later steps would not roll out the same work."""
    import bench_agents
    import benchlib
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3"}}}
    thinking = [{"role": "assistant", "content": " hmm hmm hmm", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "x y z"}]
    brief = [{"role": "assistant", "content": " aha", "tool_calls": [call]},
             {"role": "tool", "name": "calculator", "content": "a e i"}]
    scores = bench_agents.episode_reward([thinking, brief, "plain aeiou text"])
    assert scores[0] < scores[1]
    assert scores[2] == benchlib.reward(solution_str="plain aeiou text")
    text = " hmm hmm hmm" + json.dumps(call["function"]) + "x y z"
    assert scores[0] == pytest.approx(benchlib.reward(solution_str=text))


def test_bench_learning_summarises_an_edgerl_variant_in_a_row_of_its_own(tmp_path):
    """--variant NAME --edgerl-set ...: edgerl with other settings, a row of its own between edgerl and TRL,
    with the training reward over the last quarter of the steps (the mean over seeds, min-max)."""
    import bench_learning as b

    def rec(tool, seed, rewards, acc, variant=None):
        steps = [{"step": i + 1, "wall_s": 0.5, "reward_mean": r} for i, r in enumerate(rewards)]
        return {"task": "arithmetic", "tool": tool, "variant": variant, "seed": seed, "device": "cpu",
                "machine": "cpu", "versions": {"trl": "1.16.0"}, "steps": steps,
                "evals": [{"step": 0, "accuracy": 0.5}, {"step": 4, "accuracy": acc}]}

    recs = [rec("edgerl", 0, [0, 0, 0.2, 0.4], 0.75), rec("trl", 0, [0, 0, 0, 0.6], 0.8),
            rec("edgerl", 0, [0, 0, 0, 1.0], 0.9, variant="hf"), rec("edgerl", 1, [0, 0, 0, 0.0], 0.7, variant="hf")]
    summary = b.summarise(recs)["arithmetic"]
    assert [k for k in summary if k != "target"] == ["edgerl", "edgerl:hf", "trl"]
    assert summary["edgerl:hf"]["reward_last"] == [1.0, 0.0] and summary["edgerl"]["reward_last"] == [0.4]
    assert summary["edgerl:hf"]["reach"] == (4, 2.0) and summary["edgerl"]["reach"] is None
    rows = [ln for ln in b.table(b.summarise(recs)).splitlines() if ln.startswith("| edgerl:hf")]
    assert rows and "| 2 |" in rows[0] and "0.500 (0.000-1.000)" in rows[0], rows
    assert [p.name for p in b.plot(recs, tmp_path)] == ["learning_arithmetic.png"]   # a line per run, each row its colour


FAKE_VS_TRL = '''import json, sys
args = sys.argv[1:]
n, out = int(args[args.index("--new-tokens") + 1]), args[args.index("--out") + 1]
status = "ok" if n < 2048 else "out of memory (CUDA): tried to allocate 2.00 GiB"
open(out, "w").write(json.dumps({"meta": {}, "runs": {"qwen7b-p40/trl": {"status": status}}}))
open(out + ".argv", "w").write(" ".join(args))
'''


def test_gpu_session_trl_longest_doubles_until_trl_fails(tmp_path):
    """The trl-longest stage runs TRL's side at each length in turn and stops at the first that fails: what it
    prints is the longest TRL trains at under the card's cap (here a stand-in for bench_vs_trl fails at 2048)."""
    (tmp_path / "bench").mkdir()
    for name in ("gpu_session.sh", "benchlib.py"):
        (tmp_path / "bench" / name).write_text((BENCH / name).read_text())
    (tmp_path / "bench" / "bench_vs_trl.py").write_text(FAKE_VS_TRL)
    out = tmp_path / "out"
    env = {**os.environ, "SKIP_INSTALL": "1", "OUT": str(out), "SESSION_BUDGET_S": "300",
           "LONGEST_TOKENS": "512 1024 2048 4096", "WORK": str(tmp_path / "work")}
    res = subprocess.run(["bash", str(tmp_path / "bench" / "gpu_session.sh"), "trl-longest"], env=env,
                         capture_output=True, text=True, timeout=240)
    log = (out / "session.log").read_text()
    assert "TRL at 512 new tokens: ok (1 runs)" in log and "TRL at 1024 new tokens: ok (1 runs)" in log, log
    assert "TRL at 2048 new tokens: qwen7b-p40/trl: out of memory" in log, log
    assert "4096" not in log.split("TRL at 2048")[1] and not (out / "trl_longest_4096.json").exists()
    argv = (out / "trl_longest_1024.json.argv").read_text()
    assert "--only qwen7b-p40:trl --new-tokens 1024 --steps 2" in argv, argv
    from benchlib import run_statuses
    assert run_statuses(tmp_path / "missing.json").startswith("no result file")


def test_bench_agents_compares_the_models_tokens_a_second_at_step_1_and_after():
    """The rollout is compared by the model's tokens a second (episodes' lengths part after step 1, where each
    side's update changes its policy): step 1's rate on its own, the later steps' median beside it."""
    import bench_agents
    per_step = [{"rollout_s": 3.27, "model_tokens_mean": 188.875}, {"rollout_s": 0.94, "model_tokens_mean": 44.875},
                {"rollout_s": 0.74, "model_tokens_mean": 25.625}]
    got = bench_agents.tokens_per_s(per_step, 16)
    assert got["step1_model_tokens_per_s"] == pytest.approx(188.875 * 16 / 3.27)
    assert got["model_tokens_per_s"] == pytest.approx((44.875 * 16 / 0.94 + 25.625 * 16 / 0.74) / 2)
    assert (got["step1_rollout_s"], got["step1_model_tokens"]) == (3.27, 188.875)
    one = bench_agents.tokens_per_s(per_step[:1], 16)
    assert one["model_tokens_per_s"] == one["step1_model_tokens_per_s"]
    assert bench_agents.tokens_per_s([{"rollout_s": None, "model_tokens_mean": 5}], 16)["model_tokens_per_s"] is None


def test_bench_vs_trl_runs_unsloth_after_trl_where_a_group_has_it():
    """--unsloth adds Unsloth's run after TRL's main run on the 1.7B and T4 rows only (no P40 row: Unsloth needs
    compute capability 7.0); its child gets $EDGERL_UNSLOTH_PATH ahead of the path and no network."""
    import bench_vs_trl as vs
    g = vs.GROUPS["1.7b-bf16"]
    names = [n for n, _ in vs.runs_of("1.7b-bf16", g, ("trl",), unsloth=True)]
    assert names == ["1.7b-bf16/trl", "1.7b-bf16/unsloth", "1.7b-bf16/edgerl", "1.7b-bf16/edgerl@trl"]
    assert [n for n, _ in vs.runs_of("1.7b-bf16", g, ("trl",))] == [
        "1.7b-bf16/trl", "1.7b-bf16/edgerl", "1.7b-bf16/edgerl@trl"]
    t4 = dict(vs.runs_of("llama8b-t4", vs.GROUPS["llama8b-t4"], (), trl_only=True, unsloth=True))
    assert list(t4) == ["llama8b-t4/trl", "llama8b-t4/unsloth"]
    assert t4["llama8b-t4/unsloth"].precision == "fp16" and t4["llama8b-t4/unsloth"].cap == "t4"
    assert [n for n, _ in vs.runs_of("qwen7b-p40", vs.GROUPS["qwen7b-p40"], (), unsloth=True)] == [
        "qwen7b-p40/trl", "qwen7b-p40/edgerl"]
    old = os.environ.get("EDGERL_UNSLOTH_PATH"), os.environ.get("PYTHONPATH")
    os.environ["EDGERL_UNSLOTH_PATH"], os.environ["PYTHONPATH"] = "/u", "/site"
    try:
        env = vs.unsloth_env()
    finally:
        for k, v in zip(("EDGERL_UNSLOTH_PATH", "PYTHONPATH"), old):
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert env["PYTHONPATH"] == os.pathsep.join(["/u", "/site"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["UNSLOTH_DISABLE_STATISTICS"] == "1"


def test_bench_vs_trl_report_sets_edgerl_beside_each_peer():
    """With an Unsloth run the table gains a column of edgerl's tokens/s over Unsloth's; Unsloth's own row has its
    ratio to TRL and none to itself."""
    import bench_vs_trl as vs
    runs = {"g/trl": {"group": "g", "side": "trl", "tokens_per_s": 100.0, "measured_gib": 10.0, "status": "ok"},
            "g/unsloth": {"group": "g", "side": "unsloth", "tokens_per_s": 200.0, "measured_gib": 5.0, "status": "ok"},
            "g/edgerl": {"group": "g", "side": "edgerl", "tokens_per_s": 800.0, "measured_gib": 8.0, "status": "ok"}}
    lines = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
             for ln in vs.report(runs).splitlines() if ln.startswith("| g/")}
    assert lines["g/unsloth"][4:6] == ["2.00x", "-"]
    assert lines["g/edgerl"][4:6] == ["8.00x", "4.00x"]
    assert lines["g/trl"][4:6] == ["-", "-"]
    assert "vs Unsloth" not in vs.report({k: v for k, v in runs.items() if k != "g/unsloth"})


FAKE_UNSLOTH = '''
"""A stand-in for Unsloth's loader on the CPU: transformers' model and peft's LoRA, with its arguments checked."""
__version__ = "stand-in"


class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, max_seq_length, dtype, load_in_4bit, full_finetuning, fast_inference,
                        use_gradient_checkpointing, random_state):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        assert fast_inference is False and use_gradient_checkpointing == "unsloth" and full_finetuning != load_in_4bit
        return AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype), AutoTokenizer.from_pretrained(model_name)

    @staticmethod
    def get_peft_model(model, r, lora_alpha, target_modules, **_):
        from peft import LoraConfig, get_peft_model
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                                                task_type="CAUSAL_LM"))
'''


@pytest.mark.slow
@needs_tokenizer
def test_bench_vs_trl_smoke_runs_unsloths_side_from_its_own_path(tmp_path):
    """The Unsloth side end to end with a stand-in for Unsloth's loader on $EDGERL_UNSLOTH_PATH: its child imports
    `unsloth` from there, hands the loaded model to GRPOTrainer, and the checks compare its trainable parameters
    with edgerl's."""
    pytest.importorskip("trl")
    (tmp_path / "fake" / "unsloth").mkdir(parents=True)
    (tmp_path / "fake" / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    out = tmp_path / "out.json"
    res = subprocess.run([sys.executable, str(BENCH / "bench_vs_trl.py"), "--smoke", "--work", str(tmp_path / "work"),
                          "--tokenizer", str(TOKENIZER), "--out", str(out), "--only", "1.7b-bf16:trl", "--unsloth",
                          "--skip", "1.7b-bf16/trl"],
                         capture_output=True, text=True, timeout=600,
                         env={**ENV, "EDGERL_UNSLOTH_PATH": str(tmp_path / "fake")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())["runs"]["1.7b-bf16/unsloth"]
    assert r["status"] == "ok", r.get("error")
    assert r["side"] == "unsloth" and r["unsloth_version"] == "stand-in" and r["steps_done"] == 2
    assert r["config"]["tool"] == "unsloth" and r["config"]["generation_batch_size"] == 16


def test_drop_from_wheel_leaves_out_a_folder_and_its_record_lines_only(tmp_path):
    import zipfile
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=a,1\nstudio/ui.js,sha256=b,2\npkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("studio/ui.js", "big")
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    msg = bl.drop_from_wheel(whl, tmp_path / "out", ["studio/"])
    assert "1 files under studio/ left out" in msg
    with zipfile.ZipFile(tmp_path / "out" / whl.name) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py"]
        assert z.read("pkg/__init__.py") == b"x = 1\n"
        assert z.read("pkg-1.0.dist-info/RECORD").decode() == "pkg/__init__.py,sha256=a,1\npkg-1.0.dist-info/RECORD,,\n"


def test_nf4_projections_bench_names_a_layers_products_and_needs_a_gpu():
    import bench_nf4_projections as bp
    assert bp.projections("llama8b")[:4] == [("q/k/v fused", 6144, 4096), ("o", 4096, 4096),
                                             ("gate/up fused", 28672, 4096), ("down", 4096, 14336)]
    res = subprocess.run([sys.executable, str(BENCH / "bench_nf4_projections.py"), "--shapes", "llama8b,bogus"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2 and "--shapes: unknown bogus" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, str(BENCH / "bench_nf4_projections.py")], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr
