"""The memory model of one RL step, by component and by phase.

A step has three phases and the models move between them, so the peak is the largest phase:

    rollout  generation weights + KV cache + sampling logits (+ whatever stays resident)
    score    old/reference log-probs and values: forward passes without gradients
    update   actor (then critic) forward + backward + optimizer step

Formulas, with P parameters, T trainable parameters, h hidden size, I MLP size, q/kv the query
and key-value widths, V vocabulary, L = prompt + response tokens, b_c compute-dtype bytes:

    master weights        P x w (w = 4 for fp32 masters, 2 for the bf16 optimizers), or for a frozen
                          LoRA base P x b_base + A x 4 (A = r x (in + out) per adapted linear layer);
                          a quantized base counts its projections with `quantized_bytes` (packed
                          codes and constants) and the rest in the compute dtype
    generation copy       P x b_c: the rollout engine's own weights (merged W + scale B A under
                          LoRA); none when it runs the actor's own modules (quantized base). Rollout
                          phase only, unless the plan keeps it resident with its KV cache and graphs
    layer copies          2 layers + embeddings in b_c while FSDP2 unshards layers for a forward
    gradients             T x g (T = P, or A under LoRA; g = 4, or 2 for the bf16 optimizers); with one
                          micro-step per optimizer step and checkpointing, the layers' gradients are
                          allocated as the backward frees each layer's checkpointed input, so the update
                          counts the larger of the two and not both (less min(layers' gradients, inputs))
    optimizer state       T x `OPTIMIZERS[name].state` (8 AdamW, 2 8-bit, 6 or 4 bf16), plus the bf16
                          step's fixed workspace
    dequantization        one layer's weight dequantized to the compute dtype (quantized base)
    reference             P x b_c, a separate frozen copy; none under LoRA (adapter disabled)
    stacked adapters      under LoRA where the cuda-c decode backend stacks q/k/v and gate/up (fp32 compute,
                          or an NF4 base): those layers' adapters again in fp32 (r x (in + out) x 4 each),
                          and over an NF4 base an fp32 offset per 16384 of their weights; every phase
    activations, no ckpt  tokens x layers x b_c x (5h + 3q + 3kv + 3I)   (+ K and V repeated to the
                          query heads where SDPA's memory-efficient kernel attends: 2 (q - kv) b_c;
                          + the eager score matrix: tokens x heads x L x 2 b_c per layer)
    activations, ckpt     tokens x layers x h x b_c (each layer's input) + one layer's full activations;
                          with the inputs offloaded to pinned host memory, two layers' inputs
    activations, no grad  tokens x b_c x (5h + max(4I, 4q + 2kv (+ 2q repeated K/V)))
    backward workspace    tokens x 3I x b_c: one layer's MLP gradients while its backward runs
                          (measured on the CPU: tests/test_long_memory_on_cpu.py)
    attention workspace   none where a fused SDPA kernel attends (O(L)); chunked attention holds
                          rows x heads x chunk x L scores x 4 b_c (scores, probabilities, their
                          recomputation and gradients)
    log-prob pass         chunk x V x b_logit through the chunked kernel (the torch path holds 8
                          bytes per logit of a chunk, the Triton backward one slab in the compute
                          dtype); never tokens x V. Beside it the response's hidden states gathered
                          (N x h x b_c) and, in the update, their fp32 gradient (N x h x 4), and on
                          the torch path with 16-bit inputs the backward's fp32 copy of them and the
                          gradient's cast back (N x h x (4 + b_c)); the head's own gradient (V x h x 4)
                          where the head trains. A 16-bit head is upcast a vocabulary tile at a time,
                          within the chunk's logits (edgerl/kernels/chunked.py), never whole
    KV cache              sequences x ceil(L / 16) x 16 x 2 x layers x kv x b_c (episodes on the static engine:
                          L + one turn, the rows aligning at the longest), and the engine's
                          per-row token and log-prob buffers (12 bytes a column); where a layer attends
                          through a sliding window of W tokens and the engine's cache keeps only the
                          window (transformers' generate), that layer counts min(L, W) tokens instead
    prefill activations   tokens x (4h + 3I) x b_c: the prompts' prefill (once per prompt on the static
                          engine) or, in episodes, the prefill between turns where larger
                          (`turn_prefill_tokens`)
    sampling logits       sequences x V x 4 x 3 (fp32 logits, softmax, top-p sort)
    library workspaces    cuBLAS workspaces inside torch's allocator (a constant)
    CUDA context          a constant per process, outside torch's allocator
    fragmentation         a share of the transient memory (activations, logits, KV cache): smaller
                          where the allocator's expandable segments are on (the plan's environment)

`Calibration` holds the constants; measured peaks (docs/benchmarks.md) calibrate them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from edgerl.device.device import GiB, MiB
from edgerl.plan.modelspec import ModelSpec


@dataclass(frozen=True)
class TrainingBytes:
    """What one trainable parameter costs through training under an optimizer, in bytes, and the
    dtype the trainable parameters must be stored in. `step_workspace` is per optimizer step, not
    per parameter: transient bytes the step allocates (after the backward has freed activations)."""
    weights: int
    grads: int
    state: int
    param_dtype: str
    step_workspace: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.state


# The bf16 optimizers' eager step walks each shard in chunks of 2^21 elements with 24 bytes of
# temporaries per element (counted in adamw_bf16.py, which takes its chunk size from here); the fused
# one needs none. A step that streams host-held shards through the GPU holds one chunk of weight,
# gradient and state there (10 bytes per element) besides: 34 bytes per element, counted as 36 (room
# for the allocator).
BF16_STEP_CHUNK = 1 << 21
BF16_STEP_WORKSPACE = 36 * BF16_STEP_CHUNK

# name -> bytes per trainable parameter (the table is in optim.make_optimizer's docstring). adamw8bit's
# scales add 2 * 4 / 256 = 0.03 bytes (counted in `estimate`), and bitsandbytes keeps tensors under 4096
# values in fp32 (8 bytes; left out: norms and biases). TRL's bf16 model with torch's AdamW is also 2 + 2 + 4 = 8 bytes, but
# drops updates below half a bf16 spacing (adamw_bf16.py).
OPTIMIZERS: dict[str, TrainingBytes] = {
    "adamw": TrainingBytes(4, 4, 8, "fp32"),
    "adamw8bit": TrainingBytes(4, 4, 2, "fp32"),
    "adamw-bf16": TrainingBytes(2, 2, 6, "bf16", BF16_STEP_WORKSPACE),
    "adamw-bf16-sr": TrainingBytes(2, 2, 4, "bf16", BF16_STEP_WORKSPACE),
}

QUANTS = ("nf4", "int8")
NF4_BLOCK = 64        # weights per absmax: QLoRA's choice and bitsandbytes' default
NESTED_BLOCK = 256    # absmax codes per fp32 scale in the second level (double quantization)


def quantized_bytes(in_features: int, out_features: int, quant: str) -> int:
    """Bytes one quantized weight (out_features, in_features) occupies, as bitsandbytes stores it
    (the bias is a separate float parameter and not counted).

    nf4: n = in x out packed two per byte, one uint8 absmax code per 64 weights, one fp32 scale per
    256 codes, the 256-entry fp32 code table of the second level and the 16-entry NF4 table (each
    layer holds its own copies) and the fp32 offset.  int8: one byte per weight, one fp32 scale per row."""
    if quant not in QUANTS:
        raise ValueError(f"quant={quant!r}: choose one of {', '.join(QUANTS)}")
    n = in_features * out_features
    if quant == "int8":
        return n + 4 * out_features
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * 256 + 4 * 16 + 4


def transient_bytes(in_features: int, out_features: int, quant: str, compute_bytes: int) -> int:
    """Bytes a forward or backward of one quantized layer allocates beyond its input and output: the
    weight dequantized in the compute dtype (nf4: plus its absmax dequantized to fp32, held twice
    while the offset is added). Layers run one after another, so the largest layer's figure is the
    memory model's term. bitsandbytes' fused kernel for a few tokens (M <= 4) dequantizes nothing;
    LLM.int8's forward holds int8 activations (tokens x in) and an int32 product (tokens x out) instead."""
    if quant not in QUANTS:
        raise ValueError(f"quant={quant!r}: choose one of {', '.join(QUANTS)}")
    n = in_features * out_features
    if quant == "int8":
        return n * compute_bytes
    return n * compute_bytes + 2 * 4 * math.ceil(n / NF4_BLOCK)


