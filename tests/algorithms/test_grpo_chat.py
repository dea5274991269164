"""Prompts through the tokenizer's chat template."""

from __future__ import annotations

import pytest
import torch

from phalanx.algorithms.grpo_chat import build_prompt_ids, encode_chat_prompts

# A small chat template: a tag per role, ";" closes a turn, "<a>" opens the answer.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<u>{% else %}<s2>{% endif %}"
    "{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    from phalanx.algorithms.grpo_tiny_task import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<u>", "<s2>", "<a>"]})
    tok.chat_template = TEMPLATE
    return tok


def test_chat_template_prompt(chat_tokenizer):
    tok = chat_tokenizer
    ids = build_prompt_ids(tok, "1+2=")
    assert tok.decode(ids) == "<u>1+2=;<a>"
    with_system = build_prompt_ids(tok, "1+2=", system_prompt="be brief")
    assert tok.decode(with_system) == "<s2>be brief;<u>1+2=;<a>"
    # The template's own rendering, tokenized: the same ids.
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]


def test_encode_chat_prompts_pads_right(chat_tokenizer):
    tok = chat_tokenizer
    ids, lengths = encode_chat_prompts(tok, ["1+2=", "10+20="], system_prompt="x")
    one, two = build_prompt_ids(tok, "1+2=", "x"), build_prompt_ids(tok, "10+20=", "x")
    assert lengths.tolist() == [len(one), len(two)]
    assert ids.shape == (2, len(two))
    assert ids[0, : len(one)].tolist() == one
    assert torch.all(ids[0, len(one) :] == tok.pad_token_id)
    assert ids[1].tolist() == two
    with pytest.raises(ValueError, match="no prompts"):
        encode_chat_prompts(tok, [])


def test_no_template_plain_text(tokenizer):
    # The tiny character tokenizer has no chat template: the prompt is the plain text.
    assert build_prompt_ids(tokenizer, "7+5=") == tokenizer("7+5=")["input_ids"]
    with pytest.raises(ValueError, match="no chat template"):
        build_prompt_ids(tokenizer, "7+5=", system_prompt="be brief")
    with pytest.raises(TypeError, match="prompt must be a str"):
        build_prompt_ids(tokenizer, 7)
