"""`prepare(cfg)`: everything `edgerl train` does before the first step, as a library call that the
CLI, the benchmarks and the tests all use, so that what they measure is what users run.

    device (probed, or a profile emulated on this GPU with its real memory cap)
    -> plan -> environment -> the plan's kernels checked against their references
    -> tokenizer and data (validated before anything is written)
    -> run folder (checked, locked, config and plan written atomically) -> resume point

Under torchrun each rank prepares its own session on its own device; the plan is made per rank
for the memory one GPU holds, and rank 0 alone writes files and talks to the user.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from edgerl.train import checkpoint
from edgerl.train import ranks
from edgerl.train import runfolder
from edgerl.config.schema import Config, ConfigError, to_toml
from edgerl.config.load import SetItem, load_config
from edgerl.data.prompts import DataReport, Prompt, load_prompts
from edgerl.core.errors import ModelError, RunDirError
from edgerl.models.load import unreadable_weights
from edgerl.plan.memory import DEFAULT_CALIBRATION
from edgerl.plan.plan import Plan
from edgerl.plan.target import Target, model_spec, plan_for, resolve_target
from edgerl.doctor.kernel_checks import check_at_start


@dataclass
class Session:
    cfg: Config
    target: Target
    plan: Plan
    device: Any                          # torch.device
    run_dir: Path
    tokenizer: Any
    prompts: list[Prompt]
    data_report: DataReport
    resume: Optional[runfolder.ResumePoint] = None
    rank: ranks.Rank = field(default_factory=ranks.Rank)
    emulation: str = ""                  # how a profile is emulated on this GPU; "" when not
    finished: bool = False               # resumed a run that already reached train.steps and exported
    log: Callable[[str], None] = print
    lock: Optional[runfolder.RunLock] = field(default=None, repr=False)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


def load(config: Optional[Path] = None, sets: Sequence[SetItem] = (), resume: Optional[Path] = None,
         out: Optional[Path] = None) -> tuple[Config, Optional[runfolder.ResumePoint]]:
    """The run config: the file (or, when resuming, the run's own config.toml) with `--set` overrides
    (each 'key=value', or that with the option it came from), and the resume point. `out` (--out)
    names the run folder; with `resume` it branches."""
    extra = list(sets)
    point, base = None, None
    if resume is not None:
        point = runfolder.resume_point(resume)
        if config is None and point.in_run and (point.run_dir / "config.toml").exists():
            config = point.run_dir / "config.toml"  # resume with the run's own config; --set still applies
        elif config is None:  # config.toml gone, or a checkpoint copied out of its run: the one it was saved with
            base = runfolder.checkpoint_config(point)
    cfg = load_config(config, extra, base=base)
    if out is not None:
        cfg.run.out_dir = str(out)
    elif point is not None:
        cfg.run.out_dir = str(point.run_dir)
    return cfg, point


def _device_for(target: Target, cfg: Config, processes: int = 1) -> tuple[Any, str]:
    """The torch device to train on, and how its memory is capped: a profile emulated on a bigger GPU
    gets the profile's memory, and `plan.memory_gib` is a budget the run keeps, not only one it plans
    for (its allocator gets the budget less what lives outside the allocator: the CUDA context, and
    NCCL's buffers when the run has several processes)."""
    import torch
    real = target.real
    if not target.simulated:
        device = torch.device("cuda", real.index) if real.is_cuda else torch.device("cpu")
        budget = _budget_share(cfg, real, processes) if real.is_cuda else None
        if budget is None:
            return device, ""
        torch.cuda.set_per_process_memory_fraction(budget, real.index)
        return device, _budget_note(cfg, budget, real)
    dev = target.device
    if not dev.is_cuda:
        return torch.device("cpu"), "profile cpu: training on the CPU"
    if not real.is_cuda:
        raise ConfigError(f"--profile {cfg.run.profile} plans for a {dev.name}, but this machine has no usable GPU "
                          f"({real.note}); use --profile cpu, or run edgerl recommend --gpu {cfg.run.profile} to "
                          "see the plan")
    if dev.total_memory > real.total_memory:
        raise ConfigError(f"--profile {cfg.run.profile} has {dev.total_memory / 2**30:.1f} GiB, more than this "
                          f"{real.name} ({real.total_memory / 2**30:.1f} GiB): a bigger GPU cannot be emulated")
    # The cap covers torch's allocator; the CUDA context lives outside it, as on the real card.
    outside = DEFAULT_CALIBRATION.outside_allocator(processes)
    share = min(1.0, max(0.01, (dev.total_memory - outside) / real.total_memory))
    budget = _budget_share(cfg, real, processes)
    torch.cuda.set_per_process_memory_fraction(min(share, budget or 1.0), real.index)
    return torch.device("cuda", real.index), (
        f"emulating {dev.describe()} on {real.describe()}: memory capped at {share:.1%} of this GPU, the "
        f"profile's dtype, attention and kernel limits apply; speed is NOT emulated"
        + (f"; {_budget_note(cfg, budget, real)}" if budget is not None and budget < share else ""))


def _budget_share(cfg: Config, real: Any, processes: int = 1) -> Optional[float]:
    """plan.memory_gib as a share of this GPU for torch's allocator (None when unset)."""
    gib = cfg.plan.memory_gib
    if gib is None:
        return None
    outside = DEFAULT_CALIBRATION.outside_allocator(processes)
    allocator = gib * 2**30 - outside
    if allocator <= 0:
        what = "the CUDA context" + (" and NCCL's buffers" if processes > 1 else "")
        raise ConfigError(f"plan.memory_gib={gib:g} leaves nothing for training: {what} alone take about "
                          f"{outside / 2**30:.2f} GiB outside torch's allocator; raise it")
    return min(1.0, allocator / real.total_memory)


def _budget_note(cfg: Config, share: float, real: Any) -> str:
    return (f"plan.memory_gib={cfg.plan.memory_gib:g}: torch's allocator capped at {share * real.total_memory / 2**30:.2f}"
            f" GiB ({share:.1%} of this GPU; the CUDA context is outside it)")


def device_for(target: Target, cfg: Config) -> tuple[Any, str]:
    """The torch device `edgerl train` runs on for `target` (one process), with its memory cap applied, and
    the emulation note ("" when no profile is emulated)."""
    return _device_for(target, cfg)


def cap_memory(profile: str) -> str:
    """Emulate a profile's memory on this GPU (for benchmarks that run a peer beside edgerl)."""
    cfg = load_config(None, [f"run.profile={json.dumps(profile)}"])
    return _device_for(resolve_target(profile), cfg)[1]


def apply_env(plan: Plan, device: Any) -> None:
    """Set the plan's environment variables where the user has not set them."""
    for key, value in plan.env:
        if os.environ.get(key):
            continue
        os.environ[key] = value
        if key == "PYTORCH_CUDA_ALLOC_CONF" and device.type == "cuda":
            import torch
            # the probe has already initialised CUDA, so the variable alone would come too late
            setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)   # torch >= 2.9
            if setter is None:
                setter = torch.cuda.memory._set_allocator_settings
            setter(value)


def apply_switches(plan: Plan, device: Any) -> None:
    """Process-wide torch switches the plan relies on. On CUDA with SDPA attention: cuDNN's SDPA backend
    off (torch then takes flash, or the memory-efficient kernel where a batch has padding). cuDNN builds
    an execution plan for every new sequence length, measured at 0.1 to 2.3 s per new length for a
    forward and backward on an H200 (bench/bench_attention.py, docs/benchmarks.md section 11), and a
    GRPO batch's length changes from step to step."""
    if device.type == "cuda" and plan.attention == "sdpa":
        import torch
        torch.backends.cuda.enable_cudnn_sdp(False)


def prepare(cfg: Config, resume: Optional[runfolder.ResumePoint] = None, *, log: Callable[[str], None] = print,
            probe_fn: Optional[Callable[[], Any]] = None) -> Session:
    """A session ready for `Trainer(session)`. Raises a user error (edgerl.core.errors) for anything the
    user typed or pointed at, before any file is written. Under torchrun every rank calls it; rank 0
    alone checks and writes the run folder and logs, and its verdict reaches every rank."""
    from edgerl.models.load import init_distributed, load_tokenizer
    rank = ranks.from_env()
    if not rank.main:
        log = _quiet
    target = resolve_target(cfg.run.profile, probe_fn=probe_fn, index=rank.local)
    device, emulation = _device_for(target, cfg, rank.world)
    init_distributed(device)
    plan = plan_for(cfg, target, model_spec(cfg), world_size=rank.world)
    apply_env(plan, device)
    apply_switches(plan, device)
    # the plan's kernels against their references on small inputs, before anything is written: a kernel
    # that is wrong on this device stops the run here, naming it and the setting that avoids it
    check_at_start(plan, device)

    out = Path(cfg.run.out_dir).expanduser() if cfg.run.out_dir else \
        Path("runs") / f"{Path(cfg.model.path).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = ranks.agree(lambda: runfolder.check_new(out) or out if resume is None else
                          runfolder.check_resume(resume, out), rank.main)
    cfg.run.out_dir = str(run_dir)

    m = cfg.model
    for folder in {m.path, m.critic_path or m.path}:   # a damaged download fails here, before any write
        if Path(folder).is_dir() and (why := unreadable_weights(Path(folder))):
            raise ModelError(f"cannot load model {folder!r}: {why}")
    tokenizer = load_tokenizer(m.tokenizer or m.path, m.trust_remote_code)
    # the generated task is seeded apart from train.seed: every run trains on the same problems
    prompts, report = load_prompts(cfg.data, tokenizer, seed=0, log=log)
    finished = runfolder.finished(resume, run_dir, cfg.train.steps, _exports(cfg, plan))
    held: list[runfolder.RunLock] = []   # the lock stays in this process; only the verdict is shared
    ranks.agree(lambda: held.append(_open(cfg, plan, run_dir, resume, log, write=not finished)), rank.main)
    return Session(cfg=cfg, target=target, plan=plan, device=device, run_dir=run_dir, tokenizer=tokenizer,
                   prompts=prompts, data_report=report, resume=resume, rank=rank, emulation=emulation,
                   finished=finished, log=log, lock=held[0] if held else None)


