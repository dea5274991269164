"""vLLM's asynchronous engine (v1 ``AsyncLLM``) behind a generation worker's blocking calls,
and the refit into its engine-core process by shared-memory reference.

``AsyncLLM`` runs its engine core (scheduler, model, KV cache) in a process of its own,
which vLLM spawns (inside a Ray actor it always spawns), and talks to it over ZeroMQ. The
worker drives it from an event loop on a thread of its own (``AsyncEngine``), so its
methods stay the blocking ones the training loops call; a batch's requests are all
submitted at once and the engine batches them continuously. The engine's scheduler reports
how many requests it runs after each step (``AsyncEngine.max_running``: the most during the
last ``generate``), and ``pin_process_tree`` moves the engine core onto given cores.

Weights reach the engine-core process by reference, not through vLLM's message queue:
every staged tensor lives in a shared-memory segment of this node (``SharedStaging``), and
the engine core maps the segment and loads views of it
(``WeightsExtension.phalanx_load_shared``); only names, paths and offsets travel.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

import psutil
import torch

from phalanx.comm.shm import Segment, segment_path
from phalanx.weights import gather, pack_to_shm, views
from phalanx.worker.weights_state import receiver_state

ENGINE_START_TIMEOUT_S = 900.0  # the engine core compiles its graphs as it starts


class AsyncEngine:
    """An ``AsyncLLM`` on an event loop of its own thread, with blocking methods.

    ``max_running`` is the most requests the engine's scheduler ran at once during the
    last ``generate`` (its count after each step).

    Args:
        kwargs: ``AsyncEngineArgs`` fields (what ``vllm_config.engine_kwargs`` returns).
    """

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-async-engine", daemon=True
        )
        self._thread.start()
        self._ids = itertools.count()
        self._running_peak = 0
        self.max_running = 0
        try:
            # Built on the loop, so its output handler runs there.
            self.engine = self.run(self._start(kwargs), ENGINE_START_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            raise
        self.max_model_len = int(self.engine.model_config.max_model_len)

    async def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class RunningRequests(StatLoggerBase):
            """Keeps the peak of the scheduler's running-request count (on the loop)."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index  # vLLM's config: nothing read from it

            def record(self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any):
                if scheduler_stats is not None:
                    running = int(scheduler_stats.num_running_reqs)
                    engine._running_peak = max(engine._running_peak, running)

            def log_engine_initialized(self) -> None:
                """Nothing to log: this logger only keeps the peak."""

        # A custom stat logger makes the engine core report its scheduler's counts; with
        # disable_log_stats vLLM adds no periodic log lines of its own.
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[RunningRequests])

    @property
    def thread_id(self) -> int:
        """The native id of the thread that runs the engine's event loop."""
        return int(self._thread.native_id or 0)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _one(self, prompt: dict[str, Any], params: Any, request_id: str) -> Any:
        """The final ``RequestOutput`` of one request."""
        final = None
        async for out in self.engine.generate(prompt, params, request_id):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        return final

    def _request_ids(self, n: int) -> list[str]:
        batch = next(self._ids)
        return [f"px-{os.getpid()}-{batch}-{i}" for i in range(n)]

    def generate(self, prompts: list[dict[str, Any]], params: Any) -> list[Any]:
        """The final output of every prompt, in order; all submitted at once
        (``max_running`` is then the most the scheduler ran together)."""
        ids = self._request_ids(len(prompts))

        async def all_of() -> list[Any]:
            self._running_peak = 0
            outs = await asyncio.gather(*(self._one(p, params, r) for p, r in zip(prompts, ids)))
            self.max_running = self._running_peak
            return list(outs)

        return self.run(all_of())

    async def stream(
        self, prompts: list[dict[str, Any]], params: Any
    ) -> AsyncIterator[tuple[int, Any]]:
        """``(index, final output)`` of each prompt as it finishes, on the caller's loop.

        All requests are submitted at once; those not yet finished when the caller stops
        iterating are aborted.
        """
        futures = [
            asyncio.run_coroutine_threadsafe(self._one(p, params, r), self._loop)
            for p, r in zip(prompts, self._request_ids(len(prompts)))
        ]

        async def tagged(i: int) -> tuple[int, Any]:
            return i, await asyncio.wrap_future(futures[i])

        try:
            for next_done in asyncio.as_completed([tagged(i) for i in range(len(futures))]):
                yield await next_done
        finally:
            for f in futures:
                f.cancel()

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call ``method`` on every engine worker (in the engine-core process)."""
        return self.run(self.engine.collective_rpc(method, args=args))

    def is_sleeping(self) -> bool:
        return bool(self.run(self.engine.is_sleeping()))

    def sleep(self, level: int = 1) -> None:
        self.run(self.engine.sleep(level))

    def wake_up(self) -> None:
        self.run(self.engine.wake_up())

    def shutdown(self) -> None:
        """Stop the engine-core process, then the loop."""
        if self._loop.is_closed():
            return

        async def close() -> None:
            self.engine.shutdown()

        try:
            self.run(close(), 120)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        if not self._thread.is_alive():
            self._loop.close()


def pin_process_tree(pid: int, cpus: set[int]) -> list[int]:
    """Run every thread of process ``pid``, and of the processes it started, only on
    ``cpus`` (Linux affinity); the pids pinned. A thread started meanwhile inherits its
    starter's affinity, so a process's threads are listed again until none is new."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    pinned: list[int] = []
    for proc in procs:
        seen: set[int] = set()
        try:
            while new := {t.id for t in proc.threads()} - seen:
                for tid in new:
                    try:
                        os.sched_setaffinity(tid, cpus)
                    except ProcessLookupError:
                        continue  # the thread ended
                seen |= new
        except psutil.NoSuchProcess:
            continue  # it ended
        pinned.append(proc.pid)
    return pinned


