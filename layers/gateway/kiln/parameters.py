"""SSM parameters read through an in-memory cache (`max_age` seconds), sized for a fleet.

SSM answers GetParameter at 40 TPS per account and Region by default, shared by every
execution environment, so the cache is what keeps a busy fleet under it (docs/deploy.md,
"SSM reads"):

- a fresh value is returned with no I/O at all; a stale one is refreshed in a task of its
  own, which callers wait for up to `refresh_wait` (0.5 s) from its start: past that, they
  are served the last good value at once while it goes on (an SSM that takes the connection
  and never answers held every request for the AWS client's timeouts and retries, 15 s);
- a refresh not answered in that wait is counted as failed there and then (logged, backed
  off), and goes on: its answer is kept unless one asked for later was; once the back-off is
  over, a new refresh starts beside it (a refresh frozen with its environment between Lambda
  invocations is given up on so, not waited for);
- a first read's attempts are bounded by `read_timeout` and what is left of its budget; a
  refresh's read, which no request waits for past `refresh_wait`, only as the AWS client
  bounds each try (and at `refresh_timeout`, 30 s), so a slow SSM's answer still gets through;
- each refresh schedules the next one at a random point in the last fifth of `max_age`, so
  environments started together do not refresh together (and never serve a value older
  than `max_age` while SSM answers);
- a failed refresh (throttled, unreachable, malformed) keeps serving the last good value and
  tries again after a back-off that doubles up to `max_age`, rather than failing requests
  or adding load to a throttled service;
- the first read of an environment, which has no value to fall back on, retries with
  back-off for up to `first_read_budget` seconds before giving up; callers that waited
  while it failed give up with it instead of trying again one after the other, and so do
  those that come after it for a back-off (1 s, doubled at each first read failed in a row,
  up to 30 s): on Lambda an environment serves one request at a time, so no caller ever
  waits, and each would start the whole first read again against a throttled SSM (but for
  a parameter read with `back_off_first_reads=False`: the maintenance switch, which fails
  open and so must be read again as soon as SSM answers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Awaitable, Callable, Generic, TypeVar

__all__ = ["CachedParameter", "ParameterUnavailable"]

T = TypeVar("T")
log = logging.getLogger("kiln.parameters")

JITTER = 0.2  # a refresh falls due between 80% and 100% of max_age
RETRY_AFTER = 2.0  # first back-off of a failed refresh, doubled on each failure up to max_age
FIRST_READ_DELAY = 0.05  # first pause between two attempts of a first read, doubled each time
FIRST_READ_RETRY_AFTER = 1.0  # no new first read for this long after one failed, doubled each time…
FIRST_READ_RETRY_MAX = 30.0  # …up to this
REFRESH_WAIT = 0.5  # how long callers wait for a refresh under way, from its start, before the last value
MIN_ATTEMPT = 0.25  # a first read's attempt is given at least this long, whatever is left of its budget
REFRESH_TIMEOUT = 30.0  # a refresh's read is cut after this at the latest
FROZEN_SLACK = 1.0  # a read that ends this long past its timeout was frozen, not slow


class ParameterUnavailable(Exception):
    """The parameter could not be read and no earlier value is known."""


class CachedParameter(Generic[T]):
    def __init__(
        self,
        name: str,
        fetch: Callable[[], Awaitable[str | None]],
        parse: Callable[[str | None], T],
        *,
        max_age: float,
        first_read_budget: float = 0.0,
        read_timeout: float | None = None,
        refresh_timeout: float = REFRESH_TIMEOUT,
        refresh_wait: float = REFRESH_WAIT,
        back_off_first_reads: bool = True,
        unreadable_event: str = "parameter_unreadable",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self.unreadable_event = unreadable_event
        self._fetch = fetch
        self._parse = parse
        self._max_age = max_age
        self._first_read_budget = first_read_budget
        self._read_timeout = read_timeout
        self._refresh_timeout = refresh_timeout
        self._refresh_wait = refresh_wait
        self._refreshing: asyncio.Task | None = None
        self._given_up: set[asyncio.Task] = set()  # refreshes counted as failed when their wait ended
        self._asked = float("-inf")  # when the value held was asked for
        self._refresh_started = 0.0  # the loop's time
        self._back_off_first_reads = back_off_first_reads
        self._clock = clock
        self._sleep = sleep
        self._rand = rand
        self._value: T | None = None
        self._loaded = False
        self._expires = 0.0
        self._failures = 0  # refreshes failed in a row since the last good value
        self._first_read_failed: tuple[float, str] | None = None  # when, and why
        self._first_reads_failed = 0  # in a row
        self._next_first_read = 0.0  # no first read before then (a back-off after a failed one)
        self._lock = asyncio.Lock()

    @property
    def fresh(self) -> bool:
        """`get` would answer from memory, with no I/O and no wait."""
        return self._loaded and self._clock() < self._expires

    async def get(self) -> T:
        if self.fresh:
            return self._value  # type: ignore[return-value]
        if self._loaded:
            return await self._refreshed()
        asked = self._clock()
        async with self._lock:
            if not self._loaded:
                failed = self._first_read_failed
                # it failed while this caller waited, or so recently that it is backing off
                if failed is not None and (failed[0] > asked or (self._back_off_first_reads
                                                                 and self._clock() < self._next_first_read)):
                    raise ParameterUnavailable(f"{self.name}: {failed[1]}")
                await self._first_read()
        return self._value  # type: ignore[return-value]

    async def _refreshed(self) -> T:
        """The value once a refresh has ended, or the last good value past `refresh_wait` from
        its start. The refresh under way is waited for unless it was given up on (not answered
        in its wait: SSM slow, or the environment frozen under it between Lambda invocations);
        then a new one is started beside it, and the answer asked for last is the one kept."""
        loop = asyncio.get_running_loop()
        task = self._refreshing
        if task is None or task.done() or task.get_loop() is not loop or task in self._given_up:
            task = self._refreshing = loop.create_task(self._refresh(), name=f"refresh {self.name}")
            self._refresh_started = loop.time()
        left = self._refresh_started + self._refresh_wait - loop.time()
        if left > 0:
            await asyncio.wait((task,), timeout=left)  # the refresh goes on if this caller is cancelled
        if not task.done() and task not in self._given_up:
            # not answered in the wait: a failed refresh now, logged and backed off (on Lambda the
            # environment is frozen before the read's own timeout, which then never counts),
            # whatever the read that goes on brings
            self._given_up.add(task)
            task.add_done_callback(self._given_up.discard)
            self._failed(f"no answer within {self._refresh_wait:g} s")
        return self._value  # type: ignore[return-value]

    def _read(self, timeout: float | None) -> Awaitable[str | None]:
        return self._fetch() if timeout is None else asyncio.wait_for(self._fetch(), timeout)

    def _fresh_until(self, asked: float) -> float:
        return asked + self._max_age * (1.0 - JITTER * self._rand())

    async def _first_read(self) -> None:
        deadline = self._clock() + self._first_read_budget
        delay = FIRST_READ_DELAY
        while True:
            asked = self._clock()
            timeout = self._read_timeout
            if self._first_read_budget > 0:
                left = max(deadline - self._clock(), MIN_ATTEMPT)
                timeout = left if timeout is None else min(timeout, left)
            try:
                raw = await self._read(timeout)
                break
            except Exception as exc:  # noqa: BLE001 - retried within the budget, then reported
                pause = delay * (0.5 + self._rand() / 2)
                if self._clock() + pause > deadline:
                    self._first_read_gave_up(exc)
                    raise ParameterUnavailable(f"{self.name}: {_said(exc)}") from exc
                await self._sleep(pause)
                delay *= 2
        try:
            value = self._parse(raw)
        except Exception as exc:  # a malformed value: retrying would read the same
            self._first_read_gave_up(exc)
            raise ParameterUnavailable(f"{self.name}: {_said(exc)}") from exc
        self._store(value, asked)

    def _first_read_gave_up(self, exc: Exception) -> None:
        now = self._clock()
        self._first_read_failed = (now, _said(exc))
        self._first_reads_failed += 1
        back_off = min(FIRST_READ_RETRY_MAX, self._max_age, FIRST_READ_RETRY_AFTER * 2 ** (self._first_reads_failed - 1))
        self._next_first_read = now + back_off * (0.5 + self._rand() / 2)

    async def _refresh(self) -> None:
        asked = self._clock()
        try:
            value = self._parse(await self._read(self._refresh_timeout))
        except Exception as exc:  # noqa: BLE001 - any failure keeps the last good value
            if asyncio.current_task() in self._given_up:
                return  # counted as failed when its wait ended; its back-off stands
            if self._clock() - asked > self._refresh_timeout + FROZEN_SLACK:
                # ended long past its own bound: the environment was frozen under it, not SSM
                # slow; the value is due again, for the next caller to read now
                self._expires = asked
                return
            self._failed(_said(exc))
            return
        self._store(value, asked)

    def _failed(self, detail: str) -> None:
        """A refresh failed: the last good value is kept for a back-off, and the failure logged;
        nothing, where another refresh has meanwhile brought a value still fresh."""
        if self.fresh:
            return
        self._failures += 1
        back_off = min(self._max_age, RETRY_AFTER * 2 ** (self._failures - 1)) * (0.5 + self._rand() / 2)
        self._expires = self._clock() + back_off
        # the same event as a first read that fails (`maintenance_unreadable`, …): one name to
        # search and alarm on, whether an environment is new or warm
        log.error(json.dumps({
            "event": self.unreadable_event, "parameter": self.name, "in_a_row": self._failures,
            "kept_for_seconds": round(back_off, 1), "detail": detail[:500],
        }))

    def _store(self, value: T, asked: float | None = None) -> None:
        """Keep `value`, read from `asked` on: fresh for max_age from when it was asked for, not
        from when its answer came (an environment frozen between the two holds an old value);
        not kept over a value asked for later (two refreshes, the one given up on ending last)."""
        asked = self._clock() if asked is None else asked
        if asked < self._asked:
            return
        self._asked = asked
        self._value, self._loaded = value, True
        self._failures = 0
        self._first_read_failed, self._first_reads_failed = None, 0
        self._expires = self._fresh_until(asked)


def _said(exc: BaseException) -> str:
    """What a failure says, or its kind where it says nothing (a timeout)."""
    return str(exc) or type(exc).__name__
