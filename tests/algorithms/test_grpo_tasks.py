"""Built-in tasks (splits, determinism, solvability) and JSONL task files."""

from __future__ import annotations

import json

import pytest

from phalanx.algorithms.grpo_tasks import (
    AdditionTask,
    CountdownTask,
    JsonlTask,
    load_jsonl,
    make_task,
)


@pytest.mark.parametrize("name", ["addition", "arithmetic", "countdown"])
def test_builtin_splits_are_seeded_and_disjoint(name):
    a, b = make_task(name, seed=3, eval_size=50), make_task(name, seed=3, eval_size=50)
    assert [e.prompt for e in a.heldout] == [e.prompt for e in b.heldout]
    assert len({e.prompt for e in a.heldout}) == 50
    train = a.sample(400)
    assert [e.prompt for e in train] == [e.prompt for e in b.sample(400)]
    assert not {e.prompt for e in train} & {e.prompt for e in a.heldout}
    other = make_task(name, seed=4, eval_size=50)
    assert [e.prompt for e in other.heldout] != [e.prompt for e in a.heldout]


@pytest.mark.smoke
def test_addition_answers_and_reward():
    task = AdditionTask(seed=0, eval_size=10, format_reward=0.1)
    for e in task.heldout:
        x, y = (int(t) for t in e.prompt.removeprefix("What is ").rstrip("?").split(" + "))
        assert 10 <= x <= 99 and 10 <= y <= 99 and e.answer == str(x + y)
    e = task.heldout[0]
    assert task.reward(f"The sum is {e.answer}.", e) == 1.0
    assert task.reward("The sum is 3.", e) == 0.1
    assert task.reward(f"The sum is {e.answer}", e, truncated=True) == 0.0


def test_countdown_puzzles_are_solvable():
    task = CountdownTask(seed=1, eval_size=30)
    for e in task.heldout:
        nums = e.extra["numbers"]
        assert f"equals {e.answer}." in e.prompt and len(nums) == 3
        assert task.reward("no", e) == 0.0
    # A brute-force check that each held-out target is reachable with + - * on the numbers.
    import itertools

    for e in task.heldout:
        target, found = int(e.answer), False
        for a, b, c in itertools.permutations(e.extra["numbers"]):
            for o1, o2 in itertools.product("+-*", repeat=2):
                if eval(f"({a} {o1} {b}) {o2} {c}") == target:
                    assert task.reward(f"({a} {o1} {b}) {o2} {c} = {target}", e) == 1.0
                    found = True
                    break
            if found:
                break
        assert found, e


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_task(tmp_path):
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) for i in range(20)]
    path = _write(tmp_path / "t.jsonl", [*rows[:10], "", *rows[10:]])  # a blank line is fine
    task = make_task(path, seed=0, eval_size=5)
    assert isinstance(task, JsonlTask) and len(task.heldout) == 5
    held = {e.prompt for e in task.heldout}
    assert not held & {e.prompt for e in task.sample(100)}
    e = task.heldout[0]
    assert task.reward(f"= {e.answer}", e) == 1.0
    with pytest.raises(ValueError, match="eval_size 20 leaves no training problems"):
        make_task(path, eval_size=20)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "x", "answer": 1', r"t\.jsonl:2: not valid JSON"),
        ('["x", 1]', r"t\.jsonl:2: expected an object"),
        ('{"prompt": "x"}', r"t\.jsonl:2: missing key\(s\) \['answer'\]"),
        ('{"question": "x", "answer": 1}', r"t\.jsonl:2: missing key\(s\) \['prompt'\]"),
        ('{"prompt": "", "answer": 1}', r"t\.jsonl:2: 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": [1]}', r"t\.jsonl:2: 'answer' must be a string or a number"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, match):
    path = _write(tmp_path / "t.jsonl", ['{"prompt": "ok", "answer": "1"}', line])
    with pytest.raises(ValueError, match=match):
        load_jsonl(path)


def test_task_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in task"):
        make_task("subtraction")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        make_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="holds no problems"):
        load_jsonl(_write(tmp_path / "empty.jsonl", [""]))


def test_jsonl_lone_surrogate_names_file_and_line(tmp_path):
    path = _write(tmp_path / "t.jsonl", ['{"prompt": "ok", "answer": "1"}',
                                         '{"prompt": "bad \\ud800", "answer": "1"}'])  # fmt: skip
    with pytest.raises(ValueError, match=r"t\.jsonl:2: 'prompt' holds '\\ud800', not valid"):
        load_jsonl(path)
