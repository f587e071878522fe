"""Generation-only benchmark of the rollout engine's variants, side by side, each checked for correctness.

Random-weight llama models of the SmolLM2-360M and SmolLM2-1.7B shapes (widths from edgerl's model
catalogue, vocabulary 49152), `prompts x samples` rows, greedy, `--new-tokens` tokens after a
`--prompt-len`-token prompt, no EOS (every row generates the full length). Variants:

    hf_generate               HF `generate` (the reference; timed over --hf-tokens tokens)
    static_eager              static KV cache, fused projections, no graph (decode backend torch)
    graph_unfused             + CUDA graph, projections called as modules (three q/k/v matmuls, two gate/up)
    graph_torch               + CUDA graph, fused q/k/v and gate/up matmuls: decode backend torch
                              (baddbmm/softmax/bmm in fp32, SDPA in 16 bits) over the columns written so
                              far, a span at a time (a graph per span)
    graph_torch_whole         graph_torch over the whole cache at every step (one graph)
    graph_triton_attention    decode backend triton-attention: edgerl's rotary decode-attention kernel (only
                              the columns each row sees) between torch's projections (16 bits, CC >= 8.0)
    graph_triton_layers       decode backend triton-layers: that kernel between edgerl/kernels/decode_linear.py's
                              projections (the norms, SiLU * up and residual adds inside them), the plan's
                              choice in 16 bits
    graph_cuda_c              decode backend cuda-c: the CUDA C layer kernels (the plan's choice in fp32, and in
                              fp16 below CC 8.0)

The variants measured before and not kept (torch.compile'd layers, with and without split-K o and down
products; the attention kernel without its rotary part) are in docs/benchmarks.md and git history.

Per variant: ms per decode step (median over the decode steps of --reps calls, CUDA events), decode
tokens/s (rows / step time), share of the bandwidth bound (a step reads every weight once: weight
bytes / bandwidth; the bandwidth is measured by a device-to-device copy in this run unless
--bandwidth-tbs is given; the datasheet figure is shown too), graph capture time (with compilation
), kernels per step (profiler, one eager step), KV cache and graph pool sizes,
whether the graph survived a weight sync, and the correctness checks:

- Each variant's whole output is checked against HF's own forward pass over that same output
  (teacher forcing): every emitted token must be HF's argmax given the same prefix, or within a
  tolerance of it, in units of that position's logit std: 1e-3 in fp32, `--bf16-tol` (0.75) in bf16,
  and at least 99.9% (fp32) / `--bf16-min-match` (75%) of tokens must be the exact argmax (the bf16
  bar is HF generate's own agreement with HF's forward, measured on the H200: 83-87% of tokens, gaps
  to 0.3 std over 512 tokens; the engine's variants are checked over 4096). Different
  kernels round differently, and random-weight logits have many near-ties, so in bf16 an argmax can
  flip and a row then diverges from another variant's; checking each token given its own prefix
  stays meaningful after a flip. A wrong mask, rotary or cache write moves logits by about one std,
  far beyond the tolerance. HF generate's own output gets the same check, for scale.
- Reported beside it: rows equal to HF generate over its --hf-tokens tokens, and rows equal to
  graph_torch over the whole output (expected all in fp32, most in bf16).

    python bench/bench_rollout.py --out bench_rollout.json       # H200: ~3-4 minutes
    python bench/bench_rollout.py --smoke                         # tiny shapes on the CPU, torch backend
    TRITON_INTERPRET=1 python bench/bench_rollout.py --smoke --variants hf_generate,graph_triton_attention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.core.files import write_atomically  # noqa: E402
from edgerl.plan.modelspec import CATALOGUE  # noqa: E402
from edgerl.rollout import SamplingParams, StaticCacheEngine  # noqa: E402
from edgerl.rollout.engine_static import StepClock  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SHAPES = {**{n: CATALOGUE[f"smollm2-{n}"].llama_config_fields() for n in ("135m", "360m", "1.7b")}, "tiny": TINY}
DATASHEET_TBS = [   # HBM/GDDR bandwidth by device-name substring, TB/s (vendor datasheets)
    ("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935),
    ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3), ("A10", 0.6), ("RTX 4090", 1.008), ("RTX 3090", 0.936),
    ("V100", 0.9), ("T4", 0.32), ("P100", 0.732), ("P40", 0.346),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
VARIANTS = {   # engine keyword arguments; hf_generate has none
    "hf_generate": None,
    "graph_torch": dict(cuda_graphs=True, projections="fused"),
    "graph_torch_whole": dict(cuda_graphs=True, projections="fused", spans=False),
    "graph_unfused": dict(cuda_graphs=True, projections="modules"),
    "static_eager": dict(cuda_graphs=False, projections="fused"),
    "graph_triton_attention": dict(cuda_graphs=True, projections="fused", backend="triton-attention"),
    "graph_triton_layers": dict(cuda_graphs=True, projections="fused", backend="triton-layers"),
    "graph_cuda_c": dict(cuda_graphs=True, projections="fused", backend="cuda-c"),
}


def build(shape: str, vocab: int, dtype, device) -> LlamaForCausalLM:
    # initializer_range 0.1, not HF's 0.02: at 0.02 a random model repeats one token whatever attention
    # does, and the correctness check below would pass a broken rotary or mask (measured: it did).
    # No special token ids: HF generate must not stop a row early where the static engine does not.
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter once (the tied embedding is read whole by lm_head)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB: (read + write) bytes / time, bytes/s (best of 3 x 10 copies)."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        torch.cuda.synchronize(device)
        best = max(best, 2 * x.numel() * 10 / (time.perf_counter() - t0))
    del x, y
    return best


def datasheet_bandwidth(name: str):
    return next((tbs * 1e12 for key, tbs in DATASHEET_TBS if key.lower() in name.lower()), None)


class _Clock(StepClock, LogitsProcessor):
    """Marks each HF generate step (its logits processors run once per step) with the engine's clock."""

    def __call__(self, input_ids, scores):
        self.mark()
        return scores


