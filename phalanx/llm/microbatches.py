"""How a policy rank cuts its shard of the data: global batches for optimizer steps and
micro-batches for forward passes, per the batching mode (``"plain"``, ``"dynamic"`` for
dynamic batching, ``"packed"`` for sequence packing). With dynamic batching or sequence
packing the micro-batches follow the plan ``BatchedDataDict.shard_by_batch_size`` left on
the data."""

from __future__ import annotations

from collections.abc import Iterator

from phalanx.data import BatchedDataDict


def micro_batches(batch: BatchedDataDict, mbs: int, mode: str, what: str) -> list[BatchedDataDict]:
    """This rank's micro-batches of one global batch, per the batching mode.

    Args:
        batch: one global batch (this rank's rows).
        mbs: rows per micro-batch in the plain mode.
        mode: ``"plain"``, ``"dynamic"`` or ``"packed"``.
        what: the calling method, for messages.

    Returns:
        The micro-batches.

    Raises:
        ValueError: ``mbs`` does not divide the batch, or the data carries no plan.
    """
    if mode == "plain":
        if batch.size % mbs:
            raise ValueError(
                f"{what}: mbs (train_micro_batch_size) {mbs} does not divide this rank's "
                f"global batch of {batch.size} rows"
            )
        return list(batch.make_microbatch_iterator(mbs)) if batch.size else []
    if batch.micro_batch_indices is None:
        option = "dynamic_batching" if mode == "dynamic" else "sequence_packing"
        raise ValueError(
            f"{what}: {option} is enabled but the data carries no micro-batch plan; shard "
            "it with BatchedDataDict.shard_by_batch_size(..., "
            f"{'dynamic_batching_args' if mode == 'dynamic' else 'sequence_packing_args'}"
            "=...) (Policy does this)"
        )
    if mode == "dynamic":
        return list(batch.make_microbatch_iterator_with_dynamic_shapes())
    return list(batch.make_microbatch_iterator_for_packable_sequences())


def global_batches(data: BatchedDataDict, local_gbs: int, mode: str) -> list[BatchedDataDict]:
    """This rank's global batches: those of the sharding plan, else runs of ``local_gbs`` rows.

    Args:
        data: this rank's shard.
        local_gbs: rows per global batch on this rank.
        mode: ``"plain"``, ``"dynamic"`` or ``"packed"``.

    Returns:
        The global batches.

    Raises:
        ValueError: ``local_gbs`` does not divide the shard, or the data carries no plan.
    """
    if data.elem_counts_per_gb is not None:  # sharded by shard_by_batch_size
        return [data.get_batch(g) for g in range(len(data.elem_counts_per_gb))]
    if mode != "plain":
        micro_batches(data, 1, mode, "train")  # raises: no plan
    if data.size % local_gbs:
        raise ValueError(
            f"train: this rank holds {data.size} rows, not a multiple of the per-rank "
            f"global batch {local_gbs}"
        )
    return [data.slice(s, s + local_gbs) for s in range(0, data.size, local_gbs)]


def logprob_micro_batches(
    data: BatchedDataDict, mbs: int | None, mode: str
) -> Iterator[tuple[int, BatchedDataDict]]:
    """(first row, micro-batch) pairs covering ``data`` in order, for log-prob inference.

    Args:
        data: this rank's shard.
        mbs: rows per micro-batch in the plain mode (all rows if None).
        mode: ``"plain"``, ``"dynamic"`` or ``"packed"``.

    Yields:
        ``(first row, micro-batch)``.

    Raises:
        ValueError: the data carries no plan (dynamic batching or sequence packing).
    """
    if mode == "plain":
        mbs = int(mbs or data.size or 1)
        for start in range(0, data.size, mbs):
            yield start, data.slice(start, min(start + mbs, data.size))
        return
    start = 0
    for mb in micro_batches(data, 1, mode, "get_logprobs"):
        yield start, mb
        start += mb.size
