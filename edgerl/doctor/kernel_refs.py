"""Each edgerl kernel against its torch reference, on fresh random inputs at given widths and dtype.

One function per kernel, all with the signature `check(w: Widths, device) -> list[Part]`: a Part is one
output compared (its name, the error, the tolerance it must stay within). The references are the plain
torch the kernels' docstrings name (`edgerl.kernels.*.reference*`, `naive_logprobs_and_entropy`, the
AdamW formula), in float64 where the kernel computes in fp32, and the tolerances those kernels' own
tests hold them to. `kernel_checks.py` decides which run, and turns the parts into verdicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

F64 = torch.float64


@dataclass(frozen=True)
class Widths:
    """The shapes and dtype a check runs at: the model's widths where they matter to the kernel."""
    dtype: torch.dtype
    hidden: int
    vocab: int              # the vocabulary checked (a slice of the model's: the kernels loop over it)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool
    rows: int               # rows of a decode step
    cache: int              # KV cache columns
    tokens: int             # log-prob tokens
    chunk: int              # log-prob tokens per chunk (several slabs, so the chunked loops run)
    lora_rank: int
    params: int             # elements of the AdamW check
    backend: str = "torch"  # the log-prob path
    tiles: Any = None       # its Triton tiles (kernels.Tiles) or None
    full: bool = True       # every projection's shape (self-test), or one of each kind (start of training)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def describe(self, key: str) -> str:
        dt = str(self.dtype)[6:]
        if key == "logprobs":
            return f"{dt}, {self.tokens} tokens x hidden {self.hidden} x vocabulary {self.vocab}, {self.backend}"
        if key == "adamw-bf16":
            return f"bfloat16, {self.params} elements"
        return (f"{dt}, {self.rows} rows, hidden {self.hidden}, MLP {self.intermediate}, {self.heads} heads over "
                f"{self.kv_heads} of size {self.head_dim}" + (f", {self.cache} cache columns" if "decode" in key
                                                               else ""))


@dataclass(frozen=True)
class Part:
    what: str
    err: float
    tol: float


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, g, device, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


def _maxerr(got: torch.Tensor, ref: torch.Tensor) -> float:
    d = (got.detach().double() - ref.detach().double()).abs()
    return float(d.max()) if d.numel() else 0.0


def _close(what: str, got, ref, rtol: float, atol: float) -> Part:
    """max |got - ref| against atol + rtol * max |ref| (NaN in got fails: its error is NaN)."""
    return Part(what, _maxerr(got, ref), atol + rtol * float(ref.double().abs().max()))


def _rel(what: str, got, ref, tol: float) -> Part:
    """||got - ref|| / ||ref||."""
    ref = ref.detach().double()
    return Part(what, float((got.detach().double() - ref).norm() / ref.norm().clamp(min=1e-300)), tol)


# ---- log-probs and entropy ----------------------------------------------------------------------------

LOGPROB_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}   # tests/test_kernels_on_cpu.py


def logprobs(w: Widths, device: torch.device) -> list[Part]:
    """`token_logprobs_and_entropy` on the plan's path (backend, tiles, chunks) against the full-logits
    float64 reference: log-probs, entropies, and the gradients of both with respect to hidden and weight."""
    from edgerl.kernels import naive_logprobs_and_entropy, token_logprobs_and_entropy
    g = _gen(device, 1)
    n, hid, v = w.tokens, w.hidden, w.vocab
    h = _randn((n, hid), g, device, w.dtype)
    lm = _randn((v, hid), g, device, w.dtype, 2.0 / hid ** 0.5)   # logits of a few units: peaked and flat rows
    tg = torch.randint(0, v, (n,), generator=g, device=device)
    dl, de = _randn((n,), g, device, F64), _randn((n,), g, device, F64)

    def run(fn, a, b):
        a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        lp, ent = fn(a, b)
        ((lp * dl.to(lp.dtype)).sum() + (ent * de.to(ent.dtype)).sum()).backward()
        return lp, ent, a.grad, b.grad

    got = run(lambda a, b: token_logprobs_and_entropy(a, b, tg, 0.7, backend=w.backend, chunk=w.chunk,
                                                      tiles=w.tiles), h, lm)
    ref = run(lambda a, b: naive_logprobs_and_entropy(a, b, tg, 0.7, dtype=F64), h.double(), lm.double())
    tol = LOGPROB_TOL[w.dtype]
    return [_rel(name, a, b, tol) for name, a, b in zip(("log-probs", "entropy", "grad hidden", "grad weight"),
                                                         got, ref)]


