"""LeaseKeeper: a running request's lease renewed in the background, never a failure of the request."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

import pytest

from kiln.store import Lease, LeaseKeeper, StorageError

LEASE = Lease("gen-1", "org", "key", "m", "chat.completions", True, 0.0, 60.0)


class FakeLedger:
    """Records renewals; fails the ones listed, says the lease is gone from `gone_after` on."""

    renew_seconds = 0.01

    def now(self) -> float:  # the clock of the expiries it writes (100.0 and on; LEASE's is 60.0)
        return 0.0

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
        told: list[str] = []
        keeper = LeaseKeeper(ledger, LEASE, max_seconds=0.05, on_lost=lambda: told.append("stop"))
        keeper.start()
        await asyncio.sleep(0.3)
        renewed = len(ledger.renewed)
        await asyncio.sleep(0.1)
        assert 1 <= renewed == len(ledger.renewed)  # it renewed, then stopped by itself
        # and a request still running all the same is told to stop: it would outlive its lease
        assert told == ["stop"] and keeper.lost
        await keeper.stop()

    asyncio.run(main())


class ClockedLedger(FakeLedger):
    """A ledger whose clock the test reads: each renewal that lands writes now + `ttl`."""

    def __init__(self, *, ttl: float, renew_seconds: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.renew_seconds = renew_seconds
        self.ttl = ttl
        self.started = time.monotonic()
        self.attempts: list[float] = []  # when each renewal was tried, on this clock

    def now(self) -> float:
        return time.monotonic() - self.started

    async def renew(self, lease, progress=None):
        self.attempts.append(self.now())
        await super().renew(lease, progress)
        return self.now() + self.ttl


def test_renewals_that_keep_failing_stop_the_request_before_its_lease_expires():
    """§4: a lease is never reclaimed while its request runs. Storage out for most of a TTL lets
    the lease expire and any admission of the org reclaim it: the request is told to stop
    before then (a tenth of an interval before the expiry), once, and renewing stops. Before this a
    failed renewal was tried again only an interval later, and the request ran on without its slot."""

    async def main():
        ledger = ClockedLedger(ttl=1.2, renew_seconds=0.4, failures=1000)
        lease = Lease("gen-1", "org", "key", "m", "chat.completions", True, 0.0, 1.2)
        told: list[float] = []
        keeper = LeaseKeeper(ledger, lease, on_lost=lambda: told.append(ledger.now()))
        keeper.start()
        await asyncio.sleep(1.6)
        assert keeper.lost and len(told) == 1
        assert 0.8 <= told[0] < 1.2  # before the expiry (1.2), a tenth of an interval to spare (at 1.16)
        # tried again a quarter interval after each failure, not an interval: at 0.4, 0.5, 0.6, …
        assert len([at for at in ledger.attempts if at < 1.1]) >= 5
        attempts = len(ledger.attempts)
        await asyncio.sleep(0.3)
        assert len(ledger.attempts) == attempts  # no renewal after giving up
        await keeper.stop()

    asyncio.run(main())


def test_a_renewal_that_lands_in_time_keeps_the_request_running():
    async def main():
        ledger = ClockedLedger(ttl=1.2, renew_seconds=0.4, failures=3)
        lease = Lease("gen-1", "org", "key", "m", "chat.completions", True, 0.0, 1.2)
        told: list[float] = []
        async with LeaseKeeper(ledger, lease, on_lost=lambda: told.append(ledger.now())) as keeper:
            await asyncio.sleep(2.0)  # three failures (0.4, 0.5, 0.6), then renewals that land
            assert not keeper.lost and keeper.renewals >= 3 and told == []

    asyncio.run(main())


def test_a_lease_found_gone_tells_the_request_once():
    async def main():
        ledger = FakeLedger(gone_after=1)
        told: list[str] = []
        async with LeaseKeeper(ledger, LEASE, on_lost=lambda: told.append("gone")) as keeper:
            while not keeper.lost:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
        assert told == ["gone"]

    asyncio.run(main())


def test_a_request_that_stopped_is_not_told_its_lease_is_lost():
    async def main():
        ledger = ClockedLedger(ttl=0.3, renew_seconds=0.1, failures=1000)
        lease = Lease("gen-1", "org", "key", "m", "chat.completions", True, 0.0, 0.3)
        told: list[str] = []
        keeper = LeaseKeeper(ledger, lease, on_lost=lambda: told.append("lost"))
        keeper.start()
        await asyncio.sleep(0.15)  # a renewal failed: its last chance is armed
        await keeper.stop()
        await asyncio.sleep(0.4)
        assert told == [] and not keeper.lost

    asyncio.run(main())


def test_a_renewal_slow_to_answer_stops_the_request_before_the_lease_expires():
    """A renewal can be slow rather than fail (retried within its budget, a slow answer): the
    expiry was watched only once a renewal had failed, so a renewal still waiting let the lease
    expire under the running request."""

    class SlowLedger(ClockedLedger):
        async def renew(self, lease, progress=None):
            self.attempts.append(self.now())
            await asyncio.sleep(5)  # no answer within the lease's life
            return self.now() + self.ttl

    async def main():
        ledger = SlowLedger(ttl=1.2, renew_seconds=0.4)
        lease = Lease("gen-1", "org", "key", "m", "chat.completions", True, 0.0, 1.2)
        told: list[float] = []
        keeper = LeaseKeeper(ledger, lease, on_lost=lambda: told.append(ledger.now()))
        keeper.start()
        await asyncio.sleep(1.6)
        assert keeper.lost and len(told) == 1 and 0.8 <= told[0] < 1.2, told
        assert not [task for task in asyncio.all_tasks() if task.get_name().startswith("lease-")]  # given up
        await keeper.stop()

    asyncio.run(main())
