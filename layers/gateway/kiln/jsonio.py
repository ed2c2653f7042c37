"""JSON in and out: strict parsing of client bodies, exact Decimal numbers on the way out.

What the gateway writes, orjson writes: the same JSON values as `json.dumps` (floats in their
shortest exact form, so `1e-07` may read `1e-7`) for a tenth of the time. Where orjson would
write something else or nothing (an integer past 64 bits, a string with a lone surrogate, a
subclass of a JSON type), the standard library's encoder writes it instead, as before. The one
value written otherwise is a float that is no number (NaN, an infinity): orjson writes null,
where json.dumps wrote `NaN`, which is no JSON. Nothing the gateway writes holds one: what it
reads is parsed by `loads_strict`, which refuses them, and its own figures are Decimals.
What the gateway reads from clients and model servers, the standard library reads (orjson
reads a long integer as a float): see `loads_strict`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import secrets
import sys
from decimal import Decimal
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any, Callable

import orjson

try:
    from _json import make_encoder as c_make_encoder
except ImportError:  # pragma: no cover - CPython always has it
    c_make_encoder = None

__all__ = ["ANSWER_MAX_DEPTH", "BOM", "MAX_DEPTH", "compact", "compact_encoder", "compact_text", "decimal_places", "decimal_text", "dumps", "loads_answer", "loads_strict", "loads_trusted"]

# Deeper than this is no request anyone means to send, and everything the gateway does with
# a body afterwards (copying, encoding, estimating) must stay far from the recursion limit.
MAX_DEPTH = 200
# What a model server sends may repeat a request at that bound one or two levels down (a
# Responses stream's event holds the response object, which repeats the request's `tools`):
# its answers and events are read with a few levels more.
ANSWER_MAX_DEPTH = MAX_DEPTH + 8
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


def loads_strict(raw: bytes, *, lone_surrogates: bool = False, max_depth: int = MAX_DEPTH) -> Any:
    """Parse RFC 8259 JSON; raises ValueError (never anything else) on any bad input.

    Rejects invalid UTF-8, NaN/Infinity, numbers that overflow a float, integers too long
    to convert, nesting deeper than `max_depth`, and strings (keys included) with a lone
    surrogate escape such as "\\ud800", which no UTF-8 request to a model server can carry.
    The two last checks cost a scan only of bodies that could fail them.
    """
    try:
        text = raw.decode("utf-8")
        value, end = _decoder.raw_decode(text, _skip_ws(text, 0))
        if _skip_ws(text, end) != len(text):
            raise ValueError("extra data after the JSON value")
        if raw.count(b"[") + raw.count(b"{") > max_depth and _depth(raw) > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
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


# a UTF-8 byte order mark
BOM = b"\xef\xbb\xbf"


def loads_answer(raw: bytes, *, lone_surrogates: bool = True, body: bool = True) -> Any:
    """What a model server sent (an answer, an error's body, an event's data) as JSON, as
    `loads_strict` reads a client's body but that it may repeat a request at the clients'
    bound a few levels down (ANSWER_MAX_DEPTH). A whole `body` may open with a byte order mark,
    which a JSON reader may ignore (the SDKs read a body so); an event's data may not (their
    readers refuse one there, so the gateway never relays it). A lone surrogate escape is kept
    unless told otherwise: the gateway relays it as one."""
    if body and raw.startswith(BOM):
        raw = raw[len(BOM):]
    return loads_strict(raw, lone_surrogates=lone_surrogates, max_depth=ANSWER_MAX_DEPTH)


# a JSON string as written (what it holds may be brackets that open nothing)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# every bracket as a square one, and nothing else
_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_A_BRACKET = bytes(byte for byte in range(256) if byte not in b"[]{}")
# an opening bracket as +1, a closing one as -1 (a signed byte)
_STEP = bytes.maketrans(b"[]", b"\x01\xff")
_PAIR_PASSES = 4


def _depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text that parsed, at the speed of bytes'
    own methods (walking the parsed value took a tuple an element: 16 MB of `{}`, 10 s and
    400 MB). Strings are taken out and the brackets kept, all made square. A pass takes out
    every innermost pair, one level (a replace does not see the pairs its own removals make):
    a few passes leave nothing of most bodies. What is left is read as steps up and down, and
    its depth is the highest point they reach."""
    brackets = _STRING.sub(b"", raw).translate(_SQUARE, _NOT_A_BRACKET)
    for passes in range(_PAIR_PASSES):
        if not brackets:
            return passes
        brackets = brackets.replace(b"[]", b"")
    if not brackets:
        return _PAIR_PASSES
    return _PAIR_PASSES + max(itertools.accumulate(memoryview(brackets.translate(_STEP)).cast("b")))


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


