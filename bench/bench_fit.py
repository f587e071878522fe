"""What fits on a P40: the largest model shape that trains with full parameters and with LoRA.

    python bench/bench_fit.py --tokenizer PATH [--out $OUT/bench_fit.json] [--smoke]

Every run is the real `edgerl train --profile p40` in its own process (so an out-of-memory error
ends that run only): fp32 compute, a 24 GiB cap (torch.cuda.set_per_process_memory_fraction),
torch log-prob kernels (no Triton), GRPO with the reference KL term, 2 prompts x 8 samples,
256 new tokens (EOS ignored, so every row is full length), 3 steps. Models are random-weight
llama shapes with the SmolLM2 tokenizer's 49152-token vocabulary:

    0.5b  hidden 896,  24 layers, 14 heads / 2 KV,  MLP 4864   (Qwen2.5-0.5B)
    1b    hidden 2048, 16 layers, 32 heads / 8 KV,  MLP 8192   (Llama-3.2-1B)
    1.5b  hidden 1536, 28 layers, 12 heads / 2 KV,  MLP 8960   (Qwen2.5-1.5B)
    3b    hidden 3072, 28 layers, 24 heads / 8 KV,  MLP 8192   (Llama-3.2-3B)

Modes: `full` (every weight), `lora` (r=16 on all projections, base stored fp32), `lora-fp16`
(base stored fp16, computed in fp32: plan.base_dtype=fp16). For each mode the script runs the
largest shape the plan fits on the card (FSDP2 parameter offload off unless --allow-param-offload),
then compares fp16 and fp32 base storage at one pinned setting (same micro-batch, checkpointing,
offload) on the largest shape LoRA fits with an fp32 base, and, if the fp16 base made a larger shape
fit, that shape with an fp32 base and parameter offload allowed. Lower-priority runs are skipped
when --budget-s would be exceeded. Reported per run: peak allocated / reserved memory, median step
time (steps 2..3), the plan's estimate and its error against reserved + the CUDA context
(Calibration.cuda_context, which lives outside torch's allocator). `--smoke`: tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.core.files import write_atomically  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # hidden, layers, heads, kv heads, MLP; largest last
    "0.5b": (896, 24, 14, 2, 4864), "1b": (2048, 16, 32, 8, 8192), "1.5b": (1536, 28, 12, 2, 8960),
    "3b": (3072, 28, 24, 8, 8192),
}
SMOKE_SHAPES = {"tiny": (64, 2, 4, 2, 128), "small": (96, 3, 4, 2, 192)}
MODES = {"full": ["lora.enabled=false"], "lora": ["lora.enabled=true"],
         "lora-fp16": ["lora.enabled=true", "plan.base_dtype=fp16"]}


def task_sets(smoke: bool, steps: int) -> list[str]:
    new = 8 if smoke else 256
    samples = 4 if smoke else 8
    return ["train.prompts_per_step=2", f"rollout.n_samples={samples}", f"rollout.max_new_tokens={new}",
            "rollout.stop_at_eos=false", f"train.steps={steps}", "algo.advantage=grpo", "algo.kl_coef=0.001",
            f'reward.function="{REPO / "tests" / "reward_fns.py"}:vowel_share"', "data.max_prompt_len=128",
            "data.on_too_long=filter", "data.num_examples=64", "train.lr=1e-5", "run.save_every=0",
            "run.export_final=false", "run.tensorboard=false"]


def build(shape: tuple[int, ...], tokenizer: str, out: Path) -> None:
    """A random-weight llama folder (fp16 on disk: half the bytes to write and read; runs upcast)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer)
    h, layers, heads, kv, mlp = shape
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=True,
                      max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialising billions of weights is much faster on the GPU
        model = LlamaForCausalLM(cfg).to(torch.float16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def spec(name: str, shape: tuple[int, ...], vocab: int):
    from edgerl.plan.modelspec import ModelSpec
    h, layers, heads, kv, mlp = shape
    return ModelSpec(name, "llama", vocab, h, layers, heads, kv, mlp, True)


def plan_or_none(sets: list[str], profile: str, model_spec):
    from edgerl.config.load import load_config
    from edgerl.plan.plan import PlanError
    from edgerl.config.target import plan_for, resolve_target
    try:
        return plan_for(load_config(sets=sets), resolve_target(profile), model_spec)
    except PlanError:
        return None


def run_one(name: str, model: Path, sets: list[str], profile: str, work: Path, timeout: int) -> dict:
    """`edgerl train` in a subprocess; the run folder's plan.json and metrics.jsonl are the result."""
    run = work / "runs" / name
    cmd = [sys.executable, "-m", "edgerl.cli", "train", "--profile", profile, "--model", str(model),
           "--out", str(run), *sum((["--set", s] for s in sets), [])]
    start = time.time()
    log = work / f"{name}.log"
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
        text = log.read_text()
        status = ("ok" if proc.returncode == 0 else "out of memory" if "out of memory" in text.lower() else
                  "plan: does not fit" if "does not fit" in text else f"error (exit {proc.returncode})")
    except subprocess.TimeoutExpired:
        status, text = f"timeout after {timeout} s", log.read_text()
    res: dict = {"name": name, "status": status, "wall_s": round(time.time() - start, 1), "log": str(log)}
    if status != "ok":
        res["tail"] = text[-1500:]
    if (run / "plan.json").exists():
        pj = json.loads((run / "plan.json").read_text())
        mem = pj["memory"]
        res["estimate_gib"] = mem["total_bytes"] / 2**30
        res["estimate_peak_phase"] = mem["peak_phase"]
        res["estimate_phases_gib"] = {k: v / 2**30 for k, v in mem["phases"].items()}
        res["model_params"] = pj["model"]["n_params"]
        res["plan"] = {k: pj["plan"][k] for k in ("optimizer", "lora", "base_dtype", "grad_checkpointing",
                                                  "swap_models", "optimizer_offload", "param_offload",
                                                  "micro_batch", "score_micro_batch", "rollout_batch")}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    if rows:
        steps = [r["perf/step_s"] for r in rows]
        res["step_s"] = steps
        res["median_step_s"] = statistics.median(steps[1:] or steps)
        for key in ("rollout", "score", "update"):
            res[f"median_{key}_s"] = statistics.median([r[f"time/{key}_s"] for r in rows[1:] or rows])
        res["peak_allocated_gib"] = max(r.get("memory/peak_allocated_gib", 0.0) for r in rows)
        res["peak_reserved_gib"] = max(r.get("memory/peak_reserved_gib", 0.0) for r in rows)
        res["host_rss_gib"] = max(r.get("memory/host_rss_gib", 0.0) for r in rows)
        if res["peak_reserved_gib"] and "estimate_gib" in res:
            from edgerl.plan.memory import DEFAULT_CALIBRATION
            measured = res["peak_reserved_gib"] + DEFAULT_CALIBRATION.cuda_context / 2**30
            res["estimate_error"] = res["estimate_gib"] / measured - 1
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = Path(os.environ.get("EDGERL_SHARED", REPO.parent / "shared"))
    ap.add_argument("--tokenizer", default=str(shared / "data" / "smollm2-tokenizer"))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_fit.json"))
    ap.add_argument("--profile", default="p40")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=180, help="seconds per run")
    ap.add_argument("--budget-s", type=int, default=450, help="skip runs that would start after this")
    ap.add_argument("--allow-param-offload", action="store_true", help="let 'fits' include FSDP2 param offload")
    ap.add_argument("--work", default=None, help="folder for models, runs and logs (default: a temp folder)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, end to end")
    ap.add_argument("--only", nargs="*", default=None, help="run only these modes (full, lora, lora-fp16)")
    args = ap.parse_args()
    t0 = time.time()
    profile = "cpu" if args.smoke else args.profile
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_fit-"))
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    base = task_sets(args.smoke, 2 if args.smoke else args.steps)
    no_offload = [] if args.allow_param_offload else ["plan.param_offload=false"]

    largest: dict[str, str] = {}
    plans: dict[str, object] = {}
    for mode, sets in MODES.items():
        for name in reversed(list(shapes)):
            p = plan_or_none(base + sets + no_offload, profile, spec(name, shapes[name], vocab))
            if p is not None:
                largest[mode], plans[mode] = name, p
                break
    print(f"largest shapes the plan fits on {profile}: {largest}", flush=True)

    queue: list[tuple[str, str, list[str]]] = []
    for mode in ("full", "lora-fp16", "lora"):  # the targets first: full 1.5b, LoRA 3b
        if mode in largest:
            queue.append((f"{mode}-{largest[mode]}", largest[mode], base + MODES[mode] + no_offload))
    if "lora" in largest:  # fp16 vs fp32 base storage at the LoRA run's exact setting
        p = plans["lora"]
        pin = [f"plan.grad_checkpointing={str(p.grad_checkpointing).lower()}",
               f"plan.optimizer_offload={str(p.optimizer_offload).lower()}",
               f"plan.param_offload={str(p.param_offload).lower()}", f"train.micro_batch={p.micro_batch}",
               f"plan.rollout_batch={p.rollout_batch}", f"plan.score_micro_batch={p.score_micro_batch}"]
        queue.append((f"lora-fp16-pinned-{largest['lora']}", largest["lora"], base + MODES["lora-fp16"] + pin))
    if "lora-fp16" in largest and list(shapes).index(largest["lora-fp16"]) > list(shapes).index(
            largest.get("lora", list(shapes)[0])):
        name = largest["lora-fp16"]  # an fp32 base on that shape needs parameter offload, if it fits at all
        queue.append((f"lora-{name}-param-offload", name, base + MODES["lora"]))

    if args.only:
        def mode_of(run_name: str) -> str:
            return next(m for m in ("full", "lora-fp16", "lora") if run_name.startswith(m + "-"))
        queue = [q for q in queue if mode_of(q[0]) in args.only]
    results = []
    for run_name, shape_name, sets in queue:
        elapsed = time.time() - t0
        if elapsed > args.budget_s:
            results.append({"name": run_name,
                            "status": f"skipped: {elapsed:.0f} s of the {args.budget_s} s budget used"})
            print(f"{run_name}: {results[-1]['status']}", flush=True)
            continue
        model = work / "models" / shape_name
        if not model.exists():
            model.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, __file__, "--build", shape_name, args.tokenizer, str(model),
                            "smoke" if args.smoke else "full"], check=True, timeout=args.timeout)
        res = run_one(run_name, model, sets, profile, work, args.timeout)
        res["shape"] = shape_name
        results.append(res)
        print(f"{run_name}: {res['status']} in {res['wall_s']} s; median step {res.get('median_step_s', 0):.2f} s; "
              f"peak reserved {res.get('peak_reserved_gib', 0):.2f} GiB; estimate {res.get('estimate_gib', 0):.2f} GiB",
              flush=True)

    from edgerl.plan.steps import fmt_count

    def f(r, key, fmt):
        return fmt.format(r[key]) if r.get(key) is not None else "-"
    print(f"\n{profile} emulation ({'CPU smoke' if args.smoke else 'fp32, 24 GiB cap'}), GRPO with KL, "
          f"2 prompts x {8 if not args.smoke else 4} samples x {256 if not args.smoke else 8} tokens\n")
    print("| run | params | status | optimizer / offload | micro-batch | peak alloc GiB | peak reserved GiB | "
          "estimate GiB (phase) | est. error | median step s | rollout / update s | host RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p = r.get("plan") or {}
        opt = (f"{p.get('optimizer')}{', opt offload' if p.get('optimizer_offload') else ''}"
               f"{', param offload' if p.get('param_offload') else ''}{', ckpt' if p.get('grad_checkpointing') else ''}"
               if p else "-")
        params = fmt_count(r["model_params"]) if r.get("model_params") else "-"
        est = f"{r['estimate_gib']:.2f} ({r['estimate_peak_phase']})" if "estimate_gib" in r else "-"
        print(f"| {r['name']} | {params} | {r['status']} | {opt} | {p.get('micro_batch', '-')} | "
              f"{f(r, 'peak_allocated_gib', '{:.2f}')} | {f(r, 'peak_reserved_gib', '{:.2f}')} | {est} | "
              f"{f(r, 'estimate_error', '{:+.0%}')} | {f(r, 'median_step_s', '{:.2f}')} | "
              f"{f(r, 'median_rollout_s', '{:.2f}')} / {f(r, 'median_update_s', '{:.2f}')} | "
              f"{f(r, 'host_rss_gib', '{:.1f}')} |")
    ok = {r["name"]: r for r in results if r.get("status") == "ok"}
    targets = {"full 1.5b": any(r.get("shape") == "1.5b" and r["name"].startswith("full") for r in ok.values()),
               "lora 3b": any(r.get("shape") == "3b" and r["name"].startswith("lora") for r in ok.values())}
    if not args.smoke:
        print(f"\ntargets met (trained under the cap): {targets}")
    out = {"profile": profile, "smoke": args.smoke, "largest_planned": largest, "runs": results,
           "targets": targets, "wall_s": round(time.time() - t0, 1), "work": str(work)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(Path(args.out), json.dumps(out, indent=2, default=str))
    print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--build":
        name, tokenizer, out, kind = sys.argv[2:6]
        build((SMOKE_SHAPES if kind == "smoke" else SHAPES)[name], tokenizer, Path(out))
    else:
        main()
