"""Generation-only micro-benchmark: HF `generate` vs the static-cache engine (eager, and CUDA graphs).

Random-weight llama models of the SmolLM2-360M and SmolLM2-1.7B shapes, `prompts x samples` rows of
`--new-tokens` tokens after a `--prompt-len`-token prompt. No EOS is given, so every row generates the
full length (random weights rarely emit EOS anyway): the numbers are for full-length responses.
Reports wall time, tokens/s, decode time per step, peak memory, and the memory-bandwidth bound: each
decode step must read every weight once, so step time >= weight bytes / bandwidth.

    python bench/bench_rollout.py                       # on a GPU: 360m and 1.7b, bf16 and fp32
    python bench/bench_rollout.py --fp32-cap-gib 24     # fp32 runs capped at 24 GiB (a P40/3090-size card)
    python bench/bench_rollout.py --smoke               # tiny sizes on the CPU, checks the script runs
    python bench/bench_rollout.py --cpu-compare         # 135M shape on the CPU: HF generate vs static eager
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.modelspec import CATALOGUE  # noqa: E402
from edgerl.rollout import HFGenerateEngine, SamplingParams, StaticCacheEngine  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SHAPES = {   # SmolLM2 shapes from edgerl's catalogue (tied embeddings, vocab 49152), and a tiny one for --smoke
    **{name: CATALOGUE[f"smollm2-{name}"].llama_config_fields() for name in ("135m", "360m", "1.7b")},
    "tiny": TINY,
}
DATASHEET_TBS = [   # HBM/GDDR bandwidth by device-name substring, TB/s (vendor datasheets)
    ("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935),
    ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3), ("A10", 0.6), ("RTX 4090", 1.008), ("RTX 3090", 0.936),
    ("V100", 0.9), ("T4", 0.32), ("P100", 0.732), ("P40", 0.346),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def build(shape: str, vocab: int, dtype, device) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=100000.0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter once (the tied embedding is read whole by lm_head)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB: (read + write) bytes / time, bytes/s."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(device)
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    return bw


def datasheet_bandwidth(name: str):
    for key, tbs in DATASHEET_TBS:
        if key.lower() in name.lower():
            return tbs * 1e12
    return None


def make_engine(kind: str, model, rows: int, seq_len: int):
    if kind == "hf_generate":
        return HFGenerateEngine(model, rows)
    return StaticCacheEngine(model, rows, seq_len, cuda_graphs=(kind == "static_graph"))


def run_one(args, shape, dtype_name, kind, device, bw) -> dict:
    dtype = DTYPES[dtype_name]
    cuda = device.type == "cuda"
    rec = {"model": shape, "dtype": dtype_name, "engine": kind, "rows": args.prompts * args.samples,
           "new_tokens": args.new_tokens, "prompt_len": args.prompt_len}
    if cuda:
        cap = args.fp32_cap_gib if dtype_name == "fp32" else None
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total) if cap else 1.0, torch.cuda.current_device())
        rec["memory_cap_gib"] = cap
        torch.cuda.empty_cache()
    model = engine = None
    try:
        model = build(shape, args.vocab, dtype, device)
        rec["weight_bytes"] = weight_bytes(model)
        if cuda:   # the peak of generation (weights included), not of building the random model in fp32
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, eos_token_ids=())
        engine = make_engine(kind, model, rec["rows"], args.prompt_len + args.new_tokens)
        walls, infos = [], []
        for rep in range(args.reps + 1):       # rep 0 warms up (and captures the graph)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = engine.generate(prompts, args.samples, params, generator=torch.Generator().manual_seed(rep))
            if cuda:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
            assert all(len(r) == args.new_tokens for r in out.response_ids), "a row stopped early"
            if rep == 0:
                rec["first_call_s"] = round(wall, 4)
                rec["capture_s"] = round(out.info.get("capture_s", 0.0), 4)
            else:
                walls.append(wall)
                infos.append(out.info)
        wall = statistics.median(walls)
        tokens = rec["rows"] * args.new_tokens
        rec.update(wall_s=round(wall, 4), tokens_per_s=round(tokens / wall, 1))
        if infos and "decode_s" in infos[0]:
            dec = statistics.median(i["decode_s"] for i in infos)
            rec["prefill_s"] = round(statistics.median(i["prefill_s"] for i in infos), 4)
            rec["decode_ms_per_step"] = round(1e3 * dec / max(1, args.new_tokens - 1), 3)
        else:   # HF generate: no split, charge the whole call to the steps
            rec["decode_ms_per_step"] = round(1e3 * wall / args.new_tokens, 3)
        if bw:
            bound_ms = 1e3 * rec["weight_bytes"] / bw
            rec["bound_ms_per_step"] = round(bound_ms, 4)
            rec["bandwidth_fraction"] = round(bound_ms / rec["decode_ms_per_step"], 4)
        if cuda:
            rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    except torch.cuda.OutOfMemoryError as e:
        rec["error"] = "out of memory: " + str(e).split("\n")[0][:200]
    finally:
        if engine is not None and hasattr(engine, "release"):
            engine.release()
        del engine, model
        if cuda:
            torch.cuda.empty_cache()
    return rec


def table(records, bw_note: str) -> str:
    lines = [f"bandwidth bound: {bw_note}", "",
             "| model | dtype | engine | wall s | tok/s | ms/step | bound ms/step | of bound | first call s | "
             "capture s | peak GiB |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['engine']} | {r['error']} |||||||| ")
            continue
        frac = f"{100 * r['bandwidth_fraction']:.1f}%" if "bandwidth_fraction" in r else "-"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['engine']} | {r['wall_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['decode_ms_per_step']:.2f} | {r.get('bound_ms_per_step', '-')} | {frac} | "
                     f"{r['first_call_s']:.2f} | {r['capture_s']:.2f} | {r.get('peak_mem_gib', '-')} |")
    by = {(r["model"], r["dtype"]): {} for r in records}
    for r in records:
        if "error" not in r:
            by[(r["model"], r["dtype"])][r["engine"]] = r["wall_s"]
    lines.append("")
    for (m, d), e in by.items():
        if "hf_generate" in e:
            rel = ", ".join(f"{k} {e['hf_generate'] / v:.1f}x" for k, v in e.items() if k != "hf_generate")
            lines.append(f"- {m} {d}: speed-up over hf_generate: {rel}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="360m,1.7b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--engines", default="hf_generate,static_eager,static_graph")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up call (median)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None, help="override the bandwidth used for the bound")
    ap.add_argument("--fp32-cap-gib", type=float, default=None,
                    help="cap fp32 runs at this much device memory (set_per_process_memory_fraction)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--cpu-compare", action="store_true", help="135M shape on the CPU, fp32, HF vs static eager")
    ap.add_argument("--out", default=None, help="JSON output (default $OUT/bench_rollout.json when OUT is set)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not (args.smoke or args.cpu_compare) else "cpu")
    if args.smoke:
        args.models, args.dtypes, args.engines = "tiny", "fp32,bf16", "hf_generate,static_eager"
        args.prompts, args.samples, args.prompt_len, args.new_tokens, args.vocab, args.reps = 2, 2, 8, 8, 300, 1
    if args.cpu_compare:
        args.models, args.dtypes, args.engines = "135m", "fp32", "hf_generate,static_eager"
    if device.type == "cpu" and "static_graph" in args.engines:
        args.engines = ",".join(e for e in args.engines.split(",") if e != "static_graph")
        print("no CUDA: static_graph skipped")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw, note = None, "not computed on the CPU"
    if device.type == "cuda":
        measured = measure_bandwidth(device)
        sheet = datasheet_bandwidth(name)
        bw = args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else (sheet or measured)
        note = (f"{name}: datasheet {sheet / 1e12 if sheet else '?'} TB/s, measured copy {measured / 1e12:.2f} TB/s; "
                f"bound uses {bw / 1e12:.2f} TB/s")
    records = []
    for shape in args.models.split(","):
        for dt in args.dtypes.split(","):
            for kind in args.engines.split(","):
                rec = run_one(args, shape, dt, kind, device, bw)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    report = table(records, note)
    print("\nrows never stop at EOS (none given; random weights): every row generates the full length\n")
    print(report)
    out = args.out or (os.path.join(os.environ["OUT"], "bench_rollout.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"device": name, "bandwidth_note": note, "torch": torch.__version__,
                                         "threads": torch.get_num_threads(), "args": vars(args),
                                         "records": records}, indent=1))
        print(f"\nwrote {out}")
    return 1 if any("error" in r for r in records) and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
