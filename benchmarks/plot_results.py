"""Render the benchmark results in benchmarks/results/ as SVG figures for the documentation site.

Each figure reads one results file (a markdown report: a ``#`` title, a header line with the date and the machine,
markdown tables; or the JSON loss curves of the ZeRO++ convergence run) and names that file, the machine and the
date under the plot, so a reader knows where the numbers come from. A file that lacks a table, column, row or
number a figure needs raises ValueError naming the file and what is missing: no figure is drawn empty or wrong.

    python benchmarks/plot_results.py --out docs/figures [--results benchmarks/results]

Needs matplotlib (the project's ``docs`` extra), imported only when rendering; importing this module needs the
standard library alone. The same results files give byte-identical SVGs, so regenerated figures show up in a diff
only when the numbers change.
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# A fixed hash salt and no date make the SVG ids and metadata stable; fonttype "none" keeps text as <text>.
STYLE = {"svg.hashsalt": "lightning_zero", "svg.fonttype": "none", "font.size": 9, "axes.grid": True}
STYLE |= {"grid.alpha": 0.3, "axes.axisbelow": True, "legend.fontsize": 8}
FAMILY_COLORS = {"torch": "#7f7f7f", "lightning": "#7f7f7f", "fsdp2": "#9467bd", "deepspeed": "#ff7f0e"}
NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"  # 830.3, 1,598,720, .5, -0.03


@dataclass(frozen=True)
class Table:
    """One markdown table of a results file: the heading above it, its header cells and its rows, as text."""

    source: str  # "<file>, table <i> (<heading>)": what error messages name
    heading: str
    columns: list[str]
    rows: list[list[str]]


def read_tables(path: Path) -> list[Table]:
    """All markdown tables of ``path`` in order, each with the nearest ``#`` heading above it."""
    tables: list[Table] = []
    heading, block = "", []
    for line in [*path.read_text().splitlines(), ""]:
        text = line.strip()
        if text.startswith("|"):
            # Strip one pipe at each end only: an empty last cell must stay a cell.
            block.append([c.strip() for c in text[1:].removesuffix("|").split("|")])
            continue
        if block:
            source = f"{path.name}, table {len(tables)} ({heading or 'no heading'})"
            for cells in block[2:]:  # block[1] is the |---| separator line
                if len(cells) != len(block[0]):
                    raise ValueError(f"{source}: row {cells} has {len(cells)} cells, the header {len(block[0])}")
            tables.append(Table(source, heading, block[0], block[2:]))
            block = []
        if text.startswith("#"):
            heading = text.lstrip("#").strip()
    return tables


def read_table(path: Path, which: int | str = 0) -> Table:
    """The table of ``path`` at index ``which``, or the first one under a heading containing the text ``which``."""
    tables = read_tables(path)
    found = [t for i, t in enumerate(tables) if (i == which if isinstance(which, int) else which in t.heading)]
    if not found:
        raise ValueError(f"{path.name}: no table {which!r}; its tables are under {[t.heading for t in tables]}")
    return found[0]


def cell(table: Table, key: str | int, column: str) -> str:
    """The text in ``column`` of the row whose first cell is ``key`` (a str) or of row number ``key`` (an int)."""
    if column not in table.columns:
        raise ValueError(f"{table.source}: no column {column!r}; columns: {table.columns}")
    keys = [r[0] for r in table.rows]
    if isinstance(key, int) and not 0 <= key < len(keys) or isinstance(key, str) and key not in keys:
        raise ValueError(f"{table.source}: no row {key!r}; rows: {keys}")
    row = table.rows[key if isinstance(key, int) else keys.index(key)]
    return row[table.columns.index(column)]


def _parse(table: Table, key: str | int, column: str, pattern: str) -> list[float]:
    text = cell(table, key, column)
    match = re.fullmatch(pattern, text)
    if not match:
        raise ValueError(f"{table.source}: row {key!r}, column {column!r}: cannot read {text!r} as a number")
    return [float(g.replace(",", "")) for g in match.groups()]


