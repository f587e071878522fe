"""edgerl on two GPUs of one host (torchrun, FSDP2): scaling, a model only two emulated P40s hold, and
an exact resume.

    python bench/bench_multi.py [--only scale fit2 resume] [--budget-s 480] [--out FILE]
    python bench/bench_multi.py --smoke     # tiny shapes; two ranks on the CPU (gloo), or NCCL with 2 GPUs

  scale   the 1.7B shape (SmolLM2-1.7B), GRPO with reference KL, 2 prompts x 8 samples x 256 new tokens
          per GPU: one process on one GPU, then torchrun --nproc_per_node 2 with 4 prompts (the same
          per-GPU batch); 5 steps, median of steps 2-5; throughput = generated tokens of the whole batch
          per second; ratio two/one (2.0 is linear scaling)
  fit2    P40 emulation on each rank (--profile p40: each process's allocator capped at the P40's memory
          less its context), full fine-tuning with fp32 AdamW on both (8-bit AdamW is refused on several
          GPUs) and the weights on the card (plan.param_offload=false: with FSDP2 parameter offload they
          live in host memory, and a host's RAM, not the card, decides what fits): the planner (what
          `edgerl recommend --gpu p40 --gpus N` prints) looks for the smallest SmolLM2-1.7B-wide shape
          (24 to 48 layers) that does not fit one P40 and fits two at the same per-GPU batch (2 prompts
          x 8 samples); both plans are captured from `edgerl recommend` before the run
          (JSON for 2 GPUs, the refusal for 1); then 3 steps on two emulated P40s
  resume  the 362M shape on two GPUs: 4 steps straight; 2 steps with a checkpoint, then --resume to 4
          in a new torchrun; the metrics of steps 1-4 compared (timing and memory metrics aside). If
          steps 1-2 already differ between the two runs, the difference is the GPU's run-to-run
          non-determinism, not the resume; --deterministic asks torch for deterministic kernels
NCCL_NVLS_ENABLE=0 is set for every torchrun. Each run is its own process group with a time limit;
results go to the JSON after every run. Speeds are the H200's; a P40 is far slower.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

PARTS = ("scale", "fit2", "resume")
CANDIDATES = ["1.7b", "1.7b-l28", "1.7b-l32", "1.7b-l36", "1.7b-l40", "1.7b-l44", "1.7b-l48"]
SMOKE_CANDIDATES = ["small-l4", "small-l8", "small-l16"]   # training state, not logits, dominates them
COMPARED = ("reward/mean", "reward/std", "response/length_mean", "actor/pg_loss", "actor/kl", "actor/entropy",
            "actor/grad_norm", "actor/clip_frac")


def gpu_count() -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return n if visible is None else len([x for x in visible.split(",") if x.strip()])


# ------------------------------------------------------------------------------------- the planner

def plans_child(spec_path: str) -> None:
    """For each candidate shape and GPU count: does the plan fit? (a child: the probe touches CUDA)."""
    spec = json.loads(Path(spec_path).read_text())
    from edgerl.config.load import load_config
    from edgerl.plan.modelspec import resolve
    from edgerl.plan.plan import PlanError
    from edgerl.config.target import plan_for, resolve_target
    target = resolve_target(spec["profile"])
    out = []
    for folder in spec["folders"]:
        for gib in spec["memory_gib"] or [None]:
            row: dict[str, Any] = {"folder": folder, "memory_gib": gib}
            for world in (1, 2):
                sets = spec["sets"] + [f"train.prompts_per_step={2 * world}"]
                if gib is not None:
                    sets.append(f"plan.memory_gib={gib}")
                try:
                    p = plan_for(load_config(sets=sets), target, resolve(folder), world_size=world)
                    row[f"w{world}"] = {"fits": True, "estimate_gib": p.memory.total / bl.GiB,
                                        "params": p.model.n_params()}
                except PlanError as e:
                    row[f"w{world}"] = {"fits": False, "why": str(e)[:600]}
            out.append(row)
    Path(spec["out"]).write_text(json.dumps(out))


def config_folder(work: Path, shape: str, vocab: int = 49152) -> Path:
    """A folder with config.json alone: what the planner and `edgerl recommend --model` read."""
    h, layers, heads, kv, mlp, tie = bl.SHAPES[shape]
    folder = work / "configs" / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "intermediate_size": mlp, "tie_word_embeddings": tie, "max_position_embeddings": 2048}))
    return folder


def choose_shape(work: Path, profile: str, sets: list[str], candidates: list[str],
                 grid: Optional[list[float]], timeout: float) -> dict[str, Any]:
    folders = [str(config_folder(work, c)) for c in candidates]
    spec = {"profile": profile, "sets": sets, "folders": folders, "memory_gib": grid, "out": str(work / "plans.json")}
    (work / "plans.spec.json").write_text(json.dumps(spec))
    Path(spec["out"]).unlink(missing_ok=True)
    status, rc, tail = bl.run_logged([sys.executable, __file__, "--plans-child", str(work / "plans.spec.json")],
                                     work / "plans.log", timeout)
    if rc != 0 or not Path(spec["out"]).exists():
        return {"status": f"planner failed ({status})", "error": tail[-1500:]}
    rows = json.loads(Path(spec["out"]).read_text())
    for row in rows:   # candidates are smallest first; budgets (smoke only) largest first
        if row["w2"]["fits"] and not row["w1"]["fits"]:
            shape = candidates[folders.index(row["folder"])]
            return {"status": "ok", "shape": shape, "memory_gib": row["memory_gib"], "planner": rows,
                    "params": row["w2"]["params"]}
    return {"status": "no candidate fits two GPUs and not one", "planner": rows}


def recommend(work: Path, folder: Path, profile: str, gpus: int, sets: list[str], timeout: float) -> dict[str, Any]:
    """`edgerl recommend --gpu PROFILE --gpus N` for this shape, as a user would run it."""
    cmd = [sys.executable, "-m", "edgerl.cli", "recommend", "--gpu", profile, "--gpus", str(gpus), "--model",
           str(folder), "--format", "json", *sum((["--set", s] for s in sets), [])]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "COLUMNS": "200"})
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "status": f"timeout after {timeout:.0f} s"}
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "exit": p.returncode}
    if p.returncode == 0:
        try:
            pj = json.loads(p.stdout)
            res.update(fits=True, plan=pj["plan"], estimate_gib=pj["memory"]["total_bytes"] / bl.GiB,
                       peak_phase=pj["memory"]["peak_phase"], effective_batch=pj.get("effective_batch"))
        except (ValueError, KeyError):
            res.update(fits=None, stdout=p.stdout[-2000:])
    else:
        res.update(fits=False, message=(p.stderr or p.stdout)[-2500:])
    return res


# ------------------------------------------------------------------------------------- the parts

def run(name: str, model: Path, sets: list[str], work: Path, timeout: float, nproc: int,
        resume: Optional[Path] = None, run_dir: Optional[Path] = None, fresh: bool = True,
        deterministic: bool = False) -> dict[str, Any]:
    run_dir = run_dir or work / "runs" / name
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    spec = bl.edgerl_spec(model, sets, run_dir, work / f"{name}.json", resume=str(resume) if resume else None,
                          deterministic=deterministic, cpu_ranks_on_device_0=any('"cpu"' in x for x in sets))
    env = {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    res = bl.run_edgerl(name, spec, work, timeout, nproc=nproc, env=env)
    res["ranks"] = [bl.summarise_edgerl(dict(r), None) for r in res.get("ranks", [])]
    res["run_dir"] = str(run_dir)
    return res


def part_scale(ctx: dict, results: bl.Results, log) -> None:
    model = bl.ensure_model(ctx["work"], ctx["shape_17b"], ctx["tokenizer"], log=log)
    for name, nproc in (("scale-1gpu", 1), ("scale-2gpu", 2)):
        if ctx["clock"].left() < ctx["min_run_s"]:
            results.put(name, {"status": "skipped: budget"})
            continue
        sets = bl.task_sets(ctx["work"], ctx["steps"], ctx["new_tokens"], prompts_per_step=2 * nproc) + ctx["extra"]
        res = run(name, model, sets, ctx["work"], ctx["timeout"](), nproc)
        results.put(name, {**res, "nproc": nproc, "shape": ctx["shape_17b"]})
        log(f"{name}: {res['status']}; step {bl.fmt(res.get('median_step_s'))} s, "
            f"{bl.fmt(res.get('tokens_per_s'), '{:.0f}')} tok/s" + _err(res))
    one, two = results.runs.get("scale-1gpu", {}), results.runs.get("scale-2gpu", {})
    if one.get("tokens_per_s") and two.get("tokens_per_s"):
        results.data["scale"] = {"throughput_ratio": two["tokens_per_s"] / one["tokens_per_s"],
                                 "sequences_per_step": [one.get("sequences_per_step"), two.get("sequences_per_step")],
                                 "world_size": [one.get("world_size"), two.get("world_size")]}
        results.save()


def part_fit2(ctx: dict, results: bl.Results, log) -> None:
    work = ctx["work"]
    base = bl.task_sets(work, ctx["steps_fit"], ctx["new_tokens"]) + ["lora.enabled=false", 'plan.optimizer="adamw"',
                                                                      "plan.param_offload=false"]
    base = [s for s in base if not s.startswith("train.prompts_per_step")]
    choice = choose_shape(work, ctx["profile"], base, ctx["candidates"], ctx["grid"], 120)
    results.put("fit2-plan", choice)
    if choice["status"] != "ok":
        log(f"fit2: {choice['status']}")
        return
    shape = choice["shape"]
    folder = config_folder(work, shape)
    mem = [f"plan.memory_gib={choice['memory_gib']}"] if choice.get("memory_gib") else []
    plans = {f"gpus{n}": recommend(work, folder, ctx["profile"], n, base + [f"train.prompts_per_step={2 * n}"] + mem,
                                   120) for n in (1, 2)}
    said = plans["gpus1"].get("fits") is False and plans["gpus2"].get("fits") is True
    results.put("fit2-plan", {**choice, "recommend": plans, "plan_said_2_not_1": said})
    log(f"fit2: {shape} ({choice['params'] / 1e9:.2f}B); edgerl recommend: 1 GPU fits={plans['gpus1'].get('fits')}, "
        f"2 GPUs fits={plans['gpus2'].get('fits')}")
    if ctx["clock"].left() < ctx["min_run_s"]:
        results.put("fit2-run", {"status": "skipped: budget"})
        return
    model = bl.ensure_model(work, shape, ctx["tokenizer"], log=log)
    sets = base + ["train.prompts_per_step=4", f'run.profile="{ctx["profile"]}"'] + mem
    res = run("fit2-run", model, sets, work, ctx["timeout"](2), 2)
    res["shape"] = shape
    results.put("fit2-run", res)
    rank1 = (res["ranks"] or [{}])[0]
    log(f"fit2-run: {res['status']}; step {bl.fmt(res.get('median_step_s'))} s; peak reserved rank 0 "
        f"{bl.fmt(res.get('peak_reserved_gib'))} GiB, rank 1 {bl.fmt(rank1.get('peak_reserved_gib'))} GiB" + _err(res))


def part_resume(ctx: dict, results: bl.Results, log) -> None:
    work = ctx["work"]
    model = bl.ensure_model(work, ctx["shape_resume"], ctx["tokenizer"], log=log)

    def sets(steps: int, save_every: int) -> list[str]:
        s = bl.task_sets(work, steps, ctx["new_tokens"], prompts_per_step=4) + ctx["extra"]
        return [x for x in s if not x.startswith("run.save_every")] + [f"run.save_every={save_every}"]
    det = ctx["deterministic"]
    plan = [("resume-straight", sets(4, 0), None, True), ("resume-first", sets(2, 2), None, True),
            ("resume-second", sets(4, 2), work / "runs" / "resume-first", False)]
    for name, s, resume, fresh in plan:
        if ctx["clock"].left() < ctx["min_run_s"]:
            results.put(name, {"status": "skipped: budget"})
            continue
        run_dir = work / "runs" / ("resume-first" if name != "resume-straight" else name)
        res = run(name, model, s, work, ctx["timeout"](), 2, resume=resume, run_dir=run_dir, fresh=fresh,
                  deterministic=det)
        results.put(name, res)
        log(f"{name}: {res['status']}; {res.get('steps_done')} step(s)" + _err(res))
    a = bl.read_run_folder(work / "runs" / "resume-straight")["rows"]
    b = bl.read_run_folder(work / "runs" / "resume-first")["rows"]
    results.data["resume"] = compare(a, b)
    results.save()
    log(f"resume: {results.data['resume']['verdict']}")


def compare(straight: list[dict], resumed: list[dict]) -> dict[str, Any]:
    """Steps 1-4 of the straight run against the run that stopped at 2 and resumed."""
    sa, sb = {r["step"]: r for r in straight}, {r["step"]: r for r in resumed}
    out: dict[str, Any] = {"steps_straight": sorted(sa), "steps_resumed": sorted(sb), "diffs": {}}
    if sorted(sa) != [1, 2, 3, 4] or sorted(sb) != [1, 2, 3, 4]:
        out["verdict"] = "incomplete: both runs need steps 1-4"
        return out
    worst = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    for step in (1, 2, 3, 4):
        for key in COMPARED:
            x, y = sa[step].get(key), sb[step].get(key)
            if x is None and y is None:
                continue
            if x is None or y is None:
                out["diffs"][f"{step}:{key}"] = [x, y]
                worst[step] = float("inf")
                continue
            d = abs(x - y) / max(abs(x), abs(y), 1e-12)
            if d:
                out["diffs"][f"{step}:{key}"] = [x, y]
            worst[step] = max(worst[step], d)
    out["max_rel_diff_by_step"] = worst
    before, after = max(worst[1], worst[2]), max(worst[3], worst[4])
    out["verdict"] = ("exact: steps 1-4 equal" if before == after == 0 else
                      f"differs after the resume only (max rel. diff {after:.2e}): the resume is not exact"
                      if before == 0 else
                      f"differs before the resume too (steps 1-2: {before:.2e}, 3-4: {after:.2e}): run-to-run "
                      "non-determinism, which hides whether the resume is exact")
    return out


def _err(res: dict) -> str:
    return f"; {res.get('error', '')[:300]}" if not str(res.get("status", "")).startswith("ok") else ""


def report(results: bl.Results) -> str:
    rows = []
    for name in ("scale-1gpu", "scale-2gpu", "fit2-run", "resume-straight", "resume-first", "resume-second"):
        r = results.runs.get(name)
        if not r:
            continue
        peaks = [r.get("peak_reserved_gib")] + [x.get("peak_reserved_gib") for x in r.get("ranks") or []]
        p = r.get("plan") or {}
        plan = (f"{(p.get('dtype') or {}).get('compute', '?')} {p.get('optimizer')}"
                + (" ckpt" if p.get("grad_checkpointing") else "") + f" mb{p.get('micro_batch')}"
                + (" swap" if p.get("swap_models") else "") + (" opt-off" if p.get("optimizer_offload") else "")
                ) if p else "-"
        rows.append([name, str(r.get("status", "-"))[:40], str(r.get("world_size", "-")),
                     str(r.get("sequences_per_step", "-")), str(r.get("steps_done", "-")),
                     bl.fmt(r.get("median_step_s")), bl.fmt(r.get("tokens_per_s"), "{:.0f}"),
                     " / ".join(bl.fmt(x) for x in peaks), bl.fmt(r.get("estimate_gib")), plan])
    text = bl.table(["run", "status", "GPUs", "sequences/step", "steps", "s/step", "tok/s (whole batch)",
                     "peak reserved GiB per rank", "estimate GiB per GPU", "plan"], rows)
    lines = [text, ""]
    sc = results.data.get("scale")
    if sc:
        lines.append(f"scale: two GPUs / one GPU throughput = {sc['throughput_ratio']:.2f}x (same per-GPU batch; "
                     f"sequences per step {sc['sequences_per_step']})")
    fp = results.runs.get("fit2-plan")
    if fp:
        if fp.get("status") == "ok":
            rec = fp.get("recommend", {})
            lines.append(f"fit2: shape {fp['shape']} ({fp['params'] / 1e9:.2f}B params); edgerl recommend --gpus 1: "
                         f"fits={rec.get('gpus1', {}).get('fits')}, --gpus 2: fits={rec.get('gpus2', {}).get('fits')} "
                         f"(estimate {bl.fmt(rec.get('gpus2', {}).get('estimate_gib'))} GiB per GPU); trained: "
                         f"{results.runs.get('fit2-run', {}).get('status', '-')}")
        else:
            lines.append(f"fit2: {fp.get('status')}")
    rs = results.data.get("resume")
    if rs:
        lines.append(f"resume: {rs['verdict']}")
    bad = checks(results)
    results.data["check_failures"] = bad
    lines.append("checks: " + ("all passed" if not bad else f"{len(bad)} FAILED: " + "; ".join(bad)))
    return "\n".join(lines)


def checks(results: bl.Results) -> list[str]:
    """What must hold for the parts to say what they claim."""
    runs, bad = results.runs, []
    one, two = runs.get("scale-1gpu", {}), runs.get("scale-2gpu", {})
    if one.get("status") == "ok" and two.get("status") == "ok":
        if (one.get("world_size"), two.get("world_size")) != (1, 2):
            bad.append(f"scale: world sizes {one.get('world_size')}, {two.get('world_size')}, not 1 and 2")
        if two.get("sequences_per_step") != 2 * (one.get("sequences_per_step") or 0):
            bad.append(f"scale: {two.get('sequences_per_step')} sequences on two GPUs, {one.get('sequences_per_step')} "
                       "on one: not the same per-GPU batch")
    fp = runs.get("fit2-plan", {})
    if fp.get("status") == "ok" and not fp.get("plan_said_2_not_1"):
        bad.append("fit2: edgerl recommend did not say 'fits on 2, not on 1' for the chosen shape")
    fr = runs.get("fit2-run", {})
    if fr.get("status") == "ok" and fr.get("world_size") != 2:
        bad.append(f"fit2: trained with world size {fr.get('world_size')}")
    for name in ("scale-1gpu", "scale-2gpu", "fit2-run", "resume-straight", "resume-first", "resume-second"):
        r = runs.get(name, {})
        if r and not str(r.get("status", "")).startswith(("ok", "skipped")):
            bad.append(f"{name}: {str(r.get('status'))[:60]}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=list(PARTS), choices=PARTS)
    ap.add_argument("--steps", type=int, default=5, help="steps of the scale runs")
    ap.add_argument("--steps-fit", type=int, default=3, help="steps of the fit2 run")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=180, help="seconds per run (fit2: twice)")
    ap.add_argument("--deterministic", action="store_true", help="resume part: deterministic torch kernels")
    bl.add_run_args(ap, 480, 45, "tiny shapes, 8 tokens, 2 steps; CPU/gloo unless 2 GPUs", skip_done=False)
    args = ap.parse_args()
    out, work = bl.out_and_work(args, "bench_multi", 45)
    work.mkdir(parents=True, exist_ok=True)
    gpus = gpu_count()
    if not args.smoke and gpus < 2:
        raise SystemExit(f"bench_multi needs two GPUs ({gpus} visible); --smoke runs on the CPU")
    clock = bl.Clock(args.budget_s)
    ctx: dict[str, Any] = {
        "work": work, "tokenizer": args.tokenizer, "clock": clock, "min_run_s": args.min_run_s,
        "deterministic": args.deterministic,
        "steps": 2 if args.smoke else args.steps, "steps_fit": 2 if args.smoke else args.steps_fit,
        "new_tokens": 8 if args.smoke else args.new_tokens,
        "shape_17b": "tiny" if args.smoke else "1.7b", "shape_resume": "tiny" if args.smoke else "362m",
        "candidates": SMOKE_CANDIDATES if args.smoke else CANDIDATES,
        "profile": "p40" if gpus >= 2 else "cpu",
        # smoke: a tiny model fits any card, so the budget is searched too (largest first)
        "grid": [round(0.6 * 0.92 ** k, 4) for k in range(40)] if args.smoke else None,
        "extra": [] if gpus >= 2 else ['run.profile="cpu"'],
        "timeout": lambda k=1: max(10.0, min(args.timeout * k, clock.left() - 5)),
    }
    results = bl.Results(out, {"script": "bench_multi", "smoke": args.smoke, "argv": sys.argv[1:], "gpus": gpus,
                               "device": bl.device_name(), "versions": bl.versions(),
                               "backend": "nccl" if gpus >= 2 else "gloo (CPU)"})

    def log(s: str) -> None:
        print(f"[{clock.elapsed():5.0f} s] {s}", flush=True)
    for part in args.only:
        try:
            {"scale": part_scale, "fit2": part_fit2, "resume": part_resume}[part](ctx, results, log)
        except Exception as e:  # noqa: BLE001 - one part failing leaves the others to run
            import traceback
            results.put(f"{part}-error", {"status": "error", "error": traceback.format_exc()[-2000:]})
            log(f"{part}: {type(e).__name__}: {e}")
    text = report(results)
    results.data["table"] = text
    results.save()
    print("\n" + text)
    print(f"\nwrote {out} ({clock.elapsed():.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--plans-child":
        plans_child(sys.argv[2])
    else:
        main()
