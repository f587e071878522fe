"""The recipes in examples/recipes: each one's plan fits its card (`edgerl recommend --config`), and each
trains two steps on the CPU with a tiny random model of its architecture in place of the real one (the
recipe's algorithm, LoRA and base storage, batch shape, evaluation and sample logging kept)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import need_tokenizer
from edgerl.cli.main import app
from edgerl.config import recipes
from edgerl.config.load import load_config
from edgerl.config.target import resolve_target
from edgerl.plan.modelspec import resolve
from edgerl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
NAMES = ("ppo-qwen2.5-0.5b-gsm8k-p40.toml", "grpo-qwen2.5-7b-qlora-gsm8k-p40.toml", "grpo-qwen3-4b-lora-t4.toml",
         "grpo-qwen3-1.7b-full-rtx3090.toml", "grpo-qwen2.5-1.5b-2xp40.toml",
         "grpo-qwen3-1.7b-tools-gsm8k-lora-t4.toml", "grpo-qwen3-1.7b-tools-gsm8k-full-rtx3090.toml")
GPUS = {n: recipes.GPUS.get(n, 1) for n in NAMES}
runner = CliRunner()


def test_every_recipe_is_listed_and_readme_shows_their_plans():
    assert recipes.FOLDER == RECIPES and sorted(p.name for p in RECIPES.glob("*.toml")) == sorted(NAMES)
    block = re.search(r"<!-- recipes:start -->\n(.*?)\n<!-- recipes:end -->", (ROOT / "README.md").read_text(), re.S)
    assert block and block.group(1).strip() == recipes.recipe_table().strip(), \
        "README's recipes table is stale: paste the output of `python -m edgerl.config.recipes`"


@pytest.mark.parametrize("name", sorted(GPUS))
def test_the_headers_commands_run_from_the_repository_root(name):
    """Every path the header's commands name exists from the root, and the files they write are the ones the
    recipe reads (data.path, eval.data: relative to where edgerl runs); pip installs from the clone, as the
    package index holds no edgerl."""
    path = RECIPES / name
    header = [line[4:] for line in path.read_text().splitlines() if line.startswith("#   ")]
    configs = [m.group(1) for line in header for m in [re.search(r"--config (\S+)", line)] if m]
    assert configs and all((ROOT / c).is_file() for c in configs), configs
    written = {m.group(1) for line in header for m in [re.search(r"data prepare \S+ .*--out (\S+)", line)] if m}
    cfg = load_config(path, [])
    assert {cfg.data.path, cfg.eval.data} == written
    assert all("pip install '.[" in line for line in header if "pip install" in line)


@pytest.mark.parametrize("name", sorted(GPUS))
def test_the_recipe_plans_to_fit_its_card(name):
    path = RECIPES / name
    cfg = load_config(path, [])
    r = runner.invoke(app, ["recommend", "--config", str(path), "--gpus", str(GPUS[name]), "--format", "json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["memory"]["fits"] and p["memory"]["total_bytes"] <= p["memory"]["budget_bytes"], name
    assert p["task"]["response_len"] == cfg.rollout.response_tokens() and p["task"]["world_size"] == GPUS[name]
    assert p["task"]["turn_len"] == (cfg.rollout.max_new_tokens if cfg.rollout.tools else 0)
    assert p["device"]["name"] == resolve_target(cfg.run.profile).device.name
    text = runner.invoke(app, ["recommend", "--config", str(path), "--gpus", str(GPUS[name])])
    assert text.exit_code == 0 and ": fits" in text.stdout, text.output


def test_recommend_plans_for_the_configs_profile_unless_a_gpu_is_named():
    path = str(RECIPES / "ppo-qwen2.5-0.5b-gsm8k-p40.toml")
    named = runner.invoke(app, ["recommend", "--config", path, "--gpu", "t4", "--format", "json"])
    assert named.exit_code == 0 and json.loads(named.stdout)["device"]["name"] == "Tesla T4", named.output


def tiny_of(arch: str, out: Path, tools: bool = False) -> Path:
    """A random model of `arch`'s family at tiny widths (multiples of 64: bitsandbytes' CPU NF4 rows); with
    `tools`, its tokenizer has Qwen2.5's chat template (SmolLM2's cannot take tools)."""
    import torch
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(need_tokenizer())
    if tools:
        from agent_helpers import QWEN25_TEMPLATE
        tok.chat_template = QWEN25_TEMPLATE
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, max_position_embeddings=1024)
    torch.manual_seed(0)
    if arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    else:
        raise AssertionError(f"no tiny model for {arch}: add one")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def gsm8k_like(path: Path, n: int = 40) -> Path:
    """GSM8K-format rows (verl's layout) of small sums."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from edgerl.data.builtin import gsm8k_row
    rows = [gsm8k_row(f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
                      f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}", "train", i) for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


CPU_SETS = ['run.profile="cpu"', "train.steps=2", "rollout.max_new_tokens=8", "eval.max_prompts=4",
            "run.tensorboard=false", "run.save_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GPUS))
def test_the_recipe_trains_two_steps_on_the_cpu(name, tmp_path):
    cfg = load_config(RECIPES / name, [])
    arch = resolve(cfg.model.path).model_type
    model = tiny_of(arch, tmp_path / "model", tools=bool(cfg.rollout.tools))
    data = gsm8k_like(tmp_path / "gsm8k.parquet")
    run = tmp_path / "run"
    sets = CPU_SETS + [f'model.path="{model}"', f'data.path="{data}"', f'eval.data="{data}"', f'run.out_dir="{run}"']
    args = ["train", "--config", str(RECIPES / name), *sum((["--set", s] for s in sets), [])]
    if GPUS[name] == 1:
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
    else:   # under torchrun, as its header says, on gloo
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={GPUS[name]}", "-m", "edgerl.cli", *args],
                           capture_output=True, text=True, timeout=900, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = read_metrics(run)
    assert [m["step"] for m in rows if "reward/mean" in m] == [1, 2]
    assert any("eval/accuracy" in m for m in rows)
    plan = json.loads((run / "plan.json").read_text())
    assert plan["task"]["samples_per_prompt"] == cfg.rollout.n_samples
    assert (plan["plan"]["lora"] is not None) == bool(cfg.lora.enabled)
    if cfg.run.log_samples:
        assert (run / "samples.jsonl").stat().st_size > 0
