"""What a resume may change since its checkpoint, and how each change takes effect.

A resumed run is built from its config (config.toml or the checkpoint's own, with --set applied),
then the checkpoint's state is loaded into it. A key whose value differs from the one the checkpoint
was written with takes effect in one of three ways:

    applied    the run reads it from the config (train.steps, rollout.*, reward.*, algo.clip_*, ...):
               nothing in the checkpoint overrides it
    restored   the checkpoint holds a copy (`RESTORED`: the optimizer's lr, betas and weight decay, the
               schedule's base rate, the KL coefficient); after loading, `apply` writes the new value
               into that state, and says so. The learning rate is recomputed whenever a key of the
               schedule changed (`SCHEDULE`), so the step after the resume already uses it
    refused    the checkpoint's state cannot follow it (`REFUSED`, and `check`'s structural rules: LoRA
               or a critic turned on or off, another optimizer state format, another number of
               prompts: `STRUCTURAL`): one line, before anything is written. Another number of processes
               is no change to refuse: the checkpoint's full state dicts re-shard (state.restore, `RESHARDED`)

`table()` is docs/run-folders.md's table of these (`python -m edgerl.train.resume`; a test compares them).

Nothing is announced that is not done: `changes` lists every differing key, and `apply` prints them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from edgerl.config.schema import Config, to_dict
from edgerl.core.errors import CheckpointError

# keys whose value the checkpoint also holds, in the state named here
RESTORED = {
    "train.lr": "the optimizer's and the schedule's learning rate",
    "train.critic_lr": "the critic optimizer's and schedule's learning rate",
    "train.betas": "the optimizer's betas",
    "train.weight_decay": "the optimizer's weight decay",
    "algo.kl_coef": "the KL controller's coefficient",
}
# keys the learning rate of the current step is computed from (trainer.lr_lambda)
SCHEDULE = ("train.lr", "train.critic_lr", "train.steps", "train.warmup_ratio", "train.lr_schedule",
            "train.min_lr_ratio")
# keys the checkpoint's state cannot follow, with why
REFUSED = {
    "train.seed": "the sampling RNG and the prompt order continue from the checkpoint, which the seed made",
    "data.shuffle": "the prompt order continues from the checkpoint, which was made with the old setting",
    "lora.rank": "the checkpoint's adapter has the old rank's shapes",
    "lora.target_modules": "the checkpoint's adapter covers the old modules",
    "sft.enabled": "the checkpoint's data position is over the other kind of rows (SFT conversations or RL prompts); "
                   "go from SFT to RL in a new run from RUN/final",
}
# where the run lives, not how it trains
IGNORED = ("run.out_dir",)
# what `check` refuses besides the keys of REFUSED: the checkpoint's state has another structure
STRUCTURAL = ("LoRA or a critic turned on or off (`lora.enabled`, `algo.advantage`)",
              "another optimizer state format (`plan.optimizer`)", "data that gives another number of prompts")
# what a resume on another number of processes does (state.restore): no change to refuse
RESHARDED = ("another number of processes (`torchrun --nproc_per_node`)",
             "the checkpoint's full state dicts re-shard over the new processes, the prompt order continues where "
             "it stopped, and each process starts a new sampling stream from `train.seed`, the step and its rank")


def _flat(cfg: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for section, values in cfg.items():
        if isinstance(values, dict):
            for key, value in values.items():
                out[f"{section}.{key}"] = json.loads(json.dumps(value, default=str))  # as meta.json holds it
    return out


def changes(saved: Optional[dict[str, Any]], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """'section.key' -> (value in the checkpoint's config, value now) for every key that differs;
    keys one of the two does not know (another edgerl version) are left out."""
    if not isinstance(saved, dict):
        return {}
    old, new = _flat(saved), _flat(to_dict(cfg))
    return {k: (old[k], v) for k, v in new.items() if k in old and old[k] != v and k not in IGNORED}


def _meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _refuse(point: Any, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"--resume {point.checkpoint}: {what}; {fix}")


def check(point: Any, cfg: Config, plan: Any, n_prompts: int, world: int) -> None:
    """Refuse, before anything is written, a resume whose changes the checkpoint's state cannot follow.
    `point` is a runfolder.ResumePoint, `plan` this run's plan, `n_prompts` the prompts loaded now and
    `world` the number of processes."""
    import torch
    folder = point.checkpoint
    meta = _meta(folder)
    new_run = "or train them in a new run from the model (--out NEW_FOLDER without --resume)"
    # the kind of weights first: a changed lora.rank means nothing to a checkpoint without an adapter
    lora = (folder / "adapter_model.safetensors").exists()
    if lora != (plan.lora is not None):
        had, has = ("a LoRA adapter", "trains every weight") if lora else ("full weights", "trains LoRA")
        raise _refuse(point, f"the checkpoint holds {had}, but this run {has}",
                      f"resume with the lora.enabled the run had ({str(lora).lower()}), {new_run}")
    for key, (old, new) in changes(meta.get("config"), cfg).items():
        if key in REFUSED and (not key.startswith("lora.") or plan.lora is not None):
            raise _refuse(point, f"{key} changed from {json.dumps(old)} to {json.dumps(new)}, but {REFUSED[key]}",
                          f"resume with {key}={json.dumps(old)} (the run's value), {new_run}")
    critic = (folder / "critic.safetensors").exists()
    if critic != bool(plan.task.critic):
        had = "a critic (algo.advantage=gae)" if critic else "no critic"
        raise _refuse(point, f"the checkpoint holds {had}, but this run "
                      f"{'has none' if critic else 'trains one'} (algo.advantage={cfg.algo.advantage})",
                      f"resume with the run's algo.advantage "
                      f"({(meta.get('config') or {}).get('algo', {}).get('advantage', 'of the run')}), {new_run}")
    saved_opt = (meta.get("plan") or {}).get("optimizer")
    if saved_opt is not None and saved_opt != plan.optimizer:
        raise _refuse(point, f"the checkpoint's optimizer state is {saved_opt}'s, but this run's plan uses "
                      f"{plan.optimizer}", f"resume with --set plan.optimizer={saved_opt}, {new_run}")
    try:
        train = torch.load(folder / "train.pt", map_location="cpu", weights_only=False)
        sampler = train["sampler"]
    except Exception as e:  # the checksums passed; a train.pt of another layout is refused here, in one line
        raise _refuse(point, f"{folder / 'train.pt'} cannot be read ({type(e).__name__}: {e})",
                      "resume from another checkpoint") from None
    if sampler.get("n_prompts") != n_prompts:
        raise _refuse(point, f"the data now gives {n_prompts} prompts, but the checkpoint's prompt order is over "
                      f"{sampler.get('n_prompts')}", f"resume with the run's data settings, {new_run}")


def apply(st: Any, cfg: Config, saved: Optional[dict[str, Any]], log: Callable[[str], None]) -> list[str]:
    """After a checkpoint was loaded into `st` (a state.TrainState): write the RESTORED keys that
    changed into the loaded state, recompute the learning rate when its schedule changed, and log one
    line naming every changed key. Returns the changed keys."""
    found = changes(saved, cfg)
    if not found:
        return []
    t = cfg.train
    for ln, lr in ((st.actor, t.lr), (st.critic, t.critic_lr)):
        if ln is None:
            continue
        if any(k in found for k in SCHEDULE):
            set_lr(ln, lr)
        for g in ln.optim.param_groups:
            if "train.betas" in found and "betas" in g:
                g["betas"] = tuple(t.betas)
            if "train.weight_decay" in found and "weight_decay" in g:
                g["weight_decay"] = t.weight_decay
    if "algo.kl_coef" in found:
        st.loop.kl_ctl.value = float(cfg.algo.kl_coef)
    shown = []
    for key, (old, new) in found.items():
        note = f" (set in {RESTORED[key]})" if key in RESTORED else ""
        shown.append(f"{key} {_short(old)} -> {_short(new)}{note}")
    log(f"changed since the checkpoint of step {st.loop.step}, in effect from step {st.loop.step + 1}: "
        + "; ".join(shown))
    return list(found)


def set_lr(ln: Any, lr: float) -> None:
    """Make `lr` the base rate of learner `ln`'s restored schedule, and its optimizer's rate the
    schedule's value at the current step (the rate the next update uses)."""
    sched, groups = ln.sched, ln.optim.param_groups
    sched.base_lrs = [lr for _ in groups]
    for g, f in zip(groups, sched.lr_lambdas):
        g["initial_lr"] = lr
        g["lr"] = lr * f(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in groups]


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _keys(keys: Any) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def table() -> str:
    """docs/run-folders.md's table of what a resume does with each change, from the constants above and the
    config's keys: a key added to the config lands in the applied row unless it is named here."""
    named = set(RESTORED) | set(REFUSED) | set(IGNORED)
    whole, rest = [], []
    for section, values in to_dict(Config()).items():
        keys = {f"{section}.{k}" for k in values} if isinstance(values, dict) else set()
        (rest if keys & named else whole).append(f"`{section}.*`")
    rows = [
        ("applied", f"every key not named below: {', '.join(whole)}, and the rest of {', '.join(rest)}",
         "read from the config, as in a new run"),
        ("restored, then set", _keys(RESTORED),
         "the checkpoint holds these too (the optimizer, the schedule, the KL controller); the new value is written "
         "into the restored state, and `actor/lr` / `actor/kl_coef` show it from the next step; a change to "
         f"any of {_keys(SCHEDULE)} recomputes the next step's learning rate"),
        ("refused", f"{_keys(REFUSED)}; {'; '.join(STRUCTURAL)}",
         "one line naming the key and the run's value, before anything is written"),
        ("re-sharded", RESHARDED[0], RESHARDED[1]),
        ("ignored", _keys(IGNORED), "where the run lives, not how it trains"),
    ]
    return "\n".join(["| kind | keys | what happens |", "|---|---|---|"]
                     + [f"| {kind} | {keys} | {what} |" for kind, keys, what in rows])


if __name__ == "__main__":
    print(table())
