"""What the benchmarks need, checked in seconds before any of them runs (gpu_session.sh's quick stage).

    python bench/env_check.py [--tokenizer PATH]

Prints package versions, the GPUs, free disk and host memory, the device memory a CUDA context takes
(NVML: used before and after this process initialises CUDA), and tries an NF4 layer on the GPU through
bitsandbytes (TRL's QLoRA side and edgerl's plan.base_dtype=nf4 need it). Exit status 1 when something
a benchmark needs is missing: TRL, datasets, peft, the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

NEEDED = ("torch", "transformers", "trl", "datasets", "peft", "accelerate", "safetensors", "edgerl")
OPTIONAL = ("bitsandbytes", "nvidia-ml-py", "triton", "liger-kernel", "pandas", "pyarrow", "xxhash", "dill",
            "multiprocess")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=bl.default_tokenizer())
    args = ap.parse_args()
    mem = bl.DeviceMemory()
    report: dict = {"versions": {}, "problems": []}
    for pkg in NEEDED + OPTIONAL:
        try:
            report["versions"][pkg] = version(pkg)
        except PackageNotFoundError:
            report["versions"][pkg] = None
            if pkg in NEEDED:
                report["problems"].append(f"{pkg} is not installed (carry its wheel in .whl/)")
    for mod in ("trl", "datasets", "peft"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001 - a missing dependency of a carried wheel shows here
            report["problems"].append(f"import {mod}: {type(e).__name__}: {str(e)[:200]}")
    tok = Path(args.tokenizer)
    if not (tok / "tokenizer.json").exists():
        report["problems"].append(f"no tokenizer at {tok} (copy the SmolLM2 tokenizer folder to "
                                  "$EDGERL_SHARED/data/smollm2-tokenizer)")
    report["disk_free_gib_tmp"] = shutil.disk_usage("/tmp").free / bl.GiB
    try:
        import psutil
        report["host_ram_gib"] = psutil.virtual_memory().total / bl.GiB
    except ImportError:
        pass
    import torch
    report["cuda"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        dev = torch.device("cuda", 0)
        torch.empty(1, device=dev)
        report["context"] = mem.outside_allocator(dev)
        try:
            import bitsandbytes as bnb
            layer = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=torch.float32, compress_statistics=True,
                                      quant_type="nf4").to(dev)
            x = torch.randn(4, 256, device=dev)
            y = layer(x)
            report["bitsandbytes_nf4_cuda"] = f"ok, output {tuple(y.shape)} finite={bool(torch.isfinite(y).all())}"
        except Exception as e:  # noqa: BLE001
            report["bitsandbytes_nf4_cuda"] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            report["problems"].append("bitsandbytes NF4 does not run on this GPU: the QLoRA groups and "
                                      "plan.base_dtype=nf4 will fail")
    print(json.dumps(report, indent=1))
    print("environment: " + ("ready" if not report["problems"] else "PROBLEMS:\n  " + "\n  ".join(report["problems"])))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