def number(table: Table, key: str | int, column: str) -> float:
    """A number such as "1,598,720", "830.3" or "1.02x"; a parenthesis after it ("24.20 (24.20)") is ignored."""
    return _parse(table, key, column, rf"({NUMBER})\s*x?(?:\s*\(.*\))?")[0]


def span(table: Table, key: str | int, column: str) -> tuple[float, float]:
    """A range such as "794.3-850.3" or "1.37 - 1.60" as (low, high)."""
    low, high = _parse(table, key, column, rf"({NUMBER})\s*-\s*({NUMBER})")
    return low, high


def median_span(table: Table, key: str | int, column: str) -> tuple[float, float, float]:
    """A median with its range in parentheses, such as "1419 (1138-1659)", as (median, low, high)."""
    median, low, high = _parse(table, key, column, rf"({NUMBER})\s*\(\s*({NUMBER})\s*-\s*({NUMBER})\s*\)")
    return median, low, high


def read_header(path: Path) -> tuple[str, str, str]:
    """(title, machine, date) of a markdown results file, from its ``#`` title and its date / machine line."""
    lines = path.read_text().splitlines()
    title = next((line[2:].strip() for line in lines if line.startswith("# ")), path.stem)
    header = next((line for line in lines if re.match(r"(- )?(date|machine):", line, re.IGNORECASE)), "")
    dates = re.findall(r"\d{4}-\d{2}-\d{2}", f"{header} {title} {path.name}")
    if not dates:
        raise ValueError(f"{path.name}: no date in its header line, title or name")
    # The header line mixes machine, versions and workload ("date: ...; machine: AMD EPYC, 2 cores; torch ...");
    # keep the short parts that describe the hardware and the process group.
    parts = [re.sub(r"^(machine|date):\s*", "", p.strip(), flags=re.IGNORECASE) for p in header.lstrip("- ").split(";")]
    machine = "; ".join(
        p for p in parts if len(p) <= 50 and re.search(r"\b(cores?|threads?|ranks?|nodes?|gloo|nccl|GPUs?)\b", p)
    )
    if not machine:  # e.g. the convergence report, whose title says "(..., 4 CPU ranks as 2 nodes of 2)"
        machine = next(iter(re.findall(r"([^(,]*\branks?\b[^),]*)", title)), "").strip()
    if not machine:
        raise ValueError(f"{path.name}: no machine in its header line or title")
    return title, machine, dates[0]


