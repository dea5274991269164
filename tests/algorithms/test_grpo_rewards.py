"""Answer parsing and rewards on tricky model outputs."""

from __future__ import annotations

import sys
import textwrap

import pytest

from phalanx.algorithms.grpo_rewards import (
    call_reward,
    countdown_reward,
    extract_answer,
    extract_boxed,
    extract_last_number,
    load_reward,
    numeric_reward,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("17 + 25 = 42", "42"),  # several numbers: the last one counts
        ("First 17, then 25. So the sum is 42.", "42"),  # sentence full stop after it
        ("The answer is \\boxed{42}. Check: 40 + 2 = 42, not 43", "42"),  # boxed wins
        ("\\boxed{\\frac{84}{2}} so 42", "2"),  # boxed content: its last number
        ("We get 1,234 apples", "1,234"),  # thousands separator
        ("It is -7.", "-7"),
        ("about 3.50 dollars", "3.50"),
        ("x=42", "42"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_extract_helpers_edge_cases():
    assert extract_boxed("\\boxed{a{b}c} and \\boxed{7}") == "7"  # the last box
    assert extract_boxed("\\boxed{4{2}") is None  # cut off inside the box
    assert extract_boxed("nothing boxed") is None
    assert extract_last_number("1, 2, 3") == "3"  # a list is not one number
    assert extract_last_number("v2 is 10") == "10"


def test_numeric_reward():
    assert numeric_reward("17 + 25 = 42", "42") == 1.0
    assert numeric_reward("17 + 25 = 42.0", "42") == 1.0  # compared as numbers
    assert numeric_reward("17 + 25 = 32", "42") == 0.0
    # Wrong but finished and parseable: the format reward; no number: nothing.
    assert numeric_reward("17 + 25 = 32", "42", format_reward=0.1) == 0.1
    assert numeric_reward("I cannot say", "42", format_reward=0.1) == 0.0
    # Truncated: nothing, even when the last number so far happens to be right.
    assert numeric_reward("17 + 25 = 42, and then 42", "42", truncated=True) == 0.0
    with pytest.raises(ValueError, match="'forty'"):
        numeric_reward("42", "forty")


def test_countdown_reward():
    nums = [25, 5, 3]
    assert countdown_reward("(25 - 5) * 3 = 60", "60", numbers=nums) == 1.0
    assert countdown_reward("Answer: \\boxed{3 * (25 - 5)}", "60", numbers=nums) == 1.0
    assert (
        countdown_reward("We try.\n25 x 3 - 5 - 5 = 60", "60", numbers=nums, format_reward=0.1)
        == 0.1
    )
    assert countdown_reward("25 * 3 = 75", "60", numbers=nums, format_reward=0.1) == 0.1
    assert countdown_reward("(25 - 5) * 3 = 60", "60", truncated=True, numbers=nums) == 0.0
    assert countdown_reward("no idea", "60", numbers=nums) == 0.0
    assert countdown_reward("25 / (5 - 5) = 60", "60", numbers=nums) == 0.0  # division by 0
    with pytest.raises(ValueError, match="numbers"):
        countdown_reward("1", "1")


def test_user_reward_loading(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def exact(response, answer):
                return float(response.strip() == answer)

            def lenient(response, answer, truncated=False):
                return 0.5 if truncated else 1.0

            def bad(response, answer):
                return "yes"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards:exact")
    assert call_reward(fn, " 7 ", "7", truncated=True, numbers=[1]) == 1.0
    assert call_reward(load_reward("my_rewards:lenient"), "x", "7", truncated=True) == 0.5
    with pytest.raises(TypeError, match="'yes'"):
        call_reward(load_reward("my_rewards:bad"), "x", "7")
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_reward("my_rewards:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="module:function"):
        load_reward("my_rewards.exact")
    sys.modules.pop("my_rewards", None)


def test_non_finite_reward_is_refused_naming_function_and_response():
    def nan_reward(response, answer):
        return float("nan")

    def nan_string(response, answer):
        return "nan"

    for fn in (nan_reward, nan_string):
        with pytest.raises(ValueError, match=rf"reward function '.*{fn.__name__}' returned .*nan"):
            call_reward(fn, "the sum is 12", "12")
    with pytest.raises(ValueError, match="for the response 'the sum is 12'"):
        call_reward(lambda r, a: float("inf"), "the sum is 12", "12")
