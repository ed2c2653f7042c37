"""The keys' tallies through the ledger (kiln.store.tally): a key's tally, month by month and
UTC day by day, equals the sum of its usage events' costs (check_tallies), to the 38th digit,
at the edges of days and months, and once the events of a version that kept no tallies are
added to them (kiln.store.tally_backfill), however that races a late settle."""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from kiln.store import UsageEvent
from kiln.store.clock import epoch_of, iso_ms
from kiln.store.codec import exact_sum
from kiln.store.keys import create_key, with_keyring
from kiln.store.tally_backfill import tally_org
from support import check_tallies, made_before_tallies, older_event, with_clocked_ledger

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}]}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def event_of(lease, cost: str, status: str = "success") -> UsageEvent:
    """The usage event the gateway writes for `lease` (kiln.exchange: created_at = iso_ms(lease.started))."""
    return UsageEvent(gen_id=lease.gen_id, org_id=lease.org_id, created_at=iso_ms(lease.started), key_id=lease.key_id,
                      model=lease.model, endpoint=lease.endpoint, streamed=False, status=status, cost=Decimal(cost),
                      prompt_tokens=3, completion_tokens=4)


def admit_args(org_id: str, key_id: str) -> dict:
    return dict(org_id=org_id, key_id=key_id, model="gpt-oss-120b", endpoint="chat.completions", streamed=False)


# -- sums of more digits than Python's default context --------------------------------------------


def test_costs_whose_sum_has_more_than_28_digits_are_tallied_exactly_as_their_events_store_them(stack):
    """A cost has up to 15 decimal places (kiln.catalog.PRICE_DECIMALS) and the dearest bill the
    usage bounds allow is at most $2E12 (kiln.metering.MAX_REQUEST_TOKENS): 28 digits. Summed in
    Python's default context (28 digits), a tally of several got its sum rounded and stopped
    equalling the sum of the key's events (a reclaim summing several leases of one key and day,
    and a late settle's difference, rounded the same way). Six such bills admitted together, as
    an org's in-flight requests are, settle with credits, events and tallies all exact."""
    org_id, _ = stack.org(credits="10")
    key = create_key(stack.tables, org_id, label="unlimited")
    cost = "1999999999999.999999999999997"  # 28 significant digits
    leases = [stack.ledger.admit(**admit_args(org_id, key.key_id)) for _ in range(6)]
    for lease in leases:
        assert stack.ledger.settle(lease, event_of(lease, cost)) == "settled"
    events = stack.events(org_id)
    assert [event.cost for event in events] == [Decimal(cost)] * 6  # stored exactly
    total = Decimal("11999999999999.999999999999982")  # 29 significant digits
    assert stack.org_info(org_id).credits == Decimal("-11999999999989.999999999999982")  # 10 - total, exactly
    tallies = stack.key_tallies(org_id)
    month = events[0].created_at[:7]
    days = {"d" + event.created_at[8:10] for event in events}
    assert exact_sum(*(tallies[(key.key_id, month, day)] for day in days)) == total, tallies
    assert tallies[(key.key_id, month, "month")] == total, tallies


# -- a day's edge ---------------------------------------------------------------------------------


def test_a_late_settle_of_a_lease_admitted_a_fraction_of_a_microsecond_before_midnight_keeps_the_tally(stack):
    """A lease admitted at 2026-12-31T23:59:59.9999998Z (time.time() has finer steps than a
    microsecond). Stored, its start is cut to the millisecond (Lease.to_attribute: 23:59:59.999,
    December); in the gateway's memory it is not, and datetime.fromtimestamp rounds it to the
    microsecond: 2027-01-01T00:00:00. The reclaim bills its abandoned event and tallies it in
    December (from the stored lease); the late settle replaced that event with one created
    2027-01-01T00:00:00.000Z and tallied only the difference, in January (from the lease in
    memory): the events said $0.5 on 1 January, the tallies $0.1 on 31 December and $0.4 on
    1 January. The lease now starts at its stored millisecond."""
    org_id, _ = stack.org(credits="10", concurrency=1)
    key = create_key(stack.tables, org_id, label="midnight")
    midnight = datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp()
    clock = Clock(math.nextafter(midnight, 0))  # 0.2 µs before midnight

    async def scenario(ledger):
        dead = await ledger.admit(**admit_args(org_id, key.key_id))
        clock.now = midnight + 1
        assert await ledger.renew(dead, (3, 2, Decimal("0.1"))) is not None
        clock.now = midnight + 10 * ledger.lease_ttl  # the gateway that held it died: expired
        other = await ledger.admit(**admit_args(org_id, key.key_id))  # reclaims `dead` first (org full)
        await ledger.drain()
        assert await ledger.settle(other, event_of(other, "0.2")) == "settled"
        # the request that was reclaimed settles after all, for $0.5
        return dead, await ledger.settle(dead, event_of(dead, "0.5"))

    dead, outcome = with_clocked_ledger(stack.settings, clock, scenario)
    assert outcome == "replaced_abandoned"
    events = stack.events(org_id)
    assert sorted(e.cost for e in events) == [Decimal("0.2"), Decimal("0.5")]
    check_tallies(stack, org_id, events)


