"""vLLM as the generation engine: NeMo-RL's ``VllmGenerationWorker``, one ``vllm.LLM`` per rank.

Configured by NeMo-RL's ``policy.generation`` keys (``phalanx.llm.vllm_config``); the config
is checked, and vLLM's presence too, by ``create_group`` before any worker starts.
``generate`` returns what ``HFGenerationWorker.generate`` returns (same keys, shapes and
padding; log-probs of the sampled tokens under the unprocessed logits by default).

Refit: the worker receives weights exactly as ``HFGenerationWorker`` does
(``GenerationWorker``'s refit methods, and the weight sender's transports), into a staging
copy of the Hugging Face model's tensors (``weights_module()``; on CPU on the sender's node
they become views of the sender's shared buffer, no copy). The engine loads the staged
version through the worker extension (``phalanx.llm.vllm_extension``,
``LLM.collective_rpc``): at once after a direct ``update_weights*`` call, and before the
next ``generate`` after a sender's refit. The sender applies a version only between
method calls, so one ``generate`` runs on one version, which it loads before its first
token.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Any

import torch

from phalanx.data import BatchedDataDict
from phalanx.llm.generation import GenerationWorker, assemble_output, check_prompts
from phalanx.llm.policy_config import PRECISIONS
from phalanx.llm.vllm_config import (
    INSTALL_HINT,
    check_vllm_generation_config,
    engine_kwargs,
    require_vllm,
)

EXTENSION = "phalanx.llm.vllm_extension.WeightsExtension"
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: vLLM's own default is larger


class VllmGenerationWorker(GenerationWorker):
    """One generation rank holding a ``vllm.LLM`` engine (tensor parallel inside it).

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
        # The engine inside this process (a Ray actor), not a spawned engine-core process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
        self.llm = vllm.LLM(**kwargs)
        self._sampling_params = vllm.SamplingParams
        self.stop_token_ids = list(self.cfg.get("stop_token_ids") or [tokenizer.eos_token_id])
        self.max_positions = int(self.llm.llm_engine.model_config.max_model_len)
        self.staged = self._load_staging(PRECISIONS[self.cfg["vllm_cfg"]["precision"]])
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
        named = list(self.staged.items())
        loaded = self.llm.collective_rpc("phalanx_load_weights", args=(named,))
        if any(n != len(named) for n in loaded):
            raise RuntimeError(f"{self!r}: engine workers loaded {loaded} tensors of {len(named)}")
        self._engine_key = key
        self.engine_loads += 1
        return True

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
        self._load_engine()
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids[i, : int(lengths[i])].tolist()} for i in range(len(ids))],
            self._params(max_new, greedy),
            use_tqdm=bool(self.cfg["vllm_cfg"].get("use_tqdm", False)),
        )
        pad = self.tokenizer.pad_token_id
        B = len(ids)
        new = torch.full((B, max_new), pad, dtype=torch.long)
        new_lp = torch.zeros((B, max_new), dtype=torch.float32)
        gen_lengths = torch.zeros(B, dtype=torch.long)
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            toks = list(sample.token_ids)
            new[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            new_lp[i, : len(toks)] = torch.tensor(
                [step[t].logprob for t, step in zip(toks, sample.logprobs)], dtype=torch.float32
            )
            gen_lengths[i] = len(toks)
        return assemble_output(ids, lengths, new, new_lp, gen_lengths, pad)

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
        )

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Restore the engine's memory after ``finish_generation`` (colocated GPU only)."""
        if self._sleeps and self.llm.llm_engine.is_sleeping():
            self.llm.wake_up()
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Free the KV cache until the next round (colocated GPU; vLLM's CPU backend has no
        sleep mode)."""
        if self._sleeps:
            self.llm.sleep(level=1)
        return True

    def shutdown(self) -> bool:
        """Stop the engine and free its memory (the KV cache, the model)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        return True

    def is_alive(self) -> bool:
        return True
