"""How long a step should take on a card, by phase: a roofline over the plan's bytes and FLOPs.

Each phase is the larger of its matmul time (FLOPs at the card's rate for the plan's compute dtype) and
its memory time (bytes at the card's bandwidth), each divided by an efficiency: the share of the peak that
edgerl's kernels reach in that phase, calibrated once on the GPUs edgerl has run on (`DECODE`, `MATMUL`,
docs/benchmarks.md, Step time estimate), plus fixed per-step costs (kernel launches, the optimizer's
pass over its state, PCIe transfers of offloaded state, the checkpointed inputs' copies to host memory where the
matmuls do not hide them, decode graphs captured again where the engine is freed between steps, and a
micro-batch too small to give every SM an output tile). The card's rates are its `edgerl doctor --bench`
measurements when cached, else its datasheet rates (`edgerl/profile_data/*.toml`, docs/hardware.md, Datasheet
rates). Pure: it reads a `Plan` (or, for the memory search, a candidate's values: `phases`) and touches no
hardware.

What it assumes, and `recommend` says: every response runs to `rollout.max_new_tokens` (EOS at random
places makes a real step shorter), prompts at `data.max_prompt_len`, no other process on the GPU, and
the efficiencies of a Hopper GPU carried over to the card (its kernels reach the same share of its own
peak); a card whose rates are not known gets no estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from edgerl.plan.dtypes import nbytes

# Shares of the peak that edgerl's kernels reach, by phase (calibrated on the rows of docs/benchmarks.md,
# Step time estimate: an H100 and an H200, each run alone on its GPU). A decode step reads the weights and
# the KV cache written so far and multiplies every row through the weights; each of the three is timed at its
# own share of the card's bandwidth or arithmetic rate, and they add (the kernels overlap them only in part).
DECODE = {   # backend: (weights' bytes, the cache's bytes, arithmetic)
    "triton-layers": (0.55, 0.45, 0.30), "triton-attention": (0.50, 0.40, 0.30), "cuda-c": (0.60, 0.45, 0.45),
    "cuda-c-nf4": (0.21, 0.45, 0.53), "cuda-c-nf4-mma": (0.20, 0.45, 0.50),
    "torch": (0.45, 0.30, 0.30), "hf-generate": (0.30, 0.20, 0.20),
    "vllm": (0.55, 0.45, 0.30)}
MATMUL = 0.45        # training and scoring matmuls, of the compute dtype's peak
ATTENTION = 0.60     # training and scoring attention, of its rate (tensor cores in 16 bits, CUDA cores in fp32)
GRAPH_STEP_S = 25e-6         # one decode step's fixed cost when replayed from a CUDA graph (per layer: below)
GRAPH_LAYER_S = 6e-6
EAGER_LAYER_S = 120e-6       # a decode step's host launches per layer where no CUDA graph holds it (hf-generate)
TRAIN_LAYER_S = 1e-3         # a micro-step's launches per layer, forward and backward (plan/search.py's figure)
NF4_BYTES = 0.5 + 4 / 64     # bytes per NF4 weight read by the decode kernel: the codes and an fp32 absmax per 64
STATE_BYTES = {"adamw": 16, "adamw8bit": 10, "adamw-bf16": 10, "adamw-bf16-sr": 8}   # per trainable parameter
PCIE_GBS = {3: 12.0, 4: 24.0, 5: 50.0}   # pinned copies per PCIe generation (docs/hardware.md, Host transfers)
CAPTURE_STEPS = 3            # a decode graph's capture: two eager warm-up steps and the captured one
TILE = 128                   # rows and columns of one matmul output tile (cuBLAS's large tiles)


@dataclass(frozen=True)
class Rates:
    """What the card can do, from `edgerl doctor --bench` or its datasheet."""
    card: str
    bandwidth_gbs: float
    matmul_tflops: float      # the plan's compute dtype (fp32 on CUDA cores unless tf32; 16 bits on tensor cores)
    fp32_tflops: float        # CUDA cores in fp32: fp32 attention and the CUDA C decode kernels
    pcie_gbs: float
    source: str
    sm_count: int = 0         # 0: unknown (no wave term)
    cc: tuple[int, int] = (0, 0)   # compute capability ((0, 0): unknown)


@dataclass(frozen=True)
class StepTime:
    rollout_s: float
    score_s: float
    update_s: float
    rates: Rates
    assumptions: tuple[str, ...] = field(default=())

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.score_s + self.update_s

    def line(self) -> str:
        return (f"expected step time on {self.rates.card}: {fmt_s(self.total_s)} (rollout {fmt_s(self.rollout_s)}, "
                f"scoring {fmt_s(self.score_s)}, update {fmt_s(self.update_s)}); {self.rates.source}")

    def to_dict(self) -> dict[str, Any]:
        return {"rollout_s": self.rollout_s, "score_s": self.score_s, "update_s": self.update_s,
                "total_s": self.total_s, "card": self.rates.card, "bandwidth_gbs": self.rates.bandwidth_gbs,
                "matmul_tflops": self.rates.matmul_tflops, "rates_source": self.rates.source,
                "assumptions": list(self.assumptions)}


def fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s" if s < 600 else f"{s / 60:.0f} min"


def rates(device: Any, compute: str, tf32: bool = False) -> Optional[Rates]:
    """The card's bandwidth and matmul rate for `compute` (fp32/fp16/bf16): measured where `edgerl doctor
    --bench` cached them, else the profile's datasheet figures; None where either is unknown (the CPU, a
    card without a profile). `tf32`: fp32 matmuls run on TF32 tensor cores (CC >= 8.0, when enabled)."""
    if not getattr(device, "is_cuda", False):
        return None
    m = device.measured
    measured_bw = m.memory_gbs if m else None
    bandwidth = measured_bw or device.memory_bandwidth_gbs
    if compute == "fp32":
        measured_mm = None if tf32 else (m.fp32_tflops if m else None)
        mm = measured_mm or (device.tf32_tflops if tf32 else device.fp32_tflops)
    else:
        measured_mm = (m.fp16_tflops if compute == "fp16" else m.bf16_tflops) if m else None
        mm = measured_mm or device.fp16_tflops
    if not bandwidth or not mm:
        return None
    pcie = PCIE_GBS.get(device.pcie_gen or 3, 12.0)
    if m and m.h2d_gbs:
        pcie = m.h2d_gbs
    measured = measured_bw is not None or measured_mm is not None
    source = ("rates measured by edgerl doctor --bench" if measured else
              f"datasheet rates: {bandwidth:g} GB/s, {mm:g} TFLOP/s in {'tf32' if tf32 else compute}")
    cuda_cores = (m.fp32_tflops if m else None) or device.fp32_tflops or mm
    return Rates(device.name, bandwidth, mm, cuda_cores, pcie, source, getattr(device, "sm_count", 0) or 0,
                 tuple(getattr(device, "cc", None) or (0, 0)))


def matmul_params(model: Any) -> int:
    """Weights a token multiplies through: every layer's linears and the LM head (the embedding is a lookup)."""
    return model.num_layers * model.layer_params() + model.embedding_params()


def attention_flops(model: Any, length: int) -> float:
    """Forward FLOPs of causal attention over one sequence (QK^T and PV over the causal half)."""
    return 2.0 * model.num_layers * model.q_dim * length * length


def decode_step_s(model: Any, v: Any, r: Rates, rows: int, cached: float) -> float:
    """One decode step of `rows` rows whose KV cache holds `cached` tokens each, under the plan's values `v`."""
    compute = v["dtype"].compute
    cbytes = 4 if compute == "fp32" else 2
    engine, backend = v["rollout_engine"], v.get("decode_backend")
    nf4 = v.get("base_dtype") == "nf4"
    name = backend if engine == "static" and backend else engine
    if name == "cuda-c" and nf4:
        from edgerl.kernels.tiles import nf4_on_tensor_cores  # pure
        # fp16 from CC 7.5: the NF4 kernel on tensor cores (kernels/nf4.py, tensor_cores)
        name = "cuda-c-nf4-mma" if nf4_on_tensor_cores(compute, r.cc) else "cuda-c-nf4"
    w_eff, kv_eff, f_eff = DECODE.get(name, DECODE["torch"])
    N = matmul_params(model)
    bw = r.bandwidth_gbs * 1e9
    # the CUDA C kernels compute on CUDA cores in fp32 (but the NF4 kernel's fp16 tensor-core path); the others'
    # 16-bit matmuls on tensor cores
    cuda_cores = name.startswith("cuda-c") and name != "cuda-c-nf4-mma"
    rate = r.fp32_tflops if cuda_cores or compute == "fp32" else r.matmul_tflops
    s = N * (NF4_BYTES if nf4 else cbytes) / (bw * w_eff)
    # an fp16 cache under fp32 compute is read at the backend's share too (docs/benchmarks.md, The attention at
    # long lengths: split over columns)
    kv = v.get("kv_cache_dtype")
    kv_bytes = int(nbytes(kv)) if kv else cbytes
    s += rows * model.kv_bytes_per_token(kv_bytes) * cached / (bw * kv_eff)
    s += 2 * N * rows / (rate * 1e12 * f_eff)
    if engine == "static":
        s += GRAPH_STEP_S + GRAPH_LAYER_S * model.num_layers
    elif engine == "hf-generate":
        s += EAGER_LAYER_S * model.num_layers
    return s


def phases(model: Any, task: Any, v: Any, r: Rates, prompt_len: Optional[int] = None) -> tuple[float, float, float]:
    """Seconds of (rollout, scoring, update) for `task` on the card of `r` under the plan's values `v` (a `Plan`'s
    `values`, or the search's candidate setting in the same keys)."""
    P = prompt_len or task.prompt_len
    R = task.response_len
    n = task.local_sequences
    compute = v["dtype"].compute
    cbytes = 4 if compute == "fp32" else 2
    bw = r.bandwidth_gbs * 1e9
    mm = r.matmul_tflops * 1e12 * MATMUL
    # SDPA's fused kernels compute fp32 on CUDA cores (TF32 or not); 16 bits on tensor cores
    attn = (r.fp32_tflops if compute == "fp32" else r.matmul_tflops) * 1e12 * ATTENTION
    N = matmul_params(model)
    lora = v.get("lora")
    nf4 = v.get("base_dtype") == "nf4"
    engine = v["rollout_engine"]

    # --- rollout: the prompts' prefill, then R decode steps, rollout_batch rows at a time
    rows = max(1, min(v["rollout_batch"], n))
    passes = math.ceil(n / rows)
    prefill = 2 * N * rows * P / mm + rows * attention_flops(model, P) / attn
    rollout_s = passes * (prefill + R * decode_step_s(model, v, r, rows, P + R / 2))
    if engine == "static" and not v.get("rollout_resident"):
        # the graphs were freed with the engine's memory: each pass captures its decode step again
        rollout_s += passes * CAPTURE_STEPS * EAGER_LAYER_S * model.num_layers

    # --- scoring: one no-grad forward per model that scores (old log-probs, the reference, the critic)
    L = P + R
    tokens = n * L
    fwd = 2 * N * tokens / mm + n * attention_flops(model, L) / attn
    updates = n // max(1, task.local_mini)
    forwards = (1 if task.kl else 0) + (1 if task.critic else 0) + (1 if updates > 1 else 0)
    score_s = forwards * fwd
    if v.get("swap_models") and task.kl and not lora:
        score_s += 2 * N * cbytes / (r.pcie_gbs * 1e9)          # the reference in and out over PCIe

    # --- update: forward and backward (and the forward again under checkpointing) of the actor and critic
    mb = max(1, v["micro_batch"])
    micro_steps = math.ceil(n / mb)
    ckpt = 1 if v.get("grad_checkpointing") else 0
    passes_mm = (2 if lora else 3) + ckpt             # in forwards: a frozen base has no weight gradient
    matmuls = passes_mm * 2 * N * tokens / mm * under_filled(mb * L, model.hidden_size, r.sm_count)
    one = matmuls + (3 + ckpt) * n * attention_flops(model, L) / attn
    models = 1 + (1 if task.critic else 0)
    update_s = models * (one + micro_steps * model.num_layers * TRAIN_LAYER_S)
    trainable = lora["params"] if lora else model.n_params()
    state = STATE_BYTES.get(v.get("optimizer", "adamw"), 16)
    update_s += models * 2 * trainable * state / bw                  # the optimizer reads and writes its state
    if nf4:                                                          # dequantized in every forward and backward
        update_s += micro_steps * passes_mm * N * (cbytes + NF4_BYTES) / bw
    if v.get("optimizer_offload") and not v.get("param_offload"):
        update_s += models * 2 * trainable * state / (r.pcie_gbs * 1e9)
    if v.get("param_offload"):
        update_s += models * micro_steps * passes_mm * N * cbytes / (r.pcie_gbs * 1e9)
    if v.get("activation_offload") and ckpt:
        # each checkpointed layer's input goes to pinned host memory and comes back, on a side stream beside
        # the update's matmuls: only what the matmuls do not hide costs time
        moved = 2 * tokens * model.num_layers * model.hidden_size * cbytes / (r.pcie_gbs * 1e9)
        update_s += models * max(0.0, moved - matmuls)
    if not lora and engine == "static":                 # the engine's copy of the new weights
        update_s += N * cbytes / bw
    return rollout_s, score_s, update_s


def output_tiles(tokens: int, hidden: int) -> int:
    """TILE x TILE output tiles of a matmul of `tokens` rows into `hidden` columns."""
    return math.ceil(tokens / TILE) * math.ceil(hidden / TILE)


def under_filled(tokens: int, hidden: int, sm_count: int) -> float:
    """How much longer a micro-step's matmuls take than their FLOPs say when their output tiles are fewer than one
    wave over the SMs: the SMs without a tile wait. 1 where the card's SM count is unknown."""
    if not sm_count:
        return 1.0
    return max(1.0, sm_count / output_tiles(tokens, hidden))


def estimate(plan: Any, r: Rates, prompt_len: Optional[int] = None) -> StepTime:
    """The step's phases on the card of `r` under `plan` (its setting, model and task)."""
    task = plan.task
    rollout_s, score_s, update_s = phases(plan.model, task, plan.values, r, prompt_len)
    P, R = prompt_len or task.prompt_len, task.response_len
    ran = (f"every episode fills its {R} tokens, all of them decoded (tools' results are prefilled, which is "
           "faster; answers end sooner)" if task.episodes else f"every response runs to {R} tokens (EOS ends real "
           "ones sooner)")
    said = (ran, f"prompts of {P} tokens",
            "the GPU to itself", "edgerl's kernels at the share of the card's peak they reach on Hopper GPUs "
            "(docs/benchmarks.md, Step time estimate)")
    return StepTime(rollout_s, score_s, update_s, r, said)


def with_rates(device: Any) -> Any:
    """A probed GPU carries no datasheet rates: take its profile's, where one matches."""
    if not getattr(device, "is_cuda", False) or (device.memory_bandwidth_gbs and device.fp32_tflops
                                                 and device.fp16_tflops):
        return device
    from dataclasses import replace
    from edgerl.device.profiles import match_profile
    p = match_profile(device)
    if p is None:
        return device
    fill = {k: getattr(p, k) for k in ("memory_bandwidth_gbs", "fp32_tflops", "fp16_tflops", "tf32_tflops")
            if getattr(device, k) is None}
    return replace(device, **fill)


def for_plan(plan: Any) -> Optional[StepTime]:
    """The estimate for the plan's own card; None where its rates are unknown (the CPU, an unprofiled GPU)."""
    r = rates(with_rates(plan.device), plan.values["dtype"].compute)
    return None if r is None else estimate(plan, r)


def line(plan: Any) -> str:
    """One line for `recommend`: the expected seconds per step and what they assume."""
    t = for_plan(plan)
    if t is None:
        if not plan.device.is_cuda:
            return "expected step time: not estimated on the CPU"
        return (f"expected step time: not estimated: {plan.device.name}'s bandwidth and matmul rate are not known "
                "(edgerl doctor --bench on the card measures them)")
    return t.line() + "; assumes " + ", ".join(t.assumptions)
