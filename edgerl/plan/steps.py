"""The plan's steps: one function per decision of the table (`plan/table.py`), each `step(c) -> (value,
reason)`, and the facts several steps share (`@fact`: computed once per plan), such as the compute
dtype and the memory search.

A step reads the decisions it depends on as `c["name"]`: the plan makes each decision once, on first
use. So a decision that depends on the memory search is made after it, with the search's result in
hand and one reason: the weights' dtype under a bf16 optimizer (the `dtype` step reads `optimizer`),
the engine over a quantized base (the `rollout_engine` step reads the search's base). The search itself
reads what it needs before it (the compute dtype, the attention, the log-prob kernel, the budget).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from edgerl.core.errors import ModelSpecError, PlanError
from edgerl.device.device import GiB
from edgerl.plan.decisions import (BF16_PARAMS, QUANT_BASES, DtypePolicy, activation_offload_reason,
                                   bf16_state_support, bnb_support, pick_attention_chunk, choose_logprob_chunk,
                                   compute, device_dtype, fact, logit_bytes, lora_targets, optimizer_reason,
                                   pick_attention, pick_base_dtype, pick_env, pick_headroom, pick_kernels,
                                   pick_reward_model_dtype, pick_share_prompts, quant_support, share_blocker,
                                   transfer_note)
from edgerl.plan.engines import engine_choice, fp16_cache_backend, rollout_share_reason
from edgerl.plan.dtypes import nbytes
from edgerl.plan.fp16 import check
from edgerl.plan.memory import OPTIMIZERS, MemoryEstimate, Setting, estimate, fmt_bytes
from edgerl.plan.ctx import NoFit
from edgerl.plan import timing
from edgerl.plan.timing import fmt_s
from edgerl.plan.moves import STAGE_COST, STAGES, stages_for
from edgerl.plan.search import TIMED_MARGIN, Candidate, Found, micro_cost, search, trained_and_base

if TYPE_CHECKING:
    from edgerl.plan.ctx import Ctx

Step = Callable[["Ctx"], tuple[Any, str]]


# --- facts (`compute`, the compute dtype, is decisions.py's; `engine_choice`, engines.py's) --------------


@fact
def kernels(c: "Ctx") -> tuple[str, Optional[dict[str, Any]], str]:
    return pick_kernels(c.device, compute(c)[0], c.model, c.forced("kernel_backend"))


@fact
def attention_rows(c: "Ctx") -> tuple[int, bool, str]:
    """(query rows per attention chunk in training, 0: one fused call; K/V repeated for SDPA's kernel; reason)."""
    return pick_attention_chunk(c.device, compute(c)[0], c["attention"], c.model, c.forced("attention_chunk"))


@fact
def budget(c: "Ctx") -> int:
    return c["memory_limit"] - c["headroom"]


@fact
def optimizers(c: "Ctx") -> bool:
    """Whether 8-bit AdamW may be tried; refuses a forced optimizer this device cannot run."""
    dev, forced = c.device, c.forced("optimizer")
    ok, why = bnb_support(dev)
    if ok and c.task.world_size > 1:
        # its quantized state is per shard, which a checkpoint of N processes cannot gather and re-split
        ok, why = False, (f"8-bit AdamW keeps its state per shard, which edgerl cannot checkpoint across "
                          f"{c.task.world_size} processes")
    if forced == "adamw8bit" and not ok:
        raise PlanError(f"plan.optimizer=adamw8bit is not possible on {dev.describe()}: {why}; use adamw")
    if forced in ("adamw-bf16", "adamw-bf16-sr"):
        fits, why = bf16_state_support(dev, bool(c.task.lora))
        if not fits and dev.is_cuda:
            raise PlanError(f"plan.optimizer={forced} is not possible: {why}; use adamw")
    return ok


@fact
def base_choice(c: "Ctx") -> tuple[str, str]:
    """The frozen LoRA base's storage before the search (which may go down to a quantized one)."""
    base, reason = pick_base_dtype(c.device, compute(c)[0], c.forced("base_dtype"))
    if base in QUANT_BASES and c.task.lora is False:
        raise PlanError(f"plan.base_dtype={base} quantizes a frozen base, which only LoRA has; set "
                        "lora.enabled=true (or leave it unset to let the plan decide)")
    return base, reason


@fact
def lora_shape(c: "Ctx") -> tuple[tuple[str, ...], int]:
    """(adapted modules, trainable adapter parameters) where LoRA may be used."""
    if c.task.lora is False:
        return (), 0
    targets = lora_targets(c.model.model_type, c.task.lora_targets)
    try:
        return targets, c.model.lora_params(c.task.lora_rank, targets)
    except ModelSpecError as e:
        raise PlanError(f"lora.target_modules: {e}") from None


@fact
def searched(c: "Ctx") -> tuple[Candidate, Found, list]:
    """The memory search: what is trained and how the base is stored (outer loop), then the fastest
    setting of the memory knobs that fits the budget. (candidate, found, every attempt)."""
    dev, model, task = c.device, c.model, c.task
    dtype = compute(c)[0]
    attention = c["attention"]
    engine = engine_choice(c)[0]
    kernel_backend = c["kernel_backend"]
    limit = budget(c)
    chunk, per_logit = c["logprob_chunk"], logit_bytes(kernel_backend, dtype)
    bnb_ok = optimizers(c)
    base_dtype = base_choice(c)[0]
    targets, lora_params = lora_shape(c)
    forced = {k: c.forced(k) for k in ("grad_checkpointing", "swap_models", "optimizer_offload", "param_offload",
                                       "rollout_batch", "score_micro_batch", "micro_batch", "rollout_resident",
                                       "activation_offload")}
    if dev.integrated:  # host memory is the same memory: moving anything there frees nothing
        for k in ("param_offload", "optimizer_offload", "swap_models"):
            forced[k] = forced[k] or False
    if dev.integrated or not dev.is_cuda:   # pinned host memory is the same memory (or there is no GPU)
        if forced["activation_offload"]:
            raise PlanError("plan.activation_offload=true moves activations from the GPU to host memory; here "
                            + ("the GPU's memory is the host's" if dev.is_cuda else "there is no GPU")
                            + ": use plan.activation_offload=false")
        forced["activation_offload"] = False
    chunk_rows, kv_copies, _ = attention_rows(c)
    expandable = any(k == "PYTORCH_CUDA_ALLOC_CONF" and "expandable_segments:True" in v for k, v in c["env"])
    # samples of a prompt whose forward passes may compute it once (the decision itself follows the search)
    share = 1 if share_blocker(attention, model, c.forced("share_prompts"), task) else task.samples_per_prompt

    def cache_dtype(cand: Candidate) -> str:
        """The KV cache's storage for this candidate (a quantized base always runs the static engine)."""
        return kv_rule(c, "static" if cand.base in QUANT_BASES else engine)[0]

    def setting(cand: Candidate) -> Setting:
        quant = cand.base if cand.base in QUANT_BASES else None
        kv_bytes = int(nbytes(cache_dtype(cand)))
        return Setting(
            compute_bytes=dtype.compute_bytes,
            base_bytes=(dtype.compute_bytes if quant else int(nbytes(cand.base))) if cand.lora else dtype.param_bytes,
            grad_checkpointing=False, swap_models=False, optimizer_offload=False, param_offload=False,
            micro_batch=1, score_micro_batch=1, rollout_batch=1, logprob_chunk=chunk, logit_bytes=per_logit,
            mini_batch=task.local_mini,
            eager_attention=attention == "eager", lora_params=lora_params if cand.lora else 0,
            critic=task.critic, reference=task.kl and not cand.lora,
            reward_model_params=task.reward_model_params, cuda=dev.is_cuda, shards=task.world_size,
            base_quant=quant, rollout_from_actor=quant is not None,
            lora_input_bytes=lora_input_bytes(model, targets, dtype.compute_bytes) if cand.lora else 0,
            # cuda-c stacks LoRA q/k/v and gate/up over an NF4 base (fp32 or fp16) or an fp32 one under fp32
            stacked_adapters=stacked_adapter_bytes(model, targets, task.lora_rank, quant) if cand.lora and dev.is_cuda
            and ((quant == "nf4" and dtype.compute in ("fp32", "fp16"))
                 or (quant is None and dtype.compute == "fp32" and nbytes(cand.base) == 4)) else 0,
            prompt_share=share, update_share=share if task.local_mini == task.local_sequences else 1,
            # the static engine prefills a prompt once for its samples (a quantized base always runs it)
            prefill_share=task.samples_per_prompt if engine == "static" or quant else 1,
            attention_chunk=chunk_rows, kv_copies=kv_copies, expandable_segments=expandable,
            head_trains=not cand.lora, logprob_upcast=kernel_backend == "torch",
            # transformers' generate keeps only the window of sliding-window layers (the static engine every column)
            kv_window=engine == "hf-generate" and not quant, sft=task.sft, kv_bytes=kv_bytes,
            # an episode's rows align at the longest on the static engine: its cache holds one turn more
            kv_extra=task.turn_len if engine == "static" or quant else 0,
            episode_turn=task.turn_len, episode_reprefill=task.episodes and engine == "hf-generate" and not quant)

    host = dev.host_memory if not dev.integrated else 0
    rates = timing.rates(timing.with_rates(dev), dtype.compute)

    def timer(cand: Candidate) -> Optional[Callable[[Setting], float]]:
        """A setting's estimated seconds per step on this card (plan/timing.py), None where its rates are unknown:
        then the search takes the fixed order of moves.STAGE_COST."""
        if rates is None:
            return None
        fixed = {"dtype": dtype, "rollout_engine": engine, "base_dtype": cand.base if cand.lora else None,
                 "lora": {"params": lora_params} if cand.lora else None,
                 "kv_cache_dtype": cache_dtype(cand)}

        def seconds(s: Setting) -> float:
            v = dict(fixed, rollout_batch=s.rollout_batch, micro_batch=s.micro_batch, optimizer=s.optimizer,
                     **{k: getattr(s, k) for k in STAGES[0].knobs()})
            return sum(timing.phases(model, task, v, rates))
        return seconds

    attempts: list[tuple[Candidate, Optional[Found], list[str]]] = []
    for cand in trained_and_base(dev, task, base_dtype, bool(c.forced("base_dtype"))):
        # bf16 weights only where the compute is bf16: plan.dtype=fp32 keeps fp32 weights
        bf16_ok = bf16_state_support(dev, cand.lora)[0] and dtype.compute == "bf16"
        stages = stages_for(c.forced("optimizer"), bnb_ok, bf16_ok, cand.param_offload, forced["rollout_resident"],
                            forced["activation_offload"])
        base = setting(cand)
        found, tried = search(model, task, base, limit, forced, c.calibration, host, stages,
                              micro_cost(dev, model, task, base), timer(cand))
        attempts.append((cand, found, tried))
        if found:
            return cand, found, attempts
    raise NoFit(limit, attempts)   # plan() says what would fit


def setting(c: "Ctx") -> Setting:
    return searched(c)[1].setting


def memory(c: "Ctx") -> MemoryEstimate:
    return searched(c)[1].memory


def lora_input_bytes(model, targets: tuple[str, ...], compute_bytes: int) -> int:
    """Per token and layer, what peft's fp32 adapters add to the saved activations beside a 16-bit base:
    each adapted layer's input is copied to fp32 and saved for the adapter's weight gradient (4 bytes an
    element), while the frozen base layer saves no input of its own, and the activation model counts one
    16-bit input per projection: the net is 4 - compute bytes an element. On an H200 (1.7B shape, bf16,
    16 x 320 tokens, no checkpointing) the update's peak measured 42 KB per token and layer above the
    model without this term; 4 bytes an element would be 82 KB, this net 41 KB. Zero in fp32."""
    shapes = model.module_shapes()
    return max(0, 4 - compute_bytes) * sum(shapes[t][0] for t in targets if t in shapes)


def stacked_adapter_bytes(model, targets: tuple[str, ...], rank: int, quant: Optional[str]) -> int:
    """What the decode step's LoRA groups (edgerl/rollout/lora_group.py: q/k/v and gate/up as one product each,
    under the cuda-c decode backend) hold beside the model: those layers' rank-`rank` adapters again in fp32 (A and
    B), and over an NF4 base an fp32 offset per nested block (256 blocks of 64 weights) of their weights."""
    shapes = model.module_shapes()
    grouped = [t for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
               if all(t in targets and t in shapes for t in group) for t in group]
    adapters = model.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in grouped) * 4
    offsets = model.num_layers * sum(shapes[t][0] * shapes[t][1] for t in grouped) // 16384 * 4 if quant == "nf4" else 0
    return adapters + offsets


def fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


@fact
def memory_reasons(c: "Ctx") -> dict[str, str]:
    """Why the search's setting is what it is, for each memory knob."""
    cand, found, attempts = searched(c)
    task, device, model = c.task, c.device, c.model
    s, mem = found.setting, found.memory
    targets, lora_params = lora_shape(c)
    reasons: dict[str, str] = {}
    fits = f"estimate {fmt_bytes(mem.total)} (peak in {mem.peak_phase}) of a {fmt_bytes(mem.budget)} budget"
    first = found.stage in (STAGES[0].name, STAGES[1].name)
    micro = found.micro
    split = micro is not None and s.micro_batch < task.local_mini
    if found.timed is not None and found.timed.taken:
        reasons["grad_checkpointing"] = (("on" if s.grad_checkpointing else "off") + ": part of the fastest setting "
                                         f"that fits by the step time estimate (see micro_batch); {fits}")
    elif s.grad_checkpointing:
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
                              "on, and nothing moves: the reference is the base with the adapter disabled, "
                              "which the actor holds" if s.lora_params else
                              "the reference model moves to host memory outside the scoring phase"
                              + transfer_note(device, ref_bytes))
    reasons["optimizer_offload"] = (f"optimizer state stays {where}" if not s.optimizer_offload else
                                    "optimizer state waits in host memory between updates and comes back "
                                    "for the optimizer step only" + transfer_note(device, state_bytes))
    reasons["param_offload"] = (f"weights stay {where}" if not s.param_offload else
                                f"FSDP2 CPUOffloadPolicy: host RAM holds {fmt_bytes(mem.host_needed)}; "
                                "layers stream over PCIe (slow, but it fits)" + transfer_note(device, mem.host_needed))
    per_gpu = " per GPU" if task.world_size > 1 else ""
    timed = found.timed
    if timed is not None and timed.taken:
        (fs, fmb, fw), (_, _, w) = timed.first, timed.fastest
        reasons["micro_batch"] = (f"{s.micro_batch} sequences per forward/backward{per_gpu}: the fastest setting that "
                                  f"fits by the step time estimate ({fmt_s(w)} a step, weighed with its optimizer's "
                                  f"precision cost): {found.stage}; the fixed order's first fit ({fs}, micro-batch "
                                  f"{fmb}) is {fmt_s(fw)}; a setting replaces it where it is estimated over "
                                  f"{TIMED_MARGIN:.0%} faster, or makes fewer memory moves at no more time (micro-batches "
                                  "below the first fit's are not weighed)")
    elif micro is not None:
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
    if timed is not None and not timed.taken:
        (fs, fmb, fw), (qs, qmb, qw) = timed.first, timed.fastest
        reasons["micro_batch"] += (f"; estimated {fmt_s(fw)} a step, and no setting that fits with a micro-batch as "
                                   "large is estimated faster"
                                   if (qs, qmb) == (fs, fmb) else
                                   f"; estimated {fmt_s(fw)} a step: the fastest estimate that fits with a micro-batch "
                                   f"as large ({qs}, micro-batch "
                                   f"{qmb}: {fmt_s(qw)}) is not over {TIMED_MARGIN:.0%} faster, too little to leave the "
                                   f"fixed order")
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
                                f"(KV cache {fmt_bytes(mem.phases.get('rollout', {}).get('KV cache', 0))})")
    if cand.lora:
        full_tried = attempts[0][2][-1] if attempts[0][2] and not attempts[0][0].lora else ""
        why = ("asked for" if task.lora else f"full fine-tuning does not fit without streaming every weight "
               f"over PCIe (most frugal on-GPU setting: {full_tried})")
        # the same setting with every weight trained, an fp32 master copy and a separate reference
        full = estimate(model, replace(s, lora_params=0, base_bytes=4, reference=task.kl, base_quant=None,
                                       rollout_from_actor=False), task.prompt_len, task.response_len, mem.budget,
                        c.calibration)
        reasons["lora"] = (f"LoRA r={task.lora_rank} on {', '.join(targets)}: {fmt_count(lora_params)} trainable "
                           f"parameters ({lora_params / model.n_params():.2%} of {fmt_count(model.n_params())}); "
                           f"saves {fmt_bytes(full.total - mem.total)} at this setting ({fmt_bytes(full.total)} "
                           f"-> {fmt_bytes(mem.total)}): no gradients or optimizer state for the frozen base, and "
                           f"the reference is the base with the adapter disabled; {why}")
    else:
        reasons["lora"] = "full fine-tuning fits" if task.lora is None else "full fine-tuning (lora.enabled=false)"
    return reasons


