"""From what the user typed to the plan's inputs: the device (probed, a profile, or a spec), the
model shape, the task and the overrides. Shared by `doctor`, `recommend` and `train`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.config.schema import Config
from edgerl.device.device import Device, SpecError, device_from_spec
from edgerl.plan.fp16 import read_cached
from edgerl.plan.modelspec import ModelSpec, resolve
from edgerl.plan.plan import Plan, Task, plan
from edgerl.device.probe import ProbeResult, probe
from edgerl.device.profiles import Profile, device_from_profile, get_profile, match_profile


@dataclass(frozen=True)
class Target:
    device: Device
    probe: ProbeResult
    simulated: bool              # planned for a GPU that is not (necessarily) this machine's
    profile: Optional[Profile]
    index: int = 0               # which of the probed devices this process runs on (torchrun's LOCAL_RANK)

    @property
    def real(self) -> Device:
        """This process's own device on this machine (the one a profile is emulated on)."""
        devs = self.probe.devices
        return devs[self.index] if self.index < len(devs) else devs[0]


def resolve_target(gpu: Optional[str] = None, gpu_spec: Optional[str] = None,
                   probe_fn: Optional[Callable[[], ProbeResult]] = None, index: int = 0) -> Target:
    """The probed device (the `index`-th GPU torch sees), or the one named by --gpu/--profile or
    described by --gpu-spec."""
    if gpu and gpu_spec:
        raise SpecError("give either --gpu NAME or --gpu-spec ..., not both")
    result = (probe_fn or probe)()
    if not result.cuda_available:
        index = 0  # every process trains on the CPU
    elif index >= len(result.devices):
        raise SpecError(f"this process should use GPU {index} (LOCAL_RANK), but torch sees {len(result.devices)} "
                        "GPU(s); start fewer processes (torchrun --nproc_per_node) or make more GPUs visible "
                        "(CUDA_VISIBLE_DEVICES)")
    host = result.primary.host_memory
    if gpu:
        prof = get_profile(gpu)
        dev = device_from_profile(prof, result.software, host)
        return Target(dev, result, True, prof, index)
    if gpu_spec:
        return Target(device_from_spec(gpu_spec, result.software, host), result, True, None, index)
    dev = result.devices[index]
    prof = match_profile(dev)
    if prof is not None:
        dev = replace(dev, profile=prof.name, fp32_tflops=dev.fp32_tflops or prof.fp32_tflops)
    return Target(dev, result, False, prof, index)


def task_from_config(cfg: Config, prompt_len: Optional[int] = None, world_size: int = 1) -> Task:
    from edgerl.algos import ESTIMATORS
    from edgerl.plan.modelspec import classifier_params
    if cfg.sft.enabled:   # one forward and backward over whole rows: no rollout, reference, critic or reward model
        return Task(prompt_len=1, response_len=cfg.sft.max_len - 1, prompts_per_step=cfg.train.prompts_per_step,
                    samples_per_prompt=1, mini_batch=cfg.train.mini_batch, algo="sft", critic=False, kl=False,
                    lora=cfg.lora.enabled, lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha,
                    lora_targets=tuple(cfg.lora.target_modules) if cfg.lora.target_modules else None,
                    world_size=world_size, sft=True)
    return Task(prompt_len=prompt_len or cfg.data.max_prompt_len, response_len=cfg.rollout.response_tokens(),
                prompts_per_step=cfg.train.prompts_per_step, samples_per_prompt=cfg.rollout.n_samples,
                mini_batch=cfg.train.mini_batch, algo=cfg.algo.advantage,
                critic=ESTIMATORS[cfg.algo.advantage].critic, kl=cfg.algo.kl_coef > 0,
                reward_model_params=classifier_params(cfg.reward.model) if cfg.reward.model else 0,
                lora=cfg.lora.enabled, lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha,
                lora_targets=tuple(cfg.lora.target_modules) if cfg.lora.target_modules else None,
                world_size=world_size, rollout_correction=cfg.algo.rollout_correction,
                rollout_correction_level=cfg.algo.rollout_correction_level,
                rollout_correction_threshold=cfg.algo.rollout_correction_threshold,
                turn_len=cfg.rollout.max_new_tokens if cfg.rollout.episodes else 0)


def overrides_from_config(cfg: Config, profile: Optional[Profile] = None) -> dict[str, Any]:
    """The config's [plan] section and train.micro_batch, over the profile's known-good defaults."""
    out: dict[str, Any] = dict(profile.defaults) if profile else {}
    for f in dataclasses.fields(cfg.plan):
        v = getattr(cfg.plan, f.name)
        if v is not None:
            out[f.name] = v
    if cfg.train.micro_batch is not None:
        out["micro_batch"] = cfg.train.micro_batch
    return out


def model_spec(cfg: Config) -> ModelSpec:
    return resolve(cfg.model.path)


def weights_folder(path: str) -> Optional[Path]:
    """The folder of `path`'s weights where they are on this machine already: a local folder, a Hugging Face
    id in huggingface_hub's cache, the embedded model once converted. None otherwise; never downloads."""
    from edgerl.core.files import converted_folder
    from edgerl.core.hub import cached_folder, is_hub_id
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    return cached_folder(path) if is_hub_id(path) else converted_folder(path)


def plan_for(cfg: Config, target: Target, spec: Optional[ModelSpec] = None,
             prompt_len: Optional[int] = None, world_size: int = 1) -> Plan:
    """The plan for `cfg` on `target`, with the model's cached fp16 calibration where there is one
    (plan/fp16.py): `doctor`, `recommend` and `train` then plan the same dtype for it."""
    spec = spec or model_spec(cfg)
    if spec.activations is None and (folder := weights_folder(cfg.model.path)) is not None:
        spec = replace(spec, activations=read_cached(folder))
    return plan(target.device, spec, task_from_config(cfg, prompt_len, world_size),
                overrides_from_config(cfg, target.profile))
