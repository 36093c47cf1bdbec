"""The benchmark figures of the docs (benchmarks/plot_results.py, drawn when the site is built) are the results
files' numbers: every figure is drawn, the same inputs give the same bytes, and a results file that lacks what a
figure needs is one error naming the file, never an empty or wrong figure."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from tests.support.helpers import REPO

RESULTS = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def plots():
    spec = importlib.util.spec_from_file_location("plot_results", REPO / "benchmarks" / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_every_figure_is_drawn_from_its_results_and_the_same_twice(plots, tmp_path):
    figures = plots.render(RESULTS, tmp_path / "a")
    assert len(figures) == 8 and all(f.stat().st_size > 5_000 for f in figures)
    memory = (tmp_path / "a" / "memory_per_rank.svg").read_text()
    source = plots.newest(RESULTS, "zero_cpu_gpt6.4M_*.md")
    assert source.name in memory  # the figure names its source
    table = plots.read_table(source, 0)
    total = sum(plots.number(table, "zero3", f"{c} MiB (formula)") for c in ("params", "grads", "optimizer state"))
    assert f"{total:.1f}" in memory  # zero3's bar is the file's numbers
    again = plots.render(RESULTS, tmp_path / "b")
    assert [f.read_bytes() for f in again] == [f.read_bytes() for f in figures]


def test_a_results_file_without_what_a_figure_needs_is_one_error_naming_it(plots, tmp_path):
    source = plots.newest(RESULTS, "zero_cpu_gpt6.4M_*.md")
    broken = tmp_path / source.name
    shutil.copy(source, broken)
    broken.write_text(broken.read_text().replace("grads MiB (formula)", "gradients MiB"))
    with pytest.raises(ValueError, match=source.name):
        plots.plot_memory_per_rank(broken, tmp_path / "memory.svg")
