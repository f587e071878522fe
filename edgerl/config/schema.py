"""The run config: typed, validated, read from TOML and `--set key=value` overrides.

One dataclass per section; every field carries its documentation in `doc=`, every number its
range in `RANGES`. The [plan] section is built from the plan's decision table (`edgerl.plan.table`):
its keys, types, allowed values, ranges and documentation are the table's. Loading
(edgerl/config/load.py) checks types (an int is accepted where a float is wanted, `0.03` stays a
float, a bool is never an int) and choices, names the closest valid key for an unknown one (and the
new key for a retired one), and names where a bad value came from (the file or the --set); `validate`
checks ranges and cross-field rules. `to_toml()` writes a file that `load.load_config()` reads back
unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from edgerl.core.errors import ConfigError
from edgerl.plan import table
from edgerl.core.files import check_path, shown
from edgerl.rewards.contain import MAX_ABS_REWARD


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
    max_prompt_len: int = F(512, "prompt length limit in tokens (the longest prompt of GSM8K's train split, as `edgerl data "
                            "prepare gsm8k` writes it, is 268 tokens under SmolLM2's chat template)")
    on_too_long: Literal["error", "filter"] = F(
        "error", "prompts over max_prompt_len: stop with the row numbers, or drop them and print how many")
    shuffle: bool = F(True, "shuffle prompts each epoch (seeded by train.seed)")
    difficulty: int = F(1, "builtin:arithmetic difficulty level, 1 (one-digit sums) to 4")
    num_examples: int = F(4096, "builtin:arithmetic number of problems generated")


@dataclass
class RewardConfig:
    functions: list[str] = F(factory=lambda: ["answer"], doc=(
        "reward functions summed with reward.weights, each a built-in name or 'path/to/file.py:fn': 'answer' "
        "(each row's answer checked by its data_source's rule: gsm8k, math, arithmetic), 'format' (<think>...</think> "
        "then an answer); a user function takes verl's per-sample arguments (data_source, solution_str, "
        "ground_truth, extra_info) or TRL's batched ones (prompts, completions, **kwargs) -> list[float] "
        "(docs/rewards.md). Each one's mean is logged as reward/<name>"))
    weights: Optional[list[float]] = F(None, "one weight per reward function; None weighs each 1.0")
    function: Optional[str] = F(None, "one user reward 'path/to/file.py:fn' (the --reward option): the same as "
                                "reward.functions = [it]")
    model: Optional[str] = F(None, "HF sequence-classification reward model (folder or id) whose score is "
                             "added to the rule reward")
    model_coef: float = F(1.0, "weight of the reward model's score")
    timeout_s: float = F(30.0, "seconds one call of reward.function may take (a call scores one sample); the "
                         "function runs in a process of its own, stopped when the time is up, and the run stops "
                         "with its last completed step saved. 0: no limit (Ctrl-C still stops it)")


@dataclass
class RolloutConfig:
    n_samples: int = F(4, "responses sampled per prompt (the GRPO group size)")
    max_new_tokens: int = F(1024, "response length limit in tokens (step-by-step answers to GSM8K take a few "
                            "hundred; the plan sizes the KV cache and activations for it)")
    temperature: float = F(1.0, "sampling temperature (also applied to the log-probs the loss uses)")
    top_p: float = F(1.0, "nucleus sampling threshold; 1.0 samples from the full distribution")
    top_k: int = F(0, "sample from the k most likely tokens; 0 disables")
    stop_at_eos: bool = F(True, "stop a response at the tokenizer's EOS token")
    tools: list[str] = F(factory=list, doc=(
        "tools the model may call in episodes of several turns (docs/agents.md): built-in 'calculator' and "
        "'python', or 'path/to/file.py:function' (its signature and docstring are the schema); each call runs in "
        "a worker process, confined to a scratch folder"))
    environment: Optional[str] = F(None, "an environment 'path/to/file.py:Class' (reset(row), step(text) -> "
                                   "observation, reward, done) the model talks with over several turns")
    max_turns: Optional[int] = F(None, "model turns per episode at most (with rollout.tools or "
                                 "rollout.environment); None: 4")
    max_episode_tokens: Optional[int] = F(None, "tokens after the prompt per episode at most: the model's turns "
                                          "and everything between them; None: max_turns x max_new_tokens. The plan "
                                          "sizes memory for it")
    turn_discount: float = F(1.0, "an environment's per-turn rewards enter the episode's reward as sum over turns "
                             "k of discount^k x reward_k (1.0: their sum)")
    tool_timeout_s: float = F(10.0, "seconds one tool call (or environment step) may take")
    tool_memory_mb: int = F(1024, "memory a tool worker may allocate beyond its own, in MiB")
    tool_max_chars: int = F(2000, "characters of a tool's result the model reads; the rest is cut, with a note")
    tool_workers: int = F(2, "worker processes serving tool calls (calls of different episodes run in parallel)")

    @property
    def episodes(self) -> bool:
        """Episodes of several turns: tools or an environment answer the model."""
        return bool(self.tools) or self.environment is not None

    def turns(self) -> int:
        return (self.max_turns or 4) if self.episodes else 1

    def response_tokens(self) -> int:
        """Tokens after the prompt the plan sizes memory for: the episode's budget, or one response."""
        if not self.episodes:
            return self.max_new_tokens
        return self.max_episode_tokens or self.turns() * self.max_new_tokens

    def cache_tokens(self) -> int:
        """Tokens after the prompt a row's KV cache holds: the response, or the episode's budget and one turn
        more (the static engine aligns an episode's rows at the longest: edgerl/rollout/turns_static.py)."""
        return self.response_tokens() + (self.max_new_tokens if self.episodes else 0)


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
    policy_loss: str = F("ppo", "policy loss, one of edgerl.algos.POLICY_LOSSES (docs/policy-losses.md has a row "
                         "for each): 'ppo' is PPO's clipped surrogate per token")
    clip_low: Optional[float] = F(None, "ratio clip below 1 (the ratio is clipped at 1 - clip_low); None: the "
                                  "policy loss's own (0.2 for ppo; docs/policy-losses.md)")
    clip_high: Optional[float] = F(None, "ratio clip above 1 (at 1 + clip_high); None: the policy loss's own "
                                   "(0.2 for ppo, and DAPO's clip-higher uses 0.28; docs/policy-losses.md)")
    dual_clip: Optional[float] = F(None, "the dual-clip bound c > 1 for negative advantages, for a policy loss "
                                   "that takes one (ppo); None disables")
    value_clip: float = F(0.2, "critic value clip")
    entropy_coef: float = F(0.0, "entropy bonus coefficient")
    loss_agg: Optional[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                               "seq-mean-token-sum-norm"]] = F(
        None, "how token losses are averaged; None: seq-mean-token-mean for gspo (its ratio is per "
        "sequence), token-mean otherwise")

    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high) in effect: the ones set, else the policy loss's own."""
        from edgerl.algos import POLICY_LOSSES
        own = POLICY_LOSSES[self.policy_loss]
        return (own.clip_low if self.clip_low is None else self.clip_low,
                own.clip_high if self.clip_high is None else self.clip_high)

    def loss_agg_mode(self) -> str:
        """The aggregation in effect: the one set, else the policy loss's own, else token-mean."""
        from edgerl.algos import POLICY_LOSSES
        return self.loss_agg or POLICY_LOSSES[self.policy_loss].agg or "token-mean"
    skip_uniform_groups: bool = F(True, "leave the rows of a group whose rewards are all equal (zero advantages "
                                  "under grpo and rloo) out of the update's forward and backward passes, where that "
                                  "changes nothing: no KL loss term, no entropy bonus, no LoRA dropout, one process; "
                                  "the run log says when it cannot. Logged: batch/uniform_groups")
    dynamic_sampling: bool = F(False, "DAPO's dynamic sampling: draw more prompts until the step holds "
                               "train.prompts_per_step groups whose rewards differ (at most algo.max_extra_draws "
                               "more batches; the rest is filled with uniform groups)")
    max_extra_draws: int = F(3, "dynamic sampling: batches of prompts drawn beyond the first, at most, per step")
    overlong: Literal["none", "mask", "soft_penalty"] = F(
        "none", "responses cut at rollout.max_new_tokens: 'mask' leaves them out of the loss (DAPO's overlong "
        "filtering); 'soft_penalty' subtracts DAPO's length penalty, growing linearly over the last "
        "algo.overlong_buffer tokens to algo.overlong_penalty at the limit")
    overlong_buffer: Optional[int] = F(None, "soft_penalty: tokens before rollout.max_new_tokens where the penalty "
                                       "starts; None = a quarter of rollout.max_new_tokens")
    overlong_penalty: float = F(1.0, "soft_penalty: the penalty at rollout.max_new_tokens")
    rollout_correction: Optional[Literal["none", "tis", "mis"]] = F(
        None, "weigh each token's policy loss by the trainer's probability over the rollout engine's "
        "(docs/rollout-correction.md): 'tis' caps the ratio at algo.rollout_correction_threshold (truncated "
        "importance sampling), 'mis' also zeroes units whose ratio is outside [1/threshold, threshold] (masked); "
        "None: the plan decides (tis wherever the engine computes differently from the trainer)")
    rollout_correction_level: Literal["token", "sequence"] = F(
        "token", "rollout correction ratio per token, or one per sequence (the product of its token ratios)")
    rollout_correction_threshold: float = F(2.0, "rollout correction cap C on the ratio (mis keeps [1/C, C])")


