"""The shape of the package (issue #23): no module over 700 lines, and no import circle
inside any package, computed with grimp (import-linter's graph library) over the imports
that run when a module is imported (module and class bodies; not function bodies, not
``if TYPE_CHECKING:`` blocks)."""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import grimp

import phalanx

PACKAGE_DIR = pathlib.Path(phalanx.__file__).parent
MAX_LINES = 700


def _module_file(module: str) -> pathlib.Path:
    path = PACKAGE_DIR.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _import_time_lines(path: pathlib.Path) -> set[int]:
    """Line numbers of the import statements that run when the module is imported."""
    lines: set[int] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                lines.add(node.lineno)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, block, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(ast.parse(path.read_text()).body)
    return lines


def import_time_graph() -> dict[str, set[str]]:
    """importer -> modules of the same package it imports at import time."""
    graph = grimp.build_graph("phalanx", exclude_type_checking_imports=True, cache_dir=None)
    edges: dict[str, set[str]] = defaultdict(set)
    for importer in graph.modules:
        package = importer.rpartition(".")[0]
        lines = None
        for imported in graph.find_modules_directly_imported_by(importer):
            if imported.rpartition(".")[0] != package or imported == importer:
                continue
            if lines is None:
                lines = _import_time_lines(_module_file(importer))
            details = graph.get_import_details(importer=importer, imported=imported)
            if any(d["line_number"] in lines for d in details):
                edges[importer].add(imported)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(found)


def test_find_cycles_finds_a_circle_and_only_circles():
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert find_cycles(edges) == [["p.a", "p.b", "p.c"]]
    assert find_cycles({"p.a": {"p.b"}}) == []


def test_import_time_lines_skip_functions_and_type_checking(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import json\n"
        "try:\n"
        "    import numpy\n"
        "except ImportError:\n"
        "    import math\n"
        "class C:\n"
        "    import re\n"
        "def f():\n"
        "    import sys\n"
    )
    # TYPE_CHECKING blocks are excluded by grimp itself; the line scan keeps top-level ifs
    assert _import_time_lines(source) == {1, 2, 4, 6, 8, 10}


def test_no_import_circle_inside_a_package():
    assert find_cycles(import_time_graph()) == []


def test_no_module_over_700_lines():
    offenders = sorted(
        (str(path.relative_to(PACKAGE_DIR.parent)), n)
        for path in PACKAGE_DIR.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert offenders == []
