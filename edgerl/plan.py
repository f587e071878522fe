"""`plan()`: how to train on this device. Pure: same inputs, same plan, no I/O.

The single-choice decisions come from `decisions.py`, each with its reason; the memory-relevant
knobs are chosen here by walking `moves.STAGES` from the fastest setting to the most frugal until
the memory model fits the budget. `doctor`, `recommend`, `train` and the README print this `Plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .decisions import (DtypePolicy, bnb_support, choose_logprob_chunk, logit_bytes, lora_targets, optimizer_reason,
                        pick_attention, pick_base_dtype, pick_dtype, pick_env, pick_headroom, pick_kernels,
                        pick_reward_model_dtype, pick_rollout, rollout_share_reason, transfer_note)
from .device import GiB, Device
from .dtypes import nbytes
from .errors import ModelSpecError, PlanError
from .memory import DEFAULT_CALIBRATION, Calibration, MemoryEstimate, Setting, estimate, fmt_bytes
from .modelspec import ModelSpec
from .moves import STAGES, TASK_MOVES, Stage, stages_for


@dataclass(frozen=True)
class Task:
    """The shape of the work: what the memory model and batch decisions depend on."""
    prompt_len: int = 256
    response_len: int = 256
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    mini_batch: Optional[int] = None       # sequences per PPO update; None = all of the step
    algo: str = "grpo"
    critic: bool = False                   # the estimator learns values (gae): a critic model trains too
    kl: bool = True                        # a reference model is needed (kl_coef > 0)
    reward_model_params: int = 0
    lora: Optional[bool] = False           # None: the plan turns LoRA on when full fine-tuning cannot fit
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: Optional[tuple[str, ...]] = None
    world_size: int = 1                    # GPUs (processes) sharing the step; the plan is for one of them

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def mini(self) -> int:
        return self.mini_batch or self.sequences

    @property
    def local_sequences(self) -> int:
        """Sequences one GPU generates, scores and trains on per step."""
        return self.sequences // self.world_size

    @property
    def local_mini(self) -> int:
        return self.mini // self.world_size

    def effective_batch(self) -> str:
        updates = self.sequences // self.mini
        per_gpu = (f" over {self.world_size} GPUs: {self.local_sequences} sequences and a mini-batch of "
                   f"{self.local_mini} per GPU" if self.world_size > 1 else "")
        return (f"{self.prompts_per_step} prompts x {self.samples_per_prompt} samples = {self.sequences} "
                f"sequences per step; mini-batch {self.mini} -> {updates} update(s) per epoch{per_gpu}")


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
    reward_model_dtype: Optional[str]    # None without a reward model
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
                 "optimizer", "lora", "base_dtype", "reward_model_dtype", "micro_batch", "score_micro_batch", "rollout_batch",
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


def _search(model: ModelSpec, task: Task, base: Setting, budget: int, forced: dict[str, Any],
            cal: Calibration, host_memory: int, stages: list[Stage]) -> tuple[Optional[_Search], list[str]]:
    tried: list[str] = []
    mini = task.local_mini
    small = min(mini, 4)  # below 4 sequences a micro-batch leaves the GPU idle: checkpoint first
    for i, stage in enumerate(stages):
        name, eight, values = stage.name, stage.eight_bit, stage.knobs()
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
    seqs = task.local_sequences
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
    _check_world(task, o)
    reasons: dict[str, str] = {}
    dtype, reasons["dtype"] = pick_dtype(device, o.get("dtype"))
    attention, reasons["attention"] = pick_attention(device, dtype, o.get("attention"))
    engine, graphs, reasons["rollout_engine"], reasons["cuda_graphs"] = pick_rollout(
        device, dtype, model, task.prompt_len + task.response_len, o.get("rollout_engine"), o.get("cuda_graphs"),
        task.world_size)
    backend, tiles, reasons["kernel_backend"] = pick_kernels(device, dtype, model, o.get("kernel_backend"))
    reasons["kernel_tiles"] = reasons["kernel_backend"] if tiles else "no Triton kernel on this device"

    total = int(o["memory_gib"] * GiB) if "memory_gib" in o else device.total_memory
    headroom, hreason = pick_headroom(device, total, o.get("headroom_gib"))
    budget = total - headroom
    per_logit = logit_bytes(backend, dtype)
    chunk = choose_logprob_chunk(model, budget, per_logit)
    reasons["logprob_chunk"] = (f"{chunk} tokens per chunk: the kernel holds {fmt_bytes(chunk * model.vocab_size * per_logit)} "
                                f"of logits at a time instead of tokens x {model.vocab_size} for the whole batch")

    bnb_ok, bnb_why = bnb_support(device)
    if bnb_ok and task.world_size > 1:
        # its quantized state is per shard, which a checkpoint of N processes cannot gather and re-split
        bnb_ok, bnb_why = False, f"8-bit AdamW keeps its state per shard, which edgerl cannot checkpoint across " \
                                 f"{task.world_size} processes"
    if o.get("optimizer") == "adamw8bit" and not bnb_ok:
        raise PlanError(f"plan.optimizer=adamw8bit is not possible on {device.describe()}: {bnb_why}; "
                        "use adamw")
    base_dtype, base_reason = pick_base_dtype(device, dtype, o.get("base_dtype"))
    rm_dtype, reasons["reward_model_dtype"] = (pick_reward_model_dtype(dtype) if task.reward_model_params
                                               else (None, "no reward model"))
    host = device.host_memory if not device.integrated else 0

    def base_setting(lora_params: int) -> Setting:
        return Setting(
            compute_bytes=dtype.compute_bytes,
            base_bytes=int(nbytes(base_dtype)) if lora_params else dtype.param_bytes,
            grad_checkpointing=False, swap_models=False, optimizer_offload=False, param_offload=False,
            micro_batch=1, score_micro_batch=1, rollout_batch=1, logprob_chunk=chunk, logit_bytes=per_logit,
            eager_attention=attention == "eager",
            lora_params=lora_params,
            critic=task.critic, reference=task.kl and not lora_params,
            reward_model_params=task.reward_model_params, cuda=device.is_cuda, shards=task.world_size)

    forced = {k: o.get(k) for k in ("grad_checkpointing", "swap_models", "optimizer_offload", "param_offload",
                                    "rollout_batch", "score_micro_batch", "micro_batch")}
    if device.integrated:  # host memory is the same memory: moving anything there frees nothing
        for k in ("param_offload", "optimizer_offload", "swap_models"):
            forced[k] = forced[k] or False
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
        stages = stages_for(o.get("optimizer"), bnb_ok, param_offload=use_lora or task.lora is not None)
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
    reasons["optimizer"] = optimizer_reason(optimizer, o.get("optimizer"))
    reasons["base_dtype"] = base_reason if use_lora else \
        f"not used: full fine-tuning keeps {dtype.param} master weights"
    share = mem.phase_totals()["rollout"] / total if total else 0.0
    if "rollout_memory_share" in o:
        share = float(o["rollout_memory_share"])
        reasons["rollout_memory_share"] = f"asked for with plan.rollout_memory_share={share}"
    else:
        reasons["rollout_memory_share"] = rollout_share_reason(engine)
    env, reasons["env"] = pick_env(device)
    lora_info = None
    if use_lora:
        lora_info = {"rank": task.lora_rank, "alpha": task.lora_alpha, "targets": list(targets),
                     "params": lora_params}
    return Plan(device=device, model=model, task=task, dtype=dtype, attention=attention, rollout_engine=engine,
                cuda_graphs=graphs, kernel_backend=backend, kernel_tiles=tiles, logprob_chunk=chunk,
                grad_checkpointing=s.grad_checkpointing, swap_models=s.swap_models,
                optimizer_offload=s.optimizer_offload, param_offload=s.param_offload, optimizer=optimizer,
                lora=lora_info, base_dtype=base_dtype if use_lora else None, reward_model_dtype=rm_dtype,
                micro_batch=s.micro_batch, score_micro_batch=s.score_micro_batch,
                rollout_batch=s.rollout_batch, rollout_memory_share=round(share, 4), env=env,
                memory=mem, headroom=headroom, reasons=reasons | {"headroom": hreason})


def _check_world(task: Task, o: dict[str, Any]) -> None:
    """The global batch must split evenly over the GPUs: whole prompts (a GRPO group stays on one GPU)
    and whole mini-batches per GPU."""
    w = task.world_size
    if w < 1:
        raise PlanError(f"world size {w}: at least one GPU")
    if w == 1:
        return
    if task.prompts_per_step % w:
        raise PlanError(f"train.prompts_per_step={task.prompts_per_step} does not split over {w} GPUs (each GPU "
                        f"generates whole groups of prompts); use a multiple of {w}")
    if task.mini % w or (task.local_sequences % task.local_mini):
        raise PlanError(f"train.mini_batch={task.mini} does not split over {w} GPUs; use a multiple of {w} that "
                        f"divides the {task.sequences} sequences per step")
    if o.get("micro_batch") and task.local_mini % o["micro_batch"]:
        raise PlanError(f"train.micro_batch={o['micro_batch']} must divide the mini-batch of {task.local_mini} per "
                        f"GPU ({task.mini} over {w} GPUs)")


def _memory_reasons(reasons: dict[str, str], found: _Search, task: Task, device: Device,
                    attempts: list, model: ModelSpec, lora_params: int, use_lora: bool,
                    targets: tuple[str, ...], mem: MemoryEstimate, cal: Calibration) -> None:
    s = found.setting
    budget = fmt_bytes(mem.budget)
    fits = f"estimate {fmt_bytes(mem.total)} (peak in {mem.peak_phase}) of a {budget} budget"
    first = found.stage == STAGES[0].name
    reasons["grad_checkpointing"] = (f"not needed: {fits}" if not s.grad_checkpointing else
                                     f"on: without it the update does not fit with a useful micro-batch; {fits}")
    ref_bytes = model.n_params() * s.compute_bytes if s.reference else 0
    state_bytes = (lora_params or model.n_params()) * s.optimizer_bytes_per_param
    where = "on the GPU" if device.is_cuda else "in memory"   # the CPU has no device memory apart from the host's
    reasons["swap_models"] = (f"the reference model stays {where}" if not s.swap_models else
                              "the reference model moves to host memory outside the scoring phase"
                              + transfer_note(device, ref_bytes))
    reasons["optimizer_offload"] = (f"optimizer state stays {where}" if not s.optimizer_offload else
                                    "optimizer state waits in host memory between updates and comes back "
                                    "for the optimizer step only" + transfer_note(device, state_bytes))
    reasons["param_offload"] = (f"weights stay {where}" if not s.param_offload else
                                f"FSDP2 CPUOffloadPolicy: host RAM holds {fmt_bytes(mem.host_needed)}; "
                                "layers stream over PCIe (slow, but it fits)" + transfer_note(device, mem.host_needed))
    reasons["micro_batch"] = (f"{s.micro_batch} sequences per forward/backward: the largest divisor of the "
                              f"mini-batch ({task.local_mini}{' per GPU' if task.world_size > 1 else ''}) that fits" + ("" if first else f" after {found.stage}"))
    reasons["score_micro_batch"] = f"{s.score_micro_batch} sequences per no-grad log-prob pass"
    reasons["rollout_batch"] = (f"{s.rollout_batch} of {task.local_sequences} sequences generated at once "
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

    fields = {"rollout.max_new_tokens": "response_len", "rollout.n_samples": "samples_per_prompt",
              "train.prompts_per_step": "prompts_per_step"}
    for label, key, smaller in TASK_MOVES:
        value = smaller(task)
        if value is not None and fits(**{fields[key]: value}):
            lines.append(f"  - {label}: --set {key}={value}")
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
