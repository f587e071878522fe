"""`plan()`: how to train on this device. Pure: same inputs, same plan, no I/O.

The single-choice decisions come from `decisions.py`, each with its reason; the memory-relevant
knobs are chosen here by walking `moves.STAGES` from the fastest setting to the most frugal until
the memory model fits the budget. `doctor`, `recommend`, `train` and the README print this `Plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from edgerl.plan.decisions import (BF16_PARAMS, QUANT_BASES, DtypePolicy, bf16_state_support, bnb_support, choose_logprob_chunk,
                        quant_support, logit_bytes, lora_targets, optimizer_reason,
                        pick_attention, pick_base_dtype, pick_dtype, pick_env, pick_headroom, pick_kernels,
                        pick_decode_attention, pick_nf4_kernel, pick_reward_model_dtype, pick_rollout, pick_share_prompts,
                        pick_rollout_compile, triton_layers_reason,
                        rollout_share_reason, share_blocker, transfer_note)
from edgerl.device.device import GiB, Device
from edgerl.plan.dtypes import nbytes
from edgerl.core.errors import ModelSpecError, PlanError
from edgerl.plan.memory import DEFAULT_CALIBRATION, OPTIMIZERS, Calibration, MemoryEstimate, Setting, estimate, fmt_bytes
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.moves import STAGE_COST, STAGES, TASK_MOVES, stages_for
from edgerl.plan.search import Candidate, Found, micro_cost, search, trained_and_base
from edgerl.plan.task import Task


@dataclass(frozen=True)
class Plan:
    device: Device
    model: ModelSpec
    task: Task
    dtype: DtypePolicy
    attention: str
    rollout_engine: str
    cuda_graphs: bool
    rollout_compile: bool                # the hf engine's decode step compiled (torch.compile)
    decode_attention: str                # how the hf engine's decode step attends: triton(_rope), its whole layer as
                                         # Triton kernels (triton_layers), cuda, sdpa or bmm
    nf4_kernel: bool                     # the decode step's NF4 matmuls through edgerl's fused kernel
    share_prompts: bool                  # a micro-batch's forward computes each distinct prompt once
    kernel_backend: str
    kernel_tiles: Optional[dict[str, Any]]
    logprob_chunk: int
    grad_checkpointing: bool
    swap_models: bool
    optimizer_offload: bool
    param_offload: bool
    optimizer: str
    lora: Optional[dict[str, Any]]
    base_dtype: Optional[str]            # storage of the frozen LoRA base (a float dtype, int8 or nf4); None
    reward_model_dtype: Optional[str]    # None without a reward model
    micro_batch: int
    score_micro_batch: int
    rollout_batch: int
    rollout_resident: bool               # the engine keeps weights, KV cache and CUDA graphs between steps
    rollout_memory_share: float
    env: tuple[tuple[str, str], ...]
    memory: MemoryEstimate
    headroom: int
    reasons: dict[str, str] = field(default_factory=dict)

    DECISIONS = ("dtype", "attention", "rollout_engine", "cuda_graphs", "rollout_compile", "decode_attention",
                 "nf4_kernel",
                 "kernel_backend", "kernel_tiles", "logprob_chunk", "grad_checkpointing", "swap_models",
                 "optimizer_offload", "param_offload", "optimizer", "lora", "base_dtype", "reward_model_dtype",
                 "micro_batch", "score_micro_batch", "share_prompts", "rollout_batch", "rollout_resident", "rollout_memory_share",
                 "env")

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
    forced_opt = o.get("optimizer")
    if forced_opt in ("adamw-bf16", "adamw-bf16-sr"):
        ok, why = bf16_state_support(device, bool(task.lora))
        if not ok and device.is_cuda:
            raise PlanError(f"plan.optimizer={forced_opt} is not possible: {why}; use adamw")
    base_dtype, base_reason = pick_base_dtype(device, dtype, o.get("base_dtype"))
    if base_dtype in QUANT_BASES and task.lora is False:
        raise PlanError(f"plan.base_dtype={base_dtype} quantizes a frozen base, which only LoRA has; set "
                        "lora.enabled=true (or leave it unset to let the plan decide)")
    rm_dtype, reasons["reward_model_dtype"] = (pick_reward_model_dtype(dtype) if task.reward_model_params
                                               else (None, "no reward model"))
    host = device.host_memory if not device.integrated else 0

    forced = {k: o.get(k) for k in ("grad_checkpointing", "swap_models", "optimizer_offload", "param_offload",
                                    "rollout_batch", "score_micro_batch", "micro_batch", "rollout_resident")}
    if device.integrated:  # host memory is the same memory: moving anything there frees nothing
        for k in ("param_offload", "optimizer_offload", "swap_models"):
            forced[k] = forced[k] or False
    lora_targets_, lora_params = (), 0
    if task.lora is not False:
        lora_targets_ = lora_targets(model.model_type, task.lora_targets)
        try:
            lora_params = model.lora_params(task.lora_rank, lora_targets_)
        except ModelSpecError as e:
            raise PlanError(f"lora.target_modules: {e}") from None

    # samples of a prompt whose forward passes may compute it once (the decision itself follows the search)
    share = 1 if share_blocker(attention, model, o.get("share_prompts")) else task.samples_per_prompt

    def setting(config: Candidate) -> Setting:
        quant = config.base if config.base in QUANT_BASES else None
        return Setting(
            compute_bytes=dtype.compute_bytes,
            base_bytes=(dtype.compute_bytes if quant else int(nbytes(config.base))) if config.lora
            else dtype.param_bytes,
            grad_checkpointing=False, swap_models=False, optimizer_offload=False, param_offload=False,
            micro_batch=1, score_micro_batch=1, rollout_batch=1, logprob_chunk=chunk, logit_bytes=per_logit,
            eager_attention=attention == "eager", lora_params=lora_params if config.lora else 0,
            critic=task.critic, reference=task.kl and not config.lora,
            reward_model_params=task.reward_model_params, cuda=device.is_cuda, shards=task.world_size,
            base_quant=quant, rollout_from_actor=quant is not None,
            lora_input_bytes=_lora_input_bytes(model, lora_targets_, dtype.compute_bytes) if config.lora else 0,
            prompt_share=share, update_share=share if task.local_mini == task.local_sequences else 1,
            # the static engine prefills a prompt once for its samples (a quantized base always runs it)
            prefill_share=task.samples_per_prompt if engine == "hf" or quant else 1,
            kv_window=engine == "hf-generate")

    attempts: list[tuple[Candidate, Optional[Found], list[str]]] = []
    for config in trained_and_base(device, task, base_dtype, bool(o.get("base_dtype"))):
        # bf16 weights only where the compute is bf16: plan.dtype=fp32 keeps fp32 weights
        bf16_ok = bf16_state_support(device, config.lora)[0] and dtype.compute == "bf16"
        stages = stages_for(forced_opt, bnb_ok, bf16_ok, config.param_offload, forced["rollout_resident"])
        base = setting(config)
        found, tried = search(model, task, base, budget, forced, calibration, host, stages,
                              micro_cost(device, model, task, base))
        attempts.append((config, found, tried))
        if found:
            break
    config, found, tried = attempts[-1]
    use_lora = config.lora
    if found is None:
        if not explain:
            raise PlanError("does not fit")
        raise PlanError(_no_fit_message(device, model, task, budget, attempts, o, calibration))

    s, mem = found.setting, found.memory
    _memory_reasons(reasons, found, task, device, attempts, model, lora_params, use_lora, lora_targets_, mem,
                    calibration)
    optimizer = s.optimizer
    reasons["optimizer"] = optimizer_reason(optimizer, forced_opt, device, s.param_offload, backend)
    if OPTIMIZERS[optimizer].param_dtype == "bf16":  # no fp32 master copy: the weights themselves are bf16
        dtype = BF16_PARAMS
        reasons["dtype"] = f"{reasons['dtype']}; {optimizer}: bf16 weights and AdamW state (no fp32 master copy)"
    base = config.base if use_lora else None
    if use_lora:
        reasons["base_dtype"] = base_reason if base == base_dtype else _quant_reason(device, base, attempts)
    else:
        reasons["base_dtype"] = f"not used: full fine-tuning keeps {dtype.param} master weights"
    if s.rollout_from_actor and engine != "hf":
        engine, graphs = "hf", device.is_cuda
        reasons["rollout_engine"] = ("hf: generates from the quantized base and the unmerged adapters themselves "
                                     "(merging adapters into 4-bit weights would be lossy and a second model)")
    # vLLM reads its share against the device's whole memory, not against a plan.memory_gib budget
    whole = device.total_memory
    share = min(1.0, mem.phase_totals()["rollout"] / whole) if whole else 0.0
    if "rollout_memory_share" in o:
        share = float(o["rollout_memory_share"])
        reasons["rollout_memory_share"] = f"asked for with plan.rollout_memory_share={share}"
    else:
        reasons["rollout_memory_share"] = rollout_share_reason(engine)
    layers_why = triton_layers_reason(device, dtype, model, engine, graphs, s.rollout_from_actor)
    compiled, reasons["rollout_compile"] = pick_rollout_compile(device, engine, graphs, s.rollout_from_actor,
                                                              o.get("rollout_compile"), layers_why,
                                                              o.get("decode_attention"))
    decode_attention, reasons["decode_attention"] = pick_decode_attention(device, dtype, model, engine,
                                                                          o.get("decode_attention"), compiled,
                                                                          layers_why)
    fused_nf4, reasons["nf4_kernel"] = pick_nf4_kernel(device, dtype, base, engine, o.get("nf4_kernel"))
    packed, reasons["share_prompts"] = pick_share_prompts(attention, model, task, s.micro_batch, s.score_micro_batch,
                                                          o.get("share_prompts"))
    env, reasons["env"] = pick_env(device)
    lora_info = None
    if use_lora:
        lora_info = {"rank": task.lora_rank, "alpha": task.lora_alpha, "targets": list(lora_targets_),
                     "params": lora_params}
    return Plan(device=device, model=model, task=task, dtype=dtype, attention=attention, rollout_engine=engine,
                cuda_graphs=graphs, rollout_compile=compiled, decode_attention=decode_attention,
                nf4_kernel=fused_nf4, share_prompts=packed, kernel_backend=backend,
                kernel_tiles=tiles, logprob_chunk=chunk,
                grad_checkpointing=s.grad_checkpointing, swap_models=s.swap_models,
                optimizer_offload=s.optimizer_offload, param_offload=s.param_offload, optimizer=optimizer,
                lora=lora_info, base_dtype=base, reward_model_dtype=rm_dtype,
                micro_batch=s.micro_batch, score_micro_batch=s.score_micro_batch,
                rollout_batch=s.rollout_batch, rollout_resident=s.rollout_resident,
                rollout_memory_share=round(share, 4), env=env,
                memory=mem, headroom=headroom, reasons=reasons | {"headroom": hreason})


def _quant_reason(device: Device, base: str, attempts: list) -> str:
    wider = attempts[-2][0].base if len(attempts) > 1 else "a float base"
    return (f"{base}: {quant_support(device, base)[1]}; LoRA on a {wider} base did not fit. The reference is the "
            "same base with the adapter disabled and the rollout runs on it too: one copy of the weights")


def _lora_input_bytes(model: ModelSpec, targets: tuple[str, ...], compute_bytes: int) -> int:
    """Per token and layer, what peft's fp32 adapters add to the saved activations beside a 16-bit base:
    each adapted layer's input is copied to fp32 and saved for the adapter's weight gradient (4 bytes an
    element), while the frozen base layer saves no input of its own, and the activation model counts one
    16-bit input per projection: the net is 4 - compute bytes an element. On an H200 (1.7B shape, bf16,
    16 x 320 tokens, no checkpointing) the update's peak measured 42 KB per token and layer above the
    model without this term; 4 bytes an element would be 82 KB, this net 41 KB. Zero in fp32."""
    shapes = model.module_shapes()
    return max(0, 4 - compute_bytes) * sum(shapes[t][0] for t in targets if t in shapes)


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


def _memory_reasons(reasons: dict[str, str], found: Found, task: Task, device: Device,
                    attempts: list, model: ModelSpec, lora_params: int, use_lora: bool,
                    targets: tuple[str, ...], mem: MemoryEstimate, cal: Calibration) -> None:
    s = found.setting
    budget = fmt_bytes(mem.budget)
    fits = f"estimate {fmt_bytes(mem.total)} (peak in {mem.peak_phase}) of a {budget} budget"
    first = found.stage in (STAGES[0].name, STAGES[1].name)
    micro = found.micro
    split = micro is not None and s.micro_batch < task.local_mini
    if s.grad_checkpointing:
        reasons["grad_checkpointing"] = f"on: without it the update does not fit with a useful micro-batch; {fits}"
    elif split:
        reasons["grad_checkpointing"] = (f"off: micro-batches of {s.micro_batch} cost less here than recomputing "
                                         f"the forward (~{STAGE_COST['grad_checkpointing']:.0%} of a step); {fits}")
    else:
        reasons["grad_checkpointing"] = f"not needed: {fits}"
    ref_bytes = model.n_params() * s.compute_bytes if s.reference else 0
    state_bytes = (lora_params or model.n_params()) * OPTIMIZERS[s.optimizer].state
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
    per_gpu = " per GPU" if task.world_size > 1 else ""
    if micro is not None:
        reasons["micro_batch"] = (f"{s.micro_batch} sequences per forward/backward{per_gpu}: each micro-step "
                                  f"beyond the first adds ~{micro.per_step:.1%} of a step on this card (launches"
                                  + (", dequantizing the base" if s.base_quant else "")
                                  + f" against fp32 matmuls at its {micro.tflops:g} TFLOP/s and "
                                  f"{micro.bandwidth_gbs:g} GB/s); the setting with the smallest estimated "
                                  f"slowdown that fits" + ("" if first else f": {found.stage}"))
    else:
        reasons["micro_batch"] = (f"{s.micro_batch} sequences per forward/backward: the largest divisor of the "
                                  f"mini-batch ({task.local_mini}{per_gpu}) that fits"
                                  + ("" if first else f" after {found.stage}"))
    kept = sum(mem.phases["update"].get(k, 0) for k in ("generation weights", "KV cache", "graph pool"))
    held = ("KV cache and CUDA graphs (the weights are the actor's own)" if s.rollout_from_actor
            else "weights, KV cache and CUDA graphs")
    reasons["rollout_resident"] = (
        f"on: the engine keeps its {held} between steps ({fmt_bytes(kept)} through scoring and the update), so "
        "no step re-captures or refills them" if s.rollout_resident else
        "off: the rollout copy and KV cache are freed after generating so that scoring and the update have the "
        "memory; each rollout captures its CUDA graphs again" if not s.rollout_from_actor else
        "off: the engine runs the actor's own weights; its KV cache is freed after generating")
    reasons["score_micro_batch"] = f"{s.score_micro_batch} sequences per no-grad log-prob pass"
    reasons["rollout_batch"] = (f"{s.rollout_batch} of {task.local_sequences} sequences generated at once "
                                f"(KV cache {fmt_bytes(mem.phases['rollout'].get('KV cache', 0))})")
    if use_lora:
        full_tried = attempts[0][2][-1] if attempts[0][2] and not attempts[0][0].lora else ""
        why = ("asked for" if task.lora else f"full fine-tuning does not fit without streaming every weight "
               f"over PCIe (most frugal on-GPU setting: {full_tried})")
        # the same setting with every weight trained, an fp32 master copy and a separate reference
        full = estimate(model, replace(s, lora_params=0, base_bytes=4, reference=task.kl, base_quant=None,
                                       rollout_from_actor=False), task.prompt_len, task.response_len, mem.budget, cal)
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
    _, _, tried = attempts[-1]
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
    if task.lora is not False and not device.software.has("bitsandbytes") and device.is_cuda and not o.get("base_dtype"):
        libs = device.software.libs + (("bitsandbytes", "0.50"),)
        with_bnb = replace(device, software=replace(device.software, libs=libs))
        if quant_support(with_bnb, "nf4")[0] and fits_on(with_bnb, model, replace(task, lora=True), o, cal):
            lines.append("  - a 4-bit (NF4) frozen base with LoRA, once bitsandbytes is installed: pip install "
                         "bitsandbytes, then --set lora.enabled=true (the plan picks NF4 when a float base does "
                         "not fit)")
            found_any = True
    if device.is_cuda:
        from edgerl.device.profiles import device_from_profile, list_profiles
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
