"""The clipped policy-gradient loss for one on-policy update per batch.

When a batch is trained on with a single optimizer step, the policy that trains is the
one that generated the batch, so the "old" log-probs in the ratio ``exp(logp - old)`` are
the training forward's own log-probs, detached (TRL does the same with one iteration per
batch). ``OnPolicyPGLossFn`` fills ``prev_logprobs`` that way when the batch does not
carry them, which saves a whole log-prob pass over the batch; with them it is exactly
``ClippedPGLossFn``.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.llm.loss import ClippedPGLossFn, token_logprobs


class OnPolicyPGLossFn(ClippedPGLossFn):
    """``ClippedPGLossFn`` whose missing ``prev_logprobs`` are the current ones, detached."""

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if "prev_logprobs" not in data:
            with torch.no_grad():
                lp = token_logprobs(next_token_logits, data["input_ids"])
            prev = torch.nn.functional.pad(lp, (1, 0))  # position 0 predicts nothing
            data = {**data, "prev_logprobs": prev}
        return super().__call__(next_token_logits, data, global_valid_seqs, global_valid_toks)
