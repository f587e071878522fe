"""How many instructions a decode matmul's inner loop issues per KiB of weight it reads, from its compiled code,
against how many a GPU can issue while its memory delivers a KiB.

A kernel that must read its weight once per call cannot run faster than the copy bound, and cannot run faster than
its instructions can be issued either. An SM of compute capability 7.0 and up has four warp schedulers, each issuing
one instruction of one warp a clock (CUDA C++ Programming Guide, the compute capability 7.x, 8.x and 9.0 sections).
So a GPU issues 4 x SMs x clock warp instructions a second; the clock is the datasheet fp32 rate over 2 x SMs x the
fp32 results per clock per SM of its compute capability (the guide's arithmetic throughput table: 64 for 7.x and
8.0, 128 for 8.6, 8.9 and 9.0). Over the datasheet bandwidth, that is the budget: the warp instructions the GPU can
issue per KiB it reads. A loop that needs more per KiB of weight is issue bound: it needs `issue_over_copy` times
the copy time of its weight at the very least, every scheduler of every SM busy every clock.

The count is of the machine code (SASS) that NVRTC compiles for the GPU, disassembled by `nvdisasm` (the
`nvidia-cuda-nvdisasm` wheel; CUDA 13's reads CC 7.5 and up, not Pascal's 6.x). The inner loop is the one holding
the kernel's multiply instructions; its count is the longest path through it (every branch taken that adds work:
the 4-bit kernel's nested block scales, every row of the tile in range), per KiB of the weight that path reads.
Static: the count says nothing of stalls (memory latency, the scoreboard), only of the issue slots the loop takes.

    python bench/kernel_issue.py [--cc 7.5,9.0] [--gpus t4,h100] [--out F]

Runs without a GPU: NVRTC from torch's CUDA wheels or the `nvidia-cuda-nvrtc` wheel.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FP32_PER_CLOCK = {(7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
                  (9, 0): 128}   # fp32 results per clock per SM (the guide's arithmetic throughput table)
SCHEDULERS = 4   # warp schedulers per SM from CC 7.0, one instruction a clock each
KIB = 1024


@dataclass(frozen=True)
class Kernel:
    """A decode matmul: its source, the instance a decode step launches, the multiply instruction that marks its
    inner loop, the weight bytes one of those instructions stands for (a warp's), and the bytes a warp reads a step
    (the loop's bytes are a whole number of steps: the fp32 kernels' few FMAs of block scales are not products)."""
    source: Callable[[], str]
    instance: Callable[[], str]
    marker: str
    bytes_per_marker: Callable[[], float]
    step_bytes: Callable[[], int]
    what: str


def _nf4_source() -> str:
    from edgerl.kernels import nf4
    return nf4.SOURCE


def _nf4_instance() -> str:
    from edgerl.kernels import nf4
    return f"nf4_mma<{nf4.MMA_WARPS}>"


def _nf4_fp32_instance() -> str:
    from edgerl.kernels import nf4
    return nf4.mm_name()


def _nf4_bytes_per_ffma() -> float:
    """nf4_mm: each 4-bit code (half a byte) a lane decodes meets each of the tile's rows of x in one FMA."""
    from edgerl.kernels import nf4
    return 32 * 0.5 / nf4._rows_tile(nf4.MAX_ROWS_PER_BLOCK)


def _fp32_source() -> str:
    from edgerl.kernels import fp32_mm
    return fp32_mm.SOURCE


def _fp32_instance() -> str:
    from edgerl.kernels import fp32_mm
    return fp32_mm.mm_name()


def _fp32_bytes_per_ffma() -> float:
    """fp32_mm: a lane's float4 of a weight row (16 bytes) meets each of the tile's rows of x in 4 FMAs."""
    from edgerl.kernels import fp32_mm
    return 32 * 16 / (4 * fp32_mm.rows_tile(fp32_mm.MAX_ROWS))


def _fp32_step_bytes() -> int:
    from edgerl.kernels import fp32_mm
    return 32 * 16 * fp32_mm.NC


KERNELS = {
    # mma.sync m16n8k8: 8 rows of W by 8 columns of K, 64 4-bit codes, 32 bytes
    "nf4_mma": Kernel(_nf4_source, _nf4_instance, "HMMA", lambda: 32.0, lambda: 32 * 64 // 2,
                      "the 4-bit kernel on tensor cores (fp16 rows, 16 a tile; the T4 plans)"),
    # mm_name's instance: 2 rows of W a lane, 32 bytes of codes each a step
    "nf4_mm": Kernel(_nf4_source, _nf4_fp32_instance, "FFMA", _nf4_bytes_per_ffma, lambda: 32 * 2 * 32,
                     "the 4-bit kernel in fp32 (the P40 plans' NF4 base)"),
    "fp32_mm": Kernel(_fp32_source, _fp32_instance, "FFMA", _fp32_bytes_per_ffma, _fp32_step_bytes,
                      "the few-row fp32 kernel (the P40 plans' fp32 weights)"),
}


def issue_per_kib(gpu: str) -> dict:
    """The GPU's warp instructions a second and per KiB of its datasheet bandwidth, from its profile."""
    from edgerl.device.profiles import get_profile
    p = get_profile(gpu)
    per_clock = FP32_PER_CLOCK.get(tuple(p.cc) if p.cc else None)
    if not (per_clock and p.sm_count and p.fp32_tflops and p.memory_bandwidth_gbs):
        raise SystemExit(f"kernel_issue: the profile {gpu!r} lacks what the budget needs (a compute capability of "
                         f"7.0 or up, sm_count, fp32_tflops, memory_bandwidth_gbs)")
    clock = p.fp32_tflops * 1e12 / (2 * p.sm_count * per_clock)
    rate = SCHEDULERS * p.sm_count * clock
    return {"gpu": p.name, "cc": f"{p.cc[0]}.{p.cc[1]}", "sms": p.sm_count, "clock_ghz": round(clock / 1e9, 3),
            "issue_per_s": rate, "bandwidth_gbs": p.memory_bandwidth_gbs,
            "budget_per_kib": rate / (p.memory_bandwidth_gbs * 1e9) * KIB}


# --- the disassembly -----------------------------------------------------------------------------------------------

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+`?\(?(\.L_x_\d+)")


def parse_sass(text: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm's text to its instructions in order and each label's index."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = _INSTR.match(line)
        if m:
            ins.append(m.group(2))
    return ins, labels


def opcode(instr: str) -> str:
    """'@!P0 LDG.E.64 R2, ...' -> 'LDG'."""
    body = instr.split(None, 1)[1] if instr.startswith("@") else instr
    return body.split(None, 1)[0].split(".")[0]


def _branch(instr: str) -> Optional[tuple[str, bool]]:
    """The target label of a branch and whether it is conditional; None for other instructions."""
    m = _TARGET.search(instr)
    if not m or opcode(instr) != "BRA":
        return None
    return m.group(1), instr.startswith("@")


def loops(ins: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(head, back edge) of each loop: a branch to a label at or before itself."""
    out = []
    for j, i in enumerate(ins):
        b = _branch(i)
        if b and labels.get(b[0], j + 1) <= j:
            out.append((labels[b[0]], j))
    return out


def longest_path(ins: list[str], labels: dict[str, int], head: int, back: int) -> list[int]:
    """The indices of the longest path from `head` to the back edge `back` through the loop's body, its forward
    edges only (fall-through, and branches to a later instruction inside the loop)."""
    best: dict[int, tuple[int, int]] = {back: (1, -1)}   # index -> (instructions to the back edge, next index)
    for j in range(back - 1, head - 1, -1):
        b = _branch(ins[j])
        options = []
        if b is None or b[1]:   # falls through unless an unconditional branch
            if ins[j].split(None, 1)[0] != "EXIT":
                options.append(j + 1)
        if b is not None:
            t = labels.get(b[0])
            if t is not None and j < t <= back:
                options.append(t)
        reach = [(best[o][0], o) for o in options if o in best]
        if reach:
            n, o = max(reach)
            best[j] = (n + 1, o)
    if head not in best:
        return []
    path, j = [], head
    while j != -1:
        path.append(j)
        j = best[j][1]
    return path


def hot_loop(text: str, marker: str) -> dict:
    """The innermost loop holding the most `marker` instructions: its longest path's instruction count and mix."""
    ins, labels = parse_sass(text)
    found = []
    for head, back in loops(ins, labels):
        path = longest_path(ins, labels, head, back)
        mix = collections.Counter(opcode(ins[j]) for j in path)
        if mix[marker]:
            found.append((mix[marker], -(back - head), path, mix))
    if not found:
        raise ValueError(f"no loop with a {marker} instruction in the disassembly")
    n_marker, _, path, mix = max(found, key=lambda f: (f[0], f[1]))
    return {"instructions": len(path), "markers": n_marker, "mix": dict(mix.most_common())}


# --- compiling and disassembling -----------------------------------------------------------------------------------

def _nvrtc_library() -> None:
    """Compile with torch's NVRTC or an nvidia-cuda-nvrtc wheel's where torch is a CPU build."""
    from edgerl.kernels import nvrtc
    handle = nvrtc.library_to_compile()
    if handle is None:
        raise SystemExit("kernel_issue: no NVRTC library: install torch's CUDA build or "
                         "`pip install nvidia-cuda-nvrtc-cu12`")
    nvrtc._nvrtc = lambda: handle


def _nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for base in map(Path, sys.path):
        for cand in sorted((base / "nvidia").glob("*/bin/nvdisasm")):
            return str(cand)
    raise SystemExit("kernel_issue: no nvdisasm: `pip install nvidia-cuda-nvdisasm` (CC 7.5 and up)")


def disassemble(k: Kernel, cc: tuple[int, int]) -> str:
    from edgerl.kernels import nvrtc
    cubin, _ = nvrtc.compile_cubin(k.source(), [k.instance()], cc)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([_nvdisasm(), "-c", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kernel_issue: nvdisasm failed for sm_{cc[0]}{cc[1]}: {done.stderr.strip()}")
    return done.stdout


def measure(kernel: str, cc: tuple[int, int], gpus: list[dict]) -> dict:
    k = KERNELS[kernel]
    loop = hot_loop(disassemble(k, cc), k.marker)
    step = k.step_bytes()
    weight = max(1, round(loop["markers"] * k.bytes_per_marker() / step)) * step
    per_kib = loop["instructions"] / weight * KIB
    row = {"kernel": k.instance(), "what": k.what, "sm": f"{cc[0]}.{cc[1]}", "loop_instructions": loop["instructions"],
           "loop_weight_bytes": weight, "instructions_per_kib": round(per_kib, 1), "mix": loop["mix"]}
    row["on"] = {g["gpu"]: {"budget_per_kib": round(g["budget_per_kib"], 1),
                            "issue_over_copy": round(per_kib / g["budget_per_kib"], 2)}
                 for g in gpus if g["cc"] == row["sm"]}
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--cc", default="7.5,9.0", help="compute capabilities to compile for (7.5 and up)")
    ap.add_argument("--gpus", default="t4,h100,h200", help="profiles to weigh each count against (same CC)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in a.kernels.split(","):
        if name not in KERNELS:
            raise SystemExit(f"kernel_issue: unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    ccs = []
    for c in a.cc.split(","):
        m = re.fullmatch(r"(\d+)\.(\d)", c.strip())
        if not m or (int(m.group(1)), int(m.group(2))) < (7, 5):
            raise SystemExit(f"kernel_issue: --cc {c!r}: give compute capabilities such as 7.5,9.0 (7.5 and up)")
        ccs.append((int(m.group(1)), int(m.group(2))))
    gpus = [issue_per_kib(g.strip()) for g in a.gpus.split(",") if g.strip()]
    _nvrtc_library()
    rows = [measure(name, cc, gpus) for name in a.kernels.split(",") for cc in ccs]
    for g in gpus:
        print(f"{g['gpu']}: CC {g['cc']}, {g['sms']} SMs at {g['clock_ghz']} GHz, {g['bandwidth_gbs']:g} GB/s: "
              f"{g['budget_per_kib']:.0f} warp instructions per KiB")
    for r in rows:
        on = "; ".join(f"{gpu} {v['issue_over_copy']}x the copy time" for gpu, v in r["on"].items())
        print(f"{r['kernel']} sm_{r['sm'].replace('.', '')}: {r['loop_instructions']} instructions a loop for "
              f"{r['loop_weight_bytes']:g} bytes of weight, {r['instructions_per_kib']} per KiB"
              + (f" ({on})" if on else ""))
    if a.out:
        from edgerl.core.files import write_atomically
        write_atomically(Path(a.out), json.dumps({"gpus": gpus, "kernels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from edgerl.core.errors import USER_ERRORS
    try:
        sys.exit(main())
    except USER_ERRORS as e:   # an unknown profile, an --out that cannot be written: one line
        raise SystemExit(f"kernel_issue: {e}")
