"""`kiln admin replay-usage`: settle the usage events the gateway could not settle.

When DynamoDB kept failing at the end of a request, the gateway logged the whole usage
event (`"event": "usage_unsettled"`) instead of losing it. Export those log lines (e.g.
`aws logs filter-log-events --log-group-name /kiln/chat-completions --filter-pattern
usage_unsettled --query 'events[].message' --output text`) and feed them here. Each event
is settled exactly as the gateway would have: lease released, cost debited, event written
— or, if its lease was since reclaimed as `abandoned`, that event replaced. Replaying the
same lines twice changes nothing the second time.

Costs are read exactly: the gateway writes the record's cost as a decimal string, and a cost
written as a JSON number is read as a Decimal, never through a float.
"""

from __future__ import annotations

import json
import secrets
from collections import Counter
from decimal import Decimal
from typing import Any, Callable, Iterable, Iterator

from kiln.catalog import MAX_PRICE, PER_MILLION
from kiln.endpoints import ENDPOINTS
from kiln.gateway import UNSETTLED
from kiln.jsonio import decimal_places
from kiln.metering import MAX_REQUEST_TOKENS
from kiln.store import Lease, Ledger, UsageEvent
from kiln.store.clock import epoch_of, iso_ms
from kiln.store.errors import NothingHeld, is_transient, translate_storage_error
from kiln.store.keyspend import kind_of_figure, period_name, spend_attribute
from kiln.store.orgs import CREDIT_DECIMALS
from kiln.store.usage import STATUSES

__all__ = ["lease_of", "replay", "unsettled_events", "unsettled_records"]


_DECODER = json.JSONDecoder(parse_float=Decimal)


def _objects(line: str) -> Iterator[dict[str, Any]]:
    """Every JSON object in a line, in order: an export may join several messages on one line
    (aws logs' text output joins a page of them with tabs)."""
    start = line.find("{")
    while start >= 0:
        try:
            record, end = _DECODER.raw_decode(line, start)
        except ValueError:
            start = line.find("{", start + 1)
            continue
        if isinstance(record, dict):
            yield record
        start = line.find("{", end)


def _records(line: str) -> Iterator[dict[str, Any]]:
    """The JSON objects in a log line: each object in it, and its `message` when that is an
    object (Powertools' JSON logs) or a JSON string (plain logs)."""
    for record in _objects(line):
        yield from _with_message(record)


