"""A worker's torch thread count reaches the threads its calls run on (worker/host.py)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

import phalanx as px


def _omp_threads() -> int:
    """OpenMP's thread count for the calling thread, read without going through torch
    (torch's own getter would set it first)."""
    return ctypes.CDLL("libgomp.so.1").omp_get_max_threads()


THREADS = 3  # no machine's default: neither 1 (Ray's OMP_NUM_THREADS) nor a usual core count


class SetsThreads(px.Worker):
    def __init__(self):
        super().__init__()
        import torch

        torch.set_num_threads(THREADS)

    def threads(self) -> tuple[int, int]:
        here = _omp_threads()
        out: list[int] = []
        fresh = threading.Thread(target=lambda: out.append(_omp_threads()))
        fresh.start()
        fresh.join()
        return here, out[0]

    def threads_stream(self):
        yield _omp_threads()


@pytest.mark.timeout(120)
def test_calls_run_with_the_thread_count_the_worker_set(cluster):
    if os.cpu_count() == THREADS:
        pytest.skip(f"{THREADS} cores: the default count cannot be told from the worker's")
    g = SetsThreads.create_group().launch(cluster, px.NodePlacement(num_workers=2), "threads")
    try:
        # Each call's thread has the count the worker set in __init__ (on another thread);
        # a thread the host never ran a call on keeps OpenMP's default, as calls did before.
        out = g.threads().wait(timeout=60)
        assert [here for here, _ in out] == [THREADS, THREADS]
        assert all(fresh != THREADS for _, fresh in out), out
        assert [list(s) for s in g.execute_on(0).threads_stream().wait(timeout=60)] == [[THREADS]]
    finally:
        g.shutdown()