def _figure(path: Path, source: Path | None = None, panels: tuple[int, int] = (1, 1), size=(7.0, 4.0)):
    """A figure titled by the report ``path`` with the machine, date and ``source`` file (default: path) below."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to disturb

    title, machine, date = read_header(path)
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(*panels, squeeze=False).ravel()
    fig.suptitle(textwrap.fill(title, 90))
    note = f"{machine}; {date}. Source: benchmarks/results/{(source or path).name}"
    fig.supxlabel(textwrap.fill(note, int(size[0] * 18)), fontsize=7, color="0.35")
    return fig, axes


def _save(fig, out: Path) -> Path:
    fig.savefig(out, format="svg", metadata={"Date": None})
    return out


def plot_memory_per_rank(path: Path, out: Path) -> Path:
    """Stacked bars: parameters, gradients and optimizer state in MiB per rank for ddp and zero1..3."""
    table, strategies = read_table(path, 0), ["ddp", "zero1", "zero2", "zero3"]
    fig, (ax,) = _figure(path)
    bottom = [0.0] * len(strategies)
    for label, column in [("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optimizer state")]:
        values = [number(table, s, f"{column} MiB (formula)") for s in strategies]  # measured, before the formula
        ax.bar(strategies, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (i, total), ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    ax.set(ylabel="MiB per rank", title="Bytes per rank, measured")
    ax.legend()
    return _save(fig, out)


def plot_step_time(path: Path, out: Path) -> Path:
    """Horizontal bars: median step time with the IQR as error bars per system, and the ratio to lightning-ddp."""
    table = read_table(path, 0)
    systems = [row[0] for row in table.rows]
    cell(table, "lightning-ddp", "vs lightning-ddp")  # the baseline of the ratios must be there
    fig, (ax,) = _figure(path, size=(7.0, 4.5))
    for y, system in enumerate(systems):
        median, (low, high) = number(table, system, "median step (ms)"), span(table, system, "IQR (ms)")
        color = FAMILY_COLORS.get(system.split("-")[0], "#1f77b4")  # lightning_zero's zero1..3 in blue
        ax.barh(y, median, xerr=[[median - low], [high - median]], color=color, capsize=3)
        ratio = number(table, system, "vs lightning-ddp")
        ax.annotate(f"{ratio:.2f}x", (high, y), va="center", xytext=(4, 0), textcoords="offset points", fontsize=8)
    ax.set_yticks(range(len(systems)), systems)
    ax.invert_yaxis()  # table order, top to bottom
    ax.margins(x=0.12)
    ax.set(xlabel="median step (ms); error bars: IQR; labels: ratio to lightning-ddp", title="Step time")
    return _save(fig, out)


def plot_link(path: Path, out: Path) -> Path:
    """Cross-node bytes per step relative to plain, measured and modelled; step times on the limited link."""
    tables = read_tables(path)
    bytes_table = read_table(path, 0)
    fig, axes = _figure(path, panels=(1, min(len(tables), 2)), size=(9.0 if len(tables) > 1 else 6.0, 4.0))
    configs = [row[0] for row in bytes_table.rows]
    measured = [number(bytes_table, c, "ratio to plain") for c in configs]
    model = [number(bytes_table, c, "model") / number(bytes_table, "plain", "model") for c in configs]
    x = range(len(configs))
    bars = axes[0].bar([i - 0.2 for i in x], measured, 0.4, label="measured (veth bytes)")
    axes[0].bar([i + 0.2 for i in x], model, 0.4, label="model (comm_model)", color="#aec7e8")
    axes[0].bar_label(bars, fmt="%.2f", fontsize=7)
    axes[0].set_xticks(x, configs)
    axes[0].set(ylabel="cross-node bytes per step / plain", title=textwrap.fill(bytes_table.heading, 45))
    axes[0].legend()
    if len(tables) > 1:  # the second table: step times with the link limited
        times = read_table(path, 1)
        stats = [median_span(times, i, "step s") for i in range(len(times.rows))]
        labels = [textwrap.fill(row[0], 22) for row in times.rows]
        errors = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
        bars = axes[1].bar(labels, [m for m, _, _ in stats], yerr=errors, capsize=3, color="#2ca02c")
        axes[1].bar_label(bars, fmt="%.3f", fontsize=7, padding=2)
        axes[1].tick_params(axis="x", labelsize=7)
        axes[1].margins(y=0.12)  # room for the value above the tallest bar
        axes[1].set(ylabel="step (s); error bars: min-max", title=textwrap.fill(times.heading, 45))
    return _save(fig, out)


def plot_convergence(path: Path, out: Path) -> Path:
    """Loss per step of every run in the JSON file, and each run's difference to the first one."""
    curves = json.loads(path.read_text())
    if not isinstance(curves, dict) or not curves:
        raise ValueError(f"{path.name}: expected a non-empty object run name -> list of losses")
    for name, losses in curves.items():
        if not losses or not all(isinstance(v, (int, float)) for v in losses):
            raise ValueError(f"{path.name}: run {name!r} is not a non-empty list of numbers")
    # The curves lie on top of each other, so the lower panel shows the differences to the first run.
    fig, (top, bottom) = _figure(path.with_suffix(".md"), source=path, panels=(2, 1), size=(7.0, 5.5))
    first_name, first = next(iter(curves.items()))
    for (name, losses), style in zip(curves.items(), ["-", "--", ":", "-."] * len(curves)):
        line = top.plot(range(1, len(losses) + 1), losses, style, label=name, linewidth=1)[0]
        if name != first_name:
            diff = [a - b for a, b in zip(losses, first)]
            bottom.plot(range(1, len(diff) + 1), diff, style, color=line.get_color(), linewidth=0.8)
    top.set(ylabel="loss (mean over ranks)", title="Training loss")
    bottom.set(xlabel="step", ylabel=f"loss - {first_name}")
    top.legend()
    return _save(fig, out)


