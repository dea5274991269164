"""Sharded checkpoints of the policy (model, optimizer and scheduler) with
``torch.distributed.checkpoint``: every rank writes and reads its own shards.

A write that fails (a full disk) raises the same ``OSError`` on every rank, naming the
folder and keeping the errno (``ENOSPC``), so no rank is left waiting in a collective for
one that failed and the caller can tell a full disk from a bug."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.llm.fsdp_state import reshard
from phalanx.llm.lora import load_adapters, save_adapters


def _write_error(error: BaseException, path: str) -> OSError | None:
    """The ``OSError`` behind a failed write of ``path``, naming ``path`` when it names no
    file; None when the failure was not an operating-system error.
    ``torch.distributed.checkpoint`` wraps it, with every rank's failures, in a
    ``CheckpointException``; Hugging Face's Rust tokenizers raise a plain ``Exception``
    ending in ``(os error <errno>)``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        causes = [exc for exc, _ in error.failures.values() if isinstance(exc, OSError)]
        error = causes[0] if causes else error
    if not isinstance(error, OSError):
        rust = re.search(r"\(os error (\d+)\)$", str(error))
        if rust is None:
            return None
        error = OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
    return OSError(error.errno, error.strerror or str(error), error.filename or path)


def _dcp_save(state: dict[str, Any], path: str) -> None:
    """``dcp.save`` of ``state`` to ``path``; a failed write raises the ``OSError`` behind
    it on every rank (dcp gathers every rank's failures)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, checkpoint_id=path)
    except BaseException as e:
        error = _write_error(e, path)
        if error is None:
            raise
        raise error from None


def write_on_every_rank(path: str, write: Callable[[], Any]) -> None:
    """Run this rank's ``write`` of ``path`` (a write some ranks skip: rank 0's files),
    then raise on every rank the failure of the first rank that failed: the ``OSError``
    behind it, else (on the other ranks) a ``RuntimeError`` naming that rank."""
    failure: Exception | None = None
    try:
        write()
    except Exception as e:
        failure = _write_error(e, path) or e
    mine = None
    if isinstance(failure, OSError):
        mine = (dist.get_rank(), failure.errno, failure.strerror, failure.filename, "")
    elif failure is not None:
        mine = (dist.get_rank(), None, None, None, f"{type(failure).__name__}: {failure}")
    reports: list[tuple[int, int | None, str | None, str | None, str] | None]
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    first = next((r for r in reports if r is not None), None)
    if first is None:
        return
    rank, code, strerror, filename, text = first
    if code is not None:
        raise OSError(code, strerror, filename)
    if failure is not None:
        raise failure
    raise RuntimeError(f"rank {rank} could not write {path}: {text}")


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
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not weights_path:
        raise ValueError("save_checkpoint: weights_path is required")
    _dcp_save({"model": get_model_state_dict(model)}, weights_path)
    if optimizer_path:
        save_optimizer(model, optimizer, scheduler, optimizer_path)


def save_optimizer(model: torch.nn.Module, optimizer: Any, scheduler: Any, path: str) -> None:
    """Write the optimizer and scheduler state to ``path`` (every rank calls it)."""
    if optimizer is None:
        raise RuntimeError("save_checkpoint: no optimizer (init_optimizer=False)")
    _dcp_save(_optimizer_state(model, optimizer, scheduler), path)


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


def save_policy(
    policy: Any,
    weights_path: str,
    optimizer_path: str | None,
    tokenizer_path: str | None,
) -> None:
    """``DTensorPolicyWorker.save_checkpoint`` (every rank calls it): the sharded model, or
    with LoRA the adapters in peft's format (rank 0 writes them); the optimizer and
    scheduler sharded when ``optimizer_path`` is given; the tokenizer (rank 0) when
    ``tokenizer_path`` is. A failed write raises on every rank."""
    model, optimizer, scheduler = policy.model, policy.optimizer, policy.scheduler
    if policy.peft_model is None:
        save_sharded(model, optimizer, scheduler, weights_path, optimizer_path)
    else:
        write_on_every_rank(
            weights_path,
            lambda: save_adapters(policy.peft_model, weights_path, write=policy.rank == 0),
        )
        if optimizer_path:
            save_optimizer(model, optimizer, scheduler, optimizer_path)
    if tokenizer_path:

        def write_tokenizer() -> None:
            if policy.rank == 0:
                policy.tokenizer.save_pretrained(tokenizer_path)

        write_on_every_rank(tokenizer_path, write_tokenizer)
    dist.barrier()


def load_policy(policy: Any, weights_path: str, optimizer_path: str | None) -> None:
    """``DTensorPolicyWorker.load_checkpoint``: a ``save_policy`` directory into the policy's
    (already sharded) model, and the optimizer and scheduler when ``optimizer_path`` is
    given; with LoRA, ``weights_path`` holds the adapters in peft's format."""
    model, optimizer, scheduler = policy.model, policy.optimizer, policy.scheduler
    if policy.peft_model is None:
        load_sharded(model, optimizer, scheduler, weights_path, optimizer_path)
        return
    reshard(model)
    load_adapters(policy.peft_model, weights_path)
    if optimizer_path:
        load_optimizer(model, optimizer, scheduler, optimizer_path)
