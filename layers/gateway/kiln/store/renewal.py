"""Keeping a running request's lease alive, off the request's own path.

    async with LeaseKeeper(ledger, lease, progress=lambda: (prompt_tokens, completion_tokens, cost)):
        ...  # the request runs; its lease is renewed every `ledger.renew_seconds`

Every `renew_seconds` a task of its own renews the lease (`Ledger.renew`): a later expiry
and what `progress()` says the request has relayed so far, so that if the gateway dies the
request's `abandoned` event is billed for those tokens. A request shorter than
`renew_seconds` costs no renewal at all. Nothing here ever raises into the request: a
renewal that fails is logged and the next one tries again; a lease found gone (reclaimed
after it expired) is logged and renewal stops, and the request's settle then replaces its
`abandoned` event. Leaving the block, normally, by an exception or by cancellation, stops
the renewals; `stop()` does the same earlier (call it right before the settle, so that no
renewal races it).
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
    ) -> None:
        self._ledger = ledger
        self._lease = lease
        self._progress = progress
        self._interval = renew_seconds if renew_seconds is not None else ledger.renew_seconds
        # a safety net: no request runs longer than its model allows, so a keeper still running
        # past that belongs to a request whose end was never seen; its lease then simply expires
        self._until = time.monotonic() + max_seconds if max_seconds is not None else None
        self._task: asyncio.Task | None = None
        self.renewals = 0  # renewals that landed
        self.expires = lease.expires  # the lease's expiry as last written
        self.lost = False  # the lease was found gone: no more renewals

    async def __aenter__(self) -> "LeaseKeeper":
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> bool:
        await self.stop()
        return False

    def start(self) -> None:
        if self._task is None and self._interval > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lease-{self._lease.gen_id}")

    async def stop(self) -> None:
        """Stop renewing (idempotent). A renewal in flight is cancelled: harmless, since a
        renewal never brings back a lease that is gone."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        except Exception:  # noqa: BLE001 - _run logs its own failures; nothing may reach the request
            pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if self._until is not None and time.monotonic() > self._until:
                log.warning(json.dumps({"event": "lease_renewal_limit", "gen_id": self._lease.gen_id}))
                return
            progress = self._read_progress()
            try:
                expires = await self._ledger.renew(self._lease, progress)
            except Exception as exc:  # noqa: BLE001 - the next renewal tries again
                log.warning(json.dumps({"event": "lease_renewal_failed", "gen_id": self._lease.gen_id,
                                        "detail": f"{type(exc).__name__}: {exc}"}))
                continue
            if expires is None:
                self.lost = True
                log.warning(json.dumps({"event": "lease_lost", "gen_id": self._lease.gen_id}))
                return
            self.expires = expires
            self.renewals += 1

    def _read_progress(self) -> Progress | None:
        if self._progress is None:
            return None
        try:
            return self._progress()
        except Exception:  # noqa: BLE001 - renew the expiry at least
            log.exception("lease %s: progress could not be read", self._lease.gen_id)
            return None
