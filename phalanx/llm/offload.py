"""Memory moves of the policy worker: model and optimizer state between the device and
host memory around training, log-prob inference and refit (NeMo-RL's method names).

``OffloadMixin`` is mixed into ``DTensorPolicyWorker``; the host class provides ``model``,
``optimizer``, ``cfg``, ``device`` and ``release_refit_buffers()`` (``RefitSource`` does).
"""

from __future__ import annotations

import gc
from typing import Any

import torch


def free_device_cache() -> None:
    """Return freed GPU memory to the device (a full gc only matters, and pays, on GPU)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


class OffloadMixin:
    """Moves of the model, its buffers and the optimizer state."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    cfg: dict[str, Any]
    device: torch.device

    def move_optimizer_to_device(self, device: str | torch.device) -> None:
        """Move every optimizer state tensor to ``device`` (no-op without an optimizer).

        Args:
            device: the target device.
        """
        if self.optimizer is None:
            return
        target = torch.device(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device != target:
                    state[k] = v.to(target)

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        """Move parameters and buffers of ``model`` to ``device``.

        Args:
            model: the model.
            device: the target device.

        Returns:
            The model.
        """
        model = self.move_buffer_to_device(model, device)
        return model.to(device)

    def move_buffer_to_device(
        self, model: torch.nn.Module, device: str | torch.device
    ) -> torch.nn.Module:
        """Move only the buffers (FSDP2 shards parameters, not buffers).

        Args:
            model: the model.
            device: the target device.

        Returns:
            The model.
        """
        target = torch.device(device)
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and buf.device != target:
                    setattr(module, name, buf.to(target))
        return model

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the GPU.

        Args:
            model: the model.

        Returns:
            The model.

        Raises:
            RuntimeError: CUDA is not available.
        """
        if not torch.cuda.is_available():
            raise RuntimeError("move_to_cuda: CUDA is not available on this worker (CPU only)")
        model = self.move_to_device(model, "cuda")
        torch.cuda.synchronize()
        return model

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the CPU and free the device's cache.

        Args:
            model: the model.

        Returns:
            The model.
        """
        model = self.move_to_device(model, "cpu")
        free_device_cache()
        return model

    def _model_device(self) -> torch.device:
        dcfg = self.cfg.get("dtensor_cfg") or {}
        return torch.device("cpu") if dcfg.get("cpu_offload") else self.device

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Model on its device in eval mode; optimizer state off the device unless
        ``keep_train_buffers`` (or ``offload_optimizer_for_logprob`` is False).

        Args:
            keep_train_buffers: keep the optimizer state on the device.
        """
        self.model = self.move_to_device(self.model, self._model_device())
        self.model.eval()
        if not keep_train_buffers and self.cfg.get("offload_optimizer_for_logprob", True):
            self.offload_before_refit()

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Model and optimizer state on the device, model in train mode.

        Args:
            *args, **kwargs: accepted for NeMo-RL's signature.
        """
        self.model = self.move_to_device(self.model, self._model_device())
        self.model.train()
        self.move_optimizer_to_device(self._model_device())
        free_device_cache()

    def offload_before_refit(self) -> None:
        """Move optimizer state to CPU to make room for refit buffers."""
        self.move_optimizer_to_device("cpu")
        free_device_cache()

    def offload_after_refit(self) -> None:
        """Free the held refit buffers and move the model to CPU (until training resumes)."""
        self.model = self.move_to_cpu(self.model)
        self.model.eval()
        self.release_refit_buffers()  # type: ignore[attr-defined]
        self.move_optimizer_to_device("cpu")
        free_device_cache()

    def finish_inference(self) -> None:
        """NeMo-RL's end of an inference phase (PPO): the model goes to host memory."""
        self.model = self.move_to_cpu(self.model)
        self.model.eval()