def _with_message(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield record
    message = record.get("message")
    if isinstance(message, dict):
        yield message
    elif isinstance(message, str) and message.startswith("{"):
        try:
            inner = json.loads(message, parse_float=Decimal)
        except ValueError:
            return
        if isinstance(inner, dict):
            yield inner


def unsettled_records(lines: Iterable[str], unreadable: list[str] | None = None
                      ) -> Iterator[tuple[UsageEvent, str | None]]:
    """Each logged event, with the key's spend figure its lease named (None: none, or a line
    logged before the gateway wrote it). A logged event that cannot be read as one is left out,
    and said in `unreadable` (its line's number and why) when given."""
    for number, line in enumerate(lines, start=1):
        found = 0
        for record in _records(line):
            if record.get("event") == UNSETTLED and isinstance(record.get("usage"), dict):
                found += 1
                figure = record.get("spend_figure")
                figure = figure if isinstance(figure, str) else None
                try:
                    event = UsageEvent.from_dict(record["usage"])
                    _check_event(event, figure)
                except (ArithmeticError, TypeError, ValueError) as exc:  # a cost that is no number, say
                    if unreadable is not None:
                        unreadable.append(f"line {number}: {exc if isinstance(exc, _Unusable) else type(exc).__name__}")
                    continue
                yield event, figure
        if not found and UNSETTLED in line and unreadable is not None:  # cut short, say
            unreadable.append(f"line {number}: it names {UNSETTLED} but holds no whole record of one")


class _Unusable(ValueError):
    pass


# what the gateway writes in an event: counts, and texts (None where it has none)
_COUNTS = ("http_status", "prompt_tokens", "completion_tokens", "cached_tokens", "ttfb_ms", "duration_ms", "expires_at")
_MOST = 2**53  # a whole number every JSON reader keeps exactly
_COUNT_BOUNDS = {"http_status": (100, 599), "prompt_tokens": (0, MAX_REQUEST_TOKENS),
                 "completion_tokens": (0, MAX_REQUEST_TOKENS), "cached_tokens": (0, MAX_REQUEST_TOKENS)}
# the dearest bill the gateway makes: the most tokens of each kind a request uses, at the dearest price
_DEAREST_BILL = 2 * MAX_REQUEST_TOKENS * MAX_PRICE / PER_MILLION
# what the gateway logs unsettled: a request it settled itself (`abandoned` is a reclaim's, never logged)
_LOGGED_STATUSES = frozenset(STATUSES) - {"abandoned"}
_TEXTS = ("usage_source", "finish_reason", "upstream", "error")
_MODEL_ENDPOINTS = frozenset(endpoint.api.name for endpoint in ENDPOINTS if endpoint.api is not None)


def _check_event(event: UsageEvent, figure: str | None) -> None:
    """An event as the gateway writes one, or _Unusable: a line edited by hand is settled as it
    says, so what it says must be what an event can be. What names the event and its lease, and
    when it was made, must be text (DynamoDB keys nothing else; the time is stored as written);
    its counts whole numbers, its cost a number not below 0, its status, endpoint and texts
    those of an event; and the figure its lease named one of its own key's, the only org
    attribute a settle adds its cost to (another, such as the org's concurrency limit, would be
    raised by it)."""
    for name in ("gen_id", "org_id", "key_id", "created_at", "model"):
        value = getattr(event, name)
        if not isinstance(value, str) or not value:
            raise _Unusable(f"its {name} is {'empty' if value == '' else type(value).__name__}, not a string")
    try:
        created = epoch_of(event.created_at)
    except (TypeError, ValueError, OverflowError):
        created = None
    # as the gateway writes it: times are compared as text (the usage reports, by the index)
    if created is None or iso_ms(created) != event.created_at:
        raise _Unusable(f"its created_at {event.created_at[:40]!r} is no time as the gateway writes one")
    if event.status not in _LOGGED_STATUSES:
        raise _Unusable(f"its status {str(event.status)[:40]!r} is none of a settled request's")
    if event.endpoint not in _MODEL_ENDPOINTS:
        raise _Unusable(f"its endpoint {str(event.endpoint)[:40]!r} is none of {', '.join(sorted(_MODEL_ENDPOINTS))}")
    if not isinstance(event.streamed, bool):
        raise _Unusable(f"its streamed is {type(event.streamed).__name__}, not true or false")
    if not event.cost.is_finite() or not 0 <= event.cost <= _DEAREST_BILL or decimal_places(event.cost) > CREDIT_DECIMALS:
        raise _Unusable(f"its cost {str(event.cost)[:40]} is no bill: from 0 to {_DEAREST_BILL.normalize()}, "
                        f"at most {CREDIT_DECIMALS} decimal places")
    for name in _COUNTS:
        value = getattr(event, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _Unusable(f"its {name} is {str(value)[:40]!r}, not a whole number")
        low, high = _COUNT_BOUNDS.get(name, (0, _MOST))
        if value is not None and not low <= value <= high:
            raise _Unusable(f"its {name} {str(value)[:40]} is not from {low} to {high}")
    for name in _TEXTS:
        if getattr(event, name) is not None and not isinstance(getattr(event, name), str):
            raise _Unusable(f"its {name} is {type(getattr(event, name)).__name__}, not a string")
    # the figure of its key for the period it was admitted in (its created_at), as its lease named it
    if figure is not None and figure != spend_attribute(event.key_id, period_name(kind_of_figure(figure), created)):
        raise _Unusable(f"its spend_figure {figure[:80]!r} is no spend figure of its key when it was made")


def unsettled_events(lines: Iterable[str]) -> Iterator[UsageEvent]:
    for event, _ in unsettled_records(lines):
        yield event


def lease_of(event: UsageEvent, spend_figure: str | None = None) -> Lease:
    """The lease the event's request held, as far as the event tells it: admitted when the
    event was created (the period its key's spend and tally count it in), naming the figure."""
    try:
        started = epoch_of(event.created_at)
    except (TypeError, ValueError):
        started = 0.0  # a time no period holds: the event is still settled, its key's figure aside
    return Lease(event.gen_id, event.org_id, event.key_id, event.model, event.endpoint, event.streamed,
                 started, started, spend_figure=spend_figure)


async def replay(ledger: Ledger, records: Iterable[UsageEvent | tuple[UsageEvent, str | None]],
                 failures: list[str] | None = None, progress: Callable[[int, int], None] | None = None) -> Counter:
    """Settle each event (alone, or with the spend figure its lease named); counts of the
    outcomes ("settled", "replaced_abandoned", "already_settled", "not_found", "not_settled"). An
    event that cannot be settled (storage still failing, a cost DynamoDB cannot store), or that
    finds neither its lease nor its event (`not_found`), does not stop the others: it is
    counted, and said in `failures` (which, its generation id and why) when given. `progress`
    is told (events done, events in all) every PROGRESS_EVERY events and at the end."""
    outcomes: Counter = Counter()
    records = list(records)
    run = f"replay {secrets.token_hex(8)}"  # this run's tokens: its retries are recognised, no one else's
    storage_down = 0  # events in a row refused because storage still fails
    for index, record in enumerate(records):
        if progress is not None and index and index % PROGRESS_EVERY == 0:
            progress(index, len(records))
        event, figure = record if isinstance(record, tuple) else (record, None)
        if storage_down >= _STORAGE_DOWN_STOP:
            outcomes["not_tried"] = len(records) - index  # each would wait out its retries in turn
            break
        try:
            lease = lease_of(event, figure)
            # tokens of this run's own: a retry after a lost answer is told it succeeded, while an
            # earlier success (the gateway's, another run's) is "already settled", not repeated
            outcomes[await ledger.settle(lease, event, request_token=run)] += 1
            storage_down = 0
        except NothingHeld as exc:  # nothing to settle here: a replay again would find the same
            outcomes["not_found"] += 1
            storage_down = 0
            if failures is not None:
                failures.append(f"not found: {str(event.gen_id)[:80]}: {exc}")
        except Exception as exc:  # noqa: BLE001 - each event is the operator's to see, the rest go on
            outcomes["not_settled"] += 1
            storage_down = storage_down + 1 if is_transient(translate_storage_error(exc)) else 0
            if failures is not None:
                failures.append(f"not settled: {str(event.gen_id)[:80]}: {str(exc)[:300] or type(exc).__name__}")
    if progress is not None:
        progress(sum(count for outcome, count in outcomes.items() if outcome != "not_tried"), len(records))
    return outcomes


# How often a replay says how far it got.
PROGRESS_EVERY = 100
# After this many events in a row refused by storage that still fails, the rest are not tried.
_STORAGE_DOWN_STOP = 3
