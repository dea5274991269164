"""Memory moves of the policy worker: model and optimizer state between the device and
host memory around training, log-prob inference and refit (NeMo-RL's method names).

``DTensorPolicyWorker`` holds one ``Offload`` over its model and optimizer and its
NeMo-RL methods call it; the moves of any model are the functions below.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch


def free_device_cache() -> None:
    """Return freed GPU memory to the device (a full gc only matters, and pays, on GPU)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def move_optimizer_to_device(
    optimizer: torch.optim.Optimizer | None, device: str | torch.device
) -> None:
    """Move every optimizer state tensor to ``device`` (no-op without an optimizer)."""
    if optimizer is None:
        return
    target = torch.device(device)
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != target:
                state[k] = v.to(target)


def move_buffer_to_device(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """Move only the buffers of ``model`` (FSDP2 shards parameters, not buffers)."""
    target = torch.device(device)
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.device != target:
                setattr(module, name, buf.to(target))
    return model


def move_to_device(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """Move parameters and buffers of ``model`` to ``device``; returns the model."""
    return move_buffer_to_device(model, device).to(device)


def move_to_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """Move ``model`` to the GPU (RuntimeError without CUDA); returns the model."""
    if not torch.cuda.is_available():
        raise RuntimeError("move_to_cuda: CUDA is not available on this worker (CPU only)")
    model = move_to_device(model, "cuda")
    torch.cuda.synchronize()
    return model


def move_to_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Move ``model`` to the CPU and free the device's cache; returns the model."""
    model = move_to_device(model, "cpu")
    free_device_cache()
    return model


@dataclass(eq=False, repr=False)
class Offload:
    """Where one policy rank's model and optimizer state live, phase by phase.

    Args:
        model: the rank's model (moved in place: ``Module.to`` returns the same module).
        optimizer: its optimizer, or None.
        model_device: where the model trains and infers (the CPU with ``cpu_offload``).
        offload_optimizer_for_logprob: move the optimizer state off the device for
            log-prob inference.
        release_refit_buffers: drops the weights held for refit receivers.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    model_device: torch.device
    offload_optimizer_for_logprob: bool
    release_refit_buffers: Callable[[], None]

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Model on its device in eval mode; optimizer state off the device unless
        ``keep_train_buffers`` (or ``offload_optimizer_for_logprob`` is False)."""
        move_to_device(self.model, self.model_device).eval()
        if not keep_train_buffers and self.offload_optimizer_for_logprob:
            self.offload_before_refit()

    def prepare_for_training(self) -> None:
        """Model and optimizer state on the device, model in train mode."""
        move_to_device(self.model, self.model_device).train()
        move_optimizer_to_device(self.optimizer, self.model_device)
        free_device_cache()

    def offload_before_refit(self) -> None:
        """Move optimizer state to CPU to make room for refit buffers."""
        move_optimizer_to_device(self.optimizer, "cpu")
        free_device_cache()

    def offload_after_refit(self) -> None:
        """Free the held refit buffers and move the model to CPU (until training resumes)."""
        move_to_cpu(self.model).eval()
        self.release_refit_buffers()
        move_optimizer_to_device(self.optimizer, "cpu")
        free_device_cache()

    def finish_inference(self) -> None:
        """NeMo-RL's end of an inference phase (PPO): the model goes to host memory."""
        move_to_cpu(self.model).eval()
