"""NeMo-RL's YAML config files loaded as NeMo-RL loads them (OmegaConf with its
resolvers): ``defaults`` parents merged under a file, ``_override_`` sections, ``${...}``
interpolations evaluated; and the kinds of :class:`Rule` that read a loaded file's keys
(:mod:`grpo_nemo_rules` holds the rule of each GRPO key, :mod:`grpo_nemo_config` the walk)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from phalanx.llm.policy_config import ConfigError


def load_nemo_rl_yaml(path: str) -> dict[str, Any]:
    """The file at ``path`` merged over its ``defaults`` parents (paths relative to the
    file; a section marked ``_override_: true`` replaces the parent's instead of merging),
    interpolations not yet evaluated."""
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OSError, OmegaConfBaseException, yaml.YAMLError) as e:
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


RESOLVERS: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
"""The resolvers NeMo-RL registers with OmegaConf for its configs' ``${name:a, b}``."""


def resolve_interpolations(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with every ``${...}`` evaluated by OmegaConf, as NeMo-RL evaluates its
    configs (with :data:`RESOLVERS`); a bad interpolation is a :class:`ConfigError` naming
    its dotted key."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_resolver(name, fn)
    try:
        return OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        message = (getattr(e, "msg", None) or str(e)).splitlines()[0]
        raise ConfigError(f"{getattr(e, 'full_key', None) or '--config'}: {message}") from None


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

    def set_entry(self, field: str, entry: str, value: Any, key: str) -> None:
        """Set ``entry`` of the mapping field ``field`` (several keys fill one mapping)."""
        dotted = f"{field}.{entry}"
        if dotted in self.set_by and self.set_by[dotted] != key:
            self.refuse(key, value, f"sets {dotted}, which {self.set_by[dotted]} sets too")
            return
        self.set_by[dotted] = key
        self.set_by.setdefault(field, key)
        self.fields.setdefault(field, {})[entry] = value

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


def into(field: str, entry: str) -> Rule:
    """The key sets ``entry`` of the mapping field ``field``."""

    def rule(r: Reader, key: str, value: Any) -> None:
        r.set_entry(field, entry, value, key)

    return Rule(rule, f"`{field}: {{{entry}: ...}}`")


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
    "into",
    "load_nemo_rl_yaml",
    "only",
    "refused",
    "resolve_interpolations",
    "same_as",
    "to",
    "unused",
    "unused_unless",
]
