"""argparse types that refuse bad values with a one-line reason (exit 2, no traceback)."""

from __future__ import annotations

import argparse
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Callable

__all__ = ["bounded_int", "http_url", "non_negative", "usd"]


def bounded_int(what: str, low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low}-{high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{what} must be {bounds}, got {value}")
        return value

    return parse


def http_url(text: str) -> str:
    """An http(s) URL with a host, as a client can call it."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - a port that is no number raises here
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r}")
    return text


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


# ASCII digits, as written: Decimal() alone takes "1_000" and digits of any script
_AMOUNT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def usd(text: str) -> Decimal:
    text = text.strip()
    try:
        value = Decimal(text) if _AMOUNT.fullmatch(text) else None
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite():
        raise argparse.ArgumentTypeError(f"not an amount of USD: {text!r}")
    from kiln.store import UnstorableValue
    from kiln.store.codec import number

    try:
        number(value)
    except UnstorableValue:
        raise argparse.ArgumentTypeError(
            f"not an amount DynamoDB can store: {text!r} (up to 38 significant digits, "
            "a magnitude from 1e-130 to below 1e126)") from None
    return value
