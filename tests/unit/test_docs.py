"""The README and the docs say what the code does: every block runs or is checked (tests/support/docs.py's
Note), every ``lightning_zero.x.y`` they name exists, every repository path they name is there, and the
reference pages cover the whole exported API. Blocks that need 2 ranks run in tests/dist/test_docs_snippets.py."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import re
import shlex

import pytest

import lightning_zero
from lightning_zero.cli.main import ZeroCLI
from tests.support import docs
from tests.support.helpers import REPO, run_cli

SNIPPETS = docs.all_snippets()
# Counts that go stale with every change are not written in the docs: the suite's output says them.
NUMBER = r"(?:\d[\d,]*|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve)"
STALE_CLAIMS = {
    rf"\b{NUMBER} (?:tests|passed|cases)\b": "a count of tests",
    rf"\b{NUMBER} (?:CUDA |kernel )?sources\b": "a count of the kernel sources (a doctest shows loader.SOURCES)",
}


def _id(snippet: docs.Snippet) -> str:
    return snippet.where


def test_the_readme_is_read_in_five_minutes():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def test_every_block_says_how_it_runs():
    problems = []
    for s in SNIPPETS:
        if s.lang not in docs.RUN_LANGS | docs.SHOWN_LANGS:
            problems.append(f"{s.where}: language {s.lang!r}: use one of {sorted(docs.RUN_LANGS | docs.SHOWN_LANGS)}")
        elif s.lang == "python":
            compile(s.code, s.where, "exec")  # a block that is never run still parses
        elif s.lang == "pycon" and not doctest.DocTestParser().get_examples(s.code, s.where):
            problems.append(f"{s.where}: a pycon block without a '>>> ' example")
        elif s.lang in ("bash", "console") and not ({"id", "skip"} & s.attrs.keys()):
            commands = docs.shell_commands(s.code) if s.lang == "bash" else [c for c, _ in docs.console_session(s.code)]
            others = [c for c in commands if docs.split_env(shlex.split(c))[1][0] != "lightning-zero"]
            if others:
                problems.append(f"{s.where}: {others[0]!r} runs nowhere: give the block id= (a test runs it) or skip=")
        if "skip" in s.attrs and not s.attrs["skip"].strip():
            problems.append(f"{s.where}: skip= needs the reason")
    assert not problems, "\n".join(problems)


def _ci_text() -> str:
    """.ci/run with pip's quiet flag dropped (CI keeps its install log short; nothing else may differ)."""
    return (REPO / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")


def test_every_block_a_test_runs_is_run():
    """A block with ``id=NAME`` is run by the test that asks for ``snippet_command("NAME")``, or by .ci/run."""
    tests_text = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    ids = [s.attrs["id"] for s in SNIPPETS if "id" in s.attrs]
    assert len(ids) == len(set(ids)), ids
    for snippet_id in ids:
        ran_by_ci = " ".join(docs.snippet_command(snippet_id)) in _ci_text()
        assert f'snippet_command("{snippet_id}")' in tests_text or ran_by_ci, f"nothing runs id={snippet_id}"


def test_the_readme_commands_are_what_ci_runs():
    """The README's test command is what CI runs after its installs, and its docs build (warnings are errors,
    nothing that hides them) comes after the tests."""
    ci = _ci_text()
    commands = {}
    for snippet_id in ("tests", "docs-build"):
        (block,) = [s for s in SNIPPETS if s.attrs.get("id") == snippet_id]
        (commands[snippet_id],) = docs.shell_commands(block.code)
    tests = "&&".join(commands["tests"].split("&&")[-2:]).strip()
    install, build = (part.strip() for part in commands["docs-build"].split("&&"))
    assert tests in ci, f"README's test command {tests!r} is not in .ci/run"
    assert install in ci and build in ci, f"README's docs build {commands['docs-build']!r} is not in .ci/run"
    (build_line,) = [line for line in ci.splitlines() if build in line]
    mkdocs = build_line[build_line.index("mkdocs") :].split(">")[0].split()
    assert not {"-q", "--quiet"} & set(mkdocs), f"CI's docs build hides its warnings: {build_line}"
    assert ci.index(tests) < ci.index(build), "CI builds the docs after the tests"


def _resolves(name: str) -> bool:
    """Whether ``lightning_zero.a.b.c`` is importable: its longest module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_name_the_docs_mention_exists():
    """In the pages, and in the package's docstrings and comments (the API reference renders the docstrings)."""
    missing = []
    for path in [*docs.markdown_files(), *sorted((REPO / "lightning_zero").rglob("*.py"))]:
        text = path.read_text()
        if path.suffix == ".py":  # a quoted value is data, not a reference (the format's name)
            text = re.sub(r"\"lightning_zero[\w.]*\"", "", text)
        missing += [f"{path.relative_to(REPO)}: {name}" for name in sorted(docs.names(text)) if not _resolves(name)]
    assert not missing, "names the docs give that do not exist:\n" + "\n".join(missing)


def test_every_option_the_docs_give_exists():
    """``ZeroConfig(key=...)``, ``LossScaleConfig(key=...)`` and ``--zero.key`` name fields that exist (a renamed
    option leaves no stale name in the docs, also where a block shows it without running it)."""
    fields = {
        "ZeroConfig": {f.name for f in dataclasses.fields(lightning_zero.ZeroConfig)},
        "LossScaleConfig": {f.name for f in dataclasses.fields(lightning_zero.LossScaleConfig)},
    }
    unknown = []
    for path in docs.markdown_files():
        text = path.read_text()
        for config, arguments in re.findall(r"\b(ZeroConfig|LossScaleConfig)\(([^()]*)\)", text):
            for key in re.findall(r"(?:^|,)\s*(\w+)=", arguments):
                if key not in fields[config]:
                    unknown.append(f"{path.relative_to(REPO)}: {config}({key}=...)")
        for match in re.finditer(r"--zero\.(\w+)", text):
            quoting_a_refusal = re.search(r"(unrecognized arguments: |has no `)$", text[: match.start()])
            if match[1] not in fields["ZeroConfig"] - {"stage"} and not quoting_a_refusal:
                unknown.append(f"{path.relative_to(REPO)}: --zero.{match[1]}")
    assert not unknown, "options the docs give that do not exist:\n" + "\n".join(unknown)


def test_every_path_the_docs_mention_exists():
    missing = []
    for path in docs.markdown_files():
        for mentioned in sorted(docs.repo_paths(path.read_text())):
            if "*" not in mentioned and docs.resolve_path(mentioned) is None:
                missing.append(f"{path.relative_to(REPO)}: {mentioned}")
    assert not missing, "paths the docs give that do not exist:\n" + "\n".join(missing)


def test_no_claim_that_goes_stale_by_itself():
    found = []
    for path in docs.markdown_files():
        for pattern, what in STALE_CLAIMS.items():
            for match in re.finditer(pattern, path.read_text()):
                where = path.relative_to(REPO)
                found.append(f"{where}: {match[0]!r} ({what}: let a checked block or the suite say it)")
    assert not found, "\n".join(found)


def test_the_api_reference_renders_everything_exported():
    page = (REPO / "docs" / "reference" / "api.md").read_text()
    rendered = set(re.findall(r"^::: (lightning_zero(?:\.\w+)+)$", page, re.M))
    missing = [name for name in lightning_zero.__all__ if f"lightning_zero.{name}" not in rendered]
    assert not missing, f"docs/reference/api.md renders no entry for {missing}"


# --- running the blocks of one rank, in this process ------------------------------------------------------
@pytest.mark.parametrize("session", docs.sessions(1), ids=lambda s: s.id)
def test_python_blocks_run(session, tmp_path, monkeypatch, stage2_checkpoint):
    docs.prepare(tmp_path, session.blocks, stage2_checkpoint)
    monkeypatch.chdir(tmp_path)
    docs.run_python(session.blocks, {"__name__": "__docs__"})


SHELL_BLOCKS = [s for s in SNIPPETS if s.lang in ("bash", "console") and docs.runnable(s)]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_id)
def test_shell_blocks_run(block, tmp_path, monkeypatch, capsys, stage2_checkpoint):
    """``lightning-zero`` commands run through ``cli.main``; each must exit 0. Lightning's subcommands do all but
    train: parse the options and configs, check the ZeRO config, build the model, data and Trainer."""
    docs.prepare(tmp_path, [block], stage2_checkpoint)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(ZeroCLI, "_run_subcommand", lambda self, subcommand: None)  # (fit/validate/...: not run)
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything's, put back after
        monkeypatch.delenv(key, raising=False)
    session = docs.console_session(block.code) if block.lang == "console" else None
    for command, expected in session or [(c, None) for c in docs.shell_commands(block.code)]:
        env, argv = docs.split_env(shlex.split(command))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert argv[0] == "lightning-zero", f"{block.where}: {command}"
        code, out, err = run_cli(capsys, *argv[1:])
        assert code == 0, f"{block.where}: {command}\n{out[-2000:]}\n{err[-2000:]}"
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        if expected is not None and not doctest.OutputChecker().check_output(expected, out, flags):
            pytest.fail(f"{block.where}: {command} printed\n{out}\nwhere the docs show\n{expected}")


@pytest.mark.parametrize("block", [s for s in SNIPPETS if s.lang in docs.RUN_LANGS and "skip" in s.attrs], ids=_id)
def test_blocks_that_cannot_run_on_one_machine(block):
    """Shown in the test report with their reason (their names and paths are checked above)."""
    pytest.skip(f"{block.where}: {block.attrs['skip']}")


# The README's three false claims before the docs were tested (issue 44), as it wrote them.
OLD_FALSE_CLAIMS = (
    'resumes with `trainer.fit(model, ckpt_path="last")` (or `lightning_zero.checkpoint.latest(dirpath)`)',
    "`lightning_zero.kernels.loader.compile_all()` compiles all seven sources up front",
    "The whole suite: 961 tests in 555 s (9.3 minutes)",
)


def test_the_checks_catch_the_old_readmes_false_claims():
    unresolved = [name for name in docs.names(OLD_FALSE_CLAIMS[0]) if not _resolves(name)]
    assert unresolved == ["lightning_zero.checkpoint.latest"]
    for claim in OLD_FALSE_CLAIMS[1:]:
        assert any(re.search(pattern, claim) for pattern in STALE_CLAIMS), claim