def searched_knob(name: str) -> Step:
    """The step of a memory knob the search sets: its value in the search's setting, and why."""
    def step(c: "Ctx") -> tuple[Any, str]:
        return getattr(setting(c), name), memory_reasons(c)[name]
    step.__name__ = name
    return step


# --- steps ---------------------------------------------------------------------------------------

def dtype(c: "Ctx") -> tuple[DtypePolicy, str]:
    """The compute dtype, and the weights' dtype: fp32 masters, or bf16 where the optimizer keeps none."""
    policy, reason = compute(c)
    opt = c["optimizer"]
    if OPTIMIZERS[opt].param_dtype == "bf16":
        return BF16_PARAMS, f"{reason}; {opt}: bf16 weights and AdamW state (no fp32 master copy)"
    return policy, reason


def fp16_check(c: "Ctx") -> tuple[Optional[str], str]:
    """What `edgerl train` does about fp16 overflow: calibrate the weights at start, read the cached
    calibration, or nothing (no fp16 asked for)."""
    return check(c.model.model_type, c.model.activations, device_dtype(c)[0].compute, compute(c)[0].compute)


def attention(c: "Ctx") -> tuple[str, str]:
    return pick_attention(c.device, compute(c)[0], c.forced("attention"))


def attention_chunk(c: "Ctx") -> tuple[int, str]:
    rows, _, reason = attention_rows(c)
    return rows, reason


