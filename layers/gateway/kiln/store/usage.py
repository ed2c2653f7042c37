"""Usage events: one per admitted request, keyed by generation id, queryable by org and time."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from .codec import from_item
from .errors import RecordNotFound
from .schema import USAGE
from .tally import is_tally

if TYPE_CHECKING:  # pynamodb is for operators' tools; the request path never imports it
    from .records import Tables

__all__ = ["UsageEvent", "STATUSES", "get_event", "key_costs", "org_events", "query_events", "recent_events"]

# What became of an admitted request.
STATUSES = (
    "success",  # answered 200 and finished
    "upstream_rejected",  # the model server answered 4xx, passed on
    "upstream_error",  # every backend failed before answering (502)
    "no_backend_available",  # 503: the model has no backend in service
    "stream_interrupted",  # the upstream failed after the stream started (error event)
    "client_disconnected",  # the client went away; tokens seen so far are billed
    "gateway_error",  # a fault inside the gateway (500)
    "abandoned",  # the lease expired without a settle (crash); reclaimed by the next admission
)


@dataclass(frozen=True)
class UsageEvent:
    gen_id: str
    org_id: str
    created_at: str
    key_id: str
    model: str
    endpoint: str
    streamed: bool
    status: str
    cost: Decimal
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    usage_source: str | None = None
    finish_reason: str | None = None
    ttfb_ms: int | None = None
    duration_ms: int | None = None
    upstream: str | None = None
    error: str | None = None
    expires_at: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "UsageEvent":
        """The inverse of as_dict() after a JSON round trip (cost as a string or number)."""
        known = {name: values.get(name) for name in cls.__dataclass_fields__}
        known["cost"] = Decimal(str(known["cost"])) if known["cost"] is not None else Decimal(0)
        return cls(**known)

    @classmethod
    def from_item(cls, item: dict[str, Any]) -> "UsageEvent":
        """From DynamoDB's attribute-value form (the request path reads it without pynamodb)."""
        return cls.from_dict(from_item(item))

    @classmethod
    def from_record(cls, record) -> "UsageEvent":
        values = record.attribute_values
        ints = ("http_status", "prompt_tokens", "completion_tokens", "cached_tokens", "ttfb_ms", "duration_ms", "expires_at")
        kwargs = {name: values.get(name) for name in cls.__dataclass_fields__}
        for name in ints:
            if kwargs[name] is not None:
                kwargs[name] = int(kwargs[name])
        return cls(**kwargs)


def get_event(tables: Tables, gen_id: str) -> UsageEvent:
    from pynamodb.exceptions import DoesNotExist

    if not gen_id or is_tally(gen_id):  # no key DynamoDB takes, or a key's tally beside the events
        raise RecordNotFound("generation", gen_id)
    try:
        return UsageEvent.from_record(tables.usage.get(gen_id, consistent_read=True))
    except DoesNotExist:
        raise RecordNotFound("generation", gen_id) from None


def recent_events(tables: Tables, org_id: str, limit: int) -> list[UsageEvent]:
    """The org's latest events, newest first."""
    records = tables.usage.by_org_time.query(org_id, scan_index_forward=False, limit=limit)
    return [UsageEvent.from_record(record) for record in records]


def query_events(tables: Tables, org_id: str, since: str | None = None, until: str | None = None) -> Iterator[UsageEvent]:
    """The org's events in time order; `since`/`until` are ISO 8601 UTC bounds (inclusive)."""
    index = tables.usage.by_org_time
    condition = None
    created = tables.usage.created_at
    if since and until:
        condition = created.between(since, until)
    elif since:
        condition = created >= since
    elif until:
        condition = created <= until
    for record in index.query(org_id, range_key_condition=condition):
        yield UsageEvent.from_record(record)


# what a usage report reads of each event (kiln.usage_report): less to carry than the whole item
_REPORTED = (USAGE.gen_id, USAGE.org_id, USAGE.created_at, USAGE.key_id, USAGE.model, USAGE.endpoint, USAGE.streamed,
             USAGE.status, USAGE.cost, USAGE.prompt_tokens, USAGE.completion_tokens, USAGE.cached_tokens)


async def org_events(aws: Any, usage_table: str, org_id: str, since: str, until: str) -> AsyncIterator[UsageEvent]:
    """The org's events from `since` to `until` (inclusive, ISO 8601 UTC), in time order, page
    by page from the `by_org_time` index over the lean client (the request path's reader),
    with the fields a usage report sums (the others None)."""
    names = {f"#p{index}": name for index, name in enumerate(_REPORTED)}
    payload: dict[str, Any] = {
        "TableName": usage_table,
        "IndexName": "by_org_time",
        "KeyConditionExpression": "#org = :org AND #created BETWEEN :since AND :until",
        "ProjectionExpression": ", ".join(names),
        "ExpressionAttributeNames": {"#org": USAGE.org_id, "#created": USAGE.created_at, **names},
        "ExpressionAttributeValues": {":org": {"S": org_id}, ":since": {"S": since}, ":until": {"S": until}},
    }
    while True:
        page = await aws.dynamodb("Query", payload)
        for item in page.get("Items", []):
            yield UsageEvent.from_item(item)
        if not page.get("LastEvaluatedKey"):
            return
        payload["ExclusiveStartKey"] = page["LastEvaluatedKey"]


async def key_costs(aws: Any, usage_table: str, org_id: str, since: str, *,
                    key_id: str | None = None) -> AsyncIterator[tuple[str, str, Decimal]]:
    """(key id, created_at, cost) of each of the org's events from `since` (inclusive, ISO 8601
    UTC) on, in time order, of one key when `key_id` is given: what a key's spend is summed
    from (kiln.store.keyring). Only those three fields are read."""
    names = {"#org": USAGE.org_id, "#created": USAGE.created_at, "#key": USAGE.key_id, "#cost": USAGE.cost}
    values: dict[str, Any] = {":org": {"S": org_id}, ":since": {"S": since}}
    payload: dict[str, Any] = {
        "TableName": usage_table,
        "IndexName": "by_org_time",
        "KeyConditionExpression": "#org = :org AND #created >= :since",
        "ProjectionExpression": "#key, #created, #cost",
        "ExpressionAttributeNames": names,
        "ExpressionAttributeValues": values,
    }
    if key_id is not None:
        payload["FilterExpression"] = "#key = :key"
        values[":key"] = {"S": key_id}
    while True:
        page = await aws.dynamodb("Query", payload)
        for item in page.get("Items", []):
            cost = item.get(USAGE.cost, {}).get("N")
            yield (item.get(USAGE.key_id, {}).get("S", ""), item.get(USAGE.created_at, {}).get("S", ""),
                   Decimal(cost) if cost is not None else Decimal(0))
        if not page.get("LastEvaluatedKey"):
            return
        payload["ExclusiveStartKey"] = page["LastEvaluatedKey"]