@dataclass
class TrainConfig:
    steps: int = F(20, "optimizer steps to run (each: one rollout batch, ppo_epochs passes)")
    prompts_per_step: int = F(4, "prompts per step; sequences per step = prompts_per_step x n_samples (sft: rows "
                              "per step)")
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
    max_bad_steps: int = F(3, "stop after this many steps in a row that went NaN/inf (a loss or gradient norm: "
                              "the update is skipped; a rollout's log-probs: nothing trains on it)")
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
class SftConfig:
    enabled: bool = F(False, "supervised fine-tuning instead of RL (`edgerl sft` sets it): data.path holds chat rows "
                      "(sft.messages_key) or prompt/response pairs (data.prompt_key, sft.response_key), and the loss "
                      "is the cross-entropy of the assistant tokens; the rollout, algo, reward and eval settings are "
                      "not used. Its final/ model starts RL with edgerl train --model RUN/final")
    messages_key: str = F("messages", "column holding a chat: a list of {'role': system|user|assistant, 'content': "
                          "...}; every assistant message is learned")
    response_key: str = F("response", "column holding the response of a prompt/response row (the prompt is "
                          "data.prompt_key: a string or a chat list)")
    max_len: int = F(1024, "tokens per row (the chat template rendered, prompt and answer); the plan sizes "
                     "activations for it; longer rows follow data.on_too_long")


