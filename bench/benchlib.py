"""Shared pieces of the benchmarks (bench_vs_trl, bench_memory, bench_multi).

- Random-weight llama folders written straight to safetensors, one tensor at a time (a 14B shape
  takes as long as writing its bytes, not building the model), with config.json and the tokenizer;
  reused while their shape, dtype and seed match.
- edgerl runs through the library entry point (`session.load` -> `session.prepare` -> `Trainer`),
  each in its own process with a time limit; under torchrun every rank writes its own result.
- Device memory outside torch's allocator (CUDA context, library handles) measured with NVML:
  the GPU's used bytes before this process touched CUDA and after, less torch's reserved bytes.
- Results kept in one JSON file, rewritten atomically after every run, merged with an earlier
  file of the same name (so a benchmark can be run in pieces with --only).

    python bench/benchlib.py build SHAPE TOKENIZER OUT [DTYPE]     # one model folder
    python bench/benchlib.py ensure WORK TOKENIZER SHAPE            # WORK/models/SHAPE-bf16 unless it is there
    python bench/benchlib.py edgerl SPEC.json                        # one edgerl run (a child)
    python bench/benchlib.py statuses RESULT.json                    # "ok (N runs)", or the first run that failed
    python bench/benchlib.py drop-from-wheel WHEEL OUTDIR PREFIX...  # the wheel without the files under PREFIX
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
# (hidden, layers, heads, KV heads, MLP, tied embeddings); the vocabulary is the tokenizer's
SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "362m": (960, 32, 15, 5, 2560, True),         # SmolLM2-360M (edgerl.plan.modelspec.CATALOGUE)
    "1.7b": (2048, 24, 32, 32, 8192, True),       # SmolLM2-1.7B
    "1.5b": (1536, 28, 12, 2, 8960, True),        # Qwen2.5-1.5B widths (llama layers: no q/k/v bias)
    "qwen7b": (3584, 28, 28, 4, 18944, False),    # Qwen2.5-7B widths (llama layers: no q/k/v bias)
    "llama8b": (4096, 32, 32, 8, 14336, False),   # Llama-3.1-8B widths
    "qwen14b": (5120, 48, 40, 8, 13824, False),   # Qwen2.5-14B widths
    "tiny": (64, 2, 4, 2, 128, True),
    "tiny-q": (128, 2, 4, 2, 256, False),         # widths multiples of 64: bitsandbytes' CPU NF4 kernel needs it
}
# deeper SmolLM2-1.7B shapes: bench_multi looks among them for one that fits two P40s and not one
SHAPES.update({f"1.7b-l{n}": (2048, n, 32, 32, 8192, True) for n in (28, 32, 36, 40, 44, 48)})
SHAPES.update({f"small-l{n}": (256, n, 4, 2, 1024, True) for n in (4, 8, 16)})   # its --smoke stand-ins
STD = 0.02   # HF's initializer_range; norms are ones
FORMAT = 3   # bumped when build_model writes something else: older folders are rebuilt (3: a 32K context)
DTYPES = {"bf16": ("BF16", "bfloat16"), "fp16": ("F16", "float16"), "fp32": ("F32", "float32")}


def default_tokenizer() -> str:
    shared = Path(os.environ.get("EDGERL_SHARED", REPO.parent / "shared"))
    return str(shared / "data" / "smollm2-tokenizer")


def catalogue_check() -> None:
    """The 362m and 1.7b rows above are edgerl's catalogue shapes: fail loudly if the catalogue moved."""
    from edgerl.plan.modelspec import CATALOGUE
    for name, key in (("362m", "smollm2-360m"), ("1.7b", "smollm2-1.7b")):
        m = CATALOGUE[key]
        got = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size, m.tie_embeddings)
        if got != SHAPES[name]:
            raise SystemExit(f"bench shape {name} {SHAPES[name]} differs from edgerl's catalogue {key} {got}")


def n_params(shape: str, vocab: int = 49152) -> int:
    h, layers, heads, kv, mlp, tie = SHAPES[shape]
    hd = h // heads
    layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * mlp + 2 * h
    return vocab * h * (1 if tie else 2) + layers * layer + h


# ------------------------------------------------------------------------------------- model folders

