"""A key's tally (kiln.store.tally): what a settle adds, and what a period's spend reads."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from kiln.store.errors import StorageError
from kiln.store.tally import MAX_BATCH, reads_for, tallied_spends, tally_updates


def _at(*parts: int) -> float:
    return datetime(*parts, tzinfo=timezone.utc).timestamp()


def test_a_charge_adds_to_its_month_and_its_utc_day_and_nothing_for_a_cost_of_zero():
    items = tally_updates("usage", [("key_a", _at(2026, 12, 31, 23, 59, 59), Decimal("0.5")),
                                    ("key_a", _at(2027, 1, 1, 0, 0, 0), Decimal("0.25")),
                                    ("key_b", _at(2026, 12, 31, 12), Decimal(0))])
    updates = {item["Update"]["Key"]["gen_id"]["S"]: item["Update"] for item in items}
    assert set(updates) == {"tally:key_a:2026-12", "tally:key_a:2027-01"}
    december = updates["tally:key_a:2026-12"]
    named = {december["ExpressionAttributeNames"][name]: december["ExpressionAttributeValues"][value]["N"]
             for name, value in (part.split() for part in december["UpdateExpression"][4:].split(", "))}
    assert named == {"month": "0.5", "d31": "0.5"}
    assert "ConditionExpression" not in december  # a tally never fails the transaction it is in


def test_charges_of_one_key_and_month_are_one_update_summed_by_day():
    """A transaction names an item once: a reclaim of several leases of one key adds them up."""
    (item,) = tally_updates("usage", [("key_a", _at(2026, 12, 3, 1), Decimal("1")),
                                      ("key_a", _at(2026, 12, 3, 2), Decimal("2")),
                                      ("key_a", _at(2026, 12, 4, 2), Decimal("-0.5"))])
    update = item["Update"]
    named = {update["ExpressionAttributeNames"][name]: update["ExpressionAttributeValues"][value]["N"]
             for name, value in (part.split() for part in update["UpdateExpression"][4:].split(", "))}
    assert named == {"month": "2.5", "d03": "3", "d04": "-0.5"}


def test_a_period_reads_its_days_or_its_months():
    now = _at(2026, 12, 2, 15)  # a Wednesday; its ISO week began on Monday 30 November
    assert reads_for("key_a", "day", "2026-01-01T00:00:00.000Z", now) == [("tally:key_a:2026-12", "d02")]
    assert reads_for("key_a", "week", "2026-01-01T00:00:00.000Z", now) == [
        ("tally:key_a:2026-11", "d30"), ("tally:key_a:2026-12", "d01"), ("tally:key_a:2026-12", "d02")]
    assert reads_for("key_a", "month", "2026-01-01T00:00:00.000Z", now) == [("tally:key_a:2026-12", "month")]
    total = reads_for("key_a", "total", "2025-11-20T08:00:00.000Z", now)
    assert [item for item, _ in total] == [f"tally:key_a:{month}" for month in
                                           ["2025-11", "2025-12", *(f"2026-{m:02d}" for m in range(1, 13))]]
    assert {attribute for _, attribute in total} == {"month"}
    # a key made later than `now` (a clock behind) reads this month's
    assert reads_for("key_a", "total", "2027-03-01T00:00:00.000Z", now) == [("tally:key_a:2026-12", "month")]
    with pytest.raises(ValueError):
        reads_for("key_a", "year", "2026-01-01T00:00:00.000Z", now)


class _Batches:
    """BatchGetItem as DynamoDB answers it: at most 100 keys, some left unprocessed at first."""

    def __init__(self, items: dict[str, dict], unprocessed_rounds: int) -> None:
        self.items, self.unprocessed_rounds, self.calls = items, unprocessed_rounds, []

    async def dynamodb(self, operation: str, payload: dict) -> dict:
        assert operation == "BatchGetItem"
        (table, request), = payload["RequestItems"].items()
        assert request["ConsistentRead"] is True and len(request["Keys"]) <= MAX_BATCH
        self.calls.append(len(request["Keys"]))
        keys = request["Keys"]
        left = []
        if self.unprocessed_rounds:
            self.unprocessed_rounds -= 1
            keys, left = keys[: len(keys) // 2], keys[len(keys) // 2:]
        found = [self.items[key["gen_id"]["S"]] for key in keys if key["gen_id"]["S"] in self.items]
        answer: dict = {"Responses": {table: found}}
        if left:
            answer["UnprocessedKeys"] = {table: {"Keys": left}}
        return answer


def test_spends_are_summed_over_batches_and_unprocessed_keys_are_asked_again(monkeypatch):
    sleep = asyncio.sleep
    monkeypatch.setattr("kiln.store.tally.asyncio.sleep", lambda seconds: sleep(0))
    items = {f"tally:key_{n}:2026-12": {"gen_id": {"S": f"tally:key_{n}:2026-12"}, "month": {"N": str(n)},
                                        "d02": {"N": "1"}} for n in range(150)}
    client = _Batches(items, unprocessed_rounds=2)
    reads = {f"key_{n}": [(f"tally:key_{n}:2026-12", "month"), (f"tally:key_{n}:2026-11", "month")]
             for n in range(150)}
    reads["key_x"] = [("tally:key_x:2026-12", "d02")]  # no item: spent nothing
    spends = asyncio.run(tallied_spends(client, "usage", reads))
    assert spends == {**{f"key_{n}": Decimal(n) for n in range(150)}, "key_x": Decimal(0)}
    assert max(client.calls) == MAX_BATCH


def test_a_batch_dynamodb_keeps_leaving_unprocessed_is_a_storage_error(monkeypatch):
    sleep = asyncio.sleep
    monkeypatch.setattr("kiln.store.tally.asyncio.sleep", lambda seconds: sleep(0))
    client = _Batches({}, unprocessed_rounds=1000)
    with pytest.raises(StorageError):
        asyncio.run(tallied_spends(client, "usage", {"key_a": [("tally:key_a:2026-12", "month")] * 1}
                                   | {f"key_{n}": [(f"tally:key_{n}:2026-12", "month")] for n in range(4)}))
