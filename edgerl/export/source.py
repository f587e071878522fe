"""What `edgerl export RUN|MODEL` reads: a run folder (its final/ export or one checkpoint) or an HF model.

    RUN                     RUN/final (merged weights); RUN/final-adapter merged over the base when final/ was
                            not written (lora.export_merged=false)
    RUN --step N            RUN/checkpoints/step-N: full weights, or the LoRA adapter merged over the base
    RUN/checkpoints/step-N  the same
    MODEL                   an HF folder with config.json and safetensors, a hub id in the local cache, or the
                            embedded model's name

The run's config, plan, step and last evaluation come along for the model card.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from edgerl.core.errors import ModelError, RunDirError
from edgerl.export.tensors import HfWeights, LoraMerged


@dataclass
class Source:
    what: str                              # for messages: "run runs/x, final/ (step 20)"
    config_dir: Path                       # the HF folder whose config.json describes the model
    tokenizer_dir: Path                    # the folder holding the tokenizer (and its chat template)
    weights: Union[HfWeights, LoraMerged]
    name: str                              # a short name for files: the run's or the model's folder name
    run: Optional[Path] = None
    step: Optional[int] = None
    base: Optional[str] = None             # the model the run started from
    run_config: Optional[str] = None       # the run's config.toml text
    plan: Optional[dict[str, Any]] = None  # plan.json
    evals: dict[str, float] = field(default_factory=dict)   # the last evaluation's eval/* metrics
    eval_step: Optional[int] = None
    notes: list[str] = field(default_factory=list)


RUN_MARKS = ("config.toml", "checkpoints", "final", "final-adapter", "metrics.jsonl")


def resolve(given: str, step: Optional[int] = None, log: Callable[[str], None] = print) -> Source:
    """The Source for what the user typed; a one-line ModelError/RunDirError when it is none of the above."""
    path = Path(given).expanduser()
    if not path.exists():
        if step is not None:
            raise RunDirError(f"{given}: no such run folder")
        return _model(given, log)
    if not path.is_dir():
        raise RunDirError(f"{given} is a file; give a run folder (edgerl train's --out), one of its checkpoints, "
                          "or an HF model folder")
    if (path / "meta.json").is_file():
        if step is not None:
            raise RunDirError(f"{given} is already one checkpoint; leave out --step")
        return _checkpoint(path, path.parent.parent if path.parent.name == "checkpoints" else None, log)
    if any((path / m).exists() for m in RUN_MARKS) and not (path / "config.json").is_file():
        return _run(path, step, log)
    if (path / "adapter_config.json").is_file():   # RUN/final-adapter given itself
        return _adapter_export(path.parent, path, log)
    if step is not None:
        raise RunDirError(f"--step goes with a run folder; {given} is not one")
    if (path / "config.json").is_file():
        return _model(str(path), log)
    raise RunDirError(f"{given} is neither a run folder (it has none of {', '.join(RUN_MARKS)}) nor an HF model "
                      "folder (no config.json)")


def _model(given: str, log: Callable[[str], None]) -> Source:
    from edgerl.core.hub import is_hub_id
    from edgerl.models.embedded import is_embedded
    from edgerl.models.load import model_source
    if not (is_embedded(given) or is_hub_id(given) or Path(given).expanduser().is_dir()):
        raise RunDirError(f"{given}: no such folder (give a run folder, an HF model folder or a hub id)")
    folder = Path(model_source(given))
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} has no config.json: not an HF model folder")
    return Source(what=f"model {given}", config_dir=folder, tokenizer_dir=folder, weights=HfWeights(folder),
                  name=_short(given))


def _run(run: Path, step: Optional[int], log: Callable[[str], None]) -> Source:
    from edgerl.train import checkpoint
    if step is not None:
        folder = run / "checkpoints" / f"step-{step:06d}"
        if not folder.is_dir():
            have = [p.name for p in checkpoint.checkpoints(run)]
            raise RunDirError(f"{run} has no checkpoint of step {step} (it has: {', '.join(have) or 'none'})")
        return _checkpoint(folder, run, log)
    if (run / "final" / "config.json").is_file():
        src = _with_run(_model(str(run / "final"), log), run)
        src.what = f"run {run}, final/" + (f" (step {src.step})" if src.step is not None else "")
        return src
    if (run / "final-adapter" / "adapter_config.json").is_file():
        return _adapter_export(run, run / "final-adapter", log)
    have = [p.name for p in checkpoint.checkpoints(run)]
    raise RunDirError(f"{run} has no final/ export (the run has not finished, or run.export_final=false); export a "
                      "checkpoint with --step N" + (f" (it has: {', '.join(have)})" if have else " (it has none)"))


def _base_of(run_config: dict[str, Any], where: Path) -> tuple[Path, Path, str]:
    """(config folder, tokenizer folder, base name) of the model a run started from."""
    from edgerl.models.load import model_source
    model = run_config.get("model") or {}
    base = model.get("path")
    if not isinstance(base, str):
        raise RunDirError(f"{where}: its config names no model.path, so the base model is unknown")
    try:
        folder = Path(model_source(base))
        tok = Path(model_source(model["tokenizer"])) if model.get("tokenizer") else folder
    except (OSError, ValueError) as e:
        raise ModelError(f"the run's base model {base!r} cannot be found ({e}); the export needs it beside the "
                         "checkpoint") from None
    if not (folder / "config.json").is_file():
        raise ModelError(f"the run's base model {base!r} ({folder}) has no config.json")
    return folder, tok, base


def _checkpoint(folder: Path, run: Optional[Path], log: Callable[[str], None]) -> Source:
    from edgerl.train import checkpoint
    why = checkpoint.damage(folder)
    if why is not None:
        raise RunDirError(f"checkpoint {folder} cannot be exported: {why}")
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    cfg_dir, tok_dir, base = _base_of(meta.get("config") or {}, folder)
    if (folder / "adapter_model.safetensors").is_file():
        weights: Union[HfWeights, LoraMerged] = LoraMerged(HfWeights(cfg_dir), folder)
    elif (folder / "actor.safetensors").is_file():
        weights = HfWeights(folder, prefix="lm.", files=[folder / "actor.safetensors"])
    else:
        raise RunDirError(f"checkpoint {folder} holds neither actor.safetensors nor a LoRA adapter")
    src = Source(what=f"checkpoint {folder} (step {meta.get('step')})", config_dir=cfg_dir, tokenizer_dir=tok_dir,
                 weights=weights, name=(run.name if run else folder.name), base=base, step=meta.get("step"),
                 plan=None)
    if run is not None:
        src = _with_run(src, run)
    src.step = meta.get("step")
    src.plan = src.plan or ({"plan": meta["plan"]} if isinstance(meta.get("plan"), dict) else None)
    _note_quantized_base(src, log)
    return src


def _adapter_export(run: Path, adapter: Path, log: Callable[[str], None]) -> Source:
    cfg = _run_config(run)
    if cfg is None:
        raise RunDirError(f"{adapter} is a LoRA adapter, but {run / 'config.toml'} (which names its base model) is "
                          "missing")
    cfg_dir, tok_dir, base = _base_of(cfg, run / "config.toml")
    src = _with_run(Source(what=f"run {run}, final-adapter/ merged over {base}", config_dir=cfg_dir,
                           tokenizer_dir=tok_dir, weights=LoraMerged(HfWeights(cfg_dir), adapter),
                           name=run.name, base=base), run)
    from edgerl.train.runfolder import export_step
    src.step = export_step(adapter)
    _note_quantized_base(src, log)
    return src


def _run_config(run: Path) -> Optional[dict[str, Any]]:
    try:
        return tomllib.loads((run / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _with_run(src: Source, run: Path) -> Source:
    """`src` with its run's config, plan, step and last evaluation."""
    from edgerl.train.runfolder import export_step
    src.run, src.name = run, run.resolve().name
    if (run / "config.toml").is_file():
        src.run_config = (run / "config.toml").read_text(encoding="utf-8", errors="replace")
        cfg = _run_config(run) or {}
        src.base = (cfg.get("model") or {}).get("path", src.base)
    try:
        src.plan = json.loads((run / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    src.step = export_step(src.config_dir) if src.step is None else src.step
    src.eval_step, src.evals = last_eval(run, src.step)
    return src


def last_eval(run: Path, step: Optional[int] = None) -> tuple[Optional[int], dict[str, float]]:
    """The eval/* metrics of the last evaluation at or before `step` (all steps when None)."""
    from edgerl.train.metrics import read_metrics
    if not (run / "metrics.jsonl").is_file():
        return None, {}
    found: tuple[Optional[int], dict[str, float]] = (None, {})
    for row in read_metrics(run, log=None):
        evals = {k: v for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        if evals and (step is None or row.get("step", 0) <= step):
            found = (row.get("step"), evals)
    return found


def _note_quantized_base(src: Source, log: Callable[[str], None]) -> None:
    plan = (src.plan or {}).get("plan") or {}
    if isinstance(src.weights, LoraMerged) and plan.get("base_dtype") in ("nf4", "int8"):
        note = (f"the run trained its adapter over a {plan['base_dtype']} copy of the base; it is merged over the "
                "base's own 16-bit weights, as peft's merge_and_unload does")
        src.notes.append(note)
        log(note)


def _short(given: str) -> str:
    name = Path(given.rstrip("/")).name or given
    return name.replace(":", "-")
