"""Peak memory and time of one forward + backward of token log-probs and entropy on the torch path (the one
Pascal, Volta and Turing run), 16-bit inputs, with the LM head frozen (LoRA) and trained (full fine-tuning).

    python bench/bench_logprob_memory.py [--tokens 1024] [--vocab 151936] [--hidden 2048] [--chunk 128]
        [--dtype bf16|fp16] [--tree CHECKOUT] [--out FILE]

--tree imports the kernels (edgerl/kernels/, or gpu_kernels/ in older checkouts) from another checkout (e.g. `git worktree add /tmp/old REV`), to compare two
versions of the path in one way. Memory: on the CPU glibc's bytes in use (mallinfo2), read after every aten
op, above what was in use before (the inputs); on a GPU torch.cuda.max_memory_allocated above the inputs.
Gradients count in both (the second call of each measures them allocated anew: its first call's gradients
are dropped). Time: wall seconds of the second call (CPU) or CUDA-synchronised (GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

REPO = bl.REPO


def measure(fn, device) -> tuple[int, float]:
    """(peak bytes above the start, seconds) of fn()."""
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0
    used = bl.malloc_meter()
    if used is None:
        raise SystemExit("bench_logprob_memory: needs glibc's mallinfo2 on the CPU")
    t0 = time.perf_counter()
    peak = bl.peak_in_use(fn, used)
    return peak, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose kernels to import")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.tokens, args.vocab, args.hidden, args.chunk) < 1:
        ap.error("--tokens, --vocab, --hidden and --chunk must be at least 1")
    if args.out and not Path(args.out).parent.is_dir():
        ap.error(f"--out {args.out}: no folder {Path(args.out).parent} to write it in")
    tree = Path(args.tree)
    kernels = next((d for d in (tree / "edgerl" / "kernels", tree / "gpu_kernels") if (d / "logprobs.py").is_file()), None)
    if kernels is None:
        ap.error(f"--tree {tree}: no edgerl/kernels/logprobs.py there")
    import importlib.util
    import torch
    # the checkout's kernels under a name of their own, beside (not instead of) the installed edgerl
    spec = importlib.util.spec_from_file_location("tree_kernels", kernels / "__init__.py",
                                                  submodule_search_locations=[str(kernels)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tree_kernels"] = module
    spec.loader.exec_module(module)
    token_logprobs_and_entropy = module.token_logprobs_and_entropy
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    h0 = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(device, dtype)
    w0 = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    rec = {"tree": str(tree), "device": str(device), **{k: getattr(args, k) for k in ("tokens", "vocab", "hidden",
                                                                                       "chunk", "dtype")}}
    for head in ("frozen", "trained"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_(head == "trained")
        out = {}

        def step():
            lp, ent = token_logprobs_and_entropy(h, w, targets, backend="torch", chunk=args.chunk)
            (lp.sum() + ent.sum()).backward()
            out["logp_sum"] = float(lp.detach().sum())
        runs = []
        for _ in range(2):   # the second: no one-off allocations of a first call
            h.grad = w.grad = None
            runs.append(measure(step, device))
        rec[head] = {"peak_extra_mib": round(runs[1][0] / 2**20, 1), "seconds": round(runs[1][1], 2),
                     "first_call_peak_extra_mib": round(runs[0][0] / 2**20, 1), **out}
    print(json.dumps(rec))
    if args.out:
        from edgerl.core.files import write_atomically
        write_atomically(args.out, json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
