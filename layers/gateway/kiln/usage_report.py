"""Usage reports: an org's usage events summed by model, day, key or endpoint, with totals.

One aggregation for both readers: `kiln admin usage` (operators) and `GET /v1/usage` (an
org itself, `kiln.selfservice`), so the two report the same figures for the same span.
Spans are half-open, as both take them: from `since` (inclusive) to `until` (exclusive).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timezone
from decimal import Context, Decimal
from typing import Any, Callable, Iterable

from .isotime import from_iso
from .store.clock import stored_time
from .store.usage import UsageEvent

__all__ = ["COLUMNS", "GROUPINGS", "KeySpend", "Line", "Summary", "in_span", "parse_time", "stored_time", "summarize"]

GROUPINGS: dict[str, Callable[[UsageEvent], str]] = {
    "model": lambda event: event.model,
    "day": lambda event: event.created_at[:10],
    "key": lambda event: event.key_id,
    "endpoint": lambda event: event.endpoint,
}
COLUMNS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens", "cost")
# Costs are summed exactly: each holds up to the 38 digits a DynamoDB number does, and a sum
# of many needs more than Python's default 28.
_SUM = Context(prec=120)


@dataclass
class Line:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost: Decimal = Decimal(0)

    def add(self, event: UsageEvent) -> None:
        self.requests += 1
        self.errors += event.status != "success"
        self.prompt_tokens += event.prompt_tokens or 0
        self.completion_tokens += event.completion_tokens or 0
        self.cached_tokens += event.cached_tokens or 0
        self.cost = _SUM.add(self.cost, event.cost)

    def row(self, group: str) -> dict[str, Any]:
        return {"group": group, **{column: getattr(self, column) for column in COLUMNS}}


@dataclass
class Summary:
    by: str
    lines: dict[str, Line] = field(default_factory=lambda: defaultdict(Line))
    total: Line = field(default_factory=Line)

    def add(self, event: UsageEvent) -> None:
        self.lines[GROUPINGS[self.by](event)].add(event)
        self.total.add(event)

    def rows(self) -> list[dict[str, Any]]:
        return [self.lines[group].row(group) for group in sorted(self.lines)]

    def columns(self) -> tuple[str, ...]:
        return ("group", *COLUMNS)


@dataclass
class KeySpend:
    """Keys' spend summed from their usage events, each from its own start (a stored time):
    one pass over the org's events, from the earliest start, serves every key."""

    starts: dict[str, str]  # key id -> the first moment counted
    spent: dict[str, Decimal] = field(default_factory=dict)

    @property
    def since(self) -> str | None:
        """Where a read of the org's events needs to begin (None: no key to sum)."""
        return min(self.starts.values(), default=None)

    def add(self, key_id: str, created_at: str, cost: Decimal) -> None:
        start = self.starts.get(key_id)
        if start is not None and created_at >= start:
            self.spent[key_id] = _SUM.add(self.spent.get(key_id, Decimal(0)), cost)

    def of(self, key_id: str) -> Decimal:
        return self.spent.get(key_id, Decimal(0))


PROGRESS_EVERY = 500  # events read between two reports of progress


def summarize(events: Iterable[UsageEvent], by: str, progress: Callable[[int], None] | None = None) -> Summary:
    summary = Summary(by)
    GROUPINGS[by]  # noqa: B018 - an unknown grouping fails before any event is read
    count = 0
    for count, event in enumerate(events, 1):
        summary.add(event)
        if progress is not None and count % PROGRESS_EVERY == 0:
            progress(count)
    if progress is not None and (count == 0 or count % PROGRESS_EVERY):  # the last count, said once
        progress(count)
    return summary


def in_span(event: UsageEvent, until: str | None) -> bool:
    """The index reads `since`..`until` inclusive; a report's `until` is exclusive."""
    return until is None or event.created_at < until


def parse_time(text: str) -> str:
    """An ISO 8601 date or time (UTC if no zone) in the stored form, e.g. 2026-11-30T00:00:00.000Z."""
    moment = from_iso(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return stored_time(moment)
