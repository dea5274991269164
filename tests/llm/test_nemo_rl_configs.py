"""NeMo-RL's own example configs (the ``policy`` sections of ``grpo_math_1B.yaml`` and
``sft.yaml``, copied under tests/llm/data/) load into ``Policy``; the keys phalanx cannot
honour are refused by name; ``Policy.flops_tracker`` and the ``timer=`` keyword."""

from __future__ import annotations

import copy
import os
import re
from contextlib import contextmanager

import pytest
import torch
import yaml

from phalanx.data import BatchedDataDict
from phalanx.llm.flops import FLOPTracker
from phalanx.llm.lora import check_lora_config, lora_settings
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy import Policy
from phalanx.llm.policy_config import ConfigError, check_policy_config

DATA = os.path.join(os.path.dirname(__file__), "data")
CONFIGS = ["nemo_rl_grpo_math_1B_policy.yaml", "nemo_rl_sft_policy.yaml"]

pytestmark = pytest.mark.timeout(300)


class _Loader(yaml.SafeLoader):
    """YAML as OmegaConf reads it: ``1e-8`` is a float (YAML 1.1 wants ``1.0e-8``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?\.?\d*(?:[eE][-+]?\d+)$|^[-+]?\d[\d_]*\.\d*$"),
    list("-+0123456789."),
)

_REF = re.compile(r"^\$\{(.*)\}$")


def _resolve(value, node, root):
    """OmegaConf's interpolations as these files use them: ``${a.b}`` from the root,
    ``${.a}`` in the same node, ``${mul:${x}, ${y}}``."""
    if isinstance(value, dict):
        return {k: _resolve(v, value, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, node, root) for v in value]
    m = _REF.match(value) if isinstance(value, str) else None
    if m is None:
        return value
    expr = m.group(1)
    if expr.startswith("mul:"):
        a, b = (_resolve(part.strip(), node, root) for part in expr[4:].split(","))
        return a * b
    target = node if expr.startswith(".") else root
    for key in expr.lstrip(".").split("."):
        target = target[key]
    return _resolve(target, node, root)


def nemo_rl_policy(name: str, model_path: str) -> dict:
    """The ``policy`` section of a NeMo-RL example config, resolved, on ``model_path``."""
    with open(os.path.join(DATA, name)) as f:
        raw = yaml.load(f, Loader=_Loader)
    raw["policy"]["model_name"] = model_path
    return _resolve(raw, raw, raw)["policy"]


@pytest.mark.parametrize("name", CONFIGS)
def test_nemo_rl_example_policy_sections_pass_the_config_check(name, model_path):
    cfg = nemo_rl_policy(name, model_path)
    assert cfg["dtensor_cfg"]["_v2"] is True
    assert cfg["dtensor_cfg"]["lora_cfg"]["enabled"] is False
    check_policy_config(cfg)


@pytest.mark.parametrize(
    "path, value, match",
    [
        (
            ("dtensor_cfg", "lora"),
            {"enabled": True},
            "reads the LoRA settings from dtensor_cfg.lora_cfg",
        ),
        (("dtensor_cfg", "dp_replicate_size"), 2, "dp_replicate_size > 1"),
        (("dtensor_cfg", "dp_replicate_size"), 0, "dp_replicate_size must be a positive int"),
        (("dtensor_cfg", "automodel_kwargs"), {"use_liger_kernel": True}, "use_liger_kernel"),
        (("dtensor_cfg", "expert_parallel_size"), 2, "expert_parallel_size"),
        (("megatron_cfg", "enabled"), True, "megatron_cfg.enabled=True"),
        (("draft", "enabled"), True, "draft.enabled=True"),
        (("generation", "top_k"), 50, "generation.top_k=50"),
        (("generation", "top_p"), 0.9, "top_p=0.9"),
        (("sequence_packing", "sequence_length_round"), 0, "sequence_length_round"),
        (("train_micro_batch_size",), True, "train_micro_batch_size must be a positive int"),
        (("max_grad_norm",), "1.0", "max_grad_norm must be a number"),
        (("seed",), -1, "seed must be >= 0"),
        (("precision",), "float8", "precision"),
        (("dtensor_cfg", "sequence_paralel"), True, "sequence_paralel"),
    ],
)
def test_keys_phalanx_cannot_honour_are_named(model_path, path, value, match):
    cfg = nemo_rl_policy(CONFIGS[0], model_path)
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=match):
        check_policy_config(cfg)


@pytest.mark.parametrize("name", CONFIGS)
def test_nemo_rl_example_lora_cfg_enabled_is_accepted(name, model_path):
    cfg = nemo_rl_policy(name, model_path)
    cfg["dtensor_cfg"]["lora_cfg"]["enabled"] = True
    check_policy_config(cfg)
    assert check_lora_config(cfg) == lora_settings(cfg["dtensor_cfg"]["lora_cfg"])
    assert check_lora_config(cfg).dim == cfg["dtensor_cfg"]["lora_cfg"]["dim"]
    cfg["dtensor_cfg"]["tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match="lora_cfg.enabled=True with tensor_parallel_size > 1"):
        check_lora_config(cfg)


def test_automodel_force_hf_is_what_phalanx_does(model_path):
    cfg = nemo_rl_policy(CONFIGS[1], model_path)
    cfg["dtensor_cfg"]["automodel_kwargs"] = {"force_hf": True, "use_liger_kernel": False}
    check_policy_config(cfg)


def test_flop_tracker_counts_nemo_rl_llama_formula(model_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    tracker = FLOPTracker.from_config(model_path, config)
    tracker.track_batch([5, 9])
    h, L, a = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    g, f, V = config.num_key_value_heads, config.intermediate_size, config.vocab_size

    def nemo_llama(s):  # NeMo-RL's flops_formulas.llama, for one sequence of s tokens
        return s * L * h * h * (12 + 12 * g / a + 18 * f / h + 6 * s / h + 6 * V / (L * h))

    assert config.head_dim * a == h  # the formula assumes head_dim = hidden / heads
    assert tracker.total_flops == pytest.approx(nemo_llama(5) + nemo_llama(9), rel=1e-12)
    assert tracker.total_tokens == 14
    tracker.reset()
    assert (tracker.total_flops, tracker.total_tokens) == (0, 0)
    gpt2 = AutoConfig.for_model("gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        FLOPTracker.from_config("gpt2", gpt2)


class RecordingTimer:
    """NeMo-RL's ``Timer`` surface that ``Policy`` uses: ``with timer.time(label)``."""

    def __init__(self):
        self.labels: list[str] = []
        self.seconds: dict[str, float] = {}

    @contextmanager
    def time(self, label):
        import time

        start = time.perf_counter()
        yield
        self.labels.append(label)
        self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start


