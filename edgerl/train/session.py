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

from edgerl.train import overflow, ranks
from edgerl.train import runfolder
from edgerl.train import resume as resume_changes
from edgerl.config.schema import Config, ConfigError, to_toml
from edgerl.config.load import SetItem, load_config, quoted
from edgerl.data.prompts import DataReport, Prompt, load_prompts
from edgerl.core.errors import ModelError, RunDirError
from edgerl.core.files import json_text, write_atomically
from edgerl.models.load import unreadable_weights
from edgerl.plan.memory import DEFAULT_CALIBRATION
from edgerl.plan.plan import Plan
from edgerl.config.target import Target, model_spec, plan_for, resolve_target
from edgerl.train.loggers import check_installed
from edgerl.train.manifest import forget, own
from edgerl.doctor.kernel_checks import check_at_start


@dataclass
class Session:
    cfg: Config
    target: Target
    plan: Plan
    device: Any                          # torch.device
    run_dir: Path
    tokenizer: Any
    prompts: list[Any]                   # data.Prompt; under sft.enabled data.sft.SftRow
    data_report: DataReport
    resume: Optional[runfolder.ResumePoint] = None
    eval_prompts: list[Prompt] = field(default_factory=list)   # eval.data's held-out prompts
    reward_functions: list[Any] = field(default_factory=list)   # reward.functions, loaded and checked
    toolbox: Any = None                  # rollout.tools / rollout.environment served (agents.toolbox.ToolBox)
    tool_format: Optional[str] = None    # the chat template's tool-call format (agents.calls)
    rank: ranks.Rank = field(default_factory=ranks.Rank)
    emulation: str = ""                  # how a profile is emulated on this GPU; "" when not
    finished: bool = False               # resumed a run that already reached train.steps and exported
    log: Callable[[str], None] = print
    lock: Optional[runfolder.RunLock] = field(default=None, repr=False)
    pending: Optional[Callable[[], None]] = field(default=None, repr=False)

    def commit(self) -> None:
        """The writes a run resumed in place makes once its checkpoint has loaded (config.toml, plan.json,
        removing interrupted writes): a resume that is refused, or whose checkpoint does not load, has
        changed nothing in the folder."""
        if self.pending is not None:
            write, self.pending = self.pending, None
            write()

    def close(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()
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
        return torch.device("cpu"), "profile cpu: running on the CPU"
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
    cfg = load_config(None, [f"run.profile={quoted(profile)}"])
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
    an execution plan for every new sequence length, which costs far more than the attention itself
    (docs/benchmarks.md, cuDNN attention), and a GRPO batch's length changes from step to step."""
    if device.type == "cuda" and plan.attention == "sdpa":
        import torch
        torch.backends.cuda.enable_cudnn_sdp(False)


def prepare(cfg: Config, resume: Optional[runfolder.ResumePoint] = None, *, log: Callable[[str], None] = print,
            probe_fn: Optional[Callable[[], Any]] = None, restart: bool = False) -> Session:
    """A session ready for `Trainer(session)`. Raises a user error (edgerl.core.errors) for anything the
    user typed or pointed at, before any file is written. Under torchrun every rank calls it; rank 0
    alone checks and writes the run folder and logs, and its verdict reaches every rank. `restart`
    (--restart): a run in the --out folder is moved aside into it, and a new one starts there."""
    if restart and resume is not None:
        raise ConfigError("--restart starts a new run in --out (the run there is moved aside); it does not go "
                          "with --resume, which continues a run")
    from edgerl.models.load import init_distributed, load_tokenizer
    rank = ranks.from_env()
    if not rank.main:
        log = _quiet
    target = resolve_target(cfg.run.profile, probe_fn=probe_fn, index=rank.local)
    device, emulation = _device_for(target, cfg, rank.world)
    init_distributed(device)
    plan = plan_for(cfg, target, model_spec(cfg), world_size=rank.world)
    if rank.world > 1:
        check_ranks_agree(ranks.gather(rank_view(cfg, plan, resume)))
    apply_env(plan, device)
    apply_switches(plan, device)
    # the plan's kernels against their references on small inputs, before anything is written: a kernel
    # that is wrong on this device stops the run here, naming it and the setting that avoids it
    check_at_start(plan, device)

    out = Path(cfg.run.out_dir).expanduser() if cfg.run.out_dir else \
        Path("runs") / f"{Path(cfg.model.path).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = ranks.agree(lambda: runfolder.check_new(out, restart=restart) or out if resume is None else
                          runfolder.check_resume(resume, out), rank.main)
    cfg.run.out_dir = str(run_dir)

    m = cfg.model
    for folder in {m.path, m.critic_path or m.path}:   # a damaged download fails here, before any write
        if Path(folder).is_dir() and (why := unreadable_weights(Path(folder))):
            raise ModelError(f"cannot load model {folder!r}: {why}")
    tokenizer = load_tokenizer(m.tokenizer or m.path, m.trust_remote_code)
    toolbox, fmt = None, None
    if cfg.rollout.episodes:   # the tools' schemas go into every prompt
        from edgerl.agents.toolbox import open_toolbox
        toolbox, fmt = open_toolbox(cfg.rollout, tokenizer, m.path, cfg.data.chat_template, log)
    try:
        schemas = toolbox.schemas if toolbox is not None and toolbox.schemas else None
        if cfg.sft.enabled:   # written answers to learn from (edgerl.data.sft): no prompts, rewards or evaluation
            from edgerl.data.sft import load_sft_rows
            d = cfg.data
            prompts = load_sft_rows(d.path, d.split, cfg.sft.messages_key, d.prompt_key, cfg.sft.response_key,
                                    d.system_prompt, tokenizer, cfg.sft.max_len, d.on_too_long, log=log)
            report = DataReport(d.path, len(prompts), len(prompts), {})
        else:
            # the generated task is seeded apart from train.seed: every run trains on the same problems
            prompts, report = load_prompts(cfg.data, tokenizer, seed=0, log=log, tools=schemas)
        # a plan that would compute in fp16 first measures the model's activations (edgerl/train/overflow.py)
        calibrated = overflow.calibrated(cfg, target, plan, prompts, device, log)
        if calibrated is not plan:
            plan = calibrated
            if rank.world > 1:
                check_ranks_agree(ranks.gather(rank_view(cfg, plan, resume)))
            apply_switches(plan, device)
            check_at_start(plan, device)
        if resume is not None:   # what the checkpoint cannot follow is refused before anything is written
            ranks.agree(lambda: resume_changes.check(resume, cfg, plan, len(prompts), rank.world), rank.main)
        eval_prompts = _eval_prompts(cfg, tokenizer, prompts, rank.world, log, schemas)
        functions = [] if cfg.sft.enabled else _reward_functions(cfg, prompts + eval_prompts, log)
        check_installed(cfg.run.loggers if rank.main else [])
        finished = runfolder.finished(resume, run_dir, cfg.train.steps, _exports(cfg, plan))
        held: list[tuple[runfolder.RunLock, Optional[Callable[[], None]]]] = []   # the lock stays in this process
        ranks.agree(lambda: held.append(_open(cfg, plan, run_dir, resume, log, write=not finished, restart=restart)),
                    rank.main)
    except BaseException:
        if toolbox is not None:
            toolbox.close()
        raise
    lock, pending = held[0] if held else (None, None)
    return Session(cfg=cfg, target=target, plan=plan, device=device, run_dir=run_dir, tokenizer=tokenizer,
                   prompts=prompts, data_report=report, resume=resume, eval_prompts=eval_prompts,
                   reward_functions=functions, rank=rank, emulation=emulation, finished=finished, log=log,
                   lock=lock, pending=pending, toolbox=toolbox, tool_format=fmt)