def activation_offload(c: "Ctx") -> tuple[bool, str]:
    s = setting(c)
    return s.activation_offload, activation_offload_reason(c.device, s.activation_offload, s.grad_checkpointing,
                                                           memory(c).host_needed, c.forced("activation_offload"))


def micro_batch_tokens(c: "Ctx") -> tuple[int, str]:
    task, mb = c.task, setting(c).micro_batch
    return mb * (task.prompt_len + task.response_len), (
        f"{mb} x ({task.prompt_len} + {task.response_len}) tokens: micro-batches are cut by tokens, so rows whose "
        "responses ended early (EOS) share a micro-batch with more rows; each is trimmed to its longest response")


def kernel_backend(c: "Ctx") -> tuple[str, str]:
    backend, _, reason = kernels(c)
    return backend, reason


def kernel_tiles(c: "Ctx") -> tuple[Optional[dict[str, Any]], str]:
    _, tiles, reason = kernels(c)
    return tiles, reason if tiles else "no Triton kernel on this device"


def logprob_chunk(c: "Ctx") -> tuple[int, str]:
    per_logit = logit_bytes(c["kernel_backend"], compute(c)[0])
    chunk = choose_logprob_chunk(c.model, budget(c), per_logit)
    v = c.model.vocab_size
    return chunk, (f"{chunk} tokens per chunk: the kernel holds {fmt_bytes(chunk * v * per_logit)} of logits at a "
                   f"time instead of tokens x {v} for the whole batch")


