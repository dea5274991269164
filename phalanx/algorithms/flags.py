"""Command-line spellings of config fields, so a config error names the flag a user typed.

``PPOConfig.validate()`` and ``GRPOConfig.validate()`` name the field (``learning_rate must
be > 0``); on the command line the same value came from ``--learning-rate`` or an alias
such as ``--lr``. tyro spells a field ``--field-name``; aliases are its ``tyro.conf.arg``.
"""

from __future__ import annotations

import dataclasses
import re
import typing


def flag_names(config_cls: type, field: str) -> list[str]:
    """The flags that set ``field`` of the dataclass ``config_cls`` (empty if not a field)."""
    if field not in {f.name for f in dataclasses.fields(config_cls)}:
        return []
    flags = ["--" + field.replace("_", "-")]
    hint = typing.get_type_hints(config_cls, include_extras=True).get(field)
    for meta in getattr(hint, "__metadata__", ()):
        flags.extend(a for a in (getattr(meta, "aliases", None) or ()) if a not in flags)
    return flags


def name_the_flag(message: str, config_cls: type) -> str:
    """``message`` followed by the flags of the field it starts with, if it starts with one."""
    match = re.match(r"[A-Za-z_][A-Za-z0-9_]*", message)
    flags = flag_names(config_cls, match.group(0)) if match else []
    return f"{message} (flag {'/'.join(flags)})" if flags else message
