"""A decoder layer's linear projections behind one small interface, with two implementations.

The static decoder calls, per layer, `qkv(h)`, `o(x)`, `gate_up(h)` and `down(x)`, never a weight:

- `FusedProjections`, the fast path for plain `nn.Linear` layers: one matmul for q/k/v and one for
  gate/up. A decode step for a few rows is hundreds of tiny kernels whose launch latency, not the
  weight reads, sets the step time; one matmul instead of three (and two) removes three kernels per
  layer and gives cuBLAS one wider, better-shaped GEMM. The fused weight is the only copy: the HF
  parameters (`q_proj.weight`, ...) are rebound as row views into it, so `load_weights` fills the
  fused weight in place, HF's own forward still works on the model, and `models.release_weights` /
  `restore_weights` (which resize each parameter's storage to 0 and back) free and re-allocate the
  one shared storage. Re-fusing after every weight sync instead would hold a second copy of ~85% of
  the weights and copy them per sync.
- `ModuleProjections` calls the modules themselves (`layer.self_attn.q_proj(h)`), so any projection
  works: a peft LoRA layer over a bitsandbytes 4-bit `Linear4bit`, a quantized layer, a plain one.

`qkv` returns q, k and v side by side in one tensor (B, L, (H + 2 KVH) D), in that order, in both
implementations (`qkv_parts` the three apart, for a kernel that reads them where they are): the
decoder rotates q and k in one pass over the first (H + KVH) D columns and writes k and v to the
cache with one copy of the last 2 KVH D columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATTN = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


def fusable(layer: nn.Module) -> str:
    """'' when the layer's projections can be fused, else why not."""
    at, mlp = layer.self_attn, layer.mlp
    for owner, names in ((at, ATTN + ("o_proj",)), (mlp, MLP + ("down_proj",))):
        for n in names:
            mod = getattr(owner, n)
            if type(mod) is not nn.Linear:   # peft / bitsandbytes layers subclass or wrap nn.Linear
                return f"{n} is a {type(mod).__module__}.{type(mod).__qualname__}, not a plain torch.nn.Linear"
    for owner, names in ((at, ATTN), (mlp, MLP)):
        mods = [getattr(owner, n) for n in names]
        if len({m.bias is None for m in mods}) > 1:
            return f"only some of {', '.join(names)} have a bias"
        if len({(m.weight.dtype, m.weight.device, m.in_features) for m in mods}) > 1:
            return f"{', '.join(names)} differ in dtype, device or input width"
        for m in mods:
            for p in (m.weight, m.bias):
                if p is not None and p.untyped_storage().nbytes() == 0:
                    return ("the weights are released (storage resized to 0); call models.restore_weights and "
                            "sync them before building the engine")
    return ""


