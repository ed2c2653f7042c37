"""The one retry policy of the ledger's DynamoDB writes (admission, renewal, settle, reclaim).

DynamoDB refuses a write now and then for reasons that say nothing about the write: the
org item is inside another request's settle transaction (`TransactionConflictException`,
or a cancellation with reason `TransactionConflict`), the partition is throttled, a 5xx, or
the answer is lost on the way back. Each of those is tried again after a random pause
("full jitter": uniform in [0, min(cap, base × 2^n)]), within a budget of attempts *and* of
seconds, whichever ends first. Everything else (a failed condition, a validation error)
is raised at once. Every write the ledger retries is safe to apply twice and recognises its
own earlier success (see `kiln.store.ledger`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from .errors import is_transient

__all__ = ["RetryPolicy", "client_token"]

T = TypeVar("T")
log = logging.getLogger("kiln.ledger")


def client_token(kind: str, text: str) -> str:
    """A transaction's ClientRequestToken (at most 36 characters), the same for the same text:
    a transaction sent again after a lost answer is recognised, not applied twice."""
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


@dataclass(frozen=True)
class RetryPolicy:
    # A hot org item (a storm of one org's requests, each admission and settle writing it) meets
    # conflicts on about 3 attempts in 4 under the emulator's fault mode: 50 attempts all fail
    # for about one write in two million. The seconds bound the wait when DynamoDB is down.
    attempts: int = 50
    budget_seconds: float = 10.0
    base_seconds: float = 0.01
    cap_seconds: float = 0.25
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    jitter: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.budget_seconds < 0 or self.base_seconds < 0 or self.cap_seconds < 0:
            raise ValueError("a retry policy needs at least one attempt and non-negative times")

    def pause(self, retry: int) -> float:
        """The random pause before retry number `retry` (1 for the first retry)."""
        return self.jitter() * min(self.cap_seconds, self.base_seconds * 2 ** (retry - 1))

    async def run(self, call: Callable[[], Awaitable[T]], *, what: str) -> T:
        """`call()` until it succeeds or fails for good; the last failure is raised."""
        deadline = self.clock() + self.budget_seconds
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except Exception as exc:
                if not is_transient(exc) or attempt == self.attempts:
                    raise
                pause = self.pause(attempt)
                if self.clock() + pause > deadline:
                    raise
                if attempt % 5 == 0:  # a write that keeps meeting refusals is worth a line
                    log.info(json.dumps({"event": "storage_retry", "write": what, "attempt": attempt, "detail": str(exc)}))
            await self.sleep(pause)
        raise AssertionError("unreachable")
