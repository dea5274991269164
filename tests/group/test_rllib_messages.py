"""RLlib's own test ``test_len_of_func_not_match_len_of_actors``, ported: a list of
functions whose length differs from the actors called raises ``AssertionError`` with
RLlib's message (which user code and tests match)."""

from __future__ import annotations

import re

import pytest

from phalanx.group import dispatch

RLLIB = "Funcs must have the same number of callables as actor indices."


def test_rllib_message_for_a_function_list_of_the_wrong_length():
    with pytest.raises(AssertionError, match=re.escape(RLLIB)) as info:
        dispatch.foreach([len, len], [0, 1, 2], None, with_id=False, check_method=lambda m: None)
    assert str(info.value) == f"{RLLIB} (func: a list of 2 functions for 3 workers)"
    with pytest.raises(AssertionError, match=re.escape(RLLIB)):
        dispatch.foreach_select(
            [0, 1], 2, [len], healthy_only=True, not_healthy=set(), remote_worker_ids=[0, 1]
        )
