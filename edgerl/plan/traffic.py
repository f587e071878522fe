"""What several GPUs send each other per step under FSDP2, and how long that takes over a given link.

FSDP2 shards every weight that trains over the processes: before each forward and each backward of a
layer its weights are all-gathered (in the compute dtype, as the mixed-precision policy casts them), and
after each backward the gradients are reduce-scattered (in fp32, the master weights' dtype). A ring
collective over W processes sends (W - 1) / W of the whole tensor out of each process, and across
machines every byte of it crosses the slowest link once per direction, so the link's speed bounds the
step: NCCL's own account of ring algorithms,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md#allreduce .

Per step (the plan's micro-batches set the counts):
- the rollout engine's copy of the weights: one all-gather;
- scoring: one all-gather per no-grad forward of the actor (and of a sharded reference or critic);
- the update: two all-gathers (forward, backward) and one reduce-scatter per micro-batch.
Under LoRA FSDP2 shards the adapters alone (each process keeps the whole frozen base), so the traffic is
the adapters'. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GRAD_BYTES = 4   # FSDP2 reduce-scatters the gradients of fp32 master weights in fp32


@dataclass(frozen=True)
class Traffic:
    world: int
    nodes: int
    link_gbps: float
    gathered_bytes: int      # sent by one process per step in all-gathers
    reduced_bytes: int       # sent by one process per step in reduce-scatters
    seconds: float           # at the link's speed, if nothing overlaps it with compute

    @property
    def total_bytes(self) -> int:
        return self.gathered_bytes + self.reduced_bytes

    def line(self) -> str:
        gib = self.total_bytes / 2**30
        where = (f"over {self.nodes} machines at {self.link_gbps:g} Gbit/s" if self.nodes > 1 else
                 f"within one machine (at {self.link_gbps:g} Gbit/s)")
        return (f"collectives: {gib:.2f} GiB sent per GPU per step ({self.gathered_bytes / 2**30:.2f} GiB of "
                f"weight all-gathers, {self.reduced_bytes / 2**30:.2f} GiB of gradient reduce-scatters) {where}: "
                f"about {self.seconds:.1f} s per step if none of it overlaps with compute")


def collective_traffic(*, trained_params: int, compute_bytes: int, world: int, nodes: int, link_gbps: float,
                       sequences: int, micro_batch: int, score_micro_batch: int, epochs: int = 1,
                       sharded_frozen: int = 0, critic: bool = False) -> Traffic:
    """The bytes one process sends per step, and their time over a `link_gbps` link.

    trained_params: parameters FSDP2 shards and trains (all of them, or the LoRA adapters);
    sharded_frozen: the parameters of a sharded reference model (0 under LoRA, where the reference is the
    base with its adapter disabled); sequences: this process's sequences per step."""
    if world < 1 or nodes < 1 or nodes > world:
        raise ValueError(f"world {world}, nodes {nodes}: every machine runs at least one process")
    if world == 1:
        return Traffic(world, nodes, link_gbps, 0, 0, 0.0)
    share = (world - 1) / world
    micro = math.ceil(sequences / max(1, micro_batch)) * epochs
    scores = math.ceil(sequences / max(1, score_micro_batch))
    models = 2 if critic else 1
    gathered = trained_params * compute_bytes * (1 + models * scores + 2 * models * micro)
    gathered += sharded_frozen * compute_bytes * scores
    reduced = trained_params * GRAD_BYTES * models * micro
    gathered, reduced = int(gathered * share), int(reduced * share)
    seconds = (gathered + reduced) * 8 / (link_gbps * 1e9)
    return Traffic(world, nodes, link_gbps, gathered, reduced, seconds)


def plan_traffic(plan, nodes: int, link_gbps: float) -> Traffic:
    """`collective_traffic` for a Plan made for `plan.task.world_size` processes over `nodes` machines."""
    task = plan.task
    trained = plan.lora["params"] if plan.lora else plan.model.n_params()
    frozen = plan.model.n_params() if (task.kl and not plan.lora) else 0
    return collective_traffic(trained_params=trained, compute_bytes=plan.dtype.compute_bytes,
                              world=task.world_size, nodes=nodes, link_gbps=link_gbps,
                              sequences=task.local_sequences, micro_batch=plan.micro_batch,
                              score_micro_batch=plan.score_micro_batch, sharded_frozen=frozen,
                              critic=task.critic)
