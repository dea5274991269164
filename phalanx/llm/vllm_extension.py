"""The vLLM worker extension through which phalanx loads weights into a running engine.

vLLM mixes the class named by ``worker_extension_cls`` into each of its engine workers;
``collective_rpc(name, args)`` then calls the method on every one of them (in the calling
process when the engine runs in-process, in the engine-core process of the asynchronous
engine, in each tensor-parallel worker otherwise). Loading goes through the worker's
``reload_weights``: vLLM's in-place reload, which takes checkpoint-format names (the
Hugging Face model's) and redoes the backend's weight processing (fused projections, the
CPU backend's repacked layouts), so the same call serves every device. Imports nothing
from vLLM: the engine worker provides the methods.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from typing import Any

import torch


class WeightsExtension:
    """Methods phalanx calls on each vLLM engine worker (``self`` is that worker)."""

    def phalanx_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format ``(name, tensor)`` pairs in place; the count loaded."""
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(named)

    def phalanx_load_shared(
        self, entries: list[tuple[str, str, int, str, list[int]]], keep: list[str]
    ) -> dict[str, Any]:
        """Load tensors that live in shared-memory segments of this node, by reference.

        ``entries``: ``(name, segment path, byte offset, dtype name, shape)`` of each
        contiguous tensor. A segment is mapped once (read-only) and kept while the sender
        lists it in ``keep`` (the segments it still maps itself), so loading the next
        version through the same buffer costs no new mapping. All segments are mapped
        before anything loads: when one is gone (its owner removed its name), nothing is
        loaded and ``missing`` names it. Returns ``{"loaded": count, "missing": paths}``.
        """
        from phalanx.comm.shm import Segment, view_as

        maps: dict[str, Segment] = self.__dict__.setdefault("_phalanx_segments", {})
        needed = {path for _, path, *_ in entries}
        for path in set(maps) - needed - set(keep):
            del maps[path]
        missing = []
        for path in sorted(needed - set(maps)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only: never written
                    maps[path] = Segment.attach(path, populate=True, writable=False)
            except FileNotFoundError:
                missing.append(path)
        if missing:
            return {"loaded": 0, "missing": missing}
        named = [
            (name, view_as(maps[path].tensor, offset, getattr(torch, dtype), tuple(shape)))
            for name, path, offset, dtype, shape in entries
        ]
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"loaded": len(named), "missing": []}

    def phalanx_exit_with_parent(self) -> int:
        """End this process when its parent (the process that started it) is gone; its pid.

        The asynchronous engine's core process would otherwise outlive a killed generation
        worker, holding the model and the KV cache. A thread checks every second.
        """
        parent = os.getppid()

        def watch() -> None:
            tick = threading.Event()
            while not tick.wait(1.0):
                if os.getppid() != parent:
                    os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="phalanx-parent-watch", daemon=True).start()
        return os.getpid()
