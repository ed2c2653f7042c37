"""JSON in and out: strict parsing of client bodies, exact Decimal numbers on the way out."""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
from decimal import Decimal
from typing import Any

__all__ = ["MAX_DEPTH", "compact", "decimal_text", "dumps", "loads_strict"]

# Deeper than this is no request anyone means to send, and everything the gateway does with
# a body afterwards (copying, encoding, estimating) must stay far from the recursion limit.
MAX_DEPTH = 200
# A \uD800-\uDFFF escape: the only way a parsed JSON string can hold a surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def loads_strict(raw: bytes, *, lone_surrogates: bool = False) -> Any:
    """Parse RFC 8259 JSON; raises ValueError (never anything else) on any bad input.

    Rejects invalid UTF-8, NaN/Infinity, numbers that overflow a float, integers too long
    to convert, nesting deeper than MAX_DEPTH, and strings (keys included) with a lone
    surrogate escape such as "\\ud800", which no UTF-8 request to a model server can carry.
    The two last checks cost a scan only of bodies that could fail them.
    """
    try:
        text = raw.decode("utf-8")
        value, end = _decoder.raw_decode(text, _skip_ws(text, 0))
        if _skip_ws(text, end) != len(text):
            raise ValueError("extra data after the JSON value")
        if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(value) > MAX_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
        if not lone_surrogates and _SURROGATE_ESCAPE.search(raw):
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate escape (not encodable as UTF-8)") from None
        return value
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        if "integer string conversion" in str(exc):  # Python's words name its own setting
            raise ValueError(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
        raise ValueError(str(exc)) from None


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed value (iteratively: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in item)
    return deepest


def _skip_ws(text: str, index: int) -> int:
    length = len(text)
    while index < length and text[index] in " \t\n\r":
        index += 1
    return index


def decimal_text(value: Decimal) -> str:
    """A Decimal as a plain JSON number: no exponent, no trailing zeros (0.000000665)."""
    if value == 0:
        return "0"
    text = format(value, "f")  # exact: no rounding to the context's precision
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def compact(value: Any) -> bytes:
    """Compact JSON bytes of plain values (no Decimals: see `dumps`), non-ASCII kept as UTF-8."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def dumps(value: Any) -> bytes:
    """Compact JSON bytes; Decimals are written exactly, as plain numbers.

    Non-ASCII text stays UTF-8; a string holding a lone surrogate (which a model server may
    send as an escape) cannot be UTF-8, so then the whole value is written with \\u escapes.
    """
    decimals: list[str] = []
    # A fresh marker per call, so no string in the payload can pass for a placeholder.
    mark = f"\u0000{secrets.token_hex(8)}:"

    def encode_decimal(obj: Any) -> str:
        if isinstance(obj, Decimal):
            decimals.append(decimal_text(obj))
            return f"{mark}{len(decimals) - 1}"
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    def text(ascii_only: bool) -> str:
        decimals.clear()
        written = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":"), default=encode_decimal)
        for index, number in enumerate(decimals):
            written = written.replace(json.dumps(f"{mark}{index}"), number, 1)
        return written

    try:
        return text(False).encode()
    except UnicodeEncodeError:
        return text(True).encode()
