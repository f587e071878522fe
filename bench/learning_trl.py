"""TRL's side of bench_learning.py: GRPOTrainer (TRL 1.16) on a task's rows, with edgerl's held-out evaluation
(the same prompt token ids, greedy answers from HF generate, edgerl's scorer) at the same steps. Run as a child
process: `python bench/learning_trl.py SPEC.json`. It writes the spec's result JSON after every step (atomically,
so a run cut short keeps its steps) and an edgerl-style metrics.jsonl in its run folder, so that
`edgerl plot EDGERL_RUN TRL_RUN` draws both.

A step's wall time runs from TRL's on_step_begin to its on_step_end (generation, reward, the loss's forward and
backward, the optimizer step), taken before the evaluation runs: evaluation time is left out, as edgerl's
perf/step_s leaves out its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_tasks as lt  # noqa: E402


def trl_config(spec: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """GRPOConfig's arguments: every setting that edgerl's side also has, explicit (bench_learning.py's table)."""
    n = spec["prompts_per_step"] * spec["samples"]
    return dict(
        # one generation of prompts x samples responses, one optimizer step on all of them (edgerl: mini_batch
        # = all, ppo_epochs 1)
        per_device_train_batch_size=n, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=spec["samples"], max_completion_length=spec["new_tokens"], max_steps=spec["steps"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, repetition_penalty=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, importance_sampling_level="token",
        loss_type="dapo",           # token-level mean over the whole batch = edgerl's algo.loss_agg="token-mean"
        scale_rewards="group",      # (r - group mean) / (group std + eps) = edgerl's norm_adv_by_std=true
        mask_truncated_completions=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        shuffle_dataset=False,      # the rows are already in the order edgerl draws them
        seed=spec["seed"], data_seed=spec["seed"],
        # not a learning setting: the 135M model fits either way and checkpointing only slows TRL
        gradient_checkpointing=False,
        # TRL's own default on a GPU (bf16 autocast over fp32 weights); fp32 on the CPU
        bf16=cuda, fp16=False, use_cpu=not cuda,
        model_init_kwargs={"dtype": "float32"},
        use_vllm=False, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        output_dir=str(Path(spec["run_dir"]) / "trainer"),
    )


def greedy(model, prompts: list[Any], new_tokens: int, eos: int, pad: int, batch: int = 64) -> list[list[int]]:
    """HF generate, greedy, left-padded batches; each response cut after its first EOS (kept, as edgerl keeps it)."""
    import torch
    out: list[list[int]] = []
    dev = next(model.parameters()).device
    for i in range(0, len(prompts), batch):
        ids = [list(p.input_ids) for p in prompts[i:i + batch]]
        width = max(map(len, ids))
        x = torch.tensor([[pad] * (width - len(s)) + s for s in ids], device=dev)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids], device=dev)
        with torch.no_grad():
            gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad, top_k=None, top_p=None, temperature=None)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(eos) + 1] if eos in row else row)
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out, run_dir = Path(spec["out"]), Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"status": "running", "steps": [], "evals": []}
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.write_text("")
    t_start = time.time()
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        import trl
        from trl import GRPOConfig, GRPOTrainer
        cuda = spec["device"] == "cuda"
        if not cuda:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        tok = AutoTokenizer.from_pretrained(spec["model"])
        train = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines()]
        heldout = lt.prompt_ids(Path(spec["heldout"]), tok)
        ds = Dataset.from_list([{"prompt": r["prompt"], "data_source": r["data_source"],
                                 "ground_truth": r["reward_model"]["ground_truth"]} for r in train])

        def reward(completions, data_source, ground_truth, **_):
            texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
            return [lt.reward(s, t, g) for s, t, g in zip(data_source, texts, ground_truth)]

        args = GRPOConfig(**trl_config(spec, cuda))
        res["config"] = {k: getattr(args, k) for k in (
            "loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high", "num_generations", "generation_batch_size",
            "steps_per_generation", "gradient_accumulation_steps", "per_device_train_batch_size", "num_iterations",
            "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
            "max_grad_norm", "temperature", "top_p", "top_k", "max_completion_length", "bf16", "fp16",
            "gradient_checkpointing", "shuffle_dataset", "mask_truncated_completions", "seed", "optim")}
        res["versions"] = {"trl": trl.__version__, "torch": torch.__version__}
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos   # as TRL pads a tokenizer without a pad token
        rows: dict[int, dict[str, Any]] = {}

        def flush() -> None:
            res["wall_s"] = time.time() - t_start
            write_json(out, res)
            lines = [json.dumps({"step": s, **rows[s]}) for s in sorted(rows)]
            tmp = metrics_path.with_name("metrics.jsonl.tmp")
            tmp.write_text("".join(x + "\n" for x in lines))
            os.replace(tmp, metrics_path)

        def evaluate(model, step: int) -> None:
            t0 = time.perf_counter()
            was_training = model.training
            model.eval()
            responses = greedy(model, heldout, spec["new_tokens"], eos, pad)
            model.train(was_training)
            acc, _ = lt.accuracy(tok, heldout, responses)
            res["evals"].append({"step": step, "accuracy": acc, "eval_s": time.perf_counter() - t0,
                                 "response_length": sum(map(len, responses)) / len(responses)})
            rows.setdefault(step, {})["eval/accuracy"] = acc
            flush()

        class Bench(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kw):
                evaluate(model, 0)

            def on_step_begin(self, args, state, control, **kw):
                if cuda:
                    torch.cuda.synchronize()
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kw):
                if cuda:
                    torch.cuda.synchronize()
                res["steps"].append({"step": state.global_step, "wall_s": time.perf_counter() - self.t})
                rows.setdefault(state.global_step, {})["perf/step_s"] = res["steps"][-1]["wall_s"]
                step = state.global_step
                if step % spec["every"] == 0 or step == spec["steps"]:
                    evaluate(model, step)
                flush()

            def on_log(self, args, state, control, logs=None, **kw):
                if not logs or "reward" not in logs or not res["steps"]:
                    return
                last = res["steps"][-1]
                last.update(reward_mean=logs["reward"], length_mean=logs.get("completions/mean_length"),
                            clipped_ratio=logs.get("completions/clipped_ratio"))
                rows.setdefault(last["step"], {}).update({"reward/mean": logs["reward"],
                                                          "response/length_mean": logs.get("completions/mean_length")})
                flush()

        trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reward], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[Bench()])
        # the prompts TRL generates from must be the ones edgerl does: its own tokenization of the first rows
        mine, _, _ = trainer._tokenize_prompts([r["prompt"] for r in train[:spec["prompts_per_step"]]])
        theirs = lt.prompt_ids(Path(spec["train"]), tok)[:spec["prompts_per_step"]]
        res["prompt_ids_match"] = [list(a) for a in mine] == [list(p.input_ids) for p in theirs]
        res["setup_s"] = time.time() - t_start
        trainer.train()
        res["status"] = "ok" if len(res["steps"]) == spec["steps"] else f"stopped after {len(res['steps'])} step(s)"
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback
        res.update(status=f"error: {type(e).__name__}: {e}"[:1500], trace=traceback.format_exc()[-3000:])
    res["wall_s"] = time.time() - t_start
    write_json(out, res)


if __name__ == "__main__":
    main(sys.argv[1])
