"""Several processes, one per GPU, under torchrun: who this process is, and the few collective steps
the loop needs (agreeing on a decision, summing counts, gathering a step's results for rank 0).

With one process every function here is the identity, so the single-GPU and CPU paths run the same
code. A collective that one rank skips makes the others wait forever; each function says which
ranks must call it (all of them, always).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    local: int = 0            # the GPU index on this machine (torchrun's LOCAL_RANK)

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env(env: Optional[dict[str, str]] = None) -> Rank:
    """The rank torchrun gave this process (RANK, WORLD_SIZE, LOCAL_RANK), or a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return Rank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))
    return Rank()


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_floats(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (all ranks call it)."""
    if world() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def tensor_sum(device: torch.device) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """A function summing a small tensor over ranks (for statistics over the global batch), or None
    with one process (all ranks call the function it returns, in the same order)."""
    if world() == 1:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().to(device=device, dtype=torch.float64).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device, t.dtype)
    return reduce


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is true on any rank (all ranks call it): e.g. a signal that reached one process."""
    if world() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (all ranks call it)."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def agree(fn: Callable[[], Any], main: bool) -> Any:
    """Run `fn` on rank 0 and give its result to every rank; an exception it raises is raised on
    every rank (same class and message), so no rank goes on to wait for the others."""
    if world() == 1:
        return fn()
    box: list[Any] = [None]
    if main:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # re-raised below, on every rank
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def shutdown() -> None:
    """End a torchrun process group cleanly: every rank waits for the others, then tears it down
    (a rank that exits while a peer still talks to it can abort the peer)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()
