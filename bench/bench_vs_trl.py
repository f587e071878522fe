"""edgerl vs TRL 1.16's GRPOTrainer on the same GRPO step, each edgerl run beside TRL in one invocation.

    python bench/bench_vs_trl.py [--only GROUP[:edgerl|:trl] ...] [--new-tokens N] [--steps N] [--timeout S]
                                 [--budget-s S] [--out FILE]
    python bench/bench_vs_trl.py --smoke          # tiny shapes, 8 tokens, both sides, on the CPU (~1 min)

The task: random-weight llama shapes with the SmolLM2 tokenizer's vocabulary (49,152), 2 prompts x 8
samples = 16 completions of 256 new tokens per step, GRPO with the reference KL term (beta 0.04, k3).
edgerl ignores EOS (every row is full length); TRL stops a row at EOS, which random weights rarely
emit: both report the tokens they generated, and tokens/s counts those. Step time is the median of
steps 2..N (step 1 holds compilation and graph capture; N is 4, or 3 for the frontier points, 1.7b-p40
and the QLoRA groups); peaks are the largest of any step. TRL loads its models with attn_implementation
"sdpa" (transformers' default; the first fp32 comparisons used "eager"), and the allocator settings edgerl sets for
itself (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: torch's out-of-memory message tells a user to set it);
--trl-default-alloc runs TRL again with torch's own settings beside it. Before 2026-12-06 TRL ran with torch's.

Groups (TRL first, so that its measured memory can set edgerl's budgets; then edgerl):
  362m-bf16    SmolLM2-360M shape, whole H200. TRL: bf16, its defaults (gradient checkpointing on).
               edgerl: the plan for the whole GPU, then --set plan.memory_gib=G for each G of
               --frontier (GiB, or trl = the device memory TRL's process used, trl/2 its half;
               ":adamw-bf16" adds --set plan.optimizer=...): the memory-speed frontier in one table
  1.7b-bf16    SmolLM2-1.7B shape, whole GPU; edgerl also at --frontier-1.7b (default: TRL's memory)
  362m-p40     P40 emulation: edgerl --profile p40 (fp32 plan, 24 GiB P40 less its context: the
               allocator is capped); TRL fp32 under the same cap (edgerl.train.session.cap_memory)
  1.7b-p40     the same at the 1.7B shape
  1.5b-p40     the same at Qwen2.5-1.5B widths, edgerl's full fine-tuning plan (bench_long's rows)
  qwen7b-p40   QLoRA at Qwen2.5-7B widths (hidden 3584, 28 layers, 28/4 heads, MLP 18944): edgerl
               --profile p40 --set lora.enabled=true --set plan.base_dtype=nf4; TRL GRPO + peft LoRA
               r16 on all linear layers + bitsandbytes NF4 double quant, gradient checkpointing,
               fp32 compute, the P40 cap. Both sides: r 16, alpha 32, no dropout; TRL keeps the
               adapter in bf16 under a quantized base (its own choice), edgerl in fp32
  llama8b-t4   QLoRA at Llama-3.1-8B widths (4096, 32 layers, 32/8, MLP 14336) under T4 emulation;
               TRL in bf16 compute (what runs; peers.md), then TRL with fp16=True as a T4 user sets it
  llama8b-p40  the Llama-3.1-8B widths under P40 emulation, as qwen7b-p40 (fp32 compute on both sides)
  qwen14b-p40  QLoRA at Qwen2.5-14B widths (5120, 48 layers, 40/8, MLP 13824), edgerl only
  A budget caps edgerl's allocator at it less the CUDA context (edgerl.train.session), as a user's run would be.
  The QLoRA groups with a TRL side also run edgerl at TRL's device memory (--frontier-qlora, default trl):
  the plan's choice when its budget is what TRL used, so that "no more memory than TRL" is compared
  at the plan's own setting, not by lowering a run by hand.
Model folders are written tensor by tensor (bench/benchlib.py) and shared by both sides. Each run is
its own process with a time limit: an out-of-memory error or a hang ends that run only. Results go to
the JSON after every run; a later invocation with the same --out adds to it. Speeds are the H200's:
an emulated P40 or T4 has the emulated card's memory, not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

QLORA_SHAPES = ("qwen7b", "llama8b", "qwen14b")
QLORA = ["lora.enabled=true", "lora.rank=16", "lora.alpha=32", 'plan.base_dtype="nf4"']


@dataclass(frozen=True)
class Trl:
    precision: str                  # compute dtype: fp32, bf16, fp16
    cap: Optional[str] = None       # profile whose memory caps the allocator
    qlora: bool = False
    tag: str = "trl"
    alloc: str = "edgerl"           # "edgerl": the allocator settings edgerl sets for itself; "default": torch's own
    tool: str = "trl"               # "unsloth": Unsloth's GRPO (its loader and patched GRPOTrainer), see UNSLOTH


def alloc_env(alloc: str) -> dict[str, Optional[str]]:
    """TRL's allocator settings. By default the ones edgerl's plan sets for itself on a GPU
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which torch's own out-of-memory message tells a user to
    set), so that the peer runs as a user who read that message would; "default" leaves torch's."""
    if alloc == "default":
        return {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None}
    from edgerl.device.device import Software
    from edgerl.device.profiles import device_from_profile, get_profile
    from edgerl.plan.decisions import pick_env
    env, _ = pick_env(device_from_profile(get_profile("h100"), Software(), 0))
    return {k: v for k, v in env if k.endswith("ALLOC_CONF")}


