"""Functions the GPU tests run in spawned processes (``torch.multiprocessing``, no Ray).

CUDA IPC needs two processes: a handle cannot be opened by the process that made it.
Each function talks to the test through queues; ``start`` spawns one with a given
environment (e.g. ``CUDA_VISIBLE_DEVICES=""`` for the CPU reference worker).
"""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Callable
from typing import Any

import torch


def start(fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Any:
    """A started spawn-context process running ``fn(*args)``; ``env`` is set in its environment."""
    ctx = torch.multiprocessing.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        proc = ctx.Process(target=fn, args=args, daemon=True)
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return proc


def free_port() -> int:
    """A TCP port nobody listens on right now (for a torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank0_env_vars() -> dict[str, str]:
    """The environment of rank 0 of a one-process torch.distributed group, on a free port."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }


def queues(n: int) -> list[Any]:
    """``n`` spawn-context queues."""
    ctx = torch.multiprocessing.get_context("spawn")
    return [ctx.Queue() for _ in range(n)]


def put_by_value(q: Any, obj: Any) -> None:
    """Put ``obj`` on ``q`` as bytes (``torch.save``). A CPU tensor put as is travels as a
    shared-memory fd that the parent can open only while the child is alive, and a child
    that exits right after ``put`` makes the parent's ``get`` fail (FileNotFoundError)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    q.put(buf.getvalue())


def get_by_value(q: Any, timeout: float) -> Any:
    """What :func:`put_by_value` put on ``q``."""
    return torch.load(io.BytesIO(q.get(timeout=timeout)), weights_only=False)


def version_tensors(version: int) -> dict[str, torch.Tensor]:
    """The CPU tensors of weights version ``version`` (the same in every process)."""
    gen = torch.Generator().manual_seed(1000 + version)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layer.bias": torch.randn(32, generator=gen).to(torch.bfloat16),
        "layer.steps": torch.randint(0, 1 << 20, (7,), generator=gen),
    }


def ipc_sender(out_q: Any, cmd_q: Any) -> None:
    """Share versions of ``version_tensors`` through CUDA IPC, one per ``"next"`` command.

    Each version is packed into a fresh CUDA buffer, kept alive until the next one; on
    ``"exit"`` the process ends, taking its buffers with it.
    """
    from phalanx.weights import gather, ipc_handle, pack_to_cuda

    device = torch.device("cuda", 0)
    version, alive = 0, None
    while True:
        cmd = cmd_q.get(timeout=120)
        if cmd == "exit":
            return
        version += 1
        named = {k: v.to(device) for k, v in version_tensors(version).items()}
        layout, sources = gather(named)
        alive = pack_to_cuda(layout, sources, device)
        out_q.put(
            {"version": version, "layout": layout, "handle": ipc_handle(alive), "pid": os.getpid()}
        )


def cpu_logprobs(out_q: Any, model_path: str, data: Any, port: int) -> None:
    """Log-probs of ``data`` by a CPU ``DTensorPolicyWorker`` (gloo, world size 1)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    from transformers import AutoTokenizer

    import phalanx as px
    from phalanx.llm.policy_worker import DTensorPolicyWorker

    assert not torch.cuda.is_available()
    worker = DTensorPolicyWorker(
        policy_config(model_path), AutoTokenizer.from_pretrained(model_path)
    )
    try:
        logprobs = worker.get_logprobs(data)["logprobs"]
        put_by_value(out_q, px.BatchedDataDict(logprobs=logprobs))
    finally:
        worker.shutdown()


def generation_receiver(in_q: Any, out_q: Any, model_path: str, prompts: Any) -> None:
    """An ``HFGenerationWorker`` on the GPU: per IPC handle received, refit, then report its
    weights, greedy generation of ``prompts``, the address of the buffer it keeps mapped
    and whether that mapping is the one of the previous refit; ends on ``None``."""
    import weakref

    from transformers import AutoTokenizer

    from phalanx.llm.generation import HFGenerationWorker
    from phalanx.weights import mapped_buffer

    cfg = {"model_name": model_path, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0}
    worker = HFGenerationWorker(cfg, AutoTokenizer.from_pretrained(model_path))
    previous = None
    while True:
        handles = in_q.get(timeout=300)
        if handles is None:
            return
        assert worker.update_weights_from_ipc_handles(handles) is True
        out = worker.generate(prompts, greedy=True)
        mapped = mapped_buffer(worker)
        put_by_value(
            out_q,
            {
                "state": worker.get_state_dict(),
                "out": dict(out),
                "device": str(worker.device),
                "mapped_ptr": mapped.data_ptr(),
                "same_mapping": previous is not None and previous() is mapped,
            },
        )
        previous = weakref.ref(mapped)  # not a reference: a replaced mapping is released


def policy_config(model_path: str, **over: Any) -> dict[str, Any]:
    """The policy config of the GPU tests (tiny model, fp32 unless overridden)."""
    cfg = {
        "model_name": model_path,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 4,
        "max_total_sequence_length": 32,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-3}},
    }
    cfg.update(over)
    return cfg


def nccl_stream_rank(out_q: Any, rank: int, world: int, port: int, bucket_bytes: int) -> None:
    """Rank ``rank`` of an NCCL weights group: rank 0 broadcasts ``version_tensors(1)`` as a
    stream (``broadcast_stream``), the others receive it and report what they got."""
    from phalanx.comm.process_group import host_store, join_store
    from phalanx.weights import broadcast_stream, gather, new_process_group, receive_stream, views

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if rank == 0:
        store = host_store("127.0.0.1", 120.0, port)
    else:
        store = join_store("127.0.0.1", port, 120.0, world)
    pg = new_process_group(store, "kit", rank, world, "nccl", 120.0)
    layout, sources = gather({k: v.to(device) for k, v in version_tensors(1).items()})
    if rank == 0:
        broadcast_stream(pg, layout, sources, bucket_bytes, device)
        torch.cuda.synchronize()
        put_by_value(out_q, (rank, None))
    else:
        flat = receive_stream(pg, layout, bucket_bytes, device)
        torch.cuda.synchronize()
        put_by_value(out_q, (rank, {k: v.cpu() for k, v in views(flat, layout).items()}))
    del store
