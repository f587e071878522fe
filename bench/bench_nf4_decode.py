"""Where a rollout decode step over a quantized (NF4 / int8) base with LoRA adapters spends its time.

A few decoder layers of a real shape (default: Qwen2.5-7B's widths, 4 of its 28 layers), quantized with
edgerl's own `quantize_linear`, peft LoRA r=16 on every projection, compute in `--compute` (fp32: what a
P40 plan runs). It reports, per layer of one decode step of `--rows` rows:

- the step time of the static engine (CUDA graph, projections called as modules), per layer;
- the CUDA kernels of one eager step from the profiler, grouped by name, with their share;
- the parts on their own: dequantizing each projection's weight to the compute dtype, the matmul in the
  compute dtype on an already dequantized weight, the bitsandbytes module's forward, and the LoRA path;
- the bandwidth floor of the same work (4-bit reads, the dequantized weight written and read once);
- with `--kernel` (default on, nf4 only): the same step and parts through edgerl's fused NF4 kernel
  (`edgerl.models.quant_decode`), its agreement with bitsandbytes, and both timed inside CUDA graphs over
  `--row-sweep` rows on four projections;
- with `--cuda-layer` (default on, fp32 and fp16): the fused-kernel step again with decode backend `cuda-c` (the
  layer kernels of `edgerl/kernels/decode_cuda.py`) against torch's ops, its greedy tokens against theirs (in fp16
  what `plan.decode_backend=cuda-c` runs on a T4 or V100 plan).

    python bench/bench_nf4_decode.py [--shape qwen7b] [--layers 4] [--rows 16] [--compute fp32] [--out F]

Random weights; speed only (the engine's agreement with HF is checked in tests/test_quant_cuda.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgerl.core.files import write_atomically  # noqa: E402

SHAPES = {   # hidden, heads, kv heads, intermediate (Qwen2.5-7B, Llama-3.1-8B)
    "qwen7b": (3584, 28, 4, 18944),
    "llama8b": (4096, 32, 8, 14336),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def build(args, compute):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from edgerl.models.quant import quantize_linear
    hidden, heads, kv, inter = SHAPES[args.shape]
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, num_hidden_layers=args.layers, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(compute)
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                setattr(owner, n, quantize_linear(getattr(owner, n), args.quant, compute))
    torch.cuda.empty_cache()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, lora).eval()


def kernels(engine, rows: int, width: int) -> list[dict]:
    """One eager decode step's CUDA kernels grouped by name, the most time first."""
    from bench_rollout import step_kernels
    by = defaultdict(lambda: [0, 0.0])
    events = step_kernels(engine, width, rows)
    seq = [[e.name[:70], round(e.device_time_total, 1)] for e in events[:45]]   # launch order, us
    for e in events:
        by[e.name[:90]][0] += 1
        by[e.name[:90]][1] += e.device_time_total / 1e3
    total = sum(v[1] for v in by.values())
    rows_ = sorted(({"kernel": k, "calls": v[0], "ms": round(v[1], 3), "share": round(v[1] / total, 3)}
                    for k, v in by.items()), key=lambda r: -r["ms"])
    return [{"total_kernel_ms": round(total, 3), "kernels": sum(v[0] for v in by.values()),
             "sequence": seq}] + rows_[:25]


def part(mod, inp, compute, bandwidth: float) -> dict:
    """One LoRA-wrapped quantized projection `mod` on input rows `inp`, timed piece by piece."""
    from edgerl.models.quant import dequantized_weight
    base = mod.base_layer
    fused = type(base).__name__ == "DecodeLinear4bit"   # the fused kernel is on
    plain = type(base).__mro__[1] if fused else type(base)
    w = dequantized_weight(base, compute)
    rec = {"shape": list(w.shape),
           "dequantize_ms": cuda_ms(lambda: dequantized_weight(base, compute)),
           "matmul_ms": cuda_ms(lambda: torch.nn.functional.linear(inp, w)),
           "bnb_forward_ms": cuda_ms(lambda: plain.forward(base, inp)),
           "lora_module_ms": cuda_ms(lambda: mod(inp))}
    if fused:
        rec["fused_kernel_ms"] = cuda_ms(lambda: base(inp))
        want = plain.forward(base, inp).float()
        rec["fused_vs_bnb_max_rel"] = float((base(inp).float() - want).abs().max() / want.abs().max())
    packed = base.weight.numel() * base.weight.element_size()
    rec["floor_ms"] = 1e3 * (packed + 2 * w.numel() * w.element_size()) / bandwidth
    # eager times (they include Python's launch cost); small relative errors keep 3 significant digits
    return {k: (float(f"{v:.3g}") if k.endswith("_rel") else round(v, 4)) if isinstance(v, float) else v
            for k, v in rec.items()}


def parts(model, args, compute) -> dict:
    layer = model.base_model.model.model.layers[0]
    hidden, _, _, inter = SHAPES[args.shape]
    x = torch.randn(args.rows, hidden, device="cuda", dtype=compute)
    xi = torch.randn(args.rows, inter, device="cuda", dtype=compute)
    return {"q_proj": part(layer.self_attn.q_proj, x, compute, args.bandwidth),
            "gate_proj": part(layer.mlp.gate_proj, x, compute, args.bandwidth),
            "down_proj": part(layer.mlp.down_proj, xi, compute, args.bandwidth)}


