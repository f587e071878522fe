"""Full (gathered) state dicts into a model and its optimizer, without a collective on one process.

A checkpoint holds full tensors, whatever the world size it was written on. torch's `set_model_state_dict` and
`set_optimizer_state_dict` with `full_state_dict=True` hand each tensor to `distribute_tensor`, which scatters it
over the process group even where the group has one process: that creates the group's NCCL communicator, whose
buffers take about half a GiB of device memory outside torch's allocator for the rest of the run
(`models.load.init_distributed` creates it lazily so that a one-process run never does). On one process every
shard is the whole tensor, so these functions copy each full tensor into the model's (or optimizer's) own local
tensor, then load that state as it is (`full_state_dict=False`): the same values, no collective. On more
processes they call torch's full-state loading as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _one_process() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def _into(full: Any, local: Any, where: str) -> Any:
    """`full` with each tensor of more than 0 dimensions copied into `local`'s tensor at the same place (a DTensor's
    local tensor: the whole tensor on one process) and that tensor put in its place. A key `local` lacks keeps the
    full value (the loading below then reports it, or adds it as torch's full-state loading does); scalar tensors
    go to the host as torch's do."""
    if isinstance(full, dict):
        return {k: _into(v, local.get(k) if isinstance(local, dict) else None, f"{where}.{k}")
                for k, v in full.items()}
    if isinstance(full, (list, tuple)):
        same = isinstance(local, (list, tuple)) and len(local) == len(full)
        return type(full)(_into(v, local[i] if same else None, f"{where}[{i}]") for i, v in enumerate(full))
    if not torch.is_tensor(full):
        return full
    if full.dim() == 0:
        return full.cpu()
    if not torch.is_tensor(local):
        return full
    from torch.distributed.tensor import DTensor
    mine = local.to_local() if isinstance(local, DTensor) else local
    if mine.shape != full.shape:
        raise ValueError(f"{where} is {tuple(full.shape)} in the checkpoint and {tuple(mine.shape)} here")
    with torch.no_grad():
        mine.copy_(full)
    return local


def set_full_model_state(module: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """`set_model_state_dict(module, state, full_state_dict=True)` without a collective on one process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    if not _one_process():
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))
        return
    local = _into(state, get_model_state_dict(module), "model")
    set_model_state_dict(module, local, options=StateDictOptions(strict=strict))


def set_full_optimizer_state(module: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`set_optimizer_state_dict(module, optim, state, full_state_dict=True)` without a collective on one
    process (the optimizer's state is created first, by a step of zero gradients at lr 0, as torch does)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    if not _one_process():
        set_optimizer_state_dict(module, optim, state, options=StateDictOptions(full_state_dict=True))
        return
    local = _into(state, get_optimizer_state_dict(module, optim), "optimizer")
    set_optimizer_state_dict(module, optim, local, options=StateDictOptions())
