"""SSM parameters read through a short in-memory cache (`max_age` seconds).

A fresh value is returned with no I/O at all; a stale one is refreshed by one caller while
the others wait for it; a failed refresh keeps serving the last good value (and says so
in the log) rather than failing requests because SSM hiccupped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Generic, TypeVar

__all__ = ["CachedParameter", "ParameterUnavailable"]

T = TypeVar("T")
log = logging.getLogger("kiln.parameters")


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._fetch = fetch
        self._parse = parse
        self._max_age = max_age
        self._clock = clock
        self._value: T | None = None
        self._loaded = False
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def get(self) -> T:
        if self._loaded and self._clock() < self._expires:
            return self._value  # type: ignore[return-value]
        async with self._lock:
            if not (self._loaded and self._clock() < self._expires):
                await self._refresh()
        return self._value  # type: ignore[return-value]

    async def _refresh(self) -> None:
        try:
            value = self._parse(await self._fetch())
        except Exception as exc:  # noqa: BLE001 - any failure keeps the last good value
            if not self._loaded:
                raise ParameterUnavailable(f"{self.name}: {exc}") from exc
            log.warning("parameter %s could not be refreshed, keeping the last value: %s", self.name, exc)
            self._expires = self._clock() + min(self._max_age, 1.0)
            return
        self._value, self._loaded = value, True
        self._expires = self._clock() + self._max_age
