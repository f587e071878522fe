"""token_logprobs_and_entropy on the CPU: naive vs torch chunked vs Triton (in Triton's interpreter),
forward and gradients, against a float64 reference; tied embeddings; memory bounds; errors.

Triton runs in its CPU interpreter, which needs TRITON_INTERPRET=1 before triton is first imported
(triton's own tl.sum/tl.max are jit functions decorated at import). So that this holds whatever
the rest of the suite imported before, and so that the interpreter never leaks into other tests,
the Triton cases (all named *triton*) run in a child pytest process started with TRITON_INTERPRET=1
by test_triton_cases_run_under_the_interpreter; in the parent they skip with that reason.
"""
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from edgerl.kernels import (TORCH_BYTES_PER_LOGIT, make_tiles, naive_logprobs_and_entropy, resolve_backend,
                            token_logprobs_and_entropy)
from edgerl.kernels import triton_impl

from conftest import run_cases_under_triton_interpreter

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def interpreted():
    if not INTERPRETER:
        pytest.skip("runs in the TRITON_INTERPRET=1 child process of test_triton_cases_run_under_the_interpreter")
    pytest.importorskip("triton")
    assert triton_impl.kernels_module().INTERPRETED


def test_triton_cases_run_under_the_interpreter():
    if INTERPRETER:
        pytest.skip("this is the interpreter process itself")
    run_cases_under_triton_interpreter(__file__, "triton", at_least=20)


# ---------------------------------------------------------------- helpers

