"""Lazy exports: a package names what it offers without importing torch or Ray up front.

Each package declares its public names once, as a table ``name -> module``:

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"Cluster": ".cluster", ...})

and imports none of its own submodules at package import. That is what makes first use
safe from several threads at once: Python holds a submodule's import lock while it
imports the parent package, so a package ``__init__`` that imported its submodules could
deadlock against a thread importing one of them directly (Python then hands one thread a
partially initialised module: "cannot import name ... from partially initialized module").
Resolving a name is an ordinary import of its module, under Python's own per-module locks.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, table: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``: ``name`` is imported from
    ``table[name]`` (absolute, or relative to ``package``) on first use, then cached on
    the package. ``__all__`` is the table's names, sorted."""
    names = sorted(table)

    def __getattr__(name: str) -> Any:
        try:
            where = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(where, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__, names
