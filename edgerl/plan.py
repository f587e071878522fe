"""`plan()`: how to train on this device. Pure: same inputs, same plan, no I/O.

Every hardware decision is made here, once, with its reason; `doctor`, `recommend`, `train` and
the README print the same `Plan`. The memory-relevant knobs are chosen by searching from the
fastest setting to the most frugal until the memory model fits the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .device import GiB, MiB, Device
from .memory import DEFAULT_CALIBRATION, Calibration, MemoryEstimate, Setting, estimate, fmt_bytes
from .modelspec import ModelSpec, ModelSpecError
from .decisions import (DTYPE_BYTES, DtypePolicy, PlanError, choose_logprob_chunk, logit_bytes, lora_targets,
                        pick_attention, pick_base_dtype, pick_dtype, pick_kernels, pick_rollout)


@dataclass(frozen=True)
class Task:
    """The shape of the work: what the memory model and batch decisions depend on."""
    prompt_len: int = 256
    response_len: int = 256
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    mini_batch: Optional[int] = None       # sequences per PPO update; None = all of the step
    algo: str = "grpo"                     # gae trains a critic
    kl: bool = True                        # a reference model is needed (kl_coef > 0)
    reward_model_params: int = 0
    lora: Optional[bool] = False           # None: the plan turns LoRA on when full fine-tuning cannot fit
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: Optional[tuple[str, ...]] = None

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def mini(self) -> int:
        return self.mini_batch or self.sequences

    def effective_batch(self) -> str:
        updates = self.sequences // self.mini
        return (f"{self.prompts_per_step} prompts x {self.samples_per_prompt} samples = {self.sequences} "
                f"sequences per step; mini-batch {self.mini} -> {updates} update(s) per epoch")


@dataclass(frozen=True)
class Plan:
    device: Device
    model: ModelSpec
    task: Task
    dtype: DtypePolicy
    attention: str
    rollout_engine: str
    cuda_graphs: bool
    kernel_backend: str
    kernel_tiles: Optional[dict[str, Any]]
    logprob_chunk: int
    grad_checkpointing: bool
    swap_models: bool
    optimizer_offload: bool
    param_offload: bool
    optimizer: str
    lora: Optional[dict[str, Any]]
    base_dtype: Optional[str]            # storage of the frozen LoRA base; None with full fine-tuning
    micro_batch: int
    score_micro_batch: int
    rollout_batch: int
    rollout_memory_share: float
    env: tuple[tuple[str, str], ...]
    memory: MemoryEstimate
    headroom: int
    reasons: dict[str, str] = field(default_factory=dict)

    DECISIONS = ("dtype", "attention", "rollout_engine", "cuda_graphs", "kernel_backend", "kernel_tiles",
                 "logprob_chunk", "grad_checkpointing", "swap_models", "optimizer_offload", "param_offload",
                 "optimizer", "lora", "base_dtype", "micro_batch", "score_micro_batch", "rollout_batch",
                 "rollout_memory_share", "env")

    def value(self, key: str) -> Any:
        v = getattr(self, key)
        if isinstance(v, DtypePolicy):
            return dataclasses.asdict(v)
        if key == "env":
            return dict(v)
        return v

    def decisions(self) -> dict[str, Any]:
        return {k: self.value(k) for k in self.DECISIONS}

    def to_dict(self) -> dict[str, Any]:
        return {"device": _device_dict(self.device), "model": dataclasses.asdict(self.model)
                | {"n_params": self.model.n_params()},
                "task": dataclasses.asdict(self.task), "plan": self.decisions(),
                "reasons": {k: self.reasons.get(k, "") for k in self.DECISIONS},
                "memory": self.memory.to_dict() | {"headroom_bytes": self.headroom},
                "effective_batch": self.task.effective_batch()}


def _device_dict(d: Device) -> dict[str, Any]:
    out = dataclasses.asdict(d)
    out["software"] = {"python": d.software.python, "torch": d.software.torch,
                       "torch_cuda": d.software.torch_cuda, "arch_list": list(d.software.arch_list),
                       "libs": dict(d.software.libs)}
    return out


# --- the search --------------------------------------------------------------------------------------

def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


@dataclass(frozen=True)
class _Search:
    setting: Setting
    memory: MemoryEstimate
    stage: str


STAGES = (  # (name, checkpointing, swap models, optimizer offload, param offload, 8-bit AdamW), fastest first
    ("none", False, False, False, False, False),
    ("gradient checkpointing", True, False, False, False, False),
    ("+ the reference waits in host memory outside scoring", True, True, False, False, False),
    # exact fp32 state over PCIe before approximate 8-bit state: offload costs ~2 x 8 bytes per parameter
    # of transfer per step, small next to a rollout on the cards that need it
    ("+ optimizer state in host memory between updates", True, True, True, False, False),
    ("+ 8-bit AdamW state (bitsandbytes) on the GPU", True, True, False, False, True),
    ("+ 8-bit AdamW state in host memory between updates", True, True, True, False, True),
    ("+ FSDP2 CPU offload of parameters, gradients and optimizer", True, True, True, True, False),
)


def _stages(optimizer: Optional[str], bnb_ok: bool, param_offload: bool) -> list[tuple]:
    """STAGES for this run: 8-bit ones only where bitsandbytes runs and plan.optimizer is not adamw;
    with plan.optimizer=adamw8bit every stage uses it (duplicates dropped); `param_offload` False drops
    the last stage (LoRA=auto tries adapters before streaming every weight over PCIe)."""
    out, seen = [], set()
    for name, ckpt, swap, opt_off, par_off, eight in STAGES:
        if par_off and not param_offload:
            continue
        if optimizer == "adamw" and eight or optimizer is None and eight and not bnb_ok:
            continue
        if optimizer == "adamw8bit":
            eight = True
            if (ckpt, swap, opt_off, par_off) in seen:
                continue
        seen.add((ckpt, swap, opt_off, par_off))
        out.append((name, ckpt, swap, opt_off, par_off, eight))
    return out


def _search(model: ModelSpec, task: Task, base: Setting, budget: int, forced: dict[str, Any],
            cal: Calibration, host_memory: int, stages: list[tuple]) -> tuple[Optional[_Search], list[str]]:
    tried: list[str] = []
    mini = task.mini
    small = min(mini, 4)  # below 4 sequences a micro-batch leaves the GPU idle: checkpoint first
    for i, (name, ckpt, swap, opt_off, par_off, eight) in enumerate(stages):
        values = {"grad_checkpointing": ckpt, "swap_models": swap, "optimizer_offload": opt_off,
                  "param_offload": par_off}
        if any(forced.get(k) is not None and forced[k] != v for k, v in values.items()):
            continue
        last = i == len(stages) - 1 or all(
            forced.get(k) is not None for k in values)
        mbs = [forced["micro_batch"]] if forced.get("micro_batch") else _divisors_desc(mini)
        for mb in mbs:
            if mb < small and not last and not forced.get("micro_batch"):
                break
            s = replace(base, micro_batch=mb, optimizer_bytes_per_param=2 if eight else 8, **values)
            s = _fit_rollout_and_score(model, task, s, budget, forced, cal)
            mem = estimate(model, s, task.prompt_len, task.response_len, budget, cal)
            if mem.fits and mem.host_needed <= host_memory * 0.8:
                return _Search(s, mem, name), tried
            tried.append(f"{name}, micro-batch {mb}: {fmt_bytes(mem.total)} ({mem.peak_phase})"
                         + ("" if mem.fits else "") + (f", host {fmt_bytes(mem.host_needed)}"
                                                       if mem.host_needed > host_memory * 0.8 else ""))
    return None, tried


def _fit_rollout_and_score(model: ModelSpec, task: Task, s: Setting, budget: int, forced: dict[str, Any],
                           cal: Calibration) -> Setting:
    """Largest rollout batch and scoring micro-batch (divisors of the step's sequences) that fit."""
    seqs = task.sequences
    for key in ("rollout_batch", "score_micro_batch"):
        options = [forced[key]] if forced.get(key) else _divisors_desc(seqs)
        for v in options:
            cand = replace(s, **{key: v})
            mem = estimate(model, cand, task.prompt_len, task.response_len, budget, cal)
            phase = "rollout" if key == "rollout_batch" else "score"
            if mem.phase_totals()[phase] <= budget or v == options[-1]:
                s = cand
                break
    return s


def plan(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]] = None,
         calibration: Calibration = DEFAULT_CALIBRATION) -> Plan:
    """The plan for `task` on `device`. `overrides` holds PlanOverrides fields (None = decide) plus
    `micro_batch`. Raises PlanError when nothing fits, saying what would."""
    return _plan(device, model, task, overrides, calibration, explain=True)