# -- a month's edge, and a read refused ------------------------------------------------------------


def test_a_reclaim_of_one_keys_leases_across_a_month_boundary_and_their_late_settles_keep_the_tally(stack):
    org_id, _ = stack.org(credits="10", concurrency=2)
    key = create_key(stack.tables, org_id, label="boundary")
    midnight = datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
    clock = Clock(midnight - 0.5)

    async def scenario(ledger):
        november = await ledger.admit(**admit_args(org_id, key.key_id))
        clock.now = midnight + 0.5
        december = await ledger.admit(**admit_args(org_id, key.key_id))
        clock.now = midnight + 1
        assert await ledger.renew(november, (3, 2, Decimal("0.1"))) is not None
        assert await ledger.renew(december, (3, 2, Decimal("0.3"))) is not None
        clock.now = midnight + 10 * ledger.lease_ttl
        third = await ledger.admit(**admit_args(org_id, key.key_id))  # reclaims both, in one transaction
        await ledger.drain()
        outcomes = [await ledger.settle(third, event_of(third, "0.01")),
                    await ledger.settle(november, event_of(november, "0.05")),  # less than billed
                    await ledger.settle(december, event_of(december, "0.3")),  # the same: no difference
                    await ledger.settle(december, event_of(december, "0.7"))]  # twice: already settled
        return outcomes

    outcomes = with_clocked_ledger(stack.settings, clock, scenario)
    assert outcomes == ["settled", "replaced_abandoned", "replaced_abandoned", "already_settled"]
    events = stack.events(org_id)
    assert sorted(e.created_at[:10] for e in events) == ["2026-11-30", "2026-12-01", "2026-12-01"]
    check_tallies(stack, org_id, events)


def test_a_throttled_tally_read_is_a_503(stack):
    org_id, _ = stack.org()
    key = create_key(stack.tables, org_id, label="read")
    assert stack.post(CHAT, BODY, key.secret).status_code == 200
    stack.faults.fail("BatchGetItem")
    try:
        response = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {key.secret}"})
    finally:
        stack.faults.clear()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "storage_unavailable"


# -- events of a version that kept no tallies (kiln.store.tally_backfill, `kiln admin keys tally`) ---------


def key_item(stack, key_id: str) -> dict:
    (item,) = stack.dynamodb.query(TableName=stack.settings.keys_table, IndexName="by_key_id",
                                   KeyConditionExpression="key_id = :id",
                                   ExpressionAttributeValues={":id": {"S": key_id}})["Items"]
    return item


def as_if_written_before_tallies(stack, org_id: str) -> None:
    """Every event of the org unmarked and every tally of its keys gone: the older version's world."""
    for event in stack.events(org_id):
        stack.dynamodb.update_item(TableName=stack.settings.usage_table, Key={"gen_id": {"S": event.gen_id}},
                                   UpdateExpression="REMOVE tallied")
        assert "tallied" not in stack.dynamodb.get_item(TableName=stack.settings.usage_table,
                                                        Key={"gen_id": {"S": event.gen_id}})["Item"]
    for key_id, month, _ in list(stack.key_tallies(org_id)):
        stack.dynamodb.delete_item(TableName=stack.settings.usage_table,
                                   Key={"gen_id": {"S": f"tally:{key_id}:{month}"}})
    assert not stack.key_tallies(org_id)


def spends(stack, org_id: str) -> dict[str, Decimal]:
    """Each key's spend, as GET /v1/keys and `kiln admin keys list` read it."""
    async def read(keyring):
        return {row["id"]: Decimal(str(row["spend"])) for row in await keyring.describe(org_id, await keyring.list(org_id))}

    return with_keyring(stack.tables, read)


