"""AdamW for bf16 parameters with no fp32 master copy, which still takes small steps.

A bf16 weight has 8 significant bits: an update smaller than half the spacing of bf16 values
around the weight (between |w| * 2^-9 and |w| * 2^-8) is rounded away. RL fine-tuning lives
there: lr 1e-6 on weights of about 0.02 moves a weight by about 5e-5 of itself per step, so plain
bf16 AdamW (torch's AdamW on bf16 parameters) leaves most weights where they were. Both variants
here compute the step in fp32 from bf16 storage and keep what rounding would lose:

- Kahan compensation (kahan=True, "adamw-bf16"): a second bf16 tensor per parameter holds the part
  of the new weight that rounding to bf16 dropped; the next step adds it back before rounding
  again. Weight plus compensation carry about 16 significant bits, so no update is lost and the
  result is deterministic. 2 more bytes of state per parameter.
- Stochastic rounding (kahan=False, "adamw-bf16-sr"): the new weight is rounded up or down at
  random with the probabilities that make the expected stored value equal the fp32 one, so small
  updates survive on average (Zamirai et al. 2020, "Revisiting BFloat16 Training"). No extra
  state; each weight carries rounding noise of about one bf16 spacing.

Both keep the moments in bf16 with stochastic rounding. Rounded to nearest, the second moment
sticks: with beta2 = 0.999 its per-step change (v * 1e-3 when the gradient vanishes) is below half
a bf16 spacing, so after one large gradient it never decays and that weight's step stays damped.

The random bits come from a generator seeded by (seed, parameter index, shard, step count, chunk,
and on the host the block of `HOST_BLOCK` elements, drawn in parallel; a GPU draws them otherwise,
so a run moved between the two draws other, equally random bits; the fused kernel keys Philox by
(seed, parameter index, shard, step count) with the element's index as the counter): runs are reproducible, and a
resumed run (the step count is in the state dict) draws the bits of one that never stopped, with no
generator state to save. The shard is the process's place along
the mesh dimensions that shard the parameter, not its rank: copies of one shard on several
processes (a replicated mesh dimension, or plain tensors under data parallelism) draw the same
bits and so stay identical.

FSDP2: parameters, gradients and state are DTensors; the update is elementwise, so it runs on each
local shard, and the state stays DTensor so DCP's full state dict gathers it as for torch's AdamW.
Every state tensor is bf16, the parameter's dtype, which is also what Optimizer.load_state_dict
casts floating-point state to (fp32 moments would come back from a checkpoint as bf16).

On a CUDA device with triton the step is one fused kernel per parameter (edgerl/kernels/_triton_adamw.py:
loads, fp32 arithmetic, Philox random bits and rounded stores in one pass, no temporaries). Elsewhere
it is eager torch, which runs wherever torch does: it walks each local shard in chunks of CHUNK
elements so its fp32 temporaries stay under WORKSPACE_BYTES however large the largest parameter is (a
150k x 1.5k embedding would otherwise need about 1 GiB per fp32 temporary), about 30 kernels a chunk.
The two draw their random bits differently (both keyed as above), so a run moved between them rounds
otherwise, equally at random.

Shards in host memory (FSDP2's parameter offload) are stepped on `step_device` when one is given:
each chunk of weight, gradient and state is copied there, stepped, and copied back (far faster than
stepping on the host's cores: docs/benchmarks.md, bf16 AdamW step).
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Optional

import torch

from edgerl.core.errors import OptimizerError

from edgerl.plan.memory import BF16_STEP_CHUNK as CHUNK
from edgerl.plan.memory import BF16_STEP_WORKSPACE as WORKSPACE_BYTES  # noqa: F401  (the bound the CUDA test checks)

log = logging.getLogger(__name__)

# Peak temporaries of `_update`, in bytes per element of a chunk, counted by hand: the int32 random
# bits (12 with stochastically rounded weights; on the host an 8-byte draw and one 4-byte field) while
# the first moment is rounded, beside the fp32 moments (8) and the rounding's int32 result (4, copied
# into the bf16 state without a bf16 temporary): 24. A streamed chunk adds its copies of weight,
# gradient and state (10): 34; memory.BF16_STEP_WORKSPACE counts 36 per element.


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds the data: a DTensor's local shard, or `t` itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def round_stochastic(x: torch.Tensor, bits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 `x` to bf16, rounded away from zero with probability (dropped part) / (bf16 spacing).

    bits: int32 uniform in [0, 2^16), same shape as x. bf16 is the upper half of an fp32's bits;
    adding uniform bits to the lower half carries into the upper half with exactly that
    probability, then the lower half is cleared. Adding to the bit pattern grows the magnitude
    for either sign, so the rounding is unbiased for negative values too. With `out` (bf16), the
    result is copied into it and returned: the cleared fp32 values convert exactly, so the copy's
    cast stands in for a separate one (one kernel and one bf16 temporary fewer in `_update`)."""
    rounded = (x.view(torch.int32) + bits).bitwise_and_(-65536).view(torch.float32)
    return rounded.bfloat16() if out is None else out.copy_(rounded)


