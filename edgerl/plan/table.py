"""The plan's decisions, one row each: the single place a decision is declared.

A row says what the decision is called (its name in the `Plan`, plan.json and the [plan] config
section), how `edgerl recommend` labels and shows it, the step that makes it and gives its reason
(`plan/steps.py`; the rollout's engine and decode backend: `plan/engines.py`), whether a user may force it (the [plan] key's type, allowed values or range, and
documentation), what `recommend --format toml` pins, and what it becomes in verl's overrides. The `Plan`,
the [plan] config section (`config.schema.PlanOverrides`), the CLI's table, the pinned config and the
verl export are all read from `TABLE`: adding a decision is a row here and a step in plan/steps.py.

The rows are in the order `recommend` shows them; the plan makes each decision on first use (a step
reads the decisions it depends on), so the order does not constrain the steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from edgerl.plan import engines, steps
from edgerl.plan.memory import fmt_bytes


def show(v: Any) -> str:
    """How a value reads in `recommend`: on/off, '-' for none, else as written."""
    if isinstance(v, bool):
        return "on" if v else "off"
    return "-" if v is None else str(v)


@dataclass(frozen=True)
class Decision:
    name: str                                 # the Plan's attribute; the [plan] key unless `key` says otherwise
    label: str                                # the row's name in `edgerl recommend`
    step: Callable[..., tuple[Any, str]]      # (Ctx) -> (value, reason): plan/steps.py, plan/engines.py
    doc: str = ""                             # what forcing it does (the [plan] key's documentation)
    override: Any = None                      # the [plan] key's type: bool, int, float or a tuple of the allowed
                                              # strings; None: users cannot force it from [plan]
    key: Optional[str] = None                 # the [plan] key, where it differs from `name` (a value in GiB)
    range: Optional[tuple[str, str]] = None   # numbers: ("[1, inf)", what the bound means), checked on load
    renamed: dict[str, str] = field(default_factory=dict)   # a former value -> the one-line error naming its
                                                            # replacement
    render: Callable[[Any], str] = show       # how `recommend` shows the value
    as_json: Callable[[Any], Any] = lambda v: v   # the value in plan.json
    pin: Union[bool, Callable[[Any], dict[str, Any]]] = False   # what `recommend --format toml` writes: True is
                                              # [plan].key = value; a function gives {"section.key": value}
    verl: Optional[Callable[[Any], list[str]]] = None   # (Plan) -> verl's Hydra overrides for it

    @property
    def config_key(self) -> str:
        return self.key or self.name

    def pinned(self, value: Any) -> dict[str, Any]:
        """The config keys (dotted) and values that reproduce this decision."""
        if callable(self.pin):
            return self.pin(value)
        return {f"plan.{self.config_key}": value} if self.pin else {}


def _dtype(v: Any) -> str:
    return f"{v['name']} (params {v['param']}, compute {v['compute']}{', grad scaler' if v['grad_scaler'] else ''})"


def _tiles(v: Any) -> str:
    return "-" if not v else ", ".join(f"{k}={val}" for k, val in v.items() if k != "reason")


def _lora(v: Any) -> str:
    return "off" if not v else f"r={v['rank']} alpha={v['alpha']:g} ({v['params'] / 1e6:.1f}M params)"


def _env(v: Any) -> str:
    return " ".join(f"{k}={val}" for k, val in v.items()) or "-"


def _lora_pin(v: Any) -> dict[str, Any]:
    # the targets the plan counted, so that a different architecture default cannot creep in
    return {"lora.enabled": bool(v)} | ({"lora.target_modules": list(v["targets"])} if v else {})


def _lora_verl(p: Any) -> list[str]:
    if not p.lora:
        return []
    from edgerl.plan.archs import DEFAULT_LORA_TARGETS
    targets = p.lora["targets"]
    return [f"actor_rollout_ref.model.lora_rank={p.lora['rank']}", f"actor_rollout_ref.model.lora_alpha={p.lora['alpha']:g}",
            "actor_rollout_ref.model.target_modules=" + ("all-linear" if tuple(targets) == DEFAULT_LORA_TARGETS  # the 7
                                                         else f"[{','.join(targets)}]")]   # projections verl means


def _correction_verl(p: Any) -> list[str]:
    """verl's rollout correction (algorithm.rollout_correction, decoupled mode: its old log-probs are the
    trainer's, as edgerl's): tis is its truncated weights (rollout_is); mis adds its rejection filter at the
    same level and threshold (rollout_rs token_k1 / seq_sum_k1, kept ratios in [1/C, C])."""
    mode, t = p.rollout_correction, p.task
    rc = "algorithm.rollout_correction"
    if mode == "none":
        return [f"{rc}.rollout_is=null", f"{rc}.rollout_rs=null"]
    rs = f"{'token' if t.rollout_correction_level == 'token' else 'seq_sum'}_k1"
    return (["actor_rollout_ref.rollout.calculate_log_probs=True", f"{rc}.rollout_is={t.rollout_correction_level}",
             f"{rc}.rollout_is_threshold={t.rollout_correction_threshold!r}"]
            + ([f"{rc}.rollout_rs={rs}", f"{rc}.rollout_rs_threshold={t.rollout_correction_threshold!r}"]
               if mode == "mis" else [f"{rc}.rollout_rs=null"]))


def _hf(dtype: str) -> str:
    from edgerl.plan.dtypes import hf_name
    return hf_name(dtype)


def _bytes(v: int) -> str:
    return fmt_bytes(v)


TABLE: tuple[Decision, ...] = (
    Decision("dtype", "dtype", steps.dtype, "compute dtype", ("fp32", "fp16", "bf16"),
             render=_dtype, as_json=dataclasses.asdict, pin=lambda v: {"plan.dtype": v.compute},
             verl=lambda p: [f"actor_rollout_ref.rollout.dtype={_hf(p.dtype.compute)}"]
             + ([f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={_hf(p.dtype.compute)}"]
                if p.dtype.compute != "bf16" else [])),
    Decision("fp16_check", "fp16 overflow check", steps.fp16_check),
    Decision("attention", "attention", steps.attention, "attention kernel", ("eager", "sdpa", "flash_attention_2"),
             pin=True, verl=lambda p: [f"+actor_rollout_ref.model.override_config.attn_implementation={p.attention}"]),
    Decision("attention_chunk", "attention chunk", steps.attention_chunk,
             "attend in chunks of this many query rows in training, each chunk's scores recomputed in the backward "
             "(0 or unset: one fused SDPA call where the GPU has an O(L)-memory kernel)", int,
             range=("[0, 1048576]", "leave it unset to let the plan choose (0: one fused SDPA call)"),
             pin=lambda v: {"plan.attention_chunk": v} if v else {}),
    Decision("rollout_engine", "rollout engine", engines.rollout_engine,
             "rollout engine: edgerl's static-cache decoder (static), transformers' generate (hf-generate) or a "
             "colocated vLLM (vllm)", tuple(engines.ENGINES), pin=True,
             renamed={"hf": "is now called 'static' (edgerl's static-cache decoder; transformers' generate is "
                            "'hf-generate'): set plan.rollout_engine=static"}),
    Decision("decode_backend", "decode backend", engines.decode_backend,
             "the static engine's decode step: five Triton kernels per layer (triton-layers; 16 bits, CC >= 8.0), "
             "torch's projections around edgerl's Triton rotary attention kernel (triton-attention; 16 bits, CC >= "
             "8.0), edgerl's CUDA C layer kernels, with the fused NF4 kernel over an NF4 base (cuda-c; fp32, or fp16 "
             "below CC 8.0, any CUDA GPU), or torch's ops (torch; every device)", tuple(engines.DECODE_BACKENDS),
             pin=True),
    Decision("kv_cache_dtype", "KV cache", steps.kv_cache_dtype,
             "storage of the static engine's KV cache: the compute dtype, or fp16 under fp32 compute with decode "
             "backend cuda-c (half the cache's bytes; the arithmetic stays fp32, and a key or value past fp16's range "
             "stops the rollout)", ("fp32", "fp16", "bf16"), pin=True),
    Decision("kernel_backend", "log-prob kernel", steps.kernel_backend, "log-prob kernel backend",
             ("torch", "triton"), pin=True),
    Decision("kernel_tiles", "kernel tiles", steps.kernel_tiles, render=_tiles),
    Decision("logprob_chunk", "log-prob chunk", steps.logprob_chunk),
    Decision("grad_checkpointing", "grad checkpointing", steps.searched_knob("grad_checkpointing"),
             "recompute activations in the backward pass", bool, pin=True,
             verl=lambda p: [f"actor_rollout_ref.model.enable_gradient_checkpointing={p.grad_checkpointing}"]),
    Decision("activation_offload", "activation offload", steps.activation_offload,
             "move the checkpointed layers' inputs to pinned host memory during the forward and back one layer ahead "
             "in the backward (CUDA)", bool, pin=True),
    Decision("swap_models", "swap models", steps.searched_knob("swap_models"),
             verl=lambda p: [f"actor_rollout_ref.ref.fsdp_config.param_offload={p.swap_models or p.param_offload}"]),
    Decision("optimizer_offload", "optimizer offload", steps.searched_knob("optimizer_offload"),
             "keep optimizer state in host memory", bool, pin=True,
             verl=lambda p: ["actor_rollout_ref.actor.fsdp_config.optimizer_offload="
                             f"{p.optimizer_offload or p.param_offload}"]),
    Decision("param_offload", "param offload", steps.searched_knob("param_offload"),
             "keep parameters in host memory (FSDP2 CPU offload)", bool, pin=True,
             verl=lambda p: [f"actor_rollout_ref.actor.fsdp_config.param_offload={p.param_offload}"]),
    Decision("optimizer", "optimizer", steps.optimizer,
             "optimizer and training-state format: fp32 AdamW with fp32 masters (16 bytes per parameter), 8-bit "
             "AdamW (bitsandbytes, CC >= 6.0, 10 bytes), or bf16 weights and AdamW state with Kahan compensation "
             "(adamw-bf16, 10 bytes) or stochastic rounding (adamw-bf16-sr, 8 bytes; native bf16, CC >= 8.0)",
             ("adamw", "adamw8bit", "adamw-bf16", "adamw-bf16-sr"), pin=True),
    Decision("lora", "LoRA", steps.lora, render=_lora, pin=_lora_pin, verl=_lora_verl),
    Decision("base_dtype", "LoRA base dtype", steps.base_dtype,
             "storage of the frozen LoRA base; None = the plan decides (the compute dtype, fp16 under fp32 compute, "
             "then int8 and nf4 when a float base does not fit). nf4/int8 quantize it with bitsandbytes (QLoRA): the "
             "reference and the rollout use the same quantized weights", ("fp32", "fp16", "bf16", "int8", "nf4"),
             pin=lambda v: {"plan.base_dtype": v} if v else {}),
    Decision("reward_model_dtype", "reward model dtype", steps.reward_model_dtype),
    Decision("micro_batch", "micro-batch", steps.searched_knob("micro_batch"),
             pin=lambda v: {"train.micro_batch": v},
             verl=lambda p: [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={p.micro_batch}"]),
    Decision("micro_batch_tokens", "micro-batch tokens", steps.micro_batch_tokens),
    Decision("score_micro_batch", "scoring micro-batch", steps.searched_knob("score_micro_batch"),
             "sequences per no-grad log-prob pass", int, range=("[1, 65536]", "leave it unset to let the plan choose"),
             pin=True,
             verl=lambda p: [f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={p.score_micro_batch}",
                             f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={p.score_micro_batch}"]),
    Decision("share_prompts", "shared prompts", steps.share_prompts,
             "the trainer's forward passes compute a prompt its samples share once per micro-batch", bool, pin=True),
    Decision("rollout_batch", "rollout batch", steps.searched_knob("rollout_batch"), "sequences generated at once",
             int, range=("[1, 65536]", "leave it unset to let the plan choose"), pin=True),
    Decision("rollout_resident", "rollout engine resident", steps.searched_knob("rollout_resident"),
             "keep the rollout engine's weights, KV cache and CUDA graphs on the GPU between steps (faster; the plan "
             "turns it on when memory allows)", bool),
    Decision("rollout_memory_share", "rollout memory share", steps.rollout_memory_share,
             "share of GPU memory the vllm engine may take", float, range=("(0, 1]", "a share of the GPU's memory"),
             verl=lambda p: ["actor_rollout_ref.rollout.gpu_memory_utilization="
                             f"{max(0.1, round(p.rollout_memory_share, 2))}"]),
    Decision("rollout_correction", "rollout correction", steps.rollout_correction,
             pin=lambda v: {"algo.rollout_correction": v}, verl=_correction_verl),
    Decision("env", "environment", steps.env, render=_env, as_json=dict),
    Decision("memory_limit", "memory limit", steps.memory_limit,
             "memory budget in GiB instead of the device's; on a GPU the run keeps it (torch's allocator is capped at "
             "it, less the CUDA context)", float, key="memory_gib",
             range=("(0, inf)", "leave it unset to use the device's memory"), render=_bytes),
    Decision("headroom", "headroom", steps.headroom, "memory kept free beyond the estimate, in GiB", float,
             key="headroom_gib", range=("[0, inf)", ""), render=_bytes),
)

# [plan] keys that no longer exist: the one-line error that names what replaced them
RETIRED: dict[str, str] = {
    "decode_attention": "set plan.decode_backend instead: triton-layers (was triton_layers), triton-attention (was "
                        "triton_rope), cuda-c (was cuda) or torch (was sdpa in 16 bits, bmm in fp32)",
    "rollout_compile": "the compiled decode step gave way to the Triton decode layers: set plan.decode_backend="
                       "triton-layers (or torch)",
    "cuda_graphs": "the static engine always replays its decode step from a CUDA graph on a GPU; "
                   "plan.decode_backend chooses the decode step's kernels",
    "nf4_kernel": "the fused NF4 kernel is part of plan.decode_backend=cuda-c (over an NF4 base; fp16 on tensor "
                  "cores from CC 7.5); "
                  "plan.decode_backend=torch leaves the NF4 matmuls to bitsandbytes",
}


def rows() -> dict[str, Decision]:
    """The table by decision name (read when called, so a test may extend TABLE)."""
    return {d.name: d for d in TABLE}
