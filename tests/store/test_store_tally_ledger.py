"""The keys' tallies through the ledger (kiln.store.tally): a key's tally, month by month and
UTC day by day, equals the sum of its usage events' costs (check_tallies), to the 38th digit
and at the edges of days and months."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from decimal import Decimal

from kiln.store import UsageEvent
from kiln.store.clock import iso_ms
from kiln.store.keys import create_key
from support import check_tallies, with_clocked_ledger

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


# -- costs of 38 digits ----------------------------------------------------------------------------


def test_a_settled_cost_of_38_digits_is_tallied_exactly_as_its_event_stores_it(stack):
    """Costs are kept to DynamoDB's 38 significant digits (kiln.metering: "what is billed is
    exactly what is stored"; a catalog price such as 35/12 $ per 1M written to 35 digits gives
    one). The settle stores the event's cost and debits the credits exactly; summed in
    Python's default context (28 digits), the tally got the cost rounded and stopped
    equalling the sum of the key's events (a reclaim summing several leases of one key and
    day, and a late settle's difference, rounded the same way)."""
    org_id, _ = stack.org(credits="10")
    key = create_key(stack.tables, org_id, label="unlimited")
    cost = "0.0000029166666666666666666666666666666667"  # 35 significant digits
    lease = stack.ledger.admit(**admit_args(org_id, key.key_id))
    assert stack.ledger.settle(lease, event_of(lease, cost)) == "settled"
    (event,) = stack.events(org_id)
    assert event.cost == Decimal(cost)  # stored exactly
    tallies = stack.key_tallies(org_id)
    month, day = event.created_at[:7], "d" + event.created_at[8:10]
    assert tallies[(key.key_id, month, day)] == event.cost, tallies
    assert tallies[(key.key_id, month, "month")] == event.cost, tallies


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