def _batch(tokenizer, rows=4, width=12):
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([12, 7, 9, 4][:rows])
    ids = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(3, len(tokenizer), (n,), generator=g)
        mask[i, 1:n] = 1
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(rows)
    )


def test_policy_from_nemo_rl_sft_config_trains_with_timer_and_flops(cluster, model_path, tokenizer):
    cfg = nemo_rl_policy(CONFIGS[1], model_path)
    cfg["precision"] = "float32"  # bf16 matrix products are ~20x slower on these CPUs
    original = copy.deepcopy(cfg)
    policy = Policy(cluster, cfg, tokenizer, num_workers=2, name_prefix="nemo_sft")
    try:
        assert cfg == original  # the caller's config is not modified
        assert isinstance(policy.flops_tracker, FLOPTracker)
        data = _batch(tokenizer)
        timer = RecordingTimer()
        lp = policy.get_logprobs(data, timer=timer)["logprobs"]
        assert lp.shape == (4, 12) and lp.dtype == torch.float32
        ref = policy.get_reference_policy_logprobs(data, timer=timer)["reference_logprobs"]
        torch.testing.assert_close(ref, lp, atol=0, rtol=0)
        out = policy.train(data, NLLLoss(), gbs=4, mbs=1, timer=timer)
        assert timer.labels == [
            "get_logprobs/shard_data",
            "get_logprobs/submit_logprob_futures",
            "get_reference_policy_logprobs/shard_data",
            "get_reference_policy_logprobs/submit_reference_policy_logprob_futures",
            "policy_training/sharding_data",
            "policy_training/submit_training_futures",
        ]
        assert all(v >= 0 for v in timer.seconds.values())
        expected = FLOPTracker.from_config(
            model_path, policy.worker_group.call("return_model_config").wait(timeout=60)[0]
        )
        expected.track_batch([12, 7, 9, 4])
        assert out["total_flops"] == expected.total_flops
        assert policy.flops_tracker.total_tokens == 32
        assert out["num_ranks"] == 2
        # dtensor_cfg._v2: every micro-batch reports lr and the global valid counts
        mb = out["all_mb_metrics"]
        assert mb["lr"] == [5.0e-6] * 4
        assert mb["global_valid_seqs"] == [4.0] * 4
        assert mb["global_valid_toks"] == [float(data["token_mask"][:, 1:].sum())] * 4
        with pytest.raises(TypeError, match="timer must have a time"):
            policy.get_logprobs(data, timer=object())
    finally:
        policy.shutdown()
