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

from edgerl.core.errors import ConfigError


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    local: int = 0            # the GPU index on this machine (torchrun's LOCAL_RANK)

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env(env: Optional[dict[str, str]] = None) -> Rank:
    """The rank torchrun gave this process (RANK, WORLD_SIZE, LOCAL_RANK), or a single process. Values
    torchrun would not set (not a whole number, a rank outside the world, one of RANK and WORLD_SIZE
    without the other, or no MASTER_ADDR/MASTER_PORT to meet at) are a ConfigError in one line: left in
    a shell by hand, they would make this process wait for peers that never come, or stay silent."""
    env = os.environ if env is None else env
    given = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env]
    if not given:
        return Rank()
    fix = (f"these variables are set by torchrun: unset them (unset {' '.join(given)}) to run one process, or "
           "start edgerl with torchrun --nproc_per_node N")
    values = {}
    for key in given:
        try:
            values[key] = int(env[key].strip())
        except ValueError:
            raise ConfigError(f"{key}={env[key]!r} is not a whole number; {fix}") from None
    if "RANK" not in values or "WORLD_SIZE" not in values:
        if given == ["LOCAL_RANK"]:   # alone it names a GPU for some launchers; edgerl runs one process
            return Rank()
        raise ConfigError(f"{' and '.join(given)} set without {'WORLD_SIZE' if 'RANK' in values else 'RANK'}; {fix}")
    rank, world = values["RANK"], values["WORLD_SIZE"]
    local = values.get("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}: a rank must be in 0..WORLD_SIZE-1 "
                          f"and WORLD_SIZE at least 1; {fix}")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} are set, but not {' and '.join(missing)}: not set by "
                          f"torchrun, which sets them all; {fix}")
    return Rank(rank, world, local)


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_floats(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (all ranks call it)."""
    if world() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def max_floats(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over ranks (all ranks call it)."""
    if world() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
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


# --- a signal or a failure on one rank -------------------------------------------------------------

_STOP_KEY = "edgerl/stop"


def _store() -> Any:
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()   # torchrun's key-value store, which every rank reaches


def announce_stop(what: str) -> None:
    """Tell every rank that this one received a signal (`what`: its name), through torchrun's store, at
    once: a rank waiting on a reward that does not return learns it there (stopped_elsewhere), not
    at the next collective, which it may never reach."""
    if world() == 1:
        return
    try:
        if not _store().check([_STOP_KEY]):
            _store().set(_STOP_KEY, f"{what} (to rank {dist.get_rank()})")
    except Exception:   # the store is gone: the ranks are ending anyway; the next collective still agrees
        pass


def stopped_elsewhere() -> Optional[str]:
    """The signal a rank announced ('SIGTERM (to rank 1)'), or None (any rank may call it, any time)."""
    if world() == 1:
        return None
    try:
        store = _store()
        return store.get(_STOP_KEY).decode("utf-8", "replace") if store.check([_STOP_KEY]) else None
    except Exception:
        return None


_together = False


def ended_together() -> None:
    """Every rank stopped at the same point (a failure or a signal they agreed on)."""
    global _together
    _together = True


def leave_together() -> None:
    """After rank 0 printed why the run stopped: when every rank stopped at the same point, they leave
    together (a barrier); torchrun stops the other ranks as soon as one exits, which could cut rank 0
    off before it says why (all ranks call it, each after its own last line)."""
    global _together
    if _together and world() > 1:
        _together = False
        try:
            dist.barrier()
        except Exception:   # a peer already gone: nothing left to wait for
            pass


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def shutdown() -> None:
    """End a torchrun process group cleanly: every rank waits for the others, then tears it down
    (a rank that exits while a peer still talks to it can abort the peer)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()