def optimizer(c: "Ctx") -> tuple[str, str]:
    name = setting(c).optimizer
    return name, optimizer_reason(name, c.forced("optimizer"), c.device, setting(c).param_offload,
                                  c["kernel_backend"])


def lora(c: "Ctx") -> tuple[Optional[dict[str, Any]], str]:
    cand = searched(c)[0]
    reason = memory_reasons(c)["lora"]
    if not cand.lora:
        return None, reason
    targets, params = lora_shape(c)
    return {"rank": c.task.lora_rank, "alpha": c.task.lora_alpha, "targets": list(targets), "params": params}, reason


def base_dtype(c: "Ctx") -> tuple[Optional[str], str]:
    cand, _, attempts = searched(c)
    if not cand.lora:
        return None, f"not used: full fine-tuning keeps {c['dtype'].param} master weights"
    chosen, reason = base_choice(c)
    if cand.base == chosen:
        return cand.base, reason
    wider = attempts[-2][0].base if len(attempts) > 1 else "a float base"
    return cand.base, (f"{cand.base}: {quant_support(c.device, cand.base)[1]}; LoRA on a {wider} base did not fit. "
                       "The reference is the same base with the adapter disabled and the rollout runs on it too: "
                       "one copy of the weights")


def reward_model_dtype(c: "Ctx") -> tuple[Optional[str], str]:
    if not c.task.reward_model_params:
        return None, "no reward model"
    return pick_reward_model_dtype(compute(c)[0])


