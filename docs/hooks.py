"""MkDocs hooks: the pages made at build time from the code and the results, so none of them can drift.

- ``reference/cli.md``: the ``--help`` of ``lightning-zero`` and of each of its subcommands, as a user's
  terminal shows it (the subcommands are the CLI's own lists, so a new one is rendered without an edit here);
- ``figures/*.svg``: the benchmark reports under ``benchmarks/results/`` drawn by ``benchmarks/plot_results.py``.
Nothing generated is written into ``docs/`` or committed.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]


def command_help(args: list[str]) -> str:
    """What ``lightning-zero ARGS --help`` prints (100 columns, as a terminal of that width shows it; the process's
    ``sys.argv`` and ``COLUMNS`` are put back)."""
    from lightning_zero.cli.main import main

    out, argv, columns = io.StringIO(), sys.argv, os.environ.get("COLUMNS")
    sys.argv = ["lightning-zero", *args, "--help"]  # the program's name in the usage line
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main()  # (None: the command line, as the console script runs it)
    finally:
        sys.argv = argv
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    text = out.getvalue().strip()
    if not text:
        raise RuntimeError(f"lightning-zero {' '.join(args)} --help printed nothing")
    return text


def cli_reference() -> str:
    """The CLI reference page: every subcommand's ``--help``."""
    from lightning_zero.cli.main import LIGHTNING_COMMANDS, OWN_COMMANDS

    parts = [
        "# CLI reference",
        "",
        "`lightning-zero` is installed with the package (`pip install -e .`). This page is generated from the",
        "commands' own `--help` when the docs are built. Every command answers bad input with one line,",
        "`lightning-zero <command>: error: ...`, and exit code 2, before anything starts; `--debug` shows the",
        "traceback instead. Guides: [Configs, CLI, Hydra, DeepSpeed JSON](../configs-and-cli.md),",
        "[The estimator](../estimator.md), [Checkpoints](../checkpoints.md).",
    ]
    parts += ["", "## `lightning-zero`", "", "```text", command_help([]), "```"]
    for command in (*LIGHTNING_COMMANDS, *OWN_COMMANDS):
        parts += ["", f"## `lightning-zero {command}`", "", "```text", command_help([command]), "```"]
    return "\n".join(parts) + "\n"


def on_files(files, config):
    """Adds the generated CLI page and the benchmark figures to the site's files."""
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from plot_results import render
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    with tempfile.TemporaryDirectory(prefix="lightning_zero_figures_") as out_dir:
        for figure in render(REPO / "benchmarks" / "results", Path(out_dir)):
            files.append(File.generated(config, f"figures/{figure.name}", content=figure.read_bytes()))
    return files