def _quiet(_: str) -> None:
    """The log of ranks other than 0: rank 0 alone talks to the user."""


def _exports(cfg: Config, plan: Plan) -> list[str]:
    """The folders the run's export writes (edgerl/trainer.py's export): a finished run has them all."""
    if not cfg.run.export_final:
        return []
    if plan.lora is None:
        return ["final"]
    return ["final-adapter"] + (["final"] if cfg.lora.export_merged else [])


def _open(cfg: Config, plan: Plan, run_dir: Path, resume: Optional[runfolder.ResumePoint],
          log: Callable[[str], None], write: bool = True) -> runfolder.RunLock:
    """Lock the run folder and write its config and plan (rank 0). `write=False` (a finished run
    resumed: nothing to do) only locks it, so nothing in it changes."""
    lock = runfolder.open_run(run_dir, log)
    if not write:
        return lock
    branch = resume is not None and run_dir != resume.run_dir
    try:
        _write_config(cfg, run_dir, resume is None or branch, log)
        if branch:  # a branch starts with its trunk's history
            history = runfolder.branch_history(resume)
            if history is not None:
                checkpoint.atomic_write_text(run_dir / "metrics.jsonl", history)
        checkpoint.atomic_write_text(run_dir / "plan.json", json.dumps(plan.to_dict(), indent=2, default=str))
    except OSError as e:
        lock.release()
        raise RunDirError(f"cannot write to the run folder {run_dir}: {e}") from None
    return lock


