"""Tests for phalanx.data.BatchedDataDict (pure Python, no Ray)."""

import pickle
import random

import numpy as np
import pytest
import torch

from phalanx.data import BatchedDataDict

DYN = "dynamic_batching_args"
PACK = "sequence_packing_args"


def _rows(d: BatchedDataDict) -> list:
    """The per-row ids in key 'i' as a plain list."""
    v = d["i"]
    return v.tolist() if isinstance(v, (torch.Tensor, np.ndarray)) else list(v)


def _same(a: BatchedDataDict, b: BatchedDataDict) -> bool:
    """Exact equality of keys, value types and contents."""
    if list(a) != list(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if type(x) is not type(y):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _seq_data(lengths: list[int], seq: int | None = None) -> BatchedDataDict:
    """A batch of right-padded token rows with lengths, row ids and a text column."""
    n = len(lengths)
    seq = seq if seq is not None else max(lengths)
    ids = torch.zeros(n, seq, dtype=torch.long)
    for r, length in enumerate(lengths):
        ids[r, :length] = torch.arange(1, length + 1) + 100 * r
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.tensor(lengths),
            "i": list(range(n)),
            "text": [f"s{r}" for r in range(n)],
        }
    )


def _dyn(max_tokens: int, rnd: int = 1) -> dict:
    return {
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "max_tokens_per_microbatch": max_tokens,
        "sequence_length_round": rnd,
    }


def _pack(capacity: int, algorithm: str = "first_fit_decreasing", **extra: int) -> dict:
    return {
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "max_tokens_per_microbatch": capacity,
        "algorithm": algorithm,
        **extra,
    }


# ----------------------------------------------------------------------------- from_batches


@pytest.mark.smoke
def test_from_batches_concatenates_and_pads_with_default_zero() -> None:
    a = {"ids": torch.tensor([[1, 2], [3, 4]]), "n": torch.tensor([2, 2]), "t": ["a", "b"]}
    b = {"ids": torch.tensor([[5, 6, 7]]), "n": torch.tensor([3]), "t": ["c"]}
    out = BatchedDataDict.from_batches([a, b])
    assert type(out) is BatchedDataDict
    assert list(out) == ["ids", "n", "t"]
    assert out["ids"].tolist() == [[1, 2, 0], [3, 4, 0], [5, 6, 7]]
    assert out["n"].tolist() == [2, 2, 3]
    assert out["t"] == ["a", "b", "c"]
    assert out.size == 3


def test_from_batches_per_key_pad_values_and_3d() -> None:
    a = {"ids": torch.ones(1, 2, dtype=torch.long), "lp": torch.ones(1, 1, 2)}
    b = {"ids": torch.ones(1, 3, dtype=torch.long), "lp": torch.ones(1, 2, 1)}
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": -100, "unused": 7})
    assert out["ids"].tolist() == [[1, 1, -100], [1, 1, 1]]
    assert out["ids"].dtype == torch.long
    assert out["lp"].shape == (2, 2, 2)
    assert out["lp"].tolist() == [[[1, 1], [0, 0]], [[1, 0], [1, 0]]]


def test_from_batches_numpy_and_tuples() -> None:
    a = {"x": np.array([[1], [2]]), "t": ("a", "b")}
    b = {"x": np.array([[3, 4]]), "t": ["c"]}
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"x": 9})
    assert isinstance(out["x"], np.ndarray)
    assert out["x"].tolist() == [[1, 9], [2, 9], [3, 4]]
    assert out["t"] == ["a", "b", "c"]


def test_from_batches_of_batched_data_dicts_keeps_subclass() -> None:
    class Mine(BatchedDataDict):
        pass

    out = Mine.from_batches([BatchedDataDict({"a": [1]}), BatchedDataDict({"a": [2]})])
    assert type(out) is Mine
    assert out["a"] == [1, 2]