def _adjacent(params: list[nn.Parameter]) -> bool:
    """Whether `params` already are consecutive row blocks of one storage (fused by an earlier engine)."""
    first = params[0]
    at = first.storage_offset()
    for p in params:
        if (not p.is_contiguous() or p.storage_offset() != at or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        at += p.numel()
    return True


def _fuse(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor holding `params` stacked along dim 0; each parameter becomes a view of its rows.
    Copies one group at a time, so the extra memory at the peak is one layer's q/k/v (or gate/up).
    Parameters that already are such views (a second engine on the same model) are reused as they
    are: a new copy would leave the first engine's fused weight stale."""
    rows = sum(p.shape[0] for p in params)
    if _adjacent(params):
        first = params[0]
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride())
    fused = torch.empty((rows, *params[0].shape[1:]), dtype=params[0].dtype, device=params[0].device)
    at = 0
    for p in params:
        n = p.shape[0]
        fused[at:at + n].copy_(p.data)
        p.data = fused[at:at + n]   # same Parameter object (names, optimizer-free copy), new storage
        at += n
    return fused


def _views_of(params: list[nn.Parameter], fused: torch.Tensor) -> bool:
    at = 0
    for p in params:
        if p.untyped_storage().nbytes() == 0 or p.data_ptr() != fused[at:].data_ptr():
            return False
        at += p.shape[0]
    return True


class FusedProjections:
    """q/k/v and gate/up fused (see the module docstring); o and down read the module's own Parameter."""

    kind = "fused"

    @torch.no_grad()
    def __init__(self, layer: nn.Module) -> None:
        why = fusable(layer)
        if why:
            raise ValueError(f"cannot fuse this layer's projections: {why}")
        at, mlp = layer.self_attn, layer.mlp
        self._qkv_p = [getattr(at, n).weight for n in ATTN]
        self._qkv_bp = [getattr(at, n).bias for n in ATTN] if at.q_proj.bias is not None else []
        self._gu_p = [getattr(mlp, n).weight for n in MLP]
        self._gu_bp = [getattr(mlp, n).bias for n in MLP] if mlp.gate_proj.bias is not None else []
        self.inter = mlp.gate_proj.out_features
        # Parameter objects, not tensors: their .data may be refilled or re-allocated in place.
        self.o_w, self.o_b = at.o_proj.weight, at.o_proj.bias
        self.down_w, self.down_b = mlp.down_proj.weight, mlp.down_proj.bias
        self.mm = F.linear   # a decode backend may put its own few-row matmul here (decode_cuda_c: fp32_mm.linear)
        self._refuse()

    def _refuse(self) -> None:
        self.qkv_w = _fuse(self._qkv_p)
        self.qkv_b = _fuse(self._qkv_bp) if self._qkv_bp else None
        self.gu_w = _fuse(self._gu_p)
        self.gu_b = _fuse(self._gu_bp) if self._gu_bp else None

    def intact(self) -> bool:
        """Whether the HF parameters are still views of the fused weights. `model.to(...)` or assigning
        `param.data` gives a parameter new storage of its own; the fused weight would then go stale."""
        return (_views_of(self._qkv_p, self.qkv_w) and _views_of(self._gu_p, self.gu_w)
                and (self.qkv_b is None or _views_of(self._qkv_bp, self.qkv_b))
                and (self.gu_b is None or _views_of(self._gu_bp, self.gu_b)))

    @torch.no_grad()
    def refuse(self) -> None:
        """Fuse again from the parameters' current values (after `intact()` turned False)."""
        self._refuse()

    def sync(self) -> None:
        """Nothing to copy before a rollout: the fused weights are the parameters' own storage."""

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qkv_w, self.qkv_b, self.gu_w, self.gu_b, self.o_w, self.o_b,
                            self.down_w, self.down_b) if t is not None]

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.mm(h, self.qkv_w, self.qkv_b)

    def qkv_parts(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v as column views of the one fused output (no copy)."""
        return self.qkv(h).split([p.shape[0] for p in self._qkv_p], dim=-1)

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gu = self.mm(h, self.gu_w, self.gu_b)
        return gu[..., :self.inter], gu[..., self.inter:]

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x, self.o_w, self.o_b)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x, self.down_w, self.down_b)


class ModuleProjections:
    """Each projection called as its module: works for any nn.Module (peft LoRA, bitsandbytes, plain)."""

    kind = "modules"

    def __init__(self, layer: nn.Module) -> None:
        at, mlp = layer.self_attn, layer.mlp
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = at.q_proj, at.k_proj, at.v_proj, at.o_proj
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._all = (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                     self.down_proj)
        self.groups: dict[str, object] = {}   # "qkv", "gate_up": LoraGroups a decode backend stacked (`stackable`)

    def stackable(self) -> dict[str, list[nn.Module]]:
        """The groups of modules one product could compute (`lora_group.LoraGroup`, which a decode backend sets in
        `groups` under these names)."""
        return {"qkv": [self.q_proj, self.k_proj, self.v_proj], "gate_up": [self.gate_proj, self.up_proj]}

    def intact(self) -> bool:
        return all(g.intact() for g in self.groups.values())

    def refuse(self) -> None:
        for g in self.groups.values():
            if not g.intact():
                g.refuse()

    def sync(self) -> None:
        """The groups' adapters from the layers' current ones (before each rollout: they train)."""
        for g in self.groups.values():
            g.sync()

    def tensors(self) -> list[torch.Tensor]:
        return [t for m in self._all for t in m.parameters()] + [t for g in self.groups.values() for t in g.tensors()]

    def modules(self) -> list[nn.Module]:
        """Every module of the layer's projections, the wrappers' own inside them included."""
        return [s for m in self._all for s in m.modules()]

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.qkv_parts(h), dim=-1)

    def _group(self, key: str, h: torch.Tensor) -> "tuple[torch.Tensor, ...] | None":
        g = self.groups.get(key)
        y = g(h) if g is not None else None
        return None if y is None else y.split(g.widths, dim=-1)

    def qkv_parts(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._group("qkv", h) or (self.q_proj(h), self.k_proj(h), self.v_proj(h))

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._group("gate_up", h) or (self.gate_proj(h), self.up_proj(h))

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(x)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(x)


def make_projections(layers, kind: str) -> tuple[list, str]:
    """kind: 'fused', 'modules' or 'auto' (fused where every layer allows it). Returns the per-layer
    objects and a note saying which and why."""
    if kind not in ("auto", "fused", "modules"):
        raise ValueError(f"projections must be 'auto', 'fused' or 'modules', got {kind!r}")
    if kind == "modules":
        return [ModuleProjections(layer) for layer in layers], "projections called as modules"
    why = next((f"layer {i}: {w}" for i, layer in enumerate(layers) if (w := fusable(layer))), "")
    if why:
        if kind == "fused":
            raise ValueError(f"projections='fused' is not possible: {why}; use projections='modules'")
        return [ModuleProjections(layer) for layer in layers], f"projections called as modules ({why})"
    return [FusedProjections(layer) for layer in layers], "q/k/v and gate/up fused into one matmul each"