def frozen_base_bytes(m: ModelSpec, quant: Optional[str], float_bytes: float) -> int:
    """A frozen base's weights: the projections quantized (`quant`) or in `float_bytes`, the rest
    (embeddings, head, norms, biases) in `float_bytes`."""
    if quant is None:
        return int(m.n_params() * float_bytes)
    shapes = m.module_shapes().values()
    packed = m.num_layers * sum(quantized_bytes(i, o, quant) for i, o in shapes)
    rest = m.n_params() - m.num_layers * sum(i * o for i, o in shapes)
    return packed + int(rest * float_bytes)


@dataclass(frozen=True)
class Calibration:
    # CUDA context, loaded kernels and library workspaces: device memory outside torch's allocator.
    # Measured 0.82-0.83 GiB (at most 848 MiB) on an H200 with torch 2.11 cu130 once training ran, in
    # every edgerl run of docs/benchmarks.md, Memory model (TRL's process: 0.78 GiB); 1.30 GiB before a
    # one-process run stopped creating an NCCL communicator. docs/hardware.md, CUDA context, gives 300-600 MiB for a bare
    # context on older stacks. The measured figure (with 32 MiB to spare) is used everywhere: a plan
    # that leaves too much is safe, one that leaves too little runs out of memory; and since the
    # allocator is capped at the budget less this, too much also leaves the allocator less room than
    # the plan counted (a budgeted run was slower at that cap).
    cuda_context: int = 880 * MiB
    # An NCCL communicator's buffers, also outside the allocator: one-process edgerl runs that created
    # one held 1.28-1.30 GiB outside it, those that did not 0.82-0.83 GiB (docs/benchmarks.md,
    # Memory model; docs/lab-log.md, 2026-12-01). Counted when the plan runs on several processes, which create one; with more
    # GPUs NCCL may hold more (not measured: no multi-GPU machine has run edgerl yet).
    nccl: int = 490 * MiB
    activation_factor: float = 1.0   # scales the activation formula
    # cuBLAS workspaces, allocated through torch's allocator: 32 MiB per (handle, stream) on Hopper, and the
    # rollout's CUDA-graph capture uses a stream of its own. Measured: a 1.5B-width P40 plan's rollout phase on
    # an H200 allocated 130 MiB beyond the other terms at 256 tokens (docs/long-responses.md), this and
    # bitsandbytes' block scales
    libraries: int = 64 * MiB
    # MLP-sized tensors per token alive beside the saved activations while one layer's backward runs
    # (the gradient of the product, then of gate and up, and SiLU(gate) recomputed): 3 measured on the CPU
    backward_mlp: int = 3

    def outside_allocator(self, processes: int) -> int:
        """Device memory a process holds outside torch's allocator: the context, and NCCL's buffers
        when it is one of several processes."""
        return self.cuda_context + (self.nccl if processes > 1 else 0)
    fragmentation: float = 0.10      # share of transient memory lost to allocator fragmentation
    # with expandable segments a segment grows and shrinks in place, so freed memory serves the next
    # phase's shapes; what stays lost is page rounding and blocks split across phases
    fragmentation_expandable: float = 0.05


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
    optimizer: str = "adamw"        # a name of OPTIMIZERS: the trainable parameters' bytes
    lora_params: int = 0            # 0: full fine-tuning
    critic: bool = False
    reference: bool = False         # a separate reference model (never with LoRA: adapter disabled)
    reward_model_params: int = 0
    cuda: bool = True
    shards: int = 1                 # FSDP2 ranks: parameters, gradients and optimizer state split over them
    base_quant: Optional[str] = None        # "nf4" / "int8": a quantized frozen LoRA base
    rollout_resident: bool = False  # the engine keeps its weights, KV cache and CUDA graphs between steps
    rollout_from_actor: bool = False        # the engine runs the actor's own modules: no generation copy
    prompt_share: int = 1           # samples of a prompt a scoring forward computes it once for (edgerl/packing.py)
    update_share: int = 1           # the same in the update (1 where shuffled mini-batches mix the groups)
    prefill_share: int = 1          # the same in the rollout's prefill (the static engine: edgerl/rollout/engine_static.py)
    lora_input_bytes: int = 0       # per token and layer: what the fp32 copies of the adapted layers' inputs add
                                    # to the activations beside a 16-bit base (steps.lora_input_bytes)
    activation_offload: bool = False        # checkpointed layers' inputs wait in pinned host memory
    attention_chunk: int = 0        # query rows per attention chunk; 0: a fused O(L) SDPA kernel attends
    kv_copies: bool = False         # SDPA's kernel needs K and V repeated to the query heads (not FlashAttention)
    expandable_segments: bool = False       # the allocator's expandable segments are on (PYTORCH_CUDA_ALLOC_CONF)
    head_trains: bool = False       # the LM head is trained (full fine-tuning): its gradient passes through the kernel
    logprob_upcast: bool = False    # the torch log-prob path computes 16-bit inputs in fp32 (upcast copies)
    kv_extra: int = 0               # columns the rollout's KV cache holds beyond prompt + response (episodes on the
                                    # static engine: one turn, Task.turn_len)
    episode_turn: int = 0           # episodes: one model turn's tokens (Task.turn_len); 0 for one response a prompt
    episode_reprefill: bool = False # episodes on an engine that prefills the whole conversation again each turn
                                    # (hf-generate); the static engine prefills only what follows a turn
    kv_window: bool = False         # the rollout's KV cache keeps only the window of sliding-window layers
                                    # (transformers' generate does; the static engine keeps every token)
    kv_bytes: int = 0               # bytes per cached key or value element (plan.kv_cache_dtype); 0: compute_bytes
    mini_batch: int = 0             # rows per optimizer step on this rank (0: unknown; several micro-steps assumed)
    sft: bool = False               # supervised fine-tuning: the update phase alone (no rollout, no scoring)
    stacked_adapters: int = 0       # bytes the decode step's LoRA groups hold for the engine's life (steps.py)


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


