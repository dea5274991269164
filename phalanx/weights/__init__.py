"""Weight synchronization: senders, receivers and their transports (layer 5).

Transports: ``"auto"`` (the default: same-node shared memory or CUDA IPC, the object store
across nodes), ``"object_store"``, ``"shm"``, ``"collective"``; see ``WeightSender``.

Public: ``WeightSender``, ``RayModuleTransformSender``, ``SyncResult``,
``WeightMismatchError``, ``NoModelError``, and worker-side building blocks
(``pack_state_dict``, ``pack_to_shm``, ``broadcast_stream``, ``receive_stream``,
``apply_weights``...) that policy workers build their refit methods on. Shared-memory
segments, CUDA IPC handles and process groups themselves come from ``phalanx.comm``
(``shm.Segment``, ``cuda_ipc``, ``process_group``); the names here wrap those. The
receiver mixin and the call lock live in the worker layer (``phalanx.worker``). Names are
imported on first use.
"""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "WeightSender": ".sender",
        "RayModuleTransformSender": ".sender",
        "SyncResult": ".sender",
        "WeightMismatchError": ".receiver",
        "NoModelError": ".receiver",
        "WeightsReceiverMixin": ".receiver",
        "check_finite": ".layout",
        "apply_weights": ".receiver",
        "validate": ".receiver",
        "bindings_epoch": ".targets",
        "target_tensors": ".targets",
        "ReadWriteLock": "phalanx.worker.call_lock",
        "Layout": ".layout",
        "TensorSpec": ".layout",
        "gather": ".layout",
        "pack_range": ".layout",
        "pack_state_dict": ".layout",
        "views": ".layout",
        "to_named_tensors": ".layout",
        "ShmRing": ".transports.shm",
        "ShmSegment": ".transports.shm",
        "pack_to_shm": ".transports.shm",
        "open_views": ".transports.shm",
        "broadcast_stream": ".transports.collective",
        "receive_stream": ".transports.collective",
        "new_process_group": ".transports.collective",
        "pack_to_cuda": ".transports.cuda_ipc",
        "ipc_handle": ".transports.cuda_ipc",
        "open_handle": ".transports.cuda_ipc",
        "RefitBuffer": ".transports.refit_buffer",
        "mapped_views": ".transports.refit_buffer",
        "mapped_buffer": ".transports.refit_buffer",
    },
)
