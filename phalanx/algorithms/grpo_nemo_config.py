"""NeMo-RL's GRPO config files (``grpo:``, ``loss_fn:``, ``policy:``, ``checkpointing:``,
``logger:``, ``data:``, ``env:``, ``cluster:``) read as ``GRPOConfig`` fields.

NeMo-RL configures a run with one nested YAML file (its ``examples/configs/grpo_*.yaml``)
that OmegaConf loads: the files named by ``defaults`` are merged under it, ``${a.b}``
interpolations and the ``add``/``sub``/``mul``/``div``/``max`` resolvers are evaluated.
:func:`read_nemo_rl_config` loads it the same way, then reads every key: a key with a
phalanx equivalent sets that field, a key whose value is what phalanx does anyway is
accepted, and the settings of a section that the file itself switches off (the Megatron
backend, a disabled logger, ...) are accepted as unused, as NeMo-RL leaves them unused.
Every other key (a value phalanx cannot honour, a key it does not know) is a
``ConfigError`` that lists them all, each by its full dotted name and why.
``docs/compat.md`` has the table.

:mod:`grpo_nemo_base` loads the file, :mod:`grpo_nemo_rules` holds the rule of each key.
A ``phalanx:`` section sets ``GRPOConfig`` fields that NeMo-RL has no key for (``task``,
``eval_every``, ``num_threads``, ...); a field set both there and by a NeMo-RL key is an
error.
"""

from __future__ import annotations

from typing import Any

from phalanx.algorithms._harness import check_keys
from phalanx.algorithms.grpo_nemo_base import Reader, load_nemo_rl_yaml, resolve_interpolations
from phalanx.algorithms.grpo_nemo_rules import PHALANX_SECTION, RULES, SECTION_RULES
from phalanx.llm.policy_config import ConfigError

SECTIONS = ("grpo", "loss_fn", "policy", "checkpointing", "logger", "data", "env", "cluster",
            "reward_penalties", "data_plane", "on_policy_distillation")  # fmt: skip


def is_nemo_rl_config(loaded: dict[str, Any]) -> bool:
    """Whether a config file's mapping is NeMo-RL's nested form (a ``grpo``, ``policy`` or
    ``loss_fn`` section, or a ``defaults`` parent), not a flat mapping of fields."""
    return any(k in loaded for k in ("grpo", "policy", "loss_fn", "defaults"))


def _read(r: Reader, section: dict[str, Any], prefix: str) -> None:
    """Apply the rule of every key under ``section`` (at dotted path ``prefix``)."""
    for key, value in section.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if dotted in SECTION_RULES:  # one rule reads the whole section, leaf by leaf
            for leaf, v in _leaves(value, dotted):
                RULES[dotted](r, leaf, v)
        elif dotted in RULES:
            RULES[dotted](r, dotted, value)
        elif isinstance(value, dict):
            _read(r, value, dotted)
        else:
            r.refuse(dotted, value, "not a NeMo-RL GRPO key phalanx knows")


def _leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    return [(prefix, value)]


def _check_generation(r: Reader) -> None:
    """With the vLLM backend and no key of ``policy.generation`` refused yet, that section
    through the vLLM worker's own check (the one ``VllmGeneration`` applies: the values'
    types and ranges)."""
    from phalanx.llm.vllm_config import check_vllm_generation_config

    gen = r.get("policy.generation")
    if not isinstance(gen, dict) or gen.get("backend") != "vllm":
        return
    if any(p.startswith("policy.generation.") for p in r.problems):
        return
    try:
        check_vllm_generation_config({**gen, "model_name": r.get("policy.model_name") or "model"})
    except (ConfigError, TypeError) as e:
        r.problems.append(f"policy.{e}")


def nemo_rl_fields(
    cfg: dict[str, Any], source: str, config_cls: type | None = None
) -> dict[str, Any]:
    """The ``GRPOConfig`` fields a resolved NeMo-RL config sets; ``ConfigError`` listing
    every key phalanx cannot honour. With ``config_cls`` the ``phalanx:`` section's keys
    may be flag spellings too (``async``, ``lr``), read as their fields."""
    r = Reader(cfg)
    for top, value in cfg.items():
        if top == PHALANX_SECTION:
            continue
        if top not in SECTIONS:
            r.refuse(
                str(top),
                value,
                f"not a NeMo-RL GRPO section phalanx knows "
                f"({', '.join(SECTIONS)}, {PHALANX_SECTION})",
            )
        else:
            _read(r, {top: value}, "")
    _check_generation(r)
    own = cfg.get(PHALANX_SECTION) or {}
    if not isinstance(own, dict):
        r.refuse(PHALANX_SECTION, own, "must be a mapping of GRPOConfig fields")
        own = {}
    if config_cls is not None:
        own = check_keys(own, config_cls, f"{source}: {PHALANX_SECTION}", aliases=True)
    for key, value in own.items():
        if key in r.set_by:
            r.refuse(f"{PHALANX_SECTION}.{key}", value, f"{r.set_by[key]} sets {key} too")
        else:
            r.fields[key] = value
    if r.problems:
        lines = "\n  ".join(r.problems)
        raise ConfigError(
            f"{source}: {len(r.problems)} NeMo-RL key(s) phalanx cannot honour "
            f"(docs/compat.md lists the mapping):\n  {lines}"
        )
    return r.fields


def mapping_table() -> str:
    """The Markdown table of every NeMo-RL key phalanx reads and what it becomes
    (``docs/compat.md`` holds it; a test keeps the two equal)."""
    rows = ["| NeMo-RL key | phalanx |", "|---|---|"]
    for key, rule in RULES.items():
        what = rule.doc
        shown = f"`{key}.*`" if key in SECTION_RULES else f"`{key}`"
        rows.append(f"| {shown} | {what} |")
    return "\n".join(rows)


def read_nemo_rl_config(path: str, config_cls: type | None = None) -> dict[str, Any]:
    """The ``GRPOConfig`` fields of the NeMo-RL config file at ``path``."""
    cfg = resolve_interpolations(load_nemo_rl_yaml(path))
    return nemo_rl_fields(cfg, f"--config {path}", config_cls)
