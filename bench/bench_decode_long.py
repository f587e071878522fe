"""The rollout's decode step at long cache lengths, for the plans small cards get, against the bytes it must read.

At reasoning lengths the rollout is most of a step, and each decode step reads every weight once plus the KV
cache written so far. This bench times one decode step of the static engine at a cache column of 512, 2048 and
8192 (`--lengths`) for each configuration below, as the plan for its card sets it up today (compute dtype, decode
backend, rows per rollout pass at that response length: `edgerl.plan.plan`), and reports it as a share of the
copy bound: (the bytes the step reads) / (the device-to-device copy bandwidth measured in the run) / (the step's
time). Where the decode backend is cuda-c, whose kernels compute in fp32 on CUDA cores, it also reports the step's
FLOPs (2 x rows x each linear layer's in x out, and the attention's q k^T and p v) over the fp32 GEMM rate measured
in the run, and the step as a share of the roofline, the larger of the two floors: at 16 rows an NF4 weight (half a
byte) takes 32 fp32 FLOPs, more than a GPU's fp32 rate covers at its bandwidth, so there the FLOPs set the floor.
In fp16 over an NF4 base from CC 7.5 the 4-bit products run on tensor cores (`edgerl/kernels/nf4.py`), and the
fp32 floor counts the attention's FLOPs alone.

    p40-1.5b-full   Qwen2.5-1.5B widths, full fine-tuning on a P40: fp32 weights and cache, decode backend cuda-c
    p40-1.5b-lora   the same widths with LoRA r=16 over the fp32 base (peft's layers, called as modules)
    p40-7b-nf4      Qwen2.5-7B widths over an NF4 base with LoRA r=16 on a P40: fp32 compute, cuda-c + the fused NF4
                    kernel
    t4-8b-nf4       Llama-3.1-8B widths over an NF4 base with LoRA r=16 on a T4: fp16 compute, cuda-c + the NF4 kernel

    4090-1.5b-bf16  Qwen2.5-1.5B widths, full fine-tuning in bf16 on an RTX 4090: the Triton layers

The KV cache is stored as the plan stores it (`plan.kv_cache_dtype`: fp16 under fp32 compute with cuda-c);
`--kv-cache compute` stores it in the compute dtype, for the A/B. `--matmul cublas` (or `plan,cublas`, both on one
model) sends an fp32 plan's projections and logits to cuBLAS instead of edgerl's few-row kernel
(`edgerl/kernels/fp32_mm.py`), for its A/B.

Bytes a step reads: each weight as stored (NF4: the 4-bit codes, their absmax bytes and the nested fp32 absmax;
the LoRA adapters; norms; the LM head whole; of an untied input embedding only the rows' tokens, counted as
nothing), and the KV cache's columns each row sees (`rows x (L + 1) x layers x 2 x KV heads x head dim x the
cache's element size`). The step writes one cache column and a few activations, counted as nothing.

Under cuda-c (fp32 arithmetic on CUDA cores) each record also has the step's fp32 FLOPs at the measured fp32 GEMM
rate (`flop_ms`), the larger of that and the copy bound (`roofline_ms`), and `ceiling_of_bound`: the share of the
copy bound a step could reach whose products and attention run one after the other, each at the larger of its
bytes' time and its fp32 FLOPs' time (an NF4 product on tensor cores: its bytes' alone).

How it times: after a short generate (which allocates the cache and captures the sampling step's CUDA graph),
the engine's column counter is set to L and the step's graph replayed `--reps` times (the counter advances by
one each time), timed by CUDA events. The columns between the prompt and L hold zeros instead of keys: the
kernels' work does not depend on the values. Random-weight models at the real widths (SmolLM2's vocabulary,
49152, as the step benchmarks use), llama layers. `--profile` adds one eager step's kernels at each length,
grouped by name (where the step's time goes).

    python bench/bench_decode_long.py [--configs p40-1.5b-full,p40-7b-nf4,t4-8b-nf4] [--lengths 512,2048,8192]
    python bench/bench_decode_long.py --smoke      # tiny shapes on the CPU, eager steps, torch's ops (the code path)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from edgerl.core.files import write_atomically  # noqa: E402
from edgerl.plan.dtypes import torch_dtype  # noqa: E402

# name: (card whose plan it is, widths (bench/benchlib.py's SHAPES), a quantized base ("nf4"), "lora" (LoRA over the
# unquantized base), or None for full fine-tuning)
CONFIGS: dict[str, tuple[str, str, str | None]] = {
    "p40-1.5b-full": ("p40", "1.5b", None),
    "p40-1.5b-lora": ("p40", "1.5b", "lora"),
    "p40-7b-nf4": ("p40", "qwen7b", "nf4"),
    "t4-8b-nf4": ("t4", "llama8b", "nf4"),
    "4090-1.5b-bf16": ("rtx4090", "1.5b", None),
}
SMOKE_SHAPE = (64, 2, 4, 2, 128, True)
VOCAB = 49152
PROMPT = 64
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def plan_for(card: str, shape: str, base: str | None, length: int, widths: tuple) -> Any:
    """The plan `card` gets today for 2 prompts x 8 samples of `length` new tokens after 64-token prompts."""
    from edgerl.device.device import Software
    from edgerl.device.profiles import device_from_profile, get_profile
    from edgerl.plan.modelspec import ModelSpec
    from edgerl.plan.plan import plan
    from edgerl.plan.task import Task
    sw = Software(python="3.12", torch="2.11.0+cu130", torch_cuda="13.0", arch_list=("sm_80", "sm_90"),
                  libs=(("torch", "2.11.0"), ("transformers", "5.17.0"), ("triton", "3.6.0"),
                        ("bitsandbytes", "0.50.2")))
    h, layers, heads, kv, mlp, tied = widths
    model = ModelSpec(shape, "llama", VOCAB, h, layers, heads, kv, mlp, tied, max_position=32768)
    task = Task(prompt_len=PROMPT, response_len=length, prompts_per_step=2, samples_per_prompt=8, kl=True,
                lora=bool(base))
    dev = device_from_profile(get_profile(card), sw, 128 << 30)
    return plan(dev, model, task, {"base_dtype": base} if base and base != "lora" else {})


def build(widths: tuple, dtype: torch.dtype, base: str | None, device: torch.device, max_len: int):
    """A random-weight llama model at these widths in `dtype`; with `base`, peft LoRA r=16 on every projection, over
    the base as it is ("lora") or quantized ("nf4": every decoder linear quantized as edgerl's loader does, the rest
    in the compute dtype)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    h, layers, heads, kv, mlp, tied = widths
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=tied,
                      max_position_embeddings=max(max_len, 4096), rope_theta=1e6, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    if base is None:
        return model
    from peft import LoraConfig, get_peft_model
    from edgerl.models.quant import quantize_linear
    for layer in model.model.layers if base != "lora" else []:
        for owner, names in ((layer.self_attn, LORA_TARGETS[:4]), (layer.mlp, LORA_TARGETS[4:])):
            for n in names:
                setattr(owner, n, quantize_linear(getattr(owner, n), base, dtype))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return get_peft_model(model, lora).eval()


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights a decode step reads, by kind: quantized linears (codes, absmax, nested absmax and code
    tables), every other parameter (LoRA adapters, norms, the LM head, a tied embedding once); an untied input
    embedding is left out (a step reads only its rows' tokens)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    quant, other, seen = 0, 0, set()
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None and id(w) not in seen:   # peft's LoRA layer shows its base layer's weight as its own
            seen.add(id(w))
            quant += _tensor_bytes(w) + _tensor_bytes(qs.absmax) + _tensor_bytes(getattr(qs, "code", None))
            nested = getattr(qs, "state2", None)
            if nested is not None:
                quant += _tensor_bytes(nested.absmax) + _tensor_bytes(getattr(nested, "code", None))
    for p in model.parameters():   # parameters() lists a tied weight once
        if id(p) in seen or (p is emb and p is not head):
            continue
        other += _tensor_bytes(p)
    return {"quantized": quant, "other": other, "total": quant + other}


def matmul_flops(model: torch.nn.Module, rows: int) -> int:
    """FLOPs of a decode step's products over its weights: 2 x rows x (in x out) for each linear layer the step
    multiplies by (the projections, or under LoRA peft's base layer and its adapter's A and B; the LM head), a
    4-bit layer at its unpacked size."""
    return 2 * rows * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_flops(model: torch.nn.Module, rows: int, col: int) -> int:
    """FLOPs of a decode step's attention at cache column `col`: q k^T and p v, 2 x head dim each, for every query
    head of every layer over the row's col + 1 columns."""
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * 2 * rows * cfg.num_hidden_layers * cfg.num_attention_heads * dim * (col + 1)


def measure_fp32_rate(device) -> float:
    """FLOP/s of an IEEE fp32 GEMM (4096 cubed, cuBLAS, no TF32), best of 3 x 5: the rate of the CUDA cores' fp32
    arithmetic that edgerl's decode kernels compute in (the NF4 and few-row matmuls, the attention)."""
    from edgerl.device.measure import strict_fp32
    n = 4096
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = 0.0
    with strict_fp32(torch):
        a @ b
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(5):
                a @ b
            torch.cuda.synchronize(device)
            best = max(best, 2 * n ** 3 * 5 / (time.perf_counter() - t0))
    del a, b
    return best


class Stepper:
    """The engine's sampling decode step at a chosen cache column: replays of its CUDA graph (or eager steps on
    the CPU), timed."""

    def __init__(self, model, rows: int, max_len: int, backend: str, projections: str, device: torch.device,
                 cache_dtype: torch.dtype | None = None, matmul: str = "plan") -> None:
        from edgerl.rollout import SamplingParams, StaticCacheEngine
        self.cuda = device.type == "cuda"
        self.engine = StaticCacheEngine(model, rows, max_len, cuda_graphs=self.cuda, projections=projections,
                                        backend=backend, cache_dtype=cache_dtype)
        if matmul == "cublas":   # the A/B of the fp32 few-row kernel: the backend's matmuls back to torch's
            from edgerl.rollout.decode_cuda_c import set_matmul
            set_matmul(self.engine.dec, None)
        if matmul == "apart":   # the A/B of LoRA groups: each LoRA layer's product a call of its own again
            for p in self.engine.dec.proj:
                getattr(p, "groups", {}).clear()
        self.rows = rows
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, VOCAB if self.cuda else 200, (rows, PROMPT if self.cuda else 8), generator=g)
        # allocates the cache and state, captures the sampling step (temperature 1, no top-p or top-k, as GRPO)
        self.engine.generate(prompts.tolist(), 1, SamplingParams(max_new_tokens=2),
                             generator=torch.Generator().manual_seed(0))

    def mode(self, col: int, reps: int):
        from edgerl.rollout.static_mode import Mode
        return Mode(rows=self.rows, full=self.rows, greedy=False, top_k=0, top_p=False, eos=(), pad=0,
                    span=self.engine._span(col + reps + 2))

    def _reset(self, col: int) -> None:
        s = self.engine._state
        s.col.fill_(col)
        s.step.fill_(1)
        s.start.zero_()
        s.done.fill_(False)

    @torch.no_grad()
    def ms(self, col: int, reps: int) -> list[float]:
        """Milliseconds per step over `reps` steps writing columns col .. col + reps - 1, three times."""
        mode, e, out = self.mode(col, reps), self.engine, []
        if self.cuda:
            graph = e._graph(mode)
            for _ in range(4):
                self._reset(col)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    graph.replay()
                b.record()
                torch.cuda.synchronize(e.device)
                out.append(a.elapsed_time(b) / reps)
            return out[1:]   # the first pass warms the caches and clocks
        for _ in range(3):
            self._reset(col)
            t0 = time.perf_counter()
            for _ in range(reps):
                e._step(mode)
            out.append((time.perf_counter() - t0) * 1e3 / reps)
        return out

    def kv_bytes(self, col: int) -> int:
        """Bytes of the cache the step at column `col` reads: each row's columns 0 .. col, every layer, K and V."""
        c = self.engine.dec.cache
        layers, two, _, kv, _, dim = c.shape
        return self.rows * (col + 1) * layers * two * kv * dim * c.element_size()

    def kernels(self, col: int) -> list[list]:
        """One eager step's kernels at column `col`, grouped by name: [name, launches, us], the most time first."""
        from bench_rollout import step_kernels
        by: dict[str, list] = {}
        for ev in step_kernels(self.engine, col, self.rows):
            if "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
                continue
            r = by.setdefault(ev.name[:80], [ev.name[:80], 0, 0.0])
            r[1] += 1
            r[2] += ev.time_range.elapsed_us()
        return [[n, c, round(t, 1)] for n, c, t in sorted(by.values(), key=lambda r: -r[2])[:8]]

    def release(self) -> None:
        self.engine.release()