@dataclass(frozen=True)
class Group:
    shape: str
    profile: Optional[str]          # edgerl --profile (None: the probed GPU)
    sets: tuple[str, ...] = ()
    trl: Optional[Trl] = None
    extra_trl: tuple[Trl, ...] = ()
    steps: int = 4
    frontier: tuple[str, ...] = ()
    smoke_shape: str = "tiny-q"     # one tiny folder serves every group of a smoke run


GROUPS: dict[str, Group] = {
    "362m-bf16": Group("362m", None, trl=Trl("bf16"),
                       frontier=("12", "8", "6", "4", "3", "2", "trl/2", "trl/2:adamw-bf16")),
    "362m-p40": Group("362m", "p40", trl=Trl("fp32", cap="p40")),
    "1.7b-bf16": Group("1.7b", None, trl=Trl("bf16"), frontier=("trl",)),
    "1.7b-p40": Group("1.7b", "p40", trl=Trl("fp32", cap="p40"), steps=3),
    "1.5b-p40": Group("1.5b", "p40", ("lora.enabled=false",), Trl("fp32", cap="p40"), steps=3),
    "qwen7b-p40": Group("qwen7b", "p40", tuple(QLORA), Trl("fp32", cap="p40", qlora=True), steps=3,
                        frontier=("trl",)),
    "llama8b-t4": Group("llama8b", "t4", tuple(QLORA), Trl("bf16", cap="t4", qlora=True),
                        (Trl("fp16", cap="t4", qlora=True, tag="trl-fp16"),), steps=3, frontier=("trl",)),
    "llama8b-p40": Group("llama8b", "p40", tuple(QLORA), Trl("fp32", cap="p40", qlora=True), steps=3,
                         frontier=("trl",)),
    "qwen14b-p40": Group("qwen14b", "p40", tuple(QLORA), None, steps=3),
}
# Unsloth's GRPO beside TRL and edgerl (--unsloth): on the 1.7B row its full fine-tuning in bf16, on the T4 row its
# QLoRA in fp16 (what it computes in on a T4, which has no bf16), each with what its GRPO notebooks turn on to save
# memory: gradient checkpointing "unsloth" (activations in host memory) and 8-bit AdamW; no vLLM
# (fast_inference=False: vLLM is not on the GPU machine), so its rollout is transformers' generate as patched by
# Unsloth. Not on the P40 rows: Unsloth documents compute capability 7.0 as its minimum (a P40 is 6.1), and under a
# P40's memory on a Hopper GPU it would compute on bf16 tensor cores that a P40 does not have.
UNSLOTH: dict[str, Trl] = {
    "1.7b-bf16": Trl("bf16", tag="unsloth", tool="unsloth"),
    "llama8b-t4": Trl("fp16", cap="t4", qlora=True, tag="unsloth", tool="unsloth"),
}
UNSLOTH_OPTIM = "adamw_8bit"
PEERS = {"trl": "TRL", "unsloth": "Unsloth"}   # a run's side -> the peer's name
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOKE_DEFAULT = ["362m-bf16", "qwen7b-p40"]
SMOKE_FRONTIER = ("2", "trl")   # a GPU run refuses a budget under its CUDA context (880 MiB)


