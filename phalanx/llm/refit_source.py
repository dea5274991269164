"""The policy worker as a refit source: its weights, gathered or written shard by shard,
for generation workers (NeMo-RL's IPC and collective refit methods).

Built on the weight-sync layer (``phalanx.weights``): its stream layout, shared-memory
segments, CUDA IPC handles and bucketed collective broadcast. ``DTensorPolicyWorker``
holds one ``RefitSource`` and its refit methods call it. Refit reads the weights from
``_refit_state()`` (gathered or written shard by shard; with LoRA, adapters merged).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from phalanx.llm.fsdp_state import reshard, whole_tensor
from phalanx.llm.lora import base_state_dict, merged_state_dict

PG_TIMEOUT_S = 300.0


class _PlanState(dict):
    """A full state made by ``_RefitPlan.full_state`` (``plan``: that plan)."""

    def __init__(self, plan: _RefitPlan) -> None:
        super().__init__()
        self.plan = plan


@dataclass(eq=False, repr=False)
class _RefitPlan:
    """What a refit reads of a model without LoRA, kept from refit to refit.

    The FSDP modules to reshard, the state dict's names and tensors (the parameters
    themselves, as ``target_tensors`` keeps them) and which of them are whole on this
    rank; and, per refit dtype, the stream layout of the full state. It holds while no
    module registered a tensor or submodule (``epoch``, the process's ``bindings_epoch``)
    and the model's state dict is still these tensors: training and offload change their
    data, which every refit reads afresh, not the tensors.
    """

    epoch: int
    fsdp_modules: list[torch.nn.Module]
    names: list[str]
    tensors: list[torch.Tensor]
    whole: list[bool]  # the local part is the full tensor (a one-rank mesh, or not a DTensor)
    _streams: dict[torch.dtype, tuple[Any, list[int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module, state: dict[str, torch.Tensor], epoch: int) -> _RefitPlan:
        from torch.distributed.fsdp import FSDPModule

        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        whole = [
            not isinstance(v, DTensor)
            or (v.device_mesh.size() == 1 and v.to_local().shape == v.shape)
            for v in state.values()
        ]
        return cls(epoch, fsdp_modules, list(state), list(state.values()), whole)

    def reads(self, state: dict[str, torch.Tensor], epoch: int) -> bool:
        """True when ``state`` (the model's, now) is the one this plan was made from."""
        return (
            epoch == self.epoch
            and len(state) == len(self.tensors)
            and all(a is b for a, b in zip(state.values(), self.tensors))
            and list(state) == self.names
        )

    def full_state(self) -> _PlanState:
        """Every tensor whole (a collective where some are sharded over several ranks),
        in the plan's order; call under ``torch.no_grad``, with the model resharded."""
        out = _PlanState(self)
        for name, t, whole in zip(self.names, self.tensors, self.whole):
            if not whole:
                out[name] = t.full_tensor()
            elif isinstance(t, DTensor):
                out[name] = t.to_local()  # under no_grad: a view that tracks no gradient
            else:
                out[name] = t.detach()
        return out

    def layout(self, state: _PlanState, dtype: torch.dtype) -> tuple[Any, list[torch.Tensor]]:
        """``gather(state, dtype=dtype)`` for a ``state`` from ``full_state``, planned once
        per dtype (names, shapes and tied tensors are the plan's)."""
        from phalanx.weights import gather

        kept = self._streams.get(dtype)
        if kept is None:
            layout, _ = gather(state, dtype=dtype)
            at = {name: i for i, name in enumerate(self.names)}
            kept = self._streams[dtype] = (layout, [at[s.name] for s in layout.specs])
        layout, picks = kept
        values = list(state.values())
        return layout, [values[i] for i in picks]


@dataclass(eq=False, repr=False)
class RefitSource:
    """One policy rank's refit methods and the buffers they keep between refits.

    Args:
        model: the rank's (FSDP2-sharded) model.
        peft_model: the ``peft.PeftModel`` over ``model`` with LoRA, else None.
        cfg: the policy config (its refit buffer size).
        dtype: the dtype the weights are sent in (the policy's precision).
        device: the rank's device.
        rank: the rank among the policy's ranks.
        device_id: gives the id of the rank's device, as the IPC handles are keyed.
    """

    model: torch.nn.Module
    peft_model: Any
    cfg: dict[str, Any]
    dtype: torch.dtype
    device: torch.device
    rank: int
    device_id: Callable[[], str]
    # What refits keep between them (not constructor arguments):
    _held_refit: dict[str, torch.Tensor] | None = field(default=None, init=False)
    _kept_plan: _RefitPlan | None = field(default=None, init=False)
    _ipc_buffer: Any = field(default=None, init=False)  # RefitBuffer of get_weights_ipc_handles
    _refit_segment: Any = field(default=None, init=False)
    _refit_layout: tuple[Any, Any] | None = field(default=None, init=False)
    _one_node: bool | None = field(default=None, init=False)
    # name -> mapped buffer (write_weights_to_shm)
    _refit_maps: dict[str, Any] = field(default_factory=dict, init=False)
    _refit_store: Any = field(default=None, init=False)
    model_update_group: Any = field(default=None, init=False)  # the collective refit's group

    def _refit_state(self, merged: bool = True) -> dict[str, torch.Tensor]:
        """The weights a refit sends, as this rank holds them: the model's state dict, or
        with LoRA the base model's names with the adapters merged (each rank its own rows;
        a collective), or unmerged when ``merged`` is False (for names and shapes)."""
        reshard(self.model)
        if self.peft_model is None:
            return self.model.state_dict()
        return merged_state_dict(self.peft_model) if merged else base_state_dict(self.peft_model)

    def _plan(self) -> _RefitPlan:
        """The kept ``_RefitPlan`` of the model (without LoRA), made again when it no
        longer holds; the model is resharded first (FSDP2 swaps its parameters while
        they are gathered)."""
        from phalanx.weights import bindings_epoch, target_tensors

        epoch = bindings_epoch()
        plan = self._kept_plan
        if plan is not None and plan.epoch == epoch:  # the same modules
            for m in plan.fsdp_modules:
                m.reshard()
        else:
            reshard(self.model)
        state = target_tensors(self.model)
        if plan is None or not plan.reads(state, epoch):
            plan = self._kept_plan = _RefitPlan.of(self.model, state, epoch)
        return plan

    @torch.no_grad()
    def _full_refit_state(self) -> dict[str, torch.Tensor]:
        """``_refit_state()`` gathered into full tensors (a collective). A refit only reads
        them before the next step, so a tensor that is whole on this rank (world size 1)
        is returned as is, not copied. Without LoRA the tensors come from the kept
        ``_RefitPlan``: a refit does not walk the model's state dict again."""
        if self.peft_model is None:
            return self._plan().full_state()
        return {k: whole_tensor(v).detach() for k, v in self._refit_state().items()}

    def _stream_of(
        self, held: dict[str, torch.Tensor], keys: list[str] | None = None
    ) -> tuple[Any, list[torch.Tensor]]:
        """``gather(held[keys], dtype=self.dtype)``: (layout, sources); the kept plan's
        layout when ``held`` is the plan's full state (every name, in order)."""
        from phalanx.weights import gather

        plan = self._kept_plan
        if isinstance(held, _PlanState) and held.plan is plan and keys in (None, plan.names):
            return plan.layout(held, self.dtype)
        chosen = held if keys is None else {k: held[k] for k in keys}
        return gather(chosen, dtype=self.dtype)

    def release_refit_buffers(self) -> None:
        """Drop the weights held for IPC handles (receivers have copied them). The packed
        buffer of ``get_weights_ipc_handles`` stays for the next refit (``close`` frees it)."""
        self._held_refit = None

    def close(self) -> None:
        """Release every refit buffer and unlink the segments this rank created."""
        self.release_refit_buffers()
        if self._ipc_buffer is not None:
            self._ipc_buffer.release()
        if self._refit_segment is not None and self.rank == 0:
            self._refit_segment.unlink()
        self._ipc_buffer = self._refit_segment = None
        self._refit_maps = {}

    @torch.no_grad()
    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{name: (full shape, refit dtype)}`` of the weights a refit sends."""
        return {k: (v.shape, self.dtype) for k, v in self._refit_state(merged=False).items()}

    def _refit_bucket_bytes(self) -> int:
        from phalanx.weights.layout import check_sizes

        if "refit_buffer_size_gb" in self.cfg:  # NeMo-RL's key
            return check_sizes(float(self.cfg["refit_buffer_size_gb"]) * 1024)
        return check_sizes(self.cfg.get("refit_buffer_size_mb", 64))

    @torch.no_grad()
    def prepare_weights_for_ipc(self) -> tuple[list[tuple[str, int]], float]:
        """Gather the full weights and hold them; ``([(name, nbytes)], free bytes)``.

        At world size 1 nothing is gathered or copied: the held tensors are the parameters.
        """
        self._held_refit = self._full_refit_state()
        item = self.dtype.itemsize
        info = [(k, v.numel() * item) for k, v in self._held_refit.items()]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            import psutil

            free = psutil.virtual_memory().available
        return info, float(free)

    @torch.no_grad()
    def get_weights_ipc_handles(self, keys: Iterable[str]) -> dict[str, Any]:
        """``{device_id: handle}`` to the held weights ``keys`` (CUDA IPC or shared memory).

        The weights are cast and copied into this rank's ``RefitBuffer``: one buffer, on
        the weights' device, kept for every refit of the same keys, shapes and dtype, so
        its handle is the same from refit to refit (receivers map it once). The buffer is
        rewritten in place: call this again only after every receiver returned from
        ``update_weights_from_ipc_handles`` with the previous handle (a synchronous refit
        between phases does). Calls with changing ``keys`` reallocate it each time.
        """
        from phalanx.weights import RefitBuffer

        if self._held_refit is None:
            raise RuntimeError("get_weights_ipc_handles: call prepare_weights_for_ipc first")
        keys = list(keys)
        missing = [k for k in keys if k not in self._held_refit]
        if missing:
            raise KeyError(f"get_weights_ipc_handles: unknown keys {missing[:5]}")
        layout, sources = self._stream_of(self._held_refit, keys)
        if self._ipc_buffer is None:
            cuda = self.device.type == "cuda"
            self._ipc_buffer = RefitBuffer(self.device if cuda else torch.device("cpu"))
        return {self.device_id(): self._ipc_buffer.pack(layout, sources)}

    def pack_weights_for_ipc(self) -> dict[str, Any] | None:
        """Write the weights into a same-node buffer; rank 0 returns the handles."""
        if self.device.type == "cuda" or not self._policy_on_one_node():
            info, _ = self.prepare_weights_for_ipc()
            return self.get_weights_ipc_handles([k for k, _ in info]) if self.rank == 0 else None
        from phalanx.llm.refit_stream import write_shards

        state, layout = self._stream_state()
        segment = self._shared_segment(layout.total_bytes)
        write_shards(segment.tensor, layout, state, self.rank == 0)
        dist.barrier()  # rank 0 returns once every rank has written: receivers may read
        if self.rank != 0:
            return None
        return {self.device_id(): {"kind": "shm", "layout": layout, "name": segment.name}}

    def _stream_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        """The (resharded) state dict and its full-tensor stream layout, cached by shapes."""
        from phalanx.llm.refit_stream import stream_layout

        state = self._refit_state()
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in state.items())
        if self._refit_layout is None or self._refit_layout[0] != key:
            self._refit_layout = (key, stream_layout(state, self.dtype))
        return state, self._refit_layout[1]

    def shm_refit_layout(self) -> Any:
        """The stream layout for ``write_weights_to_shm`` (None where it cannot be used)."""
        if self.device.type == "cuda" or not self._policy_on_one_node():
            return None
        return self._stream_state()[1]

    def write_weights_to_shm(self, path: str, live: Iterable[str] = ()) -> Any:
        """Write this rank's rows into the shared buffer ``path``; rank 0 returns the layout."""
        from phalanx.llm.refit_stream import write_shards
        from phalanx.weights import ShmSegment

        state, layout = self._stream_state()
        keep = {os.path.basename(p) for p in (path, *live)}
        maps = {k: v for k, v in self._refit_maps.items() if k in keep}
        name = os.path.basename(path)
        seg = maps.get(name)
        if seg is None:
            seg = maps[name] = ShmSegment(0, name=path, create=False)
        self._refit_maps = maps
        if seg.size < layout.total_bytes:
            raise ValueError(
                f"write_weights_to_shm: buffer {path!r} holds {seg.size} bytes, the weights "
                f"need {layout.total_bytes}"
            )
        write_shards(seg.tensor, layout, state, self.rank == 0)
        dist.barrier()  # rank 0 returns once every rank has written: receivers may read
        return layout if self.rank == 0 else None

    def _policy_on_one_node(self) -> bool:
        if self._one_node is None:
            hosts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            self._one_node = len(set(hosts)) == 1
        return self._one_node

    def _shared_segment(self, nbytes: int) -> Any:
        """The refit segment every policy rank maps (rank 0 creates it, once per size)."""
        from phalanx.weights import ShmSegment

        seg = self._refit_segment
        if seg is not None and seg.size >= nbytes:
            return seg  # every rank decides alike: all saw the same sizes
        name: list[Any] = [None]
        if self.rank == 0:
            if seg is not None:
                seg.unlink()
            seg = ShmSegment(nbytes)
            name = [seg.name]
        dist.broadcast_object_list(name, src=0)
        if self.rank != 0:
            seg = ShmSegment(nbytes, name=name[0], create=False)
        self._refit_segment = seg
        return seg

    def prepare_info_for_collective(self) -> dict[str, Any]:
        """``{"layout": ..., "bucket_bytes": ...}`` of a collective refit."""
        layout, _ = self._stream_of(self._full_refit_state())
        return {"layout": layout, "bucket_bytes": self._refit_bucket_bytes()}

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """Create the refit process group as its rank 0 (on policy rank 0 only)."""
        if self.rank != 0:
            return
        from phalanx.comm.process_group import host_store
        from phalanx.weights import new_process_group

        store = host_store(ip, PG_TIMEOUT_S, port)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._refit_store = store
        self.model_update_group = new_process_group(
            store, "refit", 0, world_size, backend, PG_TIMEOUT_S
        )

    def broadcast_weights_for_collective(self) -> None:
        """Gather the full weights (all policy ranks) and broadcast them from rank 0."""
        from phalanx.weights import broadcast_stream

        full = self._full_refit_state()
        if self.rank != 0:
            return
        if self.model_update_group is None:
            raise RuntimeError("broadcast_weights_for_collective: call init_collective first")
        layout, sources = self._stream_of(full)
        broadcast_stream(
            self.model_update_group, layout, sources, self._refit_bucket_bytes(), self.device
        )
