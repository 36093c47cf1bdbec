"""Every public definition of the package has a docstring, and what ``lightning_zero`` exports documents its
arguments and what it raises (the API reference, docs/reference/api.md, is rendered from them).

Public: a class or function whose name and module path have no leading underscore, defined in that module,
and the public methods and properties of such a class. A class needs its own docstring; a method that overrides
a documented one (a Lightning hook) inherits its docstring, as ``inspect.getdoc`` and the rendered reference do."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import lightning_zero


def public_definitions() -> dict[str, object]:
    """Qualified name -> object, for every public class, function, method and property of the package."""
    found: dict[str, object] = {}
    for info in pkgutil.walk_packages(lightning_zero.__path__, "lightning_zero."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isfunction(obj):
                found[f"{info.name}.{name}"] = obj
            elif inspect.isclass(obj):
                found[f"{info.name}.{name}"] = obj
                found.update(_members(obj, f"{info.name}.{name}"))
    return found


def _members(cls: type, qualname: str) -> dict[str, object]:
    members = {}
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if inspect.isfunction(attr) or isinstance(attr, property):
            members[f"{qualname}.{name}"] = getattr(cls, name) if inspect.isfunction(attr) else attr
    return members


def _doc(obj: object) -> str | None:
    if isinstance(obj, property):
        return obj.__doc__
    if inspect.isclass(obj):  # its own: a base class's says nothing of it
        doc = vars(obj).get("__doc__")
    else:
        doc = inspect.getdoc(obj)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        return None  # the signature dataclasses write when the class has no docstring
    return doc


def test_every_public_definition_has_a_docstring():
    definitions = public_definitions()
    assert len(definitions) > 800, len(definitions)  # the walk found the package
    missing = sorted(name for name, obj in definitions.items() if not (_doc(obj) or "").strip())
    assert not missing, f"{len(missing)} public definitions without a docstring:\n" + "\n".join(missing)


def _parameters(obj: object) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = list(inspect.signature(target).parameters)
    return [n for n in names if n not in ("self", "cls")]


def test_the_exported_api_documents_its_arguments_and_what_it_raises():
    bad = []
    for name in lightning_zero.__all__:
        obj = getattr(lightning_zero, name)
        doc = inspect.getdoc(obj) or ""
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            if not doc.strip():
                bad.append(f"{name}: no docstring")
            continue
        if _parameters(obj) and "Args:" not in doc and "Attributes:" not in doc:
            bad.append(f"{name}: no 'Args:' section for {_parameters(obj)}")
        if "Raises:" not in doc:
            bad.append(f"{name}: no 'Raises:' section")
    assert not bad, "\n".join(bad)
