"""Every CUDA kernel, for every dtype, compiles for sm_80 and sm_90 through NVRTC (the compiler CuPy uses)
with warnings as errors, on a machine without a GPU."""

from __future__ import annotations

import contextlib
import re
import threading
import types

import pytest
from cuda.bindings import nvrtc

from lightning_zero.kernels import loader
from lightning_zero.kernels.loader import SOURCES, source_dir
from tests.support.nvrtc import _check, compile_in_parallel, compiled

DTYPES = ("f32", "f16", "bf16")
# The row kernels (cuda_kernels/rows.cuh, [Note: row teams]) and the largest block each is launched with
ROW_KERNELS = {
    "layer_norm.cu": {"layer_norm_fwd_rows": 1024, "layer_norm_bwd_rows": 512},
    "softmax_dropout.cu": {"softmax_dropout_fwd_rows": 1024, "softmax_dropout_bwd_rows": 1024},
    "residual_layer_norm.cu": {"residual_layer_norm_fwd": 1024, "residual_layer_norm_bwd": 256},
}
ENTRY_POINTS = {
    "adamw.cu": [f"{k}_{g}_{low}" for k in ("adamw", "adamw_multi") for g in DTYPES for low in ("none", "f16", "bf16")]
    + [f"check_finite_{d}" for d in DTYPES],
    "bias_dropout_residual.cu": [f"{k}_{d}" for k in ("bias_dropout_residual_fwd", "dropout_bwd") for d in DTYPES],
    "bias_gelu.cu": [f"{k}_{d}" for k in ("bias_gelu_fwd", "bias_gelu_bwd") for d in DTYPES],
    "layer_norm.cu": [
        f"{k}_{d}"
        for k in ("layer_norm_fwd", "layer_norm_bwd_input", "layer_norm_bwd_params", *ROW_KERNELS["layer_norm.cu"])
        for d in DTYPES
    ],
    "quantize.cu": [f"{k}_{d}" for k in ("quantize_blocks", "dequantize_blocks") for d in DTYPES],
    "reduce.cu": [f"column_sum_partial_{d}" for d in DTYPES],
    "residual_layer_norm.cu": [f"{k}_{d}" for k in ROW_KERNELS["residual_layer_norm.cu"] for d in DTYPES],
    "softmax_dropout.cu": [
        f"{k}_{d}"
        for k in ("softmax_dropout_fwd", "softmax_dropout_bwd", *ROW_KERNELS["softmax_dropout.cu"])
        for d in DTYPES
    ],
}


# An sm_XX compile runs the same front end as compute_XX (the same __CUDA_ARCH__, so the same messages) and gives
# the same PTX but for its .target line (compared for every source on 2026-12-05), then ptxas: compute_90 would add
# nothing but time. compute_80 is kept: the PTX-only compile the emulator reads signatures from (cuda_emulator.py).
ARCHS = ("compute_80", "sm_80", "sm_90")


@pytest.fixture(scope="module", autouse=True)
def _compiled_side_by_side():
    """Every source for every architecture, on every core, once for the module's tests."""
    compile_in_parallel([(source, arch) for source in SOURCES for arch in ARCHS])


def test_every_source_is_listed():
    assert sorted(p.name for p in source_dir().glob("*.cu")) == sorted(SOURCES) == sorted(ENTRY_POINTS)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_without_warnings(source, arch):
    result = compiled(source, arch)
    assert result.ok and result.log == "", f"{source} for {arch} compiled with messages:\n{result.log}"
    entries = set(re.findall(r"\.entry (\w+)", result.ptx))  # PTX names every extern "C" entry point
    assert entries == set(ENTRY_POINTS[source])
    if arch.startswith("sm_"):
        assert result.cubin[:4] == b"\x7fELF"  # a cubin is an ELF image


# Kernels launched with up to 1024 threads a block (the looping row kernels: loader's _row_block) must fit one
# such block in an SM's 65536 registers: 64 a thread. The register-resident row kernels declare their largest
# block with __launch_bounds__, and ptxas keeps them within 65536 / that (or spills, which fails below).
LOOPING_ROW_KERNELS = ("layer_norm_fwd", "layer_norm_bwd_input", "softmax_dropout_fwd", "softmax_dropout_bwd")


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_no_kernel_spills_and_row_kernels_fit_1024_threads(source, arch):
    """Proxies for speed that fail when a change throws the design away: registers spilled to local memory,
    or a row kernel whose 1024-thread block no longer fits an SM's register file."""
    report = compiled(source, arch).report
    assert set(report) == set(ENTRY_POINTS[source])
    for name, numbers in report.items():
        assert numbers["spill stores"] == numbers["spill loads"] == numbers["stack frame"] == 0, (arch, name, numbers)
        kernel = name.rsplit("_", 1)[0]
        if kernel in LOOPING_ROW_KERNELS:
            assert numbers["registers"] <= 64, (arch, name, numbers)
        block = ROW_KERNELS.get(source, {}).get(kernel)
        if block is not None:
            assert numbers["registers"] <= 65536 // block, (arch, name, numbers)


# Kernels whose main loop moves 16 bytes per load (8 fp16/bf16 values): latency-bound 2-byte loads are what
# kept the 16-bit kernels far from the memory bandwidth.
VECTOR_LOADS = {
    "bias_gelu.cu": ["bias_gelu_fwd", "bias_gelu_bwd"],
    "bias_dropout_residual.cu": ["bias_dropout_residual_fwd", "dropout_bwd"],
    **{source: list(kernels) for source, kernels in ROW_KERNELS.items()},
}


@pytest.mark.parametrize("source", sorted(VECTOR_LOADS))
def test_16_bit_kernels_load_16_bytes_at_a_time(source):
    """Every 16-bit elementwise kernel, and every row kernel in each dtype (their path for rows of whole aligned
    packs)."""
    ptx = compiled(source, "sm_90").ptx
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)(?=\.entry |\Z)", ptx, re.S))
    for kernel in VECTOR_LOADS[source]:
        for dtype in ("f32", "f16", "bf16") if kernel in ROW_KERNELS.get(source, {}) else ("f16", "bf16"):
            assert re.search(r"ld\.global(\.nc)?\.v4\.u32", bodies[f"{kernel}_{dtype}"]), f"{kernel}_{dtype}"


def test_compile_all_compiles_the_sources_side_by_side(monkeypatch):
    """loader.compile_all through a stand-in for CuPy whose modules compile with NVRTC (to PTX): every source
    compiles, and two of them are compiling at the same moment (a barrier the first two must pass together:
    one after the other, it times out)."""
    compiled, meeting = [], threading.Barrier(2, timeout=60)

    class RawModule:
        def __init__(self, code: str, options: tuple) -> None:
            self.code, self.options = code, options

        def compile(self) -> None:
            with lock:
                first_two = len(compiled) < 2
                compiled.append(self.code)
            if first_two:
                meeting.wait()
            program = _check(nvrtc.nvrtcCreateProgram(self.code.encode(), b"source.cu", 0, [], []))
            options = [o.encode() for o in (*self.options, "-arch=compute_90")]
            assert nvrtc.nvrtcCompileProgram(program, len(options), options)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
            _check(nvrtc.nvrtcDestroyProgram(program))

    lock = threading.Lock()
    device = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    cupy = types.SimpleNamespace(RawModule=RawModule, cuda=device)
    monkeypatch.setattr(loader, "_cupy", lambda: cupy)
    loader._module.cache_clear()
    try:
        loader.compile_all(device=0)
    finally:
        loader._module.cache_clear()
    assert sorted(compiled) == sorted((source_dir() / s).read_text() for s in SOURCES)
