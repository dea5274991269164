"""Generation on CUDA: the KV-cached decoding loop equals HF ``generate`` greedy output."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.skips import needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(180)]


def test_kv_cached_decoding_equals_hf_generate_greedy(tiny_model, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    import phalanx as px
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts

    cfg = {"model_name": tiny_model, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0}
    worker = px.HFGenerationWorker(cfg, tiny_tokenizer)
    assert worker.device.type == "cuda"
    assert next(worker.model.parameters()).device.type == "cuda"
    pairs = AdditionTask(3).sample_prompts(5)
    ids, lengths = encode_prompts(tiny_tokenizer, [p for p, _ in pairs])
    data = px.BatchedDataDict(input_ids=ids, input_lengths=lengths).repeat_interleave(3)
    out = worker.generate(data, greedy=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    for i in range(data.size):
        n = int(data["input_lengths"][i])
        ref = model.generate(
            input_ids=data["input_ids"][i : i + 1, :n].cuda(),
            attention_mask=torch.ones(1, n, dtype=torch.long, device="cuda"),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=tiny_tokenizer.eos_token_id,
            pad_token_id=tiny_tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new = ref.sequences[0, n:].cpu()
        g = int(out["generation_lengths"][i])
        assert g == len(new), i
        assert out["output_ids"][i, n : n + g].tolist() == new.tolist(), i
        lp = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), -1).cpu()
        torch.testing.assert_close(
            out["logprobs"][i, n : n + g],
            lp.gather(-1, new[:, None]).squeeze(-1),
            atol=1e-4,
            rtol=0,
        )
    # sampling on the GPU is seeded: the same seed gives the same tokens
    again = px.HFGenerationWorker(cfg, tiny_tokenizer)
    torch.testing.assert_close(
        again.generate(data)["output_ids"],
        px.HFGenerationWorker(cfg, tiny_tokenizer).generate(data)["output_ids"],
    )
    assert worker.finish_generation() is True and worker.prepare_for_generation() is True
