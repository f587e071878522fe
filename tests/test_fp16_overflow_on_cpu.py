"""fp16 that cannot overflow silently: a tiny Gemma-3-shaped model whose layer 1 MLP weights are scaled so that
its activations pass fp16's 65504 (in fp32 they stay finite). The calibration finds that layer, a T4 plan of it
computes in fp32 or refuses in one line, an unscaled model keeps fp16, the calibration is cached per weights,
and a run whose fp16 forward goes non-finite anyway stops in one line naming the layer.

The CPU has no fp16 plan (edgerl plans fp32 there), so the runs below make the CPU ask for fp16 the way a T4
does (`fp16_cpu`); torch's CPU kernels compute in fp16 then, and overflow as a GPU's do.
tests/test_fp16_overflow_cuda.py runs the same on a GPU with the T4 profile.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import edgerl.config.target
import edgerl.plan.decisions as decisions
from conftest import make_char_tokenizer
from edgerl.cli.main import app
from edgerl.config.load import load_config
from edgerl.config.target import plan_for, resolve_target
from edgerl.core.errors import PlanError
from edgerl.device.device import GiB, Software
from edgerl.device.profiles import device_from_profile, get_profile
from edgerl.models.activations import calibrate, first_nonfinite
from edgerl.models.backbone import decoder_layers
from edgerl.plan import fp16
from edgerl.plan.modelspec import CATALOGUE, resolve
from edgerl.plan.plan import Task, plan
from edgerl.train import overflow
from edgerl.train.metrics import read_metrics
from fakes import fake_probe

WORDS = ["hello there", "what is this", "count to ten", "tell me more", "why not", "say something"]
REWARD = Path(__file__).parent / "reward_fns.py"
SCALE = 1000.0     # layer 1's gate and up projections x 1000: their product reaches ~1.5e5 (fp16 holds 65504)
LAYER = 1
T4 = device_from_profile(get_profile("t4"), Software(), 64 * GiB)


def tiny_gemma(out: Path, scale: float = 1.0) -> Path:
    """Gemma-3-1B's shape at tiny widths (sandwich norms, one KV head, sliding layers around a full one) with a
    character tokenizer and plain-text prompts; layer 1's gate and up projections multiplied by `scale`."""
    import transformers as tf
    out.mkdir(parents=True, exist_ok=True)
    tok = make_char_tokenizer(out)
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=6, query_pre_attn_scalar=16, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    with torch.no_grad():
        mlp = model.model.layers[LAYER].mlp
        mlp.gate_proj.weight.mul_(scale)
        mlp.up_proj.weight.mul_(scale)
    model.save_pretrained(out)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w, "data_source": "letters"}) + "\n"
                                               for w in WORDS))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return SimpleNamespace(plain=tiny_gemma(root / "plain"), scaled=tiny_gemma(root / "scaled", SCALE))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fp16_cpu(monkeypatch):
    """The CPU asks for fp16 compute, as a T4 does (forced dtypes are left alone)."""
    real = decisions.pick_dtype
    monkeypatch.setattr(decisions, "pick_dtype", lambda dev, forced: real(dev, forced) if forced or dev.is_cuda
                        else (decisions.FP16_MIXED, "fp16 asked for by the test, as on a T4"))