def _eval_prompts(cfg: Config, tokenizer: Any, train: list[Prompt], world: int, log: Callable[[str], None],
                  tools: Optional[list[dict]] = None) -> list[Prompt]:
    """eval.data's prompts, checked before anything is written; none without eval.data."""
    if cfg.eval.data is None:
        return []
    from edgerl.data.heldout import load_eval_prompts
    prompts, _ = load_eval_prompts(cfg, tokenizer, train, log, tools)
    if len(prompts) < world:
        raise ConfigError(f"eval.data has {len(prompts)} prompt(s) for {world} processes; each process evaluates "
                          "a share, so give at least one per process")
    return prompts


def _reward_functions(cfg: Config, prompts: list[Prompt], log: Callable[[str], None]) -> list[Any]:
    """reward.functions loaded (a bad file or signature is a RewardError now, before anything is written);
    the 'answer' rule needs a rule for every data_source. Logs which functions and, for math rows,
    which scorer."""
    from edgerl.rewards.builtins import is_math_source, math_scorer
    from edgerl.rewards.functions import load_functions
    from edgerl.rewards.rules import check_sources
    functions = load_functions(cfg.reward.functions, cfg.reward.weights, cfg.data.answer_key,
                               cfg.reward.timeout_s or None)
    sources = {p.data_source for p in prompts}
    if any(f.spec == "answer" for f in functions):
        check_sources(sources)
    math = any(is_math_source(s) for s in sources) and any(f.spec == "answer" for f in functions)
    log("rewards: " + ", ".join(f.describe() for f in functions) + (
        f"; math answers scored by {math_scorer()}" if math else ""))
    return functions


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
          log: Callable[[str], None], write: bool = True,
          restart: bool = False) -> tuple[runfolder.RunLock, Optional[Callable[[], None]]]:
    """Lock the run folder, check it again under the lock (rank 0), and write its config and plan: now
    for a new run or a branch (a run whose model then fails to load leaves them, and may start there
    again), or, for a run resumed in place, in the returned function, which the trainer calls once the
    checkpoint has loaded. `write=False` (a finished run resumed: nothing to do) only locks it."""
    branch = resume is not None and run_dir.resolve() != resume.run_dir.resolve()
    in_place = resume is not None and not branch
    check = ((lambda: runfolder.check_new(run_dir, restart=restart)) if resume is None else
             (lambda: runfolder.check_resume(resume, run_dir, verify=False)))
    lock = runfolder.open_run(run_dir, log, check, clean=not in_place)
    if not write:
        return lock, None

    def files() -> None:
        try:
            if in_place:
                runfolder.clean_up(run_dir, log)
                runfolder.adopt(run_dir)
            if restart:
                runfolder.move_aside(run_dir, log)
            if not in_place:   # a new run's manifest is the folder's own, not what this process listed before
                forget(run_dir)
            own(run_dir, "config.toml", "plan.json")
            _write_config(cfg, run_dir, not in_place, log)
            if branch:  # a branch starts with its trunk's history
                for name in ("metrics.jsonl", "samples.jsonl"):
                    history = runfolder.branch_history(resume, name)
                    if history is not None:
                        own(run_dir, name)
                        write_atomically(run_dir / name, history)
            write_atomically(run_dir / "plan.json", json_text(plan.to_dict(), indent=2, default=str))
        except ConfigError:   # the writer's own one line, naming the file; nothing there was changed
            lock.release()
            raise
        except OSError as e:
            lock.release()
            raise RunDirError(f"cannot write to the run folder {run_dir}: {e.strerror or e}") from None
    if in_place:
        return lock, files
    files()
    return lock, None


