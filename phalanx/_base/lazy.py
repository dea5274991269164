"""Lazy exports: a package names what it offers without importing torch or Ray up front."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from ``table[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
