"""NeMo-RL's YAML config files loaded as NeMo-RL loads them (OmegaConf with its
resolvers): ``defaults`` parents merged under a file, ``_override_`` sections, ``${...}``
interpolations evaluated; and the kinds of :class:`Rule` that read a loaded file's keys
(:mod:`grpo_nemo_rules` holds the rule of each GRPO key, :mod:`grpo_nemo_config` the walk)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from phalanx.llm.policy_config import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML as OmegaConf reads it: ``1e-8`` is a float (PyYAML's YAML 1.1 wants ``1.0e-8``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?\.?\d*(?:[eE][-+]?\d+)$|^[-+]?\d[\d_]*\.\d*$"),
    list("-+0123456789."),
)


def load_nemo_rl_yaml(path: str) -> dict[str, Any]:
    """The file at ``path`` merged over its ``defaults`` parents (paths relative to the
    file; a section marked ``_override_: true`` replaces the parent's instead of merging),
    interpolations not yet evaluated."""
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.load(f, Loader=_Loader) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config: cannot read {path}: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {path} must hold a mapping")
    parents = loaded.pop("defaults", None)
    if parents is None:
        return loaded
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"--config {path}: defaults must be a file name or a list of them")
    base: dict[str, Any] = {}
    for parent in parents:
        full = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
        base = _merge(base, load_nemo_rl_yaml(full))
    return _merge(base, loaded)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and value.get("_override_"):
            out[key] = {k: v for k, v in value.items() if k != "_override_"}
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


_RESOLVERS: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}


def resolve_interpolations(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with every ``${...}`` evaluated as OmegaConf does: ``${a.b}`` from the root,
    ``${.b}`` / ``${..b}`` from the key's own section / its parent, ``${mul:x, y}`` and the
    other resolvers of NeMo-RL; a whole-value interpolation keeps the target's type."""

    def walk(value: Any, where: list[str], stack: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, [*where, str(k)], stack) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, where, stack) for v in value]
        if isinstance(value, str) and "${" in value:
            return _evaluate(value, where[:-1], stack + (".".join(where),), walk, cfg)
        return value

    return walk(cfg, [], ())


def _evaluate(text: str, section: list[str], stack: tuple[str, ...], walk: Any, root: Any) -> Any:
    """The value of ``text`` holding ``${...}``; ``section`` is the path of the section that
    holds the key (for relative references)."""
    spans = _top_level_spans(text, stack[-1])
    if len(spans) == 1 and spans[0] == (0, len(text)):
        return _expression(text[2:-1], section, stack, walk, root)
    out, last = [], 0
    for start, end in spans:
        out += [
            text[last:start],
            str(_expression(text[start + 2 : end - 1], section, stack, walk, root)),
        ]
        last = end
    return "".join(out) + text[last:]


def _top_level_spans(text: str, key: str) -> list[tuple[int, int]]:
    spans, depth, start = [], 0, 0
    i = 0
    while i < len(text):
        if text.startswith("${", i):
            if depth == 0:
                start = i
            depth += 1
            i += 2
            continue
        if text[i] == "}" and depth:
            depth -= 1
            if depth == 0:
                spans.append((start, i + 1))
        i += 1
    if depth:
        raise ConfigError(f"{key}: unbalanced interpolation {text!r}")
    return spans


def _expression(expr: str, section: list[str], stack: tuple[str, ...], walk: Any, root: Any) -> Any:
    key = stack[-1]
    name, colon, args = expr.partition(":")
    if colon and name.strip() in _RESOLVERS:
        parts = _split_args(args)
        if len(parts) != 2:
            raise ConfigError(f"{key}: ${{{name}:...}} takes two arguments, got {args!r}")
        values = []
        for part in parts:
            if "${" in part:
                values.append(_evaluate(part, section, stack, walk, root))
            else:
                values.append(yaml.load(part, Loader=_Loader))
        return _RESOLVERS[name.strip()](*values)
    if colon:
        raise ConfigError(
            f"{key}: unknown resolver {name!r} in ${{{expr}}} (known: {', '.join(_RESOLVERS)})"
        )
    ref = expr.strip()
    dots = len(ref) - len(ref.lstrip("."))
    path = (section[: len(section) - dots + 1] if dots else []) + ref.lstrip(".").split(".")
    target: Any = root
    for part in path:
        if not isinstance(target, dict) or part not in target:
            raise ConfigError(f"{key}: interpolation ${{{expr}}} names no key ({'.'.join(path)})")
        target = target[part]
    dotted = ".".join(path)
    if dotted in stack:
        raise ConfigError(f"{key}: interpolation ${{{expr}}} refers to itself")
    return walk(target, path, stack + (dotted,)) if "${" in str(target) else target