def plot_largest_model(path: Path, out: Path) -> Path:
    """MiB per rank against parameters for ddp and zero3, with the memory budget as a horizontal line."""
    table = read_table(path, 0)
    budget = re.findall(r"(\d+(?:\.\d+)?) ?MiB", f"{read_header(path)[0]} {path.name}")
    if not budget:
        raise ValueError(f"{path.name}: no 'N MiB' budget in its title or name")
    fig, (ax,) = _figure(path)
    psi = [number(table, i, "Psi") / 1e6 for i in range(len(table.rows))]
    for label, column in [("ddp", "ddp MiB"), ("zero3 (shards + transient)", "zero3 MiB (shards + transient)")]:
        mib = [number(table, i, column) for i in range(len(table.rows))]
        line = ax.plot(psi, mib, "o-", label=label, markersize=4)[0]
        fits = [(p, m) for p, m in zip(psi, mib) if m <= float(budget[0])]
        if fits:  # ring the largest model that fits
            ax.plot(*fits[-1], "o", markersize=10, fillstyle="none", color=line.get_color())
            label = f"largest: {fits[-1][0]:.1f} M"
            ax.annotate(label, fits[-1], xytext=(6, -12), textcoords="offset points", fontsize=8)
    ax.axhline(float(budget[0]), color="#d62728", linestyle="--", label=f"budget {budget[0]} MiB per rank")
    ax.set(xlabel="parameters (millions)", ylabel="MiB per rank", title="Memory per rank against model size")
    ax.legend()
    return _save(fig, out)


def plot_offload_step(path: Path, out: Path) -> Path:
    """Grouped bars: millions of parameters per second of the host AdamW step, median with min-max error bars."""
    table = read_table(path, "Host AdamW step (fp32)")
    optimizers = ["lightning_zero host AdamW", "DeepSpeedCPUAdam", "torch AdamW fused"]
    rows = range(len(table.rows))
    groups = [
        f"{cell(table, i, 'parameters')}, {cell(table, i, 'threads')} thr.\n{cell(table, i, 'tensors')}" for i in rows
    ]
    fig, (ax,) = _figure(path, size=(9.0, 4.0))
    width = 0.8 / len(optimizers)
    for k, optimizer in enumerate(optimizers):
        stats = [median_span(table, i, optimizer) for i in rows]
        xs = [i + (k - (len(optimizers) - 1) / 2) * width for i in rows]
        errors = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
        ax.bar(xs, [m for m, _, _ in stats], width, yerr=errors, capsize=2, label=optimizer)
    ax.set_xticks(rows, groups, fontsize=7)
    ax.set(ylabel="million parameters / s; error bars: min-max", title=textwrap.fill(table.heading, 80))
    ax.title.set_fontsize(8)
    ax.margins(y=0.15)  # room for the legend above the bars
    ax.legend(ncols=3, loc="upper left")
    return _save(fig, out)


