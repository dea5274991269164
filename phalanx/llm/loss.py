"""Loss functions for the policy worker: NLL (SFT) and the clipped policy-gradient loss.

A loss function is called once per micro-batch as
``loss_fn(next_token_logits, data, global_valid_seqs, global_valid_toks)`` and returns
``(loss, metrics)``. ``next_token_logits[:, t]`` predicts token ``t + 1``. Token-level
losses are *sums* over the micro-batch's valid tokens divided by ``global_valid_toks``
(the number of valid tokens of the whole global batch on all data-parallel ranks), so
that summing the micro-batch losses of every rank gives the mean over the global batch,
whatever the sharding and micro-batching.

A loss whose class sets ``masked_positions_only = True`` promises to read only the logits
of positions whose next token is valid; the policy worker then computes no logits for the
leading positions that no row trains on (a prompt's) and cuts every per-position tensor of
the micro-batch the same way (``first_loss_position``, ``drop_leading_positions``). The
losses here do; a loss without the attribute gets every position's logits, as in NeMo-RL.

Data keys: ``input_ids`` [B, T]; ``token_mask`` [B, T] (1 where a token is trained on;
without it every token counts, as in NeMo-RL); ``sample_mask`` [B] (0 drops a sample); the PG loss also reads ``advantages`` ([B] or
[B, T]), ``prev_logprobs`` [B, T] and ``reference_policy_logprobs`` [B, T] (optional).
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from phalanx.llm.logprobs import entropy_sum
from phalanx.llm.logprobs import token_logprobs as _chunked_token_logprobs


class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossFunction(Protocol):
    """What ``DTensorPolicyWorker.train`` calls per micro-batch."""

    loss_type: LossType

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: [B, T-1] from logits [B, T, V] and ids [B, T].

    Computed in chunks of positions, keeping only the chosen tokens (``phalanx.llm.logprobs``).
    """
    return _chunked_token_logprobs(logits, input_ids)


def valid_token_mask(data: dict[str, Any]) -> torch.Tensor:
    """[B, T-1] mask of the predicted tokens that count (token_mask * sample_mask).

    Without ``token_mask`` every predicted token counts.
    """
    ids = data["input_ids"]
    if "token_mask" in data:
        mask = data["token_mask"][:, 1:].float()
    else:
        mask = torch.ones(ids.shape[0], max(ids.shape[1] - 1, 0), device=ids.device)
    if "sample_mask" in data:
        mask = mask * data["sample_mask"].float().to(mask.device).unsqueeze(-1)
    return mask


