"""LoRA on a plain Hugging Face model (phalanx.llm.lora): NeMo-RL's lora_cfg keys, peft
adapters, disabled adapters as the reference policy, merged weights for refit, and peft's
checkpoint format. No Ray: the tiny test model on one process."""

from __future__ import annotations

import faulthandler
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from phalanx.llm.lora import (
    LORA_KEYS,
    LoraSettings,
    adapter_factors,
    apply_lora,
    base_state_dict,
    disabled_adapters,
    is_adapter_parameter,
    load_adapters,
    lora_layers,
    lora_settings,
    merge_adapters,
    merged_state_dict,
    save_adapters,
    select_lora_modules,
)
from phalanx.llm.policy_config import ConfigError

LAYERS = ("model.layers.0", "model.layers.1")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_PROJ = [f"{x}.self_attn.{p}" for x in LAYERS for p in ATTN] + [
    f"{x}.mlp.{p}" for x in LAYERS for p in MLP
]


def _settings(**kw) -> LoraSettings:
    return lora_settings({"enabled": True, **kw})


def _model(path) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokens() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (2, 12), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**_tokens()).logits


def _randomise_b(peft_model, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(peft_model).values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)


# ----------------------------------------------------------------------------- config


def test_nemo_rl_example_block_is_accepted_with_its_defaults():
    # grpo_math_1B.yaml's lora_cfg with enabled flipped on.
    block = {
        "enabled": True,
        "target_modules": [],
        "exclude_modules": [],
        "match_all_linear": True,
        "dim": 8,
        "alpha": 32,
        "dropout": 0.0,
        "dropout_position": "post",
        "lora_A_init": "xavier",
        "use_triton": True,
    }
    assert set(block) == set(LORA_KEYS)
    s = lora_settings(block)
    assert s == LoraSettings(match_all_linear=True, use_triton=True)
    assert s.scale == 4.0
    assert lora_settings({**block, "enabled": False}) is None
    assert lora_settings(None) is None
    # Missing keys take Automodel's PeftConfig.from_dict defaults.
    assert lora_settings({"enabled": True}) == LoraSettings()
    assert lora_settings({"enabled": True, "target_modules": "q_proj"}).target_modules == (
        "q_proj",
    )


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"dim": 0}, "dtensor_cfg.lora_cfg.dim must be >= 1, got 0"),
        ({"dim": -2}, "dtensor_cfg.lora_cfg.dim must be >= 1, got -2"),
        ({"dim": 8.0}, "dtensor_cfg.lora_cfg.dim must be an int"),
        ({"dim": True}, "dtensor_cfg.lora_cfg.dim must be an int"),
        ({"alpha": 0}, "dtensor_cfg.lora_cfg.alpha must be > 0, got 0"),
        ({"alpha": -1.5}, "dtensor_cfg.lora_cfg.alpha must be > 0, got -1.5"),
        ({"alpha": "32"}, "dtensor_cfg.lora_cfg.alpha must be a number"),
        ({"dropout": 1.0}, "dtensor_cfg.lora_cfg.dropout must be in [0, 1), got 1"),
        ({"dropout": -0.1}, "dtensor_cfg.lora_cfg.dropout must be in [0, 1), got -0.1"),
        ({"lora_A_init": "kaiming"}, "lora_cfg.lora_A_init must be one of ['xavier', 'uniform']"),
        ({"dropout_position": "mid"}, "lora_cfg.dropout_position must be one of ['pre', 'post']"),
        ({"rank": 8}, "dtensor_cfg.lora_cfg: unknown key(s) ['rank']"),
        ({"use_dora": True}, "dtensor_cfg.lora_cfg: unknown key(s) ['use_dora']"),
        ({"enabled": "yes"}, "dtensor_cfg.lora_cfg.enabled must be a bool"),
        ({"use_triton": 1}, "dtensor_cfg.lora_cfg.use_triton must be a bool"),
        ({"target_modules": [1]}, "dtensor_cfg.lora_cfg.target_modules must be a list"),
        ({"exclude_modules": {"a": 1}}, "dtensor_cfg.lora_cfg.exclude_modules must be a list"),
        ({"target_modules": ["q_proj("]}, "target_modules: 'q_proj(' is not a valid pattern"),
        (
            {"target_modules": ["q_proj"], "exclude_modules": ["k_proj"]},
            "target_modules and dtensor_cfg.lora_cfg.exclude_modules are mutually exclusive",
        ),
        (
            {"match_all_linear": True, "target_modules": ["q_proj"]},
            "match_all_linear=True needs empty target_modules and exclude_modules",
        ),
    ],
)
def test_bad_lora_cfg_is_a_config_error_naming_the_key(cfg, message):
    with pytest.raises(ConfigError) as e:
        lora_settings({"enabled": True, **cfg})
    assert message in str(e.value)
    # Checked even when LoRA is off: a misspelt key is an error either way.
    with pytest.raises(ConfigError):
        lora_settings({**cfg, "enabled": False} if "enabled" not in cfg else cfg)


