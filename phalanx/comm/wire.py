"""What travels between two endpoints: a pickled skeleton, tensor specs, raw tensor bytes.

Tensors (at any depth of any picklable object) are cut out by the pickler and travel as
raw bytes; numpy arrays travel as pickle-5 out-of-band buffers, also raw. The skeleton
and the specs (dtype, shape, transport) are pickled once per message. Non-contiguous
tensors are made contiguous; tensors that require grad are sent detached.

``select_transport`` is the one place that decides how a tensor's bytes travel.
"""

from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any

from phalanx.comm.config import CommConfig

INLINE, SHM, GLOO, NCCL, CUDA_IPC = "inline", "shm", "gloo", "nccl", "cuda_ipc"


def select_transport(
    device_type: str,
    nbytes: int,
    *,
    same_node: bool,
    same_gpu: bool,
    config: CommConfig,
) -> str:
    """How a tensor of ``nbytes`` on ``device_type`` reaches a peer.

    CUDA: the same physical GPU -> CUDA IPC handle; another GPU -> NCCL. CPU: in the
    message stream when small; shared memory on the same node from ``shm_min_bytes``;
    across nodes gloo above ``inline_max_bytes``.
    """
    if device_type == "cuda":
        return CUDA_IPC if same_gpu else NCCL
    if same_node and config.use_shm and nbytes >= config.shm_min_bytes:
        return SHM
    if nbytes <= config.inline_max_bytes:
        return INLINE
    return GLOO


@dataclass
class Blob:
    """One tensor (or raw buffer) of a message, with how it travels."""

    data: Any  # torch.Tensor, or memoryview for pickle buffers
    is_tensor: bool
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    device: str = "cpu"
    transport: str = INLINE
    extra: Any = None

    def spec(self) -> tuple:
        return (
            self.is_tensor,
            self.transport,
            self.dtype,
            self.shape,
            self.nbytes,
            self.device,
            self.extra,
        )


@dataclass
class Outgoing:
    """An encoded message: kind (``obj`` or ``raw``), pickled skeleton and blobs.

    ``shared`` (set by a broadcast): for a peer on this node, a shared-memory segment that
    already holds the message's shared-memory blobs and their offsets by blob index, so
    several readers map one copy.
    """

    kind: str
    skeleton: bytes = b""
    blobs: list[Blob] = field(default_factory=list)
    desc: str = ""
    shared: dict[str, tuple[Any, dict[int, int]]] = field(default_factory=dict)
    options: Any = None  # CollectiveGroupOptions for the pair's process group, if it is new


def tensor_blob(t: Any) -> Blob:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return Blob(
        data=t,
        is_tensor=True,
        dtype=str(t.dtype).removeprefix("torch."),
        shape=tuple(t.shape),
        nbytes=t.numel() * t.element_size(),
        device=t.device.type,
    )


def _torch():
    """torch if this process imported it (waiting for an import in progress in another thread)."""
    if "torch" not in sys.modules:
        return None
    import torch

    return torch


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, blobs: list[Blob], tensor_cls: Any):
        super().__init__(f, protocol=5, buffer_callback=self._buffer)
        self._blobs = blobs
        self._tensor_cls = tensor_cls

    def _buffer(self, buf: pickle.PickleBuffer) -> None:
        raw = buf.raw()
        self._blobs.append(Blob(data=raw, is_tensor=False, nbytes=raw.nbytes))

    def persistent_id(self, obj: Any) -> Any:
        if self._tensor_cls is not None and isinstance(obj, self._tensor_cls):
            self._blobs.append(tensor_blob(obj))
            return len(self._blobs) - 1
        return None


def encode(obj: Any) -> Outgoing:
    """Cut tensors and out-of-band buffers out of ``obj``; pickle the rest once."""
    blobs: list[Blob] = []
    torch = _torch()
    tensor_cls = torch.Tensor if torch is not None else None
    if tensor_cls is not None and type(obj) is tensor_cls:
        return Outgoing("obj", b"", [tensor_blob(obj)], desc="tensor")
    f = io.BytesIO()
    _Pickler(f, blobs, tensor_cls).dump(obj)
    return Outgoing("obj", f.getvalue(), blobs, desc=type(obj).__name__)


def encode_raw(tensor: Any) -> Outgoing:
    """A single tensor for ``recv_tensor`` (received in place into the caller's buffer)."""
    return Outgoing("raw", b"", [tensor_blob(tensor)], desc="tensor")


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, tensors: dict[int, Any], buffers: list[Any]):
        super().__init__(f, buffers=buffers)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid]


def decode(skeleton: bytes, values: list[Any], specs: list[tuple]) -> Any:
    """Rebuild the object from its skeleton and the received blobs (in order)."""
    if not skeleton:
        return values[0]
    tensors = {i: v for i, (v, s) in enumerate(zip(values, specs)) if s[0]}
    buffers = [v for v, s in zip(values, specs) if not s[0]]
    return _Unpickler(io.BytesIO(skeleton), tensors, buffers).load()


def torch_module() -> Any:
    import torch

    return torch


def dtype_of(name: str) -> Any:
    """The torch dtype called ``name`` (as in a blob's spec)."""
    return getattr(torch_module(), name)


def flat_u8(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch_module().uint8)


def byte_view(t: Any) -> memoryview:
    """A writable/readable byte view of a contiguous CPU tensor."""
    return memoryview(flat_u8(t).numpy())


def blob_bytes(b: Blob) -> Any:
    """A blob's bytes as a flat uint8 tensor (a tensor's storage or a pickle buffer)."""
    torch = torch_module()
    return flat_u8(b.data) if b.is_tensor else torch.frombuffer(b.data, dtype=torch.uint8)


def same_node_shm(b: Blob, config: CommConfig) -> bool:
    """Whether blob ``b`` travels through shared memory to a peer on this node."""
    return (
        select_transport(b.device, b.nbytes, same_node=True, same_gpu=False, config=config) == SHM
    )
