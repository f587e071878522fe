"""Optimizers as the plan says: fp32 AdamW, 8-bit AdamW or bf16 AdamW, and optimizer state that
waits in host memory.

8-bit AdamW (bitsandbytes) keeps both moments as uint8 with one fp32 scale per 256 values: about
2 bytes of state per parameter instead of 8. It runs from CC 6.0, Pascal included (docs/hardware.md,
bitsandbytes). bitsandbytes' kernels take plain tensors, not FSDP2's DTensors, so the step runs on
each parameter's local shard; its state is then per shard, which is why edgerl allows it in one
process only (a checkpoint would have to re-quantize the shards of N processes).

bf16 AdamW (edgerl/adamw_bf16.py) trains bf16 parameters with no fp32 master copy, keeping small
updates through Kahan compensation ("adamw-bf16") or stochastic rounding ("adamw-bf16-sr"). Its
state is DTensor like torch's, so it checkpoints on any number of processes. It needs native bf16
(CC >= 8.0) to be worth choosing; the code itself runs on any device torch runs on.

Optimizer offload (plan.optimizer_offload without param_offload): the state is copied to (pinned)
host memory after every step and its device storage freed, then brought back just before the next
step, when the backward has already freed the activations. The tensors keep their identity (only
their storage is resized), so the optimizer, DCP's state dict and FSDP2 never notice.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch
from edgerl.train.adamw_bf16 import AdamWBF16, local_tensor as _local
from edgerl.core.errors import OptimizerError
from edgerl.plan.memory import OPTIMIZERS, TrainingBytes  # noqa: F401  (the bytes table lives with the memory model)


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise OptimizerError(f"plan.optimizer=adamw8bit needs bitsandbytes ({e}); pip install bitsandbytes, "
                             "or --set plan.optimizer=adamw") from None
    return bnb


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float, betas: tuple[float, float],
                   weight_decay: float, world_size: int = 1, seed: int = 0, fused: Optional[bool] = None,
                   step_device: Optional[torch.device] = None) -> torch.optim.Optimizer:
    """An optimizer of OPTIMIZERS for the trainable ones of `params`; `seed` feeds the stochastic
    rounding of the bf16 variants (bits depend on seed, parameter, shard and step, so resuming draws
    the same bits). `fused` and `step_device` go to the bf16 variants (AdamWBF16: the fused Triton
    step, and the device that steps shards held in host memory).

    | name          | optimizer                                      | params | bytes/param (w + g + state) |
    |---------------|------------------------------------------------|--------|-----------------------------|
    | adamw         | torch AdamW, fused, fp32 moments               | fp32   | 4 + 4 + 8 = 16              |
    | adamw8bit     | bitsandbytes AdamW8bit on local shards         | fp32   | 4 + 4 + 2 = 10 (1 process)  |
    | adamw-bf16    | AdamWBF16, Kahan compensation, bf16 moments    | bf16   | 2 + 2 + 6 = 10              |
    | adamw-bf16-sr | AdamWBF16, stochastic rounding, bf16 moments   | bf16   | 2 + 2 + 4 = 8               |
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise OptimizerError("no trainable parameters: every weight is frozen")
    if name == "adamw":
        # fused: one kernel per step and no temporaries the size of the parameters (foreach AdamW
        # allocates whole-model lists of intermediates, which the memory model cannot afford)
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
    if name in ("adamw-bf16", "adamw-bf16-sr"):
        return AdamWBF16(params, lr=lr, betas=betas, weight_decay=weight_decay, kahan=name == "adamw-bf16",
                         seed=seed, fused=fused, step_device=step_device)
    if name != "adamw8bit":
        raise OptimizerError(f"plan.optimizer={name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if world_size > 1:
        raise OptimizerError("8-bit AdamW keeps quantized state per shard, which edgerl cannot checkpoint "
                             f"across {world_size} processes; use --set plan.optimizer=adamw on several GPUs")
    return _local_adamw8bit_class()(params, lr=lr, betas=betas, weight_decay=weight_decay)


_CLASS = None


def _local_adamw8bit_class():
    """bitsandbytes' AdamW8bit whose step runs on local shards; state stays keyed by the parameters
    themselves, so DCP's get/set_optimizer_state_dict map it to parameter names as usual."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    bnb = _bnb()

    class LocalAdamW8bit(bnb.optim.AdamW8bit):
        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self.initialized:
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    local = _local(p)
                    if local is p:
                        lp = p
                    else:  # a plain alias of the shard: bitsandbytes reads .data and .grad
                        lp = torch.Tensor._make_subclass(torch.nn.Parameter, local, False)
                        lp.grad = _local(p.grad)
                    state = self.state[p]
                    self.state[lp] = state  # the same dict under the alias, for bitsandbytes' lookups
                    try:
                        if len(state) == 0:
                            self.init_state(group, lp, gindex, pindex)
                        self.prefetch_state(lp)
                        self.update_step(group, lp, gindex, pindex)
                    finally:
                        if lp is not p:
                            del self.state[lp]
                            lp.grad = None
            return loss

    _CLASS = LocalAdamW8bit
    return _CLASS


class StateOffload:
    """Keeps an optimizer's state tensors in host memory except inside `resident()`.

    Disabled, every method is a no-op. On the CPU (tests) the 'host' copy is a second CPU tensor,
    which exercises the same path."""

    def __init__(self, optim: torch.optim.Optimizer, enabled: bool, pin: bool) -> None:
        self.optim, self.enabled, self.pin = optim, enabled, pin
        self._host: dict[tuple[int, str], torch.Tensor] = {}
        self._nbytes: dict[tuple[int, str], int] = {}
        self.offloaded = False

    def _tensors(self) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
        for p, st in self.optim.state.items():
            for k, v in st.items():
                # scalars (AdamW's step counter lives on the CPU) are not worth moving
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    yield (id(p), k), _local(v)

    def to_host(self) -> None:
        if not self.enabled or self.offloaded:
            return
        moved = []
        for key, t in self._tensors():
            h = self._host.get(key)
            if h is None or h.shape != t.shape or h.dtype != t.dtype:
                h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
                self._host[key] = h
            h.copy_(t, non_blocking=self.pin)
            moved.append((key, t))
        if self.pin:
            torch.cuda.current_stream().synchronize()  # the copies must land before the storage goes
        for key, t in moved:
            self._nbytes[key] = t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
        self.offloaded = True

    def to_device(self) -> None:
        if not self.enabled or not self.offloaded:
            return
        for key, t in self._tensors():
            if t.untyped_storage().nbytes() or key not in self._nbytes:
                continue  # not offloaded (created while resident)
            t.untyped_storage().resize_(self._nbytes[key])
            t.copy_(self._host[key], non_blocking=self.pin)
        self.offloaded = False

    @contextlib.contextmanager
    def resident(self):
        """The state on the device for a step or a checkpoint, back in host memory after."""
        self.to_device()
        try:
            yield
        finally:
            self.to_host()

    def state_dict(self, get):
        """`get()` (an optimizer state dict) with the state resident; tensors that would alias the live
        state (on the CPU, DCP's cpu_offload does not copy) are cloned before the storage is freed."""
        with self.resident():
            sd = get()
            if self.enabled:
                live = {t.untyped_storage().data_ptr() for _, t in self._tensors()}
                sd = torch.utils._pytree.tree_map_only(
                    torch.Tensor, lambda t: t.clone() if t.untyped_storage().data_ptr() in live else t, sd)
        return sd

    def device_bytes(self) -> int:
        """Bytes of optimizer state currently held by the device storage (0 while offloaded)."""
        return sum(t.untyped_storage().nbytes() for _, t in self._tensors())
