"""The request path's item encoding equals the pynamodb schema's, field for field."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kiln.settings import Settings
from kiln.store import UnstorableValue, UsageEvent, bind
from kiln.store.codec import from_item, number, to_item, within_digits

EVENTS = [
    UsageEvent(gen_id="gen-01", org_id="acme", created_at="2026-11-30T10:00:00.000Z", key_id="key_1", model="m",
               endpoint="chat.completions", streamed=True, status="success", cost=Decimal("0.000000665"),
               http_status=200, prompt_tokens=5, completion_tokens=7, cached_tokens=2, usage_source="upstream",
               finish_reason="stop", ttfb_ms=12, duration_ms=340, upstream="vllm-a", expires_at=1830000000),
    UsageEvent(gen_id="gen-02", org_id="acme", created_at="2026-11-30T10:00:01.000Z", key_id="key_1", model="m",
               endpoint="completions", streamed=False, status="abandoned", cost=Decimal(0),
               error="lease expired before the request settled"),
    UsageEvent(gen_id="gen-03", org_id="acme", created_at="2026-11-30T10:00:02.000Z", key_id="key_1", model="m",
               endpoint="completions", streamed=False, status="success", cost=Decimal("12345678901234.00000000000001")),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.gen_id)
def test_usage_items_encode_as_pynamodb_does(event):
    record = bind(Settings()).usage(**{k: v for k, v in event.as_dict().items() if v is not None})
    assert to_item(event) == record.serialize()


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.gen_id)
def test_usage_items_decode_back_to_the_same_event(event):
    assert UsageEvent.from_item(to_item(event)) == event
    assert from_item(to_item(event))["cost"] == event.cost


@pytest.mark.parametrize("value", ["1E+999999999", "1e1000000", "-1E+1000000", "1E-1000000", "1E-999999999",
                                   "123456789E+999999999", "NaN", "sNaN", "-Infinity"])
def test_a_number_beyond_any_exponent_is_unstorable_not_an_arithmetic_error(value):
    with pytest.raises(UnstorableValue):
        number(Decimal(value))


@pytest.mark.parametrize(("value", "stored"), [
    ("1E+125", "1" + "0" * 125), ("1E-130", "0." + "0" * 129 + "1"), ("-2.50", "-2.5"), ("0E-999999999", "0"),
    ("12345678901234567890123456789012345678", "12345678901234567890123456789012345678"),
    ("1234567890123456789012345678901234567800000", "1234567890123456789012345678901234567800000"),
])
def test_a_number_dynamodb_takes_is_written_exactly(value, stored):
    assert number(Decimal(value)) == stored


@pytest.mark.parametrize("value", ["1234567890123456789012345678901234567891", "1E+126", "-1E+126", "9E-131", "-9E-131"])
def test_a_number_of_too_many_digits_or_beyond_the_range_is_unstorable(value):
    with pytest.raises(UnstorableValue):
        number(Decimal(value))


@pytest.mark.parametrize(("value", "rounded"), [
    ("0.000000665", "0.000000665"),
    ("1.234567890123456789012345678901234567891", "1.2345678901234567890123456789012345679"),
    ("1E+999999999", "1E+999999999"),  # 1 digit: unchanged, whatever its exponent
    ("1234567890123456789012345678901234567891E+999999999", "1.2345678901234567890123456789012345679E+1000000038"),
    ("1234567890123456789012345678901234567891E-999999999", "1.2345678901234567890123456789012345679E-999999960"),
])
def test_within_digits_rounds_to_38_digits_at_any_exponent(value, rounded):
    assert str(within_digits(Decimal(value))) == str(Decimal(rounded))


@pytest.mark.parametrize("value", [0, 1, -1, 7, 10**37, 10**38 - 1, -(10**38 - 1), 10**38, -(10**38), 10**38 + 1,
                                   12345678901234567890123456789012345678900, 10**125, 10**126, -(10**126),
                                   10**126 - 1])
def test_an_int_is_written_or_refused_as_the_same_decimal_is(value):
    """Ints (counts, times) take a shorter path than Decimals: the same answer either way."""
    try:
        expected = number(Decimal(value))
    except UnstorableValue:
        with pytest.raises(UnstorableValue):
            number(value)
    else:
        assert number(value) == expected
