"""Verifiable rewards: pull the answer out of a model's free-form response and check it.

A response is judged by its final answer: the content of the last ``\\boxed{...}`` when
there is one, otherwise the last number in the text ("17 + 25 = 42" -> 42). A response cut
off by the token limit (``truncated``) earns nothing: its last number may be half-written
or a step of unfinished working. ``format_reward`` adds a small bonus for a response that
ended by itself and states a parseable answer, so that groups whose samples are all wrong
still tell short, well-formed answers from rambling ones.

A user's reward is ``--reward module:function``; the function is called as
``fn(response, answer)`` (plus ``truncated=`` when it accepts that argument) and returns a
float.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import operator
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

RewardFn = Callable[..., float]

_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,]*\d)|-?\d+(?:\.\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unclosed: the response was cut inside the box


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` ("1,234" and "-3.5" count as one number), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def parse_number(text: str | None) -> Fraction | None:
    """An exact value of a number string ("1,234", "42.0", "-7"), or None."""
    if text is None:
        return None
    s = text.strip().replace(",", "").rstrip(".")
    if s.startswith("$"):
        s = s[1:]
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The final answer: the last ``\\boxed{}`` content, else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        inner = extract_last_number(boxed)
        return inner if inner is not None else boxed
    return extract_last_number(text)


def numeric_reward(
    response: str, answer: str, truncated: bool = False, format_reward: float = 0.0
) -> float:
    """1 for a final answer equal to ``answer`` (as numbers), else ``format_reward`` for a
    finished response with a parseable answer, else 0. Truncated responses get 0."""
    if truncated:
        return 0.0
    got = parse_number(extract_answer(response))
    want = parse_number(answer)
    if want is None:
        raise ValueError(f"numeric_reward: the reference answer {answer!r} is not a number")
    if got is not None and got == want:
        return 1.0
    return format_reward if got is not None else 0.0


def exact_reward(
    response: str, answer: str, truncated: bool = False, format_reward: float = 0.0
) -> float:
    """1 for exactly ``answer`` (whitespace-stripped), else 0 (the tiny task's reward)."""
    if truncated:
        return 0.0
    return 1.0 if response.strip() == answer.strip() else 0.0


# ----------------------------------------------------------------------------- countdown

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: None}


def _eval_expr(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval_expr(node.body, used)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _eval_expr(node.left, used), _eval_expr(node.right, used)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ZeroDivisionError
            return a / b
        return Fraction(_OPS[type(node.op)](a, b))
    raise ValueError("not + - * / over integers")


def countdown_expression(text: str) -> str | None:
    """The candidate expression of a countdown response: the boxed content, else the last
    line's left side of ``=`` (or the whole last line holding digits and operators)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.split("=")[0].strip()
    lines = [ln for ln in text.strip().splitlines() if re.search(r"\d", ln)]
    if not lines:
        return None
    last = lines[-1].split("=")[0]
    m = re.findall(r"[\d\s+\-*/x×÷()]+", last)
    return max(m, key=len).strip() if m else None


def countdown_reward(
    response: str,
    answer: str,
    truncated: bool = False,
    format_reward: float = 0.0,
    numbers: list[int] | None = None,
) -> float:
    """1 when the final expression uses only ``numbers`` (each at most once) and equals the
    target ``answer``; ``format_reward`` for a finished response with a valid expression."""
    if truncated:
        return 0.0
    if numbers is None:
        raise ValueError("countdown_reward needs the puzzle's numbers")
    expr = countdown_expression(response)
    if not expr:
        return 0.0
    expr = expr.replace("×", "*").replace("x", "*").replace("÷", "/")
    used: list[int] = []
    try:
        value = _eval_expr(ast.parse(expr, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    if Counter(used) - Counter(numbers):  # a number used that was not given, or twice
        return format_reward
    if math.isclose(float(value), float(answer)) and value == Fraction(answer):
        return 1.0
    return format_reward


# ----------------------------------------------------------------------------- user rewards


def load_reward(spec: str) -> RewardFn:
    """Import ``module:function`` and check it is callable."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"reward: expected 'module:function', got {spec!r}")
    mod_name, fn_name = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {mod_name} has no function {fn_name!r}")
    return fn


def call_reward(fn: RewardFn, response: str, answer: str, **extra: Any) -> float:
    """Call ``fn(response, answer, **kw)`` with those of ``extra`` its signature accepts;
    ``TypeError`` for a result that is not a number, ``ValueError`` for NaN or infinity."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in extra.items() if takes_all or k in params}
    value = fn(response, answer, **kw)
    name = getattr(fn, "__qualname__", fn)
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward function {name!r} returned {value!r}, not a number") from None
    if not math.isfinite(reward):
        raise ValueError(
            f"reward function {name!r} returned {value!r} for the response {response!r} "
            f"(answer {answer!r}): a reward must be a finite number"
        )
    return reward
