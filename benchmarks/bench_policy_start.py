"""The start of a policy group: a later launch reuses the class's initializer.

A ``Policy`` names its worker class by path, so an initializer actor imports the class
(torch, transformers) and creates the workers. Groups of one class and runtime environment
launched one after another (a relaunched policy, a resumed run) share that initializer;
this script times a two-rank ``Policy`` of the tiny model started with the shared one
against one started with a fresh initializer (a new ``PHALANX_*`` variable makes the
environment, hence the initializer, new), launches alternated, and prints the ratio of the
medians.

    python benchmarks/bench_policy_start.py [--repeats 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from _common import report

import phalanx as px
from phalanx.algorithms.grpo_tiny_task import build_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed launches of each kind")
    ap.add_argument("--workers", type=int, default=2, help="policy ranks")
    args = ap.parse_args()
    if args.repeats < 1 or args.workers < 1:
        ap.error("--repeats and --workers must be >= 1")

    from transformers import AutoTokenizer

    from phalanx.llm.policy import Policy

    path = build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="bench_start_"), "model"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = {
        "model_name": path,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 64,
    }
    cluster = px.Cluster(num_cpus=8)

    def launch(kind: str, i: int) -> float:
        if kind == "fresh":  # a new environment: a new initializer that imports the class
            os.environ["PHALANX_BENCH_START"] = f"{kind}{i}"
        t0 = time.perf_counter()
        policy = Policy(cluster, cfg, tokenizer, num_workers=args.workers, name_prefix="start")
        took = time.perf_counter() - t0
        policy.shutdown()
        return took

    os.environ["PHALANX_BENCH_START"] = "shared"
    launch("shared", -1)  # warm-up: the shared initializer's import, Ray's first workers
    times: dict[str, list[float]] = {"shared": [], "fresh": []}
    for i in range(args.repeats):
        for kind in ("fresh", "shared"):
            if kind == "shared":
                os.environ["PHALANX_BENCH_START"] = "shared"
            times[kind].append(launch(kind, i))
    shared, fresh = statistics.median(times["shared"]), statistics.median(times["fresh"])
    report("policy start, shared initializer / fresh initializer", shared, fresh)
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": "policy_start",
                "workers": args.workers,
                "shared_s": [round(t, 2) for t in times["shared"]],
                "fresh_s": [round(t, 2) for t in times["fresh"]],
                "ratio": round(shared / fresh, 3),
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
