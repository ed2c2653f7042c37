"""DynamoDB attribute values for the items the request path reads and writes.

The pynamodb models in `records` are the schema of record (operators' tools and tests use
them); this is the same encoding without pynamodb, for the lean client on the request path.
A test checks that both encode every usage event identically.
"""

from __future__ import annotations

from dataclasses import fields
from decimal import MAX_EMAX, MIN_EMIN, ROUND_HALF_EVEN, Context, Decimal
from functools import lru_cache
from typing import Any

from ..jsonio import decimal_text
from .errors import UnstorableValue

__all__ = ["DIGITS", "decode", "encode", "exact_sum", "from_item", "number", "significant_digits", "storage_problem",
           "to_item", "within_digits"]

# DynamoDB numbers: up to 38 significant digits, magnitudes from 1E-130 to below 1E+126.
DIGITS = 38
# (as the exponent of a number's leading digit: 1E+126 and up overflow, below 1E-130 underflow)
_SMALLEST_LEADING, _LARGEST_LEADING = -130, 126
# Rounds to 38 digits with the widest exponents a Decimal has (no overflow short of its very
# last exponents, which no cost comes near).
_ROUNDED = Context(prec=DIGITS, rounding=ROUND_HALF_EVEN, Emax=MAX_EMAX, Emin=MIN_EMIN)


def significant_digits(value: Decimal) -> int:
    """How many significant digits a finite Decimal has (trailing zeros are not), worked out
    from its digits alone: no arithmetic, so no context's exponent limits (1E+999999999 has 1)."""
    return _significant(value.as_tuple().digits)


def _significant(digits: tuple[int, ...]) -> int:
    kept = len(digits)
    while kept > 1 and digits[kept - 1] == 0:
        kept -= 1
    return kept


# Sums of stored numbers (38 digits each) worked out exactly: Python's default context keeps 28
_EXACT = Context(prec=120, Emax=MAX_EMAX, Emin=MIN_EMIN)


def exact_sum(*values: Decimal) -> Decimal:
    """The sum of the values (a difference: a negated term), exact, then within 38 digits."""
    total = Decimal(0)
    for value in values:
        total = _EXACT.add(total, value)
    return within_digits(total)


def within_digits(value: Decimal) -> Decimal:
    """`value` rounded (half even) to DynamoDB's 38 significant digits; unchanged when it fits."""
    if not value.is_finite() or significant_digits(value) <= DIGITS:
        return value
    return _ROUNDED.plus(value)


def storage_problem(value: Decimal) -> str | None:
    """Why DynamoDB cannot hold a finite number: "digits" (more than 38 significant),
    "overflow" (1E+126 and up), "underflow" (below 1E-130 but not 0); None: it can."""
    _, digits, exponent = value.as_tuple()
    return _problem(digits, exponent)


def _problem(digits: tuple[int, ...], exponent: int) -> str | None:
    """`storage_problem` of the finite number these digits and exponent make (Decimal.as_tuple)."""
    if not any(digits):  # zero, whatever its exponent
        return None
    if _significant(digits) > DIGITS:
        return "digits"
    # the exponent of the leading digit (Decimal.adjusted), worked out from the digits alone
    leading = exponent + len(digits) - 1
    if leading >= _LARGEST_LEADING:
        return "overflow"
    return "underflow" if leading < _SMALLEST_LEADING else None


# an int strictly inside ±10**38 has at most 38 digits and no magnitude DynamoDB refuses
_PLAIN_INT = 10**DIGITS


def number(value: int | Decimal) -> str:
    """A number as DynamoDB's N, exactly, or UnstorableValue if DynamoDB would refuse it."""
    if type(value) is int and -_PLAIN_INT < value < _PLAIN_INT:  # the counts and times of every item
        return str(value)
    try:
        return _number(value)
    except TypeError:  # a signaling NaN has no hash: no cache, the same refusal
        return _number.__wrapped__(value)


@lru_cache(maxsize=1024, typed=True)
def _number(value: int | Decimal) -> str:
    """`number` of anything but a small int, worked out once per value: a request's cost is
    written several times over (the org's debit, its event, its key's figure and tallies)."""
    exact = value if type(value) is Decimal else Decimal(value)
    _, digits, exponent = exact.as_tuple()
    if type(exponent) is not int:  # "n", "N" or "F": NaN, sNaN, Infinity
        raise UnstorableValue(f"{value!r} is not a finite number")
    problem = _problem(digits, exponent)
    if problem == "digits":
        raise UnstorableValue(f"{value!r} has more than {DIGITS} significant digits")
    if problem is not None:
        raise UnstorableValue(f"{value!r} is outside DynamoDB's range of numbers")
    return decimal_text(exact)


def encode(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"BOOL": value}
    if isinstance(value, (int, Decimal)):
        return {"N": number(value)}
    if isinstance(value, str):
        return {"S": value}
    if isinstance(value, dict):
        return {"M": {key: encode(item) for key, item in value.items() if item is not None}}
    raise TypeError(f"cannot store a {type(value).__name__}")


def decode(value: dict[str, Any]) -> Any:
    (kind, data), = value.items()
    if kind == "S":
        return data
    if kind == "N":
        number = Decimal(data)
        return int(number) if number == number.to_integral_value() and "." not in data and "E" not in data.upper() else number
    if kind == "BOOL":
        return data
    if kind == "M":
        return {key: decode(item) for key, item in data.items()}
    if kind == "NULL":
        return None
    if kind == "L":
        return [decode(item) for item in data]
    raise TypeError(f"unexpected attribute type {kind}")


def to_item(record: Any) -> dict[str, dict[str, Any]]:
    """A dataclass as an item: None fields left out, as pynamodb leaves out null attributes."""
    item: dict[str, dict[str, Any]] = {}
    for name in _field_names(type(record)):
        value = getattr(record, name)
        if value is None:
            continue
        kind = type(value)  # the kinds of nearly every field, encoded here as `encode` does
        if kind is str:
            item[name] = {"S": value}
        elif kind is bool:
            item[name] = {"BOOL": value}
        elif kind is int and -_PLAIN_INT < value < _PLAIN_INT:
            item[name] = {"N": str(value)}
        else:
            item[name] = encode(value)
    return item


@lru_cache(maxsize=32)
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


def from_item(item: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: decode(value) for name, value in item.items()}
