"""vLLM as the generation engine: NeMo-RL's ``VllmGenerationWorker``, one engine per rank.

Configured by NeMo-RL's ``policy.generation`` keys (``phalanx.llm.vllm_config``); the config
is checked, and vLLM's presence too, by ``create_group`` before any worker starts.
``generate`` returns what ``HFGenerationWorker.generate`` returns (same keys, shapes and
padding; log-probs of the sampled tokens under the unprocessed logits by default).

The engine is ``vllm.LLM`` inside the worker's process, or with ``vllm_cfg.async_engine``
vLLM's asynchronous engine, whose engine core runs in a process of its own
(``phalanx.llm.vllm_async``): a batch's requests are submitted at once and batched
continuously, and ``generate_async`` (NeMo-RL's) yields each row as it finishes. That
engine core runs on the worker's cores: a worker pinned after its engine started (the
disaggregated placement pins its workers once they are up) moves the engine core, its
threads and the event loop's thread onto its cores at its next ``generate``.

Refit: the worker receives weights exactly as ``HFGenerationWorker`` does
(``GenerationWorker``'s refit methods, and the weight sender's transports), into a staging
copy of the Hugging Face model's tensors (``weights_module()``; on CPU on the sender's node
they become views of the sender's shared buffer, no copy). The engine loads the staged
version through the worker extension (``phalanx.llm.vllm_extension``,
``collective_rpc``): at once after a direct ``update_weights*`` call, and before the
next ``generate`` after a sender's refit. The sender applies a version only between
method calls, so one ``generate`` runs on one version, which it loads before its first
token. The in-process engine loads the staged tensors themselves; the asynchronous
engine's core process maps the shared-memory segments they live in (``SharedStaging``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from importlib.util import find_spec
from typing import Any

import torch

from phalanx.data import BatchedDataDict
from phalanx.llm.generation import GenerationWorker, assemble_output, check_prompts
from phalanx.llm.policy_config import PRECISIONS
from phalanx.llm.vllm_async import AsyncEngine, SharedStaging, pin_process_tree
from phalanx.llm.vllm_config import (
    INSTALL_HINT,
    check_vllm_generation_config,
    engine_kwargs,
    require_vllm,
)

EXTENSION = "phalanx.llm.vllm_extension.WeightsExtension"
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: vLLM's own default is larger


class VllmGenerationWorker(GenerationWorker):
    """One generation rank holding a vLLM engine (tensor parallel inside it): ``vllm.LLM``,
    or ``AsyncLLM`` with ``vllm_cfg.async_engine``.

    ``tokenizer`` gives the pad token and the default stop token (its eos).
    """

    read_only_weights = True  # inference only: the staged weights may view shared buffers

    @classmethod
    def create_group(cls, config: dict[str, Any], tokenizer: Any, **kwargs: Any) -> Any:
        """An unlaunched group; the config and vLLM's presence are checked first."""
        check_vllm_generation_config(config)
        if find_spec("vllm") is None:
            raise ImportError(INSTALL_HINT)
        return super().create_group(config, tokenizer, **kwargs)

    def __init__(self, config: dict[str, Any], tokenizer: Any) -> None:
        super().__init__(on_applied=self._load_engine)  # a direct load reaches the engine at once
        self.cfg = check_vllm_generation_config(config)
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("tokenizer has no pad token (pad_token_id is None)")
        self.tokenizer = tokenizer
        self.async_engine = bool(self.cfg["vllm_cfg"]["async_engine"])
        if self.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
            # vLLM drops torch to one thread unless OMP_NUM_THREADS is set.
            if self.cfg.get("num_threads"):
                os.environ["OMP_NUM_THREADS"] = str(self.cfg["num_threads"])
            os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        vllm = require_vllm()
        self._sleeps = self.device.type == "cuda" and self.cfg.get("colocated", {}).get(
            "enabled", True
        )
        seed = int(self.cfg.get("seed", 0)) * 1009 + self.rank
        kwargs = engine_kwargs(self.cfg, seed, EXTENSION)
        if self._sleeps:  # colocated on a GPU: free the KV cache between rounds
            kwargs["enable_sleep_mode"] = True
        self.staged = self._load_staging(PRECISIONS[self.cfg["vllm_cfg"]["precision"]])
        self.shared: SharedStaging | None = None
        # The synchronous engine runs inside this process (a Ray actor); the asynchronous
        # one in one engine-core process, its model worker included (without this, vLLM
        # would start the worker in a third process on CPU).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if self.async_engine:
            # The engine core is spawned (as vLLM does in a Ray actor anyway; a fork of a
            # process running torch's thread pools may hang); weights reach it through
            # shared memory.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            import vllm.envs

            vllm.envs.disable_envs_cache()  # an engine that ran here froze them: read again
            kwargs.setdefault("disable_log_stats", True)
            self.shared = SharedStaging(self, self.staged)
            self.llm: Any = AsyncEngine(kwargs)
            self.max_positions = self.llm.max_model_len
            # the engine-core processes, set to end with this one
            self.engine_pids = self.llm.collective_rpc("phalanx_exit_with_parent")
            self.engine_cpus = os.sched_getaffinity(0)  # what the engine core inherited
        else:
            self.llm = vllm.LLM(**kwargs)
            self.max_positions = int(self.llm.llm_engine.model_config.max_model_len)
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        self._sampling_params = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.stop_token_ids = list(self.cfg.get("stop_token_ids") or [tokenizer.eos_token_id])
        self.engine_loads = 0  # versions loaded into the engine
        self._engine_key = self._weights_key()

    def __repr__(self) -> str:
        return f"{type(self).__name__}[rank={self.rank}]"

    def _load_staging(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The Hugging Face model's tensors by state-dict name (tied names share one)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.cfg["model_name"], dtype=dtype)
        return {k: v.detach() for k, v in model.state_dict().items()}

    def weights_module(self) -> dict[str, torch.Tensor]:
        """What refits load into: the staged Hugging Face tensors."""
        return self.staged

    # ------------------------------------------------------------------ weights
    def _weights_key(self) -> tuple[int, int]:
        """Identifies the staged weights: the sender's version and direct loads."""
        return (self.weights_version, self.weights_updates)

    @torch.no_grad()
    def _load_engine(self) -> bool:
        """Load the staged weights into the engine unless it holds them; True if it loaded."""
        key = self._weights_key()
        if key == self._engine_key:
            return False
        self.prepare_for_generation()  # a sleeping engine holds no weights to load into
        if self.shared is not None:
            self._load_shared(self.shared)
        else:
            named = list(self.staged.items())
            loaded = self.llm.collective_rpc("phalanx_load_weights", args=(named,))
            if any(n != len(named) for n in loaded):
                raise RuntimeError(
                    f"{self!r}: engine workers loaded {loaded} tensors of {len(named)}"
                )
        self._engine_key = key
        self.engine_loads += 1
        return True

    def _load_shared(self, shared: SharedStaging) -> None:
        """Load the staged weights into the engine-core process by shared-memory reference;
        a sender's buffer whose name went away before the engine mapped it is replaced by
        the worker's own copy (once)."""
        gone: list[str] = []
        for _ in range(2):
            entries = shared.entries(gone)
            answers = self.llm.collective_rpc(
                "phalanx_load_shared", args=(entries, shared.mapped_paths)
            )
            gone = sorted({p for a in answers for p in a["missing"]})
            if not gone:
                break
        if gone or any(a["loaded"] != len(entries) for a in answers):
            raise RuntimeError(
                f"{self!r}: engine workers loaded {[a['loaded'] for a in answers]} tensors of "
                f"{len(entries)} (segments not found: {gone})"
            )

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self, data: BatchedDataDict, greedy: bool = False, weights_version: int | None = None
    ) -> BatchedDataDict:
        """Sample (or greedily decode) one response per row, all on one weights version.

        ``weights_version``: the version the caller refitted to; a rank holding another
        raises, naming itself (the refit did not reach it).
        """
        max_new = int(self.cfg.get("max_new_tokens", 16))
        ids, lengths = check_prompts(data, max_new, self.max_positions)
        self.check_weights_version(weights_version)
        self._engine_follows_cores()
        self._load_engine()
        prompts = self._prompts(ids, lengths)
        params = self._params(max_new, greedy)
        if self.async_engine:
            outputs = self.llm.generate(prompts, params)
        else:
            outputs = self.llm.generate(
                prompts, params, use_tqdm=bool(self.cfg["vllm_cfg"].get("use_tqdm", False))
            )
        pad = self.tokenizer.pad_token_id
        B = len(ids)
        new = torch.full((B, max_new), pad, dtype=torch.long)
        new_lp = torch.zeros((B, max_new), dtype=torch.float32)
        gen_lengths = torch.zeros(B, dtype=torch.long)
        for i, out in enumerate(outputs):
            toks, lps = _tokens_and_logprobs(out)
            new[i, : len(toks)] = toks
            new_lp[i, : len(toks)] = lps
            gen_lengths[i] = len(toks)
        return assemble_output(ids, lengths, new, new_lp, gen_lengths, pad)

    async def generate_async(
        self, data: BatchedDataDict, greedy: bool = False, weights_version: int | None = None
    ) -> AsyncIterator[tuple[int, BatchedDataDict]]:
        """NeMo-RL's ``generate_async``: each row's result as soon as it finishes.

        Yields ``(row index, result)``, the result being ``generate``'s output for that row
        alone, unpadded (``output_ids`` and ``logprobs`` [1, prompt + generated]). All rows
        run on one weights version, loaded before the first token; a caller that stops
        iterating aborts the rows not finished. Needs ``vllm_cfg.async_engine``.
        """
        if not self.async_engine:
            raise RuntimeError(
                "generate_async needs generation.vllm_cfg.async_engine=true (this worker "
                "runs the synchronous engine; use generate)"
            )
        max_new = int(self.cfg.get("max_new_tokens", 16))
        ids, lengths = check_prompts(data, max_new, self.max_positions)
        self.check_weights_version(weights_version)
        self._engine_follows_cores()
        self._load_engine()
        pad = self.tokenizer.pad_token_id
        params = self._params(max_new, greedy)
        async for i, out in self.llm.stream(self._prompts(ids, lengths), params):
            toks, lps = _tokens_and_logprobs(out)
            n, g = int(lengths[i]), len(toks)
            yield (
                i,
                assemble_output(
                    ids[i : i + 1, :n],
                    lengths[i : i + 1],
                    toks[None],
                    lps[None],
                    torch.tensor([g], dtype=torch.long),
                    pad,
                ),
            )

    def _engine_follows_cores(self) -> None:
        """Pin the asynchronous engine (its engine-core processes and its event loop's
        thread) to the cores of the calling thread when they changed since it started."""
        if not self.async_engine:
            return
        cpus = os.sched_getaffinity(0)
        if cpus == self.engine_cpus:
            return
        os.sched_setaffinity(self.llm.thread_id, cpus)
        for pid in self.engine_pids:
            pin_process_tree(pid, cpus)
        self.engine_cpus = cpus

    def max_running_requests(self) -> int:
        """The most requests the asynchronous engine's scheduler ran at once during the
        last ``generate`` (1 would mean its rows ran one after another)."""
        if not self.async_engine:
            raise RuntimeError(
                "max_running_requests needs generation.vllm_cfg.async_engine=true (the "
                "synchronous engine does not report its scheduler's counts here)"
            )
        return int(self.llm.max_running)

    @staticmethod
    def _prompts(ids: torch.Tensor, lengths: torch.Tensor) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": ids[i, : int(lengths[i])].tolist()} for i in range(len(ids))]

    def _params(self, max_new: int, greedy: bool) -> Any:
        """vLLM sampling parameters: stop only on ``stop_token_ids``, the chosen token's
        log-prob returned, no detokenization."""
        top_k = self.cfg.get("top_k")
        return self._sampling_params(
            n=1,
            temperature=0.0 if greedy else float(self.cfg.get("temperature", 1.0)),
            top_p=1.0 if greedy else float(self.cfg.get("top_p", 1.0)),
            top_k=-1 if greedy or top_k is None else int(top_k),
            max_tokens=max_new,
            logprobs=0,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=True,
            detokenize=False,
            output_kind=self._final_only,
        )

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Restore the engine's memory after ``finish_generation`` (colocated GPU only)."""
        if self._sleeps:
            sleeping = (
                self.llm.is_sleeping() if self.async_engine else self.llm.llm_engine.is_sleeping()
            )
            if sleeping:
                self.llm.wake_up()
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Free the KV cache until the next round (colocated GPU; vLLM's CPU backend has no
        sleep mode)."""
        if self._sleeps:
            self.llm.sleep(level=1)
        return True

    def shutdown(self) -> bool:
        """Stop the engine (and its engine-core process) and free its memory."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            if self.async_engine:
                llm.shutdown()
            else:
                llm.llm_engine.engine_core.shutdown()
        if self.shared is not None:
            self.shared.close()
        return True

    def is_alive(self) -> bool:
        return True


def _tokens_and_logprobs(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated tokens of a ``RequestOutput`` and each one's log-prob."""
    sample = out.outputs[0]
    toks = list(sample.token_ids)
    lps = [step[t].logprob for t, step in zip(toks, sample.logprobs)]
    return torch.tensor(toks, dtype=torch.long), torch.tensor(lps, dtype=torch.float32)