def decimal_places(value: Decimal) -> int:
    """How many digits a finite Decimal has after the point, trailing zeros not counted, read
    from its digits (exact: normalize() would round it to the context's 28 digits first)."""
    _, digits, exponent = value.as_tuple()
    if not any(digits):
        return 0
    zeros = len(digits) - len("".join(map(str, digits)).rstrip("0"))
    return max(0, -(exponent + zeros))


def _not_serializable(obj: Any) -> Any:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def compact_encoder(ascii_only: bool = False, default: Callable[[Any], Any] = _not_serializable) -> Callable[[Any], str]:
    """What `json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":"), check_circular=False,
    default=default)` does, without its per-call set-up: CPython's accelerated encoder (the one
    json.dumps itself uses), made once. The values the gateway writes are trees (parsed JSON and
    its own dicts), never cycles, so no circular-reference bookkeeping is needed."""
    if c_make_encoder is None:  # an interpreter without the accelerated module
        encoder = json.JSONEncoder(ensure_ascii=ascii_only, separators=(",", ":"), check_circular=False,
                                   default=default)
        return encoder.encode
    made = c_make_encoder(None, default, encode_basestring_ascii if ascii_only else encode_basestring, None, ":", ",",
                          False, False, True)

    def encode(value: Any) -> str:
        return "".join(made(value, 0))

    return encode


_COMPACT = compact_encoder(False)
_COMPACT_ASCII = compact_encoder(True)


def compact_text(value: Any, *, ascii_only: bool = False) -> str:
    """Compact JSON text of plain values (no Decimals: see `dumps`); with `ascii_only`, non-ASCII
    as \\u escapes."""
    return _COMPACT_ASCII(value) if ascii_only else _COMPACT(value)


# Types json.dumps does not write (dataclasses, datetimes) or writes as their base type
# (subclasses of str, int, dict, list) go to `default`, which leaves them to json.dumps' rules.
_ONLY_JSON_TYPES = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS


def _orjson(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """orjson's bytes, copied: its own hold the buffer it wrote them in, several times their size
    (4 KB for a short string), for as long as they are kept (a relay keeps some a whole stream)."""
    return bytes(memoryview(orjson.dumps(value, default=default, option=_ONLY_JSON_TYPES)))


def compact(value: Any) -> bytes:
    """Compact JSON bytes of plain values (no Decimals: see `dumps`), non-ASCII kept as UTF-8;
    a value with a lone surrogate, which UTF-8 cannot hold, is written with \\u escapes."""
    try:
        return _orjson(value)
    except TypeError:  # orjson.JSONEncodeError: the standard encoder writes it, or says why not
        pass
    try:
        return _COMPACT(value).encode()
    except UnicodeEncodeError:
        return _COMPACT_ASCII(value).encode()


def loads_trusted(raw: bytes) -> Any:
    """JSON from a service whose answers are well-formed by contract (AWS): parsed by orjson.
    Not for what a client or a model server sends (its long integers become floats there).

    What orjson refuses to read goes to the standard library, which says whether it is JSON:
    a lone surrogate's escape, which `compact` writes for a text that holds one, is."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _fragment(obj: Any) -> Any:
    if isinstance(obj, Decimal):
        return orjson.Fragment(decimal_text(obj))
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def dumps(value: Any) -> bytes:
    """Compact JSON bytes; Decimals are written exactly, as plain numbers.

    Non-ASCII text stays UTF-8; a string holding a lone surrogate (which a model server may
    send as an escape) cannot be UTF-8, so then the whole value is written with \\u escapes.
    """
    try:
        return _orjson(value, _fragment)
    except TypeError:  # orjson.JSONEncodeError: the standard encoder writes it, or says why not
        pass
    decimals: list[str] = []
    # A fresh marker per call, so no string in the payload can pass for a placeholder.
    mark = f"\u0000{secrets.token_hex(8)}:"
    mark_escaped = "\\u0000" + mark[1:]  # as JSON writes it, ASCII or not

    def encode_decimal(obj: Any) -> str:
        if isinstance(obj, Decimal):
            decimals.append(decimal_text(obj))
            return f"{mark}{len(decimals) - 1}"
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    def text(ascii_only: bool) -> str:
        decimals.clear()
        written = compact_encoder(ascii_only, encode_decimal)(value)
        for index, number in enumerate(decimals):
            written = written.replace(f'"{mark_escaped}{index}"', number, 1)
        return written

    try:
        return text(False).encode()
    except UnicodeEncodeError:
        return text(True).encode()
