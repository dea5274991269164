"""The log-prob kernels on CUDA at Qwen2.5's vocabulary: ``"auto"`` compiles (Triton), and the
compiled kernel equals the eager chunks in values and gradients, from bfloat16 logits; so
does the entropy metric."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.skips import needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(240)]


def test_compiled_and_eager_kernels_agree_on_cuda() -> None:
    from phalanx.llm.logprobs import chosen_token_logprobs, kernel_runs, logprob_settings

    g = torch.Generator(device="cuda").manual_seed(0)
    V = 151_936
    base = (torch.randn(4, 257, V, device="cuda", generator=g) * 3).bfloat16()
    targets = torch.randint(0, V, (4, 256), device="cuda", generator=g)
    weights = torch.randn(4, 256, device="cuda", generator=g)
    got = {}
    for kernel in ("auto", "eager"):
        before = dict(kernel_runs())
        x = base.clone().requires_grad_()
        with logprob_settings(kernel=kernel):
            lp = chosen_token_logprobs(x, targets)
        (lp * weights).sum().backward()
        ran = {k: v - before.get(k, 0) for k, v in kernel_runs().items() if v != before.get(k, 0)}
        assert ran == {"compiled" if kernel == "auto" else "eager": 1}
        assert x.grad.dtype == torch.bfloat16 and (x.grad[:, 256] == 0).all()
        got[kernel] = (lp.detach(), x.grad.float())
        del x
    torch.testing.assert_close(got["auto"][0], got["eager"][0], atol=1e-4, rtol=1e-5)
    # bf16 gradients: one rounding apart at most
    torch.testing.assert_close(got["auto"][1], got["eager"][1], atol=2e-2, rtol=1e-2)


def test_compiled_entropy_equals_eager_on_cuda() -> None:
    from phalanx.llm.logprobs import entropy_sum, logprob_settings

    g = torch.Generator(device="cuda").manual_seed(1)
    V = 151_936
    logits = (torch.randn(4, 257, V, device="cuda", generator=g) * 3).bfloat16()
    mask = (torch.rand(4, 257, device="cuda", generator=g) > 0.3).float()
    with logprob_settings(kernel="auto"):
        auto = entropy_sum(logits, mask)
    with logprob_settings(kernel="eager"):
        eager = entropy_sum(logits, mask)
    torch.testing.assert_close(auto, eager, atol=1e-2, rtol=1e-5)
