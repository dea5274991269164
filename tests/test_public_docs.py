"""Every public name of ``phalanx`` documents its arguments and what it returns.

The rule, checked over ``phalanx.__all__`` (functions, classes, and the public methods
of each class and of the phalanx classes it inherits from):

- each parameter other than ``self``/``cls`` and private ``_name`` ones is named under
  ``Args:`` (a constructor's under ``Args:`` of the class, of ``__init__`` or of the class
  that defines ``__init__``; a dataclass's fields under ``Attributes:`` or each by the
  string below it, the attribute docstring that ``tyro`` shows in ``--help``); ``*args``
  and ``**kwargs`` may share one entry;
- a function annotated to return something other than ``None``, or whose body returns a
  value, has ``Returns:`` (``Yields:`` for a generator);
- a public property has a docstring;
- each ``Raises:`` entry names an exception type of Python or of phalanx.

Sections are Google style: a line ``Args:`` and one entry per line below it,
``name: text`` or ``name (type): text``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import phalanx

_SECTION = re.compile(
    r"^(\s*)(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples):\s*$"
)
_ENTRY = re.compile(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\([^)]*\))?\s*:")
_NO_VALUE = {"None", "NoReturn", "Never", "typing.NoReturn"}


def _sections(doc: str | None) -> dict[str, list[str]]:
    """The names of the entries of each Google-style section of ``doc``."""
    sections: dict[str, list[str]] = {}
    if not doc:
        return sections
    lines = inspect.cleandoc(doc).splitlines()
    current: str | None = None
    header_indent = 0
    entry_indent: int | None = None
    for line in lines:
        match = _SECTION.match(line)
        if match:
            current, header_indent, entry_indent = match.group(2), len(match.group(1)), None
            sections.setdefault(current, [])
            continue
        if current is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            current = None
            continue
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            entry = _ENTRY.match(line.strip())
            if entry:
                sections[current].extend(n.strip().lstrip("*") for n in entry.group(1).split(","))
    return sections


def _returns_value(func: Callable[..., Any]) -> tuple[bool, bool]:
    """Whether ``func`` returns a value, and whether it is a generator."""
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        return True, True
    annotation = inspect.signature(func).return_annotation
    if annotation is not inspect.Signature.empty:
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if text.startswith(("Iterator", "Generator", "AsyncIterator")):
            return True, True
        return text not in _NO_VALUE and annotation is not None, False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError):
        return False, False
    return any(_own_returns(tree.body[0])), False


def _own_returns(node: ast.AST) -> Iterator[bool]:
    """For each ``return`` in ``node``'s own body (not nested functions): has it a value?"""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, ast.Return):
            yield child.value is not None and not (
                isinstance(child.value, ast.Constant) and child.value.value is None
            )
        yield from _own_returns(child)


def _parameters(func: Callable[..., Any]) -> list[str]:
    """The parameters a docstring must name."""
    return [
        p.name
        for p in inspect.signature(func).parameters.values()
        if p.name not in ("self", "cls") and not p.name.startswith("_")
    ]


@functools.cache
def _exception_names() -> set[str]:
    """The names of the exception types of Python and of phalanx (those imported by the
    first call: ``public_doc_problems`` imports every public name first)."""
    names, todo = set(), [BaseException]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__ == "builtins" or cls.__module__.startswith("phalanx"):
            names.add(cls.__name__)
    return names


def _raises_problems(name: str, doc: str | None) -> list[str]:
    """``Raises:`` entries of ``doc`` that name no known exception type."""
    known = _exception_names()
    return [
        f"{name}: Raises names {e}, not an exception type"
        for e in _sections(doc).get("Raises", [])
        if e not in known
    ]


def _problems(
    name: str, func: Callable[..., Any], doc: str | None, args_doc: list[str]
) -> list[str]:
    """What ``func``'s docstring lacks, one line per missing piece."""
    sections = _sections(doc)
    named = set(args_doc) | set(sections.get("Args", [])) | set(sections.get("Arguments", []))
    missing = [p for p in _parameters(func) if p not in named]
    problems = [f"{name}: Args lacks {', '.join(missing)}"] if missing else []
    returns, generator = _returns_value(func)
    if returns and "Returns" not in sections and not (generator and "Yields" in sections):
        problems.append(f"{name}: no {'Yields' if generator else 'Returns'}")
    return problems + _raises_problems(name, doc)


def _field_docstrings(cls: type) -> list[str]:
    """The fields of a dataclass that have a string literal right below them."""
    if not dataclasses.is_dataclass(cls):
        return []
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return [
        node.target.id
        for node, after in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    ]


def _class_problems(name: str, cls: type) -> list[str]:
    """What the constructor and the public methods and properties of ``cls`` lack."""
    problems = _raises_problems(name, cls.__doc__)
    class_sections = _sections(cls.__doc__)
    init = cls.__init__
    if getattr(init, "__module__", "").startswith("phalanx") or dataclasses.is_dataclass(cls):
        owner = next(k for k in cls.__mro__ if "__init__" in vars(k))
        owner_sections = _sections(owner.__doc__)
        documented = (
            class_sections.get("Args", [])
            + owner_sections.get("Args", [])
            + class_sections.get("Attributes", [])
            + _field_docstrings(cls)
        )
        problems += [
            p for p in _problems(f"{name}()", init, init.__doc__, documented) if "Returns" not in p
        ]
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("phalanx"):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or attr in seen:
                continue
            seen.add(attr)
            if isinstance(value, property):
                if not (value.__doc__ or "").strip():
                    problems.append(f"{name}.{attr}: property without a docstring")
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value):
                problems += _problems(f"{name}.{attr}", value, value.__doc__, [])
    return problems


def public_doc_problems() -> list[str]:
    """Every missing Args entry, Returns section and property docstring of the public API,
    and every ``Raises:`` entry that names no exception type."""
    problems: list[str] = []
    public = {name: getattr(phalanx, name) for name in sorted(phalanx.__all__)}
    for name, obj in public.items():
        if inspect.isclass(obj):
            problems += _class_problems(name, obj)
        elif inspect.isfunction(obj):
            problems += _problems(name, obj, obj.__doc__, [])
    return problems


@pytest.mark.timeout(60)
def test_every_public_name_documents_args_and_returns() -> None:
    problems = public_doc_problems()
    assert problems == [], "\n".join(problems)


@pytest.mark.timeout(10)
def test_sections_parse_google_style_entries() -> None:
    doc = """Send weights.

    Args:
        weights (dict): the tensors,
            one per name.
        *args, **kwargs: passed on.
        timeout: seconds.

    Returns:
        The result.
    """
    assert _sections(doc) == {"Args": ["weights", "args", "kwargs", "timeout"], "Returns": []}


@pytest.mark.timeout(10)
def test_the_rule_names_what_is_missing() -> None:
    def f(a: int, b: int, *args: int, _private: int = 0, **kwargs: int) -> int:
        """Add.

        Args:
            a: one.
            *args, **kwargs: more.

        Raises:
            ValueError: never.
            NoSuchError: never.
        """
        return a + b

    def g(a: int):  # no annotation: the body's return says it returns a value
        """Twice ``a``.

        Args:
            a: the number.
        """
        if a:
            return 2 * a
        return None

    assert _problems("f", f, f.__doc__, []) == [
        "f: Args lacks b",
        "f: no Returns",
        "f: Raises names NoSuchError, not an exception type",
    ]
    assert _problems("g", g, g.__doc__, []) == ["g: no Returns"]
