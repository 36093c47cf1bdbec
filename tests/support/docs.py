"""The README's and the docs' code blocks and references, as the docs tests read them.

[Note: snippets]
Every fenced block of README.md and docs/**/*.md is a snippet. An HTML comment on the line right before its
fence (invisible on the rendered page) says how it runs: ``<!-- snippet: ranks=2 -->``. Keys:

- ``ranks=2``: Python runs on 2 ranks of the test pool (each rank runs the block, as under a launcher);
  default 1, in the pytest process. A page's Python blocks with the same ``ranks`` run in page order in one
  namespace and one scratch working directory (a tutorial's later blocks use what earlier ones made);
  ``pycon`` blocks are doctests in that namespace, their printed output compared.
- ``session=NAME``: the block runs in the page's session NAME instead (fresh processes' state: a plain
  script's ``initialize`` after a Trainer, whose teardown removed the launcher's ``WORLD_SIZE``).
- ``gpu``: needs a CUDA GPU; skipped without one (still compiled, its names checked).
- ``skip="why"``: cannot run on one machine (several nodes, SLURM): compiled, its names and paths checked,
  never run; each is a skipped test that gives the reason.
- ``id=NAME``: a command a test under tests/e2e runs itself (``snippet_command(NAME)``), with what it adds
  said there (a shorter run).
- ``setup=NAME``: the scratch directory is prepared first (``checkpoint``: a stage-2 checkpoint at
  ``ckpts/last.ckpt``).

Shell blocks: each command (continuation lines joined, comments dropped) that starts with ``lightning-zero``
runs in this process through ``cli.main``, except Lightning's subcommands, which are parsed in full
(``--print_config``: every option and config file checked) but not trained; any other command needs ``id``
or ``skip``. A ``console`` block is a terminal session: each ``$ lightning-zero ...`` line runs the same way and
the lines after it are what it must print (``...`` stands for any text, whitespace is compared loosely).
``text``, ``yaml`` and ``json`` blocks are shown, not run.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.support.helpers import REPO

# A fence: its indentation, its backticks or tildes, the language and anything after it (an info string).
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w-]*)(?P<info>.*)$")
ATTRS = re.compile(r"^\s*<!--\s*snippet:(?P<attrs>.*?)-->\s*$")
KEYS = {"ranks", "session", "gpu", "skip", "id", "setup"}
RUN_LANGS = {"python", "pycon", "bash", "console"}
SHOWN_LANGS = {"text", "yaml", "json"}
# A reference to the package's API in prose or code: ``lightning_zero.checkpoint.format.latest``.
NAME = re.compile(r"(?<![\w/.])lightning_zero(?:\.[A-Za-z_]\w*)+")
# A path into the repository in inline code or a link: ``configs/gpt.yaml``, ``sharding/stage3.py``.
PATH_ROOTS = ("configs", "examples", "benchmarks", "tests", "lightning_zero", "cuda_kernels", "cpu_kernels", "docs")
PACKAGE_DIRS = tuple(p.name for p in (REPO / "lightning_zero").iterdir() if p.is_dir() and p.name[0] != "_")
PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|md|json|sh|cu|cuh|c|svg|toml))(?![\w/])")


@dataclass(frozen=True)
class Snippet:
    """One fenced block: where it is, its language, its text and its ``<!-- snippet: -->`` keys."""

    path: Path
    line: int
    lang: str
    code: str
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def ranks(self) -> int:
        return int(self.attrs.get("ranks", "1"))


def markdown_files() -> list[Path]:
    """README.md and every page of the docs site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def parse_attrs(text: str, where: str) -> dict[str, str]:
    """``ranks=2 gpu skip="why"`` -> {"ranks": "2", "gpu": "", "skip": "why"}; an unknown key raises."""
    attrs = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        if key not in KEYS:
            raise ValueError(f"{where}: unknown snippet key {key!r} (known: {', '.join(sorted(KEYS))})")
        attrs[key] = value
    return attrs