def tensor_shapes(shape: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of transformers' LlamaForCausalLM with this shape."""
    h, layers, heads, kv, mlp, tie = SHAPES[shape]
    hd = h // heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
                (p + "mlp.gate_proj.weight", (mlp, h)), (p + "mlp.up_proj.weight", (mlp, h)),
                (p + "mlp.down_proj.weight", (h, mlp)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not tie:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def _write_safetensors(path: Path, items: list[tuple[str, tuple[int, ...]]], st_dtype: str, elt: int,
                       make: Callable[[str, tuple[int, ...]], Any]) -> None:
    """A safetensors file written tensor by tensor: header first (offsets known from the shapes), then
    each tensor's bytes as `make` produces them (a buffer: numpy array, bytes). Only one tensor is in
    memory at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shp in items:
        n = elt
        for d in shp:
            n *= d
        header[name] = {"dtype": st_dtype, "shape": list(shp), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for name, shp in items:
            data = memoryview(make(name, shp)).cast("B")
            if data.nbytes != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise RuntimeError(f"{name}: {data.nbytes} bytes, expected {header[name]['data_offsets']}")
            fh.write(data)


def _new_folder(out: Path, dtype: str) -> tuple[Any, int, Path]:
    """The torch dtype and element size of `dtype`, and an empty temporary folder beside `out` (renamed to
    `out` once complete)."""
    import torch
    tdtype = getattr(torch, DTYPES[dtype][1])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tdtype, torch.tensor([], dtype=tdtype).element_size(), tmp


def _random_tensors(tdtype: Any, elt: int, seed: int) -> Callable[[str, tuple[int, ...]], Any]:
    """`make(name, shape)` for _write_safetensors: normal(0, STD) matrices drawn on the GPU when there is one
    (seeded: the same bytes every time), ones for norm weights, zeros for biases."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[elt]

    def make(name: str, shp: tuple[int, ...]) -> Any:
        if len(shp) == 1:
            t = (torch.zeros if name.endswith("bias") else torch.ones)(shp, dtype=tdtype)
        else:
            t = torch.empty(shp, device=device, dtype=torch.float32).normal_(0.0, STD, generator=gen).to(tdtype).cpu()
        return t.contiguous().view(view).numpy()
    return make


def build_model(shape: str, tokenizer: str, out: Path, dtype: str = "bf16", seed: int = 0,
                shard_bytes: int = 4 * GiB) -> Path:
    """A random-weight llama folder: normal(0, 0.02) weights, unit norms, drawn on the GPU when there
    is one (seeded, so the same folder every time), written in `dtype`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig
    tok = AutoTokenizer.from_pretrained(tokenizer)
    vocab = len(tok)
    h, layers, heads, kv, mlp, tie = SHAPES[shape]
    st_dtype = DTYPES[dtype][0]
    tdtype, elt, tmp = _new_folder(out, dtype)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=tie,
                      max_position_embeddings=32768, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=STD)
    cfg.dtype = tdtype
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    make = _random_tensors(tdtype, elt, seed)
    items = tensor_shapes(shape, vocab)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shp in items:
        n = elt * int(torch.Size(shp).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shp))
        size += n
    weight_map = {}
    total = 0
    for k, part in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(tmp / fname, part, st_dtype, elt, make)
        for name, shp in part:
            weight_map[name] = fname
            total += elt * int(torch.Size(shp).numel())
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    check_model_folder(tmp, shape, vocab)
    (tmp / "bench-model.json").write_text(json.dumps({"format": FORMAT, "shape": shape, "shapes": SHAPES[shape],
                                                      "dtype": dtype, "seed": seed, "vocab": vocab, "bytes": total}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_model_from_config(hf_config: Any, tokenizer: str, out: Path, dtype: str = "bf16", seed: int = 0) -> Path:
    """A random-weight folder of any transformers causal LM from its config (real widths and vocabulary):
    the names and shapes of the model transformers builds on the meta device, normal(0, 0.02) matrices,
    unit norm weights, zero biases, drawn on the GPU when there is one, written in `dtype` tensor by tensor.
    The tokenizer may hold fewer tokens than the vocabulary (ids past it decode to nothing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer)
    st_dtype = DTYPES[dtype][0]
    tdtype, elt, tmp = _new_folder(out, dtype)
    hf_config.bos_token_id, hf_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    hf_config.pad_token_id = tok.pad_token_id
    hf_config.dtype = tdtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    hf_config.architectures = [type(model).__name__]
    items = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    if hf_config.tie_word_embeddings:
        items = [(k, shp) for k, shp in items if k != "lm_head.weight"]
    hf_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _write_safetensors(tmp / "model.safetensors", items, st_dtype, elt, _random_tensors(tdtype, elt, seed))
    total = sum(elt * int(torch.Size(shp).numel()) for _, shp in items)
    (tmp / "bench-model.json").write_text(json.dumps({"format": FORMAT, "shape": hf_config.model_type,
                                                      "dtype": dtype, "seed": seed, "bytes": total}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def check_model_folder(folder: Path, shape: str, vocab: int) -> None:
    """The written names and shapes are exactly those transformers builds for this config (the model is
    built on the meta device: no memory, no time)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    got = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                got[k] = tuple(fh.get_slice(k).get_shape())
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        bad = [k for k in set(want) & set(got) if want[k] != got[k]]
        raise RuntimeError(f"model folder {folder} does not match {type(model).__name__}: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}, wrong shapes {bad[:5]}")


def model_info(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "bench-model.json").read_text())


def ensure_model(work: Path, shape: str, tokenizer: str, dtype: str = "bf16", timeout: int = 300,
                 log: Callable[[str], None] = print) -> Path:
    """The model folder work/models/SHAPE-DTYPE, built in a subprocess (the caller keeps CUDA
    uninitialised) when missing; older model folders are deleted when the disk would not hold it."""
    models = work / "models"
    out = models / f"{shape}-{dtype}"
    if (out / "bench-model.json").exists() and model_info(out).get("shapes") == list(SHAPES[shape]) \
            and model_info(out).get("format") == FORMAT:
        return out
    models.mkdir(parents=True, exist_ok=True)
    need = n_params(shape) * (2 if dtype != "fp32" else 4) + 2 * GiB
    others = sorted((p for p in models.iterdir() if p.is_dir() and p != out), key=lambda p: p.stat().st_mtime)
    while shutil.disk_usage(models).free < need and others:
        victim = others.pop(0)
        log(f"deleting {victim} to make room for {out.name} ({need / GiB:.1f} GiB)")
        shutil.rmtree(victim, ignore_errors=True)
    start = time.time()
    status, rc, tail = run_logged([sys.executable, __file__, "build", shape, tokenizer, str(out), dtype],
                                  work / f"build-{shape}-{dtype}.log", timeout)
    if rc != 0 or not (out / "bench-model.json").exists():
        raise RuntimeError(f"building {shape} failed ({status}): {tail[-1500:]}")
    log(f"built {out} in {time.time() - start:.0f} s")
    return out


# ------------------------------------------------------------------------------------- processes

def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the child's process group, then SIGKILL if it has not ended after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


_CHILDREN: set = set()   # runs started from threads other than the main one


def stop_children(signum: int = signal.SIGTERM, _frame: Any = None) -> None:
    """A SIGTERM handler for the main thread of a benchmark that starts runs from other threads."""
    for proc in list(_CHILDREN):
        _stop_group(proc, grace=3.0)
    raise SystemExit(128 + signum)


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: Optional[dict[str, Optional[str]]] = None,
               grace: float = 10.0) -> tuple[str, Optional[int], str]:
    """Run `cmd` in its own process group, output to `log_path`; on timeout the whole group is
    stopped (SIGTERM, then SIGKILL after `grace` seconds: time for a checkpoint being written). A SIGTERM to this process (a stage's time limit) stops the group
    too before this process ends, so no run outlives the benchmark that started it. Returns (status,
    exit code or None, the last 3000 characters of the log). A None value in `env` removes that variable."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={k: v for k, v in merged.items() if v is not None})

        def on_term(signum, _frame):
            _stop_group(proc, grace=3.0)
            raise SystemExit(128 + signum)
        # only the main thread may set a handler; runs started from other threads (bench_long --parallel) are
        # stopped by their own time limit, and by the main thread's handler through their process groups
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, on_term) if main else None
        if not main:
            _CHILDREN.add(proc)
        try:
            rc: Optional[int] = proc.wait(timeout=max(1.0, timeout))
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            _stop_group(proc, grace)
            rc, status = None, f"timeout after {timeout:.0f} s"
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
            else:
                _CHILDREN.discard(proc)
    text = log_path.read_text(errors="replace")
    return status, rc, text[-3000:]


def failure_status(text: str, fallback: str) -> str:
    low = text.lower()
    if "out of memory" in low:
        return "out of memory"
    if "does not fit" in low:
        return "plan: does not fit"
    return fallback


class Clock:
    """Seconds left before a deadline, for runs that must end before the caller's time limit."""
    def __init__(self, budget_s: float):
        self.t0 = time.time()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


# ------------------------------------------------------------------------------------- results

class Results:
    """One JSON file: {"meta": ..., "runs": {name: record}}, rewritten atomically after each put.
    An existing file at the same path is read first, so runs of earlier invocations stay."""
    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = Path(path)
        self.data: dict[str, Any] = {"meta": {}, "runs": {}}
        if self.path.exists():
            try:
                old = json.loads(self.path.read_text())
                if isinstance(old, dict) and isinstance(old.get("runs"), dict):
                    self.data = old
            except ValueError:
                pass
        self.data["meta"] = {**self.data.get("meta", {}), **meta}
        self.save()

    @property
    def runs(self) -> dict[str, Any]:
        return self.data["runs"]

    def put(self, name: str, record: dict[str, Any]) -> None:
        self.runs[name] = record
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def add_run_args(ap: Any, budget_s: float, min_run_s: float, smoke: str, skip_done: bool = True) -> None:
    """The options every multi-run benchmark takes: its deadline, the least time a run may start with,
    the tokenizer, the work folder, --skip-done, --smoke (with this benchmark's `smoke` help) and --out.
    `min_run_s` is the default that `out_and_work` fills in."""
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help="deadline in seconds: no run starts after it, and each run's time limit ends by it")
    ap.add_argument("--min-run-s", type=float, default=None,
                    help=f"do not start a run with less time than this left (default {min_run_s:g}; smoke 5)")
    ap.add_argument("--tokenizer", default=default_tokenizer())
    ap.add_argument("--work", default=None, help="models, run folders and logs (default /tmp/edgerl-bench)")
    if skip_done:
        ap.add_argument("--skip-done", action="store_true", help="skip runs already ok in --out")
    ap.add_argument("--smoke", action="store_true", help=smoke)
    ap.add_argument("--out", default=None)


def out_and_work(args: Any, name: str, min_run_s: float) -> tuple[Path, Path]:
    """A benchmark's result file ($OUT/NAME[_smoke].json unless --out) and work folder (unless --work),
    and `args.min_run_s` defaulted (5 s in smoke mode)."""
    args.min_run_s = args.min_run_s if args.min_run_s is not None else (5 if args.smoke else min_run_s)
    smoke = "_smoke" if args.smoke else ""
    out = Path(args.out or os.path.join(os.environ.get("OUT", "."), f"{name}{smoke}.json"))
    work = Path(args.work or ("/tmp/edgerl-bench-smoke" if args.smoke else "/tmp/edgerl-bench"))
    return out, work


def med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: Any, spec: str = "{:.2f}", missing: str = "-") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return missing
    return spec.format(x)


def times(r: dict, peer: dict, key: str) -> str:
    """r's figure over a peer run's ("2.50x"), for a run that is not the peer's own; "-" where either is missing."""
    return f"{r[key] / peer[key]:.2f}x" if r is not peer and r.get(key) and peer.get(key) else "-"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- device memory

def _nvml_used() -> dict[str, int]:
    """Used bytes per GPU by UUID (NVML), or {} without NVML. Does not initialise CUDA."""
    try:
        import pynvml
        pynvml.nvmlInit()
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out[_uuid(uuid)] = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        return out
    except Exception:
        return {}


def process_used() -> Optional[int]:
    """Device memory NVML counts for this process (its CUDA context and everything torch reserved), or
    None where NVML cannot see it (no NVML, or a PID namespace that hides the process)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        pid = os.getpid()
        for i in range(pynvml.nvmlDeviceGetCount()):
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if p.pid == pid and p.usedGpuMemory:
                    return int(p.usedGpuMemory)
    except Exception:
        return None
    return None


def _uuid(s: str) -> str:
    return s.lower().removeprefix("gpu-").strip()


class DeviceMemory:
    """Device memory this process holds outside torch's allocator. Create it before CUDA is
    initialised: it records what the GPUs used before."""
    def __init__(self) -> None:
        self.before = _nvml_used()

    def outside_allocator(self, device: Any) -> dict[str, Any]:
        import torch
        if getattr(device, "type", "cpu") != "cuda":
            return {}
        torch.cuda.synchronize(device)
        uuid = _uuid(str(torch.cuda.get_device_properties(device).uuid))
        reserved = torch.cuda.memory_reserved(device)
        now = _nvml_used()
        if uuid in now and uuid in self.before:
            used, base, method = now[uuid], self.before[uuid], "nvml: used now - used before CUDA init - reserved"
        else:
            free, total = torch.cuda.mem_get_info(device)
            used, base, method = total - free, 0, "mem_get_info: used - reserved (no baseline: other processes count)"
        return {"outside_allocator_gib": (used - base - reserved) / GiB, "device_used_gib": (used - base) / GiB,
                "reserved_now_gib": reserved / GiB, "method": method}


# ------------------------------------------------------------------------------------- edgerl runs

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how rain forms, step by step.",
           "Describe a busy market in the morning.", "Give advice to someone learning to cook.",
           "Tell the history of the bicycle in a few paragraphs.", "Explain why the sky is blue.",
           "Write a letter to a friend about a trip to the mountains.", "Describe how a bridge is built."]


def reward(data_source=None, solution_str="", ground_truth=None, extra_info=None, **_):
    """Share of vowels among letters: defined for any text, varies between samples."""
    letters = [c for c in solution_str.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def task_sets(work: Path, steps: int, new_tokens: int = 256, prompts_per_step: int = 2, samples: int = 8,
              kl_coef: float = 0.04) -> list[str]:
    """The benchmark task as edgerl --set strings: `prompts_per_step` x `samples` completions of exactly
    `new_tokens` tokens (EOS ignored), GRPO with the reference KL term (k3, as TRL), no checkpoints."""
    data = work / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": p, "data_source": "bench"}) + "\n" for p in PROMPTS))
    return [f'data.path="{data}"', 'data.answer_key=""', "data.max_prompt_len=64",
            f'reward.function="{Path(__file__).resolve()}:reward"', f"train.prompts_per_step={prompts_per_step}",
            f"rollout.n_samples={samples}", f"rollout.max_new_tokens={new_tokens}", "rollout.stop_at_eos=false",
            f"train.steps={steps}", f"algo.kl_coef={kl_coef}", 'algo.advantage="grpo"', "train.lr=1e-6",
            "run.save_every=0", "run.export_final=false", "run.tensorboard=false"]


def edgerl_spec(model: Path, sets: list[str], run_dir: Path, out: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "sets": [f'model.path="{model}"', *sets], "run_dir": str(run_dir),
            "out": str(out), **extra}


class _PhasePeaks:
    """Mixed into Trainer for bench_memory: the peak allocated and reserved bytes of each phase
    (rollout, score, update, and everything between them), read and reset at each boundary, and the
    bytes allocated when each phase began (resident across it: the peak less these is its transient)."""
    phase_peaks: list[dict[str, float]]

    def _mark(self, name: str) -> None:
        import torch
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        row = self.phase_peaks[-1] if self.phase_peaks else None
        if row is None or row.get("_step") != self.state.loop.step:
            row = {"_step": self.state.loop.step}
            self.phase_peaks.append(row)
        alloc = torch.cuda.max_memory_allocated(self.device) / GiB
        res = torch.cuda.max_memory_reserved(self.device) / GiB
        row[f"{name}_alloc"] = max(row.get(f"{name}_alloc", 0.0), alloc)
        row[f"{name}_reserved"] = max(row.get(f"{name}_reserved", 0.0), res)
        if name != "other":   # what was allocated when the phase began: its resident bytes (the rest is transient)
            row[f"{name}_start"] = max(row.get(f"{name}_start", 0.0), getattr(self, "_phase_start", 0.0))
        self._phase_start = torch.cuda.memory_allocated(self.device) / GiB
        torch.cuda.reset_peak_memory_stats(self.device)
        if getattr(self, "phase_file", None):   # kept when the run is stopped (timeout) before its result is
            from edgerl.core.files import write_atomically
            write_atomically(self.phase_file, json.dumps(self.phase_peaks))

    def rollout(self, *args, **kwargs):
        self._mark("other")
        out = super().rollout(*args, **kwargs)
        self._mark("rollout")
        return out

    def score(self, *args, **kwargs):
        self._mark("other")
        out = super().score(*args, **kwargs)
        self._mark("score")
        return out

    def update(self, *args, **kwargs):
        self._mark("other")
        out = super().update(*args, **kwargs)
        self._mark("update")
        return out

    def step_once(self):
        out = super().step_once()
        self._mark("other")   # the weight sync and the metrics, before the next step resets the peaks
        return out


def edgerl_child(spec_path: str) -> None:
    """One edgerl run as `edgerl train` makes it, from a JSON spec; writes the result JSON (rank r > 0
    writes OUT.rank{r}.json) and exits 1 when the run failed, so that torchrun stops the other ranks
    instead of leaving them waiting in a collective. Metrics rows land in the run folder as it goes."""
    spec = json.loads(Path(spec_path).read_text())
    mem = DeviceMemory()   # before CUDA is touched
    rank = int(os.environ.get("RANK", "0"))
    if spec.get("cpu_ranks_on_device_0") and "LOCAL_RANK" in os.environ:
        # edgerl (at 69b8d10) refuses LOCAL_RANK > 0 when torch sees no GPU, even with --profile cpu;
        # on the CPU every rank runs on "device 0" anyway (the gloo smoke runs only)
        os.environ["LOCAL_RANK"] = "0"
    out = Path(spec["out"]) if rank == 0 else Path(f"{spec['out']}.rank{rank}.json")
    res: dict[str, Any] = {"rank": rank}
    start = time.time()
    try:
        import torch
        if spec.get("deterministic"):
            torch.use_deterministic_algorithms(True, warn_only=True)
        if spec.get("tf32"):   # bench_long --tf32: a faster fp32 update on the H200, the same memory
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        from edgerl.train import session
        from edgerl.train.trainer import Trainer
        resume = Path(spec["resume"]) if spec.get("resume") else None
        config = Path(spec["config"]) if spec.get("config") else None   # a TOML (bench_recipes), --set on top
        cfg, point = session.load(config, spec["sets"], resume, Path(spec["run_dir"]))
        logs: list[str] = []
        s = session.prepare(cfg, point, log=logs.append)
        res["emulation"] = s.emulation
        if spec.get("uncapped") and s.device.type == "cuda":
            # plan.memory_gib caps the allocator (session._device_for); a run that measures what the plan's
            # steps need lifts the cap again, or the reserved peak would be the cap's, not the step's
            torch.cuda.set_per_process_memory_fraction(1.0, s.device)
            res["emulation"] = "uncapped (the plan's budget is planned for, not enforced)"
        res["context_after_init"] = mem.outside_allocator(s.device)
        cls = type("PhasePeaksTrainer", (_PhasePeaks, Trainer), {}) if spec.get("phase_peaks") else Trainer
        t = cls(s)
        t.phase_peaks = []
        t.phase_file = Path(f"{out}.phases.json")
        res["engine"] = t.engine.describe()
        res["setup_s"] = time.time() - start
        rows: list[dict[str, Any]] = []

        def on_step(step: int, stats: dict[str, Any]) -> None:
            rows.append({"step": step, **{k: v for k, v in stats.items() if isinstance(v, (int, float, str))}})
            if t.device.type == "cuda" and step == 1:
                res["context_after_step1"] = mem.outside_allocator(t.device)
        t.run(on_step)
        res["memory_end"] = mem.outside_allocator(t.device)
        if t.device.type == "cuda":   # this process alone (several runs may share the GPU)
            import torch
            used = process_used()
            res["process_used_end_gib"] = used / GiB if used is not None else None
            res["process_reserved_end_gib"] = torch.cuda.memory_reserved(t.device) / GiB
        # a SIGTERM (the bench's time limit) ends the run after the step in flight, with a checkpoint and no
        # error: a stopped run, not a finished one
        stopped = f"stopped by {t.stop_signal} after {len(rows)} step(s)" if t.stop_signal else None
        res.update(status=stopped or "ok", rows=rows, phase_peaks=t.phase_peaks, logs=logs[-40:])
    except BaseException as e:  # noqa: BLE001 - the parent reports it; OOM is an expected outcome
        import traceback
        text = f"{type(e).__name__}: {e}"
        res.update(status=failure_status(text, "error"), error=text[:1500], trace=traceback.format_exc()[-3000:])
    res["wall_s"] = time.time() - start
    out.write_text(json.dumps(res, default=str))
    if res["status"] != "ok":
        sys.exit(1)


def read_run_folder(run_dir: Path) -> dict[str, Any]:
    """plan.json and metrics.jsonl of a run folder (what is there, even after a crash or timeout)."""
    out: dict[str, Any] = {}
    if (run_dir / "plan.json").exists():
        out["plan_json"] = json.loads((run_dir / "plan.json").read_text())
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    out["rows"] = rows
    return out


def run_status(logged: str, child: str, steps: int, asked: Optional[int] = None,
               last: Optional[int] = None) -> str:
    """A run's status from the parent's (`logged`: run_logged's) and the child's own, given the steps this run
    did, the number of its last step (a resumed run starts after 1) and train.steps. A run the time limit's
    SIGTERM stopped ends cleanly after the step in flight: it is reported as stopped at the limit, never as
    "ok", unless that step was its last. One the SIGKILL ended (it wrote no status of its own) after its last
    step had finished, while it saved or shut down, is reported so: its steps are whole, its last checkpoint may
    not be."""
    final = steps if last is None else last   # the number of its last step
    done = asked is not None and final >= asked
    if logged.startswith("timeout") and child.startswith(("stopped by", "ok")):
        if done:
            return "ok"   # the signal came during the last step, which finished
        return f"{logged}: stopped after {steps} step(s)"
    if logged.startswith("timeout") and child == logged and done:
        return f"{logged}: killed after its last step ({final} of {asked})"
    if child != "ok" and steps and "step(s)" not in child:
        return f"{child} after {steps} step(s)"
    return child


def run_edgerl(name: str, spec: dict[str, Any], work: Path, timeout: float, nproc: int = 1,
               env: Optional[dict[str, str]] = None, grace: float = 10.0) -> dict[str, Any]:
    """An edgerl run in a subprocess (torchrun with `nproc` > 1); its summary. `grace`: seconds between the
    SIGTERM at the time limit and the SIGKILL."""
    spec_path = work / f"{name}.spec.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    Path(spec["out"]).unlink(missing_ok=True)
    Path(f"{spec['out']}.phases.json").unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "edgerl", str(spec_path)]
    else:
        cmd = [sys.executable, __file__, "edgerl", str(spec_path)]
    status, rc, tail = run_logged(cmd, work / f"{name}.log", timeout, env, grace)
    outp = Path(spec["out"])
    res: dict[str, Any] = json.loads(outp.read_text()) if outp.exists() else {}
    folder = read_run_folder(Path(spec["run_dir"]))
    if not res:
        res = {"status": failure_status(tail, status if status != "ok" else "crashed"), "error": tail[-1500:]}
    phases = Path(f"{spec['out']}.phases.json")
    if spec.get("phase_peaks") and not res.get("phase_peaks") and phases.exists():
        res["phase_peaks"] = json.loads(phases.read_text())   # the phases a run stopped or failed had finished
    if not res.get("rows"):   # steps done before a timeout or crash: this call's (a resumed run's folder holds more)
        res["rows"] = [r for r in folder["rows"] if r.get("step", 0) > spec.get("resumed_after", 0)]
    asked = [int(x.split("=", 1)[1]) for x in spec["sets"] if x.startswith("train.steps=")]
    res["status"] = run_status(status, res["status"], len(res["rows"]), asked[-1] if asked else None,
                               max((r.get("step", 0) for r in res["rows"]), default=0))
    res["ranks"] = [json.loads(Path(f"{spec['out']}.rank{r}.json").read_text())
                    for r in range(1, nproc) if Path(f"{spec['out']}.rank{r}.json").exists()]
    res["log"] = str(work / f"{name}.log")
    profiled = [int(x.split("=", 1)[1]) for x in spec["sets"] if x.startswith("run.profile_step=")]
    return summarise_edgerl(res, folder.get("plan_json"), profiled[-1] if profiled else 0)


PLAN_KEYS = ("dtype", "attention", "kernel_backend", "optimizer", "lora", "base_dtype", "grad_checkpointing",
             "swap_models", "optimizer_offload", "param_offload", "micro_batch", "score_micro_batch",
             "rollout_batch", "rollout_engine", "decode_backend")


def summarise_edgerl(res: dict[str, Any], plan_json: Optional[dict[str, Any]], profiled: int = 0) -> dict[str, Any]:
    """Medians over steps 2..N (less the step `profiled`, which torch's profiler slows), peaks over all
    steps, the plan's estimate and its error."""
    rows = res.pop("rows", []) or []
    out = {k: v for k, v in res.items() if k not in ("logs",)}
    out["steps_done"] = len(rows)
    out["step_s"] = [r.get("perf/step_s") for r in rows]
    out["rollout_s_steps"] = [r.get("time/rollout_s") for r in rows]   # beside out["metrics"], row for row
    timed = [r for i, r in enumerate(rows[1:], start=2) if i != profiled] or rows[1:] or rows
    if profiled:
        out["profiled_step"] = f"step {profiled}: left out of the medians (the profiler slows it)"
    if rows:
        tokens = [r.get("response/length_mean", 0) * r.get("batch/sequences", 0) for r in timed]
        out["sequences_per_step"] = rows[-1].get("batch/sequences")
        out["response_length_mean"] = med([r.get("response/length_mean") for r in timed])
        out["median_step_s"] = med([r.get("perf/step_s") for r in timed])
        for key in ("rollout", "reward", "score", "update", "sync"):
            out[f"median_{key}_s"] = med([r.get(f"time/{key}_s") for r in timed])
        if out["median_step_s"]:
            out["tokens_per_s"] = med(tokens) / out["median_step_s"]
        for key in ("peak_allocated", "peak_reserved", "host_rss"):
            out[f"{key}_gib"] = max((r[f"memory/{key}_gib"] for r in rows if f"memory/{key}_gib" in r), default=None)
        out["metrics"] = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))}
                          for r in rows]
        out["world_size"] = rows[-1].get("dist/world_size", 1)
    peaks = res.get("phase_peaks") or []
    if peaks:   # bench_memory's per-phase peaks replace the step-level ones (reset at each phase)
        keys = {k for row in peaks for k in row if k != "_step"}
        out["phase_alloc_gib"] = {k[:-6]: max(r.get(k, 0.0) for r in peaks) for k in keys if k.endswith("_alloc")}
        out["phase_reserved_gib"] = {k[:-9]: max(r.get(k, 0.0) for r in peaks) for k in keys
                                     if k.endswith("_reserved")}
        out["phase_start_gib"] = {k[:-6]: max(r.get(k, 0.0) for r in peaks) for k in keys if k.endswith("_start")}
        out["peak_allocated_gib"] = max(out["phase_alloc_gib"].values())
        out["peak_reserved_gib"] = max(out["phase_reserved_gib"].values())
    if plan_json:
        mem = plan_json["memory"]
        out["estimate_gib"] = mem["total_bytes"] / GiB
        out["estimate_peak_phase"] = mem["peak_phase"]
        out["estimate_phases_gib"] = {k: v / GiB for k, v in mem["phases"].items()}
        out["estimate_components_gib"] = {k: v / GiB for k, v in mem["components"].items()}
        out["estimate_context_gib"] = mem["components"].get("CUDA context", 0) / GiB   # 0 on the CPU
        out["budget_gib"] = mem["budget_bytes"] / GiB
        out["model_params"] = plan_json["model"]["n_params"]
        out["plan"] = {k: plan_json["plan"].get(k) for k in PLAN_KEYS}
        out["effective_batch"] = plan_json.get("effective_batch")
    ctx = (res.get("memory_end") or res.get("context_after_step1") or {}).get("outside_allocator_gib")
    if res.get("process_used_end_gib") is not None and res.get("process_reserved_end_gib") is not None:
        ctx = own_context_gib(res)[0]   # this process's own figure: the device's counts other runs sharing it
    out["outside_allocator_gib"] = ctx
    if out.get("peak_reserved_gib") and out.get("estimate_gib"):
        from edgerl.plan.memory import DEFAULT_CALIBRATION
        extra = ctx if ctx is not None else DEFAULT_CALIBRATION.cuda_context / GiB
        out["measured_gib"] = out["peak_reserved_gib"] + extra
        out["estimate_error"] = out["estimate_gib"] / out["measured_gib"] - 1
    return out


