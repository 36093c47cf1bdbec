"""Compiles the CUDA C sources of ``cuda_kernels/`` with CuPy (NVRTC) and launches them on torch tensors.

[Note: compile cache]
One CuPy ``RawModule`` per source file and device, cached in memory for the process; CuPy also keeps
the compiled binary on disk (``CUPY_CACHE_DIR``). CuPy's disk key covers the source text and the
options but not headers pulled in with ``-I``, so the options carry a hash of every source and
header (``-DLZ_SOURCES=<sha1>``): editing ``common.cuh`` recompiles everything.

[Note: launching]
Tensors are passed as their ``data_ptr()`` once their device, dtype and layout are checked; outputs are
allocated by the callers with torch, so one caching allocator owns all memory. Kernels run on the
device of their tensors and on that device's current torch stream (wrapped for CuPy with
``ExternalStream``), whichever device is current: a module on ``cuda:1`` launches on ``cuda:1``.

Without a GPU or without CuPy the ops use their pure-torch references (``reference.py``); which one
runs is logged once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.resources
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("lightning_zero.kernels")

SOURCES = (
    "adamw.cu",
    "bias_dropout_residual.cu",
    "bias_gelu.cu",
    "layer_norm.cu",
    "quantize.cu",
    "reduce.cu",
    "residual_layer_norm.cu",
    "softmax_dropout.cu",
)
SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
BLOCK = 256


def source_dir() -> Path:
    """cuda_kernels/: installed inside the package, or at the top of a source checkout used in place."""
    try:
        return Path(str(importlib.resources.files("lightning_zero.cuda_kernels")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "cuda_kernels"


def sources_hash() -> str:
    """A SHA-1 of every source and header in cuda_kernels/ (names and contents; see [Note: compile cache])."""
    digest = hashlib.sha1()
    for path in sorted(source_dir().glob("*.cu*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h: the nvidia pip wheels (cuda-toolkit), then a CUDA installation."""
    candidates = [Path(p) / "nvidia" / name / "include" for p in sys.path for name in ("cu13", "cu12", "cuda_runtime")]
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            candidates.append(Path(os.environ[variable]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return list(dict.fromkeys(str(c) for c in candidates if (c / "cuda_fp16.h").is_file()))


def compile_options() -> tuple[str, ...]:
    """NVRTC's options: C++17, the include directories and the sources' hash (see [Note: compile cache])."""
    includes = [str(source_dir()), *cuda_include_dirs()]
    return ("--std=c++17", *(f"-I{d}" for d in includes), f"-DLZ_SOURCES={sources_hash()}")


@functools.cache
def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@functools.cache
def available() -> bool:
    """Whether the CUDA kernels can run here (a CUDA device and CuPy)."""
    if not torch.cuda.is_available():
        log.info("lightning_zero kernels: no CUDA device, the fused ops run their pure-torch references")
        return False
    if _cupy() is None:
        log.warning(
            "lightning_zero kernels: CuPy is not installed (pip install 'lightning-zero[cuda]'), the fused"
            " ops run their pure-torch references"
        )
        return False
    log.info("lightning_zero kernels: compiling the CUDA kernels with CuPy (NVRTC) on first use")
    return True


def use_kernels(tensor: Tensor) -> bool:
    """Whether an op on ``tensor`` runs the CUDA kernel (the kernels can run here and it is on a CUDA device)."""
    return available() and tensor.is_cuda


@functools.cache
def _module(source: str, device: int) -> Any:
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.RawModule(code=(source_dir() / source).read_text(), options=compile_options())


def compile_all(device: int | None = None) -> None:
    """Compiles every CUDA source for ``device`` now, rather than on the first call of each of its kernels.

    Each source's module is compiled (or loaded from CuPy's disk cache, see [Note: compile cache]) in a thread of
    its own: NVRTC is thread-safe and CuPy releases the GIL while it compiles (on 2 cores here, NVRTC took 8.0 s
    for all of ``SOURCES`` one after another, 4.4 s in threads; the slowest source alone takes 2.4 s). Needs CuPy
    and a CUDA device (see ``available``).

    Args:
        device: the CUDA device's index; None: the current device.

    Raises:
        cupy.cuda.compiler.CompileException: a source does not compile (the first such error, from its thread).
    """
    device = torch.cuda.current_device() if device is None else device

    def compile_one(source: str) -> None:
        with _cupy().cuda.Device(device):
            _module(source, device).compile()

    with concurrent.futures.ThreadPoolExecutor(len(SOURCES)) as pool:
        list(pool.map(compile_one, SOURCES))  # (re-raises the first error)


def tensor(t: Tensor, name: str, *, dtypes: tuple[torch.dtype, ...], like: Tensor | None = None) -> int:
    """The device pointer of ``t`` after checking it; the error names the argument and what is wrong."""
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {like.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t.data_ptr()


def i64(value: int) -> np.int64:
    """``value`` as a kernel's ``long long`` argument."""
    return np.int64(value)


def f32(value: float) -> np.float32:
    """``value`` as a kernel's ``float`` argument."""
    return np.float32(value)


def grid_for(n: int, per_thread: int = 1) -> int:
    """Blocks for a grid-stride loop over ``n`` elements: enough to fill the device, never more than needed."""
    return max(1, min(-(-n // (BLOCK * per_thread)), 65535))


def launch(
    source: str, kernel: str, grid: int | tuple[int, ...], block: int, args: tuple, *, device: torch.device
) -> None:
    """Runs ``kernel`` on ``device`` (its tensors' device) on that device's current torch stream."""
    cupy = _cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    function = _module(source, index).get_function(kernel)
    grid = grid if isinstance(grid, tuple) else (grid,)
    stream = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream):
        function(grid, (block,), args)


def dropout_stream(device: torch.device) -> Tensor:
    """A fresh dropout stream for one call: (seed, offset) as two int64s drawn by torch's generator on
    ``device`` (a device tensor on CUDA: no host sync, and a CUDA graph replays the draw, so every replay
    drops other elements). ``torch.manual_seed`` governs it."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)
