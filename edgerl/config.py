"""The run config: typed, validated, read from TOML and `--set key=value` overrides.

One dataclass per section; every field carries its documentation in `doc=`. Loading checks
types (an int is accepted where a float is wanted, `0.03` stays a float, a bool is never an
int), choices, and cross-field rules, and an unknown key is an error that names the closest
valid key. `to_toml()` writes a file that `load_config()` reads back unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional
from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib




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
    kernel_backend: Optional[Literal["torch", "triton"]] = F(None, "log-prob kernel backend")
    grad_checkpointing: Optional[bool] = F(None, "recompute activations in the backward pass")
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
    memory_gib: Optional[float] = F(None, "memory budget in GiB instead of the device's")
    rollout_memory_share: Optional[float] = F(None, "share of GPU memory the vllm engine may take")


@dataclass
class RunConfig:
    out_dir: Optional[str] = F(None, "run folder; None = runs/<model>-<date>-<time>")
    save_every: int = F(10, "checkpoint every N steps (and on SIGINT/SIGTERM); 0 disables")
    keep_last: int = F(2, "checkpoints kept")
    export_final: bool = F(True, "write the final model as an HF folder in <run>/final")
    tensorboard: bool = F(True, "also log to TensorBoard when it is installed")
    profile: Optional[str] = F(None, "plan for (and emulate) this GPU profile instead of the probed GPU")


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
        """Cross-field rules; raises ConfigError naming the keys and the fix."""
        from .algos import ESTIMATORS  # the registry says which estimators exist and what they need
        a, r, t = self.algo, self.rollout, self.train
        if a.advantage not in ESTIMATORS:
            names = list(ESTIMATORS)
            close = difflib.get_close_matches(a.advantage, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"algo.advantage: {a.advantage!r} is not one of {', '.join(map(repr, names))}{hint}")
        if ESTIMATORS[a.advantage].groups and r.n_samples < 2:
            raise ConfigError(f"{a.advantage} needs rollout.n_samples >= 2 to form a group baseline; "
                              "set rollout.n_samples=4 or use algo.advantage=gae")
        positive = {"rollout.n_samples": r.n_samples, "rollout.max_new_tokens": r.max_new_tokens,
                    "train.prompts_per_step": t.prompts_per_step, "train.ppo_epochs": t.ppo_epochs,
                    "data.max_prompt_len": self.data.max_prompt_len, "lora.rank": self.lora.rank,
                    "run.keep_last": self.run.keep_last, "train.max_bad_steps": t.max_bad_steps}
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key} must be at least 1, got {value}")
        if t.steps < 0 or self.run.save_every < 0:
            raise ConfigError("train.steps and run.save_every must not be negative")
        if r.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0, got {r.temperature}; "
                              "for near-greedy sampling use a small value such as 0.1")
        if not 0 < r.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
        if not 0 <= t.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
        if a.dual_clip is not None and a.dual_clip <= 1:
            raise ConfigError(f"algo.dual_clip must be > 1 (e.g. 3.0), got {a.dual_clip}")
        if a.kl_coef < 0:
            raise ConfigError(f"algo.kl_coef must be >= 0, got {a.kl_coef}")
        if len(t.betas) != 2:
            raise ConfigError(f"train.betas needs two values, e.g. [0.9, 0.999]; got {t.betas}")
        seqs = self.sequences_per_step
        if t.mini_batch is not None and (t.mini_batch < 1 or seqs % t.mini_batch):
            raise ConfigError(f"train.mini_batch={t.mini_batch} must divide the {seqs} sequences per "
                              f"step ({self.train.prompts_per_step} prompts x {r.n_samples} samples); "
                              f"try one of {_divisors(seqs)}")
        mini = t.mini_batch or seqs
        if t.micro_batch is not None and (t.micro_batch < 1 or mini % t.micro_batch):
            raise ConfigError(f"train.micro_batch={t.micro_batch} must divide the mini-batch of {mini}; "
                              f"try one of {_divisors(mini)}")
        if self.lora.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0 (the adapter's scale is alpha / rank), got {self.lora.alpha}")
        if not 0 <= self.lora.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.lora.dropout}")
        if self.lora.target_modules is not None and not self.lora.target_modules:
            raise ConfigError("lora.target_modules is an empty list; name modules such as "
                              "[\"q_proj\", \"v_proj\"], or leave it unset for the architecture's defaults")
        if not 1 <= self.data.difficulty <= 4:
            raise ConfigError(f"data.difficulty must be 1 to 4, got {self.data.difficulty}")
        return self


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- loading -----------------------------------------------------------------------------------

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it (int -> float where a float is wanted)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    # also try a case-insensitive / dotted-suffix match (e.g. 'lr' under the wrong section)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{prefix}{key}'{hint} (valid keys under "
                       f"'{prefix.rstrip('.') or 'the top level'}': {', '.join(valid)})")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(key, names, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"'{prefix}{key}' is a section; write it as [{prefix}{key}] with keys "
                                  f"{', '.join(f.name for f in dataclasses.fields(tp))}")
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def parse_set(item: str) -> tuple[list[str], Any]:
    """Parse one `--set section.key=value`; the value is read as TOML, else taken as a string."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.lr=1e-6")
    key, raw = item.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: the key is empty")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as grpo or a path
    if raw.lower() in ("none", "null"):
        value = None
    return key.split("."), value


def _merge(base: dict[str, Any], path: list[str], value: Any) -> None:
    node = base
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: '{part}' is a value, not a section")
    node[path[-1]] = value


def load_config(path: str | Path | None = None, sets: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None) -> Config:
    """Read a TOML file (optional), apply `--set` overrides in order, validate."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        try:
            data = _deep_update(data, tomllib.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    for item in sets:
        keys, value = parse_set(item)
        _merge(data, keys, value)
    try:
        cfg = _build(Config, data)
    except ConfigError as e:
        where = f" (in {path})" if path is not None else ""
        raise ConfigError(f"{e}{where}") from None
    return cfg.validate()


def _deep_update(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