def _write_config(cfg: Config, run_dir: Path, new: bool, log: Callable[[str], None]) -> None:
    """config.toml of a new run (or branch); of a run resumed in place, rewritten when this run
    changes it (--steps 30, say), so that a later plain --resume goes on with the same settings."""
    path, text = run_dir / "config.toml", to_toml(cfg)
    old = path.read_text(encoding="utf-8", errors="replace") if path.exists() else None
    if new and old is not None:  # check_new let it through: no step was ever taken there
        log(f"{run_dir} held a run that stopped before its first step; starting this one there")
    elif not new and (old is None or old == text):
        return
    write_atomically(path, text)
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


def rank_view(cfg: Config, plan: Plan, resume: Optional[runfolder.ResumePoint] = None) -> dict[str, Any]:
    """What every rank of a run must share: its config and its plan (machines may differ), and whether it can
    read the checkpoint it resumes from (every rank loads it; a run folder on one machine's disk cannot)."""
    unreadable = None
    if resume is not None:
        files = [resume.checkpoint / "meta.json", *resume.checkpoint.glob("*.safetensors"), *resume.checkpoint.glob("*.pt")]
        unreadable = next((str(f) for f in files if not os.access(f, os.R_OK)), None) if resume.checkpoint.is_dir() \
            else str(resume.checkpoint)
    # whether the fp16 calibration is cached may differ between machines: the plans are compared again after it
    decisions = {k: v for k, v in plan.decisions().items() if k != "fp16_check"}
    return {"config": to_toml(cfg), "plan": json.dumps(decisions, sort_keys=True, default=str),
            "decisions": {k: json.dumps(v, sort_keys=True, default=str) for k, v in decisions.items()},
            "device": plan.device.describe(), "unreadable": unreadable}


def check_ranks_agree(views: list[dict[str, Any]]) -> None:
    """Every rank's `rank_view`, gathered: a rank started with another config (another machine's command
    line or file), or planning differently (another GPU), stops the run on every rank with one line."""
    first = views[0]
    for r, v in enumerate(views):
        if v.get("unreadable"):
            raise RunDirError(f"rank {r} of {len(views)} cannot read {v['unreadable']}: every rank loads the "
                              "checkpoint it resumes from; put the run folder on a file system every machine "
                              "mounts at the same path, or copy it to that path on every machine")
    for r, v in enumerate(views[1:], start=1):
        if v["config"] != first["config"]:
            keys = _changed_keys(first["config"], v["config"])
            raise ConfigError(f"rank {r} of {len(views)} was started with another config than rank 0 (differs in "
                              f"{', '.join(keys[:6]) or 'notes'}): start every machine with the same config file "
                              "and --set options")
        if v["plan"] != first["plan"]:
            keys = [k for k in first["decisions"] if first["decisions"][k] != v["decisions"].get(k)]
            raise ConfigError(f"rank {r} of {len(views)} plans differently from rank 0 ({', '.join(keys[:6])}; its "
                              f"GPU: {v['device']}, rank 0's: {first['device']}): every rank must train on one "
                              "plan; give every machine the same --profile, the smallest GPU's")
