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
from collections import Counter
from decimal import Decimal
from typing import Any, Iterable, Iterator

from kiln.gateway import UNSETTLED
from kiln.store import Lease, Ledger, UsageEvent

__all__ = ["replay", "unsettled_events"]


def _records(line: str) -> Iterator[dict[str, Any]]:
    """The JSON objects in a log line: the line itself, and its `message` when that is an
    object (Powertools' JSON logs) or a JSON string (plain logs)."""
    start = line.find("{")
    if start < 0:
        return
    try:
        record = json.loads(line[start:], parse_float=Decimal)
    except ValueError:
        return
    if not isinstance(record, dict):
        return
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


def unsettled_events(lines: Iterable[str]) -> Iterator[UsageEvent]:
    for line in lines:
        for record in _records(line):
            if record.get("event") == UNSETTLED and isinstance(record.get("usage"), dict):
                yield UsageEvent.from_dict(record["usage"])


async def replay(ledger: Ledger, events: Iterable[UsageEvent]) -> Counter:
    """Settle each event; counts of the outcomes ("settled", "replaced_abandoned", "already_settled")."""
    outcomes: Counter = Counter()
    for event in events:
        lease = Lease(event.gen_id, event.org_id, event.key_id, event.model, event.endpoint, event.streamed, 0.0, 0.0)
        # no ClientRequestToken: DynamoDB would repeat an earlier success silently, and the
        # operator is to be told "already settled"
        outcomes[await ledger.settle(lease, event, request_token=False)] += 1
    return outcomes
