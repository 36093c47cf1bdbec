"""The host AdamW kernel (``cpu_kernels/adamw.c``): built with the system's C compiler on first use,
loaded with ctypes, one call for all of a step's offloaded runs.

[Note: host kernel build]
The source is compiled once per machine into ``$LIGHTNING_ZERO_CACHE`` (default
``~/.cache/lightning_zero``) under a name that hashes the source, the flags and the compiler's
version, so an edit or a new compiler builds anew and an unchanged one loads in milliseconds. Ranks
that start together may all compile: each writes its own temporary file and renames it into place,
so a reader only ever sees a whole library. The build takes about half a second (plain C, no torch
headers, no ninja). Without a C compiler, or with ``LIGHTNING_ZERO_HOST_KERNELS=0``, ``available()``
is False and offloaded units take torch's fused CPU AdamW instead (offload.py); which one runs is
logged once. The library has x86-64-v4 (AVX-512), v3 (AVX2) and baseline clones picked at load
time, all giving the same bits (see the source's [Note: host AdamW arithmetic]).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import logging
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from lightning_zero.kernels.adamw import AdamWRun

log = logging.getLogger("lightning_zero.kernels")

FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
LOWP_KIND = {None: 0, torch.float16: 1, torch.bfloat16: 2}
LOWP_DTYPES = (torch.float16, torch.bfloat16)


class _Task(ctypes.Structure):  # lz_adamw_task in adamw.c
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("lowp", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("lowp_kind", ctypes.c_int32),
        ("lerp_small", ctypes.c_int32),
        *((name, ctypes.c_float) for name in ("grad_mul", "decay", "beta2", "lerp_weight", "one_minus_beta2")),
        *((name, ctypes.c_float) for name in ("bias2_sqrt", "eps", "neg_step_size")),
    ]


def task(run: AdamWRun) -> _Task:
    """The run as the kernel's task, after checking its tensors (a ValueError names the bad one)."""
    n = run.param.numel()
    fp32 = (run.param, run.grad, run.exp_avg, run.exp_avg_sq)
    lowp = run.lowp_out
    good = all(t.dtype == torch.float32 and _flat_host(t, n) for t in fp32)
    if not good or (lowp is not None and not (lowp.dtype in LOWP_DTYPES and _flat_host(lowp, n))):
        _refuse(run, n)  # raises, naming the bad tensor
    weight, step = 1.0 - run.beta1, int(run.step)  # (a step count held in a CPU tensor: read here)
    return _Task(
        run.param.data_ptr(),
        run.grad.data_ptr(),
        run.exp_avg.data_ptr(),
        run.exp_avg_sq.data_ptr(),
        None if lowp is None else lowp.data_ptr(),
        n,
        LOWP_KIND[None if lowp is None else lowp.dtype],
        int(weight < 0.5),
        run.grad_mul,
        1.0 - run.lr * run.weight_decay,
        run.beta2,
        weight,
        1.0 - run.beta2,
        math.sqrt(1.0 - run.beta2**step),
        run.eps,
        -run.lr / (1.0 - run.beta1**step),
    )


def _refuse(run: AdamWRun, n: int) -> None:
    for name in ("param", "grad", "exp_avg", "exp_avg_sq", "lowp_out"):
        t = getattr(run, name)
        wanted = LOWP_DTYPES if name == "lowp_out" else (torch.float32,)
        if t is not None and not (t.dtype in wanted and _flat_host(t, n)):
            raise ValueError(
                f"{name} must be a contiguous CPU tensor of {n} elements in {' or '.join(map(str, wanted))},"
                f" got {tuple(t.shape)} {t.dtype} on {t.device}"
            )


def _flat_host(t: Tensor, n: int) -> bool:
    return t.device.type == "cpu" and t.numel() == n and t.is_contiguous()


def source() -> Path:
    """The C source of the host AdamW kernel: installed inside the package, or in a source checkout used in place."""
    try:
        return Path(str(importlib.resources.files("lightning_zero.cpu_kernels"))) / "adamw.c"
    except ModuleNotFoundError:  # a source checkout used in place
        return Path(__file__).resolve().parents[2] / "cpu_kernels" / "adamw.c"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(cache_dir: Path | None = None) -> Path:
    """The compiled library, built unless the cache holds it (see [Note: host kernel build])."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    text = source().read_bytes()
    key = hashlib.sha1(text + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_zero"
    cache_dir = Path(cache_dir or os.environ.get("LIGHTNING_ZERO_CACHE") or default)
    library = cache_dir / f"host_adamw-{key}.so"
    if library.is_file():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=cache_dir, suffix=".so.partial")
    os.close(handle)
    try:
        result = subprocess.run([compiler, *FLAGS, "-o", partial, str(source())], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source()}:\n{result.stderr.strip()}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("LIGHTNING_ZERO_HOST_KERNELS", "1") == "0":
        log.info("lightning_zero host kernels: off (LIGHTNING_ZERO_HOST_KERNELS=0); torch's fused CPU AdamW steps")
        return None
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("lightning_zero host kernels: not built (%s); torch's fused CPU AdamW steps instead", error)
        return None
    library.lz_adamw_step.argtypes = (ctypes.POINTER(_Task), ctypes.c_int64, ctypes.c_int32)
    library.lz_adamw_step.restype = ctypes.c_int
    log.info("lightning_zero host kernels: loaded %s", library._name)
    return library


def available() -> bool:
    """Whether the host AdamW kernel is built and loaded here."""
    return _library() is not None


def adamw_step(runs: Sequence[AdamWRun], threads: int | None = None) -> None:
    """Steps every run in one call, over ``threads`` threads (default: ``torch.get_num_threads()``)."""
    if not runs:
        return
    library = _library()
    if library is None:
        raise RuntimeError("the host AdamW kernel is not available here (see lightning_zero.kernels.host)")
    tasks = (_Task * len(runs))(*(task(run) for run in runs))
    library.lz_adamw_step(tasks, len(runs), threads or torch.get_num_threads())
