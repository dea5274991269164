"""A tiny causal LM and a verifiable task that train offline on a couple of CPU cores.

The model is a 2-layer Llama built from a config; the tokenizer is character level,
built with the ``tokenizers`` library and wrapped as a ``PreTrainedTokenizerFast``.
Both are written with ``save_pretrained`` so that every worker loads them through the
ordinary ``from_pretrained`` path, as it would a downloaded checkpoint.

The task is single-digit addition: the prompt ``"7+5="`` has the answer ``"12"``
followed by the end-of-sequence token. The reward is 1 for the exact answer, else 0.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
CHARS = list("0123456789+-*=:,; abcdefghijklmnopqrstuvwxyz")


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with pad, bos and eos tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
    )


@dataclass
class TinyModelConfig:
    """Size of the tiny Llama; the defaults give ~0.2 M parameters."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    seed: int = 0


def build_tiny_model(path: str | os.PathLike, cfg: TinyModelConfig | None = None) -> str:
    """Create a random tiny Llama plus tokenizer and ``save_pretrained`` both to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = cfg or TinyModelConfig()
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- the task


class AdditionTask:
    """Single-digit addition with a verifiable answer: ``"a+b="`` -> ``str(a + b)``."""

    def __init__(self, seed: int = 0, max_digit: int = 9):
        self.rng = random.Random(seed)
        self.max_digit = max_digit

    def sample_prompts(self, n: int) -> list[tuple[str, str]]:
        """``n`` (prompt, answer) pairs."""
        out = []
        for _ in range(n):
            a, b = self.rng.randint(0, self.max_digit), self.rng.randint(0, self.max_digit)
            out.append((f"{a}+{b}=", str(a + b)))
        return out


def encode_prompts(tokenizer, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt token ids [B, T] and their lengths [B]."""
    enc = [tokenizer(p)["input_ids"] for p in prompts]
    lengths = torch.tensor([len(e) for e in enc], dtype=torch.long)
    ids = torch.full((len(enc), int(lengths.max())), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
    return ids, lengths


def sft_batch(tokenizer, pairs: Sequence[tuple[str, str]]):
    """A supervised batch: prompt + answer + eos, loss on the answer and eos only."""
    from phalanx.data import BatchedDataDict

    seqs, masks = [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    T = int(lengths.max())
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=mask,
        sample_mask=torch.ones(len(seqs), dtype=torch.float32),
    )
