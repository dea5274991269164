"""GGUF conversion: a tiny Llama written as a GGUF file with the ``gguf`` package's writer
comes back through ``resolve_model`` as a plain Hugging Face folder with the same weights,
tokenizer and chat template."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 3 special tokens, the 256 byte symbols, a few merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_syms = sorted(ByteLevel.alphabet())
    merges = ["1 2", "Ġ +", "Ġ 1"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + byte_syms + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved per head), which transformers'
    GGUF loader undoes."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path: str) -> dict[str, torch.Tensor]:
    """A random 2-layer Llama as an F32 GGUF file; returns its Hugging Face state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, types, merges = _tiny_vocab()
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-test")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        t = sd[hf].numpy().astype(np.float32)
        if gg.endswith("attn_q.weight"):
            t = _permute(t, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            t = _permute(t, cfg.num_key_value_heads)
        w.add_tensor(gg, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.mark.timeout(120)
def test_gguf_round_trip(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.llm.models import cache_root, resolve_model

    monkeypatch.setenv("PHALANX_CACHE", str(tmp_path / "cache"))
    gguf_path = str(tmp_path / "tiny.gguf")
    sd = write_tiny_gguf(gguf_path)

    out = resolve_model(gguf_path, quiet=True)
    assert out.startswith(cache_root()) and os.path.isfile(os.path.join(out, "config.json"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model.config, "quantization_config", None) is None
    got = model.state_dict()
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():  # F32 in, F32 out: bit-identical (q/k un-permuted back)
        assert torch.equal(got[k], v), k

    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    ids = tok("12 + 1", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12 + 1"
    assert tok.convert_ids_to_tokens(ids)[0] == "12"  # the merge "1 2" applied
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Converted once: a second call reuses the folder without writing it again.
    stamp = os.path.getmtime(os.path.join(out, "model.safetensors"))
    assert resolve_model(gguf_path, quiet=True) == out
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == stamp
    assert not [d for d in os.listdir(cache_root()) if ".partial" in d]


def test_resolve_model_errors(tmp_path, monkeypatch):
    from phalanx.llm.models import fetch_model, resolve_model

    monkeypatch.setenv("PHALANX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="phalanx models fetch smollm2-135m-instruct"):
        resolve_model("smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face folder"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        fetch_model("gpt-17")