def prompt_ids(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    return [tok(w)["input_ids"] for w in WORDS]


def reference_peaks(folder: Path) -> dict[tuple[int, str], float]:
    """Each layer's MLP and residual-stream peaks the slow way: one prompt at a time (no padding), hooks that
    keep every tensor, then a plain max."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    peaks: dict[tuple[int, str], float] = {}
    for ids in prompt_ids(folder):
        seen: list[tuple[int, str, torch.Tensor]] = []
        hooks = []
        for i, layer in enumerate(lm.model.layers):
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                hooks.append(proj.register_forward_hook(
                    lambda m, a, o, i=i: seen.extend([(i, "MLP", a[0]), (i, "MLP", o)])))
            hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: seen.append(
                (i, "residual stream", o[0] if isinstance(o, tuple) else o))))
        with torch.no_grad():
            lm(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        for i, site, t in seen:
            peaks[i, site] = max(peaks.get((i, site), 0.0), float(t.abs().max()))
    return peaks


def test_the_calibration_finds_the_layer_past_fp16s_range_and_matches_one_prompt_at_a_time(models):
    rec = calibrate(str(models.scaled), prompt_ids(models.scaled), torch.device("cpu"))
    over = rec.over()
    assert [(p.where, p.site) for p in over] == [(f"layer {LAYER}", "MLP")], over
    assert over[0].value > fp16.FP16_MAX and rec.prompts == len(WORDS)
    for (i, site), value in reference_peaks(models.scaled).items():
        assert dict(rec.layers[i])[site] == pytest.approx(value, rel=1e-5), (i, site)
    plain = calibrate(str(models.plain), prompt_ids(models.plain), torch.device("cpu"))
    assert plain.over() == [] and plain.worst().value < 100
    # a GPU's way: each layer read from the safetensors for its turn (here onto the CPU), the same numbers
    streamed = calibrate(str(models.scaled), prompt_ids(models.scaled), torch.device("cpu"), from_files=True)
    assert [(p.describe(), pytest.approx(p.value, rel=1e-6)) for p in streamed.peaks()] == \
        [(p.describe(), p.value) for p in rec.peaks()]


def test_the_fp16_forward_of_the_scaled_model_goes_non_finite_first_in_that_layer(models):
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([prompt_ids(models.scaled)[0]])
    for folder, expected in ((models.scaled, f"layer {LAYER}'s MLP"), (models.plain, None)):
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16)
        found = first_nonfinite(decoder_layers(lm), lambda: lm(ids))
        assert (found.describe() if found else None) == expected
        fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert first_nonfinite(decoder_layers(fp32), lambda: fp32(ids)) is None   # fp32 holds it


def test_a_t4_plan_computes_in_fp32_around_the_layer_and_keeps_fp16_for_an_unscaled_model(models):
    cpu = torch.device("cpu")
    scaled = calibrate(str(models.scaled), prompt_ids(models.scaled), cpu)
    p = plan(T4, replace(resolve(str(models.scaled)), activations=scaled), Task())
    assert p.dtype.compute == "fp32" and f"layer {LAYER}'s MLP reaches" in p.reasons["dtype"]
    assert p.fp16_check == "cached calibration" and "so fp32 compute" in p.reasons["fp16_check"]
    plain_spec = resolve(str(models.plain))
    plain = calibrate(str(models.plain), prompt_ids(models.plain), cpu)
    kept = plan(T4, replace(plain_spec, activations=plain), Task())
    assert kept.dtype.compute == "fp16" and "within fp16's safe range" in kept.reasons["fp16_check"]
    # without a calibration, a Gemma 3 model plans fp32 (its released weights overflow fp16) and calibrates at start
    first = plan(T4, plain_spec, Task())
    assert first.dtype.compute == "fp32" and first.fp16_check == "calibrate at start"
    assert "only if every site stays below 16376" in first.reasons["fp16_check"]


def test_what_cannot_avoid_the_overflow_is_refused_in_one_line(models):
    spec = resolve(str(models.scaled))
    rec = calibrate(str(models.scaled), prompt_ids(models.scaled), torch.device("cpu"))
    with_rec = replace(spec, activations=rec)
    with pytest.raises(PlanError) as e:   # fp16 forced on an overflowing model
        plan(T4, with_rec, Task(), {"dtype": "fp16"})
    assert "\n" not in str(e.value) and f"layer {LAYER}'s MLP" in str(e.value) and "plan.dtype=fp32" in str(e.value)
    big = replace(CATALOGUE["gemma-3-4b"], activations=rec)
    with pytest.raises(PlanError) as e:   # fp32 does not fit: one line, the layer and what would fit
        plan(T4, big, Task())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("gemma-3-4b must compute in fp32 on Tesla T4")
    assert f"layer {LAYER}'s MLP" in msg and "What would fit: a bigger GPU" in msg


def test_recommend_and_doctor_on_a_gemma3_config_say_what_train_will_do(tmp_path, monkeypatch):
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None))
    cfg = tmp_path / "gemma-3-1b" / "config.json"   # Gemma 3 1B's config.json fields
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
        "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256}))
    runner = CliRunner()
    r = runner.invoke(app, ["recommend", "--gpu", "t4", "--model", str(cfg), "--format", "json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["plan"]["dtype"]["compute"] == "fp32" and p["plan"]["fp16_check"] == "calibrate at start"
    assert "Gemma 3's activations are known to exceed fp16's maximum of 65504" in p["reasons"]["dtype"]
    assert "computes in fp16 only if every site stays below 16376" in p["reasons"]["fp16_check"]
    text = runner.invoke(app, ["recommend", "--gpu", "t4", "--model", str(cfg)])
    assert text.exit_code == 0 and "fp16 overflow check" in text.output and "calibrate at start" in text.output
    d = runner.invoke(app, ["doctor", "--gpu", "t4", "--model", str(cfg), "--json"])
    assert json.loads(d.stdout)["plan"]["plan"]["fp16_check"] == "calibrate at start"
    # another architecture keeps the GPU's fp16 and calibrates at start; a bf16 GPU has nothing to check
    llama = runner.invoke(app, ["recommend", "--gpu", "t4", "--model", "llama-3.2-1b", "--format", "json"])
    lp = json.loads(llama.stdout)
    assert lp["plan"]["dtype"]["compute"] == "fp16" and lp["plan"]["fp16_check"] == "calibrate at start"
    ampere = json.loads(runner.invoke(app, ["recommend", "--gpu", "rtx3090", "--model", str(cfg),
                                            "--format", "json"]).stdout)
    assert ampere["plan"]["dtype"]["compute"] == "bf16" and ampere["plan"]["fp16_check"] is None


def test_the_calibration_is_cached_per_weights_and_a_second_run_skips_it(models, cache, monkeypatch):
    monkeypatch.setattr(edgerl.config.target, "probe", lambda: fake_probe(None, torch_cuda=None))
    folder = models.scaled
    cfg = load_config(None, [f'model.path="{folder}"'])
    target = resolve_target("t4")
    first = plan_for(cfg, target)
    assert first.dtype.compute == "fp32" and first.fp16_check == "calibrate at start"
    prompts = [SimpleNamespace(input_ids=ids) for ids in prompt_ids(folder)]
    lines: list[str] = []
    again = overflow.calibrated(cfg, target, first, prompts, torch.device("cpu"), lines.append)
    assert again.dtype.compute == "fp32" and any(f"layer {LAYER}'s MLP" in line for line in lines)
    plain_cfg = load_config(None, [f'model.path="{models.plain}"'])   # the unscaled model earns fp16
    plain = overflow.calibrated(plain_cfg, target, plan_for(plain_cfg, target), prompts, torch.device("cpu"),
                                lines.append)
    assert plain.dtype.compute == "fp16" and plan_for(plain_cfg, target).dtype.compute == "fp16"
    assert len(list((cache / "activations").glob("*.json"))) == 2
    second = plan_for(cfg, target)   # what doctor, recommend and the next run see
    assert second.dtype.compute == "fp32" and second.fp16_check == "cached calibration"
    monkeypatch.setattr(overflow, "calibrate", lambda *a, **k: pytest.fail("the cached calibration ran again"))
    assert overflow.calibrated(cfg, target, second, prompts, torch.device("cpu"), lines.append) is second
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # other weights: calibrated again
    assert plan_for(cfg, target).fp16_check == "calibrate at start"
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert plan_for(cfg, target).fp16_check == "cached calibration"
    fp16.cache_path(fp16.weights_key(folder)).write_text("{not json")
    assert plan_for(cfg, target).fp16_check == "calibrate at start"   # an unreadable cache file is ignored


FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "train.lr=1e-4", 'algo.advantage="grpo"', 'data.answer_key=""',
        "data.chat_template=never", 'run.export_final=false', f'reward.functions=["{REWARD}:vowel_share"]']


def train(folder: Path, run: Path, *extra: str, base: list[str] = FAST):
    sets = base + [f'model.path="{folder}"', f'data.path="{folder / "prompts.jsonl"}"', f'run.out_dir="{run}"', *extra]
    return CliRunner().invoke(app, ["train"] + [x for s in sets for x in ("--set", s)])


def test_a_run_that_would_overflow_fp16_calibrates_at_start_and_trains_finite_in_fp32(models, fp16_cpu, tmp_path):
    r = train(models.scaled, tmp_path / "run", "train.steps=2")
    assert r.exit_code == 0, r.output
    assert "fp16 check" in r.output and f"layer {LAYER}'s MLP" in r.output
    p = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert p["plan"]["dtype"]["compute"] == "fp32" and p["plan"]["fp16_check"] == "cached calibration"
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/nonfinite_rows"] == 0 and row["actor/skipped_updates"] == 0
        assert all(v == v and abs(v) != float("inf") for v in row.values() if isinstance(v, float)), row


def test_an_fp16_run_that_goes_non_finite_stops_in_one_line_naming_the_layer(models, fp16_cpu, tmp_path):
    # a calibration that missed the overflow (as if the training prompts reached further than its own)
    folder = tmp_path / "model"
    shutil.copytree(models.scaled, folder)
    small = fp16.ActivationRecord(layers=((("MLP", 1.0), ("residual stream", 1.0)),) * 3, embeddings=1.0,
                                  logits=1.0, prompts=1, tokens=4, date=fp16.now())
    fp16.write_cached(folder, small)
    r = train(folder, tmp_path / "run", "train.steps=4", "train.max_bad_steps=2")
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: the rollout's log-probs were NaN or infinite in 2 steps in a row (nothing was "
                           "trained on them): the actor's fp16 forward of those rows first goes non-finite in "
                           f"layer {LAYER}'s MLP"), last
    assert last.endswith("train in fp32 with --set plan.dtype=fp32")
    assert "step 1: the rollout's log-probs were NaN or infinite (in 8 row(s): the step trains on nothing" in r.output
    rows = read_metrics(tmp_path / "run")
    assert [(row["step"], row["rollout/nonfinite_rows"], row["train/bad_steps_in_a_row"]) for row in rows] == [(1, 8, 1)]