def _plan(device: Device, model: ModelSpec, task: Task, overrides: Optional[dict[str, Any]],
          calibration: Calibration, explain: bool) -> Plan:
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    reasons: dict[str, str] = {}
    dtype, reasons["dtype"] = pick_dtype(device, o.get("dtype"))
    attention, reasons["attention"] = pick_attention(device, dtype, o.get("attention"))
    engine, graphs, reasons["rollout_engine"], reasons["cuda_graphs"] = pick_rollout(
        device, dtype, o.get("rollout_engine"), o.get("cuda_graphs"))
    backend, tiles, reasons["kernel_backend"] = pick_kernels(device, dtype, model, o.get("kernel_backend"))
    reasons["kernel_tiles"] = reasons["kernel_backend"] if tiles else "no Triton kernel on this device"

    total = int(o["memory_gib"] * GiB) if "memory_gib" in o else device.total_memory
    if "headroom_gib" in o:
        headroom = int(o["headroom_gib"] * GiB)
        hreason = f"plan.headroom_gib={o['headroom_gib']}"
    else:
        headroom = max(256 * MiB, int(0.05 * total)) if device.is_cuda else int(0.25 * total)
        hreason = ("5% of device memory (at least 256 MiB) kept free for the allocator and libraries"
                   if device.is_cuda else "25% of host RAM left to the OS and other processes")
    budget = total - headroom
    per_logit = logit_bytes(backend, dtype)
    chunk = choose_logprob_chunk(model, budget, per_logit)
    reasons["logprob_chunk"] = (f"{chunk} tokens per chunk: the kernel holds {fmt_bytes(chunk * model.vocab_size * per_logit)} "
                                f"of logits at a time instead of tokens x {model.vocab_size} for the whole batch")

    # bitsandbytes' 8-bit optimizers run from CC 6.0 (hardware.md section 8): Pascal included
    bnb_ok = device.is_cuda and device.cc >= (6, 0) and device.software.has("bitsandbytes")
    if o.get("optimizer") == "adamw8bit" and not bnb_ok:
        raise PlanError("plan.optimizer=adamw8bit needs bitsandbytes on a CUDA device with CC >= 6.0 "
                        f"({device.describe()}{', bitsandbytes not installed' if device.is_cuda else ''}); "
                        "pip install bitsandbytes, or use adamw")
    base_dtype, base_reason = pick_base_dtype(device, dtype, o.get("base_dtype"))
    need_host_for_offload = not device.integrated
    host = device.host_memory if need_host_for_offload else 0

    def base_setting(lora_params: int) -> Setting:
        return Setting(
            compute_bytes=dtype.compute_bytes, base_bytes=DTYPE_BYTES[base_dtype] if lora_params else 4,
            grad_checkpointing=False, swap_models=False, optimizer_offload=False, param_offload=False,
            micro_batch=1, score_micro_batch=1, rollout_batch=1, logprob_chunk=chunk, logit_bytes=per_logit,
            eager_attention=attention == "eager",
            lora_params=lora_params,
            critic=task.algo == "gae", reference=task.kl and not lora_params,
            reward_model_params=task.reward_model_params, cuda=device.is_cuda)

    forced = {k: o.get(k) for k in ("grad_checkpointing", "swap_models", "optimizer_offload", "param_offload",
                                    "rollout_batch", "score_micro_batch", "micro_batch")}
    if device.integrated:
        forced["param_offload"] = forced["param_offload"] or False
        forced["optimizer_offload"] = forced["optimizer_offload"] or False
    targets: tuple[str, ...] = ()
    lora_params = 0
    attempts: list[tuple[bool, Optional[_Search], list[str]]] = []
    for use_lora in ([False, True] if task.lora is None else [bool(task.lora)]):
        if use_lora:
            targets = lora_targets(model.model_type, task.lora_targets)
            try:
                lora_params = model.lora_params(task.lora_rank, targets)
            except ModelSpecError as e:
                raise PlanError(f"lora.target_modules: {e}") from None
        stages = _stages(o.get("optimizer"), bnb_ok, param_offload=use_lora or task.lora is not None)
        found, tried = _search(model, task, base_setting(lora_params if use_lora else 0), budget, forced,
                               calibration, host, stages)
        attempts.append((use_lora, found, tried))
        if found:
            break
    use_lora, found, tried = attempts[-1]
    if found is None:
        if not explain:
            raise PlanError("does not fit")
        raise PlanError(_no_fit_message(device, model, task, budget, attempts, o, calibration))

    s, mem = found.setting, found.memory
    _memory_reasons(reasons, found, task, device, attempts, model, lora_params, use_lora, targets, mem, calibration)
    optimizer = "adamw8bit" if s.optimizer_bytes_per_param == 2 else "adamw"
    reasons["optimizer"] = (
        "asked for with plan.optimizer=adamw8bit: 8-bit AdamW (bitsandbytes), 2 bytes of state per trainable "
        "parameter" if o.get("optimizer") == "adamw8bit" else
        "8-bit AdamW (bitsandbytes): 2 bytes of state per trainable parameter instead of 8; fp32 state did "
        "not fit, not even waiting in host memory between updates (--set plan.optimizer=adamw forbids 8-bit)"
        if optimizer == "adamw8bit" else
        "AdamW with fp32 moments (8 bytes per trainable parameter)")
    reasons["base_dtype"] = base_reason if use_lora else "not used: full fine-tuning keeps fp32 master weights"
    share = mem.phase_totals()["rollout"] / total if total else 0.0
    if "rollout_memory_share" in o:
        share = float(o["rollout_memory_share"])
        reasons["rollout_memory_share"] = f"asked for with plan.rollout_memory_share={share}"
    else:
        reasons["rollout_memory_share"] = (
            f"the rollout phase's estimate over device memory; vLLM's gpu_memory_utilization "
            "comes from here, not from hand tuning" if engine == "vllm" else
            "the rollout phase's estimate over device memory (the static KV cache is sized by the plan)")
    env = []
    if device.is_cuda and not device.integrated:
        env.append(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    env.append(("TOKENIZERS_PARALLELISM", "false"))
    reasons["env"] = ("expandable segments cut fragmentation between phases of different shapes; "
                      "tokenizer threads off inside the training loop") if device.is_cuda else \
        "tokenizer threads off inside the training loop"
    lora_info = None
    if use_lora:
        lora_info = {"rank": task.lora_rank, "alpha": task.lora_alpha, "targets": list(targets),
                     "params": lora_params}
    return Plan(device=device, model=model, task=task, dtype=dtype, attention=attention, rollout_engine=engine,
                cuda_graphs=graphs, kernel_backend=backend, kernel_tiles=tiles, logprob_chunk=chunk,
                grad_checkpointing=s.grad_checkpointing, swap_models=s.swap_models,
                optimizer_offload=s.optimizer_offload, param_offload=s.param_offload, optimizer=optimizer,
                lora=lora_info, base_dtype=base_dtype if use_lora else None, micro_batch=s.micro_batch,
                score_micro_batch=s.score_micro_batch,
                rollout_batch=s.rollout_batch, rollout_memory_share=round(share, 4), env=tuple(env),
                memory=mem, headroom=headroom, reasons=reasons | {"headroom": hreason})


def _memory_reasons(reasons: dict[str, str], found: _Search, task: Task, device: Device,
                    attempts: list, model: ModelSpec, lora_params: int, use_lora: bool,
                    targets: tuple[str, ...], mem: MemoryEstimate, cal: Calibration) -> None:
    s = found.setting
    budget = fmt_bytes(mem.budget)
    fits = f"estimate {fmt_bytes(mem.total)} (peak in {mem.peak_phase}) of a {budget} budget"
    first = found.stage == STAGES[0][0]
    reasons["grad_checkpointing"] = (f"not needed: {fits}" if not s.grad_checkpointing else
                                     f"on: without it the update does not fit with a useful micro-batch; {fits}")
    reasons["swap_models"] = ("the reference model stays on the GPU" if not s.swap_models else
                              "the reference model moves to host memory outside the scoring phase")
    reasons["optimizer_offload"] = ("optimizer state stays on the GPU" if not s.optimizer_offload else
                                    "optimizer state waits in host memory between updates and comes back "
                                    "for the optimizer step only")
    reasons["param_offload"] = ("weights stay on the GPU" if not s.param_offload else
                                f"FSDP2 CPUOffloadPolicy: host RAM holds {fmt_bytes(mem.host_needed)}; "
                                "layers stream over PCIe (slow, but it fits)")
    reasons["micro_batch"] = (f"{s.micro_batch} sequences per forward/backward: the largest divisor of the "
                              f"mini-batch ({task.mini}) that fits" + ("" if first else f" after {found.stage}"))
    reasons["score_micro_batch"] = f"{s.score_micro_batch} sequences per no-grad log-prob pass"
    reasons["rollout_batch"] = (f"{s.rollout_batch} of {task.sequences} sequences generated at once "
                                f"(KV cache {fmt_bytes(mem.phases['rollout'].get('KV cache', 0))})")
    if use_lora:
        full_tried = attempts[0][2][-1] if attempts[0][2] and not attempts[0][0] else ""
        why = ("asked for" if task.lora else f"full fine-tuning does not fit without streaming every weight "
               f"over PCIe (most frugal on-GPU setting: {full_tried})")
        # the same setting with every weight trained, an fp32 master copy and a separate reference
        full = estimate(model, replace(s, lora_params=0, base_bytes=4, reference=task.kl), task.prompt_len,
                        task.response_len, mem.budget, cal)
        reasons["lora"] = (f"LoRA r={task.lora_rank} on {', '.join(targets)}: {fmt_count(lora_params)} trainable "
                           f"parameters ({lora_params / model.n_params():.2%} of {fmt_count(model.n_params())}); "
                           f"saves {fmt_bytes(full.total - mem.total)} at this setting ({fmt_bytes(full.total)} "
                           f"-> {fmt_bytes(mem.total)}): no gradients or optimizer state for the frozen base, and "
                           f"the reference is the base with the adapter disabled; {why}")
    else:
        reasons["lora"] = "full fine-tuning fits" if task.lora is None else "full fine-tuning (lora.enabled=false)"


def fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _no_fit_message(device: Device, model: ModelSpec, task: Task, budget: int, attempts: list,
                    o: dict[str, Any], cal: Calibration) -> str:
    use_lora, _, tried = attempts[-1]
    lines = [f"{model.name} does not fit on {device.describe()} for this task "
             f"({task.effective_batch()}; prompt {task.prompt_len} + response {task.response_len} tokens); "
             f"budget {fmt_bytes(budget)}. Most frugal setting tried: {tried[-1] if tried else 'none'}.",
             "What would fit:"]
    found_any = False

    def fits(**changes: Any) -> bool:
        return fits_on(device, model, replace(task, **changes), o, cal)

    if task.response_len > 32 and fits(response_len=task.response_len // 2):
        lines.append(f"  - a shorter response: --set rollout.max_new_tokens={task.response_len // 2}")
        found_any = True
    if task.samples_per_prompt > 2 and fits(samples_per_prompt=task.samples_per_prompt // 2):
        lines.append(f"  - fewer samples: --set rollout.n_samples={task.samples_per_prompt // 2}")
        found_any = True
    if task.prompts_per_step > 1 and fits(prompts_per_step=1):
        lines.append("  - one prompt per step: --set train.prompts_per_step=1")
        found_any = True
    if not task.lora and task.lora is not None and fits(lora=True):
        lines.append(f"  - LoRA adapters (r={task.lora_rank}): --set lora.enabled=true")
        found_any = True
    if device.is_cuda:
        from .profiles import device_from_profile, list_profiles
        bigger = sorted((p for p in list_profiles() if p.kind == "cuda" and p.memory_bytes > device.total_memory
                         and p.integrated == device.integrated),
                        key=lambda p: p.memory_bytes)
        for p in bigger:
            if fits_on(device_from_profile(p, device.software, device.host_memory), model, task, o, cal):
                lines.append(f"  - a bigger GPU: {p.display} ({p.memory_bytes / GiB:.0f} GiB, profile {p.name})")
                found_any = True
                break
    if not found_any:
        lines.append("  - nothing close: a smaller model")
    return "\n".join(lines)


def fits_on(device: Device, model: ModelSpec, task: Task, o: dict[str, Any], cal: Calibration) -> bool:
    try:
        _plan(device, model, task, o, cal, explain=False)
        return True
    except PlanError:
        return False
