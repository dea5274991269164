"""The one place phalanx makes torch process groups and the TCP stores they meet on.

Every process group phalanx builds (point-to-point directions in ``endpoint.py``, named
collective groups in ``collective.py``, the weight sender's broadcast groups and the LLM
refit group) is a group *of its own*, not torch's default group, so a worker that also
trains with ``init_process_group`` keeps its default group untouched. One side hosts a
``TCPStore`` on its node's own address (``host_store``), the others join it
(``join_store``); ``make_process_group`` then builds gloo (bound to that address) or NCCL
on a key-prefixed view of the store, so several groups can share one store.
"""

from __future__ import annotations

import datetime
from typing import Any

GLOO = "gloo"
NCCL = "nccl"
BACKENDS = (GLOO, NCCL)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def host_store(ip: str, timeout_s: float, port: int = 0) -> Any:
    """A ``TCPStore`` served by this process on ``ip`` (port 0: any free port; see ``.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        ip, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s)
    )


def join_store(ip: str, port: int, timeout_s: float, world_size: int | None = None) -> Any:
    """A client of the ``TCPStore`` another process hosts at ``ip:port``."""
    import torch.distributed as dist

    return dist.TCPStore(ip, port, world_size, False, timeout=_timeout(timeout_s))


def make_process_group(
    backend: str,
    store: Any,
    rank: int,
    size: int,
    *,
    prefix: str = "",
    ip: str | None = None,
    timeout_s: float = 1800.0,
    options: Any = None,
) -> Any:
    """A gloo or NCCL process group of ``size`` ranks on ``store`` (under ``prefix``).

    Gloo binds to ``ip`` when given (the node's own address, never all interfaces).
    Every operation of the group times out after ``timeout_s`` (``options.timeout_s``
    when set); NCCL takes the accelerator settings of ``options``
    (a ``CollectiveGroupOptions``).
    """
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if prefix:
        store = dist.PrefixStore(prefix, store)
    if options is not None and options.timeout_s is not None:
        timeout_s = options.timeout_s
    timeout = _timeout(timeout_s)
    if backend == GLOO:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        if ip is not None:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    if options is not None:
        options.apply_nccl(opts)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def broadcast(pg: Any, tensor: Any, root: int = 0) -> Any:
    """Start broadcasting ``tensor`` from ``root`` on ``pg``; returns the work to wait on."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def make_pair_group(
    backend: str, store: Any, key: str, rank: int, ip: str, connect_s: float, options: Any = None
) -> Any:
    """The two-rank process group of one point-to-point direction (rank 0 sends)."""
    timeout_s = max(connect_s, 1800)
    return make_process_group(
        backend, store, rank, 2, prefix=key, ip=ip, timeout_s=timeout_s, options=options
    )
