"""The CLI through typer's CliRunner: doctor, recommend in every format, profiles, and bad input."""

import json

import pytest
from typer.testing import CliRunner

import edgerl.config.target
from edgerl.cli.main import app
from edgerl.config.load import load_config
from edgerl.plan.modelspec import CATALOGUE
from edgerl.plan.plan import plan
from edgerl.config.target import resolve_target, task_from_config, overrides_from_config
from fakes import CU130_ARCH, fake_probe

runner = CliRunner()


@pytest.fixture
def machine(monkeypatch):
    """Make the CLI's probe return a fake machine."""
    def use(*args, **kwargs):
        monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(*args, **kwargs))
    return use


def run(*args):
    return runner.invoke(app, list(args))


def test_doctor_simulated_p40_json(machine):
    machine(None, torch_cuda=None)
    r = run("doctor", "--gpu", "p40", "--json")
    out = json.loads(r.stdout)
    assert out["device"].startswith("Tesla P40") and out["simulated"]
    names = {c["name"]: c for c in out["checks"]}
    assert names["torch sees CUDA"]["status"] == "fail" and "cu126" in names["torch sees CUDA"]["fix"]
    assert out["plan"]["plan"]["dtype"]["compute"] == "fp32"
    assert r.exit_code == 1


def test_doctor_real_gpu_ok(machine, nvrtc_compiles):
    machine("T4")   # its fp16 plan decodes through the CUDA C kernels: NVRTC (a CUDA torch brings it) compiles them
    r = run("doctor")
    assert r.exit_code == 0, r.stdout
    assert "Ready." in r.stdout and "Tesla T4" in r.stdout


def test_doctor_fails_on_arch_mismatch(machine):
    machine("P40", arch=CU130_ARCH, torch_cuda="13.0")
    r = run("doctor", "--json")
    assert r.exit_code == 1
    arch = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "torch build covers this GPU"][0]
    assert arch["status"] == "fail" and "cu126" in arch["fix"]


def test_recommend_text(machine):
    machine(None, torch_cuda=None)
    r = run("recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b", "--prompt-len", "256",
            "--response-len", "512", "--samples", "8", "--prompts", "8", "--algo", "grpo")
    assert r.exit_code == 0, r.stdout
    for text in ("fp32", "sdpa", "8 prompts x 8 samples = 64 sequences per step", "Memory by phase", "budget"):
        assert text in r.stdout


def test_recommend_json_has_the_documented_keys(machine):
    machine(None, torch_cuda=None)
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--format", "json")
    out = json.loads(r.stdout)
    assert {"device", "plan", "reasons", "memory"} <= set(out)
    assert set(out["plan"]) == set(out["reasons"])
    assert {"components", "total_bytes", "budget_bytes", "fits"} <= set(out["memory"])
    assert out["memory"]["total_bytes"] == sum(out["memory"]["components"].values())
    assert out["plan"]["dtype"]["compute"] == "fp16"


def test_recommend_toml_is_accepted_by_train_config_unchanged(machine, tmp_path):
    machine(None, torch_cuda=None)
    r = run("recommend", "--gpu", "rtx3090", "--model", "qwen2.5-1.5b", "--format", "toml",
            "--out", str(tmp_path / "run.toml"))
    assert r.exit_code == 0, r.output
    cfg = load_config(tmp_path / "run.toml")
    assert cfg.run.profile == "rtx3090" and cfg.model.path == "qwen2.5-1.5b"
    # planning again from the written config reproduces the same decisions
    target = resolve_target("rtx3090", probe_fn=lambda: fake_probe(None, torch_cuda=None))
    again = plan(target.device, CATALOGUE["qwen2.5-1.5b"], task_from_config(cfg), overrides_from_config(cfg))
    r2 = run("recommend", "--gpu", "rtx3090", "--model", "qwen2.5-1.5b", "--format", "json")
    assert again.decisions() == json.loads(r2.stdout)["plan"]


def test_recommend_verl(machine):
    machine(None, torch_cuda=None)
    r = run("recommend", "--gpu", "t4", "--model", "qwen2.5-0.5b", "--format", "verl")
    assert "python -m verl.trainer.main_ppo" in r.stdout
    assert "actor_rollout_ref.rollout.dtype=float16" in r.stdout
    assert "attn_implementation=sdpa" in r.stdout
    r = run("recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b", "--format", "verl")
    assert "verl cannot train on Tesla P40" in r.stdout and "vLLM or SGLang" in r.stdout


def test_profiles_lists_every_required_gpu():
    r = run("profiles")
    for name in ("p40", "p100", "v100-16gb", "v100-32gb", "t4", "gtx1080ti", "rtx2080ti", "gtx1660", "rtx3090",
                 "rtx4090", "a10", "l4", "a100-40gb", "a100-80gb", "h100", "h200", "jetson-orin", "cpu"):
        assert name in r.stdout


@pytest.mark.parametrize("args,message", [
    (["recommend", "--gpu", "p4O"], "unknown GPU 'p4O'. Did you mean"),
    (["recommend", "--gpu-spec", "cc=6.1"], "needs at least cc and memory"),
    (["recommend", "--model", "qwen-0.5b"], "unknown model 'qwen-0.5b'"),
    (["recommend", "--model", "./no/such/folder"], "model folder ./no/such/folder does not exist"),
    (["recommend", "--set", "train.lrr=1"], "did you mean 'train.lr'"),
    (["doctor", "--gpu", "titan"], "unknown GPU 'titan'"),
    (["recommend", "--gpu", "p40", "--model", "llama-3.1-8b", "--no-lora"], "does not fit on Tesla P40"),
])
def test_bad_input_is_one_clear_line(machine, args, message):
    machine(None, torch_cuda=None)
    r = run(*args)
    assert r.exit_code == 2
    assert message in r.output, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
