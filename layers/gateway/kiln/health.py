"""Which backends are in service, as this process sees them (contract §5: "marked unavailable").

A backend that failed `threshold` times in a row (refused, timed out, 5xx, cut a stream)
is skipped for `cooldown` seconds; then one request may try it again (half-open): success
puts it back in service, failure starts another cooldown. When every backend of a model is
out of service the gateway answers 503 `no_backend_available` at once instead of waiting
on backends known to be down. Operators mark a backend out for good in the catalog
(`"enabled": false`).
"""

from __future__ import annotations

import time
from typing import Callable

from .catalog import Backend

__all__ = ["BackendHealth"]


class _State:
    __slots__ = ("failures", "open_until", "trial_in_flight")

    def __init__(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.trial_in_flight = False


class BackendHealth:
    def __init__(self, *, threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._threshold = threshold
        self._cooldown = cooldown
        self._clock = clock
        self._states: dict[tuple[str, str], _State] = {}

    def _state(self, backend: Backend) -> _State:
        return self._states.setdefault((backend.name, backend.url), _State())

    def usable(self, backend: Backend) -> bool:
        """In service, or due for its one trial request after a cooldown (which this call claims)."""
        state = self._states.get((backend.name, backend.url))
        if state is None or state.failures < self._threshold:
            return True
        if self._clock() < state.open_until or state.trial_in_flight:
            return False
        state.trial_in_flight = True
        return True

    def failed(self, backend: Backend) -> None:
        state = self._state(backend)
        state.failures += 1
        state.trial_in_flight = False
        if state.failures >= self._threshold:
            state.open_until = self._clock() + self._cooldown

    def succeeded(self, backend: Backend) -> None:
        self._states.pop((backend.name, backend.url), None)

    def out_of_service(self) -> list[str]:
        now = self._clock()
        return [name for (name, _), state in self._states.items() if state.failures >= self._threshold and now < state.open_until]
