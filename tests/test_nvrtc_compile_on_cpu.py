"""edgerl's CUDA C kernels (edgerl/kernels/decode_cuda.py, edgerl/kernels/nf4.py) compiled with NVRTC for each GPU
architecture the plan may run them on, without a GPU: a source that does not compile for a card fails here, not
at the start of a user's run. NVRTC is a library: a CUDA build of torch brings it; on a CPU build, the
nvidia-cuda-nvrtc-cu12 wheel (scripts/setup.sh installs it when torch has no CUDA)."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

import edgerl.kernels.nvrtc as nvrtc
from edgerl.kernels import decode_cuda, fp32_mm, nf4

ARCHS = [(6, 1), (7, 0), (7, 5), (8, 6), (9, 0)]   # Pascal (P40), Volta (V100), Turing (T4), Ampere, Hopper
# (query heads per KV head, head size): Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-3.1-8B, SmolLM2-135M, the largest group
# and head the kernels take, and the smallest
LAYOUTS = [(7, 64), (6, 128), (4, 128), (3, 64), (8, 256), (1, 32)]


LIB = nvrtc.library_to_compile()
pytestmark = pytest.mark.skipif(LIB is None, reason="no NVRTC library: torch is not a CUDA build and the "
                                "nvidia-cuda-nvrtc-cu12 wheel is not installed (scripts/setup.sh installs it)")


@pytest.fixture(autouse=True)
def with_nvrtc(monkeypatch):
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: LIB)


def _targets(cc: tuple[int, int]) -> None:
    """Skip an architecture this NVRTC cannot build for: CUDA 13 starts at sm_75 (a CUDA 13 torch has no
    Pascal or Volta code either, so such a machine never compiles for them)."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    LIB.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    if major.value >= 13 and cc < (7, 5):
        pytest.skip(f"NVRTC {major.value}.{minor.value} does not build for sm_{cc[0]}{cc[1]} (CUDA 13 starts at sm_75)")


@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_decode_layer_kernels_compile_for_every_architecture(cc, dtype):
    _targets(cc)
    names = sorted({n for group, head_dim in LAYOUTS for n in decode_cuda.kernel_names(group, head_dim, dtype)})
    cubin, lowered = nvrtc.compile_cubin(decode_cuda.SOURCE, names, cc)   # one program: every instantiation
    assert cubin and set(lowered) == set(names) and all(lowered.values())


@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
def test_the_nf4_kernels_compile_for_every_architecture(cc):
    _targets(cc)
    names = sorted({n for dt in (torch.float32, torch.float16, torch.bfloat16) for n in nf4.decode_kernels(dt, cc)})
    assert (f"nf4_mma<{nf4.MMA_WARPS}>" in names) == (cc >= (7, 5))   # fp16 on tensor cores from Turing
    if cc == ARCHS[0]:   # every tile of rows and of W's rows per lane a call may take, on the oldest card
        names += [nf4.mm_name(dt, rows, r) for dt in (torch.float32, torch.float16) for rows in (1, 2, 4, 8, 16)
                  for r in (1, 2)]
        names = sorted(set(names))
    cubin, lowered = nvrtc.compile_cubin(nf4.SOURCE, names, cc)
    assert cubin and set(lowered) == set(names)


@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
def test_the_fp32_matmul_kernels_compile_for_every_architecture_without_spills(cc):
    """Every tile of rows the fp32 few-row matmul takes, within 128 registers (two blocks an SM) and no spills to
    local memory (a spill would put the partial sums in memory the kernel is meant not to touch)."""
    _targets(cc)
    names = fp32_mm.all_kernels()
    cubin, lowered = nvrtc.compile_cubin(fp32_mm.SOURCE, names, cc)
    assert cubin and set(lowered) == set(names)
    prog = ctypes.c_void_p()
    assert LIB.nvrtcCreateProgram(ctypes.byref(prog), fp32_mm.SOURCE.encode(), b"edgerl.cu", 0, None, None) == 0
    try:
        for n in names:
            assert LIB.nvrtcAddNameExpression(prog, n.encode()) == 0
        opts = (ctypes.c_char_p * 3)(f"--gpu-architecture=sm_{cc[0]}{cc[1]}".encode(), b"-std=c++14",
                                     b"--ptxas-options=-v")
        assert LIB.nvrtcCompileProgram(prog, 3, opts) == 0
        size = ctypes.c_size_t()
        LIB.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        LIB.nvrtcGetProgramLog(prog, log)
    finally:
        LIB.nvrtcDestroyProgram(ctypes.byref(prog))
    text = log.value.decode()
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
    assert len(spills) == len(regs) == len(names), text[:2000]
    assert all(a == b == "0" for a, b in spills) and max(regs) <= 128, text[:2000]