def run_each(names: list[str], run: Callable[[str], None], parallel: bool,
             sizes: Optional[dict[str, int]] = None, capacity: Optional[int] = None, stagger: float = 2.0) -> None:
    """run(name) for each name: one after another, or at once in threads (each run is its own process under
    its own cap), started `stagger` seconds apart so that their model loads do not all hit the disk together;
    SIGTERM stops the children. With `sizes` (bytes a run may take: its cap) and `capacity` (the device's), a
    run starts only once the runs going and it fit in the capacity together, in order (one larger than it runs
    alone)."""
    if not parallel:
        for name in names:
            run(name)
        return
    signal.signal(signal.SIGTERM, stop_children)
    cond, used = threading.Condition(), [0]
    need = {n: (sizes or {}).get(n, 0) if capacity else 0 for n in names}

    def go(name: str) -> None:
        try:
            run(name)
        finally:
            with cond:
                used[0] -= need[name]
                cond.notify_all()
    threads = []
    for name in names:
        with cond:
            cond.wait_for(lambda: used[0] == 0 or used[0] + need[name] <= (capacity or 0))
            used[0] += need[name]
        t = threading.Thread(target=go, args=(name,))
        t.start()
        threads.append(t)
        time.sleep(stagger)
    for t in threads:
        t.join()


