"""Tests for phalanx.sharding.NamedSharding (pure Python, no Ray)."""

import pickle

import numpy as np
import pytest

from phalanx.group.sharding import NamedSharding

# dp=2, pp=2, tp=3 with a non-trivial rank order
LAYOUT_3D = [
    [[0, 1, 2], [3, 4, 5]],
    [[6, 7, 8], [9, 10, 11]],
]


@pytest.fixture
def s3() -> NamedSharding:
    return NamedSharding(LAYOUT_3D, ["dp", "pp", "tp"])


@pytest.mark.smoke
def test_properties(s3: NamedSharding) -> None:
    assert s3.names == ["dp", "pp", "tp"]
    assert s3.ndim == 3
    assert s3.size == 12
    assert s3.shape == {"dp": 2, "pp": 2, "tp": 3}
    assert isinstance(s3.layout, np.ndarray)
    assert s3.layout.tolist() == LAYOUT_3D
    assert [s3.get_axis_size(n) for n in ("dp", "pp", "tp")] == [2, 2, 3]
    assert [s3.get_axis_index(n) for n in ("dp", "pp", "tp")] == [0, 1, 2]


def test_returned_containers_do_not_alias_state(s3: NamedSharding) -> None:
    s3.names.append("x")
    s3.shape["dp"] = 99
    s3.get_worker_coords(4)["dp"] = 7
    assert s3.names == ["dp", "pp", "tp"]
    assert s3.shape["dp"] == 2
    assert s3.get_worker_coords(4) == {"dp": 0, "pp": 1, "tp": 1}
    with pytest.raises(ValueError):
        s3.layout[0, 0, 0] = 5  # read-only


def test_get_worker_coords_every_rank(s3: NamedSharding) -> None:
    for dp in range(2):
        for pp in range(2):
            for tp in range(3):
                rank = LAYOUT_3D[dp][pp][tp]
                assert s3.get_worker_coords(rank) == {"dp": dp, "pp": pp, "tp": tp}


def test_get_worker_coords_permuted_layout() -> None:
    s = NamedSharding(np.array([[3, 0], [2, 1]]), ["dp", "tp"])
    assert s.get_worker_coords(0) == {"dp": 0, "tp": 1}
    assert s.get_worker_coords(1) == {"dp": 1, "tp": 1}
    assert s.get_worker_coords(2) == {"dp": 1, "tp": 0}
    assert s.get_worker_coords(3) == {"dp": 0, "tp": 0}
    assert s.get_worker_coords(np.int64(2)) == {"dp": 1, "tp": 0}


@pytest.mark.parametrize("rank", [-1, 12, 100])
def test_get_worker_coords_out_of_range(s3: NamedSharding, rank: int) -> None:
    with pytest.raises(ValueError, match="rank"):
        s3.get_worker_coords(rank)


@pytest.mark.parametrize("rank", [1.0, "1", True, None])
def test_get_worker_coords_wrong_type(s3: NamedSharding, rank: object) -> None:
    with pytest.raises(TypeError, match="rank"):
        s3.get_worker_coords(rank)  # type: ignore[arg-type]


def test_get_ranks_partial_returns_named_sharding(s3: NamedSharding) -> None:
    # NeMo-RL: a partial index gives the sub-sharding over the axes left, in layout order.
    sub = s3.get_ranks(dp=1)
    assert isinstance(sub, NamedSharding)
    assert sub == NamedSharding([[6, 7, 8], [9, 10, 11]], ["pp", "tp"])
    assert sub.shape == {"pp": 2, "tp": 3}
    assert sub.get_worker_coords(10) == {"pp": 1, "tp": 1}
    assert s3.get_ranks(pp=1) == NamedSharding([[3, 4, 5], [9, 10, 11]], ["dp", "tp"])
    assert s3.get_ranks(tp=2) == NamedSharding([[2, 5], [8, 11]], ["dp", "pp"])
    assert s3.get_ranks(dp=0, tp=1) == NamedSharding([1, 4], ["pp"])
    assert s3.get_ranks(dp=0, tp=1).names == ["pp"]
    # chained: fixing the remaining axes of a sub-sharding reaches a single rank
    assert sub.get_ranks(pp=0).get_ranks(tp=2) == 8
    full = s3.get_ranks(dp=1, pp=0, tp=2)
    assert full == 8
    assert type(full) is int
    everything = s3.get_ranks()
    assert everything == s3 and everything is not s3


def test_nemo_rl_get_ranks_examples() -> None:
    s = NamedSharding([[[0, 1, 2, 3], [4, 5, 6, 7]]], ["dp", "pp", "tp"])
    assert s.get_ranks(dp=0) == NamedSharding(np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), ["pp", "tp"])
    assert s.get_ranks(dp=0, pp=1) == NamedSharding(np.array([4, 5, 6, 7]), ["tp"])
    assert s.get_ranks(dp=0, tp=2) == NamedSharding(np.array([2, 6]), ["pp"])
    assert s.get_ranks(dp=0, pp=0, tp=2) == 2
    with pytest.raises(IndexError, match="Index 2 is out of bounds for axis 'pp'"):
        s.get_ranks(pp=2)
    with pytest.raises(ValueError, match="Invalid axis name: 'xx'"):
        s.get_ranks(xx=0)


def test_get_ranks_unknown_axis_names_it(s3: NamedSharding) -> None:
    with pytest.raises(ValueError, match="'cp'"):
        s3.get_ranks(cp=0)
    with pytest.raises(ValueError, match="'cp'"):
        s3.get_ranks_by_coord(dp=0, cp=0)


