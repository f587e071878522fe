"""`edgerl train` for two GRPO steps on tiny random models of today's architectures: Qwen3 (named by a Hugging
Face id, from huggingface_hub's cache offline) and Gemma 3 on the static engine, GPT-NeoX on transformers'
generate, each plan saying which engine and why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from conftest import need_tokenizer
from edgerl.cli.main import app
from edgerl.train.metrics import read_metrics
from test_modelspec_on_cpu import fake_hub, offline_hub  # noqa: F401  (fixture)

FAST = ['run.profile="cpu"', "rollout.max_new_tokens=8", "train.prompts_per_step=2", "rollout.n_samples=4",
        "run.tensorboard=false", "data.num_examples=16", "train.lr=1e-4", "train.steps=2", 'algo.advantage="grpo"']


def tiny_folder(out: Path, kind: str) -> Path:
    import torch
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(need_tokenizer())
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  max_position_embeddings=1024)
    torch.manual_seed(0)
    if kind == "qwen3":       # Qwen3-1.7B's shape: tied, GQA, head_dim 128 at 2048 wide (here 32 at 64)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=32,
                                                   tie_word_embeddings=True))
    elif kind == "gemma3":    # Gemma-3-1B's shape: one KV head, sliding layers around a full one
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, num_key_value_heads=1, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
            final_logit_softcapping=3.0, attn_logit_softcapping=2.0, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    else:
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def train(model: str, run: Path):
    sets = FAST + [f'model.path="{model}"', f'run.out_dir="{run}"']
    return CliRunner().invoke(app, ["train"] + [x for s in sets for x in ("--set", s)])


def check_two_steps(r, run: Path) -> tuple[str, str]:
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in read_metrics(run)] == [1, 2]
    assert (run / "final" / "config.json").exists()
    p = json.loads((run / "plan.json").read_text())
    return p["plan"]["rollout_engine"], p["reasons"]["rollout_engine"]


def test_qwen3_by_hub_id_from_the_cache_offline(offline_hub, tmp_path):  # noqa: F811
    folder = tiny_folder(tmp_path / "qwen3", "qwen3")
    snap = fake_hub(offline_hub, "acme/tiny-qwen3", {})
    for f in folder.iterdir():
        shutil.copy(f, snap / f.name)
    r = train("acme/tiny-qwen3", tmp_path / "run")
    engine, why = check_two_steps(r, tmp_path / "run")
    assert engine == "static" and "qwen3" in why
    assert "static KV cache" in r.output


def test_gemma3_trains_on_the_static_engine(tmp_path):
    r = train(str(tiny_folder(tmp_path / "gemma3", "gemma3")), tmp_path / "run")
    engine, why = check_two_steps(r, tmp_path / "run")
    assert engine == "static" and "gemma3_text" in why


def test_gpt_neox_trains_on_transformers_generate_and_the_plan_says_why(tmp_path):
    r = train(str(tiny_folder(tmp_path / "neox", "neox")), tmp_path / "run")
    engine, why = check_two_steps(r, tmp_path / "run")
    assert engine == "hf-generate" and "does not implement the gpt_neox architecture" in why
    assert "hf generate" in r.output
