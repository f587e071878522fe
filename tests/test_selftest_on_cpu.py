"""`edgerl doctor --selftest` and the kernel check at the start of `edgerl train`, on the CPU: which kernels
each plan launches, the checks that run here passing and the GPU-only ones skipped with their reason, and a
kernel made wrong on purpose stopping both the self-test and training with one line naming it. The Triton
kernels' checks run in Triton's CPU interpreter (a child process with TRITON_INTERPRET=1)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import require_interpreter, run_cases_under_triton_interpreter
from edgerl.cli.main import app
from edgerl.config.load import load_config
from edgerl.core.errors import TrainingError
from edgerl.doctor import kernel_checks
from edgerl.config.target import plan_for, resolve_target

runner = CliRunner()
CPU = torch.device("cpu")
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def plan_of(profile: str, model: str = "smollm2-135m", *sets: str):
    return plan_for(load_config(None, [f'model.path="{model}"', *sets]), resolve_target(profile))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A folder with only the config.json of a small llama: the self-test's target shape."""
    from transformers import LlamaConfig
    out = tmp_path_factory.mktemp("tiny-target")
    LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=256).save_pretrained(out)
    return out


def wrong_chunked_logprobs(monkeypatch) -> None:
    """The torch log-prob path made wrong on purpose: every log-prob 0.05 too high."""
    from edgerl.kernels import chunked
    real = chunked.forward_stats_torch

    def wrong(*args, **kwargs):
        logp, ent, lse, mz = real(*args, **kwargs)
        return logp + 0.05, ent, lse, mz
    monkeypatch.setattr(chunked, "forward_stats_torch", wrong)


# ---- which kernels a plan launches ------------------------------------------------------------------

@pytest.mark.parametrize("profile,model,sets,want", [
    ("cpu", "smollm2-135m", (), ["logprobs-torch"]),
    ("p40", "smollm2-135m", (), ["logprobs-torch", "decode-cuda"]),
    ("m40", "smollm2-135m", (), ["logprobs-torch", "decode-cuda"]),
    ("t4", "smollm2-135m", (), ["logprobs-torch", "decode-cuda"]),
    ("t4", "smollm2-135m", ("plan.decode_backend=\"torch\"",), ["logprobs-torch"]),
    ("t4", "qwen2.5-7b", ("lora.enabled=true",), ["logprobs-torch", "decode-cuda", "nf4"]),
    ("a10", "smollm2-135m", (), ["logprobs-triton", "decode-attention-rope", "decode-linear"]),
    ("a10", "smollm2-135m", ("plan.decode_backend=\"triton-attention\"",), ["logprobs-triton", "decode-attention-rope"]),
    ("a10", "qwen2.5-1.5b", (), ["logprobs-triton", "decode-attention-rope", "decode-linear", "adamw-bf16"]),
    ("p40", "qwen2.5-7b", ("lora.enabled=true",), ["logprobs-torch", "decode-cuda", "nf4"]),
    ("a10", "smollm2-135m", ("plan.kernel_backend=\"torch\"", "plan.decode_backend=\"torch\""), ["logprobs-torch"]),
])
def test_plan_kernels_follow_the_plans_decisions(profile, model, sets, want):
    assert kernel_checks.plan_kernels(plan_of(profile, model, *sets)) == want


def test_every_kernel_names_the_setting_that_avoids_it():
    for name, use in kernel_checks.KERNELS.items():
        assert name == "logprobs-torch" or use.avoid.startswith("plan."), name


# ---- the checks on the CPU ----------------------------------------------------------------------------

def test_cpu_checks_pass_and_gpu_only_kernels_are_skipped_with_the_reason():
    p = plan_of("cpu")
    verdicts = {v.name: v for v in kernel_checks.check_kernels(p, CPU, quick=True)}
    assert verdicts["chunked log-probs and entropy (torch)"].status == "pass"
    nvrtc = verdicts["decode-layer kernels (CUDA C, NVRTC)"]
    assert nvrtc.status == "skip" and nvrtc.detail == "this plan does not launch it"
    # a GPU plan on the CPU: its NVRTC kernels cannot be checked here, and say why
    v = kernel_checks.check_one("decode-cuda", plan_of("p40"), CPU)
    assert v.status == "skip" and "needs a CUDA GPU" in v.detail
    if not INTERPRETER:
        v = kernel_checks.check_one("decode-linear", plan_of("a10"), CPU)
        assert v.status == "skip" and "TRITON_INTERPRET=1" in v.detail