# ---- the decode-layer kernels (CUDA C) -----------------------------------------------------------------

# relative to the largest reference value: fp32 as tests/test_decode_cuda_kernels_cuda.py holds it; fp16 rounds
# each output (and, as the eager ops do, an intermediate or two) to fp16, 2^-11 relative each
DECODE_CUDA_TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (2e-3, 2e-3)}   # (norm and SiLU, attention)


def decode_cuda(w: Widths, device: torch.device) -> list[Part]:
    """`edgerl/kernels/decode_cuda.py`'s three kernels in the plan's dtype (fp32 or fp16) against their float64
    references (tolerances of tests/test_decode_cuda_kernels_cuda.py), the attention as the engine splits it
    (`decode_cuda.slices`) and also in fixed slices of 32 columns, merged, and in fp32 over an fp16 cache too; the
    cache column rope_attend writes must equal the reference's bit for bit (the engine's eager rotation rounds the
    same way, and torch's cast to fp16 as the kernel does)."""
    from edgerl.kernels import decode_cuda as k
    dt = w.dtype
    if dt not in DECODE_CUDA_TOL:
        raise ValueError(f"the decode-layer kernels store fp32 or fp16, not {dt}")
    elt, att = DECODE_CUDA_TOL[dt]
    g = _gen(device, 2)
    B, H, D, KVH, G = w.rows, w.hidden, w.head_dim, w.kv_heads, w.group
    x, d = _randn((B, H), g, device, dt, scale=3.0), _randn((B, H), g, device, dt)
    ln = _randn((H,), g, device, dt)
    xo, y = k.add_rms_norm(x, d, ln, 1e-5)
    rxo, ry = k.reference_add_rms_norm(x, d, ln, 1e-5)
    parts = [Part("add_rms_norm residual", _maxerr(xo, x + d), 0.0), _close("add_rms_norm", y, ry, elt, elt)]
    both = _randn((B, 2 * w.intermediate), g, device, dt, scale=4.0)
    gate, up = both[:, :w.intermediate], both[:, w.intermediate:]   # views into one output, as the engine passes
    parts.append(_close("silu_mul", k.silu_mul(gate, up), k.reference_silu_mul(gate, up), elt, 1e-6))
    S, col = w.cache, w.cache - 3
    qkv = _randn((B, (KVH * G + 2 * KVH) * D), g, device, dt)
    q, kk, v = qkv.split([KVH * G * D, KVH * D, KVH * D], dim=-1)
    cos, sin = _rotary(B, D, g, device, dt)
    kc, vc = _randn((B, KVH, S, D), g, device, dt), _randn((B, KVH, S, D), g, device, dt)
    start, colt = _starts(B, col, g, device)
    rk, rv = kc.clone(), vc.clone()
    want, _ = k.reference_rope_attend(q, kk, v, cos, sin, rk, rv, start, colt, D ** -0.5)
    o = k.rope_attend(q, kk, v, cos, sin, kc, vc, start, colt, D ** -0.5)
    parts += [Part("rope_attend cache", max(_maxerr(kc, rk), _maxerr(vc, rv)), 0.0),
              _close("rope_attend", o, want, att, 1e-5)]
    split = k.rope_attend(q, kk, v, cos, sin, kc, vc, start, colt, D ** -0.5, split_columns=32)
    parts.append(_close("rope_attend split in 32-column slices", split, want, att, 1e-5))
    if dt == torch.float32:   # over an fp16 cache (plan.kv_cache_dtype under fp32): the reference reads the same
        kh, vh = kc.half(), vc.half()
        rkh, rvh = kh.clone(), vh.clone()
        want16, _ = k.reference_rope_attend(q, kk, v, cos, sin, rkh, rvh, start, colt, D ** -0.5)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        o16 = k.rope_attend(q, kk, v, cos, sin, kh, vh, start, colt, D ** -0.5, split_columns=32, flag=flag)
        parts += [Part("rope_attend fp16 cache column", max(_maxerr(kh, rkh), _maxerr(vh, rvh)), 0.0),
                  _close("rope_attend over an fp16 cache, split", o16, want16, att, 1e-5),
                  Part("rope_attend fp16 cache overflow flag (none expected)", float(flag.item()), 0.0)]
        parts += _fp32_mm(w, device, g)
    return parts


