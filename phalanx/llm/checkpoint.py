"""Sharded checkpoints of the policy (model, optimizer and scheduler) with
``torch.distributed.checkpoint``: every rank writes and reads its own shards."""

from __future__ import annotations

import os
from typing import Any

import torch


def _optimizer_state(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "optim": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
    }


def save_sharded(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    weights_path: str,
    optimizer_path: str | None,
) -> None:
    """Write the model to ``weights_path`` and, when given, the optimizer and scheduler
    to ``optimizer_path`` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not weights_path:
        raise ValueError("save_checkpoint: weights_path is required")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=weights_path)
    if optimizer_path:
        save_optimizer(model, optimizer, scheduler, optimizer_path)


def save_optimizer(model: torch.nn.Module, optimizer: Any, scheduler: Any, path: str) -> None:
    """Write the optimizer and scheduler state to ``path`` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    if optimizer is None:
        raise RuntimeError("save_checkpoint: no optimizer (init_optimizer=False)")
    dcp.save(_optimizer_state(model, optimizer, scheduler), checkpoint_id=path)


def load_sharded(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    weights_path: str,
    optimizer_path: str | None,
) -> None:
    """Load a ``save_sharded`` checkpoint into the (already sharded) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not weights_path or not os.path.isdir(weights_path):
        raise ValueError(f"load_checkpoint: weights_path {weights_path!r} is not a directory")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=weights_path)
    set_model_state_dict(model, state["model"])
    if optimizer_path:
        load_optimizer(model, optimizer, scheduler, optimizer_path)


def load_optimizer(model: torch.nn.Module, optimizer: Any, scheduler: Any, path: str) -> None:
    """Load a ``save_optimizer`` directory into the optimizer and scheduler."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not os.path.isdir(path):
        raise ValueError(f"load_checkpoint: optimizer_path {path!r} is not a directory")
    if optimizer is None:
        raise RuntimeError("load_checkpoint: no optimizer (init_optimizer=False)")
    ostate = _optimizer_state(model, optimizer, scheduler)
    dcp.load(ostate, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, ostate["optim"])
    if scheduler is not None and ostate["scheduler"]:
        scheduler.load_state_dict(ostate["scheduler"])
