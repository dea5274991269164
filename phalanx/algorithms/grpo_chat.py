"""Prompts through the tokenizer's chat template.

An instruct model expects its own conversation format (SmolLM2: ``<|im_start|>user\\n...``);
``build_prompt_ids`` renders a question as one user turn, with an optional system turn,
and the assistant header that asks the model to answer. A tokenizer without a chat
template (the tiny character-level one) gets the question as plain text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_messages(question: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """``[system?, user]`` messages; ``system_prompt=None`` keeps the template's own default."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": question})
    return messages


def build_prompt_ids(tokenizer: Any, question: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of ``question`` ready for generation (chat template when there is one)."""
    if not isinstance(question, str):
        raise TypeError(f"prompt must be a str, got {type(question).__name__}")
    if not has_chat_template(tokenizer):
        if system_prompt:
            raise ValueError(
                "system_prompt: this tokenizer has no chat template, so a system prompt "
                "cannot be placed; leave it unset"
            )
        return list(tokenizer(question)["input_ids"])
    ids = tokenizer.apply_chat_template(
        build_messages(question, system_prompt),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return an encoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_chat_prompts(
    tokenizer: Any, questions: Sequence[str], system_prompt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt ids [B, P] and lengths [B] of ``questions``."""
    if not questions:
        raise ValueError("encode_chat_prompts: no prompts")
    enc = [build_prompt_ids(tokenizer, q, system_prompt) for q in questions]
    lengths = torch.tensor([len(e) for e in enc], dtype=torch.long)
    ids = torch.full((len(enc), int(lengths.max())), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e, dtype=torch.long)
    return ids, lengths