def packed_tokens(rows: int, share: int, prompt_len: int, response_len: int) -> int:
    """Tokens one forward of `rows` sequences computes when each prompt's `share` samples may share it
    (edgerl/packing.py; share 1: every row its own prompt). Micro-batches are consecutive slices of the
    rows in rollout order, so a micro-batch spans ceil(rows / share) prompts, or one more where neither
    divides the other."""
    if share <= 1:
        return rows * (prompt_len + response_len)
    prompts = -(-rows // share) + (1 if rows % share and share % rows else 0)
    return min(rows, prompts) * prompt_len + rows * response_len


def activation_bytes_per_token(m: ModelSpec, b_c: int, seq_len: int, eager: bool, train: bool = True,
                               kv_copies: bool = False) -> int:
    """Activations of one decoder layer for one token, without checkpointing. In training: what autograd
    keeps for the backward; the MLP keeps three intermediate-sized tensors (gate, up and their product:
    edgerl/swiglu.py recomputes the SiLU). Without gradients: the most one layer holds at once (its
    input, the normed input, and four intermediate-sized tensors in the MLP, or the attention's q, k, v
    and output). `kv_copies`: K and V repeated to the query heads for SDPA's memory-efficient kernel."""
    h, q, kv, inter = m.hidden_size, m.q_dim, m.kv_dim, m.intermediate_size
    copies = 2 * (q - kv) if kv_copies else 0
    if train:
        per = b_c * (5 * h + 3 * q + 3 * kv + 3 * inter + copies)
    else:
        per = b_c * (5 * h + max(4 * inter, 4 * q + 2 * kv + copies))
    if eager:  # eager attention keeps the (heads x L) score and probability rows per token
        per += 2 * b_c * m.num_heads * seq_len
    return per


def kv_cache_bytes(m: ModelSpec, rows: int, seq_len: int, b_c: int, windowed: bool = False) -> int:
    """The static engine's cache (columns rounded up to 16: rollout/decoder.py) and its per-row token and
    log-prob buffers (int64 and fp32 per column: rollout/engine_static.py). windowed: the engine's cache keeps
    only the window of sliding-window layers (transformers' generate; `ModelSpec.kv_bytes`)."""
    cols = -(-seq_len // 16) * 16
    return rows * m.kv_bytes(cols, b_c, windowed) + rows * seq_len * 12


def turn_prefill_tokens(s: Setting, prompt_len: int, response_len: int) -> int:
    """Tokens one prefill between an episode's turns holds at once: on the static engine what follows a turn
    (the tools' results, the next turn's header), which it prefills in groups of rows of at most rows x one
    turn tokens (edgerl/rollout/turns_static.py; one row alone may bring up to the episode's budget); on an
    engine that prefills the conversation again each turn, every row's prompt and episode so far."""
    if not s.episode_turn:
        return 0
    if s.episode_reprefill:
        return s.rollout_batch * (prompt_len + response_len)
    return max(s.rollout_batch * s.episode_turn, response_len)


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
    tb = OPTIMIZERS[s.optimizer]
    # under LoRA the frozen base is whole on every rank (FSDP2 shards what trains), except when streamed
    weights = frozen_base_bytes(m, s.base_quant, s.base_bytes) + T * 4 if lora else P * tb.weights
    master = 0 if s.param_offload else (weights - T * 4 + T * 4 // n if lora else weights // n)
    grads = 0 if s.param_offload else T * tb.grads // n
    state = T * tb.state // n
    if s.optimizer == "adamw8bit":   # two fp32 block scales per 256 values of its two 8-bit moments
        state += T * 8 // 256 // n
    optim = 0 if (s.param_offload or s.optimizer_offload) else state
    ref = P * b_c if s.reference else 0
    critic_state = 0
    if s.critic:  # same backbone, full fine-tuning of its own (or its own LoRA adapter)
        critic_state = master + grads + optim
    rm = s.reward_model_params * b_c
    # a quantized layer's weight is dequantized to the compute dtype for each forward and backward
    dequant = max(transient_bytes(i, o, s.base_quant, b_c) for i, o in m.module_shapes().values()) \
        if s.base_quant else 0

    def act(tokens: int, train: bool) -> int:
        per = activation_bytes_per_token(m, b_c, L, s.eager_attention, train, s.kv_copies)
        if not train:  # no graph is kept: one layer's intermediates at a time
            full = tokens * per
        elif s.grad_checkpointing:
            kept = 2 if s.activation_offload else m.num_layers   # offloaded: the one being copied, the one prefetched
            full = tokens * (kept * m.hidden_size * b_c + per + s.lora_input_bytes)
        else:
            full = tokens * m.num_layers * (per + s.lora_input_bytes)
        return int(full * cal.activation_factor)

    def attention(rows: int, train: bool) -> int:
        if not s.attention_chunk:
            return 0
        return rows * m.num_heads * min(s.attention_chunk, L) * L * b_c * (4 if train else 2)

    def logprob(rows: int, train: bool) -> int:
        """The chunk's logits, the response's hidden states (and their fp32 gradient), the head's copies."""
        n = rows * response_len
        out = s.logprob_chunk * m.vocab_size * s.logit_bytes + n * m.hidden_size * (b_c + (4 if train else 0))
        if train and s.logprob_upcast and b_c < 4:   # the backward's fp32 h, and grad_h cast back
            out += n * m.hidden_size * (4 + b_c)
        if train and s.head_trains:
            out += m.vocab_size * m.hidden_size * 4
        return out

    ctx = cal.outside_allocator(s.shards) if s.cuda else 0
    frag = cal.fragmentation_expandable if s.expandable_segments else cal.fragmentation

    # the rollout engine's own compute-dtype weights (merged under LoRA), alive while generating
    # unless resident; none when the engine runs the actor's own (quantized) modules
    gen_copy = 0 if s.rollout_from_actor else P * b_c
    kv = kv_cache_bytes(m, s.rollout_batch, L + s.kv_extra, s.kv_bytes or b_c, windowed=s.kv_window)
    sample = s.rollout_batch * m.vocab_size * 4 * 3
    prefill = max(packed_tokens(s.rollout_batch, s.prefill_share, prompt_len, 0),
                  turn_prefill_tokens(s, prompt_len, response_len)) * (4 * m.hidden_size + 3 * m.intermediate_size) * b_c
    # only the frozen reference moves between phases; the critic (FSDP2-wrapped, trained) and a
    # reward model stay on the device
    resident_off = (0 if s.swap_models else ref) + critic_state + rm
    rollout = {"master weights": master, "optimizer state": optim, "generation weights": gen_copy,
               "other models": resident_off, "KV cache": kv, "sampling logits": sample,
               "prefill activations": prefill, "dequantization": dequant, "stacked adapters": s.stacked_adapters}
    # a resident engine keeps its weights, KV cache and the graphs' pool (about one sampling step's
    # temporaries) through scoring and the update
    kept = {"generation weights": gen_copy, "KV cache": kv, "graph pool": s.rollout_batch * m.vocab_size * 4} \
        if s.rollout_resident and not s.sft else {}

    score_tokens = packed_tokens(s.score_micro_batch, s.prompt_share, prompt_len, response_len)
    stream = 2 * layer_c + embed_c  # FSDP2 unshards one layer ahead in compute dtype
    if s.param_offload:  # every model streams its layers from host memory
        scorers = {"compute weights": stream, "reference weights": stream if s.reference else 0,
                   "critic weights": stream if s.critic else 0, "reward model": rm}
    else:
        scorers = {"compute weights": stream, "reference weights": ref,
                   "critic weights": critic_state, "reward model": rm}
    if s.base_quant:  # FSDP2 manages the adapters only: the quantized base is used where it lies
        stream = 0
        scorers["compute weights"] = 0
    score = {"master weights": master, "optimizer state": optim, **scorers,
             "activations": act(score_tokens, train=False), "attention workspace": attention(s.score_micro_batch, False),
             "log-prob pass": logprob(s.score_micro_batch, False), "dequantization": dequant,
             "stacked adapters": s.stacked_adapters, **kept}

    tokens = packed_tokens(s.micro_batch, s.update_share, prompt_len, response_len)
    update = {"master weights": master, "gradients": grads,
              "optimizer state": state if not s.param_offload else 0,
              "layer copies": stream, "other models": resident_off,
              "activations": act(tokens, train=True),
              "backward workspace": tokens * cal.backward_mlp * m.intermediate_size * b_c,
              "attention workspace": attention(s.micro_batch, True), "log-prob pass": logprob(s.micro_batch, True),
              "dequantization": dequant, "stacked adapters": s.stacked_adapters, **kept}
    # the step runs after the backward has freed activations: offloaded state comes back, and the bf16
    # step's workspace is allocated, into room the activations left
    step_extra = tb.step_workspace + (state if s.optimizer_offload and not s.param_offload else 0)
    if s.optimizer_offload and not s.param_offload:
        update["optimizer state"] = 0
    inputs = tokens * m.num_layers * m.hidden_size * b_c   # every checkpointed layer input of a micro-batch
    tokens_in = inputs if s.activation_offload and s.grad_checkpointing else 0   # offloaded: pinned host memory
    overlap = 0
    if s.grad_checkpointing and not s.activation_offload and not s.param_offload and n == 1 \
            and s.micro_batch >= s.mini_batch > 0:
        # one micro-step: the gradients start empty (set to None after each step) and the backward allocates a
        # layer's as it frees that layer's checkpointed input, so the two are never both whole; at the layer
        # the backward has reached, the sum is linear in its depth, largest at one end (all the inputs, or all
        # the gradients). What is not in a layer (embeddings, head) is counted whole.
        overlap = min((T if lora else m.num_layers * m.layer_params()) * tb.grads, inputs)
        update["gradients"] -= overlap
        # the table says so: its gradients row is what the freed inputs do not make room for
        update = {("gradients beyond freed inputs" if k == "gradients" else k): v for k, v in update.items()}
    # the step itself holds every gradient, and no activations
    update["optimizer step"] = max(0, step_extra + overlap - update["activations"] - update["backward workspace"]
                                   - update["log-prob pass"])

    phases = {"update": update} if s.sft else {"rollout": rollout, "score": score, "update": update}
    for name, comps in phases.items():
        transient = sum(v for k, v in comps.items() if k in (
            "KV cache", "sampling logits", "prefill activations", "activations", "backward workspace",
            "attention workspace", "log-prob pass"))
        comps["fragmentation"] = int(transient * frag)
        comps["library workspaces"] = cal.libraries if s.cuda else 0
        comps["CUDA context"] = ctx
        phases[name] = {k: int(v) for k, v in comps.items() if v}

    host = 0  # per process; N processes on one machine need N times this
    if s.param_offload:
        host += (weights + T * tb.grads + T * tb.state) // n
    elif s.optimizer_offload:
        host += state
    if s.swap_models:
        host += ref
    host += tokens_in
    return MemoryEstimate(phases=phases, budget=budget, host_needed=host)


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"
