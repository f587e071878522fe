"""`edgerl eval RUN_DIR|CHECKPOINT|MODEL --data ...`: a held-out evaluation on its own, built the way a
run builds its actor and rollout engine (the same plan, so the same memory), without writing anything
in the run folder. A checkpoint is verified as a resume verifies it (its files' checksums, finite
weights), and must fit the model it is loaded into (names and shapes): another architecture is refused.

    a run folder       its latest checkpoint's weights, with the run's config (data columns, rewards, lengths)
    a checkpoint       RUN/checkpoints/step-N: its weights, with its run's config
    a model            an HF folder or id, a catalogue name, or an export (RUN/final) with the config given
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from edgerl.config.load import SetItem, load_config
from edgerl.config.schema import Config
from edgerl.core.errors import ConfigError


def _is_run(p: Path) -> bool:
    return p.is_dir() and ((p / "meta.json").exists() or (p / "checkpoints").is_dir())


def load_eval_config(target: str, sets: Sequence[SetItem], config: Optional[Path] = None
                     ) -> tuple[Config, Optional[Path]]:
    """The config to evaluate with and the checkpoint folder to load (None for a model)."""
    from edgerl.config.target import model_spec
    from edgerl.core.files import check_path
    from edgerl.train import runfolder, session
    check_path(target, "edgerl eval")
    p = Path(target).expanduser()
    from edgerl.train.checkpoint import checkpoints
    if _is_run(p) and not checkpoints(p) and (p / "final" / "config.json").is_file() \
            and (p / "config.toml").is_file():
        # run.final_only left the final model alone: evaluate it with the run's config
        from edgerl.config.load import quoted, read_toml
        final = quoted(str(p / "final"))
        return load_config(config, [*sets, (f"model.path={final}", f"edgerl eval {target}")],
                           base=read_toml(p / "config.toml")), None
    if _is_run(p):
        point = runfolder.resume_point(p)
        _verify(point.checkpoint)
        cfg, _ = session.load(config, sets, resume=p)
        return cfg, point.checkpoint
    cfg = load_config(config, sets)
    cfg.model.path = target   # a path as given, never pasted into TOML (a folder named m"x or a<TAB>b)
    cfg.validate()
    model_spec(cfg)   # an unknown model or a missing folder is named now, before --data is asked for
    return cfg, None


def _verify(folder: Path) -> None:
    """Refuse a checkpoint whose files are not as written (checksums in its meta.json) or whose weights
    are not finite, as a resume does; weights without optimizer state (run.final_only's best) are fine."""
    from edgerl.core.errors import CheckpointError
    from edgerl.train import checkpoint
    why = checkpoint.damage(folder, optimizer=False)
    bad = checkpoint.non_finite(folder) if why is None else []
    if bad:
        why = f"it holds NaN or infinite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
    if why is not None:
        earlier = [c for c in checkpoint.checkpoints(folder.parent.parent) if c.name < folder.name]
        way = f"evaluate an earlier one: edgerl eval {earlier[-1]}" if earlier else "evaluate another checkpoint"
        raise CheckpointError(f"checkpoint {folder} cannot be evaluated: {why}; {way}")


def _does_not_fit(model: dict[str, tuple], saved: dict[str, Any]) -> Optional[str]:
    """How the tensors `saved` (name -> tensor) differ from a model's (name -> shape), or None."""
    missing, unknown = sorted(set(model) - set(saved)), sorted(set(saved) - set(model))
    shapes = [k for k in sorted(set(model) & set(saved)) if tuple(saved[k].shape) != tuple(model[k])]
    if not (missing or unknown or shapes):
        return None
    parts = ([f"{len(missing)} of the model's weights are not in it (e.g. {missing[0]})"] if missing else []) + \
        ([f"{len(unknown)} of its weights are not the model's (e.g. {unknown[0]})"] if unknown else []) + \
        ([f"{shapes[0]} is {tuple(saved[shapes[0]].shape)} in it and {tuple(model[shapes[0]])} in the model"]
         if shapes else [])
    return "; ".join(parts)


def _load_checkpoint(actor: Any, folder: Path, lora: bool, model_path: str) -> None:
    """The trained weights of a checkpoint into a freshly built actor."""
    from edgerl.core.errors import CheckpointError
    from edgerl.models.full_state import set_full_model_state
    from edgerl.models import lora as lora_io
    from edgerl.train import checkpoint
    tensors, _, meta = checkpoint.load(folder)
    kind = "adapter_model" if lora else "actor"
    if kind not in tensors:
        raise CheckpointError(f"{folder} holds {'a LoRA adapter' if 'adapter_model' in tensors else 'full weights'}, "
                              f"and the plan {'trains LoRA' if lora else 'trains every weight'}: evaluate with the "
                              "run's lora.enabled (--set lora.enabled=...)")
    trained_on = ((meta.get("config") or {}).get("model") or {}).get("path") if isinstance(meta, dict) else None

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {folder} does not fit the model it is loaded into ({model_path}): {why}; "
                               f"it was trained on {trained_on!r}: evaluate it with that model (the run's own "
                               "model.path)")
    if lora:
        try:
            lora_io.load_adapter_state(actor, tensors["adapter_model"], str(folder))
        except (ValueError, RuntimeError) as e:   # other names, or the same names with other shapes
            raise refuse(" ".join(str(e).split())[:300]) from None
        return
    why = _does_not_fit({k: tuple(v.shape) for k, v in actor.state_dict().items()}, tensors["actor"])
    if why is not None:
        raise refuse(why)
    set_full_model_state(actor, tensors["actor"])


