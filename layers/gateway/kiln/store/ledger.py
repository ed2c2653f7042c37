"""Admission and settlement: the org's concurrency slots and credits, without a sweeper.

Admission is one conditional UpdateItem on the org: it adds a lease (generation id →
expiry and what the request is) only while the org is active, has credits and holds fewer
leases than its limit. When the condition fails, DynamoDB hands back the item as it was
(ReturnValuesOnConditionCheckFailure=ALL_OLD), which tells 402 from 429 with no second
read, and shows any lease that outlived its expiry: such leases are reclaimed on the spot
(each gets an `abandoned` usage event) and the admission is tried once more.

Settling is one transaction: remove the lease and debit the cost from the org, and write
the usage event. It is conditioned on the lease still being there, so a retried settle
cannot charge twice; a request whose lease was already reclaimed replaces its
`abandoned` event instead, so every generation id ends with exactly one event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Awaitable, Callable, TypeVar

from ..aws import AwsClient
from ..errors import InsufficientCredits, InvalidApiKey, OrganizationDisabled, RateLimitExceeded
from ..jsonio import decimal_text
from .clock import iso_ms
from .codec import to_item
from .errors import ConditionFailed, StorageError, TransactionConflict, translate_storage_error
from .usage import UsageEvent

__all__ = ["Lease", "Ledger", "new_generation_id", "with_ledger"]

T = TypeVar("T")

log = logging.getLogger("kiln.ledger")

# Conditions, named (see the module docstring for what each protects).
ORG_EXISTS = "attribute_exists(#org_id)"
ORG_ACTIVE = "#status = :active"
HAS_CREDITS = "#credits > :zero"
HAS_FREE_SLOT = "size(#leases) < #limit"
ADMISSION = " AND ".join((ORG_EXISTS, ORG_ACTIVE, HAS_CREDITS, HAS_FREE_SLOT))
LEASE_HELD = "attribute_exists(#leases.#gen)"
EVENT_IS_NEW = "attribute_not_exists(#gen_id)"
EVENT_IS_ABANDONED = "#status = :abandoned"

# A reclaim is one transaction: at most this many leases at once (DynamoDB allows 100 items).
MAX_RECLAIM = 49


def new_generation_id(now: float) -> str:
    """Unique, and sortable by creation time: gen- + 12 hex of milliseconds + 14 random hex."""
    return f"gen-{int(now * 1000):012x}{secrets.token_hex(7)}"


@dataclass(frozen=True)
class Lease:
    gen_id: str
    org_id: str
    key_id: str
    model: str
    endpoint: str
    streamed: bool
    started: float
    expires: float

    def to_attribute(self) -> dict[str, Any]:
        return {
            "M": {
                "exp": {"N": repr(round(self.expires, 3))},
                "started": {"N": repr(round(self.started, 3))},
                "key": {"S": self.key_id},
                "model": {"S": self.model},
                "endpoint": {"S": self.endpoint},
                "streamed": {"BOOL": self.streamed},
            }
        }

    @classmethod
    def from_attribute(cls, gen_id: str, org_id: str, value: dict[str, Any]) -> "Lease":
        fields = value.get("M", {})

        def text(name: str) -> str:
            return fields.get(name, {}).get("S", "")

        return cls(
            gen_id=gen_id,
            org_id=org_id,
            key_id=text("key"),
            model=text("model"),
            endpoint=text("endpoint"),
            streamed=bool(fields.get("streamed", {}).get("BOOL", False)),
            started=float(fields.get("started", {}).get("N", "0")),
            expires=float(fields.get("exp", {}).get("N", "0")),
        )


class Ledger:
    """Admission and settlement over DynamoDB, on the caller's event loop."""

    def __init__(
        self,
        aws: AwsClient,
        *,
        orgs_table: str,
        usage_table: str,
        lease_ttl: float,
        settle_attempts: int = 4,
        retention_days: int = 0,
        clock: Callable[[], float] = time.time,
    ):
        self._aws = aws
        self._orgs_table = orgs_table
        self._usage_table = usage_table
        self._lease_ttl = lease_ttl
        self._settle_attempts = settle_attempts
        self._retention_seconds = retention_days * 86400
        self._clock = clock

    # -- admission -------------------------------------------------------------------------

    async def admit(self, *, org_id: str, key_id: str, model: str, endpoint: str, streamed: bool) -> Lease:
        """Take one of the org's slots or raise 402 / 429 / 403 (StorageError if DynamoDB fails)."""
        now = self._clock()
        lease = Lease(new_generation_id(now), org_id, key_id, model, endpoint, streamed, now, now + self._lease_ttl)
        for attempt in range(2):
            try:
                await self._call(
                    "UpdateItem",
                    {
                        "TableName": self._orgs_table,
                        "Key": {"org_id": {"S": org_id}},
                        "UpdateExpression": "SET #leases.#gen = :lease",
                        "ConditionExpression": ADMISSION,
                        "ExpressionAttributeNames": {
                            "#org_id": "org_id",
                            "#status": "status",
                            "#credits": "credits",
                            "#leases": "leases",
                            "#limit": "concurrency_limit",
                            "#gen": lease.gen_id,
                        },
                        "ExpressionAttributeValues": {
                            ":active": {"S": "active"},
                            ":zero": {"N": "0"},
                            ":lease": lease.to_attribute(),
                        },
                        "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                    },
                )
                return lease
            except ConditionFailed as refused:
                old = refused.old_item
                if not old:
                    raise InvalidApiKey("Incorrect API key provided.") from None
                if old.get("status", {}).get("S") != "active":
                    raise OrganizationDisabled("Your organization is disabled. Contact support.") from None
                if Decimal(old.get("credits", {}).get("N", "0")) <= 0:
                    raise InsufficientCredits(
                        "Your organization is out of credits. Add credits to continue."
                    ) from None
                expired = self._expired_leases(org_id, old, self._clock())
                if attempt == 0 and expired:
                    await self._reclaim(org_id, expired)
                    continue
                limit = old.get("concurrency_limit", {}).get("N", "?")
                raise RateLimitExceeded(
                    f"Your organization already has {limit} requests in flight, its limit. "
                    "Retry with exponential backoff."
                ) from None
        raise AssertionError("unreachable")

    @staticmethod
    def _expired_leases(org_id: str, old: dict[str, Any], now: float) -> list[Lease]:
        leases = old.get("leases", {}).get("M", {})
        found = [Lease.from_attribute(gen, org_id, value) for gen, value in leases.items()]
        return [lease for lease in found if lease.expires <= now][:MAX_RECLAIM]

    async def _reclaim(self, org_id: str, leases: list[Lease]) -> None:
        """Free expired leases; each gets an `abandoned` usage event (tokens unknown, cost 0)."""
        names = {"#leases": "leases", "#exp": "exp"}
        values: dict[str, Any] = {}
        removes, unchanged = [], []
        for index, lease in enumerate(leases):
            names[f"#g{index}"] = lease.gen_id
            values[f":e{index}"] = {"N": repr(round(lease.expires, 3))}
            removes.append(f"#leases.#g{index}")
            unchanged.append(f"#leases.#g{index}.#exp = :e{index}")
        items: list[dict[str, Any]] = [
            {
                "Update": {
                    "TableName": self._orgs_table,
                    "Key": {"org_id": {"S": org_id}},
                    "UpdateExpression": "REMOVE " + ", ".join(removes),
                    "ConditionExpression": " AND ".join(unchanged),
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": values,
                }
            }
        ]
        for lease in leases:
            event = UsageEvent(
                gen_id=lease.gen_id,
                org_id=org_id,
                created_at=iso_ms(lease.started),
                key_id=lease.key_id,
                model=lease.model,
                endpoint=lease.endpoint,
                streamed=lease.streamed,
                status="abandoned",
                cost=Decimal(0),
                error="lease expired before the request settled (gateway crash or timeout)",
            )
            items.append(self._put_event(event, EVENT_IS_NEW))
        try:
            await self._call("TransactWriteItems", {"TransactItems": items})
            log.warning(json.dumps({"event": "leases_reclaimed", "org_id": org_id, "gen_ids": [l.gen_id for l in leases]}))
        except TransactionConflict as conflict:
            # Another admission reclaimed them first, or one settled just now: nothing to do.
            log.info(json.dumps({"event": "reclaim_raced", "org_id": org_id, "reasons": conflict.reasons}))

    # -- settlement ------------------------------------------------------------------------

    async def settle(self, lease: Lease, event: UsageEvent) -> str:
        """Release the lease, debit `event.cost`, write the event; retried with backoff.

        Returns "settled", "replaced_abandoned" or "already_settled". Raises StorageError
        only after every attempt failed; the caller must then keep the event (log it).
        """
        delay = 0.05
        for attempt in range(1, self._settle_attempts + 1):
            try:
                return await self._settle_once(lease, event)
            except StorageError:
                if attempt == self._settle_attempts:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def _settle_once(self, lease: Lease, event: UsageEvent) -> str:
        cost = {":cost": {"N": decimal_text(event.cost)}}
        release = {
            "Update": {
                "TableName": self._orgs_table,
                "Key": {"org_id": {"S": lease.org_id}},
                "UpdateExpression": "SET #credits = #credits - :cost REMOVE #leases.#gen",
                "ConditionExpression": LEASE_HELD,
                "ExpressionAttributeNames": {"#credits": "credits", "#leases": "leases", "#gen": lease.gen_id},
                "ExpressionAttributeValues": cost,
            }
        }
        try:
            await self._call("TransactWriteItems", {"TransactItems": [release, self._put_event(event, EVENT_IS_NEW)]})
            return "settled"
        except TransactionConflict as conflict:
            if conflict.reasons[:1] != ["ConditionalCheckFailed"]:
                raise StorageError(f"settle cancelled: {conflict.reasons}") from None
        # The lease is gone: either this settle already happened, or the lease expired and was
        # reclaimed as `abandoned`. Replace the abandoned event and bill what was used.
        debit = {
            "Update": {
                "TableName": self._orgs_table,
                "Key": {"org_id": {"S": lease.org_id}},
                "UpdateExpression": "SET #credits = #credits - :cost",
                "ConditionExpression": ORG_EXISTS,
                "ExpressionAttributeNames": {"#credits": "credits", "#org_id": "org_id"},
                "ExpressionAttributeValues": cost,
            }
        }
        try:
            await self._call("TransactWriteItems", {"TransactItems": [debit, self._put_event(event, EVENT_IS_ABANDONED)]})
            return "replaced_abandoned"
        except TransactionConflict as conflict:
            if conflict.reasons[1:2] == ["ConditionalCheckFailed"]:
                return "already_settled"
            raise StorageError(f"settle cancelled: {conflict.reasons}") from None

    def _put_event(self, event: UsageEvent, condition: str) -> dict[str, Any]:
        if self._retention_seconds and event.expires_at is None:
            event = replace(event, expires_at=int(self._clock() + self._retention_seconds))
        put: dict[str, Any] = {
            "TableName": self._usage_table,
            "Item": to_item(event),
            "ConditionExpression": condition,
        }
        if condition == EVENT_IS_NEW:
            put["ExpressionAttributeNames"] = {"#gen_id": "gen_id"}
        else:
            put["ExpressionAttributeNames"] = {"#status": "status"}
            put["ExpressionAttributeValues"] = {":abandoned": {"S": "abandoned"}}
        return {"Put": put}

    async def _call(self, operation: str, payload: dict[str, Any]) -> Any:
        try:
            return await self._aws.dynamodb(operation, payload)
        except Exception as exc:  # noqa: BLE001 - translated into the storage error tree
            raise translate_storage_error(exc) from exc


def with_ledger(settings: Any, use: Callable[[Ledger], Awaitable[T]], *, http: Any = None) -> T:
    """For synchronous callers (operators' tools, tests): run `use(ledger)` on a fresh loop and client."""

    async def main() -> T:
        aws = AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url, http=http)
        try:
            ledger = Ledger(
                aws,
                orgs_table=settings.orgs_table,
                usage_table=settings.usage_table,
                lease_ttl=settings.lease_ttl_seconds,
                settle_attempts=settings.settle_attempts,
                retention_days=settings.usage_retention_days,
            )
            return await use(ledger)
        finally:
            await aws.aclose()
            if http is not None:
                await http.aclose()

    return asyncio.run(main())