Entry = tuple[str, str, int, str, list[int]]  # name, segment path, offset, dtype, shape


class SharedStaging:
    """The staged weights kept where another process of this node can map them.

    Each staged tensor views a shared-memory segment: the weight sender's buffer when a
    refit pointed it there (route ``shm_view``), else its slot in a segment this object
    owns, laid out once as ``phalanx.weights.gather`` plans the staged tensors. A refit
    that copies into the staged tensors writes into those slots; a tensor a refit left in
    private memory (``unshare``) is copied back into its slot by ``entries``.

    Args:
        worker: the receiving worker (its mapped sender buffers are looked up).
        staged: the staged tensors by checkpoint name (tied names share a tensor's data).
    """

    def __init__(self, worker: Any, staged: dict[str, torch.Tensor]) -> None:
        self._worker = worker
        self.staged = staged
        self.layout, sources = gather(staged)
        self.segment: Segment | None = pack_to_shm(self.layout, sources, None)
        self._slots = views(self.segment.tensor, self.layout)
        with torch.no_grad():
            for spec in self.layout.specs:
                self._point(spec.name)

    def _point(self, name: str) -> None:
        """Make the staged tensor ``name`` (and its tied names) view its own slot."""
        slot = self._slots[name]
        self.staged[name].data = slot
        for alias, canon in self.layout.aliases.items():
            if canon == name:
                self.staged[alias].data = slot

    def _sender_segments(self) -> list[Segment]:
        """The weight sender's buffers this worker maps (and still has a name)."""
        maps = receiver_state(self._worker).scratch.get("shm_maps", {})
        return [seg for path, seg in maps.items() if os.path.exists(path)]

    @property
    def mapped_paths(self) -> list[str]:
        """The segments the engine core may keep mapped: this one and the sender's live ones."""
        own = [] if self.segment is None else [self.segment.path]
        return own + [s.path for s in self._sender_segments()]

    def entries(self, gone: Iterable[str] = ()) -> list[Entry]:
        """Where each staged tensor lives, for ``WeightsExtension.phalanx_load_shared``.

        A tensor outside every segment, or in one of the segments ``gone`` (their names
        removed before the engine core mapped them), is first copied into its own slot.
        """
        if self.segment is None:
            raise RuntimeError("SharedStaging is closed")
        gone = {segment_path(p) for p in gone}
        segments = [self.segment] + [s for s in self._sender_segments() if s.path not in gone]
        where: dict[str, tuple[str, int]] = {}
        with torch.no_grad():
            for spec in self.layout.specs:
                t = self.staged[spec.name]
                found = _locate(t, segments)
                if found is None:
                    self._slots[spec.name].copy_(t)
                    self._point(spec.name)
                    found = (self.segment.path, spec.offset)
                where[spec.name] = found
        out: list[Entry] = []
        for name, t in self.staged.items():
            path, offset = where[self.layout.aliases.get(name, name)]
            out.append((name, path, offset, str(t.dtype).removeprefix("torch."), list(t.shape)))
        return out

    def close(self) -> None:
        """Remove the own segment's name (the mapping lives while tensors view it)."""
        if self.segment is not None:
            self.segment.unlink()
            self.segment = None


def _locate(t: torch.Tensor, segments: list[Segment]) -> tuple[str, int] | None:
    """``(segment path, byte offset)`` of contiguous ``t`` inside one of ``segments``."""
    if not t.is_contiguous() or t.device.type != "cpu":
        return None
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    for seg in segments:
        base = seg.tensor.data_ptr()
        if base <= start and end <= base + seg.size:
            return seg.path, start - base
    return None


__all__ = ["AsyncEngine", "SharedStaging", "pin_process_tree"]
