"""The ledger on a faked storage: the writes it goes on with later (settles, take-backs,
reclaims), paced, and its admission tried again after a reclaim."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from decimal import Decimal
from types import SimpleNamespace

import pytest

from kiln.aws import AwsError
from kiln.store import ledger as ledger_module
from kiln.store.errors import ConditionFailed, StorageError, TransactionCancelled, TransientStorageError
from kiln.store.ledger import Ledger
from kiln.store.retry import RetryPolicy
from kiln.store.schema import LEASE, ORG


def _org_with_dead(gen_ids: list[str]) -> dict:
    """An org item (as DynamoDB answers it) below its limit, holding these leases, all dead."""
    now = time.time()
    dead = {LEASE.exp: {"N": repr(round(now - 5, 3))}, LEASE.started: {"N": repr(now - 70)}, LEASE.key: {"S": "key_1"},
            LEASE.model: {"S": "m"}, LEASE.endpoint: {"S": "completions"}, LEASE.streamed: {"BOOL": False}}
    return {ORG.org_id: {"S": "org"}, ORG.status: {"S": "active"}, ORG.credits: {"N": "10"},
            ORG.concurrency_limit: {"N": "8"}, ORG.leases: {"M": {gen_id: {"M": dead} for gen_id in gen_ids}}}


def _quick(monkeypatch, cap: int) -> None:
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 0.005)
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_MAX_PAUSE", 0.02)
    monkeypatch.setattr(ledger_module, "MAX_SETTLING_LATER", cap)


def test_background_settles_go_one_at_a_time_and_are_capped(monkeypatch):
    """Under a storm (every settle throttled), each unsettled request had its own retries
    going at once: 40 requests made 3 000 settle calls in 10 s. They now take turns, and a
    process keeps at most MAX_SETTLING_LATER going (the log keeps the rest for the replay)."""
    _quick(monkeypatch, cap=5)

    async def main():
        ledger = Ledger(None, orgs_table="o", usage_table="u", lease_ttl=2.0)
        running = peak = 0
        calls: Counter = Counter()

        async def settle(lease, event):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            calls[lease.gen_id] += 1
            await asyncio.sleep(0.002)
            running -= 1
            if calls[lease.gen_id] < 3:
                raise TransientStorageError("throttled", "ProvisionedThroughputExceededException")
            return "settled"

        ledger.settle = settle
        for index in range(8):
            ledger.settle_later(SimpleNamespace(gen_id=f"gen-{index}"), None)
        assert len(ledger._settling_later) == 5
        while ledger._settling_later:
            await asyncio.sleep(0.01)
        assert peak == 1
        assert {gen: count for gen, count in calls.items()} == {f"gen-{index}": 3 for index in range(5)}

    asyncio.run(main())


def test_a_background_settle_stops_at_a_refusal_that_is_not_transient_and_on_close(monkeypatch):
    _quick(monkeypatch, cap=10)

    async def main():
        ledger = Ledger(None, orgs_table="o", usage_table="u", lease_ttl=60.0)
        calls: Counter = Counter()

        async def settle(lease, event):
            calls[lease.gen_id] += 1
            if lease.gen_id == "refused":
                raise StorageError("validation", "ValidationException")
            raise TransientStorageError("throttled", "ProvisionedThroughputExceededException")

        ledger.settle = settle
        ledger.settle_later(SimpleNamespace(gen_id="refused"), None)
        ledger.settle_later(SimpleNamespace(gen_id="throttled"), None)
        await asyncio.sleep(0.2)
        assert calls["refused"] == 1 and calls["throttled"] > 1
        await ledger.drain()  # the process closes: what goes on in the background stops
        assert not ledger._settling_later

    asyncio.run(main())


class _Down:
    """DynamoDB answering every call 500 (a server's fault: the write may have been applied)."""

    def __init__(self) -> None:
        self.calls = self.after_close = 0
        self.closed = False

    async def dynamodb(self, operation, payload, **options):
        self.calls += 1
        self.after_close += self.closed
        await asyncio.sleep(0.001)
        raise AwsError("InternalServerError", "down", {"__type": "x#InternalServerError"}, status=500)

    async def aclose(self):
        self.closed = True


def _down_ledger(aws):
    return Ledger(aws, orgs_table="o", usage_table="u", lease_ttl=2.0,
                  retry=RetryPolicy(attempts=3, budget_seconds=0.3, base_seconds=0.01, cap_seconds=0.02))


async def _refused(ledger):
    with pytest.raises(StorageError):
        await ledger.admit(org_id="org", key_id="k", model="m", endpoint="chat.completions", streamed=False)


def test_drain_stops_the_take_backs_a_failing_first_try_starts_while_it_waits(monkeypatch):
    """An admission refused after a 5xx takes its lease back at once, then in rounds. A first
    take-back still trying when the process closed started its rounds after drain() had
    stopped the others: they went on writing to storage after its client was closed."""
    _quick(monkeypatch, cap=10)

    async def main():
        aws = _Down()
        ledger = _down_ledger(aws)
        await _refused(ledger)
        assert ledger._background  # the first take-back, within the policy
        await ledger.drain()
        await aws.aclose()
        assert not ledger._taking_back and not ledger._settling_later and not ledger._background
        await asyncio.sleep(0.2)
        assert aws.after_close == 0

    asyncio.run(main())


def test_take_backs_in_rounds_neither_crowd_out_late_settles_nor_wait_for_their_turn(monkeypatch):
    """A 5xx storm of refused admissions filled the late settles' bound with take-backs, and a
    settle that carries a bill was dropped (left to the replay); below the bound, each take-back
    round held the settles' one-at-a-time turn for a whole retry budget."""
    _quick(monkeypatch, cap=4)
    monkeypatch.setattr(ledger_module, "MAX_TAKING_BACK", 4)

    async def main():
        aws = _Down()
        ledger = _down_ledger(aws)
        await asyncio.gather(*[_refused(ledger) for _ in range(6)])
        while ledger._background:
            await asyncio.sleep(0.01)
        assert len(ledger._taking_back) == 4 and not ledger._settling_later  # the bound of their own
        settled = asyncio.Event()

        async def settle(lease, event):
            settled.set()
            return "settled"

        ledger.settle = settle
        ledger.settle_later(SimpleNamespace(gen_id="billed"), None)
        await asyncio.wait_for(settled.wait(), 1.0)  # its first round, with take-backs going on
        await ledger.drain()

    asyncio.run(main())


def test_reclaim_rounds_end_when_one_lands_or_is_refused_for_good_and_on_close(monkeypatch):
    """A reclaim storage refused for now goes on in rounds (tests/store/test_store_ledger.py
    shows it on DynamoDB). Here, what ends them: a round that lands, a refusal for good; the
    process closing stops the rest. While they go on, their leases are theirs: an admission
    that sees them expired starts no reclaim of its own."""
    _quick(monkeypatch, cap=10)

    async def main():
        ledger = Ledger(None, orgs_table="o", usage_table="u", lease_ttl=60.0)
        calls: Counter = Counter()

        async def reclaim(org_id, leases, seen, settled=frozenset()):
            calls[org_id] += 1
            if org_id == "refused":
                raise StorageError("validation", "ValidationException")
            if org_id == "lands" and calls[org_id] == 3:
                return
            raise TransactionCancelled(["TransactionConflict", None, "TransactionConflict"])

        ledger._reclaim = reclaim
        for org_id in ("refused", "lands", "conflicted"):
            ledger._reclaim_in_rounds(org_id, [SimpleNamespace(gen_id=f"gen-{org_id}")], {})
        # another reclaim of the same lease, refused at the same moment: the rounds going on have it
        ledger._reclaim_in_rounds("conflicted", [SimpleNamespace(gen_id="gen-conflicted")], {})
        assert len(ledger._reclaiming_later) == 3
        await asyncio.sleep(0)

        async def admitted(operation, payload):  # an admission that sees the lease the rounds hold, dead
            return {"Attributes": _org_with_dead(["gen-conflicted"])}

        ledger._call = admitted
        await ledger.admit(org_id="org", key_id="key_1", model="m", endpoint="completions", streamed=False)
        assert not ledger._background  # left to the rounds
        await asyncio.sleep(0.3)
        assert calls["refused"] == 1 and calls["lands"] == 3 and calls["conflicted"] > 3
        assert list(ledger._in_rounds) == ["gen-conflicted"]
        await ledger.drain()
        assert not ledger._reclaiming_later and not ledger._in_rounds and not ledger._reclaiming

    asyncio.run(main())


def test_admissions_answered_together_send_one_background_reclaim_of_the_same_dead_lease():
    """Two admissions of one process whose answers came in the same turn of the loop both saw
    a dead lease below the limit: each started a reclaim of it, as the first had not begun
    yet to hold it."""

    async def main():
        ledger = Ledger(None, orgs_table="o", usage_table="u", lease_ttl=60.0)
        answered = asyncio.Event()
        reclaims: Counter = Counter()

        async def call(operation, payload):
            if operation == "UpdateItem":  # the admissions, answered together
                await answered.wait()
                return {"Attributes": _org_with_dead(["gen-dead"])}
            assert operation == "TransactWriteItems"
            reclaims.update(item["Put"]["Item"]["gen_id"]["S"] for item in payload["TransactItems"] if "Put" in item)
            await asyncio.sleep(0.01)
            return {}

        ledger._call = call
        admissions = [asyncio.ensure_future(ledger.admit(org_id="org", key_id="key_1", model="m",
                                                         endpoint="completions", streamed=False)) for _ in range(2)]
        await asyncio.sleep(0.01)
        answered.set()
        await asyncio.gather(*admissions)
        await ledger.drain()
        assert reclaims == {"gen-dead": 1}

    asyncio.run(main())


def test_an_admission_tried_again_after_a_reclaim_never_writes_an_earlier_expiry():
    """The admission tried again after a reclaim at the limit counts its lease's expiry afresh. A
    clock stepped back meanwhile (an NTP step) made it earlier than the first try's: that try,
    landing late, stored its lease with the later expiry, and the retry, finding its own lease
    newer than what it wrote, was refused 429 by its own slot."""

    async def main():
        stepped_back = False

        def clock() -> float:
            return time.time() - (1.0 if stepped_back else 0.0)

        ledger = Ledger(None, orgs_table="o", usage_table="u", lease_ttl=60.0, clock=clock)
        written: list[str] = []
        full = {**_org_with_dead(["gen-dead"]), ORG.concurrency_limit: {"N": "1"}}

        async def call(operation, payload):
            nonlocal stepped_back
            if operation == "TransactWriteItems":  # the reclaim; then the clock steps back
                stepped_back = True
                return {}
            written.append(payload["ExpressionAttributeValues"][":exp"]["N"])
            if len(written) == 1:
                raise ConditionFailed(full)
            return {"Attributes": {}}

        ledger._call = call
        lease = await ledger.admit(org_id="org", key_id="key_1", model="m", endpoint="completions", streamed=False)
        assert len(written) == 2 and Decimal(written[1]) >= Decimal(written[0])
        assert round(lease.expires, 3) == float(written[1])
        await ledger.drain()

    asyncio.run(main())
