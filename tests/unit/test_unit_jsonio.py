"""kiln.jsonio: strict parsing of client bodies and exact Decimal output."""

import json
from decimal import Decimal
from enum import Enum, IntEnum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.jsonio import MAX_DEPTH, compact, compact_text, decimal_places, decimal_text, dumps, loads_strict, loads_trusted


def test_accepts_rfc8259_json_with_surrounding_whitespace():
    assert loads_strict(b' \r\n{"a": [1, 2.5, "\xc3\xa9", null, true]}\t\n') == {"a": [1, 2.5, "é", None, True]}
    assert loads_strict(b"1e308") == 1e308


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"a": "\xff"}', id="invalid-utf8"),
        pytest.param(b'{"a": "\xc3"}', id="truncated-utf8"),
        pytest.param(b"NaN", id="nan"),
        pytest.param(b'{"t": Infinity}', id="infinity"),
        pytest.param(b"[-Infinity]", id="minus-infinity"),
        pytest.param(b'{"t": 1e400}', id="float-overflow"),
        pytest.param(b"-1e400", id="negative-overflow"),
        pytest.param(b"1" * 10_000, id="huge-integer"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-arrays"),
        pytest.param(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, id="deep-objects"),
        pytest.param(b'{"a": 1} x', id="trailing-garbage"),
        pytest.param(b'{"a": 1}{"b": 2}', id="two-values"),
        pytest.param(b"", id="empty"),
        pytest.param(b"   ", id="whitespace-only"),
        pytest.param(b"{'a': 1}", id="single-quotes"),
        pytest.param(b'{"a": "\\ud800"}', id="lone-high-surrogate"),
        pytest.param(b'{"a": ["x\\uDFFFy"]}', id="lone-low-surrogate"),
        pytest.param(b'{"\\ud83d": 1}', id="lone-surrogate-in-key"),
        pytest.param(b'{"a": "\\ude00\\ud83d"}', id="surrogates-in-the-wrong-order"),
        pytest.param(b"[" * 201 + b"]" * 201, id="deeper-than-max-depth"),
        pytest.param(b'{"a":' * 960 + b"1" + b"}" * 960, id="depth-the-parser-accepts"),
    ],
)
def test_rejects_bad_input_with_value_error(raw):
    with pytest.raises(ValueError):
        loads_strict(raw)


def test_accepts_surrogate_pairs_and_nesting_up_to_max_depth():
    assert loads_strict(b'"\\ud83d\\ude00"') == "\U0001F600"
    assert loads_strict(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    # many brackets, little depth: no false alarm
    assert len(loads_strict(b"[" + b"[],{}," * 1000 + b"[]]")) == 2001


def exact(raw: bytes):
    return json.loads(raw, parse_float=Decimal)


def test_decimal_written_exactly_without_exponent():
    assert dumps({"cost": Decimal("0.000000665")}) == b'{"cost":0.000000665}'
    out = dumps({"a": Decimal("0.000001155"), "b": Decimal("1E+3"), "c": Decimal("0E-12"), "d": Decimal("2.50")})
    assert b"e" not in out.lower()
    assert exact(out) == {"a": Decimal("0.000001155"), "b": 1000, "c": 0, "d": Decimal("2.5")}


def test_many_decimals_keep_their_positions():
    values = [Decimal(n) / Decimal(10**9) for n in range(1, 25)]
    assert exact(dumps({"values": values, "tail": "x"})) == {"values": values, "tail": "x"}


@pytest.mark.parametrize(
    "text", ["\u00000:0", "\u0000deadbeefdeadbeef:0", "0.000000665", "__decimal_0__", "{0}", "%s"]
)
def test_placeholder_looking_strings_are_not_corrupted(text):
    payload = {"cost": Decimal("0.000000665"), "content": text, "list": [text, Decimal("7")]}
    assert exact(dumps(payload)) == payload


def test_dumps_is_compact_utf8_and_refuses_unknown_types():
    assert dumps({"a": [1, "é"], "b": None}) == '{"a":[1,"é"],"b":null}'.encode()
    with pytest.raises(TypeError):
        dumps({"a": object()})


def test_decimal_text_is_a_plain_number():
    assert decimal_text(Decimal("6.65E-7")) == "0.000000665"
    assert decimal_text(Decimal("-0.00")) == "0"
    assert decimal_text(Decimal("1.2300")) == "1.23"


# Regression: at dff3098, decimal_text() used Decimal.normalize(), which rounds to the context
# precision (28 digits), so longer Decimals were not written exactly.
def test_long_decimal_written_exactly():
    value = Decimal("12345678901234567890.123456789012")
    assert exact(dumps({"v": value})) == {"v": value}


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, -0.0, True, False, None], "é": "\u2028 \"quoted\" \\ \x00 \U0001F600", "nested": {"k": [{}, []]}},
    ["\ud800 lone surrogate"], "text", 10**40, 1e308, {"": ""},
])
def test_compact_writes_what_json_dumps_writes(value):
    """compact_text is json.dumps' own encoder, made once: byte for byte its output. compact
    (orjson, the standard encoder where orjson writes nothing) writes the same JSON values."""
    for ascii_only in (False, True):
        assert compact_text(value, ascii_only=ascii_only) == json.dumps(
            value, ensure_ascii=ascii_only, separators=(",", ":"))
    written = compact(value)
    assert json.loads(written) == json.loads(json.dumps(value))
    if "\ud800" not in json.dumps(value, ensure_ascii=False):  # a lone surrogate is no UTF-8
        assert written.decode() == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    else:
        assert written.isascii()  # written with \\u escapes, as UTF-8 cannot hold it


