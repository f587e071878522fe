"""One PPO update on fixed rollouts, run as one process or as N under torchrun; writes the updated
weights (rank 0) so a test can compare N processes with one. The rollouts carry sampled log-probs off the
trainer's, weighed by the rollout correction CORRECTION (none, tis or mis) at LEVEL (token or sequence).

    python tests/two_ranks_update.py MODEL OUT.pt RUN_DIR ADVANTAGE CORRECTION LEVEL
    torchrun --standalone --nproc_per_node 2 tests/two_ranks_update.py MODEL OUT.pt RUN_DIR ADVANTAGE CORRECTION LEVEL
"""

import sys
from dataclasses import replace

import torch

from edgerl.train import ranks
from edgerl.train import session
from edgerl.train.experience import Experience, advantages, policy_logprobs
from edgerl.models.load import lm_weights
from edgerl.train.trainer import Trainer


def fixed_rollouts(vocab: int, prompts: int, n: int) -> Experience:
    """The same rollouts on every rank: 2 groups of n samples with ragged responses and scores."""
    g = torch.Generator().manual_seed(7)
    B, P, R = prompts * n, 6, 9
    ids = torch.randint(5, vocab, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[::3, :2] = 0                                   # left padding on some prompts
    lengths = torch.randint(2, R + 1, (B,), generator=g)
    for i, n_tok in enumerate(lengths.tolist()):
        mask[i, P + n_tok:] = 0
    scores = torch.randn(B, generator=g)
    return Experience(input_ids=ids, attention_mask=mask, response_ids=ids[:, P:].clone(),
                      response_mask=mask[:, P:].float(), start=P - 1, scores=scores)


def sampled_by_another_engine(t: Trainer, exp: Experience) -> Experience:
    """`exp` with sampled log-probs: the trainer's own, off by noise of about 0.7 (every rank computes the
    same forward over the same rows, as FSDP2 needs)."""
    logp, _ = policy_logprobs(t.actor, exp, 4, 1.0, t.device)
    noise = 0.7 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(11))
    return replace(exp, sampled_logp=(logp + noise) * exp.response_mask)


def main() -> None:
    model, out, run_dir, adv, corr, level = sys.argv[1:7]
    sets = [f'model.path="{model}"', 'run.profile="cpu"', "train.prompts_per_step=2", "rollout.n_samples=4",
            f'algo.rollout_correction="{corr}"', f'algo.rollout_correction_level="{level}"',
            f'algo.advantage="{adv}"', "algo.kl_coef=0", "train.lr=1e-3", "rollout.max_new_tokens=9",
            "data.num_examples=16", "run.tensorboard=false", "train.micro_batch=2"]
    cfg, _ = session.load(sets=sets, out=run_dir)
    t = Trainer(session.prepare(cfg, None, log=lambda s: None))
    exp = sampled_by_another_engine(t, fixed_rollouts(t.tokenizer.vocab_size, 2, 4))
    k = len(exp) // t.world
    mine = exp.rows(slice(t.rank * k, (t.rank + 1) * k))   # whole groups: 4 samples of one prompt per rank
    mine = advantages(mine, cfg.algo, cfg.rollout.n_samples, 0.0, ranks.tensor_sum(t.device))
    stats = t.update(mine, 0.0)
    weights = {name: w.clone() for name, w in lm_weights(t.actor)}   # every rank joins the all-gather
    if t.rank == 0:
        torch.save({"weights": weights, "stats": stats, "advantages": ranks.gather(mine.advantages)}, out)
    else:
        ranks.gather(mine.advantages)
    t.session.close()
    ranks.shutdown()


if __name__ == "__main__":
    main()
