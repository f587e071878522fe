"""The `static` engine: edgerl's own decoder over a static KV cache, an eager prefill, and the decode step
replayed from a CUDA graph.

HF `generate` spends most of a small model's step in per-token Python and kernel launches. Here one
decode step (model, sampling, EOS bookkeeping) works only on fixed tensors updated in place, so it is
captured once per batch size (and per span of the cache, for torch's ops) and replayed per token: one
launch instead of ~20 per layer. Plain `torch.cuda.CUDAGraph`, no torch.compile needed, so it runs on
Pascal (CC 6.x) too. The step's layers run through the plan's decode backend (`plan.decode_backend`,
decoder.py). Without CUDA (or with `cuda_graphs=False`) the same step runs eagerly.

Seeding: each `generate` draws one seed from the caller's generator (or the global torch RNG when
none is given) and seeds the engine's own generator on the model's device with it; on CUDA that
generator is registered with every captured graph (graph-safe Philox state). The same seed, inputs,
mode (graph or eager) and batch layout give the same samples; graph and eager runs of one seed may
draw differently (same distribution), and so do the CPU and CUDA.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Optional

import torch

from edgerl.core.errors import TrainingError
from .base import ActorWeights, EngineContext, OwnWeights, RolloutBatch, SamplingParams, cut_at_eos, inference_copy
from .base import load_weights
from .arch import UnsupportedModel
from .decode_backends import decode_backend
from .decoder import DecodeKernelUnavailable, StaticDecoder
from .sampling import sample
from .static_mode import CHECK_EVERY, Mode as _Mode

# Rows that finished (EOS) leave the decode batch once no more than this share of it is still decoding: the
# live rows move to the front (KV cache rows, state) and decode on as a smaller batch, with a graph captured
# for that size. Halving keeps the captures to log2(rows) per rollout.
DROP_AT = 0.5
# A backend that attends over a span of the cache (`reads_span`: torch's ops) reads the columns written so far,
# rounded up, instead of the whole cache: at step t of a response of R tokens it reads about W + t columns, not
# W + R. Each span is a mode (a graph captured the first time), so under CUDA graphs the cache is cut into at
# most SPANS equal spans of at least SPAN_MIN columns; eager steps widen it 16 columns at a time.
SPAN_MIN = 512
SPANS = 8


class _State:
    """Static tensors the decode step reads and writes in place (so captured graphs see new values)."""

    def __init__(self, max_batch: int, max_seq_len: int, device: torch.device) -> None:
        long = dict(device=device, dtype=torch.long)
        self.tok = torch.zeros(max_batch, **long)        # input token of the next step, per row
        self.start = torch.zeros(max_batch, **long)      # first real column (left padding), per row
        self.done = torch.zeros(max_batch, device=device, dtype=torch.bool)
        self.col = torch.zeros(1, **long)                # cache column the next step writes (shared)
        self.step = torch.zeros(1, **long)               # response index the next sample goes to
        self.orig = torch.arange(max_batch, **long)       # the chunk row each decoding row started as
        self.out_tok = torch.zeros(max_batch, max_seq_len, **long)
        self.out_logp = torch.zeros(max_batch, max_seq_len, device=device, dtype=torch.float32)
        self.temp = torch.ones(1, device=device, dtype=torch.float32)
        self.top_p = torch.ones(1, device=device, dtype=torch.float32)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def _addresses(dec: StaticDecoder) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in dec.weight_tensors())


def build(plan, ctx: EngineContext):
    """The static engine over its own copy of the weights, or over the actor's own modules when the
    base is quantized (decisions checked by the plan: `plan/engines.py`). The decoder checks the loaded
    model again and raises UnsupportedModel if the plan and the model disagree."""
    from edgerl.models.load import quantized_base
    cuda = ctx.device.type == "cuda"
    if quantized_base(plan):
        engine = _engine(plan, ctx.actor.lm, ctx.max_seq_len, cuda, projections="modules")
        return ActorWeights(engine, ctx.actor, plan.rollout_resident)
    copy = inference_copy(plan, ctx)
    return OwnWeights(_engine(plan, copy, ctx.max_seq_len, cuda), copy, plan.rollout_resident)


def _engine(plan, model: torch.nn.Module, max_seq_len: int, cuda: bool, **kw) -> "StaticCacheEngine":
    """The engine, or a one-line TrainingError naming the plan's setting when its decode backend cannot run
    here (the plan sees the GPU, not the loaded model's layers or whether NVRTC or triton works on it)."""
    from edgerl.plan.dtypes import torch_dtype
    kv = getattr(plan, "kv_cache_dtype", None)
    try:
        return StaticCacheEngine(model, plan.rollout_batch, max_seq_len, cuda_graphs=cuda, backend=plan.decode_backend,
                                 note=plan.reasons.get("rollout_engine", ""),
                                 cache_dtype=torch_dtype(kv) if kv else None, **kw)
    except DecodeKernelUnavailable as e:
        raise TrainingError(f"{e}" + ("" if "plan.kv_cache_dtype" in str(e) else " (set plan.decode_backend=torch)")) \
            from None
    except UnsupportedModel as e:   # the plan read the config; the loaded model says otherwise
        raise TrainingError(f"the plan runs the rollout on edgerl's static-cache engine, and it cannot run this "
                            f"model: {e} (set plan.rollout_engine=hf-generate)") from None


class StaticCacheEngine:
    """`RolloutEngine` over an HF model the static decoder implements (plan/archs.py's `static`), plain or
    peft-wrapped.

    model: the engine's inference copy (compute dtype, on its device; weights are read in place, so
    never replace its parameters, only copy into them: `sync_weights` does). max_batch: rows
    generated at once (the plan's rollout batch); max_seq_len: prompt + response tokens a row may
    reach. cuda_graphs: capture the decode step (CUDA only). projections: 'auto' | 'fused' | 'modules'
    (`projections.py`; 'fused' rebinds q/k/v and gate/up parameters as views of one fused weight
    each). backend: the decode step's layers, `plan.decode_backend` (a name of decode_backends.DECODE_BACKENDS:
    'torch', 'triton-attention', 'triton-layers', 'cuda-c').
    time_steps: record each decode step's time in `info["step_ms"]` (CUDA events on the GPU).
    spans: where the backend reads a span of the cache (torch's ops), attend over the columns written so far,
    a span at a time (SPAN_MIN, SPANS); False: over the whole cache at every step.
    cache_dtype: the KV cache's storage (default: the model's dtype; fp16 under fp32 with backend cuda-c, whose
    writes are checked against fp16's range: a rollout that overflowed it raises CacheOverflow).

    Lifetime: the KV cache and static buffers are allocated by the first `generate`, a graph is
    captured the first time a mode (rows, greedy, top-k, ...) is generated, and all of it is kept
    across `generate` calls and `sync_weights` (in-place copies keep the weights' addresses) until
    `release()` frees it. Before each generate the engine checks that the weights still sit where the
    graphs read them (`models.release_weights`/`restore_weights` may move them); if not, it drops
    the graphs and captures again, so keeping an engine is always safe, and fast when the weights stay.
    Raises decoder.UnsupportedModel / NotImplementedError for models or rope types it cannot run."""

    name = "static"

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int, *,
                 cuda_graphs: bool, projections: str = "auto", backend: str = "torch", time_steps: bool = False,
                 spans: bool = True, note: str = "", cache_dtype: Optional[torch.dtype] = None) -> None:
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(f"StaticCacheEngine needs max_batch >= 1 and max_seq_len >= 2, "
                             f"got max_batch={max_batch}, max_seq_len={max_seq_len}")
        self.dec = StaticDecoder(model, max_batch, max_seq_len, projections=projections, backend=decode_backend(backend),
                                 cache_dtype=cache_dtype)
        self.device = self.dec.device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {self.device}; "
                             "use cuda_graphs=False")
        if cuda_graphs and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            raise RuntimeError(f"torch {torch.__version__} has no graph-safe generator registration "
                               "(CUDAGraph.register_generator_state); use torch >= 2.6 or cuda_graphs=False")
        self.model = model
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.cuda_graphs, self.time_steps = cuda_graphs, time_steps
        self.drop_finished = True   # rows that finished leave the decode batch (DROP_AT)
        # columns a span grows by (SPAN_MIN, SPANS); 0: the whole cache at every step
        self.span_step = span_step(self.dec.cache_len, cuda_graphs) if spans and self.dec.backend.reads_span else 0
        self.note = note
        self._gen = torch.Generator(device=self.device)
        self._state: Optional[_State] = None
        self._graphs: dict[_Mode, torch.cuda.CUDAGraph] = {}
        # Modes warmed up once: a capture after the weights moved (FSDP2 gathers the adapters anew for
        # every rollout) needs no eager warm-up, whose two steps took two thirds of a 7B re-capture
        self._warmed: set[_Mode] = set()
        self._eos: dict[tuple[int, ...], torch.Tensor] = {}
        self._pool = None
        self._stamp: tuple[int, ...] = ()   # weight addresses the captured graphs read

    def describe(self) -> str:
        mode = "static KV cache + CUDA graph decode" if self.cuda_graphs else "static KV cache, eager decode"
        size = f"{self.max_batch} sequences x {self.max_seq_len} tokens, cache {self.dec.cache_bytes() / 2**20:.0f} MiB"
        if self.dec.narrow_cache:
            size += f" in {str(self.dec.cache_dtype).split('.')[-1]}"
        if self.span_step:
            size += f", attention over the columns written so far in spans of {self.span_step}"
        return (f"static engine: {mode}, decode backend {self.dec.backend.name}: {self.dec.backend.note} ({size}; "
                f"{self.dec.proj_note})" + (f" ({self.note})" if self.note else ""))

    @torch.no_grad()
    def sync_weights(self, weights) -> None:
        # In-place copies (into the fused weights too, through their views): the decoder and the
        # captured graphs keep pointing at the same storage, so the graphs stay valid.
        load_weights(self.model, weights)

    def release(self) -> None:
        """Drop graphs, their memory pool, the cache and the static buffers; `generate` rebuilds them."""
        self._graphs.clear()
        self._pool = None
        self._stamp = ()
        self._state = None
        self._eos.clear()
        self.dec.free()

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds now besides the model's weights: KV cache, static buffers, and the
        captured graphs' private memory pool (CUDA: read from the allocator's segments)."""
        out = {"kv_cache": self.dec.cache_bytes() if self.dec.cache is not None else 0,
               "state": self._state.nbytes() if self._state is not None else 0, "graph_pool": 0}
        if self._pool is not None and self.device.type == "cuda":
            pool = tuple(self._pool)
            out["graph_pool"] = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                                    if tuple(seg.get("segment_pool_id", ())) == pool)
        return out

    def _weights_moved(self) -> bool:
        """Check the weights before a generate; drop the graphs if what they read has moved."""
        refused = self.dec.check_weights()
        if not self._graphs:
            return False
        if refused or _addresses(self.dec) != self._stamp:
            self._graphs.clear()
            self._pool = None
            self._stamp = ()
            return True
        return False

    # ---- the step -------------------------------------------------------------------------------

    def _prefill(self, chunk: list[list[int]], ids: torch.Tensor, width: int, B: int) -> torch.Tensor:
        """The prompts' KV cache and last-column logits (B, V). A prompt that several rows share (a GRPO
        group's samples) is computed once, in its first row, and its cache columns are copied to the
        others: a group of 8 samples prefills 8 times fewer tokens."""
        s, first = self._state, {}
        src = [first.setdefault(tuple(p), b) for b, p in enumerate(chunk)]   # each row's prompt's first row
        if len(first) == B:
            return self.dec.prefill(ids.to(self.device), s.start[:B])
        rows = list(first.values())                                            # ascending: first occurrences
        idx = torch.tensor(rows, dtype=torch.long)
        on_dev = idx.to(self.device)
        logits = self.dec.prefill(ids[idx].to(self.device), s.start[:B][on_dev], rows=on_dev)
        dup = [b for b in range(B) if src[b] != b]
        self.dec.copy_rows([src[b] for b in dup], dup, width)
        slot = {r: i for i, r in enumerate(rows)}
        return logits[torch.tensor([slot[r] for r in src], device=logits.device)]

    def _emit(self, logits: torch.Tensor, mode: _Mode) -> None:
        """Sample from logits (B, V), record token and log-prob at `step`, update done/tok/step in place."""
        s, B = self._state, mode.rows
        dropped = mode.rows < mode.full
        tok, logp = sample(logits, s.temp, greedy=mode.greedy, top_k=mode.top_k,
                           top_p=s.top_p if mode.top_p else None, generator=self._gen,
                           noise_rows=s.orig[:B] if dropped else None, noise_total=mode.full)
        done = s.done[:B]
        tok = torch.where(done, mode.pad, tok)           # finished rows keep emitting pad, as HF does
        logp = logp.masked_fill(done, 0.0)
        s.out_tok[:B].index_copy_(1, s.step, tok[:, None])
        s.out_logp[:B].index_copy_(1, s.step, logp[:, None])
        if mode.eos:
            done.logical_or_((tok[:, None] == self._eos[mode.eos]).any(-1))
        s.tok[:B].copy_(tok)
        s.step.add_(1)

    def _step(self, mode: _Mode) -> None:
        s, B = self._state, mode.rows
        self._emit(self.dec.decode(s.tok[:B], s.col, s.start[:B], mode.span), mode)
        s.col.add_(1)

    def _graph(self, mode: _Mode) -> torch.cuda.CUDAGraph:
        """Capture the decode step for this mode (once; reused until `release`)."""
        if mode in self._graphs:
            return self._graphs[mode]
        s, B = self._state, mode.rows
        rng = self._gen.get_state()   # the warm-up draws; put them back so capturing changes no samples
        # a capture in the middle of a rollout (finished rows dropped) must leave its state as it found it: the
        # warm-up steps write cache column 0 and output column 0 of the rows, and the step counters
        kept = [t.clone() for t in (s.col, s.step, s.start, s.tok, s.done)]
        kept_cols = (self.dec.cache[:, :, :B, :, :1].clone(), s.out_tok[:B, :1].clone(), s.out_logp[:B, :1].clone())
        for t in (s.col, s.step, s.start, s.tok):   # keep the warm-up's writes inside the buffers
            t.zero_()
        s.done.fill_(False)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):   # warm-up off the capture: cuBLAS handles, lazy init, allocator
            for _ in range(0 if mode in self._warmed else 2):
                self._step(mode)
                s.col.zero_()
                s.step.zero_()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._warmed.add(mode)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        if not mode.greedy:
            g.register_generator_state(self._gen)
        with torch.cuda.graph(g, pool=self._pool):
            self._step(mode)
        self._gen.set_state(rng)
        for t, v in zip((s.col, s.step, s.start, s.tok, s.done), kept):
            t.copy_(v)
        for t, v in zip((self.dec.cache[:, :, :B, :, :1], s.out_tok[:B, :1], s.out_logp[:B, :1]), kept_cols):
            t.copy_(v)
        if not self._graphs:
            self._stamp = _addresses(self.dec)
        self._graphs[mode] = g
        return g

    # ---- generate -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n_samples: int, params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> RolloutBatch:
        _check(prompts, n_samples, params, self.max_seq_len)
        rows = [list(p) for p in prompts for _ in range(n_samples)]
        need, eos, info = self._begin(len(rows), params, generator)
        responses, logprobs, truncated = [], [], []
        for first in range(0, len(rows), need):
            chunk = rows[first:first + need]
            mode = _Mode(rows=len(chunk), full=len(chunk), greedy=params.greedy,
                         top_k=0 if params.greedy else params.top_k,
                         top_p=not params.greedy and params.top_p < 1.0, eos=eos, pad=params.pad_token_id,
                         span=self.dec.cache_len)
            toks, lps = self._generate_chunk(chunk, mode, params.max_new_tokens, info)
            for tok_row, lp_row in zip(toks, lps):
                resp, cut = cut_at_eos(tok_row, eos, params.max_new_tokens)
                responses.append(resp)
                logprobs.append(lp_row[:len(resp)])
                truncated.append(cut)
            info["chunks"] += 1
        self.dec.check_cache()   # a key or value past a narrow cache's range stops here, not in the update
        return RolloutBatch(prompt_ids=rows, response_ids=responses, truncated=truncated,
                            logprobs=logprobs, info=info)

    def _begin(self, n_rows: int, params: SamplingParams, generator: Optional[torch.Generator]
               ) -> tuple[int, tuple[int, ...], dict]:
        """Before a generate: the cache and buffers for min(max_batch, n_rows) rows, the sampling settings in
        place, the engine's generator seeded from `generator`. Returns (rows at once, EOS ids, info)."""
        moved = self._weights_moved()
        need = min(self.max_batch, n_rows)   # the KV cache holds the rows this call decodes at once
        if self.dec.cache is not None and self.dec.cache.shape[2] < need:
            self.release()   # a bigger cache: the graphs read the old one's addresses
        if self._state is None:
            self.dec.allocate(need)
            self._state = _State(need, self.max_seq_len, self.device)
        s = self._state
        temp = params.temperature if params.temperature > 0 else 1.0   # greedy may say T=0
        s.temp.fill_(temp)
        s.top_p.fill_(params.top_p)
        eos = tuple(params.eos_token_ids)
        if eos and eos not in self._eos:
            self._eos[eos] = torch.tensor(eos, device=self.device, dtype=torch.long)
        if generator is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        self._gen.manual_seed(seed)
        info = {"engine": "static", "cuda_graphs": self.cuda_graphs, "backend": self.dec.backend.name,
                "capture_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "chunks": 0, "seed": seed,
                "graphs_dropped": moved, "captures": 0, "row_steps": 0, "compactions": 0, "spans": 0}
        if self.time_steps:
            info["step_ms"] = []
        return need, eos, info

    @torch.no_grad()
    def generate_turns(self, prompts: list[list[int]], params: SamplingParams, generator: Optional[torch.Generator],
                       driver) -> dict:
        """Episodes of several turns (edgerl/rollout/episodes.py) without computing a conversation twice: each
        row's KV cache is kept between its turns and what follows a turn is prefilled into it
        (turns_static.py)."""
        from .turns_static import run_turns
        out = run_turns(self, prompts, params, generator, driver)
        self.dec.check_cache()
        return out

    def _generate_chunk(self, chunk: list[list[int]], mode: _Mode, max_new: int, info: dict):
        # Module projections may be the training model's own LoRA layers: their dropout must not act
        # while generating (nor be baked into a captured graph).
        was_training = self.model.training
        self.model.eval()
        try:
            if self.device.type == "cuda":   # streams, events and capture follow the current device
                with torch.cuda.device(self.device):
                    return self._run_chunk(chunk, mode, max_new, info)
            return self._run_chunk(chunk, mode, max_new, info)
        finally:
            self.model.train(was_training)

    def _run_chunk(self, chunk: list[list[int]], mode: _Mode, max_new: int, info: dict):
        s, B, cuda = self._state, mode.rows, self.device.type == "cuda"
        width = max(len(p) for p in chunk)
        mode = replace(mode, span=self._span(width))   # decode step 1 writes column width
        graph = self._captured(mode, info) if self.cuda_graphs else None

        t0 = time.perf_counter()
        ids = torch.full((B, width), mode.pad, dtype=torch.long)
        for i, p in enumerate(chunk):   # left padding: every prompt ends at column width - 1
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        s.start[:B].copy_(torch.tensor([width - len(p) for p in chunk], dtype=torch.long))
        s.orig[:B].copy_(torch.arange(B))
        s.done.fill_(False)
        s.step.zero_()
        logits = self._prefill(chunk, ids, width, B)
        self._emit(logits, mode)            # response token 0 comes from the prompt's last column
        s.col.fill_(width)
        if cuda:
            torch.cuda.synchronize(self.device)
        info["prefill_s"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        steps = 1
        order = list(range(B))     # the chunk row each decoding row is
        saved: dict[int, tuple[list[int], list[float]]] = {}   # rows dropped when they finished
        pending: deque = deque()   # (pinned flags, event): read one check late so the GPU queue never drains
        clock = StepClock(cuda) if self.time_steps else None
        if clock:
            clock.mark()
        for t in range(1, max_new):
            if width + t - 1 >= mode.span:   # this step writes column width + t - 1: a wider span
                mode = replace(mode, span=self._span(width + t - 1))
                graph = self._captured(mode, info) if self.cuda_graphs else None
                info["spans"] += 1
            if graph is not None:
                graph.replay()
            else:
                self._step(mode)
            if clock:
                clock.mark()
            steps = t + 1
            info["row_steps"] += mode.rows
            flags = None
            if mode.eos and not cuda:      # on the CPU the look costs nothing: every step
                flags = s.done[:mode.rows].tolist()
            elif mode.eos and steps % CHECK_EVERY == 0:
                buf = torch.empty(mode.rows, dtype=torch.bool, pin_memory=True)
                buf.copy_(s.done[:mode.rows], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                pending.append((buf, ev))
                if len(pending) > 1:
                    old, old_ev = pending.popleft()
                    old_ev.synchronize()
                    flags = old.tolist()
            if flags is None:
                continue
            if all(flags):
                break
            live = [r for r, f in enumerate(flags) if not f]
            if self.drop_finished and len(live) <= DROP_AT * mode.rows:
                mode, order = self._drop(mode, live, order, steps, width, saved, info)
                graph = self._captured(mode, info) if self.cuda_graphs else None
                pending.clear()   # their flags are of the rows before the move
        if clock:
            info["step_ms"] += clock.ms()
        toks = s.out_tok[:mode.rows, :steps].tolist()
        lps = s.out_logp[:mode.rows, :steps].tolist()
        for r, k in enumerate(order):
            saved[k] = (toks[r], lps[r])
        info["decode_s"] += time.perf_counter() - t0
        info["decode_steps"] += steps - 1
        return [saved[k][0] for k in range(B)], [saved[k][1] for k in range(B)]

    def _span(self, col: int) -> int:
        """The span of a step writing cache column `col` (the whole cache where the backend reads no span)."""
        return span_for(col, self.dec.cache_len, self.span_step) if self.span_step else self.dec.cache_len

    def _captured(self, mode: _Mode, info: dict) -> torch.cuda.CUDAGraph:
        fresh = mode not in self._graphs
        if fresh:   # the steps queued before it are decode time, not the capture's (a capture waits for them)
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        graph = self._graph(mode)
        if fresh:
            torch.cuda.synchronize(self.device)
            info["capture_s"] += time.perf_counter() - t0
            info["captures"] += 1
        return graph

    def _drop(self, mode: _Mode, live: list[int], order: list[int], steps: int, width: int,
              saved: dict, info: dict) -> tuple[_Mode, list[int]]:
        """Keep decoding rows `live` only: the others finished, so their tokens so far are their responses
        (they would only emit padding from here). The live rows move to the front of the KV cache and state,
        in order; the next steps decode `len(live)` rows. Returns the new mode and row order."""
        s, n = self._state, len(live)
        dead = [r for r in range(mode.rows) if r not in set(live)]
        toks, lps = s.out_tok[dead, :steps].tolist(), s.out_logp[dead, :steps].tolist()
        for r, tk, lp in zip(dead, toks, lps):
            saved[order[r]] = (tk, lp)
        src = torch.tensor(live, device=self.device)
        for t in (s.tok, s.start, s.done, s.orig):
            t[:n] = t[src]
        s.out_tok[:n, :steps] = s.out_tok[src, :steps]
        s.out_logp[:n, :steps] = s.out_logp[src, :steps]
        self.dec.copy_rows(live, list(range(n)), min(self.dec.cache_len, width + steps))
        info["compactions"] += 1
        return replace(mode, rows=n), [order[r] for r in live]


def span_step(cache_len: int, graphs: bool) -> int:
    """Columns a span grows by: 16 for eager steps (no capture to pay for); under CUDA graphs the cache cut into
    equal spans of at least SPAN_MIN columns, at most SPANS of them (a cache under 2 x SPAN_MIN columns is one
    span), each a multiple of 16 (the cache's alignment)."""
    if not graphs:
        return 16
    n = min(SPANS, max(1, cache_len // SPAN_MIN))
    return -(-cache_len // (n * 16)) * 16


def span_for(col: int, cache_len: int, step: int) -> int:
    """The cache columns a step writing column `col` attends over: the first multiple of `step` above col,
    at most the whole cache (a multiple of 16)."""
    return min(cache_len, (col // step + 1) * step)


class StepClock:
    """Decode-step times: CUDA events on the GPU (device time between steps, recorded without a host
    sync, so the queue keeps running ahead), wall time on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def _check(prompts: list[list[int]], n_samples: int, params: SamplingParams, max_seq_len: int) -> None:
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not params.greedy:
        if params.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0 when sampling, got {params.temperature}; "
                             "set greedy=True for argmax decoding")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
        if params.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {params.top_k}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(p) + params.max_new_tokens > max_seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens + max_new_tokens {params.max_new_tokens} > "
                             f"the engine's max_seq_len {max_seq_len}; build the engine with max_seq_len >= "
                             "prompt length + response length, or shorten the prompt")
