"""Ledger.settle_later: a settle refused past its budget goes on in the background, paced."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

from kiln.store import ledger as ledger_module
from kiln.store.errors import StorageError, TransientStorageError
from kiln.store.ledger import Ledger


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
