"""LeaseKeeper: a running request's lease renewed in the background, never a failure of the request."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from kiln.store import Lease, LeaseKeeper, StorageError

LEASE = Lease("gen-1", "org", "key", "m", "chat.completions", True, 0.0, 60.0)


class FakeLedger:
    """Records renewals; fails the ones listed, says the lease is gone from `gone_after` on."""

    renew_seconds = 0.01

    def __init__(self, *, failures: int = 0, gone_after: int | None = None) -> None:
        self.renewed: list[tuple] = []
        self.failures = failures
        self.gone_after = gone_after
        self.calls = 0
        self.wrote = asyncio.Event()

    async def renew(self, lease, progress=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise StorageError("throttled")
        if self.gone_after is not None and len(self.renewed) >= self.gone_after:
            return None
        self.renewed.append(progress)
        self.wrote.set()
        return 100.0 + len(self.renewed)


def test_the_lease_is_renewed_with_the_progress_at_each_renewal():
    async def main():
        ledger = FakeLedger()
        relayed = {"tokens": 0}

        async with LeaseKeeper(ledger, LEASE, progress=lambda: (7, relayed["tokens"], Decimal("0.01"))) as keeper:
            for tokens in (5, 9):
                relayed["tokens"] = tokens
                ledger.wrote.clear()
                await asyncio.wait_for(ledger.wrote.wait(), 5)
                assert ledger.renewed[-1] == (7, tokens, Decimal("0.01"))
        assert keeper.renewals == len(ledger.renewed) and keeper.expires == 100.0 + keeper.renewals
        stopped_at = ledger.calls
        await asyncio.sleep(0.05)
        assert ledger.calls == stopped_at  # no renewal after the block

    asyncio.run(main())


def test_a_failing_renewal_never_reaches_the_request_and_the_next_one_tries_again():
    async def main():
        ledger = FakeLedger(failures=3)

        def broken_progress():
            raise ValueError("a bug in the caller's counting")

        async with LeaseKeeper(ledger, LEASE, progress=broken_progress):
            await asyncio.wait_for(ledger.wrote.wait(), 5)
        assert ledger.calls >= 4 and ledger.renewed[0] is None  # the expiry renewed even without progress

    asyncio.run(main())


def test_a_lease_found_gone_stops_the_renewals():
    async def main():
        ledger = FakeLedger(gone_after=1)
        async with LeaseKeeper(ledger, LEASE) as keeper:
            while not keeper.lost:
                await asyncio.sleep(0.01)
            calls = ledger.calls
            await asyncio.sleep(0.05)
            assert ledger.calls == calls

    asyncio.run(main())


def test_cancelling_the_request_stops_the_renewals_and_cancels_only_the_request():
    async def main():
        ledger = FakeLedger()
        keepers = []

        async def request():
            async with LeaseKeeper(ledger, LEASE) as keeper:
                keepers.append(keeper)
                await asyncio.sleep(3600)

        task = asyncio.create_task(request())
        await asyncio.wait_for(ledger.wrote.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        calls = ledger.calls
        await asyncio.sleep(0.05)
        assert ledger.calls == calls
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("lease-")]

    asyncio.run(main())


def test_an_exception_in_the_request_passes_through_unchanged():
    async def main():
        with pytest.raises(KeyError):
            async with LeaseKeeper(FakeLedger(), LEASE):
                raise KeyError("the request's own failure")

    asyncio.run(main())


def test_stop_is_idempotent_and_a_short_request_costs_no_renewal():
    async def main():
        ledger = FakeLedger()
        ledger.renew_seconds = 3600
        keeper = LeaseKeeper(ledger, LEASE)
        async with keeper:
            await keeper.stop()
        await keeper.stop()
        assert ledger.calls == 0

    asyncio.run(main())


def test_renewals_stop_at_their_limit_and_the_lease_is_left_to_expire():
    """A keeper whose request's end was never seen stops after `max_seconds`: no slot held for ever."""

    async def main():
        ledger = FakeLedger()
        keeper = LeaseKeeper(ledger, LEASE, max_seconds=0.05)
        keeper.start()
        await asyncio.sleep(0.3)
        renewed = len(ledger.renewed)
        await asyncio.sleep(0.1)
        assert 1 <= renewed == len(ledger.renewed)  # it renewed, then stopped by itself
        await keeper.stop()

    asyncio.run(main())
