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


def test_get_ranks_partial_and_full(s3: NamedSharding) -> None:
    sub = s3.get_ranks(dp=1)
    assert isinstance(sub, np.ndarray)
    assert sub.tolist() == [[6, 7, 8], [9, 10, 11]]
    assert s3.get_ranks(pp=1).tolist() == [[3, 4, 5], [9, 10, 11]]
    assert s3.get_ranks(tp=2).tolist() == [[2, 5], [8, 11]]
    assert s3.get_ranks(dp=0, tp=1).tolist() == [1, 4]
    full = s3.get_ranks(dp=1, pp=0, tp=2)
    assert full == 8
    assert type(full) is int
    assert s3.get_ranks().tolist() == LAYOUT_3D


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
    assert s.get_ranks(dp=0).tolist() == [5, 2, 4]  # layout order kept by get_ranks


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
    assert repr(NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])) == (
        "NamedSharding(layout=[[0, 1], [2, 3]], names=['dp', 'tp'])"
    )
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
        ([[0, 1], [1, 3]], ["dp", "tp"], "layout"),  # duplicate rank, 2 missing
        ([[0, 1], [2, 4]], ["dp", "tp"], "layout"),  # rank out of range
        ([[-1, 0], [1, 2]], ["dp", "tp"], "layout"),  # negative rank
        ([[1, 2], [3, 4]], ["dp", "tp"], "layout"),  # does not start at 0
        ([[0, 1], [2]], ["dp", "tp"], "layout"),  # ragged
        ([[0.0, 1.0]], ["dp", "tp"], "layout"),  # float ranks
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


def test_error_message_lists_missing_and_duplicated() -> None:
    with pytest.raises(ValueError) as info:
        NamedSharding([0, 0, 3, 1], ["dp"])
    assert "missing [2]" in str(info.value)
    assert "duplicated [0]" in str(info.value)
