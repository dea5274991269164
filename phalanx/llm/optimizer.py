"""The policy's optimizer and learning-rate schedule, built from NeMo-RL's config keys.

``optimizer``: ``{"name": "torch.optim.AdamW", "kwargs": {...}}``; ``scheduler``: ``None``
(constant), ``{"name", "kwargs"}``, or NeMo-RL's list of ``{"name", "kwargs"}`` entries
plus one ``{"milestones": [...]}``, chained by ``SequentialLR``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from phalanx.llm.policy_config import ConfigError, import_object

DEFAULT_OPTIMIZER = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.0}}


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], config: dict[str, Any]
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over ``parameters`` (the trainable ones: the caller chooses) and its
    scheduler, from ``config['optimizer']`` and ``config['scheduler']``."""
    ocfg = config.get("optimizer") or DEFAULT_OPTIMIZER
    optimizer = import_object(ocfg["name"], "optimizer.name")(
        parameters, **dict(ocfg.get("kwargs") or {})
    )
    return optimizer, _build_scheduler(optimizer, config.get("scheduler"))


def _build_scheduler(optimizer: torch.optim.Optimizer, scfg: Any) -> Any:
    if not scfg:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if isinstance(scfg, dict):
        return _one_scheduler(optimizer, scfg, "scheduler.name")
    parts, milestones = [], None
    for entry in scfg:
        if "name" in entry:
            parts.append(_one_scheduler(optimizer, entry, "scheduler[].name"))
        elif "milestones" in entry:
            milestones = list(entry["milestones"])
        else:
            raise ConfigError(f"scheduler entry {entry!r} has neither name nor milestones")
    if milestones is None:
        raise ConfigError("scheduler list needs a {'milestones': [...]} entry")
    return torch.optim.lr_scheduler.SequentialLR(optimizer, parts, milestones)


def _one_scheduler(optimizer: torch.optim.Optimizer, entry: dict[str, Any], what: str) -> Any:
    cls = import_object(entry["name"], what)
    return cls(optimizer, **dict(entry.get("kwargs") or {}))
