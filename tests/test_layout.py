"""The shape of the package: no module over 700 lines of code (docstrings, which every
public name must carry with its Args/Returns/Raises, are not counted), and no import circle
inside any package, computed with grimp (import-linter's graph library) over every import,
those inside functions included (an import moved into a function to dodge a circle is
still a circle); ``if TYPE_CHECKING:`` imports are left out."""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import grimp
import pytest

import phalanx

pytestmark = pytest.mark.smoke

PACKAGE_DIR = pathlib.Path(phalanx.__file__).parent
MAX_LINES = 700


def same_package_graph() -> dict[str, set[str]]:
    """importer -> the modules of its own package that it imports."""
    graph = grimp.build_graph("phalanx", exclude_type_checking_imports=True, cache_dir=None)
    edges: dict[str, set[str]] = defaultdict(set)
    for importer in graph.modules:
        package = importer.rpartition(".")[0]
        for imported in graph.find_modules_directly_imported_by(importer):
            if imported.rpartition(".")[0] == package and imported != importer:
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


def test_no_import_circle_inside_a_package():
    assert find_cycles(same_package_graph()) == []


def code_lines(source: str) -> int:
    """Lines of ``source`` outside the docstrings of its module, classes and functions."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
            first = node.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    return len(source.splitlines()) - len(docstrings)


def test_code_lines_leave_out_docstrings_only():
    source = '"""Module."""\n\n\ndef f():\n    """One\n    two."""\n    return 1  # x\n'
    assert code_lines(source) == 4


def test_no_module_over_700_lines():
    offenders = sorted(
        (str(path.relative_to(PACKAGE_DIR.parent)), n)
        for path in PACKAGE_DIR.rglob("*.py")
        if (n := code_lines(path.read_text())) > MAX_LINES
    )
    assert offenders == []
