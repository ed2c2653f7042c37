"""kiln.jsonio: the reason a rejected body is given (the client reads it after "The request
body is not valid JSON: "), and the depth bound at its edges."""

import json
import random
from decimal import Decimal

import pytest

from kiln.jsonio import MAX_DEPTH, _depth, compact, decimal_text, dumps, loads_strict


def reason(raw: bytes) -> str:
    with pytest.raises(ValueError) as info:
        loads_strict(raw)
    assert type(info.value) is ValueError and info.value.__cause__ is None
    return str(info.value)


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"NaN", "NaN is not valid JSON"),
        (b'{"t": -Infinity}', "-Infinity is not valid JSON"),
        (b'{"t": 1e400}', "number 1e400 is out of range"),
        (b'{"a": 1} x', "extra data after the JSON value"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), f"JSON nested deeper than {MAX_DEPTH} levels"),
        (b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), f"JSON nested deeper than {MAX_DEPTH} levels"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
        (b'{"a": "\\ud800"}', "a string holds a lone surrogate escape (not encodable as UTF-8)"),
        # Python's own words for it name its internals (sys.set_int_max_str_digits)
        (b'{"n": ' + b"1" * 5000 + b"}", "an integer has more than 4300 digits"),
        (b"-" + b"9" * 4301, "an integer has more than 4300 digits"),
    ],
)
def test_the_reason_names_the_problem(raw, expected):
    assert reason(raw) == expected


def test_the_parsers_own_reason_is_kept():
    assert reason(b"{'a': 1}").startswith("Expecting property name enclosed in double quotes")
    assert "can't decode byte 0xff" in reason(b'{"a": "\xff"}')


def test_a_long_number_is_quoted_in_the_reason_to_40_characters():
    number = "1" * 60 + "e400"
    assert reason(number.encode()) == f"number {number[:40]} is out of range"


def test_nothing_but_whitespace_may_come_before_the_value():
    for raw in (b"X{}", b"XX1", b"\x0b{}", b"\xc2\xa0{}"):
        with pytest.raises(ValueError):
            loads_strict(raw)
    assert loads_strict(b" \t\r\n 1 \t\r\n ") == 1


def test_depth_counts_objects_and_arrays_together():
    # 150 arrays holding 60 objects: 210 levels, though neither kind alone is over the bound
    raw = b"[" * 150 + b'{"a":' * 60 + b"1" + b"}" * 60 + b"]" * 150
    assert reason(raw) == f"JSON nested deeper than {MAX_DEPTH} levels"


def test_exactly_max_depth_is_accepted_however_many_brackets_there_are():
    # one shallow sibling, then a chain that reaches exactly MAX_DEPTH: more brackets than levels
    raw = b"[[]," + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"]"
    assert raw.count(b"[") > MAX_DEPTH
    assert loads_strict(raw)[0] == []


def test_a_too_deep_value_is_found_behind_any_sibling():
    for sibling in (b"1", b'"s"', b"null", b"{}"):
        raw = b"[" + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"," + sibling + b"]"
        assert reason(raw) == f"JSON nested deeper than {MAX_DEPTH} levels", sibling
        raw = b"[" + sibling + b"," + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"]"
        assert reason(raw) == f"JSON nested deeper than {MAX_DEPTH} levels", sibling


def test_brackets_inside_strings_are_no_depth():
    assert loads_strict(json.dumps("[" * 500).encode()) == "[" * 500


def _nesting(value) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return 0
    return 1 + max((_nesting(item) for item in value), default=0)


def _random_value(rng: random.Random, depth: int):
    kind = rng.random()
    if depth <= 0 or kind < 0.3:
        return rng.choice([1, -2.5, None, True, "", '[{"\\', "]]}}", "\\\"[", "é[ü]", "\u2028{"])
    items = [_random_value(rng, depth - rng.randint(1, 3)) for _ in range(rng.randint(0, 4))]
    if kind < 0.65:
        return items
    return {rng.choice(['k', '[', '"{', '\\']) + str(index): item for index, item in enumerate(items)}


def test_the_depth_of_any_value_is_its_nesting_written_any_way():
    """The depth is read from the bytes (strings, with brackets, quotes and escapes in them,
    taken out); checked against the parsed value's nesting, written compact and spaced."""
    rng = random.Random(11)
    for _ in range(600):
        value = _random_value(rng, rng.randint(0, 14))
        for raw in (json.dumps(value).encode(), json.dumps(value, indent=1, ensure_ascii=False).encode()):
            assert _depth(raw) == _nesting(value), raw


def test_a_wide_and_deep_body_is_measured_in_bytes_time():
    """Thousands of nests 150 deep side by side (more than the passes that take out innermost
    pairs): measured from the steps of what the passes left."""
    raw = b"[" + b",".join([b"[" * 150 + b'"]"' + b"]" * 150] * 2000) + b"]"
    assert _depth(raw) == 151
    raw = b"[" + b",".join([b"[" * 150 + b"1" + b"]" * 150] * 10) + b"," + b"[" * 200 + b"]" * 200 + b"]"
    assert reason(raw) == f"JSON nested deeper than {MAX_DEPTH} levels"


def test_decimal_text_keeps_the_integer_digits():
    assert decimal_text(Decimal("1000")) == "1000"
    assert decimal_text(Decimal("1E+2")) == "100"
    assert decimal_text(Decimal("10.50")) == "10.5"
    assert decimal_text(Decimal("3.0")) == "3"
    assert decimal_text(Decimal("0.0100")) == "0.01"


def test_compact_is_minimal_utf8():
    assert compact({"a": [1, "é"], "b": {"c": None}}) == '{"a":[1,"é"],"b":{"c":null}}'.encode()


def test_dumps_names_the_type_it_cannot_write():
    with pytest.raises(TypeError, match="^set is not JSON serializable$"):
        dumps({"a": {1}})


def test_dumps_writes_the_same_decimal_at_each_of_its_places():
    cost = Decimal("0.000000665")
    assert dumps({"usage": {"cost": cost}, "again": cost, "list": [cost, cost]}) == (
        b'{"usage":{"cost":0.000000665},"again":0.000000665,"list":[0.000000665,0.000000665]}'
    )


@pytest.mark.parametrize("text", ["None0", "None0None1", "\u0000None0", "0", "1"])
def test_no_string_of_the_payload_passes_for_a_decimals_place(text):
    payload = {"content": text, "cost": Decimal("0.5"), "more": [text, Decimal("2")]}
    assert json.loads(dumps(payload), parse_float=Decimal) == payload