def _fp32_mm(w: Widths, device: torch.device, g) -> list[Part]:
    """`fp32_mm.fp32_matmul` (the fp32 decode step's projections and logits) against float64 at the step's rows:
    q/k/v and down (the shortest and the longest K), the logits over the vocabulary slice, and q/k/v with a LoRA
    adapter of the plan's rank."""
    from edgerl.kernels import fp32_mm
    rows = min(w.rows, fp32_mm.MAX_ROWS)
    kv_w = (w.heads + 2 * w.kv_heads) * w.head_dim
    shapes = [(kv_w, w.hidden), (w.hidden, w.intermediate), (w.vocab, w.hidden)] if w.full else [(kv_w, w.hidden)]
    parts = []
    for n, k in shapes:
        if k % 4:
            continue   # the decode step sends it to cuBLAS (fp32_mm.takes)
        x = _randn((rows, k), g, device)
        wt = _randn((n, k), g, device, scale=k ** -0.5)
        want = fp32_mm.reference(x, wt)
        parts.append(Part(f"fp32_matmul {n}x{k}, {rows} rows", _maxerr(fp32_mm.fp32_matmul(x, wt), want),
                          FP32_MM_TOL * k ** 0.5 * float(want.abs().max())))
    n, k = shapes[0]
    if k % 4 == 0 and 0 < w.lora_rank <= fp32_mm.MAX_RANK:   # a LoRA layer over an fp32 base: the adapter in it
        x = _randn((rows, k), g, device)
        wt = _randn((n, k), g, device, scale=k ** -0.5)
        lora = (_randn((w.lora_rank, k), g, device, scale=k ** -0.5), _randn((n, w.lora_rank), g, device), 2.0)
        want = fp32_mm.reference(x, wt, None, lora)
        parts.append(Part(f"fp32_matmul {n}x{k} with a rank-{w.lora_rank} LoRA adapter, {rows} rows",
                          _maxerr(fp32_mm.fp32_matmul(x, wt, lora=lora), want),
                          FP32_MM_TOL * k ** 0.5 * float(want.abs().max())))
    return parts


FP32_MM_TOL = 2e-6   # of the largest |value| times sqrt(K) (tests/test_fp32_mm_cuda.py)


