"""edgerl vs TRL's GRPOTrainer on the same RL step, in one command (issue 5's side-by-side).

    python bench/bench_vs_trl.py --tokenizer PATH --out $OUT/bench_vs_trl.json [--only NAME ...]

Workloads (random-weight llama shapes with the SmolLM2 tokenizer's vocabulary, 2 prompts x 8
samples = 16 completions of 256 tokens per step, GRPO with reference KL):
  362m-bf16   SmolLM2-360M shape (hidden 960, 32 layers, 15 heads, 5 KV heads), bf16, no cap
  362m-p40    the same in fp32 under a 24 GiB cap: edgerl --profile p40; TRL fp32 + eager attention
  1.7b-p40    SmolLM2-1.7B shape (hidden 2048, 24 layers, 32 heads), P40 emulation as above
  362m-ppo    PPO with a critic (GAE), edgerl only: TRL's PPO trainer needs a separate reward model
Random weights rarely emit EOS, so both sides generate the full 256 tokens on nearly every row.
Each run is a subprocess (an out-of-memory error ends that run only); the median step time skips
the first step (warm-up, CUDA-graph capture). `--smoke` runs a tiny shape on the CPU.
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

from edgerl.modelspec import CATALOGUE

SHAPES = {  # edgerl's catalogue shapes (the 362M one is SmolLM2-360M), and a tiny one for --smoke
    "362m": CATALOGUE["smollm2-360m"].llama_config_fields(),
    "1.7b": CATALOGUE["smollm2-1.7b"].llama_config_fields(),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
}
WORKLOADS = {  # name: (shape, precision, cap GiB, algo, run TRL)
    "362m-bf16": ("362m", "bf16", None, "grpo", True),
    "362m-p40": ("362m", "p40", 24, "grpo", True),
    "1.7b-p40": ("1.7b", "p40", 24, "grpo", True),
    "362m-ppo": ("362m", "bf16", None, "gae", False),
}
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how rain forms, step by step."]


def reward(data_source=None, solution_str="", ground_truth=None, extra_info=None, **_):
    """Share of vowels among letters: defined for any text, varies between samples."""
    letters = [c for c in solution_str.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def trl_reward(completions, **_):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [reward(solution_str=t) for t in texts]


def make_model(shape: str, tokenizer: str, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _cap(gib):
    import torch
    if gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


def run_edgerl(model: Path, precision: str, algo: str, steps: int, new_tokens: int, work: Path) -> dict:
    import torch
    from edgerl.config import load_config
    from edgerl.target import plan_for, resolve_target
    from edgerl.trainer import Trainer
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "data_source": "bench"}) + "\n" for p in PROMPTS))
    sets = [f'model.path="{model}"', f'data.path="{data}"', 'data.answer_key=""', "data.num_examples=2",
            f'reward.function="{Path(__file__).resolve()}:reward"', "train.prompts_per_step=2", "rollout.n_samples=8",
            f"rollout.max_new_tokens={new_tokens}", "rollout.stop_at_eos=false", f"train.steps={steps}",
            "algo.kl_coef=0.04", f'algo.advantage="{algo}"', "run.save_every=0", "run.export_final=false",
            "run.tensorboard=false", "train.lr=1e-6", "data.max_prompt_len=64"]
    if precision == "p40":
        sets.append('run.profile="p40"')
    cfg = load_config(sets=sets)
    target = resolve_target(cfg.run.profile)
    if precision == "p40":
        _cap(24)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if not torch.cuda.is_available():
        target = resolve_target("cpu")
    plan = plan_for(cfg, target)
    t = Trainer(cfg, plan, device, work / "run", log=lambda s: None)
    rows = []
    t.run(on_step=lambda step, stats: rows.append(stats))
    return {"step_s": [r["perf/step_s"] for r in rows], "tokens": [r["response/length_mean"] * 16 for r in rows],
            "rollout_s": [r["time/rollout_s"] for r in rows],
            "peak_gib": max(r.get("memory/peak_allocated_gib", 0.0) for r in rows),
            "reserved_gib": max(r.get("memory/peak_reserved_gib", 0.0) for r in rows),
            "estimate_gib": plan.memory.total / 2**30, "engine": t.engine.describe(),
            "plan": {k: plan.value(k) for k in ("dtype", "attention", "kernel_backend", "micro_batch",
                                                 "grad_checkpointing", "rollout_batch")}}


def run_trl(model: Path, precision: str, steps: int, new_tokens: int, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    if precision == "p40":
        _cap(24)
    fp32 = precision == "p40" or not torch.cuda.is_available()  # --smoke runs on the CPU in fp32
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32 if fp32 else torch.bfloat16,
                                              attn_implementation="eager" if fp32 else "sdpa")
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS] * (steps + 2))
    args = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=new_tokens, beta=0.04, learning_rate=1e-6, max_steps=steps,
                      logging_steps=1, save_strategy="no", report_to=[], bf16=not fp32, temperature=1.0,
                      use_cpu=not torch.cuda.is_available(),
                      gradient_accumulation_steps=1, use_vllm=False, seed=0)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)
    trainer = GRPOTrainer(model=lm, reward_funcs=[trl_reward], args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    return {"step_s": times, "tokens": [ln * 16 for ln in lengths] or [16 * new_tokens] * len(times),
            "peak_gib": peak, "reserved_gib": reserved}


def child(argv: list[str]) -> None:
    side, model, precision, algo, steps, new_tokens, out = argv
    work = Path(tempfile.mkdtemp())
    try:
        res = (run_edgerl(Path(model), precision, algo, int(steps), int(new_tokens), work) if side == "edgerl"
               else run_trl(Path(model), precision, int(steps), int(new_tokens), work))
        res["status"] = "ok"
    except Exception as e:  # the parent reports it; OOM is an expected outcome for TRL under the cap
        import traceback
        oom = "out of memory" in str(e).lower()
        res = {"status": "out of memory" if oom else "error", "error": f"{type(e).__name__}: {str(e)[:400]}",
               "trace": traceback.format_exc()[-2000:]}
    Path(out).write_text(json.dumps(res))


def summarise(res: dict) -> dict:
    if res.get("status") != "ok" or not res.get("step_s"):
        return res
    steps = res["step_s"][1:] or res["step_s"]
    med = statistics.median(steps)
    toks = statistics.median(res["tokens"][1:] or res["tokens"])
    return {**res, "median_step_s": med, "tokens_per_s": toks / med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared/data/smollm2-tokenizer"))
    ap.add_argument("--only", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, 8 tokens, CPU")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_vs_trl.json"))
    args = ap.parse_args()
    results = {}
    work = Path(tempfile.mkdtemp())
    for name in args.only:
        shape, precision, cap, algo, with_trl = WORKLOADS[name]
        if args.smoke:
            shape, steps, new_tokens = "tiny", 2, 8
        else:
            steps, new_tokens = args.steps, args.new_tokens
        model = work / shape
        if not model.exists():
            make_model(shape, args.tokenizer, model)
        row = {}
        for side in (["edgerl", "trl"] if with_trl else ["edgerl"]):
            out = work / f"{name}-{side}.json"
            cmd = [sys.executable, __file__, "--child", side, str(model), precision, algo, str(steps),
                   str(new_tokens), str(out)]
            start = time.time()
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
                res = json.loads(out.read_text()) if out.exists() else {
                    "status": "crashed", "error": (proc.stderr or proc.stdout)[-1500:]}
            except subprocess.TimeoutExpired:
                res = {"status": f"timeout after {args.timeout} s"}
            res["wall_s"] = time.time() - start
            row[side] = summarise(res)
            print(f"{name} {side}: {row[side].get('status')} "
                  f"{row[side].get('median_step_s', '')} {row[side].get('error', '')}", flush=True)
        if not with_trl:
            row["trl"] = {"status": "not run: TRL's PPO (trl.experimental.ppo) needs a separate reward model"}
        results[name] = row
    print("\n| workload | edgerl s/step | TRL s/step | edgerl tok/s | TRL tok/s | throughput ratio | "
          "edgerl peak GiB | TRL peak GiB |\n|---|---|---|---|---|---|---|---|")
    for name, row in results.items():
        e, t = row["edgerl"], row["trl"]

        def cell(r, key, fmt):
            return fmt.format(r[key]) if key in r else r.get("status", "-")
        ratio = (f"{e['tokens_per_s'] / t['tokens_per_s']:.2f}x" if "tokens_per_s" in e and "tokens_per_s" in t
                 else "-")
        print(f"| {name} | {cell(e, 'median_step_s', '{:.2f}')} | {cell(t, 'median_step_s', '{:.2f}')} | "
              f"{cell(e, 'tokens_per_s', '{:.0f}')} | {cell(t, 'tokens_per_s', '{:.0f}')} | {ratio} | "
              f"{cell(e, 'peak_gib', '{:.2f}')} | {cell(t, 'peak_gib', '{:.2f}')} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