def _shard(p: torch.Tensor) -> tuple[int, ...]:
    """Which shard of `p` this process holds: its coordinates along the mesh dimensions that split
    `p` (FSDP2 shards dim 0 over a 1-D mesh: the rank). () for a plain tensor, a replicated one, or
    one 'sharded' over a single process, which holds all of it and so steps as a plain tensor would."""
    if not hasattr(p, "placements"):
        return ()
    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    return tuple(c for d, (c, placement) in enumerate(zip(coord, p.placements))
                 if placement.is_shard() and mesh.size(d) > 1)


def _seed(*key) -> int:
    """A 63-bit generator seed that depends on every part of `key` (blake2b, not Python's hash)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1


def _chunks(w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """[w, g, *state] as matching pieces of at most CHUNK elements (whole tensors when a layout
    cannot be flattened in place: the update writes through these views)."""
    if not (w.is_contiguous() and all(s.is_contiguous() for s in state)):
        yield [w, g, *state]
        return
    flat = [w.view(-1), g.reshape(-1), *(s.view(-1) for s in state)]  # g is only read: a copy would do
    for start in range(0, w.numel(), CHUNK):
        yield [t[start:start + CHUNK] for t in flat]


# The host's random bits come in blocks of this many elements, each block from a generator seeded by its
# own key, drawn by several threads at once: torch's CPU generator fills a tensor on one thread, and with
# three 32-bit draws per element it was most of a host-side step (an optimizer that FSDP2 offloads runs
# on the host). The block size is fixed, so the bits do not depend on the thread count.
HOST_BLOCK = 1 << 18
_pools: dict[int, ThreadPoolExecutor] = {}


def _host_pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="edgerl-bits")
    return _pools[threads]


class _HostBits:
    """Random bits on the host: one 64-bit draw per element (`random_` fills int64 with 63 uniform bits)
    whose low 48 bits are three 16-bit fields, cut out as int32 when used. One draw where three 32-bit
    draws were made before, and the blocks drawn in parallel (`HOST_BLOCK`). On a GPU the generator is
    cheap and the step is bound by memory traffic, which one int32 tensor per field keeps lower."""

    def __init__(self, shape: torch.Size, key: tuple) -> None:
        self.shape = shape
        draw = torch.empty(math.prod(shape), dtype=torch.int64)
        blocks = [(draw[i:i + HOST_BLOCK], _seed(*key, i // HOST_BLOCK)) for i in range(0, draw.numel(), HOST_BLOCK)]

        def fill(block):
            out, seed = block
            out.random_(generator=torch.Generator().manual_seed(seed))

        threads = min(torch.get_num_threads(), len(blocks))
        if threads > 1:
            list(_host_pool(threads).map(fill, blocks))   # torch releases the GIL inside random_
        else:
            for block in blocks:
                fill(block)
        halves = draw.view(torch.int32)
        first, second = halves[0::2], halves[1::2]
        # bits 0-31 and 32-63 of each draw; bit 63 is always 0, so only the high word's low half is used
        self.low, self.high = (first, second) if sys.byteorder == "little" else (second, first)

    def __getitem__(self, i: int) -> torch.Tensor:
        word = self.high if i == 2 else self.low
        return (word >> 16 if i == 1 else word).bitwise_and(0xFFFF).view(self.shape)


def _update(w, g, m, v, comp: Optional[torch.Tensor], bits, lr: float, beta1: float,
            beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW step in place on bf16 pieces of equal shape, computed in fp32 as torch's AdamW does:
    w <- w * (1 - lr * wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps). bits[i]: int32 in [0, 2^16) of
    w's shape, for the first moment, the second, the weight (AdamWBF16._bits)."""
    g32 = g.float()
    m32 = m.float().lerp_(g32, 1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    del g32
    round_stochastic(m32, bits[0], out=m)
    round_stochastic(v32, bits[1], out=v)
    # the step uses this step's exact moments; only what is stored for the next step is rounded
    denom = v32.sqrt_().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
    w32 = w.float()
    if comp is not None:
        w32.add_(comp.float())  # the weight as it would be without bf16 rounding (to ~16 bits)
    w32.mul_(1 - lr * weight_decay).addcdiv_(m32, denom, value=-lr / (1 - beta1 ** step))
    del m32, denom
    if comp is None:
        round_stochastic(w32, bits[2], out=w)
    else:
        w.copy_(w32)  # round to nearest; the remainder is exact in fp32 and kept to 8 bits
        comp.copy_(w32.sub_(w.float()))


class AdamWBF16(torch.optim.Optimizer):
    """AdamW on bf16 parameters: bf16 moments (stochastically rounded) and either a Kahan
    compensation buffer (kahan=True, 6 bytes of state per parameter) or stochastic rounding of the
    weights (kahan=False, 4 bytes). Steps FSDP2 DTensor parameters on their local shards.

    fused: the step as one Triton kernel per parameter (edgerl/kernels/_triton_adamw.py) instead of eager
    chunks. None: fused for tensors on a CUDA device where triton imports, eager elsewhere; True: fused
    or an error saying why not (on the CPU only under TRITON_INTERPRET=1); False: eager.
    step_device: where shards held in host memory (FSDP2's parameter offload) are stepped. They are
    streamed through it in chunks of CHUNK elements (copied in, stepped, copied back) instead of
    being stepped by the host's cores; None steps them where they lie."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 *, kahan: bool = True, seed: int = 0, fused: Optional[bool] = None,
                 step_device: Optional[torch.device | str] = None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.kahan, self.seed, self.fused = kahan, seed, fused
        self.step_device = torch.device(step_device) if step_device is not None else None
        wrong = {str(p.dtype) for g in self.param_groups for p in g["params"] if p.dtype != torch.bfloat16}
        if wrong:
            raise OptimizerError(f"bf16 AdamW steps bf16 parameters in place, but some are {', '.join(sorted(wrong))}; "
                                 "load the model in bf16 (no fp32 master copy), or use plan.optimizer=adamw")
        self._generators: dict[torch.device, torch.Generator] = {}
        self._fused_on: dict[torch.device, bool] = {}
        self._unpinnable = False   # set once pinning the streamed state has failed (said in the log)

    def uses_fused(self, device: torch.device) -> bool:
        """Whether tensors on `device` are stepped by the fused kernel (raises if fused=True cannot be)."""
        if device not in self._fused_on:
            if self.fused is False or (self.fused is None and device.type != "cuda"):
                self._fused_on[device] = False   # the default off CUDA: eager, without importing triton
            else:
                from edgerl.kernels.adamw import unavailable_reason
                why = unavailable_reason(device)
                if self.fused and why is not None:
                    raise OptimizerError(f"the fused bf16 AdamW step cannot run on {device}: {why}")
                self._fused_on[device] = why is None
        return self._fused_on[device]

    def _bits(self, device: torch.device, shape: torch.Size, key: tuple):
        """bits[i]: int32 in [0, 2^16) of `shape` for the first moment, the second and the weight."""
        if device.type == "cpu":
            return _HostBits(shape, (self.seed, *key))
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(_seed(self.seed, *key))
        k = 2 if self.kahan else 3  # moments, and the weight unless it is compensated
        return torch.randint(0, 1 << 16, (k, *shape), generator=gen, device=device, dtype=torch.int32)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0)  # a CPU scalar, as torch's (non-fused) AdamW keeps it
        # zeros_like of a DTensor is a DTensor with the parameter's placements: DCP gathers it
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.kahan:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _step_tensors(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], key: tuple,
                      hp: dict, offset: int = 0, chunk: int = 0) -> None:
        """Step w (with gradient g and state [m, v, comp?]) where they lie. `offset` and `chunk` place a
        streamed piece in its shard, so that it draws the bits the whole shard would."""
        comp = state[2] if self.kahan else None
        contiguous = all(t.is_contiguous() for t in (w, *state))
        if contiguous and self.uses_fused(w.device):
            from edgerl.kernels.adamw import adamw_bf16_step
            adamw_bf16_step(w, g.contiguous(), state[0], state[1], comp, seed=_seed(self.seed, *key),
                            offset=offset, **hp)
            return
        for c, (wc, gc, *st) in enumerate(_chunks(w, g, state), start=chunk):
            bits = self._bits(w.device, wc.shape, (*key, c))
            _update(wc, gc, st[0], st[1], st[2] if self.kahan else None, bits, hp["lr"], hp["beta1"],
                    hp["beta2"], hp["eps"], hp["weight_decay"], hp["step"])

    def _stream(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], key: tuple, hp: dict) -> None:
        """Step host-held tensors on self.step_device, one chunk of CHUNK elements at a time: the
        device holds about 5 x 2 bytes per element of a chunk (plus the eager step's temporaries)."""
        dev = self.step_device
        whole = not (w.is_contiguous() and all(s.is_contiguous() for s in state))
        for c, pieces in enumerate(_chunks(w, g, state)):
            on_dev = [torch.empty(t.shape, dtype=t.dtype, device=dev).copy_(t, non_blocking=True) for t in pieces]
            self._step_tensors(on_dev[0], on_dev[1], on_dev[2:], key, hp, offset=0 if whole else c * CHUNK, chunk=c)
            for host, done in zip(pieces[:1] + pieces[2:], on_dev[:1] + on_dev[2:]):  # the gradient is only read
                host.copy_(done, non_blocking=True)

    def _pinned(self, state: dict, names: list[str], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The host state of a streamed parameter in pinned memory, so that its copies to and from the
        GPU run at the bus's speed: state created here, or loaded from a checkpoint, is pageable, and is
        replaced once by a pinned copy (a DTensor keeps its placements)."""
        if self.step_device.type != "cuda" or self._unpinnable or all(t.is_pinned() for t in tensors):
            return tensors
        out = []
        for n, t in zip(names, tensors):
            if not t.is_pinned():
                try:
                    t = t.pin_memory()
                except RuntimeError as e:  # the host would not lock more memory: same result, slower copies
                    log.warning("could not pin the bf16 AdamW state in host memory (%s); its copies to the GPU "
                                "stay pageable (slower)", e)
                    self._unpinnable = True
                    return out + tensors[len(out):]   # those already replaced are the state's now
                old = state[n]
                # DTensor's constructor, as FSDP2 wraps its offloaded shards: from_local would move the
                # local tensor to the mesh's device type (CUDA)
                state[n] = type(old)(t, old._spec, requires_grad=False) if hasattr(old, "_local_tensor") else t
            out.append(t)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # the parameter's position in the groups: the same after a rebuild from a checkpoint
        streamed = False
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hp = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"])
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                names = ["exp_avg", "exp_avg_sq"] + (["compensation"] if self.kahan else [])
                tensors = [local_tensor(state[n]) for n in names]
                w, g = local_tensor(p), local_tensor(p.grad)
                key = (index, _shard(p), int(state["step"]))
                args = dict(hp, step=key[-1])
                if self.step_device is not None and w.device.type == "cpu":
                    tensors = self._pinned(state, names, tensors)
                    self._stream(w, g, tensors, key, args)
                    streamed = True
                else:
                    self._step_tensors(w, g, tensors, key, args)
        if streamed and self.step_device.type == "cuda":
            torch.cuda.current_stream(self.step_device).synchronize()  # the copies back into host memory
        return loss