def test_lora_cfg_must_be_a_dict():
    with pytest.raises(ConfigError, match="dtensor_cfg.lora_cfg must be a dict, got list"):
        lora_settings([("enabled", True)])


# ----------------------------------------------------------------------------- selection


def test_target_modules_select_exactly_the_named_modules(model_path):
    model = _model(model_path)
    assert select_lora_modules(model, _settings(target_modules=["q_proj", "*down_proj*"])) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    assert select_lora_modules(model, _settings(target_modules=["*.layers.1.*.v_proj"])) == [
        "model.layers.1.self_attn.v_proj"
    ]
    assert select_lora_modules(model, _settings(target_modules=["lm_head"])) == ["lm_head"]


def test_exclude_modules_and_match_all_linear_select_exactly(model_path):
    model = _model(model_path)
    assert select_lora_modules(model, _settings(match_all_linear=True)) == [
        *_ordered(ALL_PROJ),
        "lm_head",
    ]
    excluded = select_lora_modules(
        model, _settings(exclude_modules=["q_proj", "k_proj", "lm_head"])
    )
    assert excluded == [n for n in _ordered(ALL_PROJ) if not n.endswith(("q_proj", "k_proj"))]
    with pytest.warns(UserWarning, match=r"using target_modules=\['\*_proj'\]"):
        assert select_lora_modules(model, _settings()) == _ordered(ALL_PROJ)


def _ordered(names: list[str]) -> list[str]:
    order = [
        f"{x}.{part}"
        for x in LAYERS
        for part in [*(f"self_attn.{p}" for p in ATTN), *(f"mlp.{p}" for p in MLP)]
    ]
    return [n for n in order if n in names]


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"target_modules": ["q_prj"]}, "lora_cfg.target_modules: 'q_prj' matches no linear layer"),
        (
            {"exclude_modules": ["*attn*", "mlpp"]},
            "lora_cfg.exclude_modules: 'mlpp' matches no linear",
        ),
        (
            {"target_modules": ["embed_tokens"]},
            "'embed_tokens' matches no linear layer of the model (it matches only non-linear "
            "modules ['model.embed_tokens'])",
        ),
        ({"exclude_modules": ["*"]}, "lora_cfg selects no linear layer of the model"),
    ],
)
def test_pattern_matching_nothing_is_a_config_error(model_path, cfg, message):
    with pytest.raises(ConfigError) as e:
        select_lora_modules(_model(model_path), _settings(**cfg))
    assert message in str(e.value)


def test_tied_output_head_gets_no_adapter():
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with pytest.warns(UserWarning, match="'lm_head' shares its weight with the input embedding"):
        names = select_lora_modules(model, _settings(match_all_linear=True))
    assert "lm_head" not in names and len(names) == 7
    with pytest.raises(ConfigError, match="selects 'lm_head', whose weight is tied"):
        select_lora_modules(model, _settings(target_modules=["lm_head", "q_proj"]))


# ----------------------------------------------------------------------------- training


def test_zero_b_gives_exactly_the_base_logprobs(model_path):
    base = _logits(_model(model_path))
    with pytest.warns(UserWarning, match="use_triton=True is ignored"):
        peft_model = apply_lora(
            _model(model_path), _settings(match_all_linear=True, use_triton=True)
        )
    layers = lora_layers(peft_model)
    assert len(layers) == 15
    assert all(torch.count_nonzero(m.lora_B["default"].weight) == 0 for m in layers.values())
    assert all(torch.count_nonzero(m.lora_A["default"].weight) > 0 for m in layers.values())
    assert torch.equal(_logits(peft_model.get_base_model()), base)


def test_only_adapters_are_trainable_and_change_in_a_step(model_path):
    peft_model = apply_lora(_model(model_path), _settings(match_all_linear=True))
    model = peft_model.get_base_model().train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if is_adapter_parameter(n)}
    assert len(trainable) == 30
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = model(**_tokens(), labels=_tokens()["input_ids"])
    out.loss.backward()
    opt.step()
    after = model.state_dict()
    for k, v in before.items():
        if is_adapter_parameter(k):
            continue
        assert torch.equal(after[k], v), k
    changed_b = [k for k in trainable if ".lora_B." in k and not torch.equal(after[k], before[k])]
    assert len(changed_b) == 15