def run_config(name: str, args, device: torch.device, bw: float | None, rate: float | None, results: list,
               save) -> None:
    card, shape, base = CONFIGS[name] if not args.smoke else ("cpu", "smoke", None)
    if args.smoke:
        widths, rows_by_len = SMOKE_SHAPE, {n: args.rows or 2 for n in args.lengths}
        dtype, backend, projections, kv = torch.float32, "torch", "auto", "fp32"
    else:
        from benchlib import SHAPES
        widths = SHAPES[shape]
        # the plan at each length, its KV cache as --kv-cache says (the same rows: the A/B of the cache alone)
        plans = {n: plan_for(card, shape, base, n, widths) for n in args.lengths}
        first = plans[args.lengths[0]]
        dtype, backend = torch_dtype(first.dtype.compute), first.decode_backend
        kv = first.kv_cache_dtype if args.kv_cache == "plan" else (first.dtype.compute if args.kv_cache == "compute"
                                                                   else args.kv_cache)
        projections = "modules" if base else "auto"
        rows_by_len = {n: args.rows or p.rollout_batch for n, p in plans.items()}
    max_len = max(args.lengths) + args.reps + 2 * 8 + PROMPT
    t0 = time.perf_counter()
    model = build(widths, dtype, base, device, max_len)
    built_s = time.perf_counter() - t0
    wb = weight_bytes(model)
    tensor_cores = False
    if base == "nf4" and device.type == "cuda":
        from edgerl.kernels.nf4 import tensor_cores as nf4_tensor_cores
        tensor_cores = nf4_tensor_cores(dtype, torch.cuda.get_device_capability(device))
    by_rows: dict[int, list[int]] = {}
    for n, r in rows_by_len.items():
        by_rows.setdefault(r, []).append(n)
    for (rows, lengths), matmul in ((rl, mm) for rl in by_rows.items() for mm in args.matmul):
        rec_base = {"config": name, "card": card, "widths": shape, "base": base, "dtype": str(dtype).split(".")[-1],
                    "kv_cache": kv, "backend": backend + {"cublas": " (cuBLAS matmuls)", "apart": " (LoRA layers apart)"}
                    .get(matmul, ""),
                    "rows": rows, "weight_bytes": wb, "build_s": round(built_s, 1)}
        try:
            stepper = Stepper(model, rows, max_len, backend, projections, device, torch_dtype(kv), matmul)
        except Exception as e:   # noqa: BLE001 - one configuration failing must not hide the others
            for n in lengths:
                results.append({**rec_base, "length": n, "error": f"{type(e).__name__}: {e}"[:400]})
            save()
            continue
        rec_base["engine"] = stepper.engine.describe()
        try:
            for n in lengths:
                rec = {**rec_base, "length": n}
                results.append(rec)
                try:
                    ms = stepper.ms(n, args.reps)
                    rec["ms_per_step"] = round(statistics.median(ms), 4)
                    rec["ms_spread"] = [round(min(ms), 4), round(max(ms), 4)]
                    rec["kv_bytes"] = stepper.kv_bytes(n)
                    rec["bytes"] = wb["total"] + rec["kv_bytes"]
                    rec["kv_share_of_bytes"] = round(rec["kv_bytes"] / rec["bytes"], 3)
                    # fp16 over an NF4 base from CC 7.5: the 4-bit products on tensor cores (kernels/nf4.py), so the
                    # fp32 floor is the attention's FLOPs alone
                    products_flops, attention_fp32 = matmul_flops(model, rows), attention_flops(model, rows, n)
                    products_fp32 = 0 if tensor_cores else products_flops
                    rec["flops"] = products_flops + attention_fp32
                    fp32_flops = products_fp32 + attention_fp32
                    if bw:
                        rec["bound_ms"] = round(1e3 * rec["bytes"] / bw, 4)
                        rec["share_of_bound"] = round(rec["bound_ms"] / rec["ms_per_step"], 4)
                    if bw and rate and backend == "cuda-c":   # its kernels' arithmetic is fp32 on CUDA cores
                        rec["flop_ms"] = round(1e3 * fp32_flops / rate, 4)
                        rec["roofline_ms"] = max(rec["bound_ms"], rec["flop_ms"])
                        rec["share_of_roofline"] = round(rec["roofline_ms"] / rec["ms_per_step"], 4)
                        # the products and the attention run one after the other, each at best at the larger of
                        # its bytes' time and its fp32 FLOPs' time: the highest share of the copy bound the step
                        # could reach so
                        products = max(wb["total"] / bw, products_fp32 / rate)
                        attention = max(rec["kv_bytes"] / bw, attention_fp32 / rate)
                        rec["phases_roofline_ms"] = round(1e3 * (products + attention), 4)
                        rec["ceiling_of_bound"] = round(rec["bound_ms"] / rec["phases_roofline_ms"], 4)
                    if args.profile and stepper.cuda:
                        rec["kernels"] = stepper.kernels(n)
                except Exception as e:   # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {e}"[:400]
                print(json.dumps({k: v for k, v in rec.items() if k not in ("engine", "kernels")}), flush=True)
                save()
        finally:
            stepper.release()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(results: list, note: str) -> str:
    lines = [note, "", "| configuration | backend | KV cache | rows | cache column | ms per step | weights GB | KV GB "
             "| of bound | fp32 FLOPs ms | of roofline | ceiling |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['backend']} | {r['kv_cache']} | {r['rows']} | {r['length']} | "
                         f"{r['error'][:100]} |||||||")
            continue
        share = f"{100 * r['share_of_bound']:.1f}%" if "share_of_bound" in r else "-"
        flop = f"{r['flop_ms']:.2f}" if "flop_ms" in r else "-"
        roof = f"{100 * r['share_of_roofline']:.1f}%" if "share_of_roofline" in r else "-"
        ceiling = f"{100 * r['ceiling_of_bound']:.1f}%" if "ceiling_of_bound" in r else "-"
        lines.append(f"| {r['config']} | {r['backend']} | {r['kv_cache']} | {r['rows']} | {r['length']} | "
                     f"{r['ms_per_step']:.3f} | "
                     f"{r['weight_bytes']['total'] / 1e9:.2f} | {r['kv_bytes'] / 1e9:.2f} | {share} | {flop} | "
                     f"{roof} | {ceiling} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="p40-1.5b-full,p40-7b-nf4,t4-8b-nf4",
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--lengths", default="512,2048,8192", help="cache columns the timed steps write")
    ap.add_argument("--rows", type=int, default=0, help="rows per step (default: the plan's rollout batch)")
    ap.add_argument("--reps", type=int, default=32, help="steps per timed pass (three passes)")
    ap.add_argument("--kv-cache", default="plan", choices=["plan", "compute", "fp16"],
                    help="the KV cache's storage: the plan's (plan.kv_cache_dtype), the compute dtype, or fp16")
    ap.add_argument("--matmul", default="plan",
                    help="the decode step's matmuls: plan (the backend's; cuda-c: edgerl's few-row kernels, LoRA q/k/v "
                         "and gate/up stacked), cublas (fp32: torch's), apart (LoRA layers one call each), or several "
                         "(plan,apart: the A/B on one model)")
    ap.add_argument("--profile", action="store_true", help="one eager step's kernels at each length")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager, torch's ops")
    ap.add_argument("--out", default=None, help="JSON output (default $OUT/bench_decode_long.json when OUT is set)")
    args = ap.parse_args(argv)
    try:
        args.lengths = sorted({int(x) for x in args.lengths.split(",") if x})
    except ValueError:
        ap.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 16:
        ap.error("--lengths: each cache column must be at least 16")
    args.matmul = [m for m in args.matmul.split(",") if m]
    if not args.matmul or set(args.matmul) - {"plan", "cublas", "apart"}:
        ap.error(f"--matmul takes plan, cublas, apart or several (comma-separated), got {','.join(args.matmul)!r}")
    names = ["smoke"] if args.smoke else [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS and not args.smoke]
    if unknown:
        ap.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    if args.smoke:
        args.reps = min(args.reps, 4)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("bench_decode_long needs a CUDA GPU (or --smoke, the code path on the CPU)", file=sys.stderr)
        return 2
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    from bench_rollout import measure_bandwidth   # a device-to-device copy's bytes per second
    bw = measure_bandwidth(device) if device.type == "cuda" else None
    rate = measure_fp32_rate(device) if device.type == "cuda" else None
    note = (f"{dev_name}: measured device copy {bw / 1e12:.2f} TB/s, fp32 GEMM {rate / 1e12:.1f} TFLOP/s" if bw
            else "no bandwidth bound on the CPU")
    out = args.out or (os.path.join(os.environ["OUT"], "bench_decode_long.json") if os.environ.get("OUT") else None)
    results: list = []

    def save() -> None:
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(Path(out), json.dumps({"device": dev_name, "bandwidth_bytes_s": bw, "fp32_flops_s": rate,
                                                     "note": note,
                                                     "torch": torch.__version__, "args": vars(args),
                                                     "table": table(results, note), "records": results}, indent=1))

    for name in names:
        run_config(name, args, device, bw, rate, results, save)
    print("\n" + table(results, note))
    save()
    bad = [f"{r['config']}@{r['length']}" for r in results if "error" in r]
    if bad:
        print(f"failed: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
