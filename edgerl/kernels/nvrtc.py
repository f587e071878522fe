"""CUDA C kernels compiled at run time with NVRTC, launched on torch's current stream.

Why NVRTC and not Triton or a C++ extension: Pascal (CC 6.x) has no Triton, and a C++ extension needs
nvcc and a host compiler on the user's machine. NVRTC is a library that every CUDA build of torch
loads already (the pip wheels depend on `nvidia-cuda-nvrtc`), so a kernel written in CUDA C compiles
on any machine that runs torch on CUDA, for the GPU's own architecture. The source must not include
headers (a CUDA toolkit may not be installed); the builtin vector types and intrinsics need none.

torch's own `torch.cuda._compile_kernel` adds the toolkit's include folder and fails without
`CUDA_HOME`; this module compiles without it and loads the cubin through torch's module loader
(`torch.cuda._utils._cuda_load_module`, private: an error names it if a torch version lacks it).
A launch goes through `cuLaunchKernel` on the current stream, so CUDA graphs capture it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional


class KernelUnavailable(RuntimeError):
    """The kernel cannot be compiled or loaded here; the message says why."""


def _nvrtc() -> ctypes.CDLL:
    import torch
    if torch.version.cuda is None:
        raise KernelUnavailable(f"this torch ({torch.__version__}) is not a CUDA build")
    try:
        from torch.cuda._utils import _get_nvrtc_library
        return _get_nvrtc_library()
    except (ImportError, AttributeError, OSError):   # an older torch, or not found its way: by name
        major = int(str(torch.version.cuda).split(".")[0])
        for name in (f"libnvrtc.so.{major}", "libnvrtc.so", f"nvrtc64_{major}0_0.dll"):
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise KernelUnavailable("no NVRTC library found (it comes with torch's CUDA wheels as nvidia-cuda-nvrtc)")


def library_to_compile() -> Optional[ctypes.CDLL]:
    """An NVRTC to compile with where no GPU is needed (the CPU tests, bench/kernel_issue.py): torch's own on a CUDA
    build, else an nvidia-cuda-nvrtc wheel's (scripts/setup.sh installs the CUDA 12 one when torch has none); None
    where neither is."""
    try:
        return _nvrtc()
    except KernelUnavailable:
        pass
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        wheels = sorted(Path(root).glob("cuda_nvrtc/lib/libnvrtc.so.*"))   # CUDA 12's wheel
        wheels += sorted(Path(root).glob("cu*/lib/libnvrtc.so.*"))         # CUDA 13's
        for lib in wheels:
            if "builtins" not in lib.name:
                try:
                    return ctypes.CDLL(str(lib))
                except OSError:
                    continue
    return None


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        text = lib.nvrtcGetErrorString(rc)
        raise KernelUnavailable(f"NVRTC {what} failed: {text.decode() if text else rc}")


def compile_cubin(source: str, names: list[str], cc: tuple[int, int]) -> tuple[bytes, dict[str, str]]:
    """Compile `source` for sm_{cc} with NVRTC. `names` are name expressions (template instances such as
    'f<float, 4>'). Returns the cubin and each name's lowered (mangled) symbol."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"edgerl.cu", 0, None, None),
           "create program")
    try:
        for n in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
        opts = [f"--gpu-architecture=sm_{cc[0]}{cc[1]}".encode(), b"-std=c++14"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise KernelUnavailable(f"NVRTC could not compile for sm_{cc[0]}{cc[1]}: "
                                    f"{log.value.decode(errors='replace').strip()[:600]}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)), f"lowered name of {n}")
            lowered[n] = out.value.decode()
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def blocks_per_sm(kernel: Any, threads: int) -> int:
    """How many blocks of `threads` threads of `kernel` (from `load`) an SM holds at once (the driver's
    occupancy calculator; registers and shared memory decide it); 1 if the driver cannot say."""
    try:
        from torch.cuda._utils import _get_gpu_runtime_library
        n = ctypes.c_int()
        rc = _get_gpu_runtime_library().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), kernel.func, ctypes.c_int(threads), ctypes.c_size_t(0))
    except (ImportError, AttributeError, OSError):
        return 1
    return n.value if rc == 0 and n.value > 0 else 1


_loaded: dict[tuple, Any] = {}


def kernel(source: str, name: str, device: Any) -> Any:
    """`load(source, [name], device)[name]`, compiled once per source, name and device and kept."""
    key = (source, name, device.index)
    k = _loaded.get(key)
    if k is None:
        k = _loaded[key] = load(source, [name], device)[name]
    return k


def load(source: str, names: list[str], device: Any) -> dict[str, Any]:
    """Compile `source` for `device`'s architecture and load it there; returns name -> launcher, called as
    `k(grid=(x, y, z), block=(x, y, z), args=[tensors and ints])` on the current stream."""
    import torch
    try:
        from torch.cuda._utils import _cuda_load_module
    except ImportError as e:
        raise KernelUnavailable(f"this torch ({torch.__version__}) has no torch.cuda._utils._cuda_load_module "
                                f"to load a compiled kernel ({e})") from None
    cc = torch.cuda.get_device_capability(device)
    cubin, lowered = compile_cubin(source, names, cc)
    with torch.cuda.device(device):
        try:
            mod = _cuda_load_module(cubin, list(lowered.values()))
        except RuntimeError as e:
            raise KernelUnavailable(f"loading the compiled kernel failed: {e}") from None
    return {n: mod[lowered[n]] for n in names}