def plan_overrides(rows) -> type:
    """The [plan] section: one key per row of the plan's decision table (`edgerl.plan.table`) that users may
    force, with the row's type, allowed values, range and documentation; None leaves the decision to the
    plan (which explains its choice)."""
    fields = []
    for d in rows:
        if d.override is None:
            continue
        tp = Literal[d.override] if isinstance(d.override, tuple) else d.override
        fields.append((d.config_key, Optional[tp], field(default=None, metadata={"doc": d.doc, "range": d.range})))
    return dataclasses.make_dataclass("PlanOverrides", fields, namespace={
        "__doc__": "Force one decision of the plan; None leaves it to the plan (which explains its choice).",
        "__module__": __name__,
        "RETIRED": dict(table.RETIRED), "RENAMED": {d.config_key: d.renamed for d in rows if d.renamed}})


PlanOverrides = plan_overrides(table.TABLE)


@dataclass
class RunConfig:
    out_dir: Optional[str] = F(None, "run folder; None = runs/<model>-<date>-<time>")
    save_every: int = F(10, "checkpoint every N steps (and on SIGINT/SIGTERM); 0 disables")
    keep_last: int = F(2, "the newest checkpoints kept (a new one is complete before an old one goes)")
    keep_best: bool = F(True, "also keep the checkpoint with the best held-out score (eval.data, at a step "
                        "that is both evaluated and saved), however old")
    final_only: bool = F(False, "when the run finishes and final/ is written, remove its checkpoints; the best "
                         "(run.keep_best) keeps its weights without the optimizer state. The run can no longer "
                         "be extended with --resume (edgerl train --final-only)")
    export_final: bool = F(True, "write the final model as an HF folder in <run>/final")
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = F(
        factory=lambda: ["jsonl", "tensorboard"], doc="where metrics go besides metrics.jsonl (always written): "
        "'tensorboard' (when installed), 'wandb' (pip install 'edgerl[wandb]'), 'mlflow' (pip install "
        "'edgerl[mlflow]'); rank 0 only")
    tensorboard: Optional[bool] = F(None, "false drops 'tensorboard' from run.loggers, true adds it (the key "
                                    "before run.loggers)")
    project: Optional[str] = F(None, "wandb project / MLflow experiment; None: $WANDB_PROJECT or "
                               "$MLFLOW_EXPERIMENT_NAME, else 'edgerl'")
    log_samples: int = F(0, "prompt/response/reward rows written per step and per evaluation to "
                         "<run>/samples.jsonl (and TensorBoard's text tab); 0 writes none")
    profile: Optional[str] = F(None, "plan for (and emulate) this GPU profile instead of the probed GPU")
    profile_step: int = F(0, "record step N with torch's profiler: <run>/profile/step-N.txt (operators by "
                             "device and host time) and a Chrome trace beside it; 0 records none")