def test_disabled_adapters_are_the_reference_policy(model_path):
    base = _logits(_model(model_path))
    peft_model = apply_lora(_model(model_path), _settings(match_all_linear=True))
    _randomise_b(peft_model)
    adapted = _logits(peft_model.get_base_model())
    assert not torch.allclose(adapted, base, atol=1e-3)
    with peft_model.disable_adapter():
        assert torch.equal(_logits(peft_model.get_base_model()), base)
    assert torch.equal(_logits(peft_model.get_base_model()), adapted)


class _OneLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x)


def test_alpha_over_dim_scaling_by_hand():
    torch.manual_seed(0)
    net = _OneLinear()
    w, b = net.proj.weight.detach().clone(), net.proj.bias.detach().clone()
    peft_model = apply_lora(net, _settings(target_modules=["proj"], dim=2, alpha=6))
    layer = lora_layers(peft_model)["proj"]
    a = torch.tensor([[1.0, 0.0, 2.0, -1.0], [0.5, 1.0, 0.0, 0.0]])
    bm = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0]])
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(bm)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # B @ A = [[1, 0, 2, -1], [1, 2, 0, 0], [-0.5, 1, -2, 1]]; B @ A @ x = [3, 5, -0.5]; scale 3.
    expected = x @ w.T + b + 3.0 * torch.tensor([[3.0, 5.0, -0.5]])
    with torch.no_grad():
        assert torch.allclose(peft_model.get_base_model()(x), expected, atol=1e-6)
    merged = merged_state_dict(peft_model)
    assert set(merged) == {"proj.weight", "proj.bias"}
    assert torch.allclose(merged["proj.weight"], w + 3.0 * (bm @ a), atol=1e-6)
    assert torch.equal(merged["proj.bias"], b)


def test_dropout_position_pre_and_post():
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    outs = {}
    for position in ("pre", "post"):
        torch.manual_seed(0)
        peft_model = apply_lora(
            _OneLinear(), _settings(target_modules=["proj"], dropout=0.5, dropout_position=position)
        )
        _randomise_b(peft_model)
        net = peft_model.get_base_model()
        layer = lora_layers(peft_model)["proj"]
        with torch.no_grad():
            net.eval()
            base = layer.base_layer(x)
            delta = layer.scaling["default"] * layer.lora_B["default"](layer.lora_A["default"](x))
            assert torch.allclose(net(x) - base, delta, atol=1e-6)
            net.train()
            torch.manual_seed(5)
            outs[position] = net(x) - base
        if position == "post":
            # Each output element keeps the whole adapter term (times 1/(1-p)) or none of it.
            kept = torch.isclose(outs["post"], 2 * delta, atol=1e-6)
            dropped = outs["post"].abs() < 1e-6
            assert bool((kept | dropped).all()) and 0 < int(kept.sum()) < kept.numel()
    assert not torch.allclose(outs["pre"], outs["post"], atol=1e-4)


def test_lora_a_init_xavier_normal_and_uniform():
    stats = {}
    for init in ("xavier", "uniform"):
        torch.manual_seed(0)
        net = torch.nn.Module()
        net.proj = torch.nn.Linear(256, 256)
        peft_model = apply_lora(net, _settings(target_modules=["proj"], dim=64, lora_A_init=init))
        a = lora_layers(peft_model)["proj"].lora_A["default"].weight.detach()
        stats[init] = (float(a.std()), float(a.abs().max()))
    bound = 1 / math.sqrt(256)  # Kaiming-uniform with a=sqrt(5)
    assert abs(stats["xavier"][0] - math.sqrt(2 / (256 + 64))) < 0.004
    assert stats["xavier"][1] > bound
    assert stats["uniform"][1] <= bound
    assert abs(stats["uniform"][0] - bound / math.sqrt(3)) < 0.002


# ----------------------------------------------------------------------------- refit


def test_merged_weights_give_the_adapted_logits(model_path):
    peft_model = apply_lora(_model(model_path), _settings(match_all_linear=True))
    _randomise_b(peft_model)
    adapted = _logits(peft_model.get_base_model())
    before = {k: v.clone() for k, v in peft_model.get_base_model().state_dict().items()}
    merged = merged_state_dict(peft_model)
    plain = _model(model_path)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    assert torch.allclose(_logits(plain), adapted, atol=1e-5)
    for k, v in peft_model.get_base_model().state_dict().items():
        assert torch.equal(v, before[k]), k
    # Sending only the factors and merging on the receiver gives the same weights.
    factors = adapter_factors(peft_model)
    assert len(factors) == 30 and factors["lm_head.weight.lora_A"].shape == (8, 64)
    again = merge_adapters(base_state_dict(peft_model), factors)
    assert all(torch.equal(again[k], merged[k]) for k in merged)
    with pytest.raises(KeyError, match="'nope.weight', which is not among the weights"):
        merge_adapters({}, {"nope.weight.lora_A": factors["lm_head.weight.lora_A"]})


