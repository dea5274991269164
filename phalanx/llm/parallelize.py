"""Tensor, sequence and data parallelism of a Hugging Face decoder, as plain functions.

torchtitan's recipe on a plain ``from_pretrained`` model: ``apply_tp`` first (DTensor
``parallelize_module`` over the "tp" mesh), then ``apply_fsdp`` (FSDP2 ``fully_shard``
per decoder layer and the root over the "dp" mesh). Every parameter ends up a DTensor on
the same 2-D ("dp", "tp") mesh, so that gradient clipping, the optimizer and distributed
checkpoints see one kind of tensor.

Tensor parallelism shards attention q/k/v (columns, i.e. heads) and o (rows), and the MLP
gate/up (columns) and down (rows) projections; the rest (embeddings, norms, lm_head) is
replicated over the tp ranks. With ``sequence_parallel`` the norms and residual adds of
each decoder layer run on a sequence shard: o and down reduce-scatter onto the sequence
dimension instead of all-reducing, and the hidden state is all-gathered before attention,
before the MLP and at the end of the layer (so the model code between layers sees whole
sequences, which keeps HF's masks and rotary positions unchanged).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from phalanx.llm.policy_config import ConfigError, import_object, positive_int


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the ModuleList with num_hidden_layers entries."""
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def compile_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (``dtensor_cfg.compile``).

    A layer's elementwise work (norms, rotary embedding, activations, residuals) then runs
    in fused kernels. The layers share one compiled graph per shape class and grad mode
    (their code is the same; the weights are the graph's inputs), so a model compiles once
    whatever its depth. Applied before sharding, as FSDP2's per-layer hooks run outside
    the compiled code; names and state dicts are unchanged (``Module.compile``).
    """
    for layer in decoder_layers(model):
        layer.compile()


def check_tp_size(config: Any, tp: int) -> None:
    """Raise naming the value when ``tp`` does not divide the model's head counts."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None)
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("intermediate_size", inter),
    ):
        if value is not None and value % tp:
            raise ConfigError(
                f"dtensor_cfg.tensor_parallel_size={tp} does not divide the model's {name}={value}"
            )


def check_parallel_config(config: dict[str, Any]) -> tuple[int, int]:
    """Check ``dtensor_cfg``'s parallel sizes against the model; returns (tp, cp).

    Runs on the driver (``Policy``) before any worker starts, and again in each worker.
    """
    dcfg = config.get("dtensor_cfg") or {}
    tp = positive_int(dcfg.get("tensor_parallel_size", 1), "dtensor_cfg.tensor_parallel_size")
    cp = positive_int(dcfg.get("context_parallel_size", 1), "dtensor_cfg.context_parallel_size")
    if dcfg.get("sequence_parallel") and tp == 1:
        # NeMo-RL warns and goes on; sequence parallelism only exists over tp ranks.
        warnings.warn(
            "dtensor_cfg.sequence_parallel=True has no effect with tensor_parallel_size=1 "
            "(it shards the norms over the tensor-parallel ranks)",
            stacklevel=2,
        )
    if cp > 1 and not torch.cuda.is_available():
        raise NotImplementedError(
            f"dtensor_cfg.context_parallel_size={cp}: context parallelism needs CUDA (torch's "
            "context_parallel runs ring attention on the flash/efficient SDPA kernels, which "
            "exist only on GPU); use context_parallel_size=1 on CPU"
        )
    if tp > 1:
        from transformers import AutoConfig

        check_tp_size(AutoConfig.from_pretrained(config["model_name"]), tp)
    return tp, cp


