"""Cores that follow the phase in asynchronous GRPO on one machine.

With placement "shared", asynchronous generation and training overlap only while a
generation batch is in flight; the collector then idles until the next refit. A fixed
split (half the cores each) leaves the trainer on half the machine for the rest of its
step. Here the driver's collector says when a batch starts and ends, by writing the
policy's thread count into a small file (in ``/dev/shm`` where it exists); each policy
worker reads it before every micro-batch and calls ``torch.set_num_threads`` when it
changed: its share while generating, every core otherwise. Only for workers on the
driver's machine (the shared placement on one node).
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from typing import Any

import torch

from phalanx.comm.shm import owner_token

_FORMAT = "<i"


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PhaseThreads:
    """Driver side: the policy's thread count while a generation batch runs (``busy``)
    and while none does (``idle``); :meth:`generating` switches between them."""

    def __init__(self, busy: int, idle: int) -> None:
        for name, v in (("busy", busy), ("idle", idle)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PhaseThreads: {name} must be an int >= 1, got {v!r}")
        self.busy, self.idle = busy, idle
        # named as phalanx's shared-memory segments are (px_<kind>_<pid>-<start time>_), so
        # that reap_orphans() removes it only once this process has ended
        fd, self.path = tempfile.mkstemp(prefix=f"px_threads_{owner_token()}_", dir=_folder())
        os.close(fd)
        self.generating(True)  # the collector starts with a batch

    def generating(self, on: bool) -> None:
        """A generation batch started (``True``) or ended."""
        fd = os.open(self.path, os.O_WRONLY)
        try:  # 4 bytes in one write: a reader sees the old count or the new one
            os.pwrite(fd, struct.pack(_FORMAT, self.busy if on else self.idle), 0)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Remove the file (again: a no-op)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class FollowThreads:
    """Worker side: a micro-batch hook that sets torch's thread count to the file's."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(4)
        except FileNotFoundError:  # the run closed it: keep the current count
            return
        if len(raw) == 4:
            n = struct.unpack(_FORMAT, raw)[0]
            if n >= 1 and n != torch.get_num_threads():
                torch.set_num_threads(n)


def follow_phase_threads(worker: Any, path: str) -> int:
    """(On a policy worker) read the thread count from ``path`` before every micro-batch;
    returns the count now."""
    hook = FollowThreads(path)
    worker.add_microbatch_hook(hook)
    hook()
    return torch.get_num_threads()
