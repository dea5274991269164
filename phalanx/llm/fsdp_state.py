"""The state of an FSDP2-sharded model: local shards, CPU copies, unshard and reshard,
and the gathered weights kept through a training step.

Shared by the policy worker (reference weights), its refit source (full weights for the
generators) and tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def unshard_fsdp2_model(model: torch.nn.Module) -> Generator[None, None, None]:
    """Hold the full (unsharded) parameters of every FSDP2 module inside the block."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for m in fsdp_modules:
            m.unshard()
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()


def reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters an FSDP2 forward left behind (state dicts then hold
    this rank's shards only)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gathers_once(setting: Any, fsdp_shards: int, cpu_offload: bool) -> bool:
    """Whether ``train`` keeps the gathered weights for a step (``gathered_for_step``), by
    the ``dtensor_cfg.gather_weights_once_per_step`` setting: True or False as given;
    ``"auto"`` (or None) where FSDP has one shard and no CPU offload. With more shards the
    kept copy would be the whole model's on every rank, and with CPU offload it would hold
    on the accelerator the memory the offload frees."""
    if setting in ("auto", None):
        return fsdp_shards == 1 and not cpu_offload
    return bool(setting)


@contextlib.contextmanager
def gathered_for_step(
    model: torch.nn.Module, enabled: bool
) -> Generator[Callable[[bool], None], None, None]:
    """Keep an FSDP2 model's gathered weights from the first forward of an optimizer step to
    the backward of its last micro-batch (``enabled``), instead of gathering them again for
    every forward and every backward.

    With one shard (FSDP world size 1) a "gather" is a cast of every weight to the compute
    dtype and two copies, made twice per micro-batch; kept, it is made once per step, for
    the memory of one compute-dtype copy of the weights during the step. Yields
    ``before_microbatch(is_last)``, to call before each micro-batch's forward: the weights
    are released after the last one's backward. On exit (an error included) every FSDP
    module is resharded and reshards after forward again (``parallelize.apply_fsdp``'s
    setting), so ``state_dict`` and in-place weight swaps see the sharded parameters. A
    model that is not an FSDP module is left as it is.
    """
    from torch.distributed.fsdp import FSDPModule

    if not (enabled and isinstance(model, FSDPModule)):
        yield lambda is_last: None
        return
    model.set_reshard_after_forward(False)
    try:
        yield lambda is_last: model.set_reshard_after_backward(is_last)
    finally:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_backward(True)
        reshard(model)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``t``: a DTensor on a one-rank mesh is its local tensor (no copy),
    one sharded over several ranks is gathered (a collective); a plain tensor is itself."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1 and t.to_local().shape == t.shape:
        return t.to_local()
    return t.full_tensor()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) weights on their device; a collective over the model's ranks."""
    reshard(model)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.state_dict().items()
    }


def get_cpu_state_dict(
    state_generator: Iterable[tuple[str, torch.Tensor | DTensor]], pin_memory: bool = False
) -> dict[str, torch.Tensor]:
    """Copy each tensor's local part (a DTensor's shard on this rank) into new CPU memory.

    The copies share nothing with the model, so they survive later training steps.
    ``pin_memory`` pins them (only when CUDA is available) for fast copies back.
    """
    pin = pin_memory and torch.cuda.is_available()
    out: dict[str, torch.Tensor] = {}
    for key, value in state_generator:
        part = local(value).detach()
        buf = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=pin)
        buf.copy_(part, non_blocking=pin)
        out[key] = buf
    if pin:
        torch.cuda.synchronize()
    return out