@pytest.mark.parametrize(
    ("batches", "exc", "match"),
    [
        ({"a": [1]}, TypeError, "batches"),
        ([{"a": [1]}, [1]], TypeError, "batches"),
        ([{"a": [1]}, {"b": [1]}], ValueError, "batches"),
        # an empty batch may lack keys, but not bring keys the others do not have
        ([{"a": [1]}, {"a": [], "b": []}], ValueError, "batches\\[1\\]"),
        ([{"a": [1]}, {"a": torch.tensor([1])}], TypeError, "'a'"),
        ([{"a": torch.ones(1, 2)}, {"a": torch.ones(1)}], ValueError, "'a'"),
        ([{"a": torch.ones(1)}, {"a": np.ones(1)}], TypeError, "'a'"),
        ([{"a": "xy"}, {"a": "z"}], TypeError, "'a'"),
    ],
)
def test_from_batches_errors(batches: object, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        BatchedDataDict.from_batches(batches)  # type: ignore[arg-type]


def test_from_batches_accepts_empty_list_and_empty_batches_missing_keys() -> None:
    # NeMo-RL gathers the outputs of empty data-parallel shards this way.
    out = BatchedDataDict.from_batches([])
    assert type(out) is BatchedDataDict and dict(out) == {} and out.size == 0
    full = {"x": torch.tensor([[1, 2], [3, 4]]), "names": ["a", "b"]}
    empty_no_keys: dict = {}
    empty_some = {"x": torch.zeros((0, 5), dtype=torch.long)}
    out = BatchedDataDict.from_batches(
        [empty_no_keys, full, empty_some, {"x": torch.tensor([[5, 6, 7]]), "names": ["c"]}],
        pad_value_dict={"x": -1},
    )
    assert out["names"] == ["a", "b", "c"]
    # empty batches do not widen the padding (NeMo-RL pads the rows it gets)
    assert torch.equal(out["x"], torch.tensor([[1, 2, -1], [3, 4, -1], [5, 6, 7]]))
    # only empty batches: their keys, concatenated
    both_empty = BatchedDataDict.from_batches([{"x": torch.zeros(0, 2)}, {"x": torch.zeros(0, 3)}])
    assert both_empty["x"].shape == (0, 3)


def test_from_batches_names_keys_that_disagree_on_rows() -> None:
    with pytest.raises(ValueError, match=r"batches\[0\]: .*\{'a': 2, 'b': 3\}"):
        BatchedDataDict.from_batches([{"a": [1, 2], "b": [1, 2, 3]}])


def test_from_batches_different_keys_is_nemo_rl_key_error() -> None:
    full = {"ids": torch.tensor([[1, 2, 3]]), "experts": torch.ones(1, 3, 2)}
    with pytest.raises(KeyError, match="non-empty batches") as info:
        BatchedDataDict.from_batches([full, {"ids": torch.tensor([[4, 5, 6]])}])
    assert str(info.value) == (
        "Key 'experts' is missing from non-empty batches [1] (batches[0] has it); all "
        "non-empty batches need the same keys"
    )
    assert isinstance(info.value, ValueError)
    # a key missing only from an empty batch is kept
    empty = {"ids": torch.zeros((0, 0), dtype=torch.long)}
    out = BatchedDataDict.from_batches([empty, full])
    assert list(out) == ["ids", "experts"] and out["experts"].shape == (1, 3, 2)


def test_from_batches_sizes_a_batch_from_its_first_field() -> None:
    class Metadata:  # NeMo-RL never measures such a value
        def __len__(self) -> int:
            raise AssertionError("measured")

    batches = [
        {"tokens": torch.tensor([[1], [2]]), "metadata": Metadata()},
        {"tokens": torch.tensor([[3]]), "metadata": Metadata(), "extra": torch.tensor([1])},
    ]
    with pytest.raises(KeyError, match="'extra'"):
        BatchedDataDict.from_batches(batches)
    with pytest.raises(TypeError, match="'metadata'"):  # measured only to concatenate it
        BatchedDataDict.from_batches(batches[:1])


# ----------------------------------------------------------------------------- basics


def test_size_and_len_are_independent() -> None:
    d = BatchedDataDict({"a": torch.zeros(5, 2), "b": list(range(5)), "c": np.zeros(5)})
    assert d.size == 5
    assert len(d) == 3
    assert BatchedDataDict().size == 0


@pytest.mark.parametrize(
    ("value", "exc"),
    [
        (torch.zeros(3), ValueError),  # disagrees with 'a' (size 2)
        (torch.tensor(1.0), ValueError),  # 0-d: not batched
        (5, TypeError),
        ("ab", TypeError),
    ],
)
def test_size_errors(value: object, exc: type) -> None:
    d = BatchedDataDict({"a": [1, 2], "b": value})
    with pytest.raises(exc, match="'b'"):
        _ = d.size


def test_generic_subscription_and_repr() -> None:
    d = BatchedDataDict[dict]({"a": [1]})
    assert isinstance(d, BatchedDataDict)
    assert repr(d) == "BatchedDataDict({'a': [1]})"


def test_slice_returns_views_and_validates() -> None:
    d = BatchedDataDict({"x": torch.arange(6), "i": list(range(6))})
    s = d.slice(2, 5)
    assert type(s) is BatchedDataDict
    assert s["x"].tolist() == [2, 3, 4]
    assert s["i"] == [2, 3, 4]
    s["x"][0] = 99
    assert d["x"][2].item() == 99  # tensor slices are views
    assert d.slice(6, 6).size == 0
    with pytest.raises(ValueError, match="start"):
        d.slice(-1, 2)
    with pytest.raises(ValueError, match="end"):
        d.slice(3, 7)
    with pytest.raises(ValueError, match="end"):
        d.slice(3, 2)
    with pytest.raises(TypeError, match="start"):
        d.slice(1.0, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "indices", [[4, 0, 0, 2], torch.tensor([4, 0, 0, 2]), np.array([4, 0, 0, 2])]
)
def test_select_indices(indices: object) -> None:
    d = BatchedDataDict(
        {"x": torch.arange(5) * 10, "n": np.arange(5), "i": list(range(5)), "t": tuple("abcde")}
    )
    out = d.select_indices(indices)  # type: ignore[arg-type]
    assert out["x"].tolist() == [40, 0, 0, 20]
    assert out["n"].tolist() == [4, 0, 0, 2]
    assert out["i"] == [4, 0, 0, 2]
    assert out["t"] == ["e", "a", "a", "c"]
    out["x"][0] = -1
    assert d["x"][4].item() == 40  # new storage


def test_select_indices_errors() -> None:
    d = BatchedDataDict({"i": [0, 1, 2]})
    with pytest.raises(IndexError, match="indices"):
        d.select_indices([0, 3])
    with pytest.raises(IndexError, match="indices"):
        d.select_indices([-1])
    with pytest.raises(TypeError, match="indices"):
        d.select_indices(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="indices"):
        d.select_indices(torch.tensor([True, False, True]))
    with pytest.raises(TypeError, match="indices"):
        d.select_indices([0, 1.5])
    with pytest.raises(ValueError, match="indices"):
        d.select_indices(torch.tensor([[0]]))
    assert d.select_indices([])["i"] == []


def test_chunk() -> None:
    d = BatchedDataDict({"x": torch.arange(6), "i": list(range(6))})
    assert [d.chunk(r, 3)["i"] for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert d.chunk(1, 2)["x"].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="chunks"):
        d.chunk(0, 4)
    with pytest.raises(ValueError, match="chunks"):
        d.chunk(0, 0)
    with pytest.raises(ValueError, match="rank"):
        d.chunk(3, 3)


def test_repeat_interleave_deep_copies_list_items() -> None:
    d = BatchedDataDict(
        {"x": torch.tensor([[1], [2]]), "n": np.array([1, 2]), "m": [{"k": [1]}, {"k": [2]}]}
    )
    out = d.repeat_interleave(3)
    assert out["x"].tolist() == [[1], [1], [1], [2], [2], [2]]
    assert out["n"].tolist() == [1, 1, 1, 2, 2, 2]
    assert out["m"] == [{"k": [1]}] * 3 + [{"k": [2]}] * 3
    out["m"][0]["k"].append(9)
    assert out["m"][1] == {"k": [1]}
    assert d["m"][0] == {"k": [1]}
    with pytest.raises(ValueError, match="num_repeats"):
        d.repeat_interleave(0)


def test_to_copy_get_dict_and_pickle() -> None:
    d = BatchedDataDict({"x": torch.ones(2, 3), "i": [0, 1]})
    d.micro_batch_indices = [[[0, 2]]]
    d.micro_batch_lengths = [[3]]
    d.elem_counts_per_gb = [2]

    c = d.copy()
    assert type(c) is BatchedDataDict
    assert c is not d and c["x"] is d["x"]
    assert (
        c.micro_batch_indices == [[[0, 2]]] and c.micro_batch_indices is not d.micro_batch_indices
    )
    c["y"] = [5, 6]
    assert "y" not in d

    plain = d.get_dict()
    assert type(plain) is dict and plain == {"x": d["x"], "i": [0, 1]}

    back = pickle.loads(pickle.dumps(d))
    assert type(back) is BatchedDataDict
    assert _same(back, d)
    assert back.micro_batch_indices == [[[0, 2]]]
    assert back.micro_batch_lengths == [[3]]
    assert back.elem_counts_per_gb == [2]

    assert d.to("meta") is d
    assert d["x"].device.type == "meta"
    assert d["i"] == [0, 1]


def test_truncate_tensors() -> None:
    d = BatchedDataDict(
        {"a": torch.ones(2, 5), "b": torch.ones(2, 3), "c": torch.ones(2), "i": [1, 2]}
    )
    d.truncate_tensors(dim=1, truncated_len=4)
    assert d["a"].shape == (2, 4)
    assert d["b"].shape == (2, 3)
    assert d["c"].shape == (2,)


def test_make_microbatch_iterator() -> None:
    d = BatchedDataDict({"x": torch.arange(6), "i": list(range(6))})
    assert [mb["i"] for mb in d.make_microbatch_iterator(2)] == [[0, 1], [2, 3], [4, 5]]
    assert [mb["x"].tolist() for mb in d.make_microbatch_iterator(3)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="microbatch_size"):
        d.make_microbatch_iterator(4)
    with pytest.raises(ValueError, match="microbatch_size"):
        d.make_microbatch_iterator(0)


# ----------------------------------------------------------------------------- reorder_data


def test_reorder_data_moves_row_i_to_position_p_i() -> None:
    d = BatchedDataDict({"i": ["a", "b", "c", "d"], "x": torch.tensor([0, 1, 2, 3])})
    d.micro_batch_indices = [[[0, 4]]]
    d.reorder_data([2, 0, 3, 1])
    assert d["i"] == ["b", "d", "a", "c"]
    assert d["x"].tolist() == [1, 3, 0, 2]
    assert d.micro_batch_indices is None


def test_reorder_data_undoes_select_indices() -> None:
    d = _seq_data([3, 1, 4, 1, 5, 2])
    perm = [5, 2, 0, 4, 1, 3]
    shuffled = d.select_indices(perm)
    shuffled.reorder_data(torch.tensor(perm))
    assert _same(shuffled, d)


@pytest.mark.parametrize("perm", [[0, 1], [0, 0, 1], [0, 1, 3], [2, 1, 0, 0]])
def test_reorder_data_rejects_non_permutations(perm: list[int]) -> None:
    d = BatchedDataDict({"i": [0, 1, 2]})
    with pytest.raises((ValueError, IndexError), match="reorded_indices"):
        d.reorder_data(perm)
    assert d["i"] == [0, 1, 2]


# ----------------------------------------------------------------------------- plain sharding


@pytest.mark.smoke
def test_shard_whole_batch_and_by_global_batch() -> None:
    d = BatchedDataDict({"problem_id": [0, 0, 1, 1, 2, 2, 3, 3], "x": torch.arange(8)})
    shards = d.shard_by_batch_size(shards=2)
    assert [s["problem_id"] for s in shards] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    shards = d.shard_by_batch_size(shards=2, batch_size=4)
    assert [s["problem_id"] for s in shards] == [[0, 0, 2, 2], [1, 1, 3, 3]]
    assert [s["x"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [s.elem_counts_per_gb for s in shards] == [[2, 2], [2, 2]]
    assert all(type(s) is BatchedDataDict and s.micro_batch_indices is None for s in shards)
    assert [s["x"].tolist() for s in d.shard_by_batch_size(4, batch_size=8)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]


def test_shards_own_their_storage() -> None:
    d = BatchedDataDict({"x": torch.arange(100).reshape(10, 10)})
    shard = d.shard_by_batch_size(2)[1]
    assert shard["x"].untyped_storage().nbytes() == 5 * 10 * 8
    shard["x"][0, 0] = -1
    assert d["x"][5, 0].item() == 50


def test_shard_get_batch_walks_global_batches() -> None:
    d = BatchedDataDict({"i": list(range(8))})
    s1 = d.shard_by_batch_size(2, batch_size=4)[1]
    assert s1.get_batch(0)["i"] == [2, 3]
    assert s1.get_batch(1, batch_size=2)["i"] == [6, 7]
    assert s1.get_batch(1).elem_counts_per_gb == [2]
    with pytest.raises(IndexError, match="batch_idx"):
        s1.get_batch(2)
    with pytest.raises(ValueError, match="batch_size"):
        s1.get_batch(0, batch_size=3)
    plain = BatchedDataDict({"i": list(range(6))})
    assert plain.get_batch(2, batch_size=2)["i"] == [4, 5]
    with pytest.raises(ValueError, match="batch_size"):
        plain.get_batch(0)
    with pytest.raises(IndexError, match="batch_idx"):
        plain.get_batch(3, batch_size=2)


def test_uneven_shards_single_global_batch() -> None:
    d = BatchedDataDict({"i": [0, 1, 2, 3, 4], "x": torch.arange(5)})
    assert [s["i"] for s in d.shard_by_batch_size(2, allow_uneven_shards=True)] == [
        [0, 1, 2],
        [3, 4],
    ]
    four = d.shard_by_batch_size(4, allow_uneven_shards=True)
    assert [s["i"] for s in four] == [[0, 1], [2], [3], [4]]
    assert [s["x"].tolist() for s in four] == [[0, 1], [2], [3], [4]]
    seven = d.shard_by_batch_size(7, allow_uneven_shards=True)
    assert [s["i"] for s in seven] == [[0], [1], [2], [3], [4], [], []]
    assert seven[6]["x"].shape == (0,)
    # one global batch: concatenating the shards gives back the original order
    assert BatchedDataDict.from_batches(four)["i"] == [0, 1, 2, 3, 4]


def test_uneven_shards_rotate_extras_across_global_batches() -> None:
    d = BatchedDataDict({"i": list(range(10))})
    shards = d.shard_by_batch_size(2, batch_size=5, allow_uneven_shards=True)
    assert [s["i"] for s in shards] == [[0, 1, 2, 5, 6], [3, 4, 7, 8, 9]]
    assert [s.elem_counts_per_gb for s in shards] == [[3, 2], [2, 3]]
    partial = BatchedDataDict({"i": list(range(7))}).shard_by_batch_size(
        2, batch_size=4, allow_uneven_shards=True
    )
    assert [s["i"] for s in partial] == [[0, 1, 4, 5], [2, 3, 6]]
    assert [s.elem_counts_per_gb for s in partial] == [[2, 2], [2, 1]]


@pytest.mark.parametrize(("n", "shards", "bs"), [(11, 3, None), (13, 4, 5), (9, 4, 2), (3, 5, 1)])
def test_uneven_shards_differ_by_at_most_one(n: int, shards: int, bs: int | None) -> None:
    d = BatchedDataDict({"i": list(range(n))})
    out = d.shard_by_batch_size(shards, batch_size=bs, allow_uneven_shards=True)
    sizes = [s.size for s in out]
    assert len(out) == shards
    assert max(sizes) - min(sizes) <= 1
    assert sorted(i for s in out for i in s["i"]) == list(range(n))


def test_shard_empty_data() -> None:
    d = BatchedDataDict({"i": [], "x": torch.zeros(0, 3)})
    out = d.shard_by_batch_size(3)
    assert [s["i"] for s in out] == [[], [], []]
    assert [tuple(s["x"].shape) for s in out] == [(0, 3)] * 3
    out, perm = d.shard_by_batch_size(
        2, sequence_packing_args=_pack(4) | {"input_key": "x", "input_lengths_key": "i"}
    )
    assert perm == [] and [s.micro_batch_indices for s in out] == [[], []]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"shards": 3}, ValueError, "shards"),
        ({"shards": 2, "batch_size": 3}, ValueError, "batch_size"),
        ({"shards": 4, "batch_size": 2}, ValueError, "shards"),
        ({"shards": 0}, ValueError, "shards"),
        ({"shards": 2.0}, TypeError, "shards"),
        ({"shards": True}, TypeError, "shards"),
        ({"shards": 2, "batch_size": 0}, ValueError, "batch_size"),
        ({"shards": 2, "batch_size": "4"}, TypeError, "batch_size"),
        ({"shards": 2, DYN: _dyn(8), PACK: _pack(8)}, ValueError, DYN),
    ],
)
def test_shard_errors(kwargs: dict, exc: type, match: str) -> None:
    d = _seq_data([1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(exc, match=match):
        d.shard_by_batch_size(**kwargs)


def test_shard_rejects_inconsistent_batch() -> None:
    with pytest.raises(ValueError, match="disagree"):
        BatchedDataDict({"a": [1, 2], "b": [1]}).shard_by_batch_size(1)


def test_shard_errors_are_also_nemo_rl_assertion_errors() -> None:
    # NeMo-RL's tests catch AssertionError with these words; phalanx's callers ValueError.
    d = BatchedDataDict({"data": torch.arange(10)})
    with pytest.raises(AssertionError, match="Total batch size.*is not a multiple of batch_size"):
        d.shard_by_batch_size(shards=2, batch_size=3)
    d8 = BatchedDataDict({"data": torch.arange(8)})
    with pytest.raises(AssertionError, match="Batch size.*is not a multiple of shards"):
        d8.shard_by_batch_size(shards=3, batch_size=4)
    bad = BatchedDataDict({"a": torch.arange(4), "b": torch.arange(3)})
    with pytest.raises(AssertionError, match="Batch sizes are not the same across the rollout"):
        bad.shard_by_batch_size(shards=2, batch_size=2)
    s = _seq_data([1, 2])
    with pytest.raises(AssertionError, match=f"{DYN} and {PACK} cannot be passed together"):
        s.shard_by_batch_size(shards=1, **{DYN: _dyn(8), PACK: _pack(8)})


# ----------------------------------------------------------------------------- dynamic batching


@pytest.mark.smoke
def test_dynamic_batching_exact_plan() -> None:
    d = _seq_data([5, 1, 7, 3, 2, 8, 4, 6])
    shards, perm = d.shard_by_batch_size(2, dynamic_batching_args=_dyn(16, rnd=2))
    # sorted by length: rows 1 4 3 6 0 7 2 5, dealt round-robin to the two shards
    assert [s["i"] for s in shards] == [[1, 3, 0, 2], [4, 6, 7, 5]]
    assert perm == [1, 3, 0, 2, 4, 6, 7, 5]
    # padded max per position across shards: 2, 4, 6, 8 -> [2 rows x 4], [2 rows x 8]
    for s in shards:
        assert s.micro_batch_indices == [[[0, 2], [2, 4]]]
        assert s.micro_batch_lengths == [[4, 8]]
        assert s.elem_counts_per_gb == [4]
        assert s.get_microbatch_iterator_dynamic_shapes_len() == 2
    mbs = list(shards[0].make_microbatch_iterator_with_dynamic_shapes())
    assert [mb["i"] for mb in mbs] == [[1, 3], [0, 2]]
    assert [tuple(mb["input_ids"].shape) for mb in mbs] == [(2, 4), (2, 8)]
    assert mbs[0]["input_ids"].tolist() == [[101, 0, 0, 0], [301, 302, 303, 0]]
    assert mbs[0]["input_lengths"].tolist() == [1, 3]
    assert mbs[0]["text"] == ["s1", "s3"]


def test_dynamic_batching_round_trip_through_reorder_data() -> None:
    d = _seq_data([5, 1, 7, 3, 2, 8, 4, 6, 9, 2, 2, 5])
    shards, perm = d.shard_by_batch_size(3, dynamic_batching_args=_dyn(20, rnd=4))
    gathered = BatchedDataDict.from_batches(shards)
    assert _same(gathered, d.select_indices(perm))
    gathered.reorder_data(perm)
    assert _same(gathered, d)


def test_dynamic_batching_several_global_batches() -> None:
    d = _seq_data([5, 1, 7, 3, 2, 8, 4, 6])
    shards, perm = d.shard_by_batch_size(2, batch_size=4, dynamic_batching_args=_dyn(12, rnd=2))
    assert [s["i"] for s in shards] == [[1, 0, 4, 7], [3, 2, 6, 5]]
    assert perm == [1, 0, 4, 7, 3, 2, 6, 5]
    for s in shards:
        assert s.micro_batch_indices == [[[0, 1], [1, 2]], [[0, 1], [1, 2]]]
        assert s.micro_batch_lengths == [[4, 8], [4, 8]]
        assert s.elem_counts_per_gb == [2, 2]
    s0 = shards[0]
    assert s0.get_microbatch_iterator_dynamic_shapes_len() == 4
    all_mbs = list(s0.make_microbatch_iterator_with_dynamic_shapes())
    assert [(mb["i"], mb["input_ids"].shape[1]) for mb in all_mbs] == [
        ([1], 4),
        ([0], 8),
        ([4], 4),
        ([7], 8),
    ]
    gb1 = s0.get_batch(1)
    assert gb1["i"] == [4, 7]
    assert gb1.micro_batch_indices == [[[0, 1], [1, 2]]]
    assert [mb["i"] for mb in gb1.make_microbatch_iterator_with_dynamic_shapes()] == [[4], [7]]
    gathered = BatchedDataDict.from_batches(shards)
    gathered.reorder_data(perm)
    assert _same(gathered, d)


def test_dynamic_batching_caps_rounding_at_tensor_length() -> None:
    d = _seq_data([5, 3], seq=5)
    # rounding 5 up to 8 would need 16 tokens; capped at the tensor's 5 columns it fits in 10
    (s,), perm = d.shard_by_batch_size(1, dynamic_batching_args=_dyn(10, rnd=4))
    assert perm == [1, 0]
    assert s.micro_batch_indices == [[[0, 2]]]
    assert s.micro_batch_lengths == [[5]]


def test_dynamic_batching_uneven_shards_clamp_shared_boundaries() -> None:
    d = _seq_data([4, 1, 3, 2, 5])
    shards, perm = d.shard_by_batch_size(2, allow_uneven_shards=True, dynamic_batching_args=_dyn(6))
    assert [s["i"] for s in shards] == [[1, 2, 4], [3, 0]]
    assert perm == [1, 2, 4, 3, 0]
    # padded max per position: 2, 4, 5; 4*2 and 5*2 exceed 6, so one position per mb
    assert shards[0].micro_batch_indices == [[[0, 1], [1, 2], [2, 3]]]
    assert shards[1].micro_batch_indices == [[[0, 1], [1, 2], [2, 2]]]
    assert shards[0].micro_batch_lengths == [[2, 4, 5]]
    assert [mb.size for mb in shards[1].make_microbatch_iterator_with_dynamic_shapes()] == [1, 1, 0]


def test_dynamic_batching_respects_token_budget_random() -> None:
    rng = random.Random(0)
    for shards_n, bs, budget, rnd in [(2, 8, 32, 4), (3, 12, 40, 1), (4, 16, 64, 8)]:
        lengths = [rng.randint(1, 16) for _ in range(bs * 2)]
        d = _seq_data(lengths, seq=16)
        shards, perm = d.shard_by_batch_size(
            shards_n, batch_size=bs, dynamic_batching_args=_dyn(budget, rnd)
        )
        assert sorted(perm) == list(range(len(lengths)))
        for s in shards:
            for mb in s.make_microbatch_iterator_with_dynamic_shapes():
                width = mb["input_ids"].shape[1]
                assert width * mb.size <= budget
                assert all(n <= width for n in mb["input_lengths"].tolist())
                assert width % rnd == 0 or width == 16
                assert mb["input_lengths"].tolist() == sorted(mb["input_lengths"].tolist())
        for g in range(2):  # every shard runs the same number of micro-batches per global batch
            assert len({len(s.micro_batch_indices[g]) for s in shards}) == 1
        gathered = BatchedDataDict.from_batches(shards)
        gathered.reorder_data(perm)
        assert _same(gathered, d)


def test_dynamic_batching_errors() -> None:
    d = _seq_data([9, 2])
    with pytest.raises(ValueError, match=DYN):
        d.shard_by_batch_size(1, dynamic_batching_args=_dyn(8))
    with pytest.raises(ValueError, match="sequence_length_round"):
        d.shard_by_batch_size(1, dynamic_batching_args=_dyn(8) | {"sequence_length_round": 0})
    missing = _dyn(8)
    del missing["sequence_length_round"]
    with pytest.raises(ValueError, match=f"{DYN} is missing keys"):
        d.shard_by_batch_size(1, dynamic_batching_args=missing)
    with pytest.raises(ValueError, match=DYN):
        d.shard_by_batch_size(1, dynamic_batching_args=_dyn(8) | {"input_lengths_key": "nope"})
    with pytest.raises(TypeError, match=DYN):
        d.shard_by_batch_size(1, dynamic_batching_args=[1])  # type: ignore[arg-type]


def test_microbatch_iterators_need_a_plan() -> None:
    d = _seq_data([1, 2])
    with pytest.raises(ValueError, match="micro-batch plan"):
        d.get_microbatch_iterator_dynamic_shapes_len()
    with pytest.raises(ValueError, match="micro-batch plan"):
        d.make_microbatch_iterator_for_packable_sequences()
    d.micro_batch_indices = [[[0, 1]], [[0, 1]]]
    d.micro_batch_lengths = [[1], [2]]
    with pytest.raises(ValueError, match="elem_counts_per_gb"):
        d.make_microbatch_iterator_with_dynamic_shapes()


# ----------------------------------------------------------------------------- sequence packing


@pytest.mark.smoke
def test_packing_ffd_vs_mffd_exact() -> None:
    # capacity 30: MFFD puts two small items (6, 7) beside the large 16; FFD puts 9 there
    d = _seq_data([9, 16, 6, 7])
    (ffd,), perm_ffd = d.shard_by_batch_size(1, sequence_packing_args=_pack(30))
    # FFD takes sequences longest first (ties: higher index first), as NeMo-RL does
    assert ffd["i"] == [1, 0, 3, 2]
    assert perm_ffd == [1, 0, 3, 2]
    assert ffd.micro_batch_indices == [[[0, 2], [2, 4]]]
    assert ffd.micro_batch_lengths == [[25, 13]]
    (mffd,), perm = d.shard_by_batch_size(
        1, sequence_packing_args=_pack(30, "modified_first_fit_decreasing")
    )
    assert mffd["i"] == [1, 2, 3, 0]
    assert perm == [1, 2, 3, 0]
    assert mffd.micro_batch_indices == [[[0, 3], [3, 4]]]
    assert mffd.micro_batch_lengths == [[29, 9]]
    assert mffd.get_microbatch_iterator_for_packable_sequences_len() == (2, 29)
    mbs = list(mffd.make_microbatch_iterator_for_packable_sequences())
    assert [mb["i"] for mb in mbs] == [[1, 2, 3], [0]]
    assert mbs[0]["input_ids"].shape == (3, 16)  # packing does not truncate


def test_packing_deals_bin_b_to_shard_b_mod_shards_and_round_trips() -> None:
    d = _seq_data([5, 1, 7, 3, 2, 8, 4, 6])
    shards, perm = d.shard_by_batch_size(2, sequence_packing_args=_pack(10))
    # FFD bins in order: {8,2} {7,3} {6,4} {5,1}; bin b goes to shard b % 2 (NeMo-RL)
    assert [s["i"] for s in shards] == [[5, 4, 7, 6], [2, 3, 0, 1]]
    assert [s.micro_batch_indices for s in shards] == [[[[0, 2], [2, 4]]]] * 2
    assert [s.micro_batch_lengths for s in shards] == [[[10, 10]], [[10, 6]]]
    assert perm == [5, 4, 7, 6, 2, 3, 0, 1]
    gathered = BatchedDataDict.from_batches(shards)
    gathered.reorder_data(perm)
    assert _same(gathered, d)


def test_packing_pad_multiple() -> None:
    d = _seq_data([3, 3, 5])
    (s,), _ = d.shard_by_batch_size(
        1, sequence_packing_args=_pack(8, sequence_length_pad_multiple=4)
    )
    # padded lengths 4, 4, 8: three can't share, (8) and (4, 4)
    assert s["i"] == [2, 1, 0]
    assert s.micro_batch_lengths == [[8, 8]]
    assert s.micro_batch_indices == [[[0, 1], [1, 3]]]


def test_packing_moves_single_sequences_so_every_shard_has_work() -> None:
    # one FFD bin {3,2,1,0}; NeMo-RL's adjustment moves its last sequence to a new bin
    d = _seq_data([1, 1, 1, 1])
    shards, perm = d.shard_by_batch_size(2, sequence_packing_args=_pack(100))
    assert [s["i"] for s in shards] == [[3, 2, 1], [0]]
    assert [s.micro_batch_lengths for s in shards] == [[[3]], [[1]]]
    assert perm == [3, 2, 1, 0]
    # FFD bins {0} {1,3} {2}: three bins become four by moving 3 out of the fullest bin
    d = _seq_data([10, 9, 8, 1])
    shards, perm = d.shard_by_batch_size(2, sequence_packing_args=_pack(10))
    assert [s["i"] for s in shards] == [[0, 2], [1, 3]]
    assert [s.micro_batch_lengths for s in shards] == [[[10, 8]], [[9, 1]]]
    assert perm == [0, 2, 1, 3]
    # fewer sequences than shards: an empty bin (NeMo-RL raises) so the idle rank can join
    few = _seq_data([3])
    shards, perm = few.shard_by_batch_size(
        2, allow_uneven_shards=True, sequence_packing_args=_pack(100)
    )
    assert [s["i"] for s in shards] == [[0], []]
    assert shards[1].micro_batch_indices == [[[0, 0]]]
    assert shards[1].micro_batch_lengths == [[0]]
    assert perm == [0]


def test_packing_mffd_leftovers_and_microbatch_order() -> None:
    # capacity 10: bin {6} takes the two 1s in the greedy pass; the 5s become a leftover bin
    d = _seq_data([6, 1, 1, 5, 5])
    args = _pack(10, "modified_first_fit_decreasing")
    (s,), perm = d.shard_by_batch_size(1, sequence_packing_args=args)
    assert perm == [0, 1, 2, 3, 4] and s.micro_batch_lengths == [[8, 10]]
    (s,), perm = d.shard_by_batch_size(
        1, sequence_packing_args={**args, "microbatch_order": "largest_first"}
    )
    assert perm == [3, 4, 0, 1, 2] and s.micro_batch_lengths == [[10, 8]]
    assert s.micro_batch_indices == [[[0, 2], [2, 5]]]
    with pytest.raises(ValueError, match="microbatch_order.*'smallest'"):
        d.shard_by_batch_size(1, sequence_packing_args={**args, "microbatch_order": "smallest"})


def _nemo_packing(lengths: list[int], order: str | None, shards: int = 2, **kw: int) -> tuple:
    d = BatchedDataDict(
        {
            "input_ids": torch.ones((len(lengths), 100), dtype=torch.long),
            "sequence_lengths": torch.tensor(lengths),
            "problem_ids": torch.arange(len(lengths)),
        }
    )
    args = {
        "max_tokens_per_microbatch": 100,
        "input_key": "input_ids",
        "input_lengths_key": "sequence_lengths",
        "algorithm": "modified_first_fit_decreasing",
        "microbatch_order": order,
        "sequence_length_pad_multiple": 1,
    }
    shards_out, perm = d.shard_by_batch_size(shards, sequence_packing_args=args, **kw)
    return d, shards_out, perm


def test_packing_largest_first_keeps_each_shards_bins_as_nemo_rl() -> None:
    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    _, packer, _ = _nemo_packing(lengths, "packer")
    d, largest, perm = _nemo_packing(lengths, "largest_first")
    assert [s.micro_batch_lengths for s in packer] == [[[99, 96]], [[87, 46]]]
    assert [s.micro_batch_lengths for s in largest] == [[[99, 96]], [[87, 46]]]
    assert [s["problem_ids"].tolist() for s in largest] == [[3, 4, 2, 7, 1], [6, 5, 0]]
    assert perm == [3, 4, 2, 7, 1, 6, 5, 0]
    gathered = BatchedDataDict.from_batches(largest)
    gathered.reorder_data(perm)
    assert torch.equal(gathered["problem_ids"], d["problem_ids"])
    _, omitted, _ = _nemo_packing(lengths, None)  # NeMo-RL: omitted means "packer"
    assert [s.micro_batch_lengths for s in omitted] == [[[99, 96]], [[87, 46]]]


def test_packing_largest_first_orders_within_shard_and_global_batch() -> None:
    lengths = [46, 24, 55, 88, 11, 14, 73, 17, 31, 67, 19, 82, 12, 43, 58, 21]
    _, packer, _ = _nemo_packing(lengths, "packer", batch_size=8)
    d, largest, perm = _nemo_packing(lengths, "largest_first", batch_size=8)
    assert [s.micro_batch_lengths for s in packer] == [[[99, 96], [94, 98]], [[87, 46], [98, 43]]]
    assert [s.micro_batch_lengths for s in largest] == [
        [[99, 96], [98, 94]],
        [[87, 46], [98, 43]],
    ]
    assert [s["problem_ids"].tolist() for s in largest] == [
        [3, 4, 2, 7, 1, 14, 10, 15, 11, 12],
        [6, 5, 0, 9, 8, 13],
    ]
    assert [s.elem_counts_per_gb for s in largest] == [[5, 5], [3, 3]]
    gathered = BatchedDataDict.from_batches(largest)
    gathered.reorder_data(perm)
    assert torch.equal(gathered["problem_ids"], d["problem_ids"])
    # one global batch: equal bins keep the packer's order (a stable sort)
    _, one, _ = _nemo_packing(lengths, "largest_first")
    assert [s.micro_batch_lengths for s in one] == [[[100, 99, 94, 65]], [[98, 98, 96, 11]]]
    assert one[1]["problem_ids"].tolist() == [9, 8, 2, 13, 11, 5, 4]
    with pytest.raises(ValueError, match="microbatch_order"):
        _nemo_packing([4, 5], "unknown", shards=1)


def test_packers_match_nemo_rl_layouts() -> None:
    from phalanx.data.bin_packing import adjust_bin_count, pack

    # FFD, capacity 10
    assert pack([4, 8, 1, 4, 2, 1], 10, "first_fit_decreasing") == [[1, 4], [3, 0, 5, 2]]
    # MFFD, capacity 12: large 8 and 7; medium 5 joins 7; the two 3s do not both fit
    # beside 8, so the greedy pass adds one 3 and the 1; the other 3 is a leftover bin
    assert pack([7, 5, 8, 3, 3, 1], 12, "modified_first_fit_decreasing") == [[2, 3, 5], [0, 1], [4]]
    # the bin-count adjustment pops the last sequence of the bin holding the most
    assert adjust_bin_count([[0], [1, 2, 3], [4, 5]], min_bin_count=2, bin_count_multiple=2) == [
        [0],
        [1, 2],
        [4, 5],
        [3],
    ]
    with pytest.raises(ValueError, match="exceed the bin capacity"):
        pack([11], 10, "first_fit_decreasing")


@pytest.mark.parametrize("algorithm", ["first_fit_decreasing", "modified_first_fit_decreasing"])
def test_packing_invariants_random(algorithm: str) -> None:
    rng = random.Random(1)
    for shards_n, bs, cap in [(2, 16, 32), (3, 12, 20), (4, 32, 64)]:
        lengths = [rng.randint(1, min(cap, 24)) for _ in range(bs * 2)]
        d = _seq_data(lengths, seq=24)
        shards, perm = d.shard_by_batch_size(
            shards_n, batch_size=bs, sequence_packing_args=_pack(cap, algorithm)
        )
        assert sorted(perm) == list(range(len(lengths)))
        for g in range(2):
            assert len({len(s.micro_batch_indices[g]) for s in shards}) == 1
            rows_in_gb = [i for s in shards for i in s.get_batch(g)["i"]]
            assert sorted(rows_in_gb) == list(range(g * bs, (g + 1) * bs))
        for s in shards:
            assert sum(s.elem_counts_per_gb) == s.size
            for mb in s.make_microbatch_iterator_for_packable_sequences():
                assert sum(mb["input_lengths"].tolist()) <= cap
            planned = [n for gb in s.micro_batch_lengths for n in gb]
            actual = [
                sum(mb["input_lengths"].tolist())
                for mb in s.make_microbatch_iterator_for_packable_sequences()
            ]
            assert planned == actual
        gathered = BatchedDataDict.from_batches(shards)
        assert _same(gathered, d.select_indices(perm))
        gathered.reorder_data(perm)
        assert _same(gathered, d)


def test_packing_errors() -> None:
    d = _seq_data([9, 2])
    with pytest.raises(ValueError, match=PACK):
        d.shard_by_batch_size(1, sequence_packing_args=_pack(8))
    with pytest.raises(ValueError, match="algorithm"):
        d.shard_by_batch_size(1, sequence_packing_args=_pack(16, "best_fit"))
    with pytest.raises(ValueError, match=f"{PACK} is missing keys"):
        d.shard_by_batch_size(1, sequence_packing_args={"input_key": "input_ids"})  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        d.shard_by_batch_size(1, sequence_packing_args=_pack(0))