def _ptx(source: str, names: list[str], arch: str) -> tuple[str, dict[str, str]]:
    prog = ctypes.c_void_p()
    assert LIB.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"edgerl.cu", 0, None, None) == 0
    try:
        for n in names:
            assert LIB.nvrtcAddNameExpression(prog, n.encode()) == 0
        opts = (ctypes.c_char_p * 2)(f"--gpu-architecture={arch}".encode(), b"-std=c++14")
        assert LIB.nvrtcCompileProgram(prog, 2, opts) == 0
        size = ctypes.c_size_t()
        LIB.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        LIB.nvrtcGetPTX(prog, buf)
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            LIB.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out))
            lowered[n] = out.value.decode()
        return buf.value.decode(), lowered
    finally:
        LIB.nvrtcDestroyProgram(ctypes.byref(prog))


FLOAT_OP = re.compile(r"(fma|mul|add|sub|div|rcp|ex2|max|min|rsqrt|neg|setp)\.\S*f32\b")


def _body(ptx: str, symbol: str) -> list[str]:
    body = ptx[ptx.index(f".entry {symbol}"):]
    return [line.strip() for line in body[:body.index("\n}\n")].splitlines()]


def _float_ops(ptx: str, symbol: str) -> list[str]:
    """The opcodes of a kernel's fp32 arithmetic, in order (registers, loads and conversions left out)."""
    return [line.split()[0] for line in _body(ptx, symbol) if FLOAT_OP.match(line)]


@pytest.mark.parametrize("arch", ["compute_61", "compute_75"])
def test_the_fp16_decode_kernels_compute_what_the_fp32_ones_compute(arch):
    """The fp16 instantiations read and write fp16 and round where torch's fp16 ops round, but their fp32
    arithmetic is the fp32 kernels' (which the CUDA tests check against float64): the same float instructions in
    the same order, the conversions aside."""
    _targets((int(arch[-2]), int(arch[-1])))
    names32 = decode_cuda.kernel_names(6, 128, torch.float32) + decode_cuda.kernel_names(3, 64, torch.float32)
    names16 = decode_cuda.kernel_names(6, 128, torch.float16) + decode_cuda.kernel_names(3, 64, torch.float16)
    p32, l32 = _ptx(decode_cuda.SOURCE, names32, arch)
    p16, l16 = _ptx(decode_cuda.SOURCE, names16, arch)
    for a, b in zip(names32, names16):
        ops32, ops16 = _float_ops(p32, l32[a]), _float_ops(p16, l16[b])
        assert ops32 and ops16 == ops32, (b, len(ops32), len(ops16))
        assert any(line.startswith("cvt.rn.f16.f32") for line in _body(p16, l16[b])), b   # it stores fp16


@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
def test_the_attention_over_an_fp16_cache_under_fp32_compiles_for_every_architecture(cc):
    _targets(cc)
    names = sorted({n for group, head_dim in LAYOUTS
                    for n in decode_cuda.kernel_names(group, head_dim, torch.float32, torch.float16)})
    assert any("_kv<float, h16," in n for n in names)
    cubin, lowered = nvrtc.compile_cubin(decode_cuda.SOURCE, names, cc)
    assert cubin and set(lowered) == set(names) and all(lowered.values())


@pytest.mark.parametrize("arch", ["compute_61", "compute_75"])
def test_the_attention_over_an_fp16_cache_computes_what_the_fp32_one_computes(arch):
    """Under fp32 compute with an fp16 cache the attention kernels' arithmetic is the fp32 cache's, in the same
    order; what they add is the rounding of the written column to fp16 (a cvt.rn.f16.f32 per value), its widening
    as it is read, and the overflow check of the written values (two comparisons of their absolute values)."""
    _targets((int(arch[-2]), int(arch[-1])))
    for split in (False, True):
        a32 = decode_cuda.attend_name(6, 128, split, torch.float32)
        a16 = decode_cuda.attend_name(6, 128, split, torch.float32, torch.float16)
        p32, l32 = _ptx(decode_cuda.SOURCE, [a32], arch)
        p16, l16 = _ptx(decode_cuda.SOURCE, [a16], arch)
        ops32, ops16 = _float_ops(p32, l32[a32]), _float_ops(p16, l16[a16])
        assert [op for op in ops16 if not op.startswith("setp.")] == [op for op in ops32 if not op.startswith("setp.")]
        assert sum(op.startswith("setp.") for op in ops16) - sum(op.startswith("setp.") for op in ops32) == 2, a16
        body = _body(p16, l16[a16])
        assert sum(line.startswith("cvt.rn.f16.f32") for line in body) == 2, a16   # the key and the value
        assert any(line.startswith("atom.") or line.startswith("red.") for line in body), a16   # the flag


def test_a_cache_dtype_the_kernels_do_not_take_is_refused_in_one_line():
    with pytest.raises(ValueError, match="fp16 cache under fp32|not one they take"):
        decode_cuda.attend_name(4, 64, False, torch.float16, torch.float32)
    assert "fp32 or fp16 caches under fp32" in decode_cuda.unavailable_reason(
        torch.device("cuda"), 64, torch.float32, 4, torch.bfloat16)
