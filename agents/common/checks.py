"""Checks of an agent config's fields, for its `__post_init__`.

Each raises ValueError naming the field, its value and what was expected; `expected`
replaces the default wording where a sentinel value means something ("0: by network").
A NaN fails every real-valued check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def ints(config: Any, *names: str, low: int = 1, high: int | None = None,
         expected: str | None = None) -> None:
    """Each field is an int (not a bool) >= `low` (and <= `high`, if given)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (
                high is not None and value > high):
            raise ValueError(f"{name} must be {expected or f'an int >= {low}'}, got {value!r}")


def sizes(config: Any, *names: str) -> None:
    """Each field is a tuple of ints >= 1 (layer sizes)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, tuple) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in value):
            raise ValueError(f"{name} must be a tuple of ints >= 1, got {value!r}")


def reals(config: Any, *names: str, low: float | None = None, high: float | None = None,
          open_low: bool = False, expected: str | None = None) -> None:
    """Each field is a number in [low, high] (low excluded with `open_low`; None: no
    bound on that side)."""
    for name in names:
        value = getattr(config, name)
        number = isinstance(value, int | float)  # compared only then: "1e-3" < 0 raises
        above = number and (low is None or (value > low if open_low else value >= low))
        if not (above and (high is None or value <= high)):
            raise ValueError(f"{name} must be {expected or _interval(low, high, open_low)}, "
                             f"got {value!r}")


def one_of(config: Any, name: str, allowed: Sequence[Any]) -> None:
    """The field is one of `allowed`."""
    value = getattr(config, name)
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _interval(low: float | None, high: float | None, open_low: bool) -> str:
    if high is None:
        return f"{'>' if open_low else '>='} {low:g}"
    return f"in {'(' if open_low else '['}{low:g}, {high:g}]"