@pytest.mark.parametrize("coord", [2, -1])
def test_get_ranks_out_of_range(s3: NamedSharding, coord: int) -> None:
    with pytest.raises(IndexError, match="dp"):
        s3.get_ranks(dp=coord)


def test_get_ranks_wrong_type(s3: NamedSharding) -> None:
    with pytest.raises(TypeError, match="dp"):
        s3.get_ranks(dp=0.0)  # type: ignore[arg-type]


def test_get_ranks_by_coord(s3: NamedSharding) -> None:
    assert s3.get_ranks_by_coord(dp=1) == [6, 7, 8, 9, 10, 11]
    assert s3.get_ranks_by_coord(tp=0) == [0, 3, 6, 9]
    assert s3.get_ranks_by_coord(pp=0, tp=0) == [0, 6]
    assert s3.get_ranks_by_coord(dp=0, pp=1, tp=2) == [5]
    assert s3.get_ranks_by_coord() == list(range(12))
    assert s3.get_ranks_by_coord(dp=5) == []  # NeMo-RL: out-of-range coordinate matches nothing
    assert all(type(r) is int for r in s3.get_ranks_by_coord(dp=0))


def test_get_ranks_by_coord_is_sorted_for_permuted_layout() -> None:
    s = NamedSharding([[5, 2, 4], [0, 3, 1]], ["dp", "tp"])
    assert s.get_ranks_by_coord(dp=0) == [2, 4, 5]
    assert s.get_ranks(dp=0).layout.tolist() == [5, 2, 4]  # layout order kept by get_ranks


def test_axis_lookup_errors(s3: NamedSharding) -> None:
    with pytest.raises(ValueError, match="'ep'"):
        s3.get_axis_index("ep")
    with pytest.raises(ValueError, match="'ep'"):
        s3.get_axis_size("ep")


def test_default() -> None:
    s = NamedSharding.default(4)
    assert s.names == ["dp"]
    assert s.layout.tolist() == [0, 1, 2, 3]
    assert s.shape == {"dp": 4}
    assert s.get_worker_coords(3) == {"dp": 3}
    assert s.get_ranks(dp=2) == 2
    assert s == NamedSharding([0, 1, 2, 3], ["dp"])
    with pytest.raises(ValueError, match="n"):
        NamedSharding.default(0)
    with pytest.raises(TypeError, match="n"):
        NamedSharding.default(2.0)  # type: ignore[arg-type]


def test_eq_hash_repr_pickle(s3: NamedSharding) -> None:
    same = NamedSharding(np.array(LAYOUT_3D), ("dp", "pp", "tp"))
    assert s3 == same
    assert hash(s3) == hash(same)
    assert s3 != NamedSharding(LAYOUT_3D, ["a", "pp", "tp"])
    assert s3 != NamedSharding(np.arange(12).reshape(2, 2, 3)[::-1].copy(), ["dp", "pp", "tp"])
    assert s3 != "not a sharding"
    text = repr(NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]))
    assert text.startswith("NamedSharding(shape=(2, 2), names=['dp', 'tp'], layout=[[0 1]")
    restored = pickle.loads(pickle.dumps(s3))
    assert restored == s3
    assert restored.get_worker_coords(10) == {"dp": 1, "pp": 1, "tp": 1}
    assert not restored.layout.flags.writeable


@pytest.mark.parametrize(
    ("layout", "names", "match"),
    [
        ([[0, 1], [2, 3]], ["dp"], "names"),  # too few names
        ([0, 1], ["dp", "tp"], "names"),  # too many names
        ([[0, 1], [2, 3]], ["dp", "dp"], "names"),  # duplicate names
        ([[0, 1], [1, 3]], ["dp", "tp"], "Duplicate ranks"),  # duplicate rank
        ([[-1, 0], [1, 2]], ["dp", "tp"], "layout"),  # negative rank
        ([[0, 1], [2]], ["dp", "tp"], "layout"),  # ragged
        ([[0, 1.5], [2, 3]], ["dp", "tp"], "integer rank IDs"),  # non-integral float
        ([["a", "b"]], ["dp", "tp"], "integer rank IDs"),  # not numbers
        ([], ["dp"], "layout"),  # empty
        (0, [], "layout"),  # 0-d
    ],
)
def test_init_value_errors(layout: object, names: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NamedSharding(layout, names)  # type: ignore[arg-type]


@pytest.mark.parametrize("names", ["dp", ["dp", 3], [""]])
def test_init_names_type_errors(names: object) -> None:
    layout = [0, 1] if names != ["dp", 3] else [[0, 1]]
    with pytest.raises(TypeError, match="names"):
        NamedSharding(layout, names)  # type: ignore[arg-type]


def test_error_message_lists_duplicated() -> None:
    with pytest.raises(ValueError) as info:
        NamedSharding([0, 0, 3, 1, 3], ["dp"])
    assert "Duplicate ranks found in layout: [0, 3]" in str(info.value)


def test_layouts_nemo_rl_accepts() -> None:
    # Ranks need not be 0..N-1 (a slice of a bigger layout), and integral floats are cast.
    s = NamedSharding([[0, 1], [2, 4]], ["dp", "tp"])
    assert s.get_worker_coords(4) == {"dp": 1, "tp": 1}
    assert s.contains_worker_id(4) and not s.contains_worker_id(3)
    with pytest.raises(ValueError, match="Worker ID 3 not found"):
        s.get_worker_coords(3)
    f = NamedSharding([[0.0, 1.0], [2.0, 3.0]], ["dp", "tp"])
    assert f == NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    assert f.layout.dtype.kind == "i"
    with pytest.raises(ValueError, match="Number of dimensions"):
        NamedSharding([[0, 1], [2, 3]], ["dp", "pp", "tp"])