@dataclass
class EvalConfig:
    data: Optional[str] = F(None, "held-out prompts: a .parquet/.jsonl/.json/.csv file, an HF dataset name or "
                            "'builtin:arithmetic' (problems generated apart from the training ones); columns as "
                            "data.*. None: no evaluation")
    split: Optional[str] = F(None, "split of an HF dataset; None: 'test', else 'validation', where the dataset has one")
    every: int = F(0, "evaluate every N steps, besides before the first step and after the last; 0: only those two")
    samples: int = F(0, "k responses sampled per prompt (at rollout.temperature) for eval/mean@k and eval/pass@k "
                     "besides the greedy eval/accuracy; 0: greedy only")
    max_prompts: Optional[int] = F(None, "evaluate the first N prompts; None: all (the built-in task: 256)")


@dataclass
class Config:
    model: ModelConfig = F(factory=ModelConfig, doc="models")
    data: DataConfig = F(factory=DataConfig, doc="training data")
    reward: RewardConfig = F(factory=RewardConfig, doc="how responses are scored")
    rollout: RolloutConfig = F(factory=RolloutConfig, doc="sampling")
    algo: AlgoConfig = F(factory=AlgoConfig, doc="advantages, KL and losses")
    train: TrainConfig = F(factory=TrainConfig, doc="optimisation and batch sizes")
    lora: LoraConfig = F(factory=LoraConfig, doc="LoRA adapters")
    sft: SftConfig = F(factory=SftConfig, doc="supervised fine-tuning (edgerl sft)")
    plan: PlanOverrides = F(factory=lambda: PlanOverrides(), doc="overrides of the hardware plan")
    eval: EvalConfig = F(factory=EvalConfig, doc="held-out evaluation while training")
    run: RunConfig = F(factory=RunConfig, doc="run folder, checkpoints, logging")

    @property
    def sequences_per_step(self) -> int:
        return self.train.prompts_per_step * (1 if self.sft.enabled else self.rollout.n_samples)

    def effective_batch(self, planned_micro: Optional[int] = None) -> str:
        """The batch in one line, e.g. '4 prompts x 4 samples = 16 sequences per step; ...';
        `planned_micro` is the plan's micro-batch when the config leaves it to the plan."""
        seqs = self.sequences_per_step
        mini = self.train.mini_batch or seqs
        updates = (seqs // mini) * self.train.ppo_epochs
        micro = self.train.micro_batch
        if self.sft.enabled:
            micro_s = f"micro-batch {micro}" if micro else f"micro-batch {planned_micro} (plan)" if planned_micro \
                else "micro-batch chosen by the plan"
            return f"{seqs} rows per step; mini-batch {mini} -> {seqs // mini} update(s) per step; {micro_s}"
        micro_s = (f"micro-batch {micro}" if micro else f"micro-batch {planned_micro} (plan)" if planned_micro
                   else "micro-batch chosen by the plan")
        return (f"{self.train.prompts_per_step} prompts x {self.rollout.n_samples} samples = "
                f"{seqs} sequences per step; mini-batch {mini} -> {updates} update(s) per step; {micro_s}")

    def validate(self) -> "Config":
        """Every number in its range (`RANGES`), then the cross-field rules; raises ConfigError
        naming the keys and the fix."""
        from edgerl.algos import ESTIMATORS, POLICY_LOSSES  # the registries say what exists and what it needs
        a, r, t = self.algo, self.rollout, self.train
        _check_ranges(self)
        for key in PATH_KEYS:
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if value is not None:   # reward.function is 'path/to/file.py:fn'
                check_path(value.rsplit(":", 1)[0] if key == "reward.function" and ":" in value else value, key)
        for spec in self.reward.functions or []:   # a user function's file: 'path/to/file.py:fn'
            if isinstance(spec, str) and ":" in spec:
                check_path(spec.rsplit(":", 1)[0], "reward.functions")
        self._validate_episodes()
        for key, value, registry in (("algo.advantage", a.advantage, ESTIMATORS),
                                     ("algo.policy_loss", a.policy_loss, POLICY_LOSSES)):
            if value not in registry:
                names = list(registry)
                close = difflib.get_close_matches(value, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, names))}{hint}")
        if ESTIMATORS[a.advantage].groups and r.n_samples < 2 and not self.sft.enabled:
            raise ConfigError(f"{a.advantage} needs rollout.n_samples >= 2 to form a group baseline; "
                              "set rollout.n_samples=4 or use algo.advantage=gae")
        if self.run.final_only and not self.run.export_final:
            raise ConfigError("run.final_only removes the checkpoints once final/ is written, but run.export_final "
                              "= false writes no final/; set run.export_final = true or drop run.final_only")
        if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
            raise ConfigError(f"train.betas needs two values in [0, 1), e.g. [0.9, 0.999]; got {t.betas}")
        seqs = self.sequences_per_step
        if seqs > MAX_SEQUENCES:
            raise ConfigError(f"train.prompts_per_step={t.prompts_per_step} x rollout.n_samples={r.n_samples} = "
                              f"{seqs} sequences per step, more than the {MAX_SEQUENCES} edgerl plans for; lower "
                              "one of them")
        if t.mini_batch is not None and (t.mini_batch < 1 or seqs % t.mini_batch):
            raise ConfigError(f"train.mini_batch={t.mini_batch} must divide the {seqs} sequences per "
                              f"step ({self.train.prompts_per_step} prompts x {r.n_samples} samples); "
                              f"try one of {_divisors(seqs)}")
        mini = t.mini_batch or seqs
        if t.micro_batch is not None and (t.micro_batch < 1 or mini % t.micro_batch):
            raise ConfigError(f"train.micro_batch={t.micro_batch} must divide the mini-batch of {mini}; "
                              f"try one of {_divisors(mini)}")
        own = POLICY_LOSSES[a.policy_loss]
        if a.dual_clip is not None and not own.dual_clip:
            takes = ", ".join(n for n, loss in POLICY_LOSSES.items() if loss.dual_clip)
            raise ConfigError(f"algo.dual_clip is {takes}'s; algo.policy_loss={a.policy_loss} has no dual clip: "
                              "leave algo.dual_clip unset")
        if own.agg is not None and a.loss_agg not in (None, own.agg):
            raise ConfigError(f"algo.policy_loss={a.policy_loss} averages per sequence ({own.agg}), its ratio "
                              f"being one per sequence; algo.loss_agg={a.loss_agg} contradicts it: leave "
                              f"algo.loss_agg unset or set it to {own.agg}")
        if self.lora.target_modules is not None and not self.lora.target_modules:
            raise ConfigError("lora.target_modules is an empty list; name modules such as "
                              "[\"q_proj\", \"v_proj\"], or leave it unset for the architecture's defaults")
        self._validate_rewards()
        if a.dynamic_sampling and not ESTIMATORS[a.advantage].groups:
            raise ConfigError(f"algo.dynamic_sampling keeps groups whose rewards differ, and {a.advantage} has no "
                              "groups; use algo.advantage=grpo or rloo, or set algo.dynamic_sampling=false")
        if a.overlong_buffer is not None and a.overlong_buffer > r.max_new_tokens:
            raise ConfigError(f"algo.overlong_buffer={a.overlong_buffer} is longer than rollout.max_new_tokens="
                              f"{r.max_new_tokens}; the penalty starts that many tokens before the limit: lower it")
        e = self.eval
        if self.sft.enabled and e.data is not None:
            raise ConfigError("eval.data evaluates RL runs with generated answers; an sft run does not evaluate: "
                              "leave eval.data unset (evaluate the result with edgerl eval RUN --data ...)")
        if self.sft.enabled and r.episodes:
            raise ConfigError("rollout.tools and rollout.environment run episodes in RL; an sft run learns from written "
                              "conversations: leave them unset (edgerl train with them after the sft run)")
        if self.sft.enabled and self.data.path.startswith("builtin:"):
            raise ConfigError(f"sft learns from written answers; data.path={self.data.path} holds prompts only: give "
                              "a .jsonl/.parquet/.json/.csv of chat rows (sft.messages_key) or prompt/response pairs")
        if e.data is None:
            for key, value, default in (("every", e.every, 0), ("samples", e.samples, 0),
                                        ("max_prompts", e.max_prompts, None), ("split", e.split, None)):
                if value != default:
                    raise ConfigError(f"eval.{key} is set but eval.data is not; name the held-out prompts with "
                                      "eval.data (a file, an HF dataset or builtin:arithmetic)")
        self._validate_loggers()
        return self

    def _validate_rewards(self) -> None:
        from edgerl.rewards.functions import BUILTIN_REWARDS   # the registry says which built-ins exist
        rw = self.reward
        if rw.function is not None:
            # the same function in both (a resumed run's saved config and the command line it started with) is one
            if rw.functions not in (["answer"], [rw.function]):
                raise ConfigError("reward.function and reward.functions are both set; list every function in "
                                  "reward.functions (reward.function is the same as reward.functions = [it])")
            rw.functions, rw.function = [rw.function], None
        if not rw.functions and self.rollout.environment is None:
            raise ConfigError("reward.functions is empty; name at least one, e.g. [\"answer\"] (an empty list is for "
                              "runs whose rollout.environment gives the rewards)")
        for i, spec in enumerate(rw.functions):
            if ":" in spec or spec in BUILTIN_REWARDS:
                continue
            close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
            raise ConfigError(f"reward.functions[{i}] = {spec!r} is neither a built-in reward "
                              f"({', '.join(map(repr, BUILTIN_REWARDS))}) nor 'path/to/file.py:function'"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
        if rw.weights is not None and len(rw.weights) != len(rw.functions):
            raise ConfigError(f"reward.weights has {len(rw.weights)} value(s) for {len(rw.functions)} reward "
                              f"function(s) {rw.functions}; give one weight per function")
        for i, w in enumerate(rw.weights or []):
            if isinstance(w, (int, float)) and abs(w) > MAX_ABS_REWARD:
                raise ConfigError(f"reward.weights[{i}] = {w:g} is beyond +-{MAX_ABS_REWARD:g}, the range a weighted "
                                  "reward may take (edgerl computes advantages in float32); scale the weights down "
                                  "(the advantages are normalised anyway)")

    def _validate_episodes(self) -> None:
        from edgerl.agents.builtin import BUILTIN_TOOLS
        r = self.rollout
        if not r.episodes:
            for key in ("max_turns", "max_episode_tokens"):
                if getattr(r, key) is not None:
                    raise ConfigError(f"rollout.{key} is set, but episodes have several turns only with rollout.tools "
                                      "or rollout.environment; set one of them, or unset it")
            return
        seen = set()
        for i, spec in enumerate(r.tools):
            if spec in seen:
                raise ConfigError(f"rollout.tools names {spec!r} twice")
            seen.add(spec)
            if spec in BUILTIN_TOOLS:
                continue
            path, sep, name = spec.rpartition(":")
            if not sep or not path or not name or "/" in name:
                close = difflib.get_close_matches(spec, list(BUILTIN_TOOLS), n=1)
                raise ConfigError(f"rollout.tools[{i}] = {spec!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                                  "nor 'path/to/file.py:function'" + (f"; did you mean {close[0]!r}?" if close else ""))
            check_path(path, "rollout.tools")
        if r.environment is not None:
            path, sep, name = r.environment.rpartition(":")
            if not sep or not path or not name:
                raise ConfigError(f"rollout.environment = {r.environment!r}: expected 'path/to/file.py:Class'")
            check_path(path, "rollout.environment")
        if r.turns() < 2:
            raise ConfigError("rollout.max_turns=1 leaves the model no turn to read a tool's result or an observation; "
                              "set it to 2 or more")
        if r.max_episode_tokens is not None and r.max_episode_tokens < r.max_new_tokens:
            raise ConfigError(f"rollout.max_episode_tokens={r.max_episode_tokens} is less than one turn "
                              f"(rollout.max_new_tokens={r.max_new_tokens}); raise it, or lower max_new_tokens")

    def _validate_loggers(self) -> None:
        run = self.run
        seen: list[str] = []
        for name in run.loggers:
            if name in seen:
                raise ConfigError(f"run.loggers names {name!r} twice: {run.loggers}")
            seen.append(name)
        if run.tensorboard is not None:   # the key before run.loggers, mapped onto it
            if run.tensorboard and "tensorboard" not in seen:
                seen.append("tensorboard")
            elif not run.tensorboard and "tensorboard" in seen:
                seen.remove("tensorboard")
            run.tensorboard = None
        run.loggers = seen


# The range of every number that has one, as an interval ("(" excludes the bound, "[" includes it),
# with what the bound means. A value outside would fail later, mid-run, or train nothing. The [plan]
# keys carry theirs in their field's metadata, from the plan's decision table. Every integer has a finite
# upper bound: Python's integers have none, and a value past what torch, numpy or a loop can take (a seed
# of 10**23, a billion prompts per step) would fail mid-run or compute for hours.
FLOAT32_MAX = 3.4028234663852886e38   # a float setting open above ("inf") is still at most this: fp32 holds no more
MAX_SEQUENCES = 65536   # sequences per step (prompts x samples) a plan is searched for
RANGES: dict[str, tuple[str, str]] = {
    "rollout.n_samples": ("[1, 1024]", ""),
    "rollout.max_new_tokens": ("[1, 1048576]", ""),
    "rollout.temperature": ("(0, inf)", "for near-greedy sampling use a small value such as 0.1"),
    "rollout.top_p": ("(0, 1]", "1.0 samples from the full distribution"),
    "rollout.top_k": ("[0, 1048576]", "0 samples from every token"),
    "rollout.max_turns": ("[1, 1024]", ""),
    "rollout.max_episode_tokens": ("[1, 1048576]", ""),
    "rollout.turn_discount": ("[0, 1]", "1.0 sums the turns' rewards"),
    "rollout.tool_timeout_s": ("(0, 86400]", ""),
    "rollout.tool_memory_mb": ("[64, 1048576]", ""),
    "rollout.tool_max_chars": ("[1, 10000000]", ""),
    "rollout.tool_workers": ("[1, 256]", ""),
    "train.steps": ("[0, 1000000000]", ""),
    "train.prompts_per_step": ("[1, 65536]", ""),
    "train.mini_batch": ("[1, 65536]", "sequences; leave it unset for one update per epoch"),
    "train.micro_batch": ("[1, 65536]", "sequences; leave it unset to let the plan choose"),
    "train.ppo_epochs": ("[1, 1000]", ""),
    "train.lr": ("(0, inf)", "a negative rate climbs the loss instead of descending it; typical: 1e-6 for full "
                 "fine-tuning, 1e-5 to 1e-4 with LoRA"),
    "train.critic_lr": ("(0, inf)", "typical: 1e-5"),
    "train.weight_decay": ("[0, inf)", "0 turns it off"),
    "train.warmup_ratio": ("[0, 1)", "a share of train.steps"),
    "train.min_lr_ratio": ("[0, 1]", "the cosine schedule's floor, as a share of train.lr"),
    "train.max_grad_norm": ("(0, inf)", "gradients are scaled down to this norm, so 0 would erase them; a large "
                            "value such as 1e9 clips nothing"),
    "train.max_bad_steps": ("[1, 1000000]", ""),
    "train.seed": ("[0, 4294967295]", "a 32-bit seed, as numpy and vLLM take"),
    "algo.gamma": ("[0, 1]", "a discount per token: 1.0 does not discount"),
    "algo.lam": ("[0, 1]", "GAE's lambda: 1.0 is Monte Carlo, 0 is one-step TD"),
    "algo.kl_coef": ("[0, inf)", "0 turns the KL term off"),
    "algo.kl_target": ("(0, inf)", "a KL per token such as 0.01; leave it unset for a fixed algo.kl_coef"),
    "algo.kl_horizon": ("[1, 1000000000000]", ""),
    "algo.clip_low": ("[0, 1)", "the ratio is clipped below at 1 - clip_low, which must stay above 0; typical: 0.2"),
    "algo.clip_high": ("[0, inf)", "typical: 0.2 (0.28 for DAPO's clip-higher)"),
    "algo.dual_clip": ("(1, inf)", "e.g. 3.0; leave it unset to turn it off"),
    "algo.value_clip": ("(0, inf)", "typical: 0.2"),
    "reward.timeout_s": ("[0, inf)", "0 waits as long as the function takes"),
    "data.max_prompt_len": ("[1, 1048576]", ""),
    "data.difficulty": ("[1, 4]", ""),
    "data.num_examples": ("[1, 1000000]", ""),
    "lora.rank": ("[1, 65536]", ""),
    "lora.alpha": ("(0, inf)", "the adapter's scale is alpha / rank"),
    "lora.dropout": ("[0, 1)", ""),
    "run.save_every": ("[0, 1000000000]", "0 writes no periodic checkpoint"),
    "run.keep_last": ("[1, 1000000]", ""),
    "run.profile_step": ("[0, 1000000000]", "0 records no step"),
    "run.log_samples": ("[0, 1000000]", "0 writes no samples"),
    "algo.max_extra_draws": ("[0, 1000]", "0 draws no more prompts than a plain step"),
    "algo.overlong_buffer": ("[1, 1048576]", "leave it unset for a quarter of rollout.max_new_tokens"),
    "algo.overlong_penalty": (f"[0, {MAX_ABS_REWARD:g}]", "the penalty at the length limit, e.g. 1.0; a reward "
                              f"with its penalties lies within +-{MAX_ABS_REWARD:g}"),
    "reward.model_coef": (f"[-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]", f"a weighted reward lies within "
                          f"+-{MAX_ABS_REWARD:g}; e.g. 1.0"),
    "algo.rollout_correction_threshold": ("(1, inf)", "the ratio's cap, e.g. 2.0 (verl, ms-swift) or 3.0 (TRL)"),
    "eval.every": ("[0, 1000000000]", "0 evaluates before the first step and after the last only"),
    "eval.samples": ("[0, 1024]", "0 evaluates greedy answers only"),
    "eval.max_prompts": ("[1, 1000000]", "leave it unset to evaluate every prompt"),
    "sft.max_len": ("[2, 1048576]", ""),
}


# keys that hold a path (or a name that may be one): checked by core.files.check_path
PATH_KEYS = ("model.path", "model.tokenizer", "model.critic_path", "data.path", "reward.function", "reward.model",
             "run.out_dir")


def _interval(spec: str) -> tuple[float, float, bool, bool]:
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    return lo, hi, spec[0] == "[", spec[-1] == "]"


def _in_words(spec: str, integer: bool) -> str:
    lo, hi, lo_in, hi_in = _interval(spec)
    if math.isinf(hi):
        return f"at least {lo:g}" if integer and lo_in else f"{'>=' if lo_in else '>'} {lo:g}"
    return f"in {spec}" if not integer else f"{int(lo)} to {int(hi)}"


def _check_ranges(cfg: "Config") -> None:
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")
            if isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
                raise ConfigError(f"{section.name}.{f.name} must hold finite numbers, got {value}")
            texts = value if isinstance(value, list) else [value]
            if f"{section.name}.{f.name}" not in PATH_KEYS + ("reward.functions",) and any(isinstance(v, str) and any("\ud800" <= c <= "\udfff" for c in v) for v in texts):
                raise ConfigError(f"{section.name}.{f.name} holds bytes that are not UTF-8 text ({shown(str(value))}); "
                                  "give it as UTF-8")
    ranges = dict(RANGES)
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            if f.metadata.get("range"):
                ranges[f"{section.name}.{f.name}"] = f.metadata["range"]
    for key, (spec, why) in ranges.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None:
            continue
        lo, hi, lo_in, hi_in = _interval(spec)
        if math.isinf(hi) and isinstance(value, float) and value > FLOAT32_MAX:
            raise ConfigError(f"{key} must be {_in_words(spec, False)} and at most {FLOAT32_MAX:.4g}, the largest "
                              f"32-bit float (the value meets fp32 tensors), got {value:g}" + (f"; {why}" if why else ""))
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


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """`text` as a TOML basic string that reads back equal: quotes, backslashes and every control
    character (U+0000 to U+001F and DEL, which TOML refuses raw) escaped. Other characters stay as
    they are, a lone surrogate too (a byte that was not UTF-8), for the config's checks to name."""
    return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c)
                         for c in text) + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return toml_string(v)
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