def memory_columns(res: dict[str, Any]) -> dict[str, Any]:
    """A summarised run's memory against its estimate: measured = the allocator's peak allocated bytes over
    the phases + the process's memory outside the allocator (own_context_gib); reserved = its peak reserved
    bytes (its cache included) + the same; error = estimate / measured - 1."""
    ctx, source = own_context_gib(res)
    alloc, reserved, est = res.get("peak_allocated_gib"), res.get("peak_reserved_gib"), res.get("estimate_gib")
    measured = alloc + ctx if alloc is not None and ctx is not None else None
    return {"measured_gib": measured, "reserved_gib": reserved + ctx if reserved is not None and ctx is not None
            else None, "context_gib": ctx, "context_source": source, "estimate_gib": est,
            "error": (est / measured - 1) if est and measured else None}


def memory_table(records: list[dict[str, Any]], name_key: str) -> str:
    """The markdown table of runs summarised with memory_columns: time, memory against the estimate."""
    return table(["run", "status", "steps", "s/step", "tok/s", "measured GiB", "reserved GiB", "estimate GiB",
                  "est. peak", "error"],
                 [[r[name_key], str(r["status"])[:40], r.get("steps", "-"), fmt(r.get("median_step_s")),
                   fmt(r.get("tokens_per_s"), "{:.0f}"), fmt(r.get("measured_gib")), fmt(r.get("reserved_gib")),
                   fmt(r.get("estimate_gib")), str(r.get("estimate_peak_phase") or "-"), fmt(r.get("error"), "{:+.1%}")]
                  for r in records])