class _Replicated(ParallelStyle):
    """Parameters replicated over the tp mesh; plain tensors in and out of the module."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def to_dtensor(_m: Any, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(_m: Any, out: Any, _mesh: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, None, to_dtensor, to_local)


def _layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    attn, mlp = "self_attn", "mlp"
    if not sequence_parallel:
        return {
            "input_layernorm": _Replicated(),
            "post_attention_layernorm": _Replicated(),
            f"{attn}.q_proj": ColwiseParallel(),
            f"{attn}.k_proj": ColwiseParallel(),
            f"{attn}.v_proj": ColwiseParallel(),
            f"{attn}.o_proj": RowwiseParallel(),
            f"{mlp}.gate_proj": ColwiseParallel(),
            f"{mlp}.up_proj": ColwiseParallel(),
            f"{mlp}.down_proj": RowwiseParallel(),
        }
    seq = Shard(1)
    return {
        # The layer's input (whole sequences) is split locally, without communication.
        "": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(seq,),
            use_local_output=True,
        ),
        "input_layernorm": SequenceParallel(),
        attn: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        f"{attn}.q_proj": ColwiseParallel(),
        f"{attn}.k_proj": ColwiseParallel(),
        f"{attn}.v_proj": ColwiseParallel(),
        f"{attn}.o_proj": RowwiseParallel(output_layouts=seq),
        "post_attention_layernorm": SequenceParallel(),
        mlp: PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        f"{mlp}.gate_proj": ColwiseParallel(),
        f"{mlp}.up_proj": ColwiseParallel(),
        f"{mlp}.down_proj": RowwiseParallel(output_layouts=seq),
    }


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``model`` (a Llama-style HF decoder) over ``tp_mesh`` in place."""
    check_tp_size(model.config, tp_mesh.size())
    layer_plan = _layer_plan(sequence_parallel)
    for layer in decoder_layers(model):
        missing = [k for k in layer_plan if k and layer.get_submodule(k) is None]
        if missing:  # pragma: no cover - get_submodule raises first
            raise ValueError(f"tensor parallelism: decoder layer has no {missing}")
        if sequence_parallel:
            # The layer's output goes back to whole sequences for the model code.
            parallelize_module(layer, tp_mesh, {k: v for k, v in layer_plan.items() if k})
            parallelize_module(layer, tp_mesh, layer_plan[""])
            parallelize_module(
                layer,
                tp_mesh,
                PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
            )
        else:
            parallelize_module(layer, tp_mesh, layer_plan)
    # Everything outside the decoder layers is replicated over tp (tied weights kept tied).
    tied = _tied_output_embedding(model)
    layer_ids = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    _replicate_rest(model, tp_mesh, layer_ids)
    if tied is not None:
        out, emb = tied
        out.weight = emb.weight


def _replicate_rest(model: torch.nn.Module, tp_mesh: DeviceMesh, skip: set[int]) -> None:
    """Replicate over tp every module whose own parameters are not DTensors yet."""
    for module in list(model.modules()):
        own = [p for p in module.parameters(recurse=False) if id(p) not in skip]
        if own and not any(isinstance(p, DTensor) for p in own):
            parallelize_module(module, tp_mesh, _Replicated())


def load_parallel_plan(plan: dict[str, Any] | str) -> dict[str, ParallelStyle]:
    """A tensor-parallel plan: a dict of module name (``*`` wildcards allowed) ->
    ``ParallelStyle``, or a dotted path to such a dict or to a function returning one
    (NeMo-RL's ``dtensor_cfg.custom_parallel_plan``)."""
    obj: Any = plan
    if isinstance(plan, str):
        obj = import_object(plan, "dtensor_cfg.custom_parallel_plan")
        if callable(obj) and not isinstance(obj, dict):
            obj = obj()
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in obj.items()
    ):
        raise ValueError(
            f"dtensor_cfg.custom_parallel_plan {plan!r} must be (or name, or return) a dict of "
            f"module name -> torch ParallelStyle, got {type(obj).__name__}"
        )
    return obj


def apply_custom_plan(
    model: torch.nn.Module, tp_mesh: DeviceMesh, plan: dict[str, Any] | str
) -> None:
    """Shard ``model`` over ``tp_mesh`` with a user's plan (whole-model module names);
    modules the plan leaves out are replicated, and tied embeddings stay tied."""
    styles = load_parallel_plan(plan)
    check_tp_size(model.config, tp_mesh.size())
    tied = _tied_output_embedding(model)
    parallelize_module(model, tp_mesh, styles)
    _replicate_rest(model, tp_mesh, set())
    if tied is not None:
        out, emb = tied
        out.weight = emb.weight


def _tied_output_embedding(model: torch.nn.Module) -> tuple[Any, Any] | None:
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and emb is not None and out.weight is emb.weight:
        return out, emb
    return None


