"""Worker classes used by the tests (importable by dotted path from worker processes)."""

from __future__ import annotations

import os
import time

import phalanx as px


class Recorder(px.Worker):
    """Records every call it receives, so tests can assert who was called with what."""

    def __init__(self, tag: str = "rec"):
        super().__init__()
        self.tag = tag
        self.calls: list[tuple[str, tuple, dict]] = []

    def record(self, *args, **kwargs):
        self.calls.append(("record", args, kwargs))
        return {"rank": self.rank, "args": args, "kwargs": kwargs}

    def get_calls(self):
        return list(self.calls)

    def env(self, *keys):
        return {k: os.environ.get(k) for k in keys}

    def info(self):
        i = self.worker_info
        return {
            "rank": i.rank,
            "node_id": i.node_id,
            "gpu_id": i.gpu_id,
            "available_gpus": i.available_gpus,
            "address": i.address.get_name(),
            "local_rank": i.local_rank,
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def noop(self):
        return None

    def sleep(self, s: float):
        time.sleep(s)
        return self.rank

    def fail(self, msg: str = "boom"):
        raise ValueError(f"{msg} from rank {self.rank}")

    def stream(self, n: int):
        for i in range(n):
            yield (self.rank, i)

    def cleanup(self):
        return True


class PlainWorker:
    """Not a px.Worker subclass: NeMo-RL style classes work too."""

    def __init__(self, cfg=None):
        self.cfg = cfg

    def get_cfg(self):
        return self.cfg

    def rank_env(self):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Configured(px.Worker):
    """Asks for env vars and init kwargs through configure_worker."""

    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None, num_gpus_per_node=None):
        return (
            {"num_gpus": num_gpus},
            {"PX_TEST_LAYER": "configure", "PX_TEST_CONF_ONLY": "c"},
            {"extra": 7},
        )

    def __init__(self, extra: int = 0):
        super().__init__()
        self.extra = extra

    def get(self):
        return self.extra, os.environ.get("PX_TEST_LAYER"), os.environ.get("PX_TEST_CONF_ONLY")
