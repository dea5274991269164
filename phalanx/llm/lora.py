"""LoRA adapters on the policy model, configured by NeMo-RL's ``dtensor_cfg.lora_cfg``.

Built on peft: adapters are injected into the plain Hugging Face model before any
parallelism is applied, the base weights are frozen, the reference policy is the same
model with its adapters disabled, and adapters are saved in peft's own format.

The keys and their meaning follow NeMo-RL's DTensor worker (which hands ``lora_cfg`` to
Automodel's ``PeftConfig``):

- ``match_all_linear``: every ``nn.Linear`` (the output head included);
- ``target_modules``: patterns, each matching a module whose last name part equals it or
  whose full dotted name it matches whole, ``*`` standing for any run of characters;
- ``exclude_modules``: every ``nn.Linear`` except those the patterns match;
- none of the three: ``target_modules=["*_proj"]`` (with a warning, as Automodel);
- ``alpha / dim`` scales ``B @ A``; ``dropout`` acts on the adapter's input (``"pre"``)
  or on its output (``"post"``); ``lora_A_init`` is ``"xavier"`` (normal) or
  ``"uniform"`` (Kaiming-uniform) and ``B`` starts at zero.

A pattern that matches no linear layer is a ``ConfigError``: a misspelt name would
otherwise train nothing. A tied output head (its weight is the input embedding) is left
out of ``match_all_linear``/``exclude_modules`` with a warning and refused when named in
``target_modules``: a merged head would differ from the embedding the generators share.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from phalanx._base.checks import check_int, check_number
from phalanx.llm.policy_config import ConfigError

ADAPTER = "default"  # peft's adapter name; phalanx trains one adapter
LORA_A_INITS = ("xavier", "uniform")
DROPOUT_POSITIONS = ("pre", "post")
DEFAULT_TARGETS = ("*_proj",)


@dataclass(frozen=True)
class LoraSettings:
    """A checked ``lora_cfg`` (see the module docstring for each key's meaning)."""

    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    match_all_linear: bool = False
    dim: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: str = "post"
    lora_A_init: str = "xavier"
    use_triton: bool = False

    @property
    def scale(self) -> float:
        """The factor of ``B @ A``: ``alpha / dim``."""
        return self.alpha / self.dim


LORA_KEYS = ("enabled", *LoraSettings.__dataclass_fields__)


def lora_settings(
    cfg: Mapping[str, Any] | None, where: str = "dtensor_cfg.lora_cfg"
) -> LoraSettings | None:
    """The checked settings of ``cfg``, or None when it is absent or not enabled.

    Every key is checked even when LoRA is off (a misspelt key is an error either way);
    a missing key takes Automodel's ``PeftConfig.from_dict`` default, as in NeMo-RL.
    """
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{where} must be a dict, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(LORA_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; NeMo-RL's LoRA keys are {list(LORA_KEYS)}"
        )
    flags = {k: cfg.get(k, False) for k in ("enabled", "match_all_linear", "use_triton")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{where}.{key} must be a bool, got {value!r}")
    targets = _patterns(cfg.get("target_modules"), f"{where}.target_modules")
    excludes = _patterns(cfg.get("exclude_modules"), f"{where}.exclude_modules")
    if targets and excludes:
        raise ConfigError(
            f"{where}.target_modules and {where}.exclude_modules are mutually exclusive "
            "(as in NeMo-RL); give only one"
        )
    if flags["match_all_linear"] and (targets or excludes):
        raise ConfigError(
            f"{where}.match_all_linear=True needs empty target_modules and exclude_modules "
            f"(as in NeMo-RL), got target_modules={list(targets)}, exclude_modules={list(excludes)}"
        )
    settings = LoraSettings(
        target_modules=targets,
        exclude_modules=excludes,
        match_all_linear=flags["match_all_linear"],
        dim=_checked(check_int, cfg.get("dim", 8), f"{where}.dim", minimum=1),
        alpha=_checked(check_number, cfg.get("alpha", 32), f"{where}.alpha", minimum=None),
        dropout=_checked(check_number, cfg.get("dropout", 0.0), f"{where}.dropout", minimum=None),
        dropout_position=_choice(cfg, "dropout_position", "post", DROPOUT_POSITIONS, where),
        lora_A_init=_choice(cfg, "lora_A_init", "xavier", LORA_A_INITS, where),
        use_triton=flags["use_triton"],
    )
    if settings.alpha <= 0:
        raise ConfigError(f"{where}.alpha must be > 0, got {settings.alpha:g}")
    if not 0 <= settings.dropout < 1:
        raise ConfigError(f"{where}.dropout must be in [0, 1), got {settings.dropout:g}")
    return settings if flags["enabled"] else None


def _checked(check: Any, value: Any, key: str, minimum: float | None) -> Any:
    try:
        return check(value, key, minimum=minimum)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _choice(
    cfg: Mapping[str, Any], key: str, default: str, allowed: tuple[str, ...], where: str
) -> str:
    value = cfg.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{where}.{key} must be one of {list(allowed)}, got {value!r}")
    return value


def _patterns(value: Any, key: str) -> tuple[str, ...]:
    """A list of module-name patterns (a single string or None accepted, as Automodel)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) and p for p in items):
        raise ConfigError(f"{key} must be a list of module names, got {value!r}")
    for p in items:
        try:
            _pattern_regex(p)
        except re.error as e:
            raise ConfigError(f"{key}: {p!r} is not a valid pattern ({e})") from None
    return tuple(items)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    # Automodel's wildcard rule: a "*" not already preceded by "." means ".*".
    return re.compile(re.sub(r"(?<!\.)\*", ".*", pattern))


def _matches(pattern: str, name: str) -> bool:
    return pattern == name.rpartition(".")[2] or _pattern_regex(pattern).fullmatch(name) is not None


# ----------------------------------------------------------------------------- selection


def select_lora_modules(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """The names of the linear layers ``settings`` puts adapters on (works on a model on
    the meta device, so the driver can check a config before any worker starts)."""
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    head = _tied_head(model)
    if settings.match_all_linear:
        chosen = list(linear)
    elif settings.exclude_modules:
        _require_matches(settings.exclude_modules, linear, model, "exclude_modules")
        chosen = [n for n in linear if not any(_matches(p, n) for p in settings.exclude_modules)]
    else:
        targets = settings.target_modules
        if not targets:
            warnings.warn(
                "lora_cfg: no target_modules, exclude_modules or match_all_linear; using "
                "target_modules=['*_proj'] (as NeMo-RL/Automodel)",
                stacklevel=2,
            )
            targets = DEFAULT_TARGETS
        _require_matches(targets, linear, model, "target_modules")
        chosen = [n for n in linear if any(_matches(p, n) for p in targets)]
        if head in chosen:
            raise ConfigError(
                f"lora_cfg.target_modules selects {head!r}, whose weight is tied to the input "
                "embedding: its merged weight could not reach the generators; leave it out"
            )
    if head in chosen:
        warnings.warn(
            f"lora_cfg: the output head {head!r} shares its weight with the input embedding; "
            "it gets no adapter",
            stacklevel=2,
        )
        chosen.remove(head)
    if not chosen:
        raise ConfigError("lora_cfg selects no linear layer of the model")
    return chosen


def check_lora_config(config: Mapping[str, Any], with_model: bool = True) -> LoraSettings | None:
    """The LoRA settings of a policy config (``dtensor_cfg.lora_cfg``), checked; with
    ``with_model``, its patterns are checked against the model's module names too (a model
    built on the meta device from its config: no weights are read)."""
    dcfg = config.get("dtensor_cfg") or {}
    settings = lora_settings(dcfg.get("lora_cfg"))
    if settings is not None and dcfg.get("tensor_parallel_size", 1) != 1:
        raise ConfigError(
            "dtensor_cfg.lora_cfg.enabled=True with tensor_parallel_size > 1: phalanx's tensor-"
            "parallel plans do not cover peft's LoRA layers yet; use tensor_parallel_size=1"
        )
    if settings is not None and with_model:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = AutoConfig.from_pretrained(
            config["model_name"], **(config.get("hf_config_overrides") or {})
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the workers warn, once each
            select_lora_modules(model, settings)
    return settings


def _require_matches(
    patterns: tuple[str, ...], linear: dict[str, torch.nn.Module], model: torch.nn.Module, key: str
) -> None:
    for p in patterns:
        if not any(_matches(p, n) for n in linear):
            others = [n for n, _ in model.named_modules() if n and _matches(p, n)]
            found = f" (it matches only non-linear modules {others[:4]})" if others else ""
            raise ConfigError(
                f"lora_cfg.{key}: {p!r} matches no linear layer of the model{found}; linear "
                f"layers are named like {sorted({n.rpartition('.')[2] for n in linear})}"
            )


def _tied_head(model: torch.nn.Module) -> str | None:
    """The module name of the output head when its weight is the input embedding's."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    out = get_out() if get_out else None
    emb = get_in() if get_in else None
    if out is None or emb is None or out.weight is not emb.weight:
        return None
    return next(n for n, m in model.named_modules() if m is out)


# ----------------------------------------------------------------------------- applying


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """Inject adapters into ``model`` in place and return the ``peft.PeftModel`` over it.

    ``PeftModel.get_base_model()`` is ``model`` itself, now holding peft's LoRA layers;
    only the adapter parameters require gradients. Call it before any parallelism.
    """
    from peft import LoraConfig, get_peft_model

    names = select_lora_modules(model, settings)
    if settings.use_triton:
        warnings.warn(
            "lora_cfg.use_triton=True is ignored: phalanx runs peft's PyTorch LoRA layers "
            "(there is no Triton LoRA kernel here)",
            stacklevel=2,
        )
    config = LoraConfig(
        r=settings.dim,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout if settings.dropout_position == "pre" else 0.0,
        target_modules=sorted(names),
        bias="none",
        init_lora_weights=True,  # Kaiming-uniform A, zero B: NeMo-RL's "uniform"
    )
    peft_model = get_peft_model(model, config)
    layers = lora_layers(peft_model)
    if sorted(layers) != sorted(names):
        raise RuntimeError(f"peft adapted {sorted(layers)}, expected {sorted(names)}")
    for layer in layers.values():
        if settings.lora_A_init == "xavier":
            with torch.no_grad():
                torch.nn.init.xavier_normal_(layer.lora_A[ADAPTER].weight)
        if settings.dropout > 0 and settings.dropout_position == "post":
            layer.lora_B[ADAPTER].register_forward_hook(_post_dropout(settings.dropout))
    return peft_model


@contextlib.contextmanager
def disabled_adapters(peft_model: Any) -> Iterator[None]:
    """peft's ``disable_adapter()`` (the base model's outputs), with the adapters still
    marked trainable inside the block.

    peft also turns the adapters' ``requires_grad`` off there. FSDP2 reads ``requires_grad``
    at its lazy initialisation (the model's first forward) to choose the dtype it casts
    reduced gradients to; if that forward is the reference model's, it would choose none,
    and with bf16 compute the first backward then fails assigning bf16 gradients to the
    float32 adapters.
    """
    with peft_model.disable_adapter():
        for name, p in peft_model.named_parameters():
            if is_adapter_parameter(name):
                p.requires_grad_(True)
        yield


def _post_dropout(p: float) -> Any:
    # Dropout is linear, so dropping B @ A x before peft scales it equals NeMo-RL's
    # dropout(scale * B @ A x).
    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(out, p=p, training=module.training)

    return hook


def lora_layers(peft_model: Any) -> dict[str, Any]:
    """The adapted layers of the base model, by module name (``model.layers.0...q_proj``)."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    return {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name of the adapted model is an adapter's (``lora_A``/``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


# ----------------------------------------------------------------------------- refit


def base_weight_name(name: str) -> str:
    """The base model's name of an adapted model's parameter (``.base_layer`` removed)."""
    return name.replace(".base_layer.", ".")


def base_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The base model's tensors under the base model's own names (no copies)."""
    state = peft_model.get_base_model().state_dict()
    return {base_weight_name(k): v for k, v in state.items() if not is_adapter_parameter(k)}


def _factors(peft_model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{adapted weight name: (A, B, alpha/dim)}`` (the parameters themselves, detached)."""
    out = {}
    for name, layer in lora_layers(peft_model).items():
        if layer.fan_in_fan_out:
            raise ConfigError(f"{name}: transposed (Conv1D) layers are not supported with LoRA")
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        out[f"{name}.weight"] = (a.detach(), b.detach(), float(layer.scaling[ADAPTER]))
    return out


def adapter_factors(peft_model: Any) -> dict[str, torch.Tensor]:
    """Each adapted weight's factors, full (gathered) tensors: ``"<weight>.lora_A"`` (A)
    and ``"<weight>.lora_B"`` (``alpha/dim * B``): the merged weight is ``W + lora_B @ lora_A``.

    A collective when the adapters are sharded (every rank calls it)."""
    out: dict[str, torch.Tensor] = {}
    for name, (a, b, scale) in _factors(peft_model).items():
        out[f"{name}.lora_A"] = _full(a)
        out[f"{name}.lora_B"] = _full(b) * scale
    return out


def merge_adapters(
    weights: Mapping[str, torch.Tensor], factors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``weights`` with ``lora_B @ lora_A`` added to each adapted weight, as new tensors;
    the inputs are not changed (the receiver's side of an adapters-only refit)."""
    out = dict(weights)
    for key, a in factors.items():
        if not key.endswith(".lora_A"):
            continue
        name = key[: -len(".lora_A")]
        if name not in out:
            raise KeyError(f"adapter factors for {name!r}, which is not among the weights")
        out[name] = merged_weight(out[name], a, factors[f"{name}.lora_B"], 1.0)
    return out


def merged_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The weights a generator needs: the base model's state dict, under its own names,
    with ``alpha/dim * B @ A`` added to each adapted weight; the model is not changed.

    Sharded weights stay sharded the same way (see ``merged_weight``); a collective when
    the model is sharded (every rank calls it, e.g. in a refit)."""
    out = base_state_dict(peft_model)
    for name, (a, b, scale) in _factors(peft_model).items():
        out[name] = merged_weight(out[name], a, b, scale)
    return out


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``w + scale * b @ a`` as a new tensor (computed in float32, in ``w``'s dtype).

    For a DTensor ``w`` split by rows (FSDP2's ``Shard(0)``) with ``b`` split alike, each
    rank merges its own rows (only the small ``a`` is gathered) and the result is a DTensor
    of the same layout; other layouts are gathered and merged whole.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(w, DTensor):
        by_rows = all(isinstance(p, Replicate) or p == Shard(0) for p in w.placements)
        if (
            by_rows
            and isinstance(b, DTensor)
            and (b.device_mesh, b.placements)
            == (
                w.device_mesh,
                w.placements,
            )
        ):
            rows = merged_weight(w.to_local(), _full(a), b.to_local(), scale)
            return DTensor.from_local(
                rows, w.device_mesh, w.placements, shape=w.shape, stride=w.stride(), run_check=False
            )
        w = w.full_tensor()
    a, b = _full(a).to(w.device), _full(b).to(w.device)
    return torch.addmm(w.float(), b.float(), a.float(), alpha=scale).to(w.dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- checkpoints


def save_adapters(peft_model: Any, path: str, write: bool = True) -> None:
    """Write the adapters in peft's format (``adapter_model.safetensors`` and
    ``adapter_config.json``; ``PeftModel.from_pretrained`` loads them).

    Sharded adapters are gathered first (a collective: every rank calls it); only ranks
    with ``write`` write the files."""
    state = {k: _full(v) for k, v in peft_model.state_dict().items() if is_adapter_parameter(k)}
    if write:
        peft_model.save_pretrained(path, state_dict=state)


def load_adapters(peft_model: Any, path: str) -> None:
    """Load adapters written by ``save_adapters`` into ``peft_model`` (same ``dim``,
    ``alpha`` and layers, else ``ConfigError``); sharded adapters take their own rows."""
    from peft import PeftConfig, load_peft_weights

    def shape(c: Any) -> str:
        return f"dim={c.r}, alpha={c.lora_alpha:g}, {len(c.target_modules)} layers"

    saved, ours = PeftConfig.from_pretrained(path), peft_model.peft_config[ADAPTER]
    if shape(saved) != shape(ours) or set(saved.target_modules) != set(ours.target_modules):
        raise ConfigError(
            f"adapters at {path!r} ({shape(saved)}) do not fit this lora_cfg ({shape(ours)})"
        )
    weights = load_peft_weights(path, device="cpu")
    params = {
        f"base_model.model.{n.replace(f'.{ADAPTER}.', '.')}": p
        for n, p in peft_model.get_base_model().named_parameters()
        if is_adapter_parameter(n)
    }
    if set(params) != set(weights):
        raise ConfigError(
            f"adapters at {path!r}: missing {sorted(set(params) - set(weights))[:4]}, "
            f"unexpected {sorted(set(weights) - set(params))[:4]}"
        )
    with torch.no_grad():
        for key, p in params.items():
            _copy_rows(p, weights[key])


def _copy_rows(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``p`` (a DTensor takes only its own part)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        part = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(part.to_local())
    else:
        p.copy_(full)