def plot_nvme_step(path: Path, out: Path) -> Path:
    """Per round: the step with its state on NVMe against its I/O alone and its work alone."""
    table = read_table(path, 0)
    rounds = [i for i, row in enumerate(table.rows) if row[0].isdigit()]  # the "median" row has no times
    if not rounds:
        raise ValueError(f"{table.source}: no numbered rounds")
    fig, (ax,) = _figure(path)
    columns = ["step s", "I/O alone s", "work alone s"]
    for k, column in enumerate(columns):
        xs = [j + (k - 1) * 0.27 for j in range(len(rounds))]
        ax.bar(xs, [number(table, i, column) for i in rounds], 0.27, label=column.removesuffix(" s"))
    ax.set_xticks(range(len(rounds)), [f"round {table.rows[i][0]}" for i in rounds])
    ax.set(ylabel="seconds", title="The step against its I/O alone and its work alone")
    ax.margins(y=0.15)
    ax.legend(ncols=3, loc="upper left")
    return _save(fig, out)


def plot_nvme_io(path: Path, out: Path) -> Path:
    """Bars: median GB/s of dd and of the swap files' direct I/O, min-max error bars, swap / dd annotated."""
    table = read_table(path, 0)
    transfers = [row[0] for row in table.rows]
    fig, (ax,) = _figure(path, size=(6.0, 4.0))
    for x, transfer in enumerate(transfers):
        median, (low, high) = number(table, transfer, "median GB/s"), span(table, transfer, "min - max")
        color = "#1f77b4" if transfer.startswith("swap") else "#7f7f7f"
        ax.bar(x, median, yerr=[[median - low], [high - median]], capsize=3, color=color)
        if cell(table, transfer, "swap / dd"):  # only the swap rows have a ratio
            ratio = number(table, transfer, "swap / dd")
            label = f"{ratio:.2f}x dd {transfer.split()[-1]}"  # swap write / dd write, swap read / dd read
            ax.annotate(label, (x, high), ha="center", xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(transfers)), transfers)
    ax.set(ylabel="GB/s (median); error bars: min-max", title="Direct I/O throughput")
    return _save(fig, out)


def newest(results_dir: Path, pattern: str) -> Path:
    """The file matching the glob ``pattern`` with the latest YYYY-MM-DD date in its name."""
    dated = [(re.findall(r"\d{4}-\d{2}-\d{2}", p.name), p) for p in results_dir.glob(pattern)]
    dated = [(dates[-1], p) for dates, p in dated if dates]
    if not dated:
        raise ValueError(f"{results_dir}: no dated file matches {pattern!r}")
    return max(dated)[1]


def render(results_dir: Path, out_dir: Path) -> list[Path]:
    """Write every figure as an SVG file into ``out_dir`` (created if missing) and return their paths."""
    import matplotlib

    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [
        ("memory_per_rank.svg", plot_memory_per_rank, newest(results_dir, "zero_cpu_gpt6.4M_*.md")),
        ("step_time_vs_peers.svg", plot_step_time, newest(results_dir, "compare_cpu_gpt14M_*.md")),
        ("zero_plus_plus_link.svg", plot_link, results_dir / "zero_plus_plus_link_cpu_2026-12-02.md"),
        ("convergence.svg", plot_convergence, results_dir / "zero_plus_plus_convergence_cpu_2026-12-02.json"),
        ("largest_model.svg", plot_largest_model, results_dir / "largest_model_64MiB_4ranks_2026-11-30.md"),
        ("offload_step.svg", plot_offload_step, results_dir / "offload_cpu_2026-12-01.md"),
        ("nvme_step.svg", plot_nvme_step, results_dir / "nvme_step_cpu_2026-12-05.md"),
        ("nvme_io.svg", plot_nvme_io, results_dir / "nvme_io_cpu_2026-12-05.md"),
    ]
    # rc_context: the style applies to these figures only, and is read again at savefig (the hash salt).
    with matplotlib.rc_context(STYLE):
        return [plot(source, out_dir / name) for name, plot, source in figures]


def main(argv: list[str] | None = None) -> None:
    """Command line: render the figures from --results into --out and print each file written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the SVG files")
    args = parser.parse_args(argv)
    for path in render(args.results, args.out):
        print(path)


if __name__ == "__main__":
    main()
