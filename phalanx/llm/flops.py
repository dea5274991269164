"""Model FLOPs of a training step: NeMo-RL's ``FLOPTracker`` (``Policy.flops_tracker``).

The count is that of the matrix products of a Llama-style decoder (Llama, Mistral,
Qwen2, Qwen3: grouped-query attention, a gated MLP), forward plus backward (3x the
forward), per sequence of ``s`` tokens:

    forward = 2 s (L (P_attn + P_mlp) + h V)  +  2 L s^2 a d      (causal attention: half
    P_attn = h a d + 2 h g d + a d h,  P_mlp = 3 h f              of QK^T and AV)

with ``h`` hidden size, ``L`` layers, ``a`` query heads, ``g`` key/value heads, ``d`` head
size, ``f`` MLP size, ``V`` vocabulary. For Llama this equals NeMo-RL's ``llama`` formula
term by term. Other architectures are not counted: ``from_config`` raises ``ValueError``
and ``Policy.flops_tracker`` is ``None``, as in NeMo-RL.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from phalanx._base.checks import check_int

COUNTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder that its FLOPs depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    def train_flops(self, seq_len: int) -> int:
        """Forward plus backward FLOPs of one sequence of ``seq_len`` tokens."""
        h, s = self.hidden, seq_len
        attn = 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        per_token = self.layers * (attn + 3 * h * self.ffn) + h * self.vocab
        forward = 2 * s * per_token + 2 * self.layers * s * s * self.heads * self.head_dim
        return 3 * forward


def decoder_shape(config: Any) -> DecoderShape:
    """The ``DecoderShape`` of a Hugging Face config; ``ValueError`` for an architecture
    this count does not cover."""
    model_type = getattr(config, "model_type", None)
    if model_type not in COUNTED_MODEL_TYPES:
        raise ValueError(
            f"FLOPs are counted for model types {COUNTED_MODEL_TYPES}, not {model_type!r}"
        )
    heads = config.num_attention_heads
    return DecoderShape(
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn=config.intermediate_size,
        vocab=config.vocab_size,
    )


class FLOPTracker:
    """Model FLOPs (and tokens) of the sequences trained since the last ``reset``."""

    def __init__(self, model_name: str, shape: DecoderShape) -> None:
        self.model_name = model_name
        self.shape = shape
        self.total_flops = 0
        self.total_tokens = 0

    @classmethod
    def from_config(cls, model_name: str, config: Any) -> FLOPTracker:
        """A tracker for the model with Hugging Face ``config``; ``ValueError`` if its
        architecture is not counted."""
        return cls(model_name, decoder_shape(config))

    def track(self, n_samples: int, padded_seq_len: int) -> None:
        """Count ``n_samples`` sequences of ``padded_seq_len`` tokens."""
        n = check_int(n_samples, "n_samples", minimum=0)
        s = check_int(padded_seq_len, "padded_seq_len", minimum=0)
        self.total_flops += n * self.shape.train_flops(s)
        self.total_tokens += n * s

    def track_batch(self, sequence_lengths: Iterable[int]) -> None:
        """Count one sequence per entry of ``sequence_lengths``."""
        for seq_len in sequence_lengths:
            self.track(1, seq_len)

    def reset(self) -> None:
        self.total_flops = 0
        self.total_tokens = 0