def run_eval(cfg: Config, checkpoint_folder: Optional[Path], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate cfg.eval on the model (and checkpoint). Returns {"metrics": {...}, "samples": [...],
    "model": ..., "checkpoint": ...}."""
    from edgerl.models.load import init_distributed, load_tokenizer
    from edgerl.config.target import model_spec, plan_for, resolve_target
    from edgerl.train.session import _device_for, apply_env, apply_switches
    if cfg.eval.data is None:
        raise ConfigError("edgerl eval needs the held-out prompts: --data FILE|DATASET|builtin:arithmetic")
    target = resolve_target(cfg.run.profile)
    device, emulation = _device_for(target, cfg)
    if emulation:
        log(emulation)
    init_distributed(device)
    plan = plan_for(cfg, target, model_spec(cfg))
    apply_env(plan, device)
    apply_switches(plan, device)
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer or m.path, m.trust_remote_code)
    r = cfg.rollout
    toolbox, fmt = None, None
    if r.episodes:   # the same episodes as training: tools or the environment in their workers
        from edgerl.agents.toolbox import open_toolbox
        toolbox, fmt = open_toolbox(r, tokenizer, m.path, cfg.data.chat_template, log)
    with contextlib.ExitStack() as stack:
        if toolbox is not None:
            stack.callback(toolbox.close)
        return _run(cfg, checkpoint_folder, target, plan, device, tokenizer, toolbox, fmt, log)


def _run(cfg: Config, checkpoint_folder: Optional[Path], target, plan, device, tokenizer, toolbox, fmt,
         log: Callable[[str], None]) -> dict[str, Any]:
    import torch
    from edgerl.data.heldout import load_eval_prompts
    from edgerl.data.prompts import load_prompts
    from edgerl.models.load import build_actor, lm_weights
    from edgerl.rollout import EngineContext, build_engine
    from edgerl.rollout.base import SamplingParams
    from edgerl.rollout.episodes import EpisodeRollout
    from edgerl.train.evaluate import evaluate, on_engine
    from edgerl.train.session import _reward_functions
    m, r = cfg.model, cfg.rollout
    schemas = toolbox.schemas if toolbox is not None and toolbox.schemas else None
    train = load_prompts(cfg.data, tokenizer, seed=0, log=None, tools=schemas)[0] \
        if cfg.eval.data.startswith("builtin:") else []
    prompts, _ = load_eval_prompts(cfg, tokenizer, train, log, schemas)
    from edgerl.train.overflow import calibrated   # an fp16 plan first measures the model's activations
    plan = calibrated(cfg, target, plan, prompts, device, log)
    functions = _reward_functions(cfg, prompts, log)
    torch.manual_seed(cfg.train.seed)
    actor = build_actor(m.path, plan, device, m.trust_remote_code, cfg.lora.dropout)
    if checkpoint_folder is not None:
        _load_checkpoint(actor, checkpoint_folder, plan.lora is not None, m.path)
    with tempfile.TemporaryDirectory(prefix="edgerl-eval-") as work:
        from edgerl.models.load import save_hf
        engine = build_engine(plan, EngineContext(
            model_path=m.path, trust_remote_code=m.trust_remote_code, device=device,
            max_seq_len=max(len(p.input_ids) for p in prompts) + r.cache_tokens(), seed=cfg.train.seed,
            work_dir=Path(work), actor=actor,
            save_initial=lambda folder: save_hf(dict(lm_weights(actor)), m.path, tokenizer, folder,
                                                m.trust_remote_code)))
        if engine.needs_weights:
            engine.sync_weights(lm_weights(actor))
        log(f"rollout: {engine.describe()}")
        eos = tokenizer.eos_token_id
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                  top_k=r.top_k, eos_token_ids=(eos,) if (r.stop_at_eos and eos is not None) else (),
                                  pad_token_id=tokenizer.pad_token_id)
        if toolbox is not None:
            generate = EpisodeRollout(engine, toolbox, fmt, tokenizer, r).generate
        else:
            generate = on_engine(engine)
        res = evaluate(generate, tokenizer, prompts, functions, sampling, cfg.eval.samples, cfg.train.seed, 0,
                       device, cfg.data.answer_key, keep=len(prompts))
    return {"model": m.path, "checkpoint": str(checkpoint_folder) if checkpoint_folder else None,
            "data": cfg.eval.data, "metrics": res.metrics, "samples": res.samples}
