"""Each key's spend, summed month by month beside its usage events (contract §10).

A key's spend in its period (`GET /v1/key`, `GET /v1/keys`, and the seed of a new spend
limit) is the sum of its usage events in that period. Summed from the events themselves it
would read every event of the org since the period began (the `by_org_time` index knows no
key), since the key was made for a `total` period, and once a usage retention is set the
events that expired would be missing from it. So every write of a usage event (a settle, a
reclaim's `abandoned` event, the replacement of one) adds the event's cost, in the same
transaction, to one item per key and UTC month in the usage table:

    gen_id    "tally:<key id>:<YYYY-MM>"   not a generation id: GET /v1/generations never
                                           finds it; no org_id or created_at: no usage
                                           query or report sees it
    month     the month's sum
    d01..d31  each day's sum

An item holds at most 32 numbers (well under 1 KB: one write unit, two in a transaction).
A day, a week (across two months at most) or a month is read from one or two items; `total`
from one item a month of the key's life, in batches. Tallies do not expire with the events.
A request counts in the period it was admitted in, as its event's `created_at` does.

Keys made before tallies were kept have no `tallied` mark on their key item: their spend
is still summed from their events (kiln.store.usage.key_costs) until their events are added
to their tallies (kiln.store.tally_backfill, `kiln admin keys tally`).
"""

from __future__ import annotations

import asyncio
import random
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from .codec import exact_sum, number
from .errors import StorageError
from .keyspend import period_start
from .schema import TALLY

__all__ = ["MAX_BATCH", "TALLY_PREFIX", "is_tally", "tally_id", "tally_updates", "tallied_spends", "reads_for"]

TALLY_PREFIX = "tally:"
MAX_BATCH = 100  # BatchGetItem's most keys a call
_UNPROCESSED_ATTEMPTS = 8


def _day(moment: float) -> date:
    return datetime.fromtimestamp(moment, timezone.utc).date()


def tally_id(key_id: str, month: date) -> str:
    return f"{TALLY_PREFIX}{key_id}:{month.strftime('%Y-%m')}"


def is_tally(item_id: str) -> bool:
    return item_id.startswith(TALLY_PREFIX)


def _day_attribute(day: date) -> str:
    return f"d{day.day:02d}"


@lru_cache(maxsize=16)
def _names_on(epoch_day: int) -> tuple[str, str]:
    """(the month's "YYYY-MM", the day's attribute) of a UTC day: worked out once a day."""
    day = date(1970, 1, 1) + timedelta(days=epoch_day)
    return day.strftime("%Y-%m"), _day_attribute(day)


def tally_updates(table: str, charges: Iterable[tuple[str, float, Decimal]]) -> list[dict[str, Any]]:
    """The transaction items that add each (key id, moment admitted, cost) to its key's tally:
    one Update per key and month (a transaction names an item once), none for a cost of 0."""
    sums: dict[str, dict[str, Decimal]] = {}
    for key_id, moment, cost in charges:
        if not cost:
            continue
        month, day = _names_on(int(moment // 86400))
        days = sums.setdefault(f"{TALLY_PREFIX}{key_id}:{month}", {})
        days[day] = exact_sum(days[day], cost) if day in days else cost
    items = []
    for item_id, days in sums.items():
        names = {"#month": TALLY.month}
        month_sum = exact_sum(*days.values()) if len(days) > 1 else next(iter(days.values()))
        values = {":month": {"N": number(month_sum)}}
        adds = ["#month :month"]
        for index, (attribute, amount) in enumerate(sorted(days.items())):
            names[f"#d{index}"], values[f":d{index}"] = attribute, {"N": number(amount)}
            adds.append(f"#d{index} :d{index}")
        items.append({"Update": {
            "TableName": table,
            "Key": {TALLY.hash_key: {"S": item_id}},
            "UpdateExpression": "ADD " + ", ".join(adds),
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }})
    return items


def reads_for(key_id: str, period: str, created_at: str, now: float) -> list[tuple[str, str]]:
    """(tally item id, attribute) pairs whose sum is the key's spend in the current `period`
    at `now`; `created_at` (ISO 8601) bounds a `total` period."""
    today = _day(now)
    if period == "day":
        return [(tally_id(key_id, today), _day_attribute(today))]
    if period == "week":
        start = period_start("week", now)
        assert start is not None
        days = [start.date() + timedelta(days=offset) for offset in range((today - start.date()).days + 1)]
        return [(tally_id(key_id, day), _day_attribute(day)) for day in days]
    if period == "month":
        return [(tally_id(key_id, today), TALLY.month)]
    if period == "total":
        month = _created_month(created_at, today)
        reads = []
        while month <= today:
            reads.append((tally_id(key_id, month), TALLY.month))
            month = (month + timedelta(days=32)).replace(day=1)
        return reads
    raise ValueError(f"no such spend period: {period!r}")


def _created_month(created_at: str, today: date) -> date:
    """The first day of the month the key was made in (this month if unreadable or later)."""
    try:
        made = datetime.fromisoformat(created_at.replace("Z", "+00:00")).astimezone(timezone.utc).date()
    except ValueError:
        made = today
    return min(made, today).replace(day=1)


async def tallied_spends(aws: Any, table: str, reads: Mapping[str, Sequence[tuple[str, str]]]) -> dict[str, Decimal]:
    """Key id -> the sum of its (item, attribute) pairs, the items read consistently in batches."""
    wanted = sorted({item_id for pairs in reads.values() for item_id, _ in pairs})
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(wanted), MAX_BATCH):
        found.update(await _batch(aws, table, wanted[start:start + MAX_BATCH]))
    spends = {}
    for key_id, pairs in reads.items():
        total = Decimal(0)
        for item_id, attribute in pairs:
            raw = found.get(item_id, {}).get(attribute, {}).get("N")
            if raw is not None:
                total = exact_sum(total, Decimal(raw))
        spends[key_id] = total
    return spends


async def _batch(aws: Any, table: str, item_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Up to MAX_BATCH tally items by id (those that exist), what DynamoDB leaves unprocessed
    asked again after a pause; StorageError if some still are."""
    keys = [{TALLY.hash_key: {"S": item_id}} for item_id in item_ids]
    found: dict[str, dict[str, Any]] = {}
    for attempt in range(_UNPROCESSED_ATTEMPTS):
        if attempt:
            await asyncio.sleep(random.random() * min(1.0, 0.05 * 2**attempt))
        answer = await aws.dynamodb("BatchGetItem", {"RequestItems": {table: {"Keys": keys, "ConsistentRead": True}}})
        for item in answer.get("Responses", {}).get(table, []):
            found[item[TALLY.hash_key]["S"]] = item
        keys = answer.get("UnprocessedKeys", {}).get(table, {}).get("Keys") or []
        if not keys:
            return found
    raise StorageError(f"{len(keys)} spend tallies left unread", "ProvisionedThroughputExceededException")