def _rotary(B: int, D: int, g, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, D) as the engine keeps them (sin with rotate_half's sign folded in)."""
    ang = torch.rand((B, D // 2), generator=g, device=device, dtype=F64) * 6
    return (torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((-ang.sin(), ang.sin()), -1).to(dtype))


def _starts(B: int, col: int, g, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first cache column (one row from column 0, one that sees only the new column) and col."""
    start = torch.randint(0, col + 1, (B,), generator=g, device=device)
    start[0] = 0
    start[-1] = col
    return start, torch.tensor([col], device=device)


# ---- the NF4 decode matmul (CUDA C) ---------------------------------------------------------------------

NF4_TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # tests/test_nf4_kernel_cuda.py
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)   # the NF4 levels (QLoRA, Dettmers et al. 2023), as bitsandbytes stores them


def nf4_weight(n: int, k: int, device: torch.device, seed: int = 3):
    """(packed codes, quant state) of a random NF4 weight (n, k) with double-quantized block scales: from
    bitsandbytes' own quantizer where it is installed, else built here in its layout (random codes)."""
    g = _gen(device, seed)
    try:
        import bitsandbytes as bnb
        return bnb.functional.quantize_4bit(_randn((n, k), g, device), blocksize=64, compress_statistics=True,
                                            quant_type="nf4")
    except ImportError:
        pass
    from types import SimpleNamespace
    blocks = n * k // 64
    packed = torch.randint(0, 256, (n * k // 2, 1), generator=g, device=device, dtype=torch.int32).to(torch.uint8)
    code2 = torch.sort(torch.rand(256, generator=g, device=device) * 2 - 1).values
    state2 = SimpleNamespace(absmax=torch.rand(-(-blocks // 256), generator=g, device=device) + 0.5, code=code2,
                             blocksize=256)
    qabs = torch.randint(0, 256, (blocks,), generator=g, device=device, dtype=torch.int32).to(torch.uint8)
    return packed, SimpleNamespace(quant_type="nf4", shape=(n, k), blocksize=64, nested=True, absmax=qabs,
                                   offset=torch.tensor(1.5, device=device), state2=state2,
                                   code=torch.tensor(NF4_CODE, device=device))


def nf4(w: Widths, device: torch.device) -> list[Part]:
    """`nf4_matmul` against `nf4.reference` at the decode step's rows: the gate/up and down projections'
    shapes (one small weight at the start of training), without and with a LoRA adapter summed in."""
    from edgerl.kernels.nf4 import nf4_matmul, reference
    k_h, k_i = w.hidden - w.hidden % 64, w.intermediate - w.intermediate % 64   # the kernel takes K % 64 == 0
    shapes = [(w.intermediate, k_h), (w.hidden, k_i)] if w.full else [(256, k_h)]
    g, parts = _gen(device, 4), []
    for n, k in shapes:
        packed, state = nf4_weight(n, k, device)
        x = _randn((w.rows, k), g, device, w.dtype)
        bias = _randn((n,), g, device, w.dtype)
        want = reference(x, packed, state, bias)
        grow = k ** 0.5 if w.dtype == torch.float32 else 1.0   # fp32: sums of k terms in another order
        tol = NF4_TOL[w.dtype] * grow * float(want.float().abs().max())
        parts.append(Part(f"nf4_matmul {n}x{k}", _maxerr(nf4_matmul(x, packed, state, bias), want), tol))
        r = max(1, w.lora_rank)
        lora = (_randn((r, k), g, device, scale=k ** -0.5), _randn((n, r), g, device), 0.5)
        want = reference(x, packed, state, bias, lora)
        tol = NF4_TOL[w.dtype] * grow * float(want.float().abs().max())
        parts.append(Part(f"nf4_matmul + LoRA r={r} {n}x{k}", _maxerr(nf4_matmul(x, packed, state, bias, lora),
                                                                        want), tol))
    return parts


# ---- decode attention (Triton) ------------------------------------------------------------------------

ATTENTION_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}   # tests/rollout_helpers.py


def attention_reference(q, k, v, start, col, scale: float) -> torch.Tensor:
    """Query head g of KV head h attends to columns start[b]..col of that head, in float64.
    q (B, KVH, G, D); k, v (B, KVH, S, D). Returns (B, KVH, G, D) float64."""
    S = k.shape[2]
    cols = torch.arange(S, device=q.device)
    seen = (cols[None, :] >= start[:, None]) & (cols[None, :] <= col)                  # (B, S)
    s = torch.einsum("bhgd,bhsd->bhgs", q.double(), k.double()) * scale
    s = s.masked_fill(~seen[:, None, None, :], -math.inf)
    return torch.einsum("bhgs,bhsd->bhgd", torch.softmax(s, -1), v.double())


def rotate(x, cos, sin):
    """The engine's rotary embedding (`StaticDecoder._rotate`) in x's dtype, op by op."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def _attention_inputs(w: Widths, device, seed: int):
    g = _gen(device, seed)
    B, KVH, G, D, S = w.rows, w.kv_heads, w.group, w.head_dim, w.cache
    q = _randn((B, KVH, G, D), g, device, w.dtype)
    k, v = _randn((B, KVH, S, D), g, device, w.dtype), _randn((B, KVH, S, D), g, device, w.dtype)
    start, col = _starts(B, S - 3, g, device)
    return g, q, k, v, start, col


def decode_attention(w: Widths, device: torch.device) -> list[Part]:
    """The plain decode-attention kernel (plan.decode_attention=triton) against the float64 attention."""
    from edgerl.kernels.decode_attention import decode_attention as kernel
    _, q, k, v, start, col = _attention_inputs(w, device, 5)
    scale = w.head_dim ** -0.5
    got = kernel(q, k, v, start, col, scale)
    return [Part("decode_attention", _maxerr(got, attention_reference(q, k, v, start, int(col), scale)),
                 ATTENTION_TOL[w.dtype])]


def decode_attention_rope(w: Widths, device: torch.device) -> list[Part]:
    """The rotary decode-attention kernel (triton_rope, triton_layers): its cache column against the
    engine's rotation op by op (fp32 bit for bit; 16 bits within the three roundings' steps), and its
    output against the float64 attention over the rotated query."""
    from edgerl.kernels.decode_attention import decode_attention_rope as kernel
    g, q, k, v, start, col = _attention_inputs(w, device, 6)
    B, KVH, G, D = q.shape
    new_k, new_v = _randn((B, KVH, D), g, device, w.dtype), _randn((B, KVH, D), g, device, w.dtype)
    qkv = torch.cat((q.reshape(B, -1), new_k.reshape(B, -1), new_v.reshape(B, -1)), dim=1)
    cos, sin = _rotary(B, D, g, device, w.dtype)
    kc, vc = k.clone(), v.clone()
    scale = D ** -0.5
    got = kernel(qkv, cos, sin, kc, vc, start, col, scale, G)
    c = int(col)
    want_k = rotate(new_k, cos[:, None], sin[:, None])
    if w.dtype == torch.float32:
        k_err, k_tol = _maxerr(kc[:, :, c], want_k), 0.0
    else:   # each of three roundings may be one step off: 2^-6 of the operands' size
        size = new_k.float().abs() + torch.cat((new_k[..., D // 2:], new_k[..., :D // 2]), -1).float().abs()
        k_err, k_tol = float(((kc[:, :, c].float() - want_k.float()).abs() / size.clamp(min=1e-30)).max()), 2 ** -6
    others = torch.ones(k.shape[2], dtype=torch.bool, device=device)
    others[c] = False
    want = attention_reference(rotate(q, cos[:, None, None], sin[:, None, None]), kc, vc, start, c, scale)
    return [Part("decode_attention_rope cache key", k_err, k_tol),
            Part("decode_attention_rope cache value and other columns",
                 max(_maxerr(vc[:, :, c], new_v), _maxerr(kc[:, :, others], k[:, :, others]),
                     _maxerr(vc[:, :, others], v[:, :, others])), 0.0),
            Part("decode_attention_rope", _maxerr(got, want), ATTENTION_TOL[w.dtype])]


# ---- the decode layer's projections (Triton) ----------------------------------------------------------

# fp32: a few steps of the largest output; 16 bits: the relative size of one step (bf16 8 bits, fp16 11)
ULP = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def _linear_ref(x, wt, norm, eps, bias, residual, glu):
    """The torch ops `decode_linear` replaces, in x's dtype, as HF's llama layer computes them."""
    h = x
    if norm is not None:
        h = norm * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(h, wt, bias)
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def decode_linear(w: Widths, device: torch.device) -> list[Part]:
    """`decode_linear` on the four products of a decode layer (q/k/v with the norm and the rows' sums of
    squares passed in, o and down into the residual with the new sums returned, gate/up with the norm and
    SiLU * up) against the same torch ops: in fp32 its error against their float64 result at most twice
    theirs; in 16 bits, where it rounds as they do, within four steps of their result (one step where an
    fp32 sum in another order rounds the other way, and what that step moves downstream of it)."""
    from edgerl.kernels.decode_linear import decode_linear as kernel, kernel_module
    interpreted = kernel_module().INTERPRETED
    g = _gen(device, 7)
    B, Hd, I, dt = w.rows, w.hidden, w.intermediate, w.dtype
    qkv_n, q_w = (w.heads + 2 * w.kv_heads) * w.head_dim, w.heads * w.head_dim
    kinds = [("q/k/v", Hd, qkv_n, True, w.qkv_bias, False, False), ("o", q_w, Hd, False, False, True, False),
             ("gate/up", Hd, I, True, False, False, True), ("down", I, Hd, False, False, True, False)]
    parts = []
    for name, K, N, normed, biased, resid, glu in kinds:
        rows_w = 2 * N if glu else N
        x = _randn((B, K), g, device, dt)
        wt = _randn((rows_w, K), g, device, dt, K ** -0.5)
        ln = (1 + _randn((K,), g, device, scale=0.3)).to(dt) if normed else None
        bias = _randn((rows_w,), g, device, dt, 0.1) if biased else None
        res = _randn((B, N), g, device, dt) if resid else None
        ssq = x.float().square().sum(-1)[None].contiguous() if normed else None
        out = kernel(x, wt, norm=ln, eps=1e-5, bias=bias, residual=res, glu=glu, sumsq=ssq, return_sumsq=resid)
        got, got_ssq = out if resid else (out, None)
        args = (x, wt, ln, 1e-5, bias, res, glu)
        exact = _linear_ref(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
        want = _linear_ref(*args)
        if dt == torch.float32:   # sums in another order: no larger an error than torch's, twice over
            rms = float(exact.pow(2).mean().sqrt().clamp(min=1e-30))
            parts.append(Part(f"decode_linear {name} {K}->{N}", _maxerr(got, exact) / rms,
                              2 * _maxerr(want, exact) / rms + ULP[dt]))
        elif interpreted:   # Triton's interpreter truncates to 16 bits, at up to five roundings (tests/test_decode_linear_on_cpu.py)
            parts.append(Part(f"decode_linear {name} {K}->{N} (interpreter)",
                              _maxerr(got, want) / float(want.double().abs().max()), 2 ** -4))
        else:   # rounded where torch's ops round: within a few steps of their result (near zero, of the mean size)
            step = ULP[dt] * exact.abs().clamp(min=float(exact.abs().mean()))
            parts.append(Part(f"decode_linear {name} {K}->{N} (steps of the torch ops' result)",
                              float(((got.double() - want.double()).abs() / step).max()), 4.0))
        if got_ssq is not None:   # the next norm's sums of squares, summed over its partials
            ref = got.double().square().sum(-1)
            parts.append(_close(f"decode_linear {name} sums of squares", got_ssq.double().sum(0), ref, 1e-5, 0.0))
    return parts


# ---- the fused bf16 AdamW step (Triton) ---------------------------------------------------------------

def adamw_bf16(w: Widths, device: torch.device) -> list[Part]:
    """`adamw_bf16_step` against the AdamW formula in float64. With Kahan compensation the weight plus its
    compensation carries about 16 bits (within 2^-15 of the formula's terms); stochastically rounded values
    (the moments, and the weight without compensation) are each one of the two bf16 neighbours of the exact
    value. Both allow the fp32 arithmetic's own rounding: a few fp32 steps of the terms, which matters
    where they nearly cancel."""
    from edgerl.kernels.adamw import adamw_bf16_step
    g = _gen(device, 8)
    n = w.params
    bf = torch.bfloat16
    w0, g0 = _randn((n,), g, device, bf), _randn((n,), g, device, bf)
    m0 = _randn((n,), g, device, bf, 0.1)
    v0 = (torch.rand((n,), generator=g, device=device) * 0.01 + 1e-4).to(bf)
    lr, b1, b2, eps, wd, step = 3e-3, 0.9, 0.99, 1e-8, 0.1, 5
    w0d, g0d, m0d, v0d = (t.double() for t in (w0, g0, m0, v0))
    m_ref, m_terms = b1 * m0d + (1 - b1) * g0d, b1 * m0d.abs() + (1 - b1) * g0d.abs()
    v_ref = b2 * v0d + (1 - b2) * g0d ** 2
    upd = lr / (1 - b1 ** step) * m_ref / (v_ref.sqrt() / math.sqrt(1 - b2 ** step) + eps)
    w_ref, w_terms = w0d * (1 - lr * wd) - upd, w0d.abs() * (1 - lr * wd) + upd.abs()
    parts = []
    for kahan in (True, False):
        wt, m, v = w0.clone(), m0.clone(), v0.clone()
        comp = torch.zeros_like(w0) if kahan else None
        adamw_bf16_step(wt, g0, m, v, comp, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                        seed=12345)
        how = "Kahan" if kahan else "stochastic rounding"
        rounded = [("first moment", m, m_ref, m_terms), ("second moment", v, v_ref, v_ref)]
        if kahan:
            err = (wt.double() + comp.double() - w_ref).abs() / (w_terms * 2 ** -15)
            parts.append(Part("adamw_bf16 (Kahan) weight + compensation", float(err.max()), 1.0))
        else:
            rounded.append(("weight", wt, w_ref, w_terms))
        for what, stored, exact, terms in rounded:
            parts.append(Part(f"adamw_bf16 ({how}) {what}", _spacings(stored, exact, terms), 1.0))
            # unbiased: the mean rounding error, in spacings, within 5 standard deviations of zero
            parts.append(Part(f"adamw_bf16 ({how}) {what} mean rounding", _bias(stored, exact, terms), 2.5 / n ** 0.5))
    return parts


def _spacings(stored: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> float:
    """max |stored - exact| in units of the bf16 spacing at exact plus 8 fp32 steps of the formula's terms:
    below 1 when every stored value is one of exact's two bf16 neighbours (up to fp32 rounding)."""
    _, e = torch.frexp(exact)
    gap = torch.ldexp(torch.ones_like(exact), e - 8) + 8 * 2 ** -24 * terms
    return float(((stored.double() - exact).abs() / gap).max())


def _bias(stored: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> float:
    """|mean (stored - exact) / spacing| over the values whose terms do not cancel (where fp32's own
    rounding is far below a bf16 spacing); near 0 for unbiased stochastic rounding (each term's variance
    is at most 1/4)."""
    _, e = torch.frexp(exact)
    keep = terms <= 16 * exact.abs()
    err = (stored.double() - exact) / torch.ldexp(torch.ones_like(exact), e - 8)
    return float(err[keep].mean().abs())


# the registry: every check takes (widths, device) and returns its parts
CHECKS = {"logprobs": logprobs, "decode-cuda": decode_cuda, "nf4": nf4, "decode-attention": decode_attention,
          "decode-attention-rope": decode_attention_rope, "decode-linear": decode_linear, "adamw-bf16": adamw_bf16}


def run(key: str, w: Widths, device: torch.device) -> tuple[list[Part], Optional[str]]:
    """The parts of check `key`, or the one-line error a kernel raised (a failed compile or launch)."""
    try:
        parts = CHECKS[key](w, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return parts, None
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:   # NVRTC, Triton and launch errors: the verdict names the kernel and the setting
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return [], f"{type(e).__name__}: {first}"
