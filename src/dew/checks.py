"""Argument checks shared by every layer, so a bad count reads the same wherever it is caught."""

from __future__ import annotations

import numbers
from typing import Any


def count(value: Any, name: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    """`value` as a Python int of at least `minimum` (a count, a size, a number of steps).

    Python and NumPy integers pass; bools, floats (even whole ones) and strings do not, since a
    float count is almost always a unit mistake. ``optional=True`` lets None through. The error
    names the argument, what it must be and what was given.
    """
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= minimum:
        return int(value)
    bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if optional:
        bound += " or None"
    raise ValueError(f"{name} must be {bound}; got {value!r} ({type(value).__name__}).")


def count_fields(record: Any, **minimums: int) -> None:
    """Check the named count fields of a (frozen) dataclass with `count`, storing each as an int.

    ``count_fields(self, image_size=1, seed=0)`` in ``__post_init__`` checks ``self.image_size >= 1``
    and ``self.seed >= 0``, naming them ``ClassName.image_size`` and ``ClassName.seed`` on failure.
    """
    for name, minimum in minimums.items():
        value = count(getattr(record, name), f"{type(record).__name__}.{name}", minimum=minimum)
        object.__setattr__(record, name, value)


def one_of(value: Any, choices: Any, name: str, *, what: str, extra: str = "") -> Any:
    """`value` if it is among `choices`, else a ValueError naming the argument, what it must be and
    every accepted value (``extra`` is prepended to that list, e.g. "None (the default)")."""
    if value in choices:
        return value
    listed = ", ".join(repr(choice) for choice in choices)
    raise ValueError(f"{name}={value!r} is not {what}; use {extra + ' or ' if extra else ''}one of {listed}")
