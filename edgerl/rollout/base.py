"""The one rollout interface the trainer uses, what an engine builder is given, and the wrappers that
keep an engine's weights in step with the trainer's; the engines live beside it (`engine_*.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0: off
    eos_token_ids: tuple[int, ...] = ()  # empty: never stop early
    pad_token_id: int = 0
    greedy: bool = False                 # argmax instead of sampling (tests, evaluation)


@dataclass
class RolloutBatch:
    """One response per row; the n samples of a prompt are contiguous rows."""
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]        # ends with the EOS token when the response stopped
    truncated: list[bool]                # reached max_new_tokens without EOS
    logprobs: Optional[list[list[float]]] = None   # the sampler's own log-probs, when the engine has them
    info: dict = field(default_factory=dict)       # engine notes, e.g. timings
    # episodes of several turns (rollout/episodes.py): 1 on the model's own tokens of each response, 0 on the
    # context between its turns (tool results, observations); None: every response token is the model's
    loss_mask: Optional[list[list[int]]] = None
    episodes: Optional[list] = None                # the agents.episode.Episode of each row

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


class RolloutEngine(Protocol):
    name: str
    needs_weights: bool   # False when the engine runs the trainer's own modules (nothing to sync)

    def generate(self, prompts: list[list[int]], n_samples: int, params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> RolloutBatch:
        """Sample `n_samples` responses for each prompt (token ids, no padding)."""

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's current weights (HF parameter names, full tensors) after an update."""

    def release(self) -> None:
        """Free engine memory (KV cache, graphs) while the trainer updates."""

    def describe(self) -> str:
        """One line for the run log: engine, mode, and why."""


def cut_at_eos(tokens: list[int], eos: tuple[int, ...], limit: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first EOS; (response, truncated)."""
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1], False
    return tokens[:limit], True


@dataclass(frozen=True)
class EngineContext:
    """What an engine builder may need besides the plan."""
    model_path: str                 # the actor's model (config and initial weights)
    trust_remote_code: bool
    device: torch.device
    max_seq_len: int                # longest prompt + max_new_tokens
    seed: int
    work_dir: Path                  # a folder the engine may write to (vLLM loads from a folder)
    save_initial: Callable[[Path], None]   # writes the actor's current weights as an HF folder there
    actor: Optional[torch.nn.Module] = None   # the trained PolicyHead (FSDP2): for an engine without a copy


def inference_copy(plan, ctx: EngineContext) -> torch.nn.Module:
    """The engine's own copy of the actor's model, in the compute dtype on the device."""
    from edgerl.models.load import build_inference_copy
    return build_inference_copy(ctx.model_path, plan, ctx.device, ctx.trust_remote_code)


class OwnWeights:
    """An engine over its own compute-dtype copy of the weights, synced after every update. Unless the
    plan keeps it resident, the copy's storage, the KV cache and the graphs are freed between rollouts
    (the memory serves scoring and the update; the plan counts them in the rollout phase only) and the
    next weight sync re-allocates and refills every parameter. Resident, the sync copies in place and
    the captured graphs are replayed again."""

    needs_weights = True

    def __init__(self, engine, model: torch.nn.Module, resident: bool) -> None:
        self.engine, self.model, self.resident = engine, model, resident
        self.name = engine.name

    def generate(self, prompts, n_samples, params, generator=None) -> RolloutBatch:
        return self.engine.generate(prompts, n_samples, params, generator)

    def __getattr__(self, name: str):
        engine = vars(self).get("engine")
        if name == "generate_turns" and hasattr(engine, "generate_turns"):   # the engine's own turn loop
            return self.engine.generate_turns
        raise AttributeError(name)

    def release(self) -> None:
        if self.resident:
            return
        from edgerl.models.load import release_weights
        self.engine.release()
        release_weights(self.model)

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from edgerl.models.load import restore_weights
        restore_weights(self.model)
        self.engine.sync_weights(weights)

    def describe(self) -> str:
        return self.engine.describe() + ("; resident between steps" if self.resident else "")


class ActorWeights:
    """The static engine over the trained actor's own modules: a quantized base with its unmerged LoRA
    adapters, so rollout, reference and training share one copy of the weights and the rollout's
    log-probs come from the weights the trainer scores. FSDP2 shards the adapters; they are gathered
    for the rollout and re-sharded after (a CUDA graph is captured again when their addresses move)."""

    needs_weights = False

    def __init__(self, engine, actor: torch.nn.Module, resident: bool) -> None:
        from torch.distributed.fsdp import FSDPModule
        self.engine, self.resident = engine, resident
        self.fsdp = [m for m in actor.modules() if isinstance(m, FSDPModule)]
        self.name = engine.name

    def generate(self, prompts, n_samples, params, generator=None) -> RolloutBatch:
        for m in self.fsdp:
            m.unshard()
        try:
            return self.engine.generate(prompts, n_samples, params, generator)
        finally:
            for m in self.fsdp:
                m.reshard()

    def __getattr__(self, name: str):
        engine = vars(self).get("engine")
        if name == "generate_turns" and hasattr(engine, "generate_turns"):
            def turns(*args):
                for m in self.fsdp:
                    m.unshard()
                try:
                    return self.engine.generate_turns(*args)
                finally:
                    for m in self.fsdp:
                        m.reshard()
            return turns
        raise AttributeError(name)

    def release(self) -> None:
        if not self.resident:
            self.engine.release()

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: the engine reads the actor's weights themselves."""

    def describe(self) -> str:
        return self.engine.describe() + "; runs the actor's own quantized base and adapters (no copy)"


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights) -> None:
    """Copy (name, tensor) pairs into `model`'s parameters, casting to their dtype, in place (engines
    and captured CUDA graphs keep pointing at the same storage). Every parameter must be covered:
    a missing or unknown name is an error, not a skip. A tied weight may come under either of its
    names (`lm_head.weight` or `model.embed_tokens.weight`), as a full state dict sends both."""
    params = dict(model.named_parameters())
    aliases = dict(model.named_parameters(remove_duplicate=False))
    first_name = {id(p): n for n, p in params.items()}
    seen = set()
    for name, tensor in weights:
        if name not in aliases:
            raise KeyError(f"weight {name!r} has no parameter in the inference model")
        p = aliases[name]
        p.copy_(tensor.to(device=p.device, dtype=p.dtype))
        seen.add(first_name[id(p)])
    missing = set(params) - seen
    if missing:
        raise KeyError(f"weight sync left {len(missing)} parameters untouched, e.g. {sorted(missing)[:3]}")

