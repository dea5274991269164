"""Device and memory facts of a policy rank (NeMo-RL's ``get_gpu_info`` keys, with CPU
figures where there is no GPU), its device id for same-device refit, and the profiler.

``DTensorPolicyWorker`` holds one ``DeviceInfo`` and its NeMo-RL methods call it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx.llm.fsdp_state import local


class DeviceInfo:
    """One policy rank's ``get_gpu_info``, ``report_device_id``, peak memory and profiler.

    Args:
        model: the rank's model (a parameter of it is sampled).
        device: the rank's device.
        rank: the rank among the policy's ranks.
        world_size: how many ranks the policy has.
        profile_dir: where traces go (``$TMPDIR/phalanx_profiles`` if None).
        trace_name: the first part of a trace's file name.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        rank: int,
        world_size: int,
        profile_dir: str | None,
        trace_name: str,
    ) -> None:
        self.model = model
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self._profile_dir = profile_dir
        self._trace_name = trace_name
        self._profiler: Any = None
        self._peak_rss = 0  # the largest resident memory seen (CPU's peak memory figure)

    def close(self) -> None:
        """Stop the profiler if it runs."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def reset_peak_memory_stats(self) -> None:
        """Start the peak memory figures again from now."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._peak_rss = self._rss()

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def get_gpu_info(self) -> dict[str, Any]:
        """Device and memory facts of this rank, with NeMo-RL's keys."""
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        mb = 1024 * 1024
        sample: dict[str, Any] = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                part = local(p)
                sample[name] = {
                    "device": str(part.device),
                    "shape": list(part.shape),
                    "dtype": str(part.dtype),
                }
                break
        cuda = torch.cuda.is_available()
        info: dict[str, Any] = {
            "rank": dist.get_rank() if dist.is_initialized() else self.rank,
            "world_size": dist.get_world_size() if dist.is_initialized() else self.world_size,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "local_device_id": torch.cuda.current_device() if cuda else None,
            "global_device_id": os.environ.get("CUDA_VISIBLE_DEVICES") if cuda else None,
            "device_count": torch.cuda.device_count() if cuda else 0,
            "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "memory_allocated_mb": (torch.cuda.memory_allocated(self.device) if cuda else rss) / mb,
            "memory_reserved_mb": (torch.cuda.memory_reserved(self.device) if cuda else rss) / mb,
            "peak_memory_allocated_mb": (
                torch.cuda.max_memory_allocated(self.device) if cuda else self._peak_rss
            )
            / mb,
            "peak_memory_reserved_mb": (
                torch.cuda.max_memory_reserved(self.device) if cuda else self._peak_rss
            )
            / mb,
            "parameter_sample": sample,
            "env_vars": {
                k: v
                for k, v in os.environ.items()
                if k.startswith("CUDA") or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")
            },
            # phalanx's own
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "device": str(self.device),
            "cuda": cuda,
            "cpu_rss_bytes": rss,
            "cpu_peak_rss_bytes": self._peak_rss,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        if cuda:
            props = torch.cuda.get_device_properties(self.device)
            info.update(total_memory=props.total_memory, device_uuid=self.report_device_id())
        return info

    def report_device_id(self) -> str:
        """The GPU's UUID, or ``cpu:<hostname>`` on CPU."""
        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return f"cpu:{socket.gethostname()}"

    def start_gpu_profiling(self) -> None:
        """Start the torch profiler (CPU activity, plus CUDA when present)."""
        from torch.profiler import ProfilerActivity, profile

        if self._profiler is not None:
            raise RuntimeError("start_gpu_profiling: profiling is already running")
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=acts, record_shapes=False)
        self._profiler.start()

    def stop_gpu_profiling(self) -> str:
        """Stop the profiler and write a Chrome trace; returns its path."""
        if self._profiler is None:
            raise RuntimeError("stop_gpu_profiling: call start_gpu_profiling first")
        prof, self._profiler = self._profiler, None
        prof.stop()
        out_dir = self._profile_dir or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), "phalanx_profiles"
        )
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{self._trace_name}_{int(time.time())}.json")
        prof.export_chrome_trace(path)
        return path
