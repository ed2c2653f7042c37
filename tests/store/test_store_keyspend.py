"""Spend periods of a key (contract §10): UTC days, ISO weeks from Monday, months, total."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import pytest

from kiln.store.keyspend import (
    KeyLimits,
    figures_of,
    period_kind,
    period_name,
    period_start,
    periods_at,
    resets_at,
    spend_attribute,
    spend_in,
    stale_spend_attributes,
)
from kiln_ops.emulator import item_size


def _at(*parts: int) -> float:
    return datetime(*parts, tzinfo=timezone.utc).timestamp()


def test_each_period_has_its_name_and_its_utc_end():
    wednesday = _at(2026, 12, 2, 15, 0)
    assert periods_at(wednesday) == ("2026-12-02", "2026-W49", "2026-12", "total")
    assert resets_at("day", wednesday) == datetime(2026, 12, 3, tzinfo=timezone.utc)
    assert resets_at("week", wednesday) == datetime(2026, 12, 7, tzinfo=timezone.utc)  # the next Monday
    assert resets_at("month", _at(2026, 12, 31, 23, 59)) == datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert resets_at("total", wednesday) is None


def test_iso_weeks_cross_years_and_a_monday_starts_a_new_week():
    assert period_name("week", _at(2027, 1, 1)) == "2026-W53"  # a Friday of 2026's last ISO week
    assert period_name("week", _at(2026, 12, 6, 23, 59, 59)) == "2026-W49"
    assert period_name("week", _at(2026, 12, 7)) == "2026-W50"
    assert resets_at("week", _at(2026, 12, 7)) == datetime(2026, 12, 14, tzinfo=timezone.utc)


def test_an_unknown_period_is_refused():
    with pytest.raises(ValueError, match="day, week, month, total"):
        period_name("year", 0)


def test_spend_is_read_for_the_current_period_and_past_periods_are_stale():
    now = _at(2026, 12, 2, 12)
    item = {
        spend_attribute("key_a", "2026-12-02"): {"N": "0.5"},
        spend_attribute("key_a", "2026-12-01"): {"N": "9"},
        spend_attribute("key_a", "2026-W49"): {"N": "9.5"},
        spend_attribute("key_a", "2026-11"): {"N": "3"},
        spend_attribute("key_a", "total"): {"N": "12.5"},
        "credits": {"N": "1"},
    }
    assert spend_in(item, "key_a", "day", now) == Decimal("0.5")
    assert spend_in(item, "key_a", "week", now) == Decimal("9.5")
    assert spend_in(item, "key_a", "month", now) == 0
    assert spend_in(item, "key_b", "total", now) == 0
    assert sorted(stale_spend_attributes(item, now)) == ["key_spend:key_a:2026-11", "key_spend:key_a:2026-12-01"]


@pytest.mark.parametrize("behind, ahead", [
    ((2026, 12, 7, 23, 59, 59), "2026-12-08"),  # a day
    ((2026, 12, 13, 23, 59, 59), "2026-W51"),  # a week
    ((2027, 1, 3, 23, 59, 59), "2027-W01"),  # ISO 2026-W53 to 2027-W01
    ((2026, 12, 31, 23, 59, 59), "2027-01"),  # a month, a year
])
def test_a_figure_of_a_later_period_than_this_clocks_is_never_stale(behind, ahead):
    """A gateway whose clock ran a moment behind, still in the period that had just ended, took
    the new period's figure for stale and removed it at its next admission: what the key had
    spent since the turn was gone, and the key admitted past its limit."""
    item = {spend_attribute("key_a", ahead): {"N": "0.00002"}}
    assert stale_spend_attributes(item, _at(*behind)) == []


def test_a_figure_of_the_period_just_ended_stays_while_a_clock_behind_may_still_count_in_it():
    """A gateway whose clock ran ahead removed the figure of the period just ended at once: one
    a moment behind, still admitting in that period, then read the key's spend there as 0."""
    from kiln.store.keyspend import PERIOD_GRACE_SECONDS

    item = {spend_attribute("key_a", "2026-12-07"): {"N": "9"}, spend_attribute("key_a", "2026-W50"): {"N": "9"},
            spend_attribute("key_a", "2026-12"): {"N": "9"}, spend_attribute("key_a", "total"): {"N": "9"}}
    turn = _at(2026, 12, 8)
    assert stale_spend_attributes(item, turn + 1) == []
    assert stale_spend_attributes(item, turn + PERIOD_GRACE_SECONDS - 1) == []
    assert stale_spend_attributes(item, turn + PERIOD_GRACE_SECONDS + 1) == ["key_spend:key_a:2026-12-07"]
    month = {spend_attribute("key_a", "2026-11"): {"N": "9"}}
    assert stale_spend_attributes(month, _at(2026, 12, 1) + PERIOD_GRACE_SECONDS - 1) == []
    assert stale_spend_attributes(month, _at(2026, 12, 1) + PERIOD_GRACE_SECONDS + 1) == ["key_spend:key_a:2026-11"]


def test_each_period_starts_where_the_previous_one_reset_and_a_name_tells_its_kind():
    moment = _at(2026, 12, 2, 15, 0)
    for period in ("day", "week", "month"):
        start = period_start(period, moment)
        assert start.timestamp() <= moment < resets_at(period, moment).timestamp()
        assert resets_at(period, start.timestamp() - 1) == start  # the previous period ends where this begins
        assert period_kind(period_name(period, moment)) == period
    assert period_start("total", moment) is None and period_kind("total") == "total"


