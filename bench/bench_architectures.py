"""Qwen3 and Gemma 3 on the static engine against transformers, in fp32, bf16 and fp16, on a GPU.

Random weights at catalogue shapes (Qwen3-0.6B: 28 layers, q/k norms, head_dim 128; Gemma-3-1B: 26 layers,
one KV head of 256, vocabulary 262144), with Gemma's sliding window shortened from 512 to 48 tokens so that
the rows (64 prompt + 128 new tokens) reach past it, its embeddings untied, and the norm weights moved off
their init. Per
architecture, dtype and decode attention: 16 rows greedy with the decode step in a CUDA graph, then each
emitted token checked against HF's forward over the same tokens (teacher forcing, as bench_rollout.py
does): the share that is HF's argmax given the same prefix and the largest gap to it in units of that
position's logit std. HF generate's own output gets the same check, for scale: in 16 bits HF's cached
decoding itself is not its own forward's argmax at every token. Rows equal to HF generate are reported
beside it. Variants: the decode backends (`plan.decode_backend`) per dtype: `torch` (baddbmm/softmax/bmm in
fp32, SDPA in 16 bits), `cuda-c` (the CUDA C layer kernels, in fp32 and fp16), `triton-attention` (the rotary decode-attention
kernel between torch's layers), `triton-layers` (that kernel between the fused Triton projections, SiLU
models with llama-style norms only); a backend a model cannot run is reported with its reason.

    python bench/bench_architectures.py --out arch.json          # H200: under three minutes
    python bench/bench_architectures.py --smoke                  # tiny shapes on the CPU (torch's bmm and sdpa)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rollout import hf_generate, teacher_forced  # noqa: E402
from edgerl.plan.modelspec import CATALOGUE  # noqa: E402
from edgerl.rollout import SamplingParams, StaticCacheEngine  # noqa: E402
from edgerl.core.files import write_atomically  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (variant, decode backend, the torch backend's SDPA in fp32) per dtype: fp32 as the plan runs it on CUDA (cuda-c;
# torch where it cannot), 16 bits as it runs it from CC 8.0 (triton-layers, else triton-attention), fp16 as it
# runs it below CC 8.0 (cuda-c)
VARIANTS = {"fp32": [("torch", "torch", False), ("cuda-c", "cuda-c", False),
                     ("triton-attention", "triton-attention", False)],
            "bf16": [("torch", "torch", False), ("triton-attention", "triton-attention", False),
                     ("triton-layers", "triton-layers", False)],
            "fp16": [("torch", "torch", False), ("cuda-c", "cuda-c", False),
                     ("triton-attention", "triton-attention", False), ("triton-layers", "triton-layers", False)]}
SMOKE = {"fp32": [("torch-bmm", "torch", False), ("torch-sdpa", "torch", True)]}


def build(arch: str, dtype, device, smoke: bool):
    import transformers as tf
    spec = CATALOGUE["qwen3-0.6b" if arch == "qwen3" else "gemma-3-1b"]
    fields = dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.hd, vocab_size=spec.vocab_size)
    if smoke:
        fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=1 if arch == "gemma3" else 2, head_dim=32, vocab_size=1000)
    # initializer_range 0.1: at HF's 0.02 a random model repeats one token whatever attention does
    # (bench_rollout.py); no special tokens, so that HF generate never stops a row early
    common = dict(initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  max_position_embeddings=4096)
    if arch == "qwen3":
        cfg = tf.Qwen3Config(**fields, **common, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = tf.Qwen3ForCausalLM
    else:
        n = fields["num_hidden_layers"]
        # untied: with random weights a tied head scores the sqrt(hidden)-scaled input embedding far above any
        # other row, and the model repeats the prompt's last token whatever attention computes (measured)
        cfg = tf.Gemma3TextConfig(**fields, **common, sliding_window=48, query_pre_attn_scalar=256,
                                  tie_word_embeddings=False,
                                  layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                               for i in range(n)])
        cls = tf.Gemma3ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    with torch.no_grad():   # norms off their init (ones for Qwen3, zeros for Gemma's 1 + weight)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


def run(arch: str, dtype_name: str, variants, device, rows: int, prompt: int, new: int, smoke: bool) -> list[dict]:
    dtype = DTYPES[dtype_name]
    model = build(arch, dtype, device, smoke)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, model.config.vocab_size, (rows, prompt), generator=g).to(device)
    cuda = device.type == "cuda"
    ref, _ = hf_generate(model, ids, new, cuda)
    out = [{"arch": arch, "dtype": dtype_name, "variant": "hf_generate",
            **teacher_forced(model, ids, ref, 1e-3 if dtype == torch.float32 else 0.75)}]
    params = SamplingParams(max_new_tokens=new, greedy=True, pad_token_id=0)
    for name, backend, sdpa in variants:
        row = {"arch": arch, "dtype": dtype_name, "variant": name}
        try:
            eng = StaticCacheEngine(model, rows, prompt + new, cuda_graphs=cuda, backend=backend)
            if sdpa:   # the torch backend's 16-bit attention path, on fp32 weights
                eng.dec.backend.sdpa = True
            t0 = time.perf_counter()
            got = eng.generate(ids.tolist(), 1, params).response_ids
            row["s"] = round(time.perf_counter() - t0, 2)
            row.update(teacher_forced(model, ids, got, 1e-3 if dtype == torch.float32 else 0.75))
            same = sum(a == b for a, b in zip(got, ref))
            row["rows_equal_hf_generate"] = f"{same}/{rows}"
            row["engine"] = eng.describe()
            eng.release()
        except (ValueError, RuntimeError) as e:   # a variant this model or GPU cannot run: its reason
            row["refused"] = " ".join(str(e).split())[:300]
        out.append(row)
        print(json.dumps(row), flush=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, fp32, torch's bmm and sdpa")
    ap.add_argument("--archs", default="qwen3,gemma3")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    table = SMOKE if args.smoke else VARIANTS
    results = []
    for arch in args.archs.split(","):
        for dt in args.dtypes.split(","):
            if dt in table:
                results += run(arch, dt, table[dt], device, args.rows, args.prompt_len, args.new_tokens, args.smoke)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)}}
    text = json.dumps({"meta": meta, "results": results}, indent=1)
    if args.out:
        write_atomically(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
