"""Generation workers: sample responses from the policy's model, refitted with its weights.

``GenerationInterface`` is what the GRPO loop needs from a generation backend; the
Hugging Face ``generate`` backend (``HFGenerationWorker``) implements it on CPU or GPU, and
a vLLM backend can implement the same methods later.

Input of ``generate``: a ``BatchedDataDict`` with right-padded prompt ``input_ids`` [B, P]
and ``input_lengths`` [B]. Output (right-padded to P + max_new_tokens):

    output_ids                 prompt followed by the generated tokens
    logprobs                   log-prob of each generated token under the unprocessed
                               logits (0 on prompt and padding positions)
    generation_lengths         generated tokens per row, the stop token included
    unpadded_sequence_lengths  prompt length + generation length
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import torch

from phalanx.data import BatchedDataDict
from phalanx.worker.worker import Worker


class GenerationInterface(ABC):
    """What a generation backend offers the training loop (NeMo-RL's ``GenerationInterface``)."""

    @abstractmethod
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Sample (or greedily decode) one response per row of ``data``."""

    @abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the backend up (weights and caches onto the device)."""

    @abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release what generation holds (e.g. KV caches) until the next round."""

    @abstractmethod
    def update_weights(self, state_dict: dict[str, Any]) -> bool:
        """Load a full state dict (names as in the policy's Hugging Face model)."""


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


class HFGenerationWorker(Worker, GenerationInterface):
    """One generation rank running Hugging Face ``generate`` on a full copy of the model.

    Config: ``model_name``, ``temperature`` (1.0), ``top_p`` (1.0), ``max_new_tokens`` (16),
    ``stop_token_ids`` (default: the tokenizer's eos), ``seed``, ``precision``.
    Its model is ``self.model``, so phalanx's weight senders refit it directly.
    """

    def __init__(self, config: dict[str, Any], tokenizer: Any) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.cfg = _check_generation_config(config)
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("tokenizer has no pad token (pad_token_id is None)")
        self.tokenizer = tokenizer
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.cfg.get("precision", "float32")
        ]
        self.model = AutoModelForCausalLM.from_pretrained(self.cfg["model_name"], dtype=dtype).to(
            self.device
        )
        self.model.eval()
        self.stop_token_ids = list(self.cfg.get("stop_token_ids") or [tokenizer.eos_token_id])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._gen = torch.Generator(device="cpu").manual_seed(
            int(self.cfg.get("seed", 0)) * 1009 + self.rank
        )
        self.weights_updates = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}[rank={self.rank}]"

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        if "input_ids" not in data or "input_lengths" not in data:
            raise ValueError("generate: data needs 'input_ids' and 'input_lengths'")
        ids, lengths = data["input_ids"], data["input_lengths"].long()
        B, P = ids.shape
        max_new = int(self.cfg.get("max_new_tokens", 16))
        if P + max_new > self.max_positions:
            raise ValueError(
                f"generate: prompt length {P} + max_new_tokens {max_new} exceeds the model's "
                f"max_position_embeddings {self.max_positions}"
            )
        pad = self.tokenizer.pad_token_id
        # HF batched generation wants left padding.
        left = torch.full((B, P), pad, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for i in range(B):
            n = int(lengths[i])
            left[i, P - n :] = ids[i, :n]
            attn[i, P - n :] = 1
        # Sampling draws from torch's global RNG; seed it from this worker's own stream
        # so that runs are reproducible.
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self._gen)))
        out = self.model.generate(
            input_ids=left.to(self.device),
            attention_mask=attn.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else float(self.cfg.get("temperature", 1.0)),
            top_p=None if greedy else float(self.cfg.get("top_p", 1.0)),
            top_k=None,
            max_new_tokens=max_new,
            eos_token_id=self.stop_token_ids,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new = out.sequences[:, P:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, new, V]
        new_lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        total = P + max_new
        output_ids = torch.full((B, total), pad, dtype=torch.long)
        logprobs = torch.zeros((B, total), dtype=torch.float32)
        gen_lengths = torch.zeros(B, dtype=torch.long)
        stops = torch.tensor(self.stop_token_ids)
        for i in range(B):
            n = int(lengths[i])
            row = new[i]
            hit = torch.isin(row, stops).nonzero()
            g = int(hit[0]) + 1 if len(hit) else row.shape[0]
            output_ids[i, :n] = ids[i, :n]
            output_ids[i, n : n + g] = row[:g]
            logprobs[i, n : n + g] = new_lp[i, :g]
            gen_lengths[i] = g
        return BatchedDataDict(
            output_ids=output_ids,
            logprobs=logprobs,
            generation_lengths=gen_lengths,
            unpadded_sequence_lengths=lengths + gen_lengths,
        )

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        self.model.to(self.device)
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    # ------------------------------------------------------------------ refit
    # Receiving halves of the policy worker's refit, on the weight-sync layer's blocks.
    # ``self.model`` is also what phalanx.weights.WeightSender refits (any transport).
    def _apply(self, layout: Any, tensors: dict[str, torch.Tensor]) -> bool:
        from phalanx.weights import apply_weights

        apply_weights(self, layout, tensors)
        self.weights_updates += 1
        return True

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, Any]) -> bool:
        """Load a full state dict (tensors or arrays, names as in the model) in place."""
        from phalanx.weights import gather, to_named_tensors

        named = to_named_tensors(state_dict)
        layout, sources = gather(named)
        return self._apply(layout, {s.name: t for s, t in zip(layout.specs, sources)})

    def update_weights_from_ipc_handles(self, handles: dict[str, Any]) -> bool:
        """Open the handles of ``DTensorPolicyWorker.get_weights_ipc_handles`` and copy in.

        ``handles`` maps a device id to a handle; this worker uses the one of its own
        device (a GPU's UUID, or the host on CPU).
        """
        from phalanx.weights import open_handle, open_views, views

        if not isinstance(handles, dict) or not handles:
            raise ValueError("update_weights_from_ipc_handles: handles must be a non-empty dict")
        own = self._device_id()
        handle = handles.get(own)
        if handle is None:
            raise ValueError(
                f"update_weights_from_ipc_handles: no handle for this worker's device {own!r} "
                f"(have {sorted(handles)}); IPC works on the same node/GPU only"
            )
        layout = handle["layout"]
        if handle["kind"] == "shm":
            cache = self.__dict__.setdefault("_shm_cache", {})
            return self._apply(layout, open_views(handle["name"], layout, cache))
        flat = open_handle(handle)
        ok = self._apply(layout, views(flat, layout))
        torch.cuda.synchronize()
        return ok

    def _device_id(self) -> str:
        import socket

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return f"cpu:{socket.gethostname()}"

    def init_collective(self, ip: str, port: int, world_size: int, rank_offset: int = 1) -> bool:
        """Join the refit group as rank ``rank_offset + self.rank`` (the policy is rank 0)."""
        import datetime

        import torch.distributed as dist

        from phalanx.weights import new_process_group

        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore(ip, port, world_size, False, timeout=timeout)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._refit_store = store
        self.model_update_group = new_process_group(
            store, "refit", rank_offset + self.rank, world_size, backend, 300.0
        )
        return True

    def update_weights_from_collective(self, info: dict[str, Any]) -> bool:
        """Receive ``DTensorPolicyWorker.broadcast_weights_for_collective`` and copy it in.

        ``info`` is what ``prepare_info_for_collective`` returned (layout, bucket size).
        """
        from phalanx.weights import receive_stream, views

        group = getattr(self, "model_update_group", None)
        if group is None:
            raise RuntimeError("update_weights_from_collective: call init_collective first")
        layout = info["layout"]
        flat = receive_stream(group, layout, info["bucket_bytes"], self.device)
        return self._apply(layout, views(flat, layout))

    def get_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights on CPU (tests compare them with the policy's)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def is_alive(self) -> bool:
        return True