def memory_line(name: str, row: dict[str, Any]) -> str:
    """One run of memory_table as a log line, with its error message when it failed."""
    return (f"{name}: {row['status']} {row.get('steps', '-')} steps; median {fmt(row.get('median_step_s'))} s/step; "
            f"measured {fmt(row.get('measured_gib'))} GiB, estimate {fmt(row.get('estimate_gib'))} GiB "
            f"({row.get('estimate_peak_phase') or '-'}), error {fmt(row.get('error'), '{:+.1%}')}"
            + (f"; {str(row.get('message', ''))[:300]}" if row["status"] != "ok" else ""))


def finish_memory_runs(results: "Results", names: list[str], name_key: str, out: Path,
                       clock: "Clock") -> None:
    """The memory_table of the runs done, saved into the results file and printed."""
    text = memory_table([results.runs[k] for k in names if k in results.runs], name_key)
    results.data["table"] = text
    results.save()
    print(text)
    print(f"wrote {out} ({clock.elapsed():.0f} s)")


def own_context_gib(res: dict[str, Any]) -> tuple[Optional[float], str]:
    """This process's memory outside torch's allocator (its CUDA context and libraries): NVML's figure for the
    process less what its allocator had reserved, read together at the end of the run; else the plan's
    constant for it (a run stopped before its end). Not the device's used memory less the allocator's, which
    counts every other process on a shared GPU."""
    used, reserved = res.get("process_used_end_gib"), res.get("process_reserved_end_gib")
    if used is not None and reserved is not None:
        return used - reserved, "NVML, this process"
    if res.get("estimate_context_gib") is not None:
        return res["estimate_context_gib"], "the plan's constant"
    return None, "unknown"


