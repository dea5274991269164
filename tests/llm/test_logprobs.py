"""Chunked chosen-token log-probs and packed rows, in one process (no Ray)."""

from __future__ import annotations

import pytest
import torch

from phalanx.llm.logprobs import chosen_token_logprobs, entropy_sum, token_logprobs
from phalanx.llm.packed_rows import pack_rows, unpack_to_rows, unpack_token_logprobs


def _full(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [None, 1, 3, 7, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_full_computation(chunk, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 9, 50, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    got = token_logprobs(logits, ids, chunk)
    assert got.dtype == torch.float32 and got.shape == (3, 8)
    torch.testing.assert_close(got, _full(logits, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.smoke
def test_chunked_logprobs_gradients_equal_the_full_computation() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 6, 40, generator=g)
    ids = torch.randint(0, 40, (2, 6), generator=g)
    weights = torch.randn(2, 5, generator=g)
    a = base.clone().requires_grad_()
    b = base.clone().requires_grad_()
    (token_logprobs(a, ids, 2) * weights).sum().backward()
    (_full(b, ids) * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def _entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), -1)
    return (-(logp.exp() * logp).sum(-1) * mask).sum()


@pytest.mark.parametrize("chunk", [None, 1, 2, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_of_the_masked_positions(chunk, dtype) -> None:
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 30, generator=g) * 3).to(dtype)
    mask = torch.tensor([[1.0, 1, 0, 1, 0], [0, 1, 1, 0.5, 1]])
    got = entropy_sum(logits, mask, chunk_size=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _entropy(logits, mask), atol=1e-4, rtol=1e-5)
    assert entropy_sum(logits, torch.zeros(2, 5), chunk_size=chunk).item() == 0.0


def test_entropy_copies_one_chunk_of_rows_at_a_time() -> None:
    """The loss's entropy metric allocates nothing larger than one chunk's rows in float32
    (2 rows x 2 positions), where gathering every counted position first would allocate
    [7, V] (and a float32 copy of a chunk of those)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from phalanx.llm.logprobs import logprob_settings
    from phalanx.llm.loss import masked_entropy_sum

    V = 64
    logits = torch.randn(2, 7, V)
    mask = torch.ones(2, 6)  # the positions predicting tokens 1..6
    mask[0, 0] = mask[1, 5] = mask[1, 3] = mask[0, 2] = mask[1, 1] = 0
    given = logits.untyped_storage().data_ptr()

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != given:
                    Largest.nbytes = max(Largest.nbytes, t.untyped_storage().nbytes())
            return out

    with logprob_settings(chunk_size=2), Largest():
        got = masked_entropy_sum(logits, mask)
    assert Largest.nbytes <= 2 * 2 * V * 4, Largest.nbytes
    torch.testing.assert_close(got, _entropy(logits[:, :6], mask))


@pytest.mark.timeout(300)
def test_compiled_entropy_equals_eager() -> None:
    from phalanx.llm.logprobs import logprob_settings

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 7, 40, generator=g) * 3).to(torch.bfloat16)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    with logprob_settings(kernel="eager"):
        eager = entropy_sum(logits, mask, chunk_size=3)
    with logprob_settings(kernel="compiled"):
        compiled = entropy_sum(logits, mask, chunk_size=3)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(eager, _entropy(logits, mask), atol=1e-4, rtol=1e-5)


def test_bad_chunk_and_shapes() -> None:
    logits = torch.randn(2, 5, 30)
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        chosen_token_logprobs(logits, torch.zeros(2, 5, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="disagree"):
        chosen_token_logprobs(logits, torch.zeros(2, 6, dtype=torch.long))


def test_pack_rows_layout_mask_and_unpack() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    packed = pack_rows(ids, torch.tensor([3, 2, 4]), pad_id=0, pad_to_multiple=4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert packed.starts == [0, 3, 5] and packed.lengths == [3, 2, 4]
    m = packed.attention_mask[0, 0]
    assert m.shape == (12, 12)
    assert m[4].tolist() == [False] * 3 + [True, True] + [False] * 7  # 2nd sequence, token 2
    assert m[2, :3].all() and not m[3, :3].any()  # no attention across the boundary
    # per-position values back to rows; past-the-length positions repeat the last token
    vals = torch.arange(12.0).reshape(1, 12, 1)
    rows = unpack_to_rows(vals, packed, 4)[..., 0]
    assert rows.tolist() == [[0, 1, 2, 2], [3, 4, 4, 4], [5, 6, 7, 8]]
    lp = torch.arange(1.0, 12.0).reshape(1, 11)  # next-token values of the packed row
    out = unpack_token_logprobs(lp, packed, 4)
    assert out.tolist() == [[0, 1, 2, 0], [0, 4, 0, 0], [0, 6, 7, 8]]
    with pytest.raises(ValueError, match="input_lengths"):
        pack_rows(ids, torch.tensor([3, 5, 1]), pad_id=0)


@pytest.mark.timeout(120)
def test_packed_forward_equals_separate_forwards(model_path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    g = torch.Generator().manual_seed(3)
    V = model.config.vocab_size
    lengths = torch.tensor([5, 9, 2, 7])
    ids = torch.zeros(4, 9, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(1, V, (n,), generator=g)
    with torch.no_grad():
        packed = pack_rows(ids, lengths, pad_id=0)
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=packed.attention_mask,
        ).logits
        rows = unpack_to_rows(out, packed, 9)
        for i, n in enumerate(lengths.tolist()):
            alone = model(input_ids=ids[i : i + 1, :n]).logits[0]
            torch.testing.assert_close(rows[i, :n], alone, atol=1e-5, rtol=1e-5)


def test_default_chunks_hold_more_positions_on_a_gpu() -> None:
    """A GPU's chunks are 8x larger (fewer kernel launches); a given size is used as is."""
    from phalanx.llm.logprobs import _chunk_positions

    vocab = 151_936  # Qwen2.5's
    assert _chunk_positions(1, vocab, None, torch.device("cpu")) == (1 << 24) // vocab == 110
    assert _chunk_positions(1, vocab, None, torch.device("cuda")) == (1 << 27) // vocab == 883
    assert _chunk_positions(8, vocab, 1024, torch.device("cuda")) == 1024


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_equals_eager_in_values_and_gradients(dtype) -> None:
    """torch.compile's fused kernel (here inductor's CPU backend) against the eager chunks:
    the same log-probs and logit gradients, zero gradient past the targets, and the
    gradient in the logits' dtype."""
    from phalanx.llm.logprobs import kernel_runs, logprob_settings

    g = torch.Generator().manual_seed(4)
    base = (torch.randn(3, 10, 64, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 64, (3, 8), generator=g)  # 2 positions past the targets
    weights = torch.randn(3, 8, generator=g)
    results = {}
    for kernel in ("eager", "compiled"):
        before = kernel_runs().get(kernel, 0)
        x = base.clone().requires_grad_()
        with logprob_settings(chunk_size=3, kernel=kernel):
            lp = chosen_token_logprobs(x, targets)
        (lp * weights).sum().backward()
        assert kernel_runs()[kernel] == before + 1
        assert x.grad.dtype == dtype and lp.dtype == torch.float32
        assert (x.grad[:, 8:] == 0).all()
        results[kernel] = (lp.detach(), x.grad.float())
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 0}
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["compiled"][1], results["eager"][1], **tol)
    full = torch.log_softmax(base.float(), -1)[:, :8].gather(-1, targets.unsqueeze(-1))
    torch.testing.assert_close(results["compiled"][0], full.squeeze(-1), atol=1e-5, rtol=1e-5)


def test_logprob_settings_choose_the_kernel_and_check_their_values() -> None:
    from phalanx.llm.logprobs import LogprobSettings, kernel_runs, logprob_settings, resolve_kernel

    assert resolve_kernel("auto", torch.device("cpu")) == "eager"
    assert resolve_kernel("compiled", torch.device("cpu")) == "compiled"
    # a GPU gets the compiled kernel only where Triton can be imported
    import importlib.util

    has_triton = importlib.util.find_spec("triton") is not None
    assert resolve_kernel("auto", torch.device("cuda")) == ("compiled" if has_triton else "eager")
    before = kernel_runs().get("eager", 0)
    with logprob_settings(kernel="eager"):
        token_logprobs(torch.randn(1, 4, 9), torch.randint(0, 9, (1, 4)))
    assert kernel_runs()["eager"] == before + 1
    with pytest.raises(ValueError, match="logprob_kernel must be one of"):
        LogprobSettings(kernel="fast")
    lp = None
    with pytest.raises(ValueError, match="logprob_chunk_size"), logprob_settings(chunk_size=0):
        lp = token_logprobs(torch.randn(1, 4, 9), torch.randint(0, 9, (1, 4)))
    assert lp is None  # refused before the block ran


def test_the_policy_config_checks_logprob_kernel() -> None:
    from phalanx.llm.policy_config import ConfigError, check_policy_config

    check_policy_config({"model_name": "m", "logprob_kernel": "compiled"})
    with pytest.raises(ConfigError, match="logprob_kernel must be one of"):
        check_policy_config({"model_name": "m", "logprob_kernel": "triton"})