# ------------------------------------------------------------------------------------- TRL's side

def trl_child(spec_path: str) -> None:
    """TRL's GRPOTrainer on the spec's model (or Unsloth's, where the spec's tool is "unsloth"); writes the
    result JSON, and OUT.partial after each step."""
    spec = json.loads(Path(spec_path).read_text())
    mem = bl.DeviceMemory()
    out = Path(spec["out"])
    res: dict[str, Any] = {}
    start = time.time()
    steps: list[dict[str, float]] = []
    try:
        import torch
        cuda = torch.cuda.is_available()
        unsloth = spec.get("tool") == "unsloth"
        if unsloth:   # before transformers and TRL (edgerl's cap below imports transformers), as its docs say:
            import unsloth as unsloth_pkg   # it patches both on import
            res["unsloth_version"] = getattr(unsloth_pkg, "__version__", None)
        if spec["cap"] and cuda:
            from edgerl.train.session import cap_memory
            res["emulation"] = cap_memory(spec["cap"])
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
        prec = spec["precision"] if cuda else "fp32"   # the CPU smoke run computes in fp32
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
        tok = AutoTokenizer.from_pretrained(spec["model"])
        kwargs: dict[str, Any] = {}
        model: Any = spec["model"]
        extra: dict[str, Any] = {"model_init_kwargs": {"dtype": dtype, "attn_implementation": spec["attention"]}}
        if unsloth:
            model, tok = unsloth_model(spec, dtype)
            extra = {"optim": UNSLOTH_OPTIM}
        elif spec["qlora"]:
            from peft import LoraConfig
            from transformers import BitsAndBytesConfig
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype)
            kwargs["peft_config"] = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                               task_type="CAUSAL_LM")
        n = spec["steps"]
        ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in bl.PROMPTS] * (n + 2))
        args = GRPOConfig(output_dir=str(out.parent / (out.stem + "-trl")), per_device_train_batch_size=16,
                          num_generations=8, max_completion_length=spec["new_tokens"], beta=0.04, learning_rate=1e-6,
                          max_steps=n, logging_steps=1, save_strategy="no", report_to=[], bf16=prec == "bf16",
                          fp16=prec == "fp16", temperature=1.0, use_cpu=not cuda, gradient_accumulation_steps=1,
                          use_vllm=False, seed=0, **extra)
        res["config"] = {"tool": spec.get("tool", "trl"), "optim": str(getattr(args.optim, "value", args.optim)),
                         "gradient_checkpointing": args.gradient_checkpointing, "bf16": args.bf16,
                         "fp16": args.fp16, "generation_batch_size": args.generation_batch_size,
                         "num_generations": args.num_generations, "loss_type": args.loss_type,
                         "attention": spec["attention"], "model_dtype": str(dtype), "qlora": spec["qlora"]}

        def partial() -> None:
            Path(str(out) + ".partial").write_text(json.dumps({**res, "step_rows": steps}, default=str))

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                row = {}
                if cuda:
                    torch.cuda.synchronize()
                    row = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / bl.GiB,
                           "peak_reserved_gib": torch.cuda.max_memory_reserved() / bl.GiB}
                steps.append({"step_s": time.perf_counter() - self.t, **row})
                partial()

        trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[Clock()], **kwargs)
        res["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        res["setup_s"] = time.time() - start
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        for row, length in zip(steps, lengths):
            row["length_mean"] = length
        if cuda:
            dev = torch.device("cuda", torch.cuda.current_device())
            res["memory_end"] = mem.outside_allocator(dev)
            used = bl.process_used()   # this process alone (other runs may share the GPU)
            res["process_used_end_gib"] = used / bl.GiB if used is not None else None
            res["process_reserved_end_gib"] = torch.cuda.memory_reserved(dev) / bl.GiB
        res["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - reported by the parent; OOM is an expected outcome
        import traceback
        text = f"{type(e).__name__}: {e}"
        res.update(status=bl.failure_status(text, "error"), error=text[:1500], trace=traceback.format_exc()[-3000:])
    res["step_rows"] = steps
    res["wall_s"] = time.time() - start
    out.write_text(json.dumps(res, default=str))


def unsloth_model(spec: dict, dtype: Any) -> tuple[Any, Any]:
    """The model and tokenizer as Unsloth's GRPO notebooks load them, without vLLM: its loader (4-bit NF4 for
    QLoRA, else full fine-tuning), gradient checkpointing "unsloth", and for QLoRA its LoRA on the seven
    projections with the same rank and alpha as the other sides."""
    from unsloth import FastLanguageModel
    model, tok = FastLanguageModel.from_pretrained(
        model_name=spec["model"], max_seq_length=1024 + spec["new_tokens"], dtype=dtype, load_in_4bit=spec["qlora"],
        full_finetuning=not spec["qlora"], fast_inference=False, use_gradient_checkpointing="unsloth",
        random_state=0)
    if spec["qlora"]:
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0, bias="none",
                                                 target_modules=LORA_TARGETS, use_gradient_checkpointing="unsloth",
                                                 random_state=0)
    return model, tok


def trl_reward(completions, **_):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [bl.reward(solution_str=t) for t in texts]


def context_of(res: dict, shared_gpu: bool) -> tuple[Optional[float], str]:
    """A run's memory outside torch's allocator: NVML's figure for its own process where NVML shows it; else,
    on a GPU other runs shared (--shared-gpu), the plan's constant (the device's used memory counts the
    others); else the device's used memory less the allocator's reserved bytes (the run had the GPU alone)."""
    own, how = bl.own_context_gib(res)
    if how == "NVML, this process":
        return own, how
    if shared_gpu:
        from edgerl.plan.memory import DEFAULT_CALIBRATION
        return DEFAULT_CALIBRATION.cuda_context / bl.GiB, "the plan's constant (a shared GPU)"
    return (res.get("memory_end") or {}).get("outside_allocator_gib"), "the device's used memory"


def run_trl(name: str, model: Path, t: Trl, steps: int, new_tokens: int, work: Path, timeout: float,
            shared_gpu: bool = False) -> dict:
    out = work / f"{name.replace('/', '_')}.json"
    env = alloc_env(t.alloc)
    if t.tool == "unsloth":
        env.update(unsloth_env())
    spec = {"model": str(model), "precision": t.precision, "cap": t.cap, "qlora": t.qlora, "steps": steps,
            "new_tokens": new_tokens, "attention": "sdpa", "out": str(out), "alloc_env": env, "tool": t.tool}
    spec_path = work / f"{name.replace('/', '_')}.spec.json"
    spec_path.write_text(json.dumps(spec))
    for p in (out, Path(str(out) + ".partial")):
        p.unlink(missing_ok=True)
    status, rc, tail = bl.run_logged([sys.executable, __file__, "--trl-child", str(spec_path)],
                                     work / f"{name.replace('/', '_')}.log", timeout, env)
    if out.exists():
        res = json.loads(out.read_text())
    elif Path(str(out) + ".partial").exists():
        res = json.loads(Path(str(out) + ".partial").read_text())
        res["status"] = bl.failure_status(tail, status)
    else:
        res = {"status": bl.failure_status(tail, status if status != "ok" else "crashed"), "error": tail[-1500:]}
    if res["status"] != "ok" and res.get("step_rows"):
        res["status"] += f" after {len(res['step_rows'])} step(s)"
    res["log"] = str(work / f"{name.replace('/', '_')}.log")
    res["alloc_conf"] = env.get("PYTORCH_CUDA_ALLOC_CONF") or "torch's default"
    rows = res.get("step_rows") or []
    res["steps_done"] = len(rows)
    res["step_s"] = [r["step_s"] for r in rows]
    timed = rows[1:] or rows
    if timed:
        res["median_step_s"] = bl.med([r["step_s"] for r in timed])
        res["response_length_mean"] = bl.med([r.get("length_mean") for r in timed])
        if res["response_length_mean"] is not None and res["median_step_s"]:
            res["tokens_per_s"] = 16 * res["response_length_mean"] / res["median_step_s"]
        res["peak_allocated_gib"] = max((r.get("peak_allocated_gib") or 0.0 for r in rows), default=None) or None
        res["peak_reserved_gib"] = max((r.get("peak_reserved_gib") or 0.0 for r in rows), default=None) or None
    ctx, res["context_source"] = context_of(res, shared_gpu)
    res["outside_allocator_gib"] = ctx
    if res.get("peak_reserved_gib"):
        from edgerl.plan.memory import DEFAULT_CALIBRATION
        res["measured_gib"] = res["peak_reserved_gib"] + (ctx if ctx is not None else
                                                          DEFAULT_CALIBRATION.cuda_context / bl.GiB)
    res.pop("trace", None) if res["status"] == "ok" else None
    return res


def unsloth_env() -> dict[str, Optional[str]]:
    """Unsloth's child process: $EDGERL_UNSLOTH_PATH (site folders holding Unsloth and the TRL and datasets versions
    it requires, which differ from TRL's side) ahead of the Python path; no network (the GPU machine has none, and
    Unsloth would otherwise fetch a file from the Hub for its usage statistics)."""
    env: dict[str, Optional[str]] = {"HF_HUB_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1"}
    extra = os.environ.get("EDGERL_UNSLOTH_PATH")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH")) if p)
    return env


# ------------------------------------------------------------------------------------- the groups

def budget_for(item: str, trl: Optional[dict]) -> tuple[Optional[float], Optional[str], str]:
    """(memory_gib or None, optimizer or None, why it is skipped or ''), from a --frontier item."""
    budget, _, optimizer = item.partition(":")
    if budget.startswith("trl"):
        used = (trl or {}).get("measured_gib")
        if not used:
            return None, optimizer or None, "skipped: TRL's device memory was not measured"
        div = float(budget.split("/")[1]) if "/" in budget else 1.0
        return round(used / div, 2), optimizer or None, ""
    return float(budget), optimizer or None, ""


def runs_of(gname: str, g: Group, frontier: tuple[str, ...], edgerl_only: bool = False,
            trl_only: bool = False, trl_default: bool = False, unsloth: bool = False) -> list[tuple[str, Any]]:
    """The group's runs in order, each (name, what): TRL's main run (a Trl), edgerl with its own plan (None),
    edgerl at each frontier budget (the item), TRL's other runs. edgerl_only (GROUP:edgerl): no TRL run, nor a
    budget taken from TRL's memory; trl_only (GROUP:trl): TRL's main run alone; trl_default: TRL once more with
    torch's own allocator settings (its main run has edgerl's), after TRL's main run; unsloth: Unsloth's run
    (UNSLOTH, where the group has one) after TRL's."""
    main = [(f"{gname}/{g.trl.tag}", g.trl)] if g.trl and not edgerl_only else []
    default = [(f"{gname}/{g.trl.tag}-default-alloc", replace(g.trl, alloc="default", tag=f"{g.trl.tag}-default-alloc"))
               ] if g.trl and trl_default and not edgerl_only else []
    main += [(f"{gname}/unsloth", UNSLOTH[gname])] if unsloth and gname in UNSLOTH and not edgerl_only else []
    if trl_only:
        return main + default
    runs: list[tuple[str, Any]] = main + default
    runs.append((f"{gname}/edgerl", None))
    runs += [(f"{gname}/edgerl@{item}", item) for item in frontier if not edgerl_only or not item.startswith("trl")]
    runs += [(f"{gname}/{t.tag}", t) for t in g.extra_trl if not edgerl_only]
    return runs


def run_group(gname: str, g: Group, args, work: Path, results: bl.Results, clock: bl.Clock, log) -> None:
    shape = g.smoke_shape if args.smoke else g.shape
    steps = 2 if args.smoke else (args.steps or g.steps)
    frontier_steps = 2 if args.smoke else (args.steps or args.frontier_steps)
    new_tokens = 8 if args.smoke else args.new_tokens
    import torch  # noqa: F401 - only to ask whether CUDA exists; CUDA is not initialised here
    cuda = torch.cuda.is_available()
    profile = g.profile if cuda else ("cpu" if g.profile else None)
    frontier = g.frontier
    if g.frontier:
        frontier = tuple(args.frontier.split(",")) if gname == "362m-bf16" and args.frontier else frontier
        frontier = tuple(args.frontier_17b.split(",")) if gname == "1.7b-bf16" and args.frontier_17b else frontier
        if args.smoke and not args.frontier and gname == "362m-bf16":
            frontier = SMOKE_FRONTIER
    if g.shape in QLORA_SHAPES and args.frontier_qlora is not None:
        frontier = tuple(b for b in args.frontier_qlora.split(",") if b)
    plan_runs = runs_of(gname, g, frontier, gname in args.edgerl_only, gname in args.trl_only, args.trl_default_alloc,
                        args.unsloth)
    todo = [(n, w) for n, w in plan_runs if n not in args.skip
            and not (args.skip_done and results.runs.get(n, {}).get("status") == "ok")]
    if not todo:
        return
    if clock.left() < args.min_run_s:
        for n, _ in todo:
            results.put(n, {"group": gname, "status": f"skipped: {clock.elapsed():.0f} s of the budget used"})
        return
    try:
        model = bl.ensure_model(work, shape, args.tokenizer, timeout=max(60, min(600, clock.left() - 30)), log=log)
    except Exception as e:  # noqa: BLE001
        for n, _ in todo:
            results.put(n, {"group": gname, "status": "error: model not built", "error": str(e)[-1500:]})
        return
    info = bl.model_info(model)
    sets = bl.task_sets(work, steps, new_tokens) + list(g.sets) + list(args.edgerl_set)
    if profile:
        sets.append(f'run.profile="{profile}"')
    trl_main = results.runs.get(f"{gname}/{g.trl.tag}") if g.trl else None
    for name, what in todo:
        left = clock.left()
        if left < args.min_run_s:
            results.put(name, {"group": gname, "status": f"skipped: {clock.elapsed():.0f} s of the budget used"})
            log(f"{name}: skipped (budget)")
            continue
        timeout = min(args.timeout * (2 if g.shape in QLORA_SHAPES else 1), left - 10)
        run_steps = steps if what is None or isinstance(what, Trl) else frontier_steps
        base = {"group": gname, "shape": shape, "model": info, "steps": run_steps, "new_tokens": new_tokens,
                "speed_on": args.device + (f": a {profile}'s memory, not its speed" if cuda and g.profile else "")}
        if isinstance(what, Trl):
            res = run_trl(name, model, what, steps, new_tokens, work, timeout, args.shared_gpu)
            res["side"] = what.tool
            if what is g.trl:
                trl_main = res
        else:
            extra: list[str] = []
            budget = None
            if what is not None:
                budget, optimizer, skip = budget_for(what, trl_main)
                if skip:
                    results.put(name, {**base, "side": "edgerl", "status": skip})
                    log(f"{name}: {skip}")
                    continue
                extra += [f"plan.memory_gib={budget}", f"train.steps={run_steps}"]
                if optimizer:
                    extra.append(f'plan.optimizer="{optimizer}"')
            run_dir = work / "runs" / name.replace("/", "_").replace("@", "-at-").replace(":", "-")
            import shutil
            shutil.rmtree(run_dir, ignore_errors=True)
            spec = bl.edgerl_spec(model, sets + extra, run_dir, work / f"{name.replace('/', '_')}.json")
            res = bl.run_edgerl(name.replace("/", "_"), spec, work, timeout)
            res.update(side="edgerl", sets=extra, memory_gib=budget)
            if args.shared_gpu and res.get("peak_reserved_gib"):
                ctx, src = context_of(res, True)
                res.update(outside_allocator_gib=ctx, context_source=src, measured_gib=res["peak_reserved_gib"] + ctx)
                if res.get("estimate_gib"):
                    res["estimate_error"] = res["estimate_gib"] / res["measured_gib"] - 1
            if budget is not None and res.get("measured_gib"):
                res["within_budget"] = res["measured_gib"] <= budget
        res = {**base, **res}
        results.put(name, res)
        log(f"{name}: {res['status']} in {res.get('wall_s', 0):.0f} s; step {bl.fmt(res.get('median_step_s'))} s; "
            f"{bl.fmt(res.get('tokens_per_s'), '{:.0f}')} tok/s; peak reserved "
            f"{bl.fmt(res.get('peak_reserved_gib'))} GiB"
            + (f"; {res.get('error', '')[:300]}" if res["status"] != "ok" else ""))


# ------------------------------------------------------------------------------------- report

def checks(runs: dict[str, dict], args) -> list[str]:
    """What must hold for the comparison to mean anything; each failure as a line."""
    bad = []
    for name, r in runs.items():
        if not r.get("status", "").startswith("ok"):
            continue
        if r.get("steps_done") != r.get("steps"):
            bad.append(f"{name}: {r.get('steps_done')} steps done, {r.get('steps')} asked")
        if r.get("side") == "edgerl" and r.get("sequences_per_step") not in (None, 16):
            bad.append(f"{name}: {r.get('sequences_per_step')} sequences per step, not 16")
        if r.get("side") in PEERS and (r.get("config") or {}).get("generation_batch_size") != 16:
            bad.append(f"{name}: {PEERS[r['side']]} generated {(r.get('config') or {}).get('generation_batch_size')} per step, not 16")
        if r.get("within_budget") is False:
            bad.append(f"{name}: used {r['measured_gib']:.2f} GiB of device memory, over its plan budget "
                       f"{r['memory_gib']} GiB")
        length = r.get("response_length_mean")
        if length is not None and length < 0.9 * r.get("new_tokens", 0):
            bad.append(f"{name}: mean response {length:.0f} tokens of {r.get('new_tokens')} (tokens/s counts them)")
    groups: dict[str, list[dict]] = {}
    for r in runs.values():
        groups.setdefault(r.get("group", "?"), []).append(r)
    for g, rs in groups.items():
        models = {json.dumps(r.get("model"), sort_keys=True) for r in rs if r.get("model")}
        if len(models) > 1:
            bad.append(f"{g}: the runs used different model folders: {models}")
        edge = runs.get(f"{g}/edgerl") or {}
        for side, who in PEERS.items():
            peer = runs.get(f"{g}/{side}") or {}
            if peer.get("trainable_params") and edge.get("plan"):
                lora = (edge["plan"] or {}).get("lora")
                mine = lora["params"] if lora else edge.get("model_params")
                if mine != peer["trainable_params"]:
                    bad.append(f"{g}: edgerl trains {mine:,} parameters, {who} {peer['trainable_params']:,}: not the "
                               f"same {'adapter' if lora else 'model'}")
    return bad


def report(runs: dict[str, dict]) -> str:
    rows = []
    unsloth = any(r.get("side") == "unsloth" for r in runs.values())
    for name, r in runs.items():
        trl = runs.get(f"{r.get('group')}/trl") or {}
        uns = runs.get(f"{r.get('group')}/unsloth") or {}
        mine = r.get("side") in ("edgerl", "unsloth")
        vs_trl = bl.times(r, trl, "tokens_per_s") if mine else "-"
        mem_ratio = bl.times(r, trl, "measured_gib") if mine else "-"
        vs_uns = [bl.times(r, uns, "tokens_per_s") if r.get("side") == "edgerl" else "-"] if unsloth else []
        p = r.get("plan") or {}
        plan = (f"{(p.get('dtype') or {}).get('compute', '?')} {p.get('optimizer')}"
                + (" lora" if p.get("lora") else "") + (f" base {p.get('base_dtype')}" if p.get("base_dtype") else "")
                + (" ckpt" if p.get("grad_checkpointing") else "") + f" mb{p.get('micro_batch')}"
                + (" swap" if p.get("swap_models") else "") + (" opt-off" if p.get("optimizer_offload") else "")
                + (" param-off" if p.get("param_offload") else "")) if p else (
            f"{PEERS[r['side']]} {(r.get('config') or {}).get('model_dtype', '')}" if r.get("side") in PEERS else "-")
        est = (f"{r['estimate_gib']:.2f} ({bl.fmt(r.get('estimate_error'), '{:+.0%}')})"
               if r.get("estimate_gib") is not None else "-")
        rows.append([name, r.get("status", "-")[:40], bl.fmt(r.get("median_step_s")),
                     bl.fmt(r.get("tokens_per_s"), "{:.0f}"), vs_trl, *vs_uns, bl.fmt(r.get("peak_allocated_gib")),
                     bl.fmt(r.get("peak_reserved_gib")), bl.fmt(r.get("measured_gib")), mem_ratio,
                     bl.fmt(r.get("memory_gib"), "{:g}"), est, plan, r.get("speed_on", "-")])
    return bl.table(["run", "status", "s/step", "tok/s", "tok/s vs TRL", *(["vs Unsloth"] if unsloth else []),
                     "peak alloc GiB", "peak reserved GiB",
                     "device GiB", "device vs TRL", "plan budget GiB", "estimate GiB (error)", "plan",
                     "speed measured on"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help=f"groups, in order (default: all; smoke: {SMOKE_DEFAULT})")
    ap.add_argument("--steps", type=int, default=None, help="steps of every run (default: 4; 3 for 1.7b-p40, the "
                    "QLoRA groups and the frontier runs)")
    ap.add_argument("--frontier-steps", type=int, default=3, help="steps of each edgerl run at a memory budget")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per run (twice this for the 7-14B shapes)")
    ap.add_argument("--frontier", default=None, help="362m-bf16 edgerl budgets, comma-separated: GiB, trl, trl/2, "
                    "with :OPTIMIZER (default 12,8,6,4,3,2,trl/2,trl/2:adamw-bf16)")
    ap.add_argument("--frontier-17b", default=None, help="1.7b-bf16 edgerl budgets (default trl)")
    ap.add_argument("--frontier-qlora", default=None, help="edgerl budgets of the QLoRA groups (default trl where "
                    "TRL runs: edgerl with plan.memory_gib set to TRL's device memory; '' for none)")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="other runs share the GPU: a run's context is its own process's (NVML), else the plan's "
                         "constant, never the device's used memory")
    ap.add_argument("--trl-default-alloc", action="store_true",
                    help="also run TRL with torch's own allocator settings (its main run has the ones edgerl sets "
                         "for itself: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    ap.add_argument("--unsloth", action="store_true",
                    help="also run Unsloth's GRPO where a group has it (1.7b-bf16, llama8b-t4), from the Python path "
                         "plus $EDGERL_UNSLOTH_PATH (Unsloth wants TRL <= 1.15 and datasets < 5)")
    ap.add_argument("--skip", nargs="*", default=[], help="runs not to start, by name (llama8b-t4/trl-fp16)")
    ap.add_argument("--edgerl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more --set for every edgerl run (e.g. run.profile_step=3: that step's profile "
                         "lands in the run folder's profile/)")
    bl.add_run_args(ap, 540, 45, "tiny shapes, 2 steps of 8 tokens (CPU: profile cpu, no cap)")
    args = ap.parse_args()
    out, work = bl.out_and_work(args, "bench_vs_trl", 45)
    work.mkdir(parents=True, exist_ok=True)
    only = args.only or (SMOKE_DEFAULT if args.smoke else list(GROUPS))
    # GROUP:edgerl runs edgerl's side only (a shape whose TRL run is not needed in this call); GROUP:trl TRL's
    # main run only (how long a response TRL trains at, edgerl's side in another call or process)
    args.edgerl_only = {g.split(":")[0] for g in only if g.endswith(":edgerl")}
    args.trl_only = {g.split(":")[0] for g in only if g.endswith(":trl")}
    only = [g.split(":")[0] for g in only]
    unknown = [g for g in only if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    bl.catalogue_check()
    args.device = bl.device_name()
    clock = bl.Clock(args.budget_s)
    results = bl.Results(out, {"script": "bench_vs_trl", "smoke": args.smoke, "argv": sys.argv[1:],
                               "device": args.device, "versions": bl.versions()})

    def log(s: str) -> None:
        print(f"[{clock.elapsed():5.0f} s] {s}", flush=True)
    for gname in only:
        run_group(gname, GROUPS[gname], args, work, results, clock, log)
    runs = {k: v for k, v in results.runs.items() if v.get("group") in only}
    text = report(runs)
    bad = checks(runs, args)
    results.data["table"] = text
    results.data["check_failures"] = bad
    results.save()
    print("\nGRPO, 2 prompts x 8 samples x {} new tokens, median of steps 2..N; device GiB = peak reserved + memory "
          "outside the allocator (CUDA context); speeds are this GPU's\n".format(8 if args.smoke else args.new_tokens))
    print(text)
    print("\nchecks: " + ("all passed" if not bad else f"{len(bad)} FAILED\n  " + "\n  ".join(bad)))
    print(f"wrote {out} ({clock.elapsed():.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-child":
        trl_child(sys.argv[2])
    else:
        main()
