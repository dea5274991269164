"""Weight synchronization: senders, receivers and their transports (layer 5).

Transports: ``"auto"`` (the default: same-node shared memory or CUDA IPC, the object store
across nodes), ``"object_store"``, ``"shm"``, ``"collective"``; see ``WeightSender``.

Public: ``WeightSender``, ``RayModuleTransformSender``, ``SyncResult``,
``WeightMismatchError``, and worker-side building blocks (``pack_state_dict``,
``ShmSegment``, ``broadcast_stream``, ``receive_stream``, ``apply_weights``...) that
policy workers build their refit methods on. Names are imported on first use so that
importing the receiver mixin (part of every worker) does not pull in torch.
"""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

_LAZY = {
    "WeightSender": ".sender",
    "RayModuleTransformSender": ".sender",
    "SyncResult": ".sender",
    "WeightMismatchError": ".receiver",
    "WeightsReceiverMixin": ".receiver",
    "apply_weights": ".receiver",
    "validate": ".receiver",
    "ReadWriteLock": ".lock",
    "Layout": ".layout",
    "TensorSpec": ".layout",
    "gather": ".layout",
    "pack_range": ".layout",
    "pack_state_dict": ".layout",
    "views": ".layout",
    "to_named_tensors": ".layout",
    "ShmSegment": ".transports.shm",
    "pack_to_shm": ".transports.shm",
    "open_views": ".transports.shm",
    "broadcast_stream": ".transports.collective",
    "receive_stream": ".transports.collective",
    "new_process_group": ".transports.collective",
    "pack_to_cuda": ".transports.cuda_ipc",
    "ipc_handle": ".transports.cuda_ipc",
    "open_handle": ".transports.cuda_ipc",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
