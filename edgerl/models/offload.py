"""Checkpointed decoder layers whose inputs wait in pinned host memory between the forward and the backward.

With per-layer checkpointing, what the update keeps on the GPU through the forward is every layer's
input: tokens x layers x hidden x compute bytes, the largest saved tensor at long responses (4 rows of
8K tokens at the Qwen2.5-1.5B widths in fp32: 5.7 GB). Here each layer's input is copied to pinned
host memory on a side stream as soon as the layer's forward has run (the copy overlaps the next
layers' compute; the caching allocator keeps the GPU memory until the copy is done), and comes back
in the backward when the recomputation needs it, the next layer's (going backwards) prefetched on the
side stream meanwhile. The GPU holds about two layers' inputs instead of all of them.

`enable(layers, device)` replaces the checkpoint function transformers calls for each decoder layer
(`layer._gradient_checkpointing_func(forward, hidden_states, ...)`) after `enable_checkpointing`. The
layer is checkpointed as before (torch.utils.checkpoint, non-reentrant); only its input is held by a
`_Held` that the recomputation reads. On the CPU (tests) the "host" copy is a clone: the same code path
without streams.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint


class _Held:
    """One layer input: on the device until its copy to the host is queued, then on the host."""

    __slots__ = ("gpu", "host", "done", "prefetched", "ready", "grad")

    def __init__(self, x: torch.Tensor) -> None:
        self.gpu: Optional[torch.Tensor] = x
        # the recomputation must save what the forward saved, and autograd saves only for inputs that need grad
        self.grad = x.requires_grad
        self.host: Optional[torch.Tensor] = None
        self.done: Any = None           # event: the copy to the host has finished
        self.prefetched: Optional[torch.Tensor] = None
        self.ready: Any = None          # event: the prefetch has finished


class ActivationOffload:
    """The checkpoint function for every decoder layer of one model (see the module docstring)."""

    def __init__(self, device: torch.device, layers: int) -> None:
        self.device = device
        self.layers = layers
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.held: list[_Held] = []     # this forward's layer inputs, in forward order
        self.bytes_moved = 0            # to the host and back, for the log and the benchmark

    def __call__(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if len(self.held) >= self.layers:   # a forward whose backward never ran (a skipped micro-batch)
            self.held.clear()
        x = args[0]
        h = _Held(x)
        self.held.append(h)
        # a zero-size tensor on x's device tells checkpoint where the layer runs (its RNG and autocast state)
        # without keeping x itself alive in the recomputation's closure
        out = checkpoint(self._run, fn, h, x.new_empty(0), *args[1:], use_reentrant=False, **kwargs)
        self._to_host(h)
        return out

    def _run(self, fn: Callable, h: _Held, _where: torch.Tensor, *rest: Any) -> Any:
        return fn(self._get(h), *rest)

    def _to_host(self, h: _Held) -> None:
        x = h.gpu
        if not self.cuda:
            h.host, h.gpu = x.detach().clone(), None
            return
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # x is written
        with torch.cuda.stream(self.stream):
            host.copy_(x.detach(), non_blocking=True)
            h.done = torch.cuda.Event()
            h.done.record(self.stream)
        x.record_stream(self.stream)   # its memory is reused only once the copy has read it
        h.host, h.gpu = host, None
        self.bytes_moved += x.numel() * x.element_size()

    def _fetch(self, h: _Held, stream: Any) -> torch.Tensor:
        stream.wait_event(h.done)
        with torch.cuda.stream(stream):
            x = h.host.to(self.device, non_blocking=True)
        self.bytes_moved += x.numel() * x.element_size()
        return x

    def _get(self, h: _Held) -> torch.Tensor:
        """The layer input for the forward (on the device) or the recomputation (back from the host)."""
        if h.gpu is not None:
            return h.gpu
        if not self.cuda:
            x = h.host
        elif h.prefetched is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(h.ready)
            x, h.prefetched = h.prefetched, None
            x.record_stream(current)
        else:
            x = self._fetch(h, torch.cuda.current_stream(self.device))
        i = next((k for k, other in enumerate(self.held) if other is h), None)
        if i is not None:
            del self.held[i:]   # this layer and those after it are done with (the backward runs in reverse)
            if self.cuda and i > 0 and self.held[i - 1].prefetched is None:   # the next layer to recompute
                nxt = self.held[i - 1]
                nxt.prefetched = self._fetch(nxt, self.stream)
                nxt.ready = torch.cuda.Event()
                nxt.ready.record(self.stream)
        h.host = None
        return x.requires_grad_(h.grad)


def enable(layers: torch.nn.ModuleList, device: torch.device) -> ActivationOffload:
    """Route every decoder layer in `layers` (checkpointing already enabled on them) through one
    ActivationOffload; returns it."""
    off = ActivationOffload(device, len(layers))
    for layer in layers:
        if not (getattr(layer, "gradient_checkpointing", False) and hasattr(layer, "_gradient_checkpointing_func")):
            raise RuntimeError(f"{type(layer).__name__} is not checkpointed; enable checkpointing before offloading "
                               "its inputs")
        layer._gradient_checkpointing_func = off
    return off