def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over valid positions of the policy's entropy (a diagnostic, not differentiated).

    Only the positions with a nonzero mask are computed (a prompt's are not).
    """
    return entropy_sum(logits[:, : mask.shape[1]], mask)


def first_loss_position(data: dict[str, Any]) -> int:
    """The first position whose next-token logits a masked loss reads: the smallest ``t``
    with a valid token ``t + 1`` in any row (0 without ``token_mask``, or with none valid).

    Positions before it are context only; the policy worker computes no logits for them
    when the loss says it reads masked positions only (``masked_positions_only``).
    """
    if "token_mask" not in data:
        return 0
    valid = valid_token_mask(data).sum(0).nonzero()
    return int(valid[0]) if len(valid) else 0


def drop_leading_positions(data: dict[str, Any], start: int) -> dict[str, Any]:
    """``data`` with every per-position tensor ([B, T, ...] like ``input_ids``) cut to
    positions ``start:``, so that logits of positions ``start:`` line up with it."""
    if not start:
        return data
    T = data["input_ids"].shape[1]
    out = copy.copy(data)  # the same mapping type (a BatchedDataDict stays one)
    for k, v in data.items():
        if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == T:
            out[k] = v[:, start:]
    return out


class NLLLoss:
    """Negative log-likelihood of the masked tokens (supervised fine-tuning)."""

    loss_type = LossType.TOKEN_LEVEL
    # reads only the logits of positions whose next token is valid (first_loss_position)
    masked_positions_only = True

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        lp = token_logprobs(next_token_logits, data["input_ids"])
        mask = valid_token_mask(data)
        loss = -(lp * mask).sum() / global_valid_toks.clamp(min=1)
        return loss, {"loss": loss.item(), "num_valid_tokens": int(mask.sum().item())}


@dataclass
class ClippedPGLossConfig:
    """PPO/GRPO clipping and KL penalty (``reference_policy_kl_penalty`` is beta)."""

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    reference_policy_kl_penalty: float = 0.01


class ClippedPGLossFn:
    """Clipped policy-gradient loss with a k3 KL penalty to the reference policy.

    Per token: ``max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi)) + beta * k3`` where
    ``r = exp(logp - prev_logp)`` and ``k3 = exp(ref - logp) - (ref - logp) - 1``
    (Schulman's unbiased, always non-negative estimator of KL(pi || ref)).

    Args:
        cfg: a ``ClippedPGLossConfig`` or a dict of its fields (the defaults if None).
    """

    loss_type = LossType.TOKEN_LEVEL
    masked_positions_only = True

    def __init__(self, cfg: ClippedPGLossConfig | dict[str, Any] | None = None):
        if isinstance(cfg, dict):
            cfg = ClippedPGLossConfig(**cfg)
        self.cfg = cfg or ClippedPGLossConfig()
        if self.cfg.ratio_clip_min < 0 or self.cfg.ratio_clip_max < 0:
            raise ValueError(
                f"ratio_clip_min/ratio_clip_max must be >= 0, got {self.cfg.ratio_clip_min}, "
                f"{self.cfg.ratio_clip_max}"
            )

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        self._check_keys(data)
        lp = token_logprobs(next_token_logits, data["input_ids"])
        return self.loss_from_logprobs(lp, next_token_logits, data, global_valid_toks)

    def _check_keys(self, data: dict[str, Any]) -> None:
        for key in ("advantages", "prev_logprobs"):
            if key not in data:
                raise KeyError(f"{type(self).__name__} needs data[{key!r}]")

    def loss_from_logprobs(
        self,
        lp: torch.Tensor,
        next_token_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss and metrics from the policy's log-probs ``lp`` [B, T-1] of the tokens of
        ``data["input_ids"]`` (``next_token_logits`` only feeds the entropy metric).

        Args:
            lp: the policy's log-probs.
            next_token_logits: the logits, for the entropy metric.
            data: the batch, with the advantages, masks and previous log-probs.
            global_valid_toks: the valid tokens of the global batch.

        Returns:
            ``(loss, metrics)``.
        """
        self._check_keys(data)
        cfg = self.cfg
        mask = valid_token_mask(data)
        denom = global_valid_toks.clamp(min=1)
        adv = data["advantages"].float()
        adv = adv.unsqueeze(-1).expand_as(lp) if adv.ndim == 1 else adv[:, 1:]
        prev = data["prev_logprobs"][:, 1:].float()
        ratio = torch.exp(lp - prev)
        clipped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        pg = torch.maximum(-adv * ratio, -adv * clipped)
        loss = (pg * mask).sum() / denom
        kl_sum = torch.zeros((), dtype=lp.dtype)
        if cfg.reference_policy_kl_penalty and "reference_policy_logprobs" in data:
            diff = data["reference_policy_logprobs"][:, 1:].float() - lp
            k3 = torch.exp(diff) - diff - 1.0
            kl_sum = (k3 * mask).sum()
            loss = loss + cfg.reference_policy_kl_penalty * kl_sum / denom
        with torch.no_grad():
            n = mask.sum()
            clip_frac = (((ratio - clipped).abs() > 1e-6).float() * mask).sum()
            metrics = {
                "loss": loss.item(),
                "kl_sum": kl_sum.item(),
                "clip_frac_sum": clip_frac.item(),
                "entropy_sum": masked_entropy_sum(next_token_logits, mask).item(),
                "ratio_sum": (ratio * mask).sum().item(),
                "num_valid_tokens": int(n.item()),
            }
        return loss, metrics
