"""NVRTC, the compiler CuPy uses, on a machine without a GPU: each kernel source compiled once per architecture
in a test run, shared by the compile checks and the emulator (which reads the kernels' signatures from PTX).

An ``sm_XX`` compile gives the PTX (``.target sm_XX``), the cubin and ptxas's verbose report (registers,
stack frame and spills per entry point) in one go; a ``compute_XX`` compile gives the PTX alone.
"""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lightning_zero.kernels.loader import compile_options, source_dir

PTX_INFO = re.compile(r"^ptxas (info\s*:|\s+\.)")  # the lines of ptxas's report (-v), not messages


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str  # NVRTC's and ptxas's messages, the report's lines left out
    ptx: str
    cubin: bytes | None
    report: dict[str, dict[str, int]]  # sm_XX: per entry point, registers, stack frame, spill stores and loads


def _check(result) -> object:
    from cuda.bindings import nvrtc

    status, *values = result
    assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS, status
    return values[0] if values else None


@functools.cache
def compiled(source: str, arch: str) -> Compiled:
    """``source`` (a file of cuda_kernels/, or any path) compiled for ``arch`` with warnings as errors."""
    from cuda.bindings import nvrtc

    code = (source_dir() / source).read_bytes()
    program = _check(nvrtc.nvrtcCreateProgram(code, Path(source).name.encode(), 0, [], []))
    real = arch.startswith("sm_")
    options = [*compile_options(), f"-arch={arch}", "--warning-as-error=all-warnings"]
    options += ["--ptxas-options=-v"] if real else []
    ok = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])[0]
    ok = ok == nvrtc.nvrtcResult.NVRTC_SUCCESS
    log = bytearray(_check(nvrtc.nvrtcGetProgramLogSize(program)))
    _check(nvrtc.nvrtcGetProgramLog(program, log))
    text = log.decode(errors="replace").strip("\0")
    ptx, cubin = "", None
    if ok:
        buffer = bytearray(_check(nvrtc.nvrtcGetPTXSize(program)))
        _check(nvrtc.nvrtcGetPTX(program, buffer))
        ptx = buffer.decode(errors="replace")
        if real:
            buffer = bytearray(_check(nvrtc.nvrtcGetCUBINSize(program)))
            _check(nvrtc.nvrtcGetCUBIN(program, buffer))
            cubin = bytes(buffer)
    _check(nvrtc.nvrtcDestroyProgram(program))
    messages = "\n".join(line for line in text.splitlines() if line.strip() and not PTX_INFO.match(line))
    return Compiled(ok, messages, ptx, cubin, _report(text) if real else {})


def _report(log: str) -> dict[str, dict[str, int]]:
    """Per entry point: registers, stack frame and spill bytes, from ptxas's verbose log."""
    report = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry function|\Z)", log, re.S):
        report[name] = {
            key: int(value)
            for value, key in re.findall(r"(\d+) (?:bytes )?(stack frame|spill stores|spill loads|registers)", body)
        }
    return report


def compile_in_parallel(pairs: list[tuple[str, str]]) -> None:
    """Fills the cache for (source, arch) ``pairs`` on every core (NVRTC compiles outside the GIL)."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda pair: compiled(*pair), pairs))
