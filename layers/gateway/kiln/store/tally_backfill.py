"""The events of a version that kept no tallies, added to their keys' tallies (`kiln admin keys tally`).

Every event the ledger writes is marked `tallied`: its transaction added its cost to its
key's tally (kiln.store.tally). An event written before tallies were kept (or, during an
upgrade, by a function still running the older version) has no mark and is in no tally, and
a key made then has no `tallied` mark of its own, so its spend is summed from its events.

`tally_org` adds each unmarked event of an org to its key's tally, marking it in the same
transaction on the condition that it is still unmarked and its cost is as read; a late
settle replacing an abandoned event of the older version is conditioned on the mark the
other way round (kiln.store.ledger), so either adds the event's cost once. Then the org's
keys are marked (Keyring.mark_tallied) and their spend is read from their tallies. It can be
run again: an event is added once, and what an older function wrote since is added then.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, AsyncIterator, Callable

from .clock import epoch_of
from .codec import exact_sum, number
from .errors import TransactionCancelled, translate_storage_error
from .retry import RetryPolicy, client_token
from .schema import USAGE
from .tally import tally_updates

__all__ = ["TallyBackfill", "tally_org"]

# the transactions in flight at once (each one event and its key's tally for one month)
CONCURRENCY = 8


@dataclass
class TallyBackfill:
    """What `tally_org` did: the events it added to their keys' tallies, and their cost; those
    found tallied meanwhile (a late settle replaced it, another run added it); those of no cost."""

    added: int = 0
    cost: Decimal = field(default_factory=Decimal)
    found_tallied: int = 0
    free: int = 0

    def __iadd__(self, other: "TallyBackfill") -> "TallyBackfill":
        self.added += other.added
        self.cost = exact_sum(self.cost, other.cost)
        self.found_tallied += other.found_tallied
        self.free += other.free
        return self


async def tally_org(aws: Any, usage_table: str, org_id: str, *, retry: RetryPolicy | None = None,
                    progress: Callable[[TallyBackfill], None] | None = None) -> TallyBackfill:
    """Add each of the org's unmarked events to its key's tally, marking it (`progress` is told
    every 512 events)."""
    policy = retry or RetryPolicy()
    done = TallyBackfill()

    async def add(event: dict[str, Any]) -> None:
        outcome = await _add_one(aws, usage_table, event, policy)
        if outcome == "added":
            done.added += 1
            done.cost = exact_sum(done.cost, Decimal(event[USAGE.cost]["N"]))
        else:
            done.found_tallied += 1

    batch: list[dict[str, Any]] = []
    told = -1  # the count progress was last told
    async for event in _untallied(aws, usage_table, org_id):
        if not Decimal(event.get(USAGE.cost, {}).get("N", "0")):
            done.free += 1  # nothing to add: it stays unmarked (and is read again by the next run)
            continue
        batch.append(event)
        if len(batch) == CONCURRENCY:
            await asyncio.gather(*(add(one) for one in batch))
            batch = []
            if progress is not None and (done.added + done.found_tallied) % 512 == 0:
                progress(done)
                told = done.added + done.found_tallied
    await asyncio.gather(*(add(one) for one in batch))
    if progress is not None and done.added + done.found_tallied != told:  # the last count, said once
        progress(done)
    return done


async def _untallied(aws: Any, usage_table: str, org_id: str) -> AsyncIterator[dict[str, Any]]:
    """The org's events without the mark, oldest first (gen_id, key_id, created_at, cost)."""
    payload: dict[str, Any] = {
        "TableName": usage_table,
        "IndexName": "by_org_time",
        "KeyConditionExpression": "#org = :org",
        "FilterExpression": "attribute_not_exists(#tallied)",
        "ProjectionExpression": "#gen, #key, #created, #cost",
        "ExpressionAttributeNames": {"#org": USAGE.org_id, "#tallied": USAGE.tallied, "#gen": USAGE.gen_id,
                                     "#key": USAGE.key_id, "#created": USAGE.created_at, "#cost": USAGE.cost},
        "ExpressionAttributeValues": {":org": {"S": org_id}},
    }
    while True:
        page = await aws.dynamodb("Query", payload)
        for item in page.get("Items", []):
            yield item
        if not page.get("LastEvaluatedKey"):
            return
        payload["ExclusiveStartKey"] = page["LastEvaluatedKey"]


async def _add_one(aws: Any, usage_table: str, event: dict[str, Any], policy: RetryPolicy) -> str:
    """Mark the event and add its cost to its key's tally, in one transaction: "added", or
    "found_tallied" when it was marked (or replaced, or expired) since it was read."""
    gen_id, cost = event[USAGE.gen_id]["S"], Decimal(event[USAGE.cost]["N"])
    mark = {"Update": {
        "TableName": usage_table,
        "Key": {USAGE.hash_key: {"S": gen_id}},
        "UpdateExpression": "SET #tallied = :yes",
        "ConditionExpression": "attribute_not_exists(#tallied) AND #cost = :cost",
        "ExpressionAttributeNames": {"#tallied": USAGE.tallied, "#cost": USAGE.cost},
        "ExpressionAttributeValues": {":yes": {"BOOL": True}, ":cost": {"N": number(cost)}},
    }}
    tally = tally_updates(usage_table, [(event[USAGE.key_id]["S"], epoch_of(event[USAGE.created_at]["S"]), cost)])
    # sent again after a lost answer, it is told it succeeded (not that the event is tallied)
    payload = {"TransactItems": [mark, *tally], "ClientRequestToken": client_token("b", f"{gen_id}|{number(cost)}")}

    async def call() -> Any:
        try:
            return await aws.dynamodb("TransactWriteItems", payload)
        except Exception as exc:  # noqa: BLE001 - translated into the storage error tree
            raise translate_storage_error(exc) from exc

    try:
        await policy.run(call, what="tally backfill")
    except TransactionCancelled as cancelled:
        if cancelled.failed_condition(0):
            return "found_tallied"
        raise
    return "added"
