"""Generation workers: sample responses from the policy's model, refitted with its weights.

``GenerationInterface`` is what the GRPO loop needs from a generation backend; phalanx's
own decoding loop over a Hugging Face model (``HFGenerationWorker``) implements it on CPU or
GPU, and so does the vLLM engine (``phalanx.llm.vllm_generation.VllmGenerationWorker``).
Both are ``GenerationWorker``s, which receive refits through the ``RefitReceiver`` they hold.

Input of ``generate``: a ``BatchedDataDict`` with right-padded prompt ``input_ids`` [B, P]
and ``input_lengths`` [B]. Output (right-padded to P + max_new_tokens):

    output_ids                 prompt followed by the generated tokens
    logprobs                   log-prob of each generated token under the unprocessed
                               logits (0 on prompt and padding positions)
    generation_lengths         generated tokens per row, the stop token included
    unpadded_sequence_lengths  prompt length + generation length
"""

from __future__ import annotations

import inspect
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from phalanx._base.heap import reuse_freed_memory
from phalanx.data import BatchedDataDict
from phalanx.llm.refit_receiver import RefitReceiver
from phalanx.worker.worker import Worker


class GenerationInterface(ABC):
    """What a generation backend offers the training loop (NeMo-RL's ``GenerationInterface``)."""

    @abstractmethod
    def generate(
        self, data: BatchedDataDict, greedy: bool = False, weights_version: int | None = None
    ) -> BatchedDataDict:
        """Sample (or greedily decode) one response per row of ``data``.

        Args:
            data: the prompts, with ``input_ids`` and ``input_lengths``.
            greedy: decode greedily instead of sampling.
            weights_version: the weights version the batch must run on, or None for any.

        Returns:
            The prompts with their responses, as ``output_ids`` and their log-probs.

        Raises:
            RuntimeError: a rank holds another weights version (the error names it).
        """

    @abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the backend up (weights and caches onto the device).

        Args:
            *args, **kwargs: backend-specific.

        Returns:
            True when ready.
        """

    @abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release what generation holds (e.g. KV caches) until the next round.

        Args:
            *args, **kwargs: backend-specific.

        Returns:
            True when done.
        """

    @abstractmethod
    def update_weights(self, state_dict: dict[str, Any]) -> bool:
        """Load a full state dict (names as in the policy's Hugging Face model).

        Args:
            state_dict: the weights.

        Returns:
            True when loaded.
        """


def _check_generation_config(cfg: Any) -> dict[str, Any]:
    if not isinstance(cfg, dict):
        raise TypeError(f"config must be a dict, got {type(cfg).__name__}")
    path = cfg.get("model_name")
    if not path or not os.path.exists(os.path.join(str(path), "config.json")):
        raise ValueError(f"config['model_name']: model path {path!r} does not exist")
    temperature = float(cfg.get("temperature", 1.0))
    if temperature <= 0:
        raise ValueError(f"config['temperature'] must be > 0, got {temperature}")
    top_p = float(cfg.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise ValueError(f"config['top_p'] must be in (0, 1], got {top_p}")
    max_new = cfg.get("max_new_tokens", 16)
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"config['max_new_tokens'] must be a positive int, got {max_new!r}")
    return dict(cfg)