def _write_config(cfg: Config, run_dir: Path, new: bool, log: Callable[[str], None]) -> None:
    """config.toml of a new run (or branch); of a run resumed in place, rewritten when this run
    changes it (--steps 30, say), so that a later plain --resume goes on with the same settings."""
    path, text = run_dir / "config.toml", to_toml(cfg)
    old = path.read_text(encoding="utf-8", errors="replace") if path.exists() else None
    if new and old is not None:  # check_new let it through: no step was ever taken there
        log(f"{run_dir} held a run that stopped before its first step; starting this one there")
    elif not new and (old is None or old == text):
        return
    checkpoint.atomic_write_text(path, text)
    if not new:
        log(f"config.toml updated with this run's settings ({', '.join(_changed_keys(old, text)[:6]) or 'notes'})")


def _changed_keys(old: str, new: str) -> list[str]:
    """The 'section.key' names whose lines differ between two to_toml texts."""
    def keyed(text: str) -> dict[str, str]:
        out, section = {}, ""
        for line in text.splitlines():
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
            elif "=" in line:
                setting = line.lstrip("# ").split("  #", 1)[0]   # the value without its documentation
                out[f"{section}.{setting.split('=', 1)[0].strip()}"] = setting
        return out
    a, b = keyed(old), keyed(new)
    return [k for k in b if a.get(k) != b[k]] + [k for k in a if k not in b]

