"""The self-test's model checks: a small random model of the target's architecture, run the way training
runs it under the plan (`edgerl doctor --selftest`).

- the rollout engine the plan chose, its decode step captured in a CUDA graph where the plan says so,
  generates greedily; its tokens and log-probs are checked against HF's forward over the same tokens;
- two training steps on the plan's path (its log-prob kernel, optimizer, precision, LoRA and base
  storage, FSDP2 as training wraps it) against the same two steps on the plan's reference path (every
  logit in fp32 through plain torch, the optimizer's eager torch step): the loss and the gradients;
- the decode step's and the training step's time, and the memory each took against the plan's memory
  model for this small model at the same settings.

The model keeps the target's head size, query heads per KV head, q/k/v bias, activation and tied
embeddings, with two KV heads, two layers and a vocabulary of 4096: the kernels see the shapes they
see in training, in seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from edgerl.doctor.verdict import Verdict, within
from edgerl.plan.memory import Setting, estimate, fmt_bytes
from edgerl.plan.modelspec import ModelSpec
from edgerl.plan.plan import Plan

PROMPT, RESPONSE, ROWS = 24, 24, 8   # tokens per prompt and response, sequences: a decode step of 8 rows
VOCAB, LAYERS, KV = 4096, 2, 2
# Largest |log-prob difference| between the engine and HF's forward over the same tokens (max, mean), and
# the top-2 logit gap below which the two may pick different tokens: fp32 agrees to rounding; 16 bits rounds
# the decode step's ops where HF's SDPA forward keeps fp32 (tests/test_rollout_cuda.py's bounds for fp16), and
# bf16 keeps 3 bits fewer than fp16: 8 times the rounding (an H200 run at the Qwen2.5-7B head layout over an
# NF4 base measured mean differences of 0.005 in fp16 and 0.035 in bf16).
ENGINE_TOL = {"fp32": (1e-3, 1e-4, 2e-3), "fp16": (0.15, 0.03, 0.3), "bf16": (0.3, 0.08, 0.6)}
# The two training steps' loss (relative) and gradients (relative norm over all trainable parameters)
# against the reference path: the same model in the same precision, the log-probs' fp32 sums in another order.
TRAIN_TOL = {"fp32": (1e-5, 1e-4), "fp16": (2e-3, 2e-2), "bf16": (5e-3, 5e-2)}
# After the first update the paths' optimizers may round differently by design: the bf16 step draws its random
# bits otherwise in the fused kernel than in the eager step, and 8-bit AdamW's quantized state turns the first
# step's last-bit differences into a step of its 256 levels. The second step's gradients then differ by more
# (an H200 run: 0.066 with stochastic rounding in bf16, 1.2e-4 with 8-bit state in fp32); the kernels
# themselves are checked exactly on their own.
STEP2_GRADIENTS = {"adamw-bf16-sr": 4.0, "adamw-bf16": 4.0, "adamw8bit": 10.0}
# measured <= estimate x 1.25 + 128 MiB: the memory model holds here. The fixed part is the libraries'
# workspaces the memory model leaves to the headroom: cuBLAS keeps one per stream it runs on (32 MiB on
# Hopper), and the engine captures its graph on a stream of its own; on an H200 the small model's decode step
# measured 74-106 MiB against estimates of 8-20 MiB.
MEMORY_SLACK = 1.25, 128 * 2**20


def small_spec(m: ModelSpec) -> ModelSpec:
    """The target's architecture at a small size: its head size, group, bias, activation, tie."""
    group = m.num_heads // m.num_kv_heads
    hidden = KV * group * m.hd
    return dataclasses.replace(m, name=f"{m.model_type} {LAYERS}x{hidden} (self-test)", vocab_size=VOCAB,
                               hidden_size=hidden, num_layers=LAYERS, num_heads=KV * group, num_kv_heads=KV,
                               intermediate_size=-(-2 * hidden // 64) * 64, head_dim=m.hd, max_position=256,
                               rope_type="default", sliding_window=None, source="self-test")


def save_small_model(spec: ModelSpec, folder: Path) -> Path:
    """A random HF model of `spec` saved in `folder` (fp32); norm weights moved off 1 so a wrong use shows."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(spec.model_type, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                               num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                               num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.intermediate_size,
                               head_dim=spec.hd, tie_word_embeddings=spec.tie_embeddings, hidden_act=spec.hidden_act,
                               max_position_embeddings=spec.max_position, initializer_range=0.05,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0, use_sliding_window=False)
    if hasattr(cfg, "attention_bias"):   # where the architecture's config says it (its q/k/v biases)
        cfg.attention_bias = spec.qkv_bias
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return folder


def small_plan(plan: Plan, spec: ModelSpec) -> Plan:
    """The plan's decisions on the small model, with a batch of ROWS sequences everywhere."""
    lora = None
    if plan.lora:
        lora = dict(plan.lora, params=spec.lora_params(plan.lora["rank"], plan.lora["targets"]))
    task = dataclasses.replace(plan.task, prompt_len=PROMPT, response_len=RESPONSE, prompts_per_step=ROWS,
                               samples_per_prompt=1, mini_batch=None)
    values = dict(plan.values, lora=lora, rollout_batch=ROWS, micro_batch=ROWS, score_micro_batch=ROWS,
                  share_prompts=False, param_offload=False, optimizer_offload=False, swap_models=False)
    if "micro_batch_tokens" in values:
        values["micro_batch_tokens"] = ROWS * (PROMPT + RESPONSE)
    return dataclasses.replace(plan, model=spec, task=task, values=values)


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [PROMPT - (3 * i) % 11 for i in range(ROWS)]   # left padding: rows of different lengths
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


@contextlib.contextmanager
def peak_memory(device: torch.device, out: dict):
    """out['bytes']: the allocator's peak above what was allocated on entry (CUDA; nothing elsewhere)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    torch.cuda.synchronize(device)
    out["bytes"] = torch.cuda.max_memory_allocated(device) - base


def memory_estimate(plan: Plan, phase: str, parts: tuple[str, ...]) -> int:
    """The plan's memory model for this (small) plan: the named components of one phase, with their share of
    the fragmentation allowance."""
    from edgerl.plan.decisions import logit_bytes
    from edgerl.models.load import quantized_base
    q = quantized_base(plan)
    m, t = plan.model, plan.task
    s = Setting(compute_bytes=plan.dtype.compute_bytes,
                base_bytes=(plan.dtype.compute_bytes if q else _bytes(plan.base_dtype)) if plan.lora
                else plan.dtype.param_bytes,
                grad_checkpointing=plan.grad_checkpointing, swap_models=False, optimizer_offload=False,
                param_offload=False, micro_batch=ROWS, score_micro_batch=ROWS, rollout_batch=ROWS,
                logprob_chunk=plan.logprob_chunk, logit_bytes=logit_bytes(plan.kernel_backend, plan.dtype),
                eager_attention=plan.attention == "eager", optimizer=plan.optimizer,
                lora_params=plan.lora["params"] if plan.lora else 0, cuda=True, base_quant=q,
                rollout_from_actor=q is not None)
    comps = estimate(m, s, t.prompt_len, t.response_len, 1 << 50).phases[phase]
    return sum(comps.get(k, 0) for k in parts)


def _bytes(dtype: Optional[str]) -> int:
    from edgerl.plan.dtypes import nbytes
    return int(nbytes(dtype or "fp32"))


def memory_verdict(name: str, measured: Optional[int], est: int) -> Verdict:
    if measured is None:
        return Verdict(name, "skip", "device memory is measured on a CUDA GPU")
    limit = est * MEMORY_SLACK[0] + MEMORY_SLACK[1]
    figs = {"measured_bytes": measured, "estimated_bytes": est, "limit_bytes": int(limit)}
    detail = f"measured {fmt_bytes(measured)}, the plan's memory model {fmt_bytes(est)} for this model"
    if measured <= limit:
        return Verdict(name, "pass", detail, figs)
    return Verdict(name, "fail", detail + f": more than {MEMORY_SLACK[0]:g} x the estimate + "
                   f"{fmt_bytes(MEMORY_SLACK[1])}, so plans on this machine may run out of memory",
                   figs, "plan.memory_gib=<less than this GPU's memory>")


# ---- the rollout engine against HF's forward ---------------------------------------------------------

def check_engine(plan: Plan, folder: Path, device: torch.device, actor) -> list[Verdict]:
    """Greedy generation through the plan's engine (a CUDA graph where the plan captures one) against HF's
    forward over the same tokens; the decode step's time and memory."""
    from edgerl.core.errors import TrainingError
    from edgerl.models.load import lm_weights
    from edgerl.rollout import EngineContext, build_engine
    from edgerl.rollout.base import SamplingParams
    name = f"rollout engine ({plan.rollout_engine}, {_engine_mode(plan)})"
    avoid = _engine_avoid(plan)
    if plan.rollout_engine == "vllm":
        return [Verdict(name, "skip", "vLLM runs its own kernels; edgerl's engine is not used")]
    mem: dict[str, int] = {}
    try:
        with peak_memory(device, mem):
            engine = build_engine(plan, EngineContext(
                model_path=str(folder), trust_remote_code=False, device=device, max_seq_len=PROMPT + RESPONSE,
                seed=0, work_dir=folder, save_initial=lambda f: None, actor=actor))
            if engine.needs_weights:
                engine.sync_weights(lm_weights(actor))
            params = SamplingParams(max_new_tokens=RESPONSE, greedy=True)
            prompts = _prompts()
            out = engine.generate(prompts, 1, params)            # captures the graph
        again = engine.generate(prompts, 1, params)              # replays it: the timed run
    except (TrainingError, ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return [Verdict(name, "fail", f"it cannot generate here: {type(e).__name__}: {first}", avoid=avoid)]
    ref = _reference_lm(plan, folder, device)
    verdicts = [_compare_engine(name, plan, out, ref, avoid)]
    if again.response_ids != out.response_ids:
        verdicts[0] = Verdict(name, "fail", "two greedy generations of the same prompts differ", avoid=avoid)
    steps = max(1, again.info.get("decode_steps", 0))
    ms = 1e3 * again.info.get("decode_s", 0.0) / steps
    verdicts.append(Verdict("decode step time", "pass", f"{ms:.3f} ms per decode step of {ROWS} rows "
                            f"({ROWS * 1e3 / ms:.0f} tokens/s; {steps} steps, "
                            f"{'CUDA graph' if again.info.get('cuda_graphs') else 'eager'})",
                            {"ms_per_step": ms, "rows": ROWS, "capture_s": out.info.get("capture_s", 0.0)}))
    parts = ("generation weights", "KV cache", "sampling logits", "prefill activations")
    verdicts.append(memory_verdict("decode memory", mem.get("bytes"), memory_estimate(plan, "rollout", parts)))
    engine.release()
    del engine, ref
    return verdicts


def _engine_mode(plan: Plan) -> str:
    return (f"decode backend {plan.decode_backend}" if plan.rollout_engine == "static"
            else f"the {plan.rollout_engine} engine")


def _engine_avoid(plan: Plan) -> str:
    """The setting most likely to avoid a failing decode step: a plainer decode backend, then another engine."""
    if plan.rollout_engine == "static" and plan.decode_backend != "torch":
        return "plan.decode_backend=torch"
    return "plan.rollout_engine=hf-generate" if plan.rollout_engine == "static" else ""


def _reference_lm(plan: Plan, folder: Path, device: torch.device):
    """HF's model of the saved weights as the engine runs them: the compute dtype, or the quantized base
    (quantizing is deterministic; fresh LoRA adapters add nothing)."""
    from edgerl.models.load import _load_base, load_causal_lm, quantized_base
    from edgerl.plan.dtypes import torch_dtype
    if quantized_base(plan):
        lm = _load_base(str(folder), plan, device, False)
    else:
        lm = load_causal_lm(str(folder), torch_dtype(plan.dtype.compute), "sdpa" if device.type == "cuda" else "eager")
    return lm.to(device).eval()


@torch.no_grad()
def _compare_engine(name: str, plan: Plan, out, ref, avoid: str) -> Verdict:
    device = next(ref.parameters()).device
    width = max(len(p) for p in out.prompt_ids)
    total = width + max(len(r) for r in out.response_ids)
    ids = torch.zeros((len(out.prompt_ids), total), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(out.prompt_ids, out.response_ids)):
        ids[i, width - len(p):width + len(r)] = torch.tensor(p + r)
        mask[i, width - len(p):width + len(r)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = ref(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device)).logits.float()
    logp_all = torch.log_softmax(logits[:, width - 1:total - 1], -1)
    toks = torch.tensor(out.response_ids, device=device)
    want = logp_all.gather(-1, toks[..., None]).squeeze(-1)
    got = torch.tensor(out.logprobs, device=device)
    diff = (got - want).abs()
    top2 = logits[:, width - 1:total - 1].topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    best = logits[:, width - 1:total - 1].argmax(-1)
    tmax, tmean, tie = ENGINE_TOL[plan.dtype.compute]
    wrong = ((best != toks) & (gap > tie)).sum().item()
    ties = ((best != toks) & (gap <= tie)).sum().item()
    figs = {"max_logprob_diff": float(diff.max()), "mean_logprob_diff": float(diff.mean()), "tokens": toks.numel(),
            "argmax_differs_at_near_ties": ties, "argmax_differs": wrong, "tolerance": [tmax, tmean, tie]}
    detail = (f"{toks.numel()} greedy tokens, log-probs within {float(diff.max()):.2g} (mean {float(diff.mean()):.2g}) "
              f"of HF's forward")
    if wrong:
        return Verdict(name, "fail", f"{wrong} of {toks.numel()} greedy tokens are not HF's argmax (top-2 gap over "
                       f"{tie:g}); {detail}", figs, avoid)
    if not (within(figs["max_logprob_diff"], tmax) and within(figs["mean_logprob_diff"], tmean)):
        return Verdict(name, "fail", f"{detail}: over the tolerance {tmax:g} (mean {tmean:g})", figs, avoid)
    return Verdict(name, "pass", detail + (f"; {ties} near-tie token(s) differ" if ties else ""), figs, avoid)


# ---- two training steps against the reference path ---------------------------------------------------

def check_training(plan: Plan, folder: Path, device: torch.device) -> list[Verdict]:
    """Two steps on the plan's path and on its reference path: loss and gradients, step time and memory."""
    name = f"two training steps ({plan.dtype.compute}, log-probs {plan.kernel_backend}, {plan.optimizer}" + \
        (f", LoRA on a {plan.base_dtype} base" if plan.lora else "") + ")"
    mem: dict[str, int] = {}
    try:
        with peak_memory(device, mem):
            got = _two_steps(plan, folder, device, reference=False)
    except Exception as e:   # a kernel that cannot run: the verdict names it
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return [Verdict(name, "fail", f"it cannot train here: {type(e).__name__}: {first}",
                        avoid=_train_avoid(plan))]
    want = _two_steps(plan, folder, device, reference=True)
    ltol, gtol = TRAIN_TOL[plan.dtype.compute]
    parts = {}
    for i in range(2):
        parts[f"loss step {i + 1}"] = (abs(got["loss"][i] - want["loss"][i]) / max(abs(want["loss"][i]), 1e-12), ltol)
        grow = STEP2_GRADIENTS.get(plan.optimizer, 1.0) if i else 1.0
        parts[f"gradients step {i + 1}"] = (_rel_norm(got["grads"][i], want["grads"][i]), gtol * grow)
    figs = {k: {"error": e, "tolerance": t} for k, (e, t) in parts.items()}
    figs["loss"] = got["loss"]
    figs["reference_loss"] = want["loss"]
    bad = [k for k, (e, t) in parts.items() if not within(e, t)]
    detail = (f"loss {got['loss'][0]:.5g} then {got['loss'][1]:.5g}, reference {want['loss'][0]:.5g} then "
              f"{want['loss'][1]:.5g}; gradients within {max(parts[k][0] for k in parts if 'grad' in k):.2g} "
              f"(relative norm)")
    verdicts = [Verdict(name, "fail" if bad else "pass",
                        (f"{', '.join(bad)} over tolerance; " if bad else "") + detail, figs, _train_avoid(plan))]
    verdicts.append(Verdict("training step time", "pass", f"{got['step_s'] * 1e3:.1f} ms for a step of {ROWS} "
                            f"sequences of {PROMPT + RESPONSE} tokens (the second step)", {"step_s": got["step_s"]}))
    parts_m = ("master weights", "gradients", "optimizer state", "layer copies", "activations", "log-prob logits",
               "dequantization", "optimizer step")
    verdicts.append(memory_verdict("training memory", mem.get("bytes"), memory_estimate(plan, "update", parts_m)))
    return verdicts


def _train_avoid(plan: Plan) -> str:
    if plan.kernel_backend == "triton":
        return "plan.kernel_backend=torch"
    if plan.optimizer != "adamw":
        return "plan.optimizer=adamw"
    return ""


def _rel_norm(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return math.sqrt(num / max(den, 1e-300)) if len(a) == len(b) else math.inf


def _batch(device: torch.device):
    """ROWS left-padded prompts with responses: ids, mask, targets, the first response column."""
    g = torch.Generator().manual_seed(1)
    width, total = PROMPT, PROMPT + RESPONSE
    ids = torch.zeros((ROWS, total), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(_prompts(1)):
        resp = torch.randint(3, VOCAB, (RESPONSE,), generator=g)
        ids[i, width - len(p):] = torch.cat((torch.tensor(p), resp))
        mask[i, width - len(p):] = 1
    adv = torch.randn(ROWS, 1, generator=g)
    return ids.to(device), mask.to(device), ids[:, width:].to(device), width - 1, adv.to(device)


def _two_steps(plan: Plan, folder: Path, device: torch.device, reference: bool) -> dict[str, Any]:
    """Build the actor as training does, take two steps of a policy-gradient loss with an entropy bonus;
    the losses, the gradients of every trainable parameter (on the host) and the second step's time.
    reference: every logit in fp32 (PolicyHead backend 'naive') and the optimizer's eager torch step."""
    from edgerl.models.load import build_actor
    from edgerl.train.optim import StateOffload, make_optimizer
    from edgerl.train.update import Learner, optimizer_step
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.manual_seed(0)   # LoRA's initial adapters: the same on both paths
        actor = build_actor(str(folder), plan, device)
    if reference:
        actor.backend = "naive"
    params = [p for p in actor.parameters() if p.requires_grad]
    if reference and plan.optimizer == "adamw":
        optim = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False, fused=False)
    else:
        optim = make_optimizer(params, plan.optimizer, 1e-3, (0.9, 0.999), 0.01, seed=0,
                               fused=(False if reference else plan.kernel_backend == "triton") if cuda else None)
    learner = Learner("actor", actor, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0),
                      StateOffload(optim, False, cuda))
    scaler = torch.amp.GradScaler(device.type) if plan.dtype.grad_scaler else None
    ids, mask, targets, start, adv = _batch(device)
    out: dict[str, Any] = {"loss": [], "grads": []}
    actor.train()
    for step in range(2):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        logp, ent = actor(ids, mask, targets, start, 1.0)
        loss = -(adv * logp).mean() - 0.01 * ent.mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optim)
        out["grads"].append([_full(p.grad).detach().float().cpu() for p in params])
        out["loss"].append(loss.item())
        optimizer_step(learner, 1e9, None if scaler is None else _Unscaled(scaler))
        if cuda:
            torch.cuda.synchronize(device)
        out["step_s"] = time.perf_counter() - t0
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Unscaled:
    """The scaler after this step's unscale_ (the gradients were read unscaled): optimizer_step's unscale_
    is then a no-op, its step and update the scaler's own."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def unscale_(self, optim) -> None:
        pass

    def step(self, optim) -> None:
        self.scaler.step(optim)

    def update(self) -> None:
        self.scaler.update()


# ---- all of it ---------------------------------------------------------------------------------------

def model_checks(plan: Plan, device: torch.device) -> list[Verdict]:
    """The engine, training, time and memory checks on a small random model of the plan's architecture."""
    from edgerl.models.load import build_actor, init_distributed
    spec = small_spec(plan.model)
    small = small_plan(plan, spec)
    init_distributed(device)
    with tempfile.TemporaryDirectory(prefix="edgerl-selftest-") as tmp:
        folder = save_small_model(spec, Path(tmp))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            actor = build_actor(str(folder), small, device)
        out = check_engine(small, folder, device, actor)
        del actor
        _free(device)
        out += check_training(small, folder, device)
        _free(device)
    for v in out:
        v.figures.setdefault("model", spec.describe())
    return out


def _free(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