def check_prompts(
    data: BatchedDataDict, max_new: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ``input_ids`` [B, P] and ``input_lengths`` [B] (long), checked."""
    if "input_ids" not in data or "input_lengths" not in data:
        raise ValueError("generate: data needs 'input_ids' and 'input_lengths'")
    ids, lengths = data["input_ids"], data["input_lengths"].long()
    P = ids.shape[1]
    if P + max_new > max_positions:
        raise ValueError(
            f"generate: prompt length {P} + max_new_tokens {max_new} exceeds the model's "
            f"max_position_embeddings {max_positions}"
        )
    return ids, lengths


def assemble_output(
    ids: torch.Tensor,
    lengths: torch.Tensor,
    new: torch.Tensor,
    new_lp: torch.Tensor,
    gen_lengths: torch.Tensor,
    pad: int,
) -> BatchedDataDict:
    """``generate``'s output (see the module docstring) from the prompts and the new tokens
    [B, max_new], their log-probs and the generated lengths [B]."""
    B, P = ids.shape
    total = P + new.shape[1]
    output_ids = torch.full((B, total), pad, dtype=torch.long)
    logprobs = torch.zeros((B, total), dtype=torch.float32)
    for i in range(B):
        n, g = int(lengths[i]), int(gen_lengths[i])
        output_ids[i, :n] = ids[i, :n]
        output_ids[i, n : n + g] = new[i, :g]
        logprobs[i, n : n + g] = new_lp[i, :g]
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=gen_lengths,
        unpadded_sequence_lengths=lengths + gen_lengths,
    )


class GenerationWorker(Worker, GenerationInterface):
    """Base of the generation workers: the rank's device and the receiving half of refit.

    It holds a :class:`~phalanx.llm.refit_receiver.RefitReceiver`, which loads each version
    into the worker's weights module (``weights_module()``, or ``self.model``: also what
    ``phalanx.weights.WeightSender`` refits, any transport); the refit methods here call it.

    Attributes:
        device: the rank's device (its GPU when there is one, else the CPU).
        samplers: the random generators sampling draws from, by name; ``get_state`` keeps
            their states for a restarted rank.

    Args:
        on_applied: called after each version a refit method loaded, or None.
    """

    def __init__(self, on_applied: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self._refit = RefitReceiver(self, self.rank, self.device, on_applied)
        self.samplers: dict[str, torch.Generator] = {}

    @property
    def weights_updates(self) -> int:
        """Versions loaded by this worker's refit methods (a sender's refits not counted)."""
        return self._refit.updates

    @property
    def model_update_group(self) -> Any:
        """The collective refit's process group (None before ``init_collective``)."""
        return self._refit.model_update_group

    def update_weights(self, state_dict: dict[str, Any]) -> bool:
        """Load a full state dict (tensors or arrays, names as in the model) in place.

        Args:
            state_dict: the weights.

        Returns:
            True when loaded.

        Raises:
            WeightMismatchError: the names or shapes differ from the model's.
        """
        return self._refit.update_weights(state_dict)

    def update_weights_from_ipc_handles(self, handles: dict[str, Any]) -> bool:
        """Open the handles of ``DTensorPolicyWorker.get_weights_ipc_handles`` and copy in.

        ``handles`` maps a device id to a handle; this worker uses the one of its own
        device (a GPU's UUID, or the host on CPU). A handle's buffer is mapped once and
        kept for the next refit through the same buffer; a handle of a new buffer (the
        sender's layout changed) releases the old mapping. The copy into the weights is
        one multi-tensor copy, finished (the device synchronized) before this returns, so
        the sender may then rewrite its buffer.

        Args:
            handles: a dict from device id to handle.

        Returns:
            True when loaded.

        Raises:
            ValueError: ``handles`` is empty or has no handle for this worker's device.
        """
        return self._refit.update_weights_from_ipc_handles(handles)

    def init_collective(self, ip: str, port: int, world_size: int, rank_offset: int = 1) -> bool:
        """Join the refit group as rank ``rank_offset + self.rank`` (the policy is rank 0).

        Args:
            ip: the address of the refit group's store.
            port: its port.
            world_size: the refit group's size.
            rank_offset: the refit rank of this group's rank 0.

        Returns:
            True.
        """
        return self._refit.init_collective(ip, port, world_size, rank_offset)

    def update_weights_from_collective(self, info: dict[str, Any]) -> bool:
        """Receive ``DTensorPolicyWorker.broadcast_weights_for_collective`` and copy it in.

        ``info`` is what ``prepare_info_for_collective`` returned (layout, bucket size).

        Args:
            info: the layout and bucket size.

        Returns:
            True when loaded.

        Raises:
            RuntimeError: ``init_collective`` was not called.
        """
        return self._refit.update_weights_from_collective(info)

    def check_weights_version(self, expected: int | None) -> None:
        """Raise, naming this rank, when it holds another weights version than ``expected``.

        Args:
            expected: the sender's version the caller refitted to; None: no check.

        Raises:
            RuntimeError: this rank holds another version (the refit did not reach it).
        """
        if expected is not None and expected != self.weights_version:
            raise RuntimeError(
                f"generation rank {self.rank} holds weights version {self.weights_version}, "
                f"the batch asks for version {expected}: the refit did not reach it"
            )

    def get_state(self) -> dict[str, Any]:
        """What a restarted copy of this rank needs to sample as this one would have.

        A group under a restart policy keeps the result of each ``get_state`` call and
        gives it to the new process's ``set_state``, so a batch that a death interrupted
        is sampled again with the same random numbers. The weights are not part of it: a
        restarted rank is refitted. It holds the state of each generator in ``samplers``;
        a backend whose sampler cannot be restored (vLLM's engine) registers none, and a
        regenerated batch there is sampled anew.

        Returns:
            The state of each sampling generator, by name.
        """
        return {name: gen.get_state() for name, gen in self.samplers.items()}

    def set_state(self, state: dict[str, Any]) -> bool:
        """Sample from now on as the worker that returned ``state`` would have.

        Args:
            state: the dict ``get_state`` returned.

        Returns:
            True.

        Raises:
            ValueError: ``state`` is not a dict with the keys of ``get_state()``.
        """
        expected = sorted(self.samplers)
        if not isinstance(state, dict) or sorted(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state: expected the keys {expected} of get_state(), got {got}")
        for name, gen in self.samplers.items():
            gen.set_state(state[name])
        return True

    def get_state_dict(self) -> dict[str, torch.Tensor]:
        """The received weights on CPU (tests compare them with the policy's).

        Returns:
            A dict from parameter name to its tensor.
        """
        from phalanx.weights.targets import module_of, target_tensors

        return {k: v.detach().cpu().clone() for k, v in target_tensors(module_of(self)).items()}


class HFGenerationWorker(GenerationWorker):
    """One generation rank decoding with a Hugging Face causal LM.

    Config: ``model_name``, ``temperature`` (1.0), ``top_p`` (1.0), ``max_new_tokens`` (16),
    ``stop_token_ids`` (default: the tokenizer's eos), ``seed``, ``precision``,
    ``num_threads`` (default: every core of the machine).
    Its model is ``self.model``, so phalanx's weight senders refit it directly. It is a
    ``read_only_weights`` receiver: on CPU, on the sender's node, a refit makes its
    parameters views of the sender's shared buffer (switched between calls), so it keeps
    no copy of its own; on GPU or another node it copies.

    Args:
        config: the generation config, as above.
        tokenizer: the model's tokenizer.
    """

    read_only_weights = True  # inference only: same-node sends give it views, not copies
    DONE_CHECK_EVERY = 8  # decoding steps between looks (on a GPU) at which rows finished

    def __init__(self, config: dict[str, Any], tokenizer: Any) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.cfg = _check_generation_config(config)
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("tokenizer has no pad token (pad_token_id is None)")
        self.tokenizer = tokenizer
        if self.device.type == "cpu":  # each decoding step reallocates its KV cache's growth
            reuse_freed_memory()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.cfg.get("precision", "float32")
        ]
        self.model = AutoModelForCausalLM.from_pretrained(self.cfg["model_name"], dtype=dtype).to(
            self.device
        )
        self.model.eval()
        # transformers 5 takes and returns the KV cache as ``cache``; ``past_key_values``,
        # the name before it, is deprecated there
        forward_args = inspect.signature(self.model.forward).parameters
        self.cache_key = "cache" if "cache" in forward_args else "past_key_values"
        # Phases of an RL step do not overlap, so generation may use every core (a Ray actor
        # with one CPU otherwise gets a single torch thread).
        threads = self.cfg.get("num_threads") or os.cpu_count() or 1
        torch.set_num_threads(int(threads))
        self.stop_token_ids = list(self.cfg.get("stop_token_ids") or [tokenizer.eos_token_id])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._gen = torch.Generator(device=self.device).manual_seed(
            int(self.cfg.get("seed", 0)) * 1009 + self.rank
        )
        self.samplers["sampling_rng"] = self._gen

    def __repr__(self) -> str:
        return f"{type(self).__name__}[rank={self.rank}]"

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self, data: BatchedDataDict, greedy: bool = False, weights_version: int | None = None
    ) -> BatchedDataDict:
        """Sample (or greedily decode) one response per row.

        A hand-written decoding loop over the model's KV cache rather than HF
        ``generate``: identical prompts (a GRPO group's samples) are prefilled once and
        their cache rows copied, only the chosen tokens' log-probs are kept (no
        ``[B, new, V]`` logits), and rows that finished are dropped from the batch.

        Args:
            data: the prompts, with ``input_ids`` and ``input_lengths``.
            greedy: decode greedily instead of sampling.
            weights_version: the weights version the batch must run on, or None for any
                (see ``check_weights_version``).

        Returns:
            ``output_ids`` (prompt and response), ``logprobs``, ``generation_lengths`` and
            ``unpadded_sequence_lengths``.

        Raises:
            ValueError: ``data`` lacks ``input_ids`` or ``input_lengths``, or a prompt leaves
                no room for ``max_new_tokens``.
            RuntimeError: this rank holds another weights version than ``weights_version``.
        """
        max_new = int(self.cfg.get("max_new_tokens", 16))
        ids, lengths = check_prompts(data, max_new, self.max_positions)
        self.check_weights_version(weights_version)
        new, new_lp, gen_lengths = self._decode(ids, lengths, max_new, greedy)
        return assemble_output(ids, lengths, new, new_lp, gen_lengths, self.tokenizer.pad_token_id)

    def _decode(
        self, ids: torch.Tensor, lengths: torch.Tensor, max_new: int, greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New tokens [B, max_new], their log-probs, and generated lengths [B]."""
        B, P = ids.shape
        dev = self.device
        pad = self.tokenizer.pad_token_id
        # Rows with the same prompt share one prefill.
        keyed = ids.masked_fill(torch.arange(P)[None] >= lengths[:, None], -1)
        uniq, inverse = torch.unique(
            torch.cat([keyed, lengths[:, None]], 1), dim=0, return_inverse=True
        )
        u_len = uniq[:, -1]
        left = torch.full((len(uniq), P), pad, dtype=torch.long)
        attn = torch.zeros((len(uniq), P), dtype=torch.long)
        for j in range(len(uniq)):  # left padding: every row's last prompt token at P - 1
            n = int(u_len[j])
            left[j, P - n :] = uniq[j, :n]
            attn[j, P - n :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=left.to(dev),
            attention_mask=attn.to(dev),
            position_ids=pos.to(dev),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, self.cache_key)
        inv = inverse.to(dev)
        cache.batch_select_indices(inv)
        logits = out.logits[:, -1].float()[inv]
        attn = attn.to(dev)[inv]
        next_pos = lengths.to(dev).clone()

        # Kept on the device: the loop reads back to the host only every ``check`` steps.
        new = torch.full((B, max_new), pad, dtype=torch.long, device=dev)
        new_lp = torch.zeros((B, max_new), dtype=torch.float32, device=dev)
        gen_lengths = torch.zeros(B, dtype=torch.long, device=dev)
        stops = torch.tensor(self.stop_token_ids, device=dev)
        rows = torch.arange(B, device=dev)  # original row of each row in the batch
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        # A host read waits for the GPU's queue to drain; on a CPU it costs nothing.
        check = self.DONE_CHECK_EVERY if dev.type == "cuda" else 1
        for t in range(max_new):
            tok = self._choose(logits, greedy)
            lp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
            live = ~done
            new[rows, t] = torch.where(live, tok, pad)
            new_lp[rows, t] = torch.where(live, lp, 0.0)
            gen_lengths[rows] = torch.where(live, t + 1, gen_lengths[rows])
            done = done | torch.isin(tok, stops)
            if t == max_new - 1:
                break
            if (t + 1) % check == 0:
                finished = int(done.sum())
                if finished == len(done):
                    break
                if finished * 4 >= len(done):  # drop finished rows once a quarter are
                    keep = (~done).nonzero().squeeze(-1)
                    cache.batch_select_indices(keep)
                    rows, tok, attn = rows[keep], tok[keep], attn[keep]
                    next_pos, done = next_pos[keep], done[keep]
            tok = tok.masked_fill(done, pad)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{self.cache_key: cache},
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
        return new.cpu(), new_lp.cpu(), gen_lengths.cpu()

    def _choose(self, logits: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The next token per row: argmax, or a temperature / top-p sample."""
        if greedy:
            return logits.argmax(-1)
        scaled = logits / float(self.cfg.get("temperature", 1.0))
        top_p = float(self.cfg.get("top_p", 1.0))
        if top_p < 1.0:
            sorted_l, order = scaled.sort(-1, descending=True)
            cum = sorted_l.softmax(-1).cumsum(-1)
            drop = cum - sorted_l.softmax(-1) > top_p  # keep the smallest prefix reaching p
            sorted_l = sorted_l.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_l)
        probs = scaled.softmax(-1)
        return torch.multinomial(probs, 1, generator=self._gen).squeeze(-1)

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Move the model onto the worker's device.

        Args:
            *args, **kwargs: accepted for NeMo-RL's signature.

        Returns:
            True.
        """
        self.model.to(self.device)
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Free the device's cache.

        Args:
            *args, **kwargs: accepted for NeMo-RL's signature.

        Returns:
            True.
        """
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    def is_alive(self) -> bool:
        """True: the worker answers.

        Returns:
            True.
        """
        return True