def share_prompts(c: "Ctx") -> tuple[bool, str]:
    s = setting(c)
    return pick_share_prompts(c["attention"], c.model, c.task, s.micro_batch, s.score_micro_batch,
                              c.forced("share_prompts"))


def rollout_memory_share(c: "Ctx") -> tuple[float, str]:
    forced = c.forced("rollout_memory_share")
    if forced is not None:
        return float(forced), f"asked for with plan.rollout_memory_share={float(forced)}"
    # vLLM reads its share against the device's whole memory, not against a plan.memory_gib budget
    whole = c.device.total_memory
    share = min(1.0, memory(c).phase_totals().get("rollout", 0) / whole) if whole else 0.0
    return round(share, 4), rollout_share_reason(c["rollout_engine"])


# engines that report the log-prob of each token they sample (RolloutBatch.logprobs): the rollout correction
# weighs the trainer's log-probs against these
SAMPLED_LOGPROBS = ("static", "vllm")


def numerics_gap(c: "Ctx") -> str:
    """How the rollout engine's arithmetic differs from the trainer's (torch's ops over whole sequences), or ''
    where the engine decodes in fp32 through torch's ops too."""
    engine, compute_dtype, backend = c["rollout_engine"], c["dtype"].compute, c["decode_backend"]
    if engine == "vllm":
        return f"vLLM samples in {compute_dtype} with its own kernels"
    kv = c["kv_cache_dtype"]
    how = ([f"in {compute_dtype}"] if compute_dtype != "fp32" else []) + \
        ([f"through edgerl's {backend} kernels"] if backend not in (None, "torch") else []) + \
        ([f"over a KV cache stored in {kv}"] if kv and kv != compute_dtype else [])
    return f"the engine decodes {' '.join(how)}" if how else ""


def kv_cache_dtype(c: "Ctx") -> tuple[Optional[str], str]:
    """The static engine's KV cache storage: fp16 under fp32 compute where the decode backend is cuda-c (its
    kernels widen each value to fp32 as they read it), else the compute dtype; None for an engine with its own."""
    engine = c["rollout_engine"]
    kv, why = kv_rule(c, engine)
    if engine != "static":
        return None, why
    final, backend, forced = c["dtype"].compute, c["decode_backend"], c.forced("kv_cache_dtype")
    if kv == "fp16" and final == "fp32":
        if backend != "cuda-c":   # kv_rule reads the backend's choice ahead of it: they must agree
            raise PlanError(f"a KV cache in fp16 under fp32 compute needs decode backend cuda-c, and this plan's is "
                            f"{backend}: set plan.kv_cache_dtype=fp32")
        return kv, why
    if forced and forced != final:   # the optimizer's bf16 weights made the compute bf16 after kv_rule asked
        raise PlanError(f"plan.kv_cache_dtype={forced}: this plan computes in {final} (plan.optimizer="
                        f"{c['optimizer']} keeps bf16 weights), and the static engine stores its cache in the compute "
                        f"dtype; set plan.kv_cache_dtype={final} or leave it unset")
    return final, why if kv == final else f"the compute dtype ({final})"