def snippets(path: Path) -> list[Snippet]:
    """The fenced blocks of one markdown file, in order."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        where = f"{path.relative_to(REPO)}:{i + 1}"
        if opening["info"].strip():
            raise ValueError(f"{where}: a fence with more than its language ({lines[i].strip()!r}): not supported here")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise ValueError(f"{where}: a code fence that is never closed")
        marker = ATTRS.match(lines[i - 1]) if i else None
        attrs = parse_attrs(marker["attrs"], where) if marker else {}
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
        found.append(Snippet(path, i + 1, opening["lang"], code, attrs))
        if attrs.get("ranks", "1") not in ("1", "2"):
            raise ValueError(f"{where}: ranks={attrs['ranks']}: the docs' blocks run on 1 or 2 ranks")
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for path in markdown_files() for s in snippets(path)]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(line.split(" #")[0].strip())
    return commands


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's leading ``NAME=value`` assignments, and the command after them."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    return env, argv


def console_session(code: str) -> list[tuple[str, str]]:
    """A ``console`` block's (command, expected output) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:].strip(), []))
        elif pairs:
            pairs[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"a console block starts with '$ command', got {line!r}")
    return [(command, "\n".join(out).strip() + "\n") for command, out in pairs]


def snippet_command(snippet_id: str) -> list[str]:
    """The argv of the one command (the last of an ``&&`` chain) of the shell snippet ``id=snippet_id``."""
    matches = [s for s in all_snippets() if s.attrs.get("id") == snippet_id]
    assert len(matches) == 1, f"snippet id={snippet_id}: {len(matches)} snippets have it"
    (command,) = shell_commands(matches[0].code)
    return shlex.split(command.split("&&")[-1])


def names(text: str) -> set[str]:
    """Every ``lightning_zero.x.y`` the text mentions."""
    return {m.rstrip(".") for m in NAME.findall(text)}


def repo_paths(text: str) -> set[str]:
    """Every path into the repository the text mentions (a top-level folder's, or the package's by its
    folders: ``sharding/stage3.py``)."""
    return {p for p in PATH.findall(text) if p.split("/")[0] in PATH_ROOTS + PACKAGE_DIRS}


def resolve_path(path: str) -> Path | None:
    """The file a mentioned path names (from the repository's root, else from the package's), or None."""
    for base in (REPO, REPO / "lightning_zero", REPO / "docs"):
        if (base / path).exists():
            return base / path
    return None


# --- running them -----------------------------------------------------------------------------------------
def runnable(snippet: Snippet) -> bool:
    """Whether the docs tests run the block themselves (not skipped, not a GPU's here, not an e2e test's)."""
    gpu_ok = "gpu" not in snippet.attrs or torch.cuda.is_available()
    return "skip" not in snippet.attrs and "id" not in snippet.attrs and gpu_ok


@dataclass(frozen=True)
class Session:
    """A page's Python and doctest blocks that run together: on ``ranks`` ranks, in page order, one namespace."""

    page: Path
    name: str
    blocks: tuple[Snippet, ...]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}::{self.name}"


def sessions(ranks: int) -> list[Session]:
    """Every page's sessions of ``ranks`` ranks."""
    found = []
    for page in markdown_files():
        blocks = [s for s in snippets(page) if s.lang in ("python", "pycon") and s.ranks == ranks and runnable(s)]
        for name in dict.fromkeys(s.attrs.get("session", "main") for s in blocks):
            found.append(Session(page, name, tuple(s for s in blocks if s.attrs.get("session", "main") == name)))
    return found


def prepare(scratch: Path, blocks: Iterable[Snippet], stage2_checkpoint: Path) -> None:
    """The scratch working directory of a session: the repository's configs and examples, as in a clone, and
    what the blocks' ``setup=`` asks for."""
    for name in ("configs", "examples"):
        (scratch / name).symlink_to(REPO / name)
    for setup in {s.attrs["setup"] for s in blocks if "setup" in s.attrs}:
        if setup != "checkpoint":
            raise ValueError(f"unknown setup={setup}")
        shutil.copytree(stage2_checkpoint, scratch / "ckpts" / "last.ckpt")


def run_python(blocks: Iterable[Snippet], namespace: dict) -> None:
    """Runs a session's blocks in order in one namespace; a ``pycon`` block's printed output must match."""
    for block in blocks:
        if block.lang == "pycon":
            test = doctest.DocTestParser().get_doctest(block.code, namespace, block.where, str(block.path), block.line)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            if runner.failures:
                raise AssertionError(f"{block.where}: the output differs from the docs' (above)")
        else:
            try:
                exec(compile(block.code, str(block.path), "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"{block.where}: the block raised {type(error).__name__}: {error}") from error


def run_session(rank: int, world_size: int, blocks: tuple[Snippet, ...], scratch: str) -> None:
    """A rank's part of a session on the test pool: the blocks in the shared scratch directory."""
    os.chdir(scratch)
    run_python(blocks, {"__name__": "__docs__"})