def hf_generate(model, ids: torch.Tensor, new: int, cuda: bool):
    clock = _Clock(cuda)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True,
                           top_k=None, top_p=None, temperature=None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                         logits_processor=LogitsProcessorList([clock]))
    return out[:, ids.shape[1]:].tolist(), clock.ms()


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, responses: list[list[int]], tol: float) -> dict:
    """HF forward over prompt + response, row by row: is each emitted token HF's argmax given the same
    prefix? gap = max logit - logit of the emitted token, in units of that position's logit std."""
    W, gaps, match = ids.shape[1], [], 0
    for row, resp in zip(ids, responses):
        full = torch.cat((row, torch.tensor(resp, device=ids.device)))[None]
        logits = model(input_ids=full).logits[0, W - 1:W - 1 + len(resp)].float()
        tok = torch.tensor(resp, device=ids.device)
        chosen = logits.gather(1, tok[:, None])[:, 0]
        gap = (logits.max(-1).values - chosen) / logits.std(-1)
        gaps += gap.tolist()
        match += int((logits.argmax(-1) == tok).sum())
    gaps.sort()
    return {"argmax_match": round(match / len(gaps), 4), "gap_p99_std": round(gaps[int(0.99 * (len(gaps) - 1))], 5),
            "gap_max_std": round(gaps[-1], 5), "tokens_checked": len(gaps), "within_tol": gaps[-1] <= tol}


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    """Rows of a and b with equal tokens, and the earliest token index where any row differs (None: none)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    diverged = [f for f in firsts if f is not None]
    return {"rows_equal": len(firsts) - len(diverged), "rows": len(firsts),
            "first_divergence": min(diverged) if diverged else None}


@torch.no_grad()   # as generate runs it: no autograd records (LoRA adapters would otherwise be tracked)
def step_kernels(engine, width: int, rows: int = 0) -> list:
    """The kernel events (profiler) of one eager decode step of `rows` rows (0: the engine's max_batch)
    writing cache column `width`: CUDA kernels on a GPU, aten ops on the CPU (the smoke test's)."""
    from torch.profiler import ProfilerActivity, profile
    from edgerl.rollout.engine_static import _Mode
    s, n = engine._state, rows or engine.max_batch
    cuda = engine.device.type == "cuda"
    mode = _Mode(rows=n, full=n, greedy=True, top_k=0, top_p=False, eos=(), pad=0, span=engine._span(width))
    s.col.fill_(width)      # a column inside the cache: the step writes it
    s.step.fill_(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        engine._step(mode)
        sync()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return [e for e in prof.events() if e.device_type == kind]


def count_kernels(engine, width: int) -> tuple[int, float, list, list]:
    """CUDA kernels launched by one eager decode step (copies and fills left out), their summed device
    time in microseconds (no launch gaps: compare with the captured step's time), the 12 kernel
    names taking the most of it: [name, launches, total us], and the first 40 kernels in launch order
    ([name, us]: the embedding and the first layers, to read one layer's kernels off)."""
    kernels = [e for e in step_kernels(engine, width)
               if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    by_name: dict[str, list] = {}
    for e in kernels:
        row = by_name.setdefault(e.name[:90], [e.name[:90], 0, 0.0])
        row[1] += 1
        row[2] += e.time_range.elapsed_us()
    top = sorted(by_name.values(), key=lambda r: -r[2])[:12]
    seq = [[e.name[:70], round(e.time_range.elapsed_us(), 1)] for e in kernels[:40]]
    return (len(kernels), round(sum(r[2] for r in by_name.values()), 1), [[n, c, round(t, 1)] for n, c, t in top],
            seq)


def run_static(args, model, ids, kw, rec, cuda) -> list[list[int]]:
    prompts = ids.tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, greedy=True)
    engine = StaticCacheEngine(model, ids.shape[0], ids.shape[1] + args.new_tokens, time_steps=True, **kw)
    rec["describe"] = engine.describe()
    try:
        t0 = time.perf_counter()
        first = engine.generate(prompts, 1, params)
        rec["first_call_s"] = round(time.perf_counter() - t0, 3)
        rec["capture_s"] = round(first.info["capture_s"], 3)
        steps, walls, infos = [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = engine.generate(prompts, 1, params)
            walls.append(time.perf_counter() - t0)
            steps += out.info["step_ms"]
            infos.append(out.info)
            rec["deterministic"] = rec.get("deterministic", True) and out.response_ids == first.response_ids
        rec["ms_per_step"] = round(statistics.median(steps), 4)
        rec["ms_per_step_p90"] = round(sorted(steps)[int(0.9 * (len(steps) - 1))], 4)
        # a span's steps read more columns than the one before: the mean is the decode's time per token
        rec["ms_per_step_mean"] = round(statistics.fmean(steps), 4)
        rec["spans"], rec["captures_first_call"] = first.info["spans"] + 1, first.info["captures"]
        rec["wall_s"] = round(statistics.median(walls), 4)
        rec["prefill_s"] = round(statistics.median(i["prefill_s"] for i in infos), 4)
        rec["recaptures_in_timed_calls"] = sum(i["captures"] for i in infos)
        mem = engine.memory_bytes()
        rec["kv_cache_mib"] = round(mem["kv_cache"] / 2**20, 1)
        rec["graph_pool_mib"] = round(mem["graph_pool"] / 2**20, 1)
        if cuda and args.count_kernels:
            try:
                rec["kernels_per_step"], rec["kernel_us_per_step"], rec["top_kernels"], rec["kernel_sequence"] = \
                    count_kernels(engine, ids.shape[1])
            except Exception as e:   # the profiler is a nicety; the timing stands without it
                rec["kernels_per_step"] = f"not counted: {type(e).__name__}: {e}"[:200]
        # Keeping the graph: an in-place weight sync, then a short generate of the same mode.
        t0 = time.perf_counter()
        engine.sync_weights(list(model.state_dict().items()))
        rec["sync_s"] = round(time.perf_counter() - t0, 4)
        short = engine.generate(prompts, 1, SamplingParams(max_new_tokens=8, greedy=True))
        rec["graph_kept_across_sync"] = (short.info["captures"] == 0 and not short.info["graphs_dropped"]
                                         if kw["cuda_graphs"] else None)
        rec["same_after_sync"] = [r[:8] for r in first.response_ids] == short.response_ids
        # What the trainer runs: sampling with top-p, a second captured graph in the same pool.
        sampled = engine.generate(prompts, 1, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9),
                                  generator=torch.Generator().manual_seed(0))
        rec["capture_s_top_p"] = round(sampled.info["capture_s"], 3)
        rec["graph_pool_mib_greedy_and_top_p"] = round(engine.memory_bytes()["graph_pool"] / 2**20, 1)
        return first.response_ids
    finally:
        engine.release()


def run_config(args, shape, dt, names, device, bw, sheet, budget_end, results, outputs, save):
    cuda = device.type == "cuda"
    model = build(shape, args.vocab, DTYPES[dt], device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.rows, args.prompt_len), generator=g).to(device)
    wb = weight_bytes(model)
    key = (shape, dt)
    for name in names:
        rec = {"model": shape, "dtype": dt, "variant": name, "rows": args.rows, "new_tokens": args.new_tokens,
               "prompt_len": args.prompt_len, "weight_bytes": wb}
        results.append(rec)
        if time.perf_counter() > budget_end:
            rec["error"] = "skipped: --budget-s reached"
            print(json.dumps(rec), flush=True)
            save()
            continue
        kw = VARIANTS[name]
        if kw is not None and not cuda:   # no CUDA: the same engine without a graph
            kw = {**kw, "cuda_graphs": False}
            rec["note"] = "no CUDA: ran without a graph"
        t_variant = time.perf_counter()
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            if kw is None:
                hf_generate(model, ids, 2, cuda)   # warm-up: cuBLAS handles, allocator
                t0 = time.perf_counter()
                toks, ms = hf_generate(model, ids, args.hf_tokens, cuda)
                rec["wall_s"] = round(time.perf_counter() - t0, 4)
                rec["ms_per_step"] = round(statistics.median(ms), 4)
            else:
                toks = run_static(args, model, ids, kw, rec, cuda)
            outputs[(key, name)] = toks
            rec["decode_tok_s"] = round(args.rows * 1e3 / rec["ms_per_step"], 1)
            if bw:
                rec["bound_ms"] = round(1e3 * wb / bw, 4)
                rec["share_of_bound"] = round(rec["bound_ms"] / rec["ms_per_step"], 4)
            if sheet:
                rec["share_of_datasheet_bound"] = round(1e3 * wb / sheet / rec["ms_per_step"], 4)
            if cuda:
                rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            check(args, rec, model, ids, toks, outputs, key, dt)
        except Exception as e:   # keep going: one failing variant must not hide the others
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            rec["traceback"] = traceback.format_exc()[-2000:]
        rec["variant_s"] = round(time.perf_counter() - t_variant, 1)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        save()   # after every variant: a run cut short by a time limit still leaves its results
    del model
    if cuda:
        torch.cuda.empty_cache()


def check(args, rec, model, ids, toks, outputs, key, dt) -> None:
    """Pass/fail from HF's forward over the variant's own output (see the module docstring); token
    equality with HF generate and with graph_torch is reported beside it. Even in fp32 two correct
    kernels can order a near-tie differently once in a few thousand tokens, so equality is not required."""
    fp32 = dt == "fp32"
    c = rec["check_hf_forward"] = teacher_forced(model, ids, toks, 1e-3 if fp32 else args.bf16_tol)
    ok = c["within_tol"] and c["argmax_match"] >= (0.999 if fp32 else args.bf16_min_match)
    ref = outputs.get((key, "hf_generate"))
    if ref is not None and rec["variant"] != "hf_generate":
        rec["check_hf_prefix"] = first_divergence([r[:args.hf_tokens] for r in toks], ref)
    base = outputs.get((key, "graph_torch"))
    if base is not None and rec["variant"] not in ("hf_generate", "graph_torch"):
        rec["check_vs_graph_torch"] = first_divergence(toks, base)
    if "deterministic" in rec:
        ok = ok and rec["deterministic"] and rec["same_after_sync"]
    rec["ok"] = bool(ok)


def table(results, note: str) -> str:
    lines = [note, "", "| model | dtype | variant | ms/step | decode tok/s | of bound | of datasheet bound "
             "| gpu_kernels/step | capture s | first call s | graph pool MiB (greedy, +top-p) | graph kept over sync "
             "| checks |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['variant']} | {r['error'][:120]} ||||||||| fail |")
            continue
        pct = lambda k: f"{100 * r[k]:.1f}%" if k in r else "-"   # noqa: E731
        c = r["check_hf_forward"]
        eq = lambda k: f"{r[k]['rows_equal']}/{r[k]['rows']}"   # noqa: E731
        checks = (f"{'ok' if r['ok'] else 'FAIL'}: argmax {100 * c['argmax_match']:.1f}%, "
                  f"max gap {c['gap_max_std']:.3f} std"
                  + (f", = hf prefix {eq('check_hf_prefix')}" if "check_hf_prefix" in r else "")
                  + (f", = graph_torch {eq('check_vs_graph_torch')}" if "check_vs_graph_torch" in r else ""))
        lines.append(f"| {r['model']} | {r['dtype']} | {r['variant']} | {r['ms_per_step']:.3f} | "
                     f"{r['decode_tok_s']:.0f} | {pct('share_of_bound')} | {pct('share_of_datasheet_bound')} | "
                     f"{r.get('kernels_per_step', '-')} | "
                     f"{r.get('capture_s', '-')} | {r.get('first_call_s', '-')} | "
                     f"{r.get('graph_pool_mib', '-')}, {r.get('graph_pool_mib_greedy_and_top_p', '-')} | "
                     f"{r.get('graph_kept_across_sync', '-')} | {checks} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="360m:bf16,1.7b:bf16,360m:fp32", help="model:dtype list")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-tokens", type=int, default=32, help="HF generate's length (timing and the prefix check)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=2, help="timed generate calls per variant after the first")
    ap.add_argument("--bandwidth-tbs", type=float, default=None, help="bandwidth for the bound (default: measured)")
    ap.add_argument("--bf16-tol", type=float, default=0.75, help="largest gap to HF's argmax, in logit std")
    ap.add_argument("--bf16-min-match", type=float, default=0.75, help="least share of tokens equal to HF's argmax")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no variant after this many seconds")
    ap.add_argument("--no-count-kernels", dest="count_kernels", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default=None, help="JSON output (default $OUT/bench_rollout.json when OUT is set)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.configs, args.rows, args.prompt_len, args.new_tokens, args.hf_tokens = "tiny:fp32,tiny:bf16", 4, 8, 12, 6
        args.vocab, args.reps = 300, 1
        if args.variants == ",".join(VARIANTS):
            args.variants = ",".join(v for v in VARIANTS if "triton" not in v and "cuda_c" not in v)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = sheet = None
    note = "no bandwidth bound on the CPU"
    if device.type == "cuda":
        sheet = datasheet_bandwidth(name)
        measured = measure_bandwidth(device)
        bw = args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else measured
        note = (f"{name}: measured device copy {measured / 1e12:.2f} TB/s, datasheet "
                f"{f'{sheet / 1e12:.2f} TB/s' if sheet else 'unknown'}; 'of bound' uses {bw / 1e12:.2f} TB/s")
    results, outputs = [], {}
    out = args.out or (os.path.join(os.environ["OUT"], "bench_rollout.json") if os.environ.get("OUT") else None)

    def save() -> None:
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(Path(out), json.dumps({"device": name, "bandwidth_note": note,
                                                     "torch": torch.__version__, "args": vars(args),
                                                     "table": table(results, note), "records": results}, indent=1))

    for shape, dt in configs:
        run_config(args, shape, dt, names, device, bw, sheet, t_start + args.budget_s, results, outputs, save)
    report = table(results, note)
    print("\n" + report)
    bad = [r["variant"] + " " + r["model"] + " " + r["dtype"] for r in results if not r.get("ok")]
    print(f"\n{len(results) - len(bad)}/{len(results)} variants ran and passed their checks"
          + (f"; not: {', '.join(bad)}" if bad else "") + f"; {time.perf_counter() - t_start:.0f} s")
    save()
    if out:
        print(f"wrote {out}")
    return 1 if bad and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
