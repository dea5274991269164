"""Tasks for GRPO: prompts with verifiable answers, a training stream and a held-out split.

Built-in procedural tasks (``make_task(name, seed)``):

    addition      "What is 47 + 38?" -> 85 (two-digit operands)
    arithmetic    "What is 12 + 57 - 33?" -> 36 (three or four numbers, + and -)
    countdown     "Using the numbers 25, 5, 3 (each at most once) and + - * /, make 60."
    tiny-addition "7+5=" -> "12", exact match (the tiny character-level model's task)

A held-out split of ``eval_size`` problems is drawn first from the seed; training prompts
are drawn from the same distribution but never repeat a held-out problem. A JSONL file of
``{"prompt": ..., "answer": ...}`` lines is a task too (``load_jsonl_task``): a seeded
shuffle puts ``eval_size`` lines in the held-out split and the rest are sampled for
training.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.algorithms import grpo_rewards as R


@dataclass(frozen=True)
class Example:
    """One problem: the question shown to the model, the reference answer, extra fields
    the reward needs (countdown's numbers)."""

    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class Task:
    """A source of problems with a reward: training samples from ``rng``, fixed held-out."""

    name: str = "task"

    def __init__(
        self,
        seed: int = 0,
        eval_size: int = 200,
        reward_fn: R.RewardFn | None = None,
        format_reward: float = 0.0,
    ) -> None:
        if not isinstance(eval_size, int) or eval_size < 0:
            raise ValueError(f"eval_size must be a non-negative int, got {eval_size!r}")
        self.rng = random.Random(seed)
        self.format_reward = float(format_reward)
        self.user_reward = reward_fn
        self.heldout = self._make_heldout(random.Random(seed + 7919), eval_size)
        self._heldout_prompts = {e.prompt for e in self.heldout}

    # -- to override -------------------------------------------------------------------
    def draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def builtin_reward(self, response: str, example: Example, truncated: bool) -> float:
        return R.numeric_reward(response, example.answer, truncated, self.format_reward)

    # -- shared ------------------------------------------------------------------------
    def _make_heldout(self, rng: random.Random, n: int) -> list[Example]:
        out: dict[str, Example] = {}
        tries = 0
        while len(out) < n:
            e = self.draw(rng)
            out.setdefault(e.prompt, e)
            tries += 1
            if tries > 100 * max(n, 1):
                raise ValueError(f"task {self.name}: cannot draw {n} distinct held-out problems")
        return list(out.values())

    def sample(self, n: int) -> list[Example]:
        """``n`` training problems (never a held-out one)."""
        out = []
        while len(out) < n:
            e = self.draw(self.rng)
            if e.prompt not in self._heldout_prompts:
                out.append(e)
        return out

    def reward(self, response: str, example: Example, truncated: bool = False) -> float:
        if self.user_reward is not None:
            return R.call_reward(
                self.user_reward,
                response,
                example.answer,
                truncated=truncated,
                prompt=example.prompt,
                **example.extra,
            )
        return self.builtin_reward(response, example, truncated)


class AdditionTask(Task):
    name = "addition"

    def __init__(self, *args: Any, low: int = 10, high: int = 99, **kwargs: Any) -> None:
        self.low, self.high = low, high
        super().__init__(*args, **kwargs)

    def draw(self, rng: random.Random) -> Example:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return Example(f"What is {a} + {b}?", str(a + b))


class ArithmeticTask(Task):
    name = "arithmetic"

    def draw(self, rng: random.Random) -> Example:
        n = rng.randint(3, 4)
        nums = [rng.randint(1, 99) for _ in range(n)]
        ops = [rng.choice("+-") for _ in range(n - 1)]
        text, value = str(nums[0]), nums[0]
        for op, x in zip(ops, nums[1:]):
            text += f" {op} {x}"
            value = value + x if op == "+" else value - x
        return Example(f"What is {text}?", str(value))


class CountdownTask(Task):
    name = "countdown"

    def draw(self, rng: random.Random) -> Example:
        # Build a reachable target from three numbers, so every puzzle has a solution.
        while True:
            nums = [rng.randint(1, 25) for _ in range(3)]
            a, b, c = rng.sample(nums, 3)
            op1, op2 = rng.choice("+-*"), rng.choice("+-*")
            target = eval(f"({a} {op1} {b}) {op2} {c}")  # noqa: S307 - digits and +-* only
            if 1 <= target <= 200:
                break
        shown = ", ".join(str(x) for x in nums)
        prompt = (
            f"Using the numbers {shown}, each at most once, and the operations + - * /, "
            f"write an expression that equals {target}."
        )
        return Example(prompt, str(target), {"numbers": nums})

    def builtin_reward(self, response: str, example: Example, truncated: bool) -> float:
        return R.countdown_reward(
            response, example.answer, truncated, self.format_reward, example.extra["numbers"]
        )


class TinyAdditionTask(Task):
    """Single-digit "a+b=" with an exact-match reward; the held-out split is all 100 pairs
    (the tiny model's task has no unseen problems to hold out)."""

    name = "tiny-addition"

    def _make_heldout(self, rng: random.Random, n: int) -> list[Example]:
        return [Example(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)][:n]

    def sample(self, n: int) -> list[Example]:
        return [self.draw(self.rng) for _ in range(n)]

    def draw(self, rng: random.Random) -> Example:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return Example(f"{a}+{b}=", str(a + b))

    def builtin_reward(self, response: str, example: Example, truncated: bool) -> float:
        return R.exact_reward(response, example.answer, truncated)


class JsonlTask(Task):
    """Problems from a JSONL file of ``{"prompt", "answer"}`` objects (numeric answers are
    judged by the built-in numeric reward; use ``--reward`` for anything else)."""

    name = "jsonl"

    def __init__(self, path: str, seed: int = 0, eval_size: int = 200, **kwargs: Any) -> None:
        self.path = path
        self.examples = load_jsonl(path)
        if eval_size >= len(self.examples):
            raise ValueError(
                f"eval_size {eval_size} leaves no training problems in {path} "
                f"({len(self.examples)} lines)"
            )
        self._order = list(range(len(self.examples)))
        random.Random(seed + 7919).shuffle(self._order)
        super().__init__(seed=seed, eval_size=eval_size, **kwargs)
        self._train = [self.examples[i] for i in self._order[eval_size:]]

    def _make_heldout(self, rng: random.Random, n: int) -> list[Example]:
        return [self.examples[i] for i in self._order[:n]]

    def sample(self, n: int) -> list[Example]:
        return [self.rng.choice(self._train) for _ in range(n)]

    def builtin_reward(self, response: str, example: Example, truncated: bool) -> float:
        if R.parse_number(example.answer) is None:
            return R.exact_reward(response, example.answer, truncated, self.format_reward)
        return R.numeric_reward(response, example.answer, truncated, self.format_reward)


def load_jsonl(path: str) -> list[Example]:
    """Read ``{"prompt": str, "answer": str|number}`` lines; a bad line is an error naming
    the file and line number (blank lines are skipped)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"task file {path!r} does not exist")
    out = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{no}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{no}: expected an object, got {type(row).__name__}")
            missing = [k for k in ("prompt", "answer") if k not in row]
            if missing:
                raise ValueError(f"{path}:{no}: missing key(s) {missing} (have {sorted(row)})")
            prompt, answer = row["prompt"], row["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{no}: 'prompt' must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(
                    f"{path}:{no}: 'answer' must be a string or a number, got {answer!r}"
                )
            for key in ("prompt", "answer"):
                try:
                    str(row[key]).encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate such as "\ud800"
                    raise ValueError(
                        f"{path}:{no}: {key!r} holds {e.object[e.start : e.end]!r}, not valid "
                        "Unicode text (a lone surrogate)"
                    ) from None
            extra = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
            out.append(Example(prompt, str(answer), extra))
    if not out:
        raise ValueError(f"task file {path!r} holds no problems")
    return out


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    "addition": AdditionTask,
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "tiny-addition": TinyAdditionTask,
}


def make_task(
    spec: str,
    seed: int = 0,
    eval_size: int = 200,
    reward: str | None = None,
    format_reward: float = 0.0,
) -> Task:
    """A built-in task by name, or a JSONL file by path; ``reward`` is ``module:function``."""
    fn = R.load_reward(reward) if reward else None
    kw = {"seed": seed, "eval_size": eval_size, "reward_fn": fn, "format_reward": format_reward}
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec](**kw)
    if spec.endswith(".jsonl") or os.path.isfile(spec):
        return JsonlTask(spec, **kw)
    raise ValueError(
        f"task {spec!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a JSONL file"
    )
