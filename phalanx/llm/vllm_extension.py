"""The vLLM worker extension through which phalanx loads weights into a running engine.

vLLM mixes the class named by ``worker_extension_cls`` into each of its engine workers;
``LLM.collective_rpc(name, args)`` then calls the method on every one of them (in the
calling process when the engine runs in-process, in each tensor-parallel worker
otherwise). Loading goes through the worker's ``reload_weights``: vLLM's in-place reload,
which takes checkpoint-format names (the Hugging Face model's) and redoes the backend's
weight processing (fused projections, the CPU backend's repacked layouts), so the same call
serves every device. Imports nothing from vLLM: the engine worker provides the methods.
"""

from __future__ import annotations

import torch


class WeightsExtension:
    """Methods phalanx calls on each vLLM engine worker (``self`` is that worker)."""

    def phalanx_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format ``(name, tensor)`` pairs in place; the count loaded."""
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(named)