def test_a_wrong_kernel_fails_its_check_and_stops_training_with_one_line(monkeypatch):
    p = plan_of("cpu")
    wrong_chunked_logprobs(monkeypatch)
    v = kernel_checks.check_one("logprobs-torch", p, CPU, quick=True)
    assert v.status == "fail" and "log-probs differs from its reference" in v.line()
    with pytest.raises(TrainingError) as e:
        kernel_checks.check_at_start(p, CPU)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("kernel check: the chunked log-probs and entropy (torch) is wrong on this device")


def test_a_kernel_that_raises_fails_naming_the_setting(monkeypatch):
    from edgerl.doctor import kernel_refs

    def broken(w, device):
        raise RuntimeError("NVRTC could not compile for sm_61: out of registers\nmore lines")
    monkeypatch.setitem(kernel_refs.CHECKS, "decode-cuda", broken)
    monkeypatch.setattr(kernel_checks, "skip_reason", lambda use, device: None)   # as on a GPU
    with pytest.raises(TrainingError, match=r"decode-layer kernels \(CUDA C, NVRTC\) is wrong on this device: "
                                            r"it cannot run here .*RuntimeError: NVRTC could not compile for sm_61: "
                                            r"out of registers; set plan.decode_backend=torch to run without it"):
        kernel_checks.check_at_start(plan_of("p40"), CPU)


# ---- the self-test through the CLI --------------------------------------------------------------------

def selftest(*args):
    return runner.invoke(app, ["doctor", "--selftest", *map(str, args)])


@pytest.fixture(scope="module")
def cpu_selftest(tiny_target, tmp_path_factory):
    """`edgerl doctor --selftest --json` on this CPU for the small target: (result, the folder of its report)."""
    folder = tmp_path_factory.mktemp("selftest")
    return selftest("--model", tiny_target, "--json", "--out", folder), folder


def test_selftest_json_on_the_cpu_passes_and_lists_gpu_checks_as_skipped(cpu_selftest):
    r, folder = cpu_selftest
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out == {k: v for k, v in json.loads((folder / "selftest.json").read_text()).items() if k != "report"}
    assert r.stderr.strip().endswith(f"wrote {folder / 'selftest.json'}")   # where the report went, beside the JSON
    checks = {c["name"]: c for c in out["checks"]}
    assert out["ok"] and out["counts"]["fail"] == 0
    ran = [n for n, c in checks.items() if c["status"] == "pass"]
    assert "chunked log-probs and entropy (torch)" in ran
    assert any(n.startswith("rollout engine (static") for n in ran)
    assert any(n.startswith("two training steps (fp32") for n in ran)
    for name in ("CUDA graph capture of the decode step", "matmul and copy speed", "decode memory", "training memory",
                 "NF4 decode matmul and LoRA adapter sum (CUDA C, NVRTC)"):
        assert checks[name]["status"] == "skip" and checks[name]["detail"], name
    train = next(c for n, c in checks.items() if n.startswith("two training steps"))
    assert train["figures"]["gradients step 2"]["error"] <= train["figures"]["gradients step 2"]["tolerance"]
    assert out["environment"]["gpu"] is None and out["environment"]["torch"] == torch.__version__


def test_selftest_report_holds_no_path_user_or_host_name(cpu_selftest, tiny_target):
    from edgerl.doctor.selftest import scrub
    r, folder = cpu_selftest
    text = (folder / "selftest.json").read_text()
    report = json.loads(text)["report"]
    assert report.startswith("edgerl doctor --selftest\n") and "\nPASS  two training steps" in report
    for private in (str(tiny_target), str(folder), str(Path.home())):
        assert private not in text
    assert scrub(f"{Path.home()}/models/x failed on {socket.gethostname()}") == "~ failed on <host>"


