"""The episode statistics of a step whose episodes are split over ranks: each rank holds its share of
EPISODES (made-up episodes, ragged), logs them through the trainer's reductions over ranks, and rank 0
writes what it logged.

    torchrun --standalone --nproc_per_node 2 tests/two_ranks_episode_metrics.py OUT.json
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from edgerl.rollout.base import RolloutBatch
from edgerl.rollout.episodes import episode_metrics
from edgerl.train import ranks

ENDED = ("answer", "max_turns", "budget", "answer", "truncated", "environment", "answer")


def episode(i: int) -> SimpleNamespace:
    return SimpleNamespace(turns=1 + i % 4, tool_calls=i % 3, tool_errors=int(i == 5), model_tokens=10 + 7 * i,
                           context_tokens=3 * i, ended_by=ENDED[i % len(ENDED)],
                           turn_rewards=[0.5] * (i % 2) + [1.0] * (i == 4))


# rank r's episodes and what its tool worker and turn loop reported
EPISODES = {0: [0, 1, 2, 3, 4], 1: [5, 6, 7]}
INFO = {0: {"timeouts": 1, "restarts": 0, "seconds": 0.25, "tool_wait_s": 0.5, "rounds": 3, "extend_s": 0.1},
        1: {"timeouts": 2, "restarts": 1, "seconds": 0.75, "tool_wait_s": 0.25, "rounds": 4, "extend_s": 0.05}}


def batch(rank: int) -> RolloutBatch:
    eps = [episode(i) for i in EPISODES[rank]]
    return RolloutBatch(prompt_ids=[[1]] * len(eps), response_ids=[[2]] * len(eps), truncated=[False] * len(eps),
                        info=dict(INFO[rank]), episodes=eps)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    got = episode_metrics(batch(rank), lambda v: ranks.sum_floats(v, device), lambda v: ranks.max_floats(v, device))
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()