def kv_rule(c: "Ctx", engine: str) -> tuple[str, str]:
    """(the KV cache's storage, why) for `engine`: the memory search asks it per candidate, before the engine and
    the decode backend are decided (the engine is static over a quantized base)."""
    dt = compute(c)[0].compute
    forced = c.forced("kv_cache_dtype")
    if engine != "static":
        if forced and forced != dt:
            raise PlanError(f"plan.kv_cache_dtype={forced} is the static engine's, and the plan runs the {engine} "
                            f"engine, which keeps its cache in {dt}; leave plan.kv_cache_dtype unset or set "
                            "plan.rollout_engine=static")
        return dt, f"the {engine} engine keeps its own cache"
    narrow = dt == "fp32" and fp16_cache_backend(c)
    if forced in (None, "fp16") and narrow:
        return "fp16", (f"{'asked for with plan.kv_cache_dtype=fp16' if forced else 'fp16 under fp32 compute'}: "
                        "half the bytes a long decode step reads (at 8K tokens the cache is most of them); decode "
                        "backend cuda-c widens each value to fp32 and computes in fp32, and a key or value past "
                        "fp16's range (65504) stops the rollout with a message naming plan.kv_cache_dtype=fp32")
    if forced not in (None, dt):
        raise PlanError(f"plan.kv_cache_dtype={forced}: the static engine stores its KV cache in the compute dtype "
                        f"({dt}), or in fp16 under fp32 compute where the decode backend is cuda-c (a CUDA GPU, "
                        f"plan.decode_backend unset or cuda-c); set plan.kv_cache_dtype={dt} or leave it unset")
    if forced:
        return dt, f"asked for with plan.kv_cache_dtype={dt}: the compute dtype"
    return dt, f"the compute dtype ({dt})" + (": only decode backend cuda-c reads an fp16 cache under fp32"
                                              if dt == "fp32" else "")


def rollout_correction(c: "Ctx") -> tuple[str, str]:
    """`algo.rollout_correction` (the task's): the user's setting, else tis wherever the rollout engine's
    numerics differ from the trainer's; none where the engine reports no sampled log-probs."""
    task, engine = c.task, c["rollout_engine"]
    asked, level, cap = task.rollout_correction, task.rollout_correction_level, task.rollout_correction_threshold
    how = {"tis": f"each {level}'s ratio pi_trainer / pi_rollout, capped at {cap:g}, weighs its policy loss",
           "mis": f"each {level}'s ratio pi_trainer / pi_rollout weighs its policy loss, 0 outside [1/{cap:g}, "
                  f"{cap:g}]"}
    if engine not in SAMPLED_LOGPROBS:
        if asked in how:
            raise PlanError(f"algo.rollout_correction={asked} weighs the trainer's log-probs against the rollout "
                            f"engine's, and the {engine} engine does not report the log-probs of the tokens it "
                            f"samples; use plan.rollout_engine={SAMPLED_LOGPROBS[0]} or algo.rollout_correction=none")
        return "none", (f"{'asked for with algo.rollout_correction=none' if asked else 'off'}: the {engine} engine "
                        "does not report the log-probs of the tokens it samples, so there is nothing to weigh")
    gap = numerics_gap(c)
    if asked is not None:
        return asked, (f"asked for with algo.rollout_correction={asked}" + (f": {how[asked]}" if asked in how else "")
                       + f" ({gap or 'the engine decodes in fp32 through torch ops, as the trainer computes'})")
    if gap:
        return "tis", (f"{gap}, the trainer scores whole sequences with torch's ops: the samples come from a "
                       f"slightly different policy; truncated importance sampling, {how['tis']}")
    return "none", ("off: the engine decodes in fp32 through torch's ops, as the trainer computes "
                    "(rollout/k3_kl logs the remaining gap)")


def env(c: "Ctx") -> tuple[tuple[tuple[str, str], ...], str]:
    return pick_env(c.device)


def memory_limit(c: "Ctx") -> tuple[int, str]:
    forced = c.forced("memory_limit")
    if forced is not None:
        return int(forced * GiB), (f"asked for with plan.memory_gib={forced:g}"
                                   + (": the run caps torch's allocator at it" if c.device.is_cuda else ""))
    return c.device.total_memory, ("the device's memory" if c.device.is_cuda else "the host's RAM")


def headroom(c: "Ctx") -> tuple[int, str]:
    return pick_headroom(c.device, c["memory_limit"], c.forced("headroom"))