# ----------------------------------------------------------------------------- checkpoints


def test_save_and_load_adapters_round_trip(model_path, tmp_path):
    from peft import PeftModel

    settings = _settings(target_modules=["q_proj", "v_proj"], dim=4, alpha=8)
    peft_model = apply_lora(_model(model_path), settings)
    _randomise_b(peft_model)
    adapted = _logits(peft_model.get_base_model())
    save_adapters(peft_model, str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()

    loaded = PeftModel.from_pretrained(_model(model_path), str(tmp_path / "adapters"))
    assert torch.equal(_logits(loaded.get_base_model()), adapted)

    torch.manual_seed(9)
    fresh = apply_lora(_model(model_path), settings)
    load_adapters(fresh, str(tmp_path / "adapters"))
    assert torch.equal(_logits(fresh.get_base_model()), adapted)

    other = apply_lora(_model(model_path), _settings(target_modules=["q_proj", "v_proj"], dim=8))
    with pytest.raises(
        ConfigError,
        match=r"\(dim=4, alpha=8, 4 layers\) do not fit this lora_cfg \(dim=8, alpha=32",
    ):
        load_adapters(other, str(tmp_path / "adapters"))


def _bf16_after_reference(rank: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from phalanx.llm.parallelize import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        peft_model = apply_lora(_model(model_path), _settings(match_all_linear=True))
        model = peft_model.get_base_model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), policy)
        ids = torch.randint(
            0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad(), disabled_adapters(peft_model):
            ref = model(input_ids=ids).logits.float()
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        torch.save(
            {
                "ref_finite": bool(torch.isfinite(ref).all()),
                "trainable": sorted(trainable),
                "grad_dtypes": {p.grad.dtype for p in trainable.values()},
                "frozen_grads": [
                    n
                    for n, p in model.named_parameters()
                    if not p.requires_grad and p.grad is not None
                ],
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def test_bf16_adapters_train_when_the_first_forward_is_the_reference_models(model_path, tmp_path):
    """GRPO's order: the reference log-probs (adapters disabled) come before any training.
    FSDP2 picks the dtype of reduced gradients at the model's first forward from the
    parameters that require grad; peft's ``disable_adapter()`` alone turns that off, and
    the first bf16 backward then fails assigning bf16 gradients to float32 adapters."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "out.pt")
    mp.spawn(_bf16_after_reference, args=(str(tmp_path / "pg"), model_path, out), nprocs=1)
    got = torch.load(out)
    assert got["ref_finite"]
    assert got["trainable"] and all(is_adapter_parameter(n) for n in got["trainable"])
    assert got["grad_dtypes"] == {torch.float32}
    assert got["frozen_grads"] == []


def _sharded_merge(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    faulthandler.enable()  # a native abort prints where each thread was
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        peft_model = apply_lora(_model(model_path), _settings(match_all_linear=True))
        _randomise_b(peft_model)
        model = peft_model.get_base_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        merged = merged_state_dict(peft_model)
        by_rows = [
            k
            for k in adapter_factors(peft_model)
            if k.endswith(".lora_A") and merged[k[: -len(".lora_A")]].placements == (Shard(0),)
        ]
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in merged.items()}
        if rank == 0:
            torch.save({"full": full, "by_rows": len(by_rows)}, out)
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_merge_of_fsdp2_sharded_adapters_per_rank_rows(model_path, tmp_path):
    """Two gloo ranks, FSDP2-sharded: each rank merges its own rows of every adapted
    weight; gathered, they equal the unsharded merge."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "merged.pt")
    mp.spawn(_sharded_merge, args=(2, str(tmp_path / "pg"), model_path, out), nprocs=2, join=True)
    got = torch.load(out)
    assert got["by_rows"] == 15
    peft_model = apply_lora(_model(model_path), _settings(match_all_linear=True))
    _randomise_b(peft_model)
    expected = merged_state_dict(peft_model)
    assert set(got["full"]) == set(expected)
    for k, v in expected.items():
        assert torch.allclose(got["full"][k], v, atol=1e-6), k