def rel(out, ref):
    """||out - ref|| / ||ref||, after asserting out is finite (NaN never passes)."""
    assert out is not None and torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_inputs(lead, hid, vocab, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*lead, hid, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (torch.randn(vocab, hid, generator=g, dtype=torch.float64) / hid ** 0.5).to(dtype)
    t = torch.randint(0, vocab, lead, generator=g)
    # upstream gradients of both outputs, as a loss with an entropy bonus would send them
    wl = torch.randn(lead, generator=g, dtype=torch.float64)
    we = torch.randn(lead, generator=g, dtype=torch.float64)
    return h, w, t, wl, we


def run(fn, h, w, t, wl, we, temperature):
    """Outputs and gradients (hidden, weight) of sum(wl * logp) + sum(we * entropy)."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logp, ent = fn(h, w, t, temperature)
    ((logp * wl.to(logp.dtype)).sum() + (ent * we.to(ent.dtype)).sum()).backward()
    return logp, ent, h.grad, w.grad


def reference(h, w, t, wl, we, temperature):
    """float64 naive reference from the same (already rounded) inputs."""
    return run(lambda a, b, c, T: naive_logprobs_and_entropy(a, b, c, T, dtype=torch.float64),
               h.double(), w.double(), t, wl, we, temperature)


def errors(got, ref):
    return [rel(a, b) for a, b in zip(got, ref)]


def torch_fn(chunk=None):
    return lambda h, w, t, T: token_logprobs_and_entropy(h, w, t, T, backend="torch", chunk=chunk)


def triton_fn(tiles=None, chunk=None):
    return lambda h, w, t, T: token_logprobs_and_entropy(h, w, t, T, backend="triton", chunk=chunk, tiles=tiles)


# (leading shape, hidden, vocab): one token, a vocabulary that is no multiple of any tile, a
# hidden size that is no multiple of block_k (40) and one that is (64), a (B, T) batch, and more
# tokens than vocabulary entries (the backward then sums grad_W over token chunks).
CASES = [((1,), 40, 300), ((37,), 40, 300), ((3, 7), 64, 257), ((37,), 24, 20)]


# ---------------------------------------------------------------- torch path and naive

def test_naive_fp32_is_close_to_float64():
    h, w, t, wl, we = make_inputs((37,), 40, 300, torch.float32, seed=1)
    got = run(lambda a, b, c, T: naive_logprobs_and_entropy(a, b, c, T), h, w, t, wl, we, 0.7)
    assert max(errors(got, reference(h, w, t, wl, we, 0.7))) < 1e-4


@pytest.mark.parametrize("lead,hid,vocab", CASES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_torch_chunked_fp32_matches_float64(lead, hid, vocab, temperature, chunk):
    h, w, t, wl, we = make_inputs(lead, hid, vocab, torch.float32, seed=100 * len(lead) + hid + (chunk or 0))
    got = run(torch_fn(chunk), h, w, t, wl, we, temperature)
    assert got[0].shape == lead and got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    err = errors(got, reference(h, w, t, wl, we, temperature))
    assert max(err) < 1e-4, err


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 5e-3)])
def test_torch_chunked_16bit_matches_float64_of_rounded_inputs(dtype, tol):
    h, w, t, wl, we = make_inputs((3, 7), 40, 300, dtype, seed=3)
    got = run(torch_fn(4), h, w, t, wl, we, 0.7)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    err = errors(got, reference(h, w, t, wl, we, 0.7))
    assert max(err) < tol, err


@pytest.mark.parametrize("lead,hid,vocab", CASES)
@pytest.mark.parametrize("chunk", [1, 5, None])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 5e-3)])
def test_torch_16bit_weight_in_vocabulary_tiles_matches_float64(lead, hid, vocab, chunk, dtype, tol):
    """A 16-bit weight is upcast a vocabulary tile at a time (forward: an online log-sum-exp over the tiles;
    backward: slabs a tile of columns at a time), at every shape: several tiles, a vocabulary no multiple
    of the tile, more tokens than vocabulary entries."""
    from edgerl.kernels.chunked import vocab_tile
    n = int(torch.Size(lead).numel())
    assert vocab_tile(min(chunk or n, n), vocab, hid) < vocab or n > 4 * hid   # the cases span several tiles
    h, w, t, wl, we = make_inputs(lead, hid, vocab, dtype, seed=7 * hid + (chunk or 0))
    got = run(torch_fn(chunk), h, w, t, wl, we, 0.7)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    err = errors(got, reference(h, w, t, wl, we, 0.7))
    assert max(err) < tol, err


def test_vocab_tile_keeps_the_tile_and_its_logits_within_the_chunks_logits():
    from edgerl.kernels.chunked import vocab_tile
    for chunk, vocab, hid in ((1, 300, 40), (261, 128256, 4096), (1024, 151936, 1536), (5, 20, 24), (4096, 49152, 960)):
        tile = vocab_tile(chunk, vocab, hid)
        assert 1 <= tile <= vocab and (tile < 256 or tile % 128 == 0 or tile == vocab)
        assert tile * hid * 4 + chunk * tile * 8 <= chunk * vocab * 8
        rows = chunk + hid // 2   # the backward's slabs
        assert tile * hid * 4 + rows * tile * 8 <= chunk * vocab * 8 + 8 * tile


def test_torch_path_takes_float64():
    h, w, t, wl, we = make_inputs((37,), 40, 300, torch.float64, seed=4)
    err = errors(run(torch_fn(8), h, w, t, wl, we, 1.3), reference(h, w, t, wl, we, 1.3))
    assert max(err) < 1e-6, err


def _large_logit_inputs(dtype, peaked):
    """Logits around 1e3: either 1000 + O(1) (a shift softmax must cancel; exp(1000) overflows even
    in float64) or spread over +-1e3 (nearly one-hot distributions, entropy ~ 0)."""
    h, w, t, wl, we = make_inputs((37,), 40, 300, torch.float64, seed=5)
    if peaked:
        h = h * 300.0
    else:
        w[:, 0] = 1.0
        h[:, 0] = 1000.0
    return h.to(dtype), w.to(dtype), t, wl, we


@pytest.mark.parametrize("peaked", [False, True])
def test_torch_chunked_is_stable_for_huge_logits(peaked):
    _check_huge_logits(torch_fn(5), peaked)


@pytest.mark.parametrize("peaked", [False, True])
def test_torch_16bit_tiles_are_stable_for_huge_logits(peaked):
    """Logits near 1e3 in fp16 inputs: the running maximum grows from tile to tile and the sums so far are
    rescaled; nothing overflows and the entropies near 0 stay near 0."""
    h, w, t, wl, we = _large_logit_inputs(torch.float16, peaked)
    ref = reference(h, w, t, wl, we, 1.0)
    got = run(torch_fn(5), h, w, t, wl, we, 1.0)
    assert all(torch.isfinite(x).all() for x in got)
    err = errors(got, ref)
    assert max(err) < 5e-3, err
    assert (got[1].double() - ref[1]).abs().max() < 1e-3


def _check_huge_logits(fn, peaked):
    h, w, t, wl, we = _large_logit_inputs(torch.float32, peaked)
    z = h.double() @ w.double().t()
    assert z.abs().max() > 500
    ref = reference(h, w, t, wl, we, 1.0)
    got = run(fn, h, w, t, wl, we, 1.0)
    err = errors(got, ref)
    assert max(err) < 1e-4, err
    assert (got[1].double() - ref[1]).abs().max() < 1e-4  # entropies near 0 stay near 0


# ---------------------------------------------------------------- Triton, interpreted

TILE_SETS = [make_tiles(16, 64, 16, "fp32"), None]  # a tiny config, and choose_tiles' 48 KB pick


@pytest.mark.parametrize("lead,hid,vocab", CASES)
@pytest.mark.parametrize("tiles", TILE_SETS, ids=["16x64x16", "chosen"])
def test_triton_fp32_matches_float64(interpreted, lead, hid, vocab, tiles):
    h, w, t, wl, we = make_inputs(lead, hid, vocab, torch.float32, seed=hid + vocab)
    err = errors(run(triton_fn(tiles, chunk=6), h, w, t, wl, we, 0.7), reference(h, w, t, wl, we, 0.7))
    assert max(err) < 1e-4, err


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("lead,hid,vocab", CASES[1:3])
def test_triton_16bit_matches_float64_of_rounded_inputs(interpreted, dtype, tol, lead, hid, vocab):
    h, w, t, wl, we = make_inputs(lead, hid, vocab, dtype, seed=7)
    got = run(triton_fn(make_tiles(16, 64, 32, "bf16"), chunk=8), h, w, t, wl, we, 0.7)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    err = errors(got, reference(h, w, t, wl, we, 0.7))
    assert max(err) < tol, err


def test_triton_matches_torch_chunked(interpreted):
    h, w, t, wl, we = make_inputs((4, 9), 64, 300, torch.float32, seed=8)
    a = run(torch_fn(7), h, w, t, wl, we, 1.0)
    b = run(triton_fn(chunk=7), h, w, t, wl, we, 1.0)
    assert max(errors(b, [x.double() for x in a])) < 1e-5


@pytest.mark.parametrize("peaked", [False, True])
def test_triton_is_stable_for_huge_logits(interpreted, peaked):
    _check_huge_logits(triton_fn(make_tiles(16, 64, 16, "fp32"), chunk=5), peaked)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_output_element_is_written(request, monkeypatch, backend):
    """Buffers our code allocates with torch.empty start as NaN: any element a kernel or a slab
    loop fails to write shows up as a non-finite output or gradient."""
    if backend == "triton":
        request.getfixturevalue("interpreted")
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2 ** 31))

    monkeypatch.setattr(torch, "empty", poisoned)
    for lead, hid, vocab in CASES:
        h, w, t, wl, we = make_inputs(lead, hid, vocab, torch.float32, seed=19)
        fn = triton_fn(make_tiles(16, 64, 16, "fp32"), chunk=3) if backend == "triton" else torch_fn(3)
        err = errors(run(fn, h, w, t, wl, we, 1.0), reference(h, w, t, wl, we, 1.0))  # asserts finite
        assert max(err) < 1e-4, err


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_triton_vocabulary_splits_merge_exactly(interpreted, splits):
    h, w, t, _, _ = make_inputs((37,), 40, 300, torch.float32, seed=9)
    tiles = make_tiles(16, 64, 16, "fp32")
    logp, ent, lse, mz = triton_impl.forward_stats_triton(h, w, t, 1.0, tiles, True, splits=splits)
    ref_lp, ref_ent = naive_logprobs_and_entropy(h.double(), w.double(), t, dtype=torch.float64)
    assert rel(logp, ref_lp) < 1e-6 and rel(ent, ref_ent) < 1e-6
    assert rel(lse - mz, ref_ent) < 1e-6


# ---------------------------------------------------------------- gradients from one output, options

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_output_gradient_alone_and_compute_entropy_false(request, backend):
    if backend == "triton":
        request.getfixturevalue("interpreted")
    h, w, t, _, _ = make_inputs((37,), 40, 300, torch.float32, seed=10)
    ref_grad = {}
    for use in ("logp", "entropy"):
        grads = []
        for fn in (lambda a, b: naive_logprobs_and_entropy(a.double(), b.double(), t, 0.9, dtype=torch.float64),
                   lambda a, b: token_logprobs_and_entropy(a, b, t, 0.9, backend=backend, chunk=9)):
            a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = fn(a, b)
            (lp if use == "logp" else ent).sum().backward()  # the other output's gradient is None
            grads.append((a.grad, b.grad))
        assert rel(grads[1][0], grads[0][0]) < 1e-4 and rel(grads[1][1], grads[0][1]) < 1e-4
        ref_grad[use] = grads[0]
    a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(a, b, t, 0.9, backend=backend, chunk=9, compute_entropy=False)
    assert ent is None
    lp.sum().backward()
    ref_lp = naive_logprobs_and_entropy(h.double(), w.double(), t, 0.9, dtype=torch.float64)[0]
    assert rel(lp, ref_lp) < 1e-5
    assert rel(a.grad, ref_grad["logp"][0]) < 1e-4 and rel(b.grad, ref_grad["logp"][1]) < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_frozen_weight_or_hidden_gets_no_gradient(request, backend):
    if backend == "triton":
        request.getfixturevalue("interpreted")
    h, w, t, wl, we = make_inputs((37,), 40, 300, torch.float32, seed=11)
    ref = reference(h, w, t, wl, we, 1.0)
    a = h.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(a, w, t, backend=backend, chunk=7)  # frozen lm head (LoRA)
    ((lp * wl.float()).sum() + (ent * we.float()).sum()).backward()
    assert rel(a.grad, ref[2]) < 1e-4 and w.grad is None
    b = w.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h, b, t, backend=backend, chunk=7)
    ((lp * wl.float()).sum() + (ent * we.float()).sum()).backward()
    assert rel(b.grad, ref[3]) < 1e-4


# ---------------------------------------------------------------- tied embeddings

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tied_embedding_gradient_accumulates_into_the_shared_parameter(request, backend):
    if backend == "triton":
        request.getfixturevalue("interpreted")
    g = torch.Generator().manual_seed(12)
    vocab, hid = 300, 40
    ids = torch.randint(0, vocab, (3, 8), generator=g)
    mix = torch.randn(hid, hid, generator=g) * 0.3
    emb0 = torch.randn(vocab, hid, generator=g)

    def grad_of_embedding(fn, dtype, tie=True):
        emb = torch.nn.Parameter(emb0.to(dtype))
        hidden = torch.tanh(emb[ids] @ mix.to(dtype))  # input embedding use of the Parameter
        head = emb if tie else emb.detach()  # lm-head use of the same Parameter
        lp, ent = fn(hidden, head, ids.roll(-1, dims=1))
        (-lp.mean() - 0.05 * ent.mean()).backward()
        return emb.grad

    ref = grad_of_embedding(lambda a, b, c: naive_logprobs_and_entropy(a, b, c, 0.8, dtype=torch.float64),
                            torch.float64)
    got = grad_of_embedding(lambda a, b, c: token_logprobs_and_entropy(a, b, c, 0.8, backend=backend, chunk=5),
                            torch.float32)
    assert rel(got, ref) < 1e-4
    untied = grad_of_embedding(lambda a, b, c: naive_logprobs_and_entropy(a, b, c, 0.8, dtype=torch.float64),
                               torch.float64, tie=False)
    assert rel(untied, ref) > 0.05  # the lm-head share of the gradient is really in there


# ---------------------------------------------------------------- memory

class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created by torch ops and still alive: current, peak and largest.

    Storages of `known` tensors (the inputs) are not counted. A storage is released when the last
    tensor seen on it dies (torch keeps a tensor's Python object alive while C++, e.g. autograd,
    holds the tensor, so finalizers fire when the memory really goes).
    """

    def __init__(self, known=()):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.refs = {}
        self.known = {x.untyped_storage().data_ptr() for x in known}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self._track(x)
        return out

    def _track(self, x):
        st = x.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if key in self.known or nbytes == 0:
            return
        if key not in self.refs:
            self.refs[key] = [0, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, nbytes)
        self.refs[key][0] += 1
        weakref.finalize(x, self._drop, key)

    def _drop(self, key):
        ref = self.refs.get(key)
        if ref is not None:
            ref[0] -= 1
            if ref[0] == 0:
                self.live -= ref[1]
                del self.refs[key]


def _measure(fn, h, w, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with LiveBytes(known=(h, w, t)) as m:
        lp, ent = fn(h, w, t)
        (lp.sum() + ent.sum()).backward()
        del lp, ent
    return m


def test_torch_path_peak_memory_is_bounded_by_the_chunk():
    n, hid, vocab, chunk = 512, 16, 1000, 16
    h, w, t, _, _ = make_inputs((n,), hid, vocab, torch.float32, seed=13)
    naive = _measure(lambda a, b, c: naive_logprobs_and_entropy(a, b, c), h, w, t)
    chunked = _measure(lambda a, b, c: token_logprobs_and_entropy(a, b, c, backend="torch", chunk=chunk), h, w, t)
    # the tracker sees the naive path's (N, V) fp32 tensors: logits, log-softmax, softmax, ...
    assert naive.largest >= n * vocab * 4 and naive.peak >= 4 * n * vocab * 4
    # chunked: no tensor grows with N x V; the peak is the chunk's temporaries plus the gradients
    # (N x H and V x H) and a few per-token vectors
    assert chunked.largest <= chunk * vocab * 4
    gradients = (n + vocab) * hid * 4
    assert chunked.peak <= chunk * vocab * TORCH_BYTES_PER_LOGIT + gradients + 16 * n * 4, chunked.peak
    assert chunked.peak < naive.peak / 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_path_never_holds_an_fp32_copy_of_a_16bit_weight(dtype):
    """16-bit inputs on the torch path with a frozen head (LoRA): no tensor as large as the weight in fp32
    (the path upcasts a tile of the vocabulary at a time), and the peak is the chunk's temporaries, grad_h
    and the backward's fp32 copies of h and of grad_h, and a few per-token vectors."""
    n, hid, vocab, chunk = 96, 64, 2000, 16
    h, w, t, _, _ = make_inputs((n,), hid, vocab, dtype, seed=15)
    h = h.clone().requires_grad_()
    with LiveBytes(known=(h, w, t)) as m:
        lp, ent = token_logprobs_and_entropy(h, w, t, backend="torch", chunk=chunk)
        (lp.sum() + ent.sum()).backward()
        del lp, ent
    assert h.grad is not None and w.grad is None
    assert m.largest < vocab * hid * 4 / 2, m.largest
    assert m.peak <= chunk * vocab * TORCH_BYTES_PER_LOGIT + n * hid * (2 + 4 + 4) + 16 * n * 4, m.peak


def test_triton_path_peak_memory_is_bounded_by_the_slab(interpreted):
    n, hid, vocab, chunk = 256, 16, 1000, 16
    h, w, t, _, _ = make_inputs((n,), hid, vocab, torch.bfloat16, seed=14)
    tiles = make_tiles(64, 128, 16, "bf16")  # few, large programs: the interpreter's cost is per program
    m = _measure(lambda a, b, c: token_logprobs_and_entropy(a, b, c, backend="triton", chunk=chunk, tiles=tiles),
                 h, w, t)
    slab = chunk * vocab * 2  # bf16 grad-logits
    grads_and_acc = (n + vocab) * hid * 2 + n * hid * (4 + 2)  # outputs, fp32 grad_h sum and one partial
    assert m.largest <= max(slab, vocab * hid * 2)
    assert m.peak <= slab + grads_and_acc + 64 * n * 4, m.peak


def test_autograd_saves_no_vocabulary_sized_tensor():
    n, hid, vocab = 64, 16, 1000
    h, w, t, _, _ = make_inputs((n,), hid, vocab, torch.float32, seed=15)
    for fn, expect_big in ((naive_logprobs_and_entropy, True),
                           (lambda a, b, c: token_logprobs_and_entropy(a, b, c, backend="torch", chunk=8), False)):
        saved = []
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
            lp, ent = fn(a, b, t)
        assert (max(saved) >= n * vocab) == expect_big, saved
        if not expect_big:
            assert max(saved) <= max(n, vocab) * hid


# ---------------------------------------------------------------- backends and errors

def test_auto_backend_uses_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"
    assert resolve_backend("torch", torch.device("cpu"), torch.bfloat16) == "torch"


def test_forced_triton_on_unsupported_setup_is_a_clear_error(monkeypatch):
    class Compiled:
        INTERPRETED = False

    monkeypatch.setattr(triton_impl, "kernels_module", lambda: Compiled)
    with pytest.raises(RuntimeError, match="not CUDA"):
        resolve_backend("triton", torch.device("cpu"), torch.float32)

    def no_triton():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(triton_impl, "kernels_module", no_triton)
    with pytest.raises(RuntimeError, match="triton does not import"):
        resolve_backend("triton", torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="fp32, fp16 or bf16"):
        resolve_backend("triton", torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match="expected one of"):
        resolve_backend("cuda", torch.device("cpu"), torch.float32)
    h, w, t, _, _ = make_inputs((5,), 8, 30, torch.float32, seed=16)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        token_logprobs_and_entropy(h, w, t, backend="triton")


def test_bad_inputs_are_clear_errors():
    h, w, t, _, _ = make_inputs((2, 5), 8, 30, torch.float32, seed=17)
    with pytest.raises(TypeError, match="cast one"):
        token_logprobs_and_entropy(h, w.half(), t)
    with pytest.raises(ValueError, match=r"expected shape \(V, 8\)"):
        token_logprobs_and_entropy(h, w[:, :4], t)
    with pytest.raises(ValueError, match="leading shape"):
        token_logprobs_and_entropy(h, w, t.reshape(-1))
    with pytest.raises(TypeError, match="token ids"):
        token_logprobs_and_entropy(h, w, t.float())
    bad = t.clone()
    bad[1, 2] = 30
    with pytest.raises(ValueError, match=r"targets\[7\].*= 30.*\[0, 30\)"):
        token_logprobs_and_entropy(h, w, bad)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(h, w, t, 0.0)
    with pytest.raises(ValueError, match="chunk"):
        token_logprobs_and_entropy(h, w, t, chunk=0)


def test_autocast_casts_like_a_matmul_and_reaches_the_fp32_weight():
    h, w, t, wl, we = make_inputs((37,), 40, 300, torch.float32, seed=20)
    a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = token_logprobs_and_entropy(a.bfloat16(), b, t, backend="torch", chunk=8)
    ((lp * wl.float()).sum() + (ent * we.float()).sum()).backward()
    assert b.grad.dtype == torch.float32 and a.grad.dtype == torch.float32
    ref = reference(h.bfloat16(), w.bfloat16(), t, wl, we, 1.0)
    assert max(errors((lp, ent, a.grad, b.grad), ref)) < 1e-2


def test_zero_tokens_and_non_contiguous_hidden():
    h, w, t, wl, we = make_inputs((6, 5), 8, 30, torch.float32, seed=18)
    a = h.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(a[:0], w, t[:0])
    assert lp.shape == (0, 5) and ent.shape == (0, 5)
    (lp.sum() + ent.sum()).backward()
    assert (a.grad == 0).all()
    ht, tt = h.transpose(0, 1), t.transpose(0, 1)  # (5, 6, H), not contiguous
    err = errors(run(torch_fn(4), ht, w, tt, wl.t(), we.t(), 1.0), reference(ht, w, tt, wl.t(), we.t(), 1.0))
    assert max(err) < 1e-4
