"""The checks every config dataclass runs in `__post_init__`, on the ground floor of the library.

A bad value raises `ValueError("Owner.field=value is invalid: what is allowed")`. The owner is
the config object's class name (`owner=` names another: a JSON object's key, or "" for a bare
field name); `allowed=` replaces the default wording where a field's own says more. Imports
only the standard library, so every package may use it and validation stays instant.
"""

from __future__ import annotations

from collections.abc import Collection
from numbers import Real
from typing import Any

_FIELD: Any = object()  # `value=` not given: read the field from the object


def _where(obj: object, name: str, owner: str | None) -> str:
    owner = type(obj).__name__ if owner is None else owner
    return f"{owner}.{name}" if owner else name


def invalid(
    obj: object, name: str, allowed: str, *, value: Any = _FIELD, owner: str | None = None
) -> ValueError:
    """The error for `obj.name` (or `value`, when the shown value is not the field's)."""
    if value is _FIELD:
        value = getattr(obj, name)
    return ValueError(f"{_where(obj, name, owner)}={value!r} is invalid: {allowed}")


def require(
    ok: object,
    obj: object,
    name: str,
    allowed: str,
    *,
    value: Any = _FIELD,
    owner: str | None = None,
) -> None:
    """Raise `invalid(...)` unless `ok`: for the checks particular to one field."""
    if not ok:
        raise invalid(obj, name, allowed, value=value, owner=owner)


def is_int(value: object) -> bool:
    """An `int`, not a `bool` (YAML's `true` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number (int, float, numpy scalar), not a `bool`."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _bracket(low: Any, high: Any, low_open: bool, high_open: bool) -> str:
    return f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def _in_range(v: Any, low: Any, high: Any, low_open: bool, high_open: bool) -> bool:
    if low is not None and not (v > low if low_open else v >= low):
        return False
    return high is None or (v < high if high_open else v <= high)


def integer(
    obj: object,
    *names: str,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
    allowed: str | None = None,
    owner: str | None = None,
) -> None:
    """Each field an integer in [low, high] (a missing bound: unbounded); `optional`: or None.

    Default wording: `an integer >= low` or `an integer in [low, high]` (`... or null`)."""
    if allowed is None:
        if high is not None:
            allowed = f"an integer in {_bracket(low, high, False, False)}"
        else:
            allowed = "an integer" if low is None else f"an integer >= {low}"
        if optional:
            allowed += " or null"
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if not (is_int(v) and _in_range(v, low, high, False, False)):
            raise invalid(obj, name, allowed, value=v, owner=owner)


def positive_int(
    obj: object,
    *names: str,
    optional: bool = False,
    allowed: str = "a positive integer",
    owner: str | None = None,
) -> None:
    """Each field an integer >= 1 (`optional`: or None)."""
    integer(obj, *names, low=1, optional=optional, allowed=allowed, owner=owner)


def number(
    obj: object,
    *names: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    nan_ok: bool = False,
    allowed: str | None = None,
    owner: str | None = None,
) -> None:
    """Each field a real number within the bounds (open or closed; None: unbounded);
    `optional`: or None. NaN is out of every range unless `nan_ok`: the fields that leave it
    to the config loader, whose error names the dotted key (`'train_sim.optim.lr'=nan`).

    Default wording: `a number > low` / `a number >= low`, or `a number in [low, high)`."""
    if allowed is None:
        if high is not None:
            allowed = f"a number in {_bracket(low, high, low_open, high_open)}"
        elif low is not None:
            allowed = f"a number {'>' if low_open else '>='} {low}"
        else:
            allowed = "a number"
    for name in names:
        v = getattr(obj, name)
        if optional and v is None or nan_ok and is_number(v) and v != v:
            continue
        if not (is_number(v) and _in_range(v, low, high, low_open, high_open)):
            raise invalid(obj, name, allowed, value=v, owner=owner)


def positive(
    obj: object,
    *names: str,
    optional: bool = False,
    nan_ok: bool = False,
    allowed: str = "a positive number",
    owner: str | None = None,
) -> None:
    """Each field a number > 0 (`optional`: or None; `nan_ok` as in `number`)."""
    number(
        obj,
        *names,
        low=0,
        low_open=True,
        optional=optional,
        nan_ok=nan_ok,
        allowed=allowed,
        owner=owner,
    )


def fraction(
    obj: object,
    *names: str,
    allowed: str = "a number in [0, 1]",
    owner: str | None = None,
) -> None:
    """Each field a number in [0, 1] (a share or a probability)."""
    number(obj, *names, low=0, high=1, allowed=allowed, owner=owner)


def one_of(
    obj: object,
    name: str,
    choices: Collection[Any],
    *,
    allowed: str | None = None,
    owner: str | None = None,
) -> None:
    """The field is one of `choices` (default wording: `one of [...]`)."""
    v = getattr(obj, name)
    if v not in choices:
        raise invalid(obj, name, allowed or f"one of {list(choices)}", value=v, owner=owner)


def boolean(obj: object, *names: str, owner: str | None = None) -> None:
    """Each field `True` or `False` (not 0/1, not a string)."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, bool):
            raise invalid(obj, name, "true or false", value=v, owner=owner)


def text(
    obj: object,
    *names: str,
    optional: bool = False,
    allowed: str = "a non-empty string",
    owner: str | None = None,
) -> None:
    """Each field a non-empty string (`optional`: or None)."""
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if not (isinstance(v, str) and v):
            raise invalid(obj, name, allowed, value=v, owner=owner)
