"""A wheel holds the whole package: every subpackage is in pyproject's explicit package list (an editable
install finds them on the path and would hide one left out)."""

from __future__ import annotations

import tomllib

from tests.support.helpers import REPO


def test_every_subpackage_is_listed_for_the_wheel():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    subpackages = (REPO / "lightning_zero").glob("*/__init__.py")
    found = {"lightning_zero"} | {f"lightning_zero.{p.parent.name}" for p in subpackages}
    assert found <= listed, f"not in pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
