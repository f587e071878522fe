"""The run config: typed, validated, read from TOML and `--set key=value` overrides.

One dataclass per section; every field carries its documentation in `doc=`, every number its
range in `RANGES`. Loading (edgerl/config_load.py) checks types (an int is accepted where a float
is wanted, `0.03` stays a float, a bool is never an int) and choices, names the closest valid key
for an unknown one, and names where a bad value came from (the file or the --set); `validate`
checks ranges and cross-field rules. `to_toml()` writes a file that `config_load.load_config()` reads back
unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from edgerl.core.errors import ConfigError


def F(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A dataclass field with its documentation attached."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    path: str = F("smollm2-135m-instruct", "HF model id, local HF folder, or a built-in name "
                  "('smollm2-135m-instruct' is embedded: no download)")
    tokenizer: Optional[str] = F(None, "tokenizer id or folder; defaults to the model's own")
    critic_path: Optional[str] = F(None, "critic backbone for PPO/GAE; defaults to the actor's model")
    trust_remote_code: bool = F(False, "passed to transformers when loading model and tokenizer")


@dataclass
class DataConfig:
    path: str = F("builtin:arithmetic", "training prompts: a .parquet/.jsonl/.json/.csv file, an HF "
                  "dataset name, or 'builtin:arithmetic' (generated, no download)")
    split: str = F("train", "split of an HF dataset")
    prompt_key: str = F("prompt", "column holding the prompt: a string or a chat list "
                        "[{'role': 'user', 'content': ...}] (verl format)")
    answer_key: str = F("reward_model.ground_truth", "column holding the reference answer; dots "
                        "reach into nested columns (verl: reward_model.ground_truth)")
    data_source_key: str = F("data_source", "column naming each row's reward function (verl "
                             "format); rows without it use data.default_source")
    default_source: Optional[str] = F(None, "reward function for rows without a data_source: "
                                      "'gsm8k', 'math', 'arithmetic', or None to require the column")
    chat_template: Literal["auto", "always", "never"] = F(
        "auto", "wrap plain prompt strings in the tokenizer's chat template: 'auto' when it has one")
    system_prompt: Optional[str] = F(None, "system message prepended when a chat template is applied")
    max_prompt_len: int = F(256, "prompt length limit in tokens")
    on_too_long: Literal["error", "filter"] = F(
        "error", "prompts over max_prompt_len: stop with the row numbers, or drop them and print how many")
    shuffle: bool = F(True, "shuffle prompts each epoch (seeded by train.seed)")
    difficulty: int = F(1, "builtin:arithmetic difficulty level, 1 (one-digit sums) to 4")
    num_examples: int = F(4096, "builtin:arithmetic number of problems generated")


@dataclass
class RewardConfig:
    function: Optional[str] = F(None, "custom reward 'path/to/file.py:fn' with verl's signature fn(data_source, "
                                "solution_str, ground_truth, extra_info) -> float | dict; None scores each row "
                                "by its data_source (gsm8k, math, arithmetic)")
    model: Optional[str] = F(None, "HF sequence-classification reward model (folder or id) whose score is "
                             "added to the rule reward")
    model_coef: float = F(1.0, "weight of the reward model's score")


@dataclass
class RolloutConfig:
    n_samples: int = F(4, "responses sampled per prompt (the GRPO group size)")
    max_new_tokens: int = F(128, "response length limit in tokens")
    temperature: float = F(1.0, "sampling temperature (also applied to the log-probs the loss uses)")
    top_p: float = F(1.0, "nucleus sampling threshold; 1.0 samples from the full distribution")
    top_k: int = F(0, "sample from the k most likely tokens; 0 disables")
    stop_at_eos: bool = F(True, "stop a response at the tokenizer's EOS token")


@dataclass
class AlgoConfig:
    advantage: str = F("grpo", "advantage estimator, one of edgerl.algos.ESTIMATORS: 'gae' (PPO: trains a "
                       "critic), 'grpo', 'rloo', 'reinforce++'")
    norm_adv_by_std: bool = F(True, "grpo: divide by the group std (False is Dr. GRPO)")
    gamma: float = F(1.0, "discount for gae and reinforce++")
    lam: float = F(0.95, "GAE lambda")
    kl_coef: float = F(0.001, "KL coefficient against the reference model; 0 skips loading the reference")
    kl_estimator: Literal["k1", "k2", "k3"] = F("k3", "KL estimator (Schulman's k1/k2/k3)")
    kl_in: Literal["loss", "reward"] = F("loss", "apply the KL as a loss term (GRPO) or subtract it "
                                         "from the token rewards (classic PPO)")
    kl_target: Optional[float] = F(None, "adaptive KL: the target KL per token; None keeps kl_coef fixed")
    kl_horizon: int = F(10000, "adaptive KL controller horizon")
    clip_low: float = F(0.2, "PPO ratio clip below 1")
    clip_high: float = F(0.2, "PPO ratio clip above 1 (DAPO's clip-higher uses 0.28)")
    dual_clip: Optional[float] = F(None, "dual-clip bound c > 1 for negative advantages; None disables")
    value_clip: float = F(0.2, "critic value clip")
    entropy_coef: float = F(0.0, "entropy bonus coefficient")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = F("token-mean", "how token losses are averaged")


@dataclass
class TrainConfig:
    steps: int = F(20, "optimizer steps to run (each: one rollout batch, ppo_epochs passes)")
    prompts_per_step: int = F(4, "prompts per step; sequences per step = prompts_per_step x n_samples")
    mini_batch: Optional[int] = F(None, "sequences per PPO update; None = all sequences of the step "
                                  "(one update per epoch)")
    micro_batch: Optional[int] = F(None, "sequences per forward/backward pass; None = chosen by the plan "
                                   "to fit memory")
    ppo_epochs: int = F(1, "passes over each rollout batch")
    lr: float = F(1e-6, "actor learning rate (AdamW)")
    critic_lr: float = F(1e-5, "critic learning rate")
    weight_decay: float = F(0.0, "AdamW weight decay")
    betas: list[float] = F(factory=lambda: [0.9, 0.999], doc="AdamW betas")
    warmup_ratio: float = F(0.0, "share of steps with a linear learning-rate warm-up")
    lr_schedule: Literal["constant", "cosine"] = F("constant", "learning-rate schedule after warm-up")
    min_lr_ratio: float = F(0.0, "cosine floor as a share of lr")
    max_grad_norm: float = F(1.0, "gradient clipping norm")
    max_bad_steps: int = F(3, "abort after this many NaN/inf losses in a row (each skips its update)")
    seed: int = F(0, "seed for data order, sampling and initialisation")


@dataclass
class LoraConfig:
    enabled: Optional[bool] = F(False, "train LoRA adapters instead of all weights; None lets the plan "
                                "turn it on when full fine-tuning does not fit on the GPU (it prefers LoRA to "
                                "streaming every weight over PCIe with FSDP2 parameter offload)")
    rank: int = F(16, "LoRA rank r")
    alpha: float = F(32.0, "LoRA alpha (scale = alpha / rank)")
    dropout: float = F(0.0, "LoRA dropout")
    target_modules: Optional[list[str]] = F(None, "module names to adapt; None = all attention and MLP "
                                            "projections (llama, qwen2, mistral); other architectures must "
                                            "name them")
    export_merged: bool = F(True, "also export the merged model (W + scale * B @ A) as a plain HF folder "
                            "<run>/final that transformers loads without peft; the adapter itself always goes "
                            "to <run>/final-adapter")


@dataclass
class PlanOverrides:
    """Force one decision of the plan; None leaves it to the plan (which explains its choice)."""
    dtype: Optional[Literal["fp32", "fp16", "bf16"]] = F(None, "compute dtype")
    attention: Optional[Literal["eager", "sdpa", "flash_attention_2"]] = F(None, "attention kernel")
    rollout_engine: Optional[Literal["hf", "vllm"]] = F(None, "rollout engine")
    cuda_graphs: Optional[bool] = F(None, "capture the decode step in a CUDA graph (hf engine)")
    rollout_compile: Optional[bool] = F(None, "torch.compile the decode step's decoder layers inside the CUDA "
                                        "graph (hf engine; CC >= 8.0, triton and a C compiler)")
    nf4_kernel: Optional[bool] = F(None, "the rollout's decode step multiplies by an NF4 base through edgerl's fused "
                                   "kernel (compiled with NVRTC) instead of bitsandbytes' dequantize + matmul")
    decode_attention: Optional[Literal["sdpa", "bmm", "triton", "triton_rope", "triton_layers", "cuda"]] = F(
        None, "how the hf engine's decode step attends over its KV cache: edgerl's Triton kernel doing the rotary "
        "embedding and the cache write too (triton_rope; 16 bits, CC >= 8.0), that kernel between Triton "
        "projections with the norms, SiLU * up and residual adds fused in (triton_layers; not compiled), the kernel "
        "alone (triton), edgerl's CUDA C layer kernels (cuda; fp32, any CUDA GPU), SDPA, or baddbmm/softmax/bmm")
    share_prompts: Optional[bool] = F(None, "the trainer's forward passes compute a prompt its samples share once "
                                      "per micro-batch")
    kernel_backend: Optional[Literal["torch", "triton"]] = F(None, "log-prob kernel backend")
    attention_chunk: Optional[int] = F(None, "attend in chunks of this many query rows in training, each chunk's "
                                       "scores recomputed in the backward (0 or unset: one fused SDPA call where "
                                       "the GPU has an O(L)-memory kernel)")
    grad_checkpointing: Optional[bool] = F(None, "recompute activations in the backward pass")
    activation_offload: Optional[bool] = F(None, "move the checkpointed layers' inputs to pinned host memory during "
                                           "the forward and back one layer ahead in the backward (CUDA)")
    param_offload: Optional[bool] = F(None, "keep parameters in host memory (FSDP2 CPU offload)")
    optimizer_offload: Optional[bool] = F(None, "keep optimizer state in host memory")
    optimizer: Optional[Literal["adamw", "adamw8bit", "adamw-bf16", "adamw-bf16-sr"]] = F(
        None, "optimizer and training-state format: fp32 AdamW with fp32 masters (16 bytes per parameter), 8-bit "
        "AdamW (bitsandbytes, CC >= 6.0, 10 bytes), or bf16 weights and AdamW state with Kahan compensation "
        "(adamw-bf16, 10 bytes) or stochastic rounding (adamw-bf16-sr, 8 bytes; native bf16, CC >= 8.0)")
    base_dtype: Optional[Literal["fp32", "fp16", "bf16", "int8", "nf4"]] = F(
        None, "storage of the frozen LoRA base; None = the plan decides (the compute dtype, fp16 under fp32 "
        "compute, then int8 and nf4 when a float base does not fit). nf4/int8 quantize it with bitsandbytes "
        "(QLoRA): the reference and the rollout use the same quantized weights")
    rollout_batch: Optional[int] = F(None, "sequences generated at once")
    rollout_resident: Optional[bool] = F(None, "keep the rollout engine's weights, KV cache and CUDA graphs on the "
                                         "GPU between steps (faster; the plan turns it on when memory allows)")
    score_micro_batch: Optional[int] = F(None, "sequences per no-grad log-prob pass")
    headroom_gib: Optional[float] = F(None, "memory kept free beyond the estimate")
    memory_gib: Optional[float] = F(None, "memory budget in GiB instead of the device's; on a GPU the run keeps it "
                                    "(torch's allocator is capped at it, less the CUDA context)")
    rollout_memory_share: Optional[float] = F(None, "share of GPU memory the vllm engine may take")


@dataclass
class RunConfig:
    out_dir: Optional[str] = F(None, "run folder; None = runs/<model>-<date>-<time>")
    save_every: int = F(10, "checkpoint every N steps (and on SIGINT/SIGTERM); 0 disables")
    keep_last: int = F(2, "checkpoints kept")
    export_final: bool = F(True, "write the final model as an HF folder in <run>/final")
    tensorboard: bool = F(True, "also log to TensorBoard when it is installed")
    profile: Optional[str] = F(None, "plan for (and emulate) this GPU profile instead of the probed GPU")
    profile_step: int = F(0, "record step N with torch's profiler: <run>/profile/step-N.txt (operators by "
                             "device and host time) and a Chrome trace beside it; 0 records none")


@dataclass
class Config:
    model: ModelConfig = F(factory=ModelConfig, doc="models")
    data: DataConfig = F(factory=DataConfig, doc="training data")
    reward: RewardConfig = F(factory=RewardConfig, doc="how responses are scored")
    rollout: RolloutConfig = F(factory=RolloutConfig, doc="sampling")
    algo: AlgoConfig = F(factory=AlgoConfig, doc="advantages, KL and losses")
    train: TrainConfig = F(factory=TrainConfig, doc="optimisation and batch sizes")
    lora: LoraConfig = F(factory=LoraConfig, doc="LoRA adapters")
    plan: PlanOverrides = F(factory=PlanOverrides, doc="overrides of the hardware plan")
    run: RunConfig = F(factory=RunConfig, doc="run folder, checkpoints, logging")

    @property
    def sequences_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.n_samples

    def effective_batch(self, planned_micro: Optional[int] = None) -> str:
        """The batch in one line, e.g. '4 prompts x 4 samples = 16 sequences per step; ...';
        `planned_micro` is the plan's micro-batch when the config leaves it to the plan."""
        seqs = self.sequences_per_step
        mini = self.train.mini_batch or seqs
        updates = (seqs // mini) * self.train.ppo_epochs
        micro = self.train.micro_batch
        micro_s = (f"micro-batch {micro}" if micro else f"micro-batch {planned_micro} (plan)" if planned_micro
                   else "micro-batch chosen by the plan")
        return (f"{self.train.prompts_per_step} prompts x {self.rollout.n_samples} samples = "
                f"{seqs} sequences per step; mini-batch {mini} -> {updates} update(s) per step; {micro_s}")

    def validate(self) -> "Config":
        """Every number in its range (`RANGES`), then the cross-field rules; raises ConfigError
        naming the keys and the fix."""
        from edgerl.algos import ESTIMATORS  # the registry says which estimators exist and what they need
        a, r, t = self.algo, self.rollout, self.train
        _check_ranges(self)
        if a.advantage not in ESTIMATORS:
            names = list(ESTIMATORS)
            close = difflib.get_close_matches(a.advantage, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"algo.advantage: {a.advantage!r} is not one of {', '.join(map(repr, names))}{hint}")
        if ESTIMATORS[a.advantage].groups and r.n_samples < 2:
            raise ConfigError(f"{a.advantage} needs rollout.n_samples >= 2 to form a group baseline; "
                              "set rollout.n_samples=4 or use algo.advantage=gae")
        if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
            raise ConfigError(f"train.betas needs two values in [0, 1), e.g. [0.9, 0.999]; got {t.betas}")
        seqs = self.sequences_per_step
        if t.mini_batch is not None and (t.mini_batch < 1 or seqs % t.mini_batch):
            raise ConfigError(f"train.mini_batch={t.mini_batch} must divide the {seqs} sequences per "
                              f"step ({self.train.prompts_per_step} prompts x {r.n_samples} samples); "
                              f"try one of {_divisors(seqs)}")
        mini = t.mini_batch or seqs
        if t.micro_batch is not None and (t.micro_batch < 1 or mini % t.micro_batch):
            raise ConfigError(f"train.micro_batch={t.micro_batch} must divide the mini-batch of {mini}; "
                              f"try one of {_divisors(mini)}")
        if self.lora.target_modules is not None and not self.lora.target_modules:
            raise ConfigError("lora.target_modules is an empty list; name modules such as "
                              "[\"q_proj\", \"v_proj\"], or leave it unset for the architecture's defaults")
        return self


# The range of every number that has one, as an interval ("(" excludes the bound, "[" includes it),
# with what the bound means. A value outside would fail later, mid-run, or train nothing.
RANGES: dict[str, tuple[str, str]] = {
    "rollout.n_samples": ("[1, inf)", ""),
    "rollout.max_new_tokens": ("[1, inf)", ""),
    "rollout.temperature": ("(0, inf)", "for near-greedy sampling use a small value such as 0.1"),
    "rollout.top_p": ("(0, 1]", "1.0 samples from the full distribution"),
    "rollout.top_k": ("[0, inf)", "0 samples from every token"),
    "train.steps": ("[0, inf)", ""),
    "train.prompts_per_step": ("[1, inf)", ""),
    "train.ppo_epochs": ("[1, inf)", ""),
    "train.lr": ("(0, inf)", "a negative rate climbs the loss instead of descending it; typical: 1e-6 for full "
                 "fine-tuning, 1e-5 to 1e-4 with LoRA"),
    "train.critic_lr": ("(0, inf)", "typical: 1e-5"),
    "train.weight_decay": ("[0, inf)", "0 turns it off"),
    "train.warmup_ratio": ("[0, 1)", "a share of train.steps"),
    "train.min_lr_ratio": ("[0, 1]", "the cosine schedule's floor, as a share of train.lr"),
    "train.max_grad_norm": ("(0, inf)", "gradients are scaled down to this norm, so 0 would erase them; a large "
                            "value such as 1e9 clips nothing"),
    "train.max_bad_steps": ("[1, inf)", ""),
    "algo.gamma": ("[0, 1]", "a discount per token: 1.0 does not discount"),
    "algo.lam": ("[0, 1]", "GAE's lambda: 1.0 is Monte Carlo, 0 is one-step TD"),
    "algo.kl_coef": ("[0, inf)", "0 turns the KL term off"),
    "algo.kl_target": ("(0, inf)", "a KL per token such as 0.01; leave it unset for a fixed algo.kl_coef"),
    "algo.kl_horizon": ("[1, inf)", ""),
    "algo.clip_low": ("[0, 1)", "the ratio is clipped below at 1 - clip_low, which must stay above 0; typical: 0.2"),
    "algo.clip_high": ("[0, inf)", "typical: 0.2 (0.28 for DAPO's clip-higher)"),
    "algo.dual_clip": ("(1, inf)", "e.g. 3.0; leave it unset to turn it off"),
    "algo.value_clip": ("(0, inf)", "typical: 0.2"),
    "data.max_prompt_len": ("[1, inf)", ""),
    "data.difficulty": ("[1, 4]", ""),
    "data.num_examples": ("[1, inf)", ""),
    "lora.rank": ("[1, inf)", ""),
    "lora.alpha": ("(0, inf)", "the adapter's scale is alpha / rank"),
    "lora.dropout": ("[0, 1)", ""),
    "plan.rollout_batch": ("[1, inf)", "leave it unset to let the plan choose"),
    "plan.score_micro_batch": ("[1, inf)", "leave it unset to let the plan choose"),
    "plan.attention_chunk": ("[0, inf)", "leave it unset to let the plan choose (0: one fused SDPA call)"),
    "plan.headroom_gib": ("[0, inf)", ""),
    "plan.memory_gib": ("(0, inf)", "leave it unset to use the device's memory"),
    "plan.rollout_memory_share": ("(0, 1]", "a share of the GPU's memory"),
    "run.save_every": ("[0, inf)", "0 writes no periodic checkpoint"),
    "run.keep_last": ("[1, inf)", ""),
    "run.profile_step": ("[0, inf)", "0 records no step"),
}


def _interval(spec: str) -> tuple[float, float, bool, bool]:
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    return lo, hi, spec[0] == "[", spec[-1] == "]"


def _in_words(spec: str, integer: bool) -> str:
    lo, hi, lo_in, hi_in = _interval(spec)
    if math.isinf(hi):
        return f"at least {lo:g}" if integer and lo_in else f"{'>=' if lo_in else '>'} {lo:g}"
    return f"in {spec}" if not integer else f"{lo:g} to {hi:g}"


def _check_ranges(cfg: "Config") -> None:
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")
            if isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
                raise ConfigError(f"{section.name}.{f.name} must hold finite numbers, got {value}")
    for key, (spec, why) in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None:
            continue
        lo, hi, lo_in, hi_in = _interval(spec)
        if (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi):
            continue
        if key == "train.lr" and value == 0:
            raise ConfigError("train.lr = 0 would run every step (rollouts, rewards, backward passes) without "
                              "changing a weight; set a learning rate such as 1e-6 (full fine-tuning) or 1e-5 "
                              "(LoRA)")
        raise ConfigError(f"{key} must be {_in_words(spec, isinstance(value, int))}, got {value}"
                          + (f"; {why}" if why else ""))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- writing -----------------------------------------------------------------------------------

def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Config, comments: dict[str, str] | None = None) -> str:
    """TOML text that `load_config` reads back to an equal Config. None values are left out
    (they are the defaults' 'let the plan decide'); `comments` maps 'section.key' to a note."""
    comments = comments or {}
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            note = comments.get(f"{section.name}.{f.name}") or f.metadata.get("doc", "")
            if value is None:
                lines.append(f"# {f.name} = (unset)  # {note}")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}  # {note}")
        lines.append("")
    return "\n".join(lines)
