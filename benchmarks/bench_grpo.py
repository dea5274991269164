"""GRPO step-time breakdown and refit cost against model size.

Part 1 runs a short GRPO job on the tiny model and prints the time per phase
(generation, log-probs, training, refit), generated tokens/s, and refit's share of the
step (RATIO: goal < 5%). Part 2 builds Llama models of growing size, refits a generation
worker from a 2-rank FSDP2 policy through the shared-memory IPC path (each policy rank
writes its own rows into the next buffer of the refit sender's ring; the read-only
generator's parameters become views of it, route ``shm_view``, printed), and prints
refit time as a ratio to the weight-sync floor (one in-process ``copy_`` of the same
bytes) and against NeMo-RL's gather-then-pack refit (the generator copies),
timed interleaved in the same run.

    python benchmarks/bench_grpo.py [--sizes 10,50,200] [--steps 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def _grpo_breakdown(steps: int, cluster) -> None:
    from phalanx.algorithms.grpo import GRPOConfig, train

    with tempfile.TemporaryDirectory() as d:
        cfg = GRPOConfig.tiny(
            run_dir=d, steps=steps, warmup_steps=5, checkpoint_every=10**6, progress=False
        )
        hist = train(cfg, cluster)["history"][1:]  # drop the first (warm-up) step
    phases = ("generation", "logprobs", "training", "refit")
    step = statistics.median(h["time/step"] for h in hist)
    print(f"GRPO step (tiny model, {len(hist)} steps, medians):")
    for p in phases:
        t = statistics.median(h[f"time/{p}"] for h in hist)
        print(f"  {p:<11} {t * 1000:8.1f} ms  ({t / step:5.1%} of step)")
    print(f"  step        {step * 1000:8.1f} ms")
    print(
        f"  generated tokens/s: {statistics.median(h['throughput/tokens_per_s'] for h in hist):.0f}"
    )
    share = statistics.median(h["time/refit"] / h["time/step"] for h in hist)
    print(f"RATIO refit share of the GRPO step: {share:.1%} (goal < 5%)")


def _build(path: str, hidden: int, layers: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.algorithms.grpo_tiny_task import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 64, 1),
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _seed_path_refit(policy, gen, t: float = 300.0) -> None:
    """NeMo-RL's refit: gather the full weights on every rank, pack on rank 0."""
    pg = policy.worker_group
    infos = pg.call("prepare_weights_for_ipc").wait(timeout=t)
    handles = pg.execute_on(0).get_weights_ipc_handles([k for k, _ in infos[0][0]]).wait(t)[0]
    gen.call("update_weights_from_ipc_handles", handles).wait(timeout=t)


def _copy_floor(nbytes: int) -> Callable[[], float]:
    """One in-process ``copy_`` of ``nbytes`` (both buffers touched first); returns seconds."""
    src = torch.randn(nbytes // 4)
    dst = torch.zeros_like(src)

    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    return once


def _refit_vs_size(sizes_m: list[int], cluster, repeats: int, gather_max_m: int) -> None:
    import phalanx as px
    from phalanx.llm.generation import HFGenerationWorker
    from phalanx.llm.policy import Policy
    from phalanx.llm.refit import Refitter

    print("\nrefit (ipc over shared memory, 2 policy ranks -> 1 generator) vs copy_ floor:")
    for size in sizes_m:
        hidden = 512 if size <= 100 else 1024
        layers = max(1, math.ceil(size * 1e6 / (16 * hidden * hidden)))
        with tempfile.TemporaryDirectory() as d:
            n = _build(d, hidden, layers)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(d)
            cfg = {"model_name": d, "train_global_batch_size": 2, "train_micro_batch_size": 1}
            policy = Policy(
                cluster,
                cfg,
                tok,
                num_workers=2,
                name_prefix="bench_pol",
                init_optimizer=False,
                init_reference_model=False,
            )
            gen = HFGenerationWorker.create_group({"model_name": d}, tok).launch(
                cluster, px.NodePlacement(num_workers=1), name="bench_gen"
            )
            try:
                refitter = Refitter(policy, gen, "ipc")
                refitter.refit()  # the first refits create and map the ring's buffers
                routes = sorted(set(refitter.refit().routes.values()))
                # The gather-and-pack path holds the full model on every policy rank: on a
                # 24 GB machine it does not fit beside the rest from about 500M parameters.
                gather = size <= gather_max_m
                if gather:
                    _seed_path_refit(policy, gen)
                copy_once = _copy_floor(n * 4)
                copy_once()
                fused, seed, floors = [], [], []
                for _ in range(repeats):  # interleaved, so noise hits all three alike
                    t0 = time.perf_counter()
                    refitter.refit()
                    fused.append(time.perf_counter() - t0)
                    if gather:
                        t0 = time.perf_counter()
                        _seed_path_refit(policy, gen)
                        seed.append(time.perf_counter() - t0)
                    floors.append(copy_once())
                del copy_once
            finally:
                gen.shutdown()
                policy.shutdown()
        r, floor = statistics.median(fused), statistics.median(floors)
        s = statistics.median(seed) if seed else float("nan")
        print(
            f"  {n / 1e6:7.1f} M params ({n * 4 / 2**20:7.1f} MiB): refit {r * 1000:8.1f} ms, "
            f"gather-and-pack {s * 1000:8.1f} ms, copy floor {floor * 1000:7.2f} ms "
            f"(generator route {'/'.join(routes)})"
        )
        print(f"RATIO refit vs copy floor, {n / 1e6:.0f}M params: {r / floor:.2f}x")
        if seed:
            print(f"RATIO refit speedup vs gather-and-pack, {n / 1e6:.0f}M params: {s / r:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sizes", default="10,50,200", help="model sizes in millions (e.g. 10,100,500)"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--gather-max",
        type=int,
        default=300,
        help="largest size (millions) that also times the gather-and-pack baseline",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed refits per size")
    args = parser.parse_args()
    import phalanx as px

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cluster = px.Cluster()
    _grpo_breakdown(args.steps, cluster)
    _refit_vs_size(
        [int(s) for s in args.sizes.split(",") if s], cluster, args.repeats, args.gather_max
    )


if __name__ == "__main__":
    main()