def apply_fsdp(
    model: torch.nn.Module, dp_mesh: DeviceMesh, mp_policy: Any, offload_policy: Any = None
) -> None:
    """FSDP2: ``fully_shard`` every decoder layer, then the root, over ``dp_mesh``."""
    from torch.distributed.fsdp import fully_shard

    kw: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True, **kw)
    # The root too frees its gathered weights after forward, so that state_dict() always
    # exposes the sharded parameters that in-place swaps (reference, refit) write to.
    # ``fsdp_state.gathered_for_step`` relies on every module resharding after forward
    # outside it.
    fully_shard(model, reshard_after_forward=True, **kw)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Total gradient norm over all ranks (clipped to ``max_norm`` when given), on CPU.

    Gradients are grouped by device mesh so that DTensors of different meshes (or plain
    tensors) never meet in one foreach kernel.
    """
    from torch.nn.utils import get_total_norm

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    norms = []
    for group in groups.values():
        n = get_total_norm([p.grad for p in group], foreach=True)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms]))
    coef = float(max_norm) / (float(total) + 1e-6) if max_norm else 1.0
    if coef < 1.0:
        for group in groups.values():
            torch._foreach_mul_([p.grad for p in group], coef)
    return total


def create_context_parallel_ctx(
    cp_mesh: Any,
    cp_buffers: list[torch.Tensor],
    cp_seq_dims: list[int],
    cp_no_restore_buffers: set[torch.Tensor],
    cp_rotate_method: str | None = None,
) -> Any:
    """torch's context-parallel context that shards ``cp_buffers`` along their seq dims.

    Args:
        cp_mesh: the context-parallel device mesh.
        cp_buffers: the tensors to shard.
        cp_seq_dims: each buffer's sequence dimension.
        cp_no_restore_buffers: buffers not restored on exit.
        cp_rotate_method: the ring attention's rotate method (torch's default if None).

    Returns:
        The context manager.
    """
    from torch.distributed.tensor.experimental import context_parallel

    if cp_rotate_method is not None:
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(cp_rotate_method)
    return context_parallel(
        cp_mesh,
        buffers=cp_buffers,
        buffer_seq_dims=cp_seq_dims,
        no_restore_buffers=cp_no_restore_buffers,
    )


CP_ATTENTION = "phalanx_cp_sdpa"


def _cp_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention, but with grouped-query heads repeated before the call when
    there is no mask. Without a mask HF passes ``enable_gqa`` instead, and neither fused
    kernel (the only ones ring attention runs on) takes q and kv of different head counts:
    an fp32 GQA model under context parallelism found "No available kernel" on an H100."""
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # as HF's repeat_kv: query head j reads kv head j // groups
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=causal and query.shape[2] > 1
    )
    return out.transpose(1, 2).contiguous(), None


def use_cp_attention(model: torch.nn.Module) -> None:
    """Give ``model`` the attention context parallelism can run (:func:`_cp_sdpa`, with
    SDPA's masks); equal to ``"sdpa"`` everywhere else."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CP_ATTENTION, _cp_sdpa)
    AttentionMaskInterface.register(CP_ATTENTION, sdpa_mask)
    model.set_attn_implementation(CP_ATTENTION)


@contextlib.contextmanager
def _restores_sdpa(cp_context: Any) -> Generator[None, None, None]:
    """``cp_context``, with SDPA restored when the body raises: torch 2.11's context leaves
    its ring-attention patch on ``F.scaled_dot_product_attention`` after an exception
    (2.13's restores it), and every later forward in the process then failed on an H100."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        with cp_context:
            yield
    finally:
        if torch.nn.functional.scaled_dot_product_attention is not sdpa:
            from torch.distributed.tensor.experimental._context_parallel._attention import (
                _disable_context_parallel_dispatcher_impl,
            )

            _disable_context_parallel_dispatcher_impl()


@contextlib.contextmanager
def train_context(cp_context: Any | None = None) -> Generator[None, None, None]:
    """Enter ``cp_context`` (with the SDPA kernels context parallelism supports).

    Args:
        cp_context: a context from ``create_context_parallel_ctx``, or None.

    Yields:
        Nothing; the block runs inside the context.
    """
    with contextlib.ExitStack() as stack:
        if cp_context is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(
                sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
            )
            stack.enter_context(_restores_sdpa(cp_context))
        yield