def graph_ms(fn, reps: int = 50) -> float:
    """GPU time of one call of `fn`, from a CUDA graph of `reps` calls (no Python launch cost inside)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps)


def row_sweep(model, args, compute) -> list[dict]:
    """bitsandbytes' forward against the fused kernel, each timed inside a CUDA graph, on layer 0's
    q, k, gate and down projections for each row count of `--row-sweep`."""
    from edgerl.kernels.nf4 import nf4_matmul
    layer = model.base_model.model.model.layers[0]
    out = []
    for name, mod in (("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                      ("gate_proj", layer.mlp.gate_proj), ("down_proj", layer.mlp.down_proj)):
        base = mod.base_layer
        plain = type(base).__mro__[1]
        for m in (int(r) for r in args.row_sweep.split(",")):
            x = torch.randn(m, base.in_features, device="cuda", dtype=compute)
            bnb_ms, fused_ms = graph_ms(lambda: plain.forward(base, x)), graph_ms(lambda: base(x))
            rec = {"proj": name, "shape": [base.out_features, base.in_features], "rows": m,
                   "bnb_ms": round(bnb_ms, 4), "fused_ms": round(fused_ms, 4), "speedup": round(bnb_ms / fused_ms, 2)}
            w, st = base.weight.data, base.weight.quant_state
            if args.split_sweep:   # the kernel with K split into each of these many parts
                rec["ms_by_splits"] = {s: round(graph_ms(lambda s=s: nf4_matmul(x, w, st, splits=s)), 4)
                                       for s in (int(v) for v in args.split_sweep.split(","))}
            # the projection's LoRA adapter inside the kernel, against what it cost as its own cuBLAS matmul
            ab = (mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach(), 0.5)
            rec["fused_with_lora_ms"] = round(graph_ms(lambda: nf4_matmul(x, w, st, lora=ab)), 4)
            rec["x_at_cublas_ms"] = round(graph_ms(lambda: torch.nn.functional.linear(x.float(), ab[0])), 4)
            out.append(rec)
    return out


def equal_share(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of a's tokens that b has at the same place."""
    return round(sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / max(sum(map(len, a)), 1), 3)


def engine_step(model, args, ids, params, backend: str = "torch") -> dict:
    from edgerl.rollout import StaticCacheEngine
    engine = StaticCacheEngine(model, args.rows, args.prompt_len + args.new_tokens, cuda_graphs=True,
                               projections="modules", backend=backend, time_steps=True)
    engine.generate(ids.tolist(), 1, params)
    t0 = time.perf_counter()
    out = engine.generate(ids.tolist(), 1, params)
    ms = statistics.median(out.info["step_ms"])
    return {"graph_step_ms": round(ms, 3), "graph_step_ms_per_layer": round(ms / args.layers, 3),
            "generate_s": round(time.perf_counter() - t0, 3), "engine": engine, "tokens": out.response_ids}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--quant", default="nf4", choices=["nf4", "int8"])
    ap.add_argument("--compute", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s for the floor (H200 copy: ~4.0e12)")
    ap.add_argument("--kernel", default="on", choices=["on", "off"], help="also time the fused NF4 kernel")
    ap.add_argument("--row-sweep", default="1,4,16,32,64", help="row counts for the kernel against bitsandbytes")
    ap.add_argument("--split-sweep", default="", help="also time the kernel at each of these K splits (e.g. 1,2,4,7)")
    ap.add_argument("--cuda-layer", default="on", choices=["on", "off"],
                    help="also time the step with decode backend cuda-c (the fp32 CUDA C layer kernels)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_nf4_decode needs a CUDA GPU (bitsandbytes' CUDA kernels are what it times)", file=sys.stderr)
        return 2
    from edgerl.rollout import SamplingParams
    compute = DTYPES[args.compute]
    result = {"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = build(args, compute)
    ids = torch.randint(3, args.vocab, (args.rows, args.prompt_len), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=args.new_tokens, greedy=True)
    step = engine_step(model, args, ids, params)
    engine, tokens = step.pop("engine"), step.pop("tokens")
    result.update(step)
    result["profile_eager_step"] = kernels(engine, args.rows, args.prompt_len)
    result["parts_layer0"] = parts(model, args, compute)
    del engine
    if args.kernel == "on" and args.quant == "nf4":
        from edgerl.models import quant_decode
        from edgerl.kernels.tiles import NF4_DECODE_ROWS
        quant_decode.enable(model, NF4_DECODE_ROWS)   # as decode backend cuda-c does
        fused = engine_step(model, args, ids, params)
        fengine, ftokens = fused.pop("engine"), fused.pop("tokens")
        fused["greedy_tokens_equal_share"] = equal_share(tokens, ftokens)
        fused["speedup_vs_bnb"] = round(result["graph_step_ms"] / fused["graph_step_ms"], 2)
        fused["profile_eager_step"] = kernels(fengine, args.rows, args.prompt_len)
        fused["parts_layer0"] = parts(model, args, compute)
        fused["row_sweep"] = row_sweep(model, args, compute)
        result["fused_kernel"] = fused
        del fengine
        if args.compute in ("fp32", "fp16") and args.cuda_layer == "on":   # edgerl/kernels/decode_cuda.py
            layer = engine_step(model, args, ids, params, "cuda-c")
            lengine, ltokens = layer.pop("engine"), layer.pop("tokens")
            layer["greedy_tokens_equal_share_vs_bmm"] = equal_share(ftokens, ltokens)
            layer["speedup_vs_bmm"] = round(fused["graph_step_ms"] / layer["graph_step_ms"], 3)
            layer["profile_eager_step"] = kernels(lengine, args.rows, args.prompt_len)
            result["fused_kernel_cuda_layer"] = layer
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        write_atomically(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
