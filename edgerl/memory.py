"""The memory model of one RL step, by component and by phase.

A step has three phases and the models move between them, so the peak is the largest phase:

    rollout  generation weights + KV cache + sampling logits (+ whatever stays resident)
    score    old/reference log-probs and values: forward passes without gradients
    update   actor (then critic) forward + backward + optimizer step

Formulas, with P parameters, T trainable parameters, h hidden size, I MLP size, q/kv the query
and key-value widths, V vocabulary, L = prompt + response tokens, b_c compute-dtype bytes:

    master weights        P x 4 (fp32), or P x b_base + A x 4 for a frozen LoRA base and its fp32
                          adapter (A = r x (in + out) per adapted linear layer)
    generation copy       P x b_c: the rollout engine's own weights (merged W + scale B A under
                          LoRA). Rollout phase only: the trainer frees its storage after generating
                          and the next weight sync refills it
    layer copies          2 layers + embeddings in b_c while FSDP2 unshards layers for a forward
    gradients             T x 4 (T = P, or A under LoRA)
    optimizer state       T x 8 (AdamW: two fp32 moments) or T x 2 (8-bit AdamW)
    reference             P x b_c, a separate frozen copy; none under LoRA (adapter disabled)
    activations, no ckpt  tokens x layers x b_c x (5h + 3q + 3kv + 4I)   (+ the eager score matrix:
                          tokens x heads x L x 2 b_c per layer)
    activations, ckpt     tokens x layers x h x b_c + one layer's full activations
    log-prob pass         chunk x V x b_logit through the chunked kernel (the torch path holds 8
                          bytes per logit of a chunk, the Triton backward one slab in the compute
                          dtype); never tokens x V
    KV cache              sequences x L x 2 x layers x kv x b_c
    sampling logits       sequences x V x 4 x 3 (fp32 logits, softmax, top-p sort)
    CUDA context          a constant per process, outside torch's allocator
    fragmentation         a share of the transient memory (activations, logits, KV cache)

`Calibration` holds the constants; measured peaks (docs/benchmarks.md) calibrate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .device import GiB, MiB
from .modelspec import ModelSpec


@dataclass(frozen=True)
class Calibration:
    cuda_context: int = 512 * MiB    # CUDA context + cuBLAS/cuDNN workspaces, not in torch's allocator
    activation_factor: float = 1.0   # scales the activation formula
    fragmentation: float = 0.10      # share of transient memory lost to allocator fragmentation


DEFAULT_CALIBRATION = Calibration()


@dataclass(frozen=True)
class Setting:
    """The memory-relevant decisions the planner searches over."""
    compute_bytes: int              # 4 fp32, 2 fp16/bf16
    base_bytes: int                 # bytes per frozen base weight (LoRA) or master weight (full)
    grad_checkpointing: bool
    swap_models: bool               # the reference model leaves the GPU outside the scoring phase
    optimizer_offload: bool         # optimizer state lives in host memory between updates
    param_offload: bool             # FSDP2 CPUOffloadPolicy: params, grads, optimizer on the host
    micro_batch: int
    score_micro_batch: int
    rollout_batch: int
    logprob_chunk: int
    logit_bytes: int                # bytes per logit the kernel holds for a chunk (torch 8, Triton the dtype's)
    eager_attention: bool
    optimizer_bytes_per_param: int = 8
    lora_params: int = 0            # 0: full fine-tuning
    critic: bool = False
    reference: bool = False         # a separate reference model (never with LoRA: adapter disabled)
    reward_model_params: int = 0
    cuda: bool = True
    shards: int = 1                 # FSDP2 ranks: parameters, gradients and optimizer state split over them


@dataclass(frozen=True)
class MemoryEstimate:
    phases: dict[str, dict[str, int]]   # phase -> component -> bytes
    budget: int
    host_needed: int                    # host RAM the offloaded state needs
    peak_phase: str = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        peak = max(self.phases, key=lambda p: sum(self.phases[p].values()))
        object.__setattr__(self, "peak_phase", peak)
        object.__setattr__(self, "total", sum(self.phases[peak].values()))

    @property
    def components(self) -> dict[str, int]:
        return self.phases[self.peak_phase]

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def phase_totals(self) -> dict[str, int]:
        return {p: sum(c.values()) for p, c in self.phases.items()}

    def to_dict(self) -> dict:
        return {"components": dict(self.components), "total_bytes": self.total, "budget_bytes": self.budget,
                "fits": self.fits, "peak_phase": self.peak_phase, "phases": self.phase_totals(),
                "host_bytes_needed": self.host_needed}


def activation_bytes_per_token(m: ModelSpec, b_c: int, seq_len: int, eager: bool) -> int:
    """Saved activations of one decoder layer for one token, without checkpointing."""
    per = b_c * (5 * m.hidden_size + 3 * m.q_dim + 3 * m.kv_dim + 4 * m.intermediate_size)
    if eager:  # eager attention keeps the (heads x L) score and probability rows per token
        per += 2 * b_c * m.num_heads * seq_len
    return per


def estimate(m: ModelSpec, s: Setting, prompt_len: int, response_len: int, budget: int,
             cal: Calibration = DEFAULT_CALIBRATION) -> MemoryEstimate:
    """Bytes by phase and component for one step under setting `s`."""
    L = prompt_len + response_len
    P = m.n_params()
    lora = s.lora_params > 0
    T = s.lora_params if lora else P
    b_c = s.compute_bytes
    layer_c = m.layer_params() * b_c
    embed_c = m.embedding_params() * b_c * (1 if m.tie_embeddings else 2)

    # state that can stay on the GPU across phases; FSDP2 keeps 1/shards of each on every rank
    n = s.shards
    master = 0 if s.param_offload else (P * s.base_bytes + (T * 4 if lora else 0)) // n
    grads = 0 if s.param_offload else T * 4 // n
    optim = 0 if (s.param_offload or s.optimizer_offload) else T * s.optimizer_bytes_per_param // n
    ref = P * b_c if s.reference else 0
    critic_state = 0
    if s.critic:  # same backbone, full fine-tuning of its own (or its own LoRA adapter)
        critic_state = master + grads + optim
    rm = s.reward_model_params * b_c

    def act(tokens: int, train: bool) -> int:
        per = activation_bytes_per_token(m, b_c, L, s.eager_attention)
        if not train:  # no graph is kept: one layer's intermediates at a time
            full = tokens * per
        elif s.grad_checkpointing:
            full = tokens * (m.num_layers * m.hidden_size * b_c + per)
        else:
            full = tokens * m.num_layers * per
        return int(full * cal.activation_factor)

    logits = s.logprob_chunk * m.vocab_size * s.logit_bytes
    ctx = cal.cuda_context if s.cuda else 0
    frag = cal.fragmentation

    # the rollout engine's own compute-dtype weights (merged under LoRA), alive while generating only
    gen_copy = P * b_c
    kv = s.rollout_batch * L * m.kv_bytes_per_token(b_c)
    sample = s.rollout_batch * m.vocab_size * 4 * 3
    prefill = s.rollout_batch * prompt_len * (4 * m.hidden_size + 3 * m.intermediate_size) * b_c
    # only the frozen reference moves between phases; the critic (FSDP2-wrapped, trained) and a
    # reward model stay on the device
    resident_off = (0 if s.swap_models else ref) + critic_state + rm
    rollout = {"master weights": master, "optimizer state": optim, "generation weights": gen_copy,
               "other models": resident_off, "KV cache": kv, "sampling logits": sample,
               "prefill activations": prefill}

    score_tokens = s.score_micro_batch * L
    stream = 2 * layer_c + embed_c  # FSDP2 unshards one layer ahead in compute dtype
    if s.param_offload:  # every model streams its layers from host memory
        scorers = {"compute weights": stream, "reference weights": stream if s.reference else 0,
                   "critic weights": stream if s.critic else 0, "reward model": rm}
    else:
        scorers = {"compute weights": stream, "reference weights": ref,
                   "critic weights": critic_state, "reward model": rm}
    score = {"master weights": master, "optimizer state": optim, **scorers,
             "activations": act(score_tokens, train=False), "log-prob logits": logits}

    tokens = s.micro_batch * L
    update = {"master weights": master, "gradients": grads,
              "optimizer state": T * s.optimizer_bytes_per_param // n if not s.param_offload else 0,
              "layer copies": stream, "other models": resident_off,
              "activations": act(tokens, train=True), "log-prob logits": logits}
    if s.optimizer_offload and not s.param_offload:
        # state comes back for the step only; the step runs after the backward has freed activations
        update["optimizer state"] = max(0, T * s.optimizer_bytes_per_param // n - update["activations"]
                                        - update["log-prob logits"])

    phases = {"rollout": rollout, "score": score, "update": update}
    for name, comps in phases.items():
        transient = sum(v for k, v in comps.items() if k in (
            "KV cache", "sampling logits", "prefill activations", "activations", "log-prob logits"))
        comps["fragmentation"] = int(transient * frag)
        comps["CUDA context"] = ctx
        phases[name] = {k: int(v) for k, v in comps.items() if v}

    host = 0  # per process; N processes on one machine need N times this
    if s.param_offload:
        host += (P * s.base_bytes + T * 4 + T * s.optimizer_bytes_per_param) // n
    elif s.optimizer_offload:
        host += T * s.optimizer_bytes_per_param // n
    if s.swap_models:
        host += ref
    return MemoryEstimate(phases=phases, budget=budget, host_needed=host)


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"
