"""Runs lightning_zero's CUDA kernels on the CPU (``tests/cuda_emulator/emulator.h``), through the real host
launchers: the ``emulated_gpu`` fixture swaps ``loader.launch`` for a launch on the emulator and lets the
launchers take CPU tensors, so a test calls ``launchers.layer_norm_fwd`` or the ops exactly as on a GPU.

Each source is built once per content with g++ into a shared library of plain host functions, with one
``emulated_launch_<kernel>`` entry per kernel: a launch packs the arguments into 64-bit slots as the GPU
would receive them and runs the grid in C++, each CUDA thread a fiber (emulator.h). The kernels' argument
types come from their PTX (NVRTC), so a launcher passing the wrong number or kind of arguments fails here
as it would there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from lightning_zero.kernels import adamw, launchers, loader, ops
from tests.support import nvrtc

HERE = Path(__file__).parent / "cuda_emulator"
PTX_TYPES = {"u64": ctypes.c_uint64, "s64": ctypes.c_int64, "u32": ctypes.c_uint32, "s32": ctypes.c_int32}
PTX_TYPES["f32"] = ctypes.c_float
LAUNCHED: list[str] = []  # the kernels launched, in order (the fixture empties it)


def available() -> str | None:
    """Why the emulator cannot run here, or None."""
    if shutil.which("g++") is None:
        return "no g++"
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return "no NVRTC (cuda-bindings) to read the kernels' signatures"
    return None


@functools.cache
def _library(source: str) -> ctypes.CDLL:
    """``source`` (a file of cuda_kernels/, or any path) built for the emulator, once per content."""
    command = ["g++", "-std=c++20", "-O2", "-fno-strict-aliasing", "-shared", "-fPIC"]
    command += [f"-I{HERE / 'include'}", f"-I{loader.source_dir()}", "-include", str(HERE / "emulator.h")]
    entries = "".join(
        f'extern "C" int emulated_launch_{name}(unsigned gx, unsigned gy, unsigned bx, unsigned by,'
        f" const std::uint64_t* slots) {{ return emulated_run(&{name}, slots, gx, gy, bx, by); }}\n"
        for name in _signatures(source)
    )
    unit = f'#include "{loader.source_dir() / source}"\n{entries}'
    text = b"".join(p.read_bytes() for p in (*sorted(HERE.rglob("*.h")), *sorted(loader.source_dir().glob("*.cu*"))))
    text += (loader.source_dir() / source).read_bytes()
    key = hashlib.sha1(text + " ".join(command).encode() + unit.encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"lz_emulated_{Path(source).name.replace('.', '_')}_{key}.so"
    if not out.exists():
        partial = out.with_suffix(f".{os.getpid()}.partial")
        command += ["-x", "c++", "-", "-o", str(partial)]
        subprocess.run(command, input=unit, check=True, capture_output=True, text=True)
        partial.rename(out)
    return ctypes.CDLL(str(out))


def build_all() -> None:
    """Builds every kernel source for the emulator side by side (g++ and NVRTC run outside the GIL)."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(_library, loader.SOURCES))


def wide_loads(source: str) -> int:
    """16-byte vector loads the kernels of ``source`` made since the last call (0: they went element by element)."""
    take = _library(source).emulated_take_wide_loads
    take.restype = ctypes.c_longlong
    return take()


@functools.cache
def _signatures(source: str) -> dict[str, list]:
    """Each entry point's parameter types, from the PTX NVRTC makes of the source."""
    result = nvrtc.compiled(source, "compute_80")
    assert result.ok, result.log
    entries = re.findall(r"\.entry (\w+)\((.*?)\)", result.ptx, re.S)
    return {name: [PTX_TYPES[t] for t in re.findall(r"\.param \.(\w+)", params)] for name, params in entries}


def launch(source: str, kernel: str, grid, block: int, args: tuple, *, device: torch.device) -> None:
    """loader.launch's contract, on the emulator: ``args`` as the launchers build them."""
    LAUNCHED.append(kernel)
    types = _signatures(source)[kernel]
    assert len(args) == len(types), f"{kernel} takes {len(types)} arguments, the launcher passed {len(args)}"
    for index, (arg, kind) in enumerate(zip(args, types)):  # what CuPy would pass as other bytes than meant
        if kind is ctypes.c_float and not isinstance(arg, np.float32):
            raise TypeError(f"{kernel} argument {index}: a float parameter needs np.float32, got {type(arg)}")
        if kind is not ctypes.c_float and not isinstance(arg, (int, np.int64, np.uint64)):
            raise TypeError(f"{kernel} argument {index}: an integer parameter got {type(arg)}")
        if kind in (ctypes.c_uint32, ctypes.c_int32) and not -(2**31) <= int(arg) < 2**31:
            raise TypeError(f"{kernel} argument {index}: {arg} does not fit the 32-bit parameter")
    slots = (ctypes.c_uint64 * max(len(args), 1))(*map(_slot, args))
    grid = grid if isinstance(grid, tuple) else (grid,)
    library = _library(source)
    run = getattr(library, f"emulated_launch_{kernel}")
    run.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
    if run(grid[0], grid[1] if len(grid) > 1 else 1, block, 1, ctypes.cast(slots, ctypes.c_void_p)):
        library.emulated_error.restype = ctypes.c_char_p
        raise RuntimeError(f"emulated CUDA, {kernel}: {library.emulated_error().decode()}")


def _slot(arg) -> int:
    """An argument's bits in a 64-bit slot: a float32's in the low half, an integer's two's complement."""
    if isinstance(arg, np.float32):
        return int(np.float32(arg).view(np.uint32))
    return int(arg) & (2**64 - 1)


def _tensor(t: torch.Tensor, name: str, *, dtypes, like=None) -> int:
    """loader.tensor's checks, with CPU tensors standing in for CUDA ones."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t.data_ptr()


def emulate(monkeypatch) -> None:
    """From here on the kernels run on the emulator for CPU tensors: through the launchers, the ops, the fused
    AdamW and the fused ZeRO step (whose "cuda" backend then takes CPU masters)."""
    from lightning_zero.sharding import fused_step

    for module in (launchers, adamw):
        monkeypatch.setattr(module, "launch", launch)
        monkeypatch.setattr(module, "tensor", _tensor)
    for module in (ops, adamw, fused_step):
        monkeypatch.setattr(module, "use_kernels", lambda t: True)
    monkeypatch.setattr(launchers, "_sms", lambda device: 4)  # a small device: the row chunks are exercised
    LAUNCHED.clear()