def test_only_a_key_with_a_spend_limit_has_a_figure_and_it_names_its_own_period():
    moment = _at(2026, 12, 2, 15, 0)
    assert KeyLimits(concurrency=2).figure("key_a", moment) is None
    assert KeyLimits(spend_limit=Decimal(5), spend_period="month").figure("key_a", moment) == "key_spend:key_a:2026-12"
    item = {"key_spend:key_a:2026-12": {"N": "1"}, "key_spend:key_ab:total": {"N": "1"}, "key_leases:key_a": {"SS": ["g"]}}
    assert figures_of(item, "key_a") == ["key_spend:key_a:2026-12"]  # not key_ab's


# -- the org item at the cap of keys with a limit -------------------------------------------------


def test_an_org_at_the_cap_of_limited_keys_still_serves_twice_its_concurrency_a_second():
    """Every admission (an UpdateItem, 1 WCU per KB) and settle (a transaction, 2 WCU per KB,
    and the usage event) writes the whole org item, and one item lives in one partition: 1 000
    WCU a second at most. At MAX_LIMITED_KEYS keys with a limit, each with its marker and, at
    a period's turn, two figures, and 8 requests in flight, the org must still be served 16
    requests a second (its 8 slots, half-second requests) before DynamoDB throttles it."""
    import math
    import secrets
    import time

    from kiln.store.keyring import MAX_LIMITED_KEYS
    from kiln.store.keyspend import marker_attribute
    from kiln.store.ledger import Lease

    now = time.time()
    item = {"org_id": {"S": "org-acme"}, "status": {"S": "active"}, "credits": {"N": "1234.567891"},
            "concurrency_limit": {"N": "8"}, "created_at": {"S": "2026-12-01T00:00:00.000Z"}}
    keys = [f"key_{secrets.token_hex(8)}" for _ in range(MAX_LIMITED_KEYS)]
    for key_id in keys:
        item[marker_attribute(key_id)] = {"S": "day"}
        for moment in (now - 86400, now):  # last period's figure, and this one's
            item[spend_attribute(key_id, period_name("day", moment))] = {"N": "3.141592653"}
    leases = {}
    for index in range(8):
        lease = Lease(f"gen-{index:026x}", "org-acme", keys[index], "qwen3-32b", "chat.completions", True, now,
                      now + 60, spend_figure=spend_attribute(keys[index], period_name("day", now)))
        leases[lease.gen_id] = lease.to_attribute()
    item["leases"] = {"M": leases}
    kb = math.ceil(item_size(item) / 1024)  # as DynamoDB bills it (its guide's "Item sizes and formats")
    per_request = kb + 2 * kb + 2  # admission, settle (the event, ~1 KB, in the same transaction)
    assert 1000 / per_request >= 16, f"org item {kb} KB: {per_request} WCU a request, {1000 / per_request:.1f} a second"


def test_the_largest_org_item_the_limits_allow_stays_below_dynamodbs_400_kb():
    """An org at the most requests in flight (MAX_ORG_CONCURRENCY), each renewed (its tokens and
    cost recorded) for a model of the longest id the catalog takes, with the most keys with a limit,
    each with its marker, the figures of a period's turn and a clock ahead's, and a set of
    requests in flight. Model ids had no bound: at 8 000 characters, 47 leases filled the item, and
    the 48th admission and every renewal were refused (503, requests stopped) far below the limit."""
    import secrets
    import time

    from kiln.catalog import MAX_MODEL_ID_BYTES
    from kiln.settings import MAX_ORG_CONCURRENCY
    from kiln.store.keyring import MAX_LIMITED_KEYS
    from kiln.store.keyspend import leases_attribute, marker_attribute
    from kiln.store.ledger import Lease

    now = time.time()
    model = "é" * (MAX_MODEL_ID_BYTES // 2)  # two bytes a character: the longest id, in bytes
    item = {"org_id": {"S": "o" * 63}, "status": {"S": "active"}, "credits": {"N": "-" + "9" * 16 + "." + "9" * 15},
            "concurrency_limit": {"N": str(MAX_ORG_CONCURRENCY)}, "created_at": {"S": "2026-12-01T00:00:00.000Z"},
            "limited_keys": {"N": str(MAX_LIMITED_KEYS)}}
    keys = [f"key_{secrets.token_hex(8)}" for _ in range(MAX_LIMITED_KEYS)]
    for key_id in keys:
        item[marker_attribute(key_id)] = {"S": "month"}
        for moment in (now - 31 * 86400, now, now + 31 * 86400):  # the month ended, this one, a clock ahead's
            item[spend_attribute(key_id, period_name("month", moment))] = {"N": "9" * 23 + "." + "9" * 15}
    leases = {}
    for index in range(MAX_ORG_CONCURRENCY):
        key_id = keys[index % len(keys)]
        lease = Lease(f"gen-{index:026x}", "org", key_id, model, "chat.completions", True, now, now + 60,
                      spend_figure=spend_attribute(key_id, period_name("month", now)))
        attribute = lease.to_attribute()
        attribute["M"].update({"pt": {"N": str(10**12)}, "ct": {"N": str(10**12)},
                               "cost": {"N": "1999999999999.999999999999999"}})
        leases[lease.gen_id] = attribute
        item.setdefault(leases_attribute(key_id), {"SS": []})["SS"].append(lease.gen_id)
    item["leases"] = {"M": leases}
    size = item_size(item)
    assert size < 400 * 1024 * 3 // 4, f"the largest org item is {size} bytes"
    assert len(model.encode()) == MAX_MODEL_ID_BYTES