def tally_events(stack, org_id: str):
    return with_keyring(stack.tables, lambda keyring: keyring.tally_events(org_id))


def test_an_older_versions_events_are_added_once_and_its_keys_then_read_as_much_from_their_tallies(stack):
    org_id, _ = stack.org(credits="10")
    key = create_key(stack.tables, org_id, label="older")
    made_before_tallies(stack, key.key_id, "2026-10-15T08:00:00.000Z")
    for created_at, cost in [("2026-10-31T23:59:59.999Z", "0.1"), ("2026-11-01T00:00:00.000Z", "0.02"),
                             ("2026-11-30T12:00:00.000Z", "0"), (iso_ms(epoch_of(key.created_at)), "0.003")]:
        older_event(stack, org_id, key.key_id, created_at, cost)
    # and one the ledger of this version settled: marked, and in the tally already
    lease = stack.ledger.admit(**admit_args(org_id, key.key_id))
    assert stack.ledger.settle(lease, event_of(lease, "0.0004")) == "settled"
    before = spends(stack, org_id)
    assert before[key.key_id] == Decimal("0.1234")  # summed from its events (period: total)

    done, marked = tally_events(stack, org_id)
    assert (done.added, done.cost, done.found_tallied, done.free) == (3, Decimal("0.123"), 0, 1)
    assert marked == [key.key_id] and key_item(stack, key.key_id)["tallied"] == {"BOOL": True}
    check_tallies(stack, org_id, stack.events(org_id))  # every event once, month by month and day by day
    assert spends(stack, org_id) == before

    again, marked = tally_events(stack, org_id)
    assert (again.added, again.found_tallied, marked) == (0, 0, [])
    check_tallies(stack, org_id, stack.events(org_id))
    # an older function still settling after the upgrade: the next run adds it
    older_event(stack, org_id, key.key_id, iso_ms(epoch_of(key.created_at) + 1), "0.5")
    late, _ = tally_events(stack, org_id)
    assert (late.added, late.cost) == (1, Decimal("0.5"))
    check_tallies(stack, org_id, stack.events(org_id))
    assert spends(stack, org_id)[key.key_id] == Decimal("0.6234")


@pytest.mark.parametrize("order", ["tallied_first", "replaced_first", "tallied_between_read_and_write"])
def test_a_late_settle_replacing_an_older_versions_abandoned_event_and_the_backfill_add_it_once(stack, order):
    """A lease reclaimed as abandoned ($0.1 billed) by the older version: its event is in no tally.
    Its request settles late for $0.5: the tally needs the whole $0.5, not the difference, unless
    the backfill added the $0.1 first; the backfill must not add the $0.1 once it is replaced."""
    org_id, _ = stack.org(credits="10", concurrency=1)
    key = create_key(stack.tables, org_id, label="late")
    clock = Clock(math.floor(epoch_of(key.created_at)) + 1)
    usage_table = stack.settings.usage_table

    async def scenario(ledger):
        dead = await ledger.admit(**admit_args(org_id, key.key_id))
        clock.now += 1
        assert await ledger.renew(dead, (3, 2, Decimal("0.1"))) is not None
        clock.now += 10 * ledger.lease_ttl
        other = await ledger.admit(**admit_args(org_id, key.key_id))  # reclaims `dead` (org full)
        await ledger.drain()
        assert await ledger.settle(other, event_of(other, "0.2")) == "settled"
        await asyncio.to_thread(as_if_written_before_tallies, stack, org_id)
        if order == "tallied_first":
            assert (await tally_org(ledger._aws, usage_table, org_id)).added == 2
        elif order == "tallied_between_read_and_write":
            read = ledger._read_event

            async def racing(gen_id):
                found = await read(gen_id)
                if ledger._read_event is racing:
                    ledger._read_event = read
                    assert (await tally_org(ledger._aws, usage_table, org_id)).added == 2
                return found

            ledger._read_event = racing
        outcome = await ledger.settle(dead, event_of(dead, "0.5"))
        if order == "replaced_first":
            backfill = await tally_org(ledger._aws, usage_table, org_id)
            assert (backfill.added, backfill.cost) == (1, Decimal("0.2"))
        return outcome

    assert with_clocked_ledger(stack.settings, clock, scenario) == "replaced_abandoned"
    events = stack.events(org_id)
    assert sorted(event.cost for event in events) == [Decimal("0.2"), Decimal("0.5")]
    check_tallies(stack, org_id, events)
    assert stack.org_info(org_id).credits == Decimal("9.3")
