"""The one rank-list validator: its rule, its three ways with a repeated rank, its errors."""

from __future__ import annotations

import numpy as np
import pytest

from phalanx._base.checks import check_rank, check_ranks


@pytest.mark.timeout(10)
def test_ranks_keep_their_order_as_ints() -> None:
    assert check_ranks([2, np.int64(0), 1], 3) == [2, 0, 1]
    assert check_ranks((), 3) == []
    assert check_rank(np.int32(1), 2) == 1


@pytest.mark.timeout(10)
def test_a_repeated_rank_is_an_error_allowed_or_merged() -> None:
    with pytest.raises(ValueError, match=r"^ranks has repeated ranks: \[1, 0, 1\]$"):
        check_ranks([1, 0, 1], 2)
    assert check_ranks([1, 0, 1], 2, repeats="allow") == [1, 0, 1]
    assert check_ranks([1, 0, 1], 2, repeats="merge") == [1, 0]
    with pytest.raises(ValueError, match=r"^repeats must be one of \('error', 'allow', 'merge'\)"):
        check_ranks([0], 2, repeats="drop")


@pytest.mark.timeout(10)
def test_every_bad_rank_is_named_with_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^calls: ranks \[-1, 4\] out of range for 4 workers$"):
        check_ranks([0, -1, 4], 4, "calls")
    with pytest.raises(
        ValueError, match=r"^execute_on: ranks \[7\] out of range for group g of 4 workers$"
    ):
        check_ranks([7], 4, "execute_on", group="g")
    with pytest.raises(
        TypeError,
        match=r"^ids: ranks must be ints; each rank must be an int rank, got \['0', True\]$",
    ):
        check_ranks(["0", 1, True], 4, "ids")
    with pytest.raises(TypeError, match=r"^worker_ids must be a list of ints, got str$"):
        check_ranks("01", 4, "worker_ids")


@pytest.mark.timeout(10)
def test_ids_that_count_from_one() -> None:
    assert check_ranks([2, 1], 2, "remote_worker_ids", first=1) == [2, 1]
    with pytest.raises(
        ValueError,
        match=r"^remote_worker_ids: ranks \[0, 3\] out of range for 2 workers \(ranks 1\.\.2\)$",
    ):
        check_ranks([0, 1, 3], 2, "remote_worker_ids", first=1)