def test_selftest_with_a_wrong_kernel_fails_naming_it(tiny_target, tmp_path, monkeypatch):
    wrong_chunked_logprobs(monkeypatch)
    r = selftest("--model", tiny_target, "--out", tmp_path)
    assert r.exit_code == 1, r.output
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert fails, r.output
    assert fails[0].startswith("FAIL  chunked log-probs and entropy (torch): log-probs differs from its reference")
    assert fails[0].endswith("no setting avoids it")
    assert any(line.startswith("FAIL  two training steps") for line in fails)   # the same kernel, inside training
    assert json.loads((tmp_path / "selftest.json").read_text())["ok"] is False


def test_selftest_keeps_an_existing_report_unless_forced(tmp_path):
    (tmp_path / "selftest.json").write_text("mine")
    r = selftest("--out", tmp_path)
    assert r.exit_code == 2 and "exists; pass --force" in r.output
    assert (tmp_path / "selftest.json").read_text() == "mine"
    if Path("/dev/full").exists():   # a device is no file to write into, nor a name to write beside
        r = selftest("--json", "--out", "/dev/full")
        assert r.exit_code == 2 and "--out /dev/full is a character device, not a regular file" in r.output
        assert not Path("/dev/full.json").exists()
    r = runner.invoke(app, ["doctor", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--out and --force go with --selftest" in r.output


def test_train_stops_before_its_first_step_with_one_line(tiny_llama, tmp_path, monkeypatch):
    wrong_chunked_logprobs(monkeypatch)
    run_dir = tmp_path / "run"
    r = runner.invoke(app, ["train", "--profile", "cpu", "--model", str(tiny_llama), "--steps", "1", "--out",
                            str(run_dir), "--set", "rollout.max_new_tokens=8", "--set", "train.prompts_per_step=2"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    line = " ".join(r.output.split())
    assert "error: kernel check: the chunked log-probs and entropy (torch) is wrong on this device: log-probs " \
           "differs from its reference" in line and "no setting runs without it" in line
    assert not run_dir.exists()   # stopped before the run folder was written


# ---- the Triton kernels' checks in Triton's CPU interpreter -------------------------------------------

TRITON = ["logprobs-triton", "decode-attention", "decode-attention-rope", "decode-linear", "adamw-bf16"]


def test_triton_checks_run_under_the_interpreter():
    if INTERPRETER:
        pytest.skip("this is the interpreter process itself")
    run_cases_under_triton_interpreter(__file__, "interp", at_least=2 * len(TRITON) + 1)


@pytest.fixture
def interpreted():
    require_interpreter(lambda: __import__("edgerl.kernels.decode_linear", fromlist=["x"]).kernel_module())


@pytest.mark.parametrize("profile", ["p40", "a10"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TRITON)
def test_interp_triton_kernel_check_passes(interpreted, name, profile):
    p = plan_of(profile, "qwen2.5-1.5b")
    v = kernel_checks.check_one(name, p, CPU, quick=True)
    assert v.status == "pass", v.line()


def test_interp_a_wrong_triton_kernel_fails(interpreted, monkeypatch):
    import edgerl.kernels.decode_linear as dl
    real = dl.decode_linear

    def wrong(x, w, **kw):   # the norm weight left out: what a fused epilogue could get wrong
        if kw.get("norm") is not None:
            kw["norm"] = torch.ones_like(kw["norm"])
        return real(x, w, **kw)
    monkeypatch.setattr(dl, "decode_linear", wrong)
    v = kernel_checks.check_one("decode-linear", plan_of("cpu"), CPU, quick=True)
    assert v.status == "fail" and "decode_linear q/k/v" in v.detail
    assert v.line().endswith("avoid it with --set plan.decode_backend=triton-attention")


def test_kernel_checks_run_in_ieee_fp32_where_a_script_allowed_tf32(monkeypatch):
    """A script that turned TF32 on (Ampere and newer) must not fail fp32 kernels' checks on TF32's rounding."""
    import torch
    from edgerl.doctor import kernel_refs
    seen = []
    real = kernel_refs.run

    def spy(*a, **k):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return real(*a, **k)
    monkeypatch.setattr(kernel_refs, "run", spy)
    old = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        v = kernel_checks.check_one("logprobs-torch", plan_of("p40"), CPU, quick=True)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"   # restored after the check
    finally:
        torch.backends.cuda.matmul.fp32_precision = old
    assert seen == ["ieee"] and v.status == "pass", v.detail
