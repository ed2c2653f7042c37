"""Keeping a running request's lease alive, off the request's own path.

    async with LeaseKeeper(ledger, lease, progress=lambda: (prompt_tokens, completion_tokens, cost),
                           on_lost=stop_the_request):
        ...  # the request runs; its lease is renewed every `ledger.renew_seconds`

Every `renew_seconds` a task of its own renews the lease (`Ledger.renew`): a later expiry
and what `progress()` says the request has relayed so far, so that if the gateway dies the
request's `abandoned` event is billed for those tokens. Until a renewal is due only a timer
of the event loop waits (`loop.call_later`): a request shorter than `renew_seconds`, which
is nearly every one, costs no task and no renewal at all. Nothing here ever raises into
the request: a renewal that fails is logged and tried again sooner (a quarter of the interval).

A request never outlives its lease (contract §4): once its lease expires, any admission of
its org may reclaim it, and the request would run on without a slot, its org over its limit.
So when no renewal has landed (failed, or still waiting for an answer) by a tenth of an
interval before the lease's expiry (storage out, or slow, for most of a TTL), or a renewal
finds the lease gone (reclaimed all the same: a clock far ahead elsewhere), renewing stops
and `on_lost` is called, once: the request stops, and its settle then replaces the
`abandoned` event a reclaim may write. Leaving the block, normally, by an exception or by
cancellation, stops the renewals; `stop()` does the same earlier (call it right before the
settle, so that no renewal races it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

from .ledger import Lease, Ledger, Progress

__all__ = ["LeaseKeeper"]

log = logging.getLogger("kiln.ledger")


class LeaseKeeper:
    def __init__(
        self,
        ledger: Ledger,
        lease: Lease,
        *,
        progress: Callable[[], Progress | None] | None = None,
        renew_seconds: float | None = None,
        max_seconds: float | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._ledger = ledger
        self._lease = lease
        self._progress = progress
        self._on_lost = on_lost
        self._interval = renew_seconds if renew_seconds is not None else ledger.renew_seconds
        # a safety net: no request runs longer than its model allows, so a keeper still running
        # past that belongs to a request whose end was never seen; its lease then expires
        self._until = time.monotonic() + max_seconds if max_seconds is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # waiting for the next renewal
        self._task: asyncio.Task | None = None  # a renewal in flight
        # from a renewal's start until one lands: when to give up, a tenth of an interval before
        # the expiry as last written (by the ledger's clock), room for the request to stop and
        # for clocks elsewhere a little ahead
        self._last_chance: asyncio.TimerHandle | None = None
        self.renewals = 0  # renewals that landed
        self.expires = lease.expires  # the lease's expiry as last written
        self.lost = False  # the lease was found gone, or could not be kept: no more renewals
        self._over = False  # lost, or past the limit: never renewed again

    async def __aenter__(self) -> "LeaseKeeper":
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> bool:
        await self.stop()
        return False

    def start(self) -> None:
        if self._timer is None and self._task is None and not self._over and self._interval > 0:
            self._loop = asyncio.get_running_loop()
            self._schedule(self._interval)

    async def stop(self) -> None:
        """Stop renewing (idempotent). A renewal in flight is cancelled: harmless, since a
        renewal never brings back a lease that is gone."""
        self._progress = None  # read by no renewal after this; it holds the request that made it
        self._on_lost = None
        self._stop_timers()
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        except Exception:  # noqa: BLE001 - _renew logs its own failures; nothing may reach the request
            pass

    def _stop_timers(self) -> None:
        for timer in (self._timer, self._last_chance):
            if timer is not None:
                timer.cancel()
        self._timer = self._last_chance = None

    def _schedule(self, delay: float) -> None:
        assert self._loop is not None
        # the callback runs in a copy of this context: the renewal's log lines keep the request's ids
        self._timer = self._loop.call_later(delay, self._due)

    def _due(self) -> None:
        """The timer fired: a renewal is due (unless the keeper has run past its limit)."""
        self._timer = None
        if self._until is not None and time.monotonic() > self._until:
            # a request whose end was never seen: its lease is left to expire, and the request,
            # should it run all the same, is told to stop like one whose lease is lost
            self._lose("lease_renewal_limit")
            return
        assert self._loop is not None
        if self._last_chance is None:
            # a renewal may be slow rather than fail (retried within its budget, or waiting on a
            # slow answer): from its start the expiry is watched, not only once it has failed
            left = self.expires - self._interval / 10 - self._ledger.now()
            if left <= 0:
                self._lose("lease_not_kept")
                return
            self._last_chance = self._loop.call_later(left, self._lose, "lease_not_kept")
        self._task = self._loop.create_task(self._renew(), name=f"lease-{self._lease.gen_id}")

    async def _renew(self) -> None:
        progress = self._read_progress()
        try:
            expires = await self._ledger.renew(self._lease, progress)
        except Exception as exc:  # noqa: BLE001 - tried again sooner, until the lease's last chance
            log.warning(json.dumps({"event": "lease_renewal_failed", "gen_id": self._lease.gen_id,
                                    "detail": f"{type(exc).__name__}: {exc}"}))
            landed = False
        else:
            if expires is None:
                self._lose("lease_lost")
                return
            self.expires = expires
            self.renewals += 1
            landed = True
        if self._task is not asyncio.current_task() or self._over:  # stopped meanwhile
            return
        self._task = None
        if landed:
            if self._last_chance is not None:
                self._last_chance.cancel()
                self._last_chance = None
            self._schedule(self._interval)
        else:  # the last chance, set when this renewal began, still stands
            self._schedule(self._interval / 4)

    def _lose(self, why: str) -> None:
        """The lease is gone, or will expire before a renewal can land: no more renewals, and
        the request is told to stop (`on_lost`, once)."""
        if self._over:
            return
        self.lost = self._over = True
        self._stop_timers()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # a renewal still trying: too late to keep the lease
        log.warning(json.dumps({"event": why, "gen_id": self._lease.gen_id}))
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            try:
                on_lost()
            except Exception:  # noqa: BLE001 - nothing here may reach the request
                log.exception("lease %s: the request could not be told its lease is lost", self._lease.gen_id)

    def _read_progress(self) -> Progress | None:
        if self._progress is None:
            return None
        try:
            return self._progress()
        except Exception:  # noqa: BLE001 - renew the expiry at least
            log.exception("lease %s: progress could not be read", self._lease.gen_id)
            return None