class Level(IntEnum):
    HIGH = 3


class Word(str, Enum):
    STOP = "stop"


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20))
def test_compact_and_dumps_write_the_values_json_dumps_writes(value):
    """Any plain value, long integers and lone surrogates included: the same JSON value."""
    expected = json.loads(json.dumps(value))
    assert json.loads(compact(value)) == expected
    assert json.loads(dumps(value)) == expected


def test_subclasses_of_json_types_are_written_as_json_dumps_writes_them():
    value = {"level": Level.HIGH, "word": Word.STOP, "flag": True, "cost": Decimal("0.5")}
    assert dumps(value) == b'{"level":3,"word":"stop","flag":true,"cost":0.5}'
    del value["cost"]
    assert compact(value) == json.dumps(value, separators=(",", ":")).encode()


def test_dumps_writes_decimals_exactly_beside_what_only_the_standard_encoder_writes():
    """A long integer or a lone surrogate leaves the value to the standard encoder: its
    Decimals are still written exactly."""
    value = {"big": 10**40, "cost": Decimal("0.000000665"), "text": "\ud800"}
    out = dumps(value)
    assert out.isascii() and b"0.000000665" in out
    assert exact(out) == value


def test_loads_trusted_reads_what_json_loads_reads():
    raw = '{"Attributes":{"n":{"N":"0.000001155"},"s":{"S":"é \\u2028"},"b":{"BOOL":true},"l":{"L":[]}},"C":1.5}'
    assert loads_trusted(raw.encode()) == json.loads(raw)
    with pytest.raises(ValueError):
        loads_trusted(b"{")


def test_loads_trusted_reads_back_what_compact_writes_with_a_lone_surrogate():
    """`compact` writes a lone surrogate (a model server's escape) as an escape; orjson refuses
    to read one back. What the gateway sends AWS, it reads again from AWS's answer."""
    value = {"Item": {"error": {"S": "bad \ud800 text"}}, "Count": 1}
    written = compact(value)
    assert b"\\ud800" in written
    assert loads_trusted(written) == value
    assert loads_trusted(b'{"a":"\\udc00","b":[1,2.5,null]}') == {"a": "\udc00", "b": [1, 2.5, None]}


def test_compact_refuses_what_json_dumps_refuses():
    with pytest.raises(TypeError, match="not JSON serializable"):
        compact_text({"a": object()})
    with pytest.raises(TypeError):
        compact({"cost": Decimal("1")})


def test_what_is_written_holds_no_more_memory_than_its_bytes():
    """A relay keeps some written JSON (item ids) for a whole stream: each is its bytes, not the
    buffer it was written in (orjson's own bytes hold several times their size)."""
    import tracemalloc

    tracemalloc.start()
    try:
        kept = [dumps(f"m{index}") for index in range(1000)] + [compact({"id": f"m{index}"}) for index in range(1000)]
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept) == 2000 and retained / 2000 < 200


@pytest.mark.parametrize("text, places", [
    ("1", 0), ("1.50", 1), ("0.000", 0), ("1E-9", 9), ("12.3E+1", 0), ("-0.0015", 4), ("1e3", 0),
    ("0.0350000000000000000000000000001", 31), ("1.00000000000000000000000000001", 29),
])
def test_decimal_places_are_read_from_the_digits_exactly(text, places):
    assert decimal_places(Decimal(text)) == places


def test_a_model_servers_body_may_open_with_a_byte_order_mark_an_events_data_may_not():
    from kiln.jsonio import ANSWER_MAX_DEPTH, loads_answer

    assert loads_answer(b'\xef\xbb\xbf{"a":1}') == {"a": 1}
    with pytest.raises(ValueError):
        loads_answer(b'\xef\xbb\xbf{"a":1}', body=False)
    deep = b"[" * ANSWER_MAX_DEPTH + b"]" * ANSWER_MAX_DEPTH
    assert loads_answer(deep) is not None  # a request at the clients' bound, repeated a few levels down
    with pytest.raises(ValueError):
        loads_answer(b"[" + deep + b"]")
    with pytest.raises(ValueError):
        loads_strict(deep)