def device_name() -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return (name.decode() if isinstance(name, bytes) else name).removeprefix("NVIDIA ")
    except Exception:
        return "CPU"


def malloc_meter() -> Optional[Callable[[], int]]:
    """A function giving glibc's bytes in use now (mallinfo2), or None where it is missing: torch's CPU
    allocator takes every tensor from malloc, so the in-use bytes follow the live tensors."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return None

    def used() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd
    return used


def peak_in_use(fn: Callable[[], Any], used: Callable[[], int]) -> int:
    """The most bytes in use (`used`, e.g. malloc_meter()) above the start while `fn` runs, read after every
    aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.base, self.peak = used(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, used() - self.base)
            return out
    with Peak() as p:
        fn()
    return p.peak


def device_bytes() -> Optional[int]:
    """GPU 0's memory less 2% (NVML, without starting CUDA in this process), or None without a GPU."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return int(0.98 * pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:
        return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "edgerl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def run_statuses(path: Path) -> str:
    """One line for a bench's result JSON: "ok (N runs)" when every run in it ended ok, else the first run that
    did not, with its status (a shell loop stops on it)."""
    if not path.exists():
        return f"no result file {path}"
    runs = json.loads(path.read_text()).get("runs") or {}
    if not runs:
        return f"no run in {path}"
    for name, row in runs.items():
        if not str(row.get("status", "")).startswith("ok"):
            return f"{name}: {row.get('status')}"
    return f"ok ({len(runs)} runs)"


def drop_from_wheel(wheel: Path, out: Path, prefixes: list[str]) -> str:
    """A copy of `wheel` in folder `out` without the files under `prefixes` (and their RECORD lines): Unsloth's wheel
    carries its Studio web UI (studio/, 25 MiB of its 27), which the library never imports, and a GPU call carries
    64 MiB in all. Everything else is copied byte for byte."""
    import zipfile
    out.mkdir(parents=True, exist_ok=True)
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out / wheel.name, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(tuple(prefixes)):
                dropped += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(ln for ln in data.splitlines(keepends=True)
                                if not ln.decode().startswith(tuple(prefixes)))
            dst.writestr(info, data)
    return f"{out / wheel.name}: {dropped} files under {', '.join(prefixes)} left out"


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "build":
        shape, tokenizer, out = sys.argv[2:5]
        dtype = sys.argv[5] if len(sys.argv) > 5 else "bf16"
        build_model(shape, tokenizer, Path(out), dtype)
    elif cmd == "ensure":
        work, tokenizer, shape = sys.argv[2:5]
        ensure_model(Path(work), shape, tokenizer, timeout=900)
    elif cmd == "edgerl":
        edgerl_child(sys.argv[2])
    elif cmd == "statuses":
        print(run_statuses(Path(sys.argv[2])))
    elif cmd == "drop-from-wheel":
        print(drop_from_wheel(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