def _split_args(args: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in args:
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        current.append(ch)
    parts.append("".join(current).strip())
    return parts


# ----------------------------------------------------------------------------- rules
class Reader:
    """Walks a resolved NeMo-RL config; collects the fields it sets and the problems."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.fields: dict[str, Any] = {}
        self.set_by: dict[str, str] = {}
        self.problems: list[str] = []

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.cfg
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def has(self, dotted: str) -> bool:
        marker = object()
        return self.get(dotted, marker) is not marker

    def set(self, field: str, value: Any, key: str) -> None:
        if field in self.set_by and self.set_by[field] != key:
            self.refuse(key, value, f"sets {field}, which {self.set_by[field]} sets too")
            return
        self.fields[field] = value
        self.set_by[field] = key

    def refuse(self, key: str, value: Any, why: str) -> None:
        self.problems.append(f"{key}={value!r}: {why}")


@dataclass(frozen=True)
class Rule:
    """How one NeMo-RL key is read (``read(reader, dotted key, value)``) and what the
    mapping table says about it (``doc``)."""

    read: Callable[[Reader, str, Any], None]
    doc: str

    def __call__(self, r: Reader, key: str, value: Any) -> None:
        self.read(r, key, value)


def to(field: str, convert: Callable[[Any], Any] | None = None) -> Rule:
    """The key sets ``field``."""

    def rule(r: Reader, key: str, value: Any) -> None:
        r.set(field, convert(value) if convert is not None else value, key)

    return Rule(rule, f"`{field}`")


def only(*allowed: Any, why: str) -> Rule:
    """The key is accepted at the ``allowed`` values (what phalanx does), else refused."""

    def rule(r: Reader, key: str, value: Any) -> None:
        if not any(_same(value, a) for a in allowed):
            r.refuse(key, value, f"only {' or '.join(map(_yaml, allowed))}: {why}")

    return Rule(rule, f"only {' / '.join(map(_yaml, allowed))}: {why}")


def _same(value: Any, allowed: Any) -> bool:
    """``value == allowed``, an int and a float of one value alike, a bool never a number."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if number(value) and number(allowed):
        return bool(value == allowed)
    return type(value) is type(allowed) and value == allowed


def _yaml(value: Any) -> str:
    """``value`` as a YAML file spells it."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return f'"{value}"' if isinstance(value, str) else repr(value)


def same_as(other: str, why: str) -> Rule:
    """The key must hold the value of the key ``other``."""

    def rule(r: Reader, key: str, value: Any) -> None:
        if value != r.get(other):
            r.refuse(key, value, f"must equal {other} ({r.get(other)!r}): {why}")

    return Rule(rule, f"must equal `{other}`: {why}")


def refused(why: str) -> Rule:
    """A key refused at any value."""

    def rule(r: Reader, key: str, value: Any) -> None:
        r.refuse(key, value, why)

    return Rule(rule, f"refused: {why}")


def unused(why: str) -> Rule:
    """A key accepted at any value: what it configures, the run does not have (``why``)."""

    def rule(r: Reader, key: str, value: Any) -> None:
        return None

    return Rule(rule, f"unused: {why}")


def unused_unless(flag: str, why: str) -> Rule:
    """Keys of a section that the boolean ``flag`` switches off: accepted and unused, as
    NeMo-RL leaves them; the flag itself at true is refused with ``why``."""

    def rule(r: Reader, key: str, value: Any) -> None:
        if key == flag and value is not False:
            r.refuse(key, value, why)

    return Rule(rule, f"unused while `{flag}` is false (true is refused: {why})")


def custom(doc: str) -> Callable[[Callable[[Reader, str, Any], None]], Rule]:
    def wrap(fn: Callable[[Reader, str, Any], None]) -> Rule:
        return Rule(fn, doc)

    return wrap


__all__ = [
    "Reader",
    "Rule",
    "custom",
    "load_nemo_rl_yaml",
    "only",
    "refused",
    "resolve_interpolations",
    "same_as",
    "to",
    "unused",
    "unused_unless",
]
