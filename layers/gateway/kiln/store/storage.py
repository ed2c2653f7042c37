"""The request path's one storage interface: keys, orgs (leases and credits), usage events.

`Storage` says what the gateway needs of its storage; `DynamoStorage` is the DynamoDB
implementation over the lean client (`kiln.aws`), with every table and attribute name from
`kiln.store.schema`. The ledger (admission, renewal, settlement) is its part for orgs.
Authentication and the handlers use only this, never the client, so a different store (or
a test double) is one class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

from ..aws import tried_once
from .errors import translate_storage_error
from .keyspend import KeyLimits
from .ledger import Ledger
from .retry import RetryPolicy
from .schema import KEY, ORG, USAGE
from .usage import UsageEvent

__all__ = ["DynamoStorage", "KeyEntry", "Storage", "key_entry"]


@dataclass(frozen=True)
class KeyEntry:
    """What authentication needs of a key item."""

    key_id: str
    org_id: str
    active: bool
    last_used_at: str  # "" when never recorded
    role: str = "inference"  # or "management"
    models: frozenset[str] | None = None  # the allowlist; None: every model
    limits: KeyLimits = field(default_factory=KeyLimits)


# what authentication reads of a key item (never its hash, never more)
_KEY_FIELDS = (KEY.key_id, KEY.org_id, KEY.status, KEY.last_used_at, KEY.role, KEY.models, KEY.concurrency,
               KEY.spend_limit, KEY.spend_period)


def key_entry(item: dict[str, Any]) -> KeyEntry:
    """A key item (wire form) as authentication sees it."""
    concurrency = item.get(KEY.concurrency, {}).get("N")
    spend_limit = item.get(KEY.spend_limit, {}).get("N")
    models = item.get(KEY.models, {}).get("SS")
    return KeyEntry(
        item[KEY.key_id]["S"],
        item[KEY.org_id]["S"],
        item.get(KEY.status, {}).get("S") == "active",
        item.get(KEY.last_used_at, {}).get("S", ""),
        role=item.get(KEY.role, {}).get("S") or "inference",
        models=frozenset(models) if models is not None else None,
        limits=KeyLimits(
            concurrency=int(concurrency) if concurrency is not None else None,
            spend_limit=Decimal(spend_limit) if spend_limit is not None else None,
            spend_period=item.get(KEY.spend_period, {}).get("S") or "total",
        ),
    )


class Storage(Protocol):
    ledger: Ledger

    async def find_key(self, key_hash: str) -> KeyEntry | None:
        """The key with this hash, or None."""

    async def org_active(self, org_id: str) -> bool | None:
        """Whether the org is active; None if it does not exist."""

    async def touch_key(self, key_hash: str, when: str) -> None:
        """Record the key's last use (bookkeeping: never on a request's path)."""

    async def event_of_org(self, gen_id: str, org_id: str) -> UsageEvent | None:
        """The usage event if it exists and belongs to `org_id`; None otherwise, indistinguishably."""


# A request's reads wait less than its writes (the ledger's 10 s): a read found nothing to
# undo, and a client waits on it before anything else
_READS = RetryPolicy(attempts=20, budget_seconds=2.0)


class DynamoStorage:
    def __init__(self, aws: Any, *, keys_table: str, orgs_table: str, usage_table: str, ledger: Ledger,
                 reclaims: bool = True) -> None:
        self._aws = aws
        self._keys_table, self._orgs_table, self._usage_table = keys_table, orgs_table, usage_table
        self.ledger = ledger
        # whether a disabled org's dead leases seen by a lookup are reclaimed from here: only a
        # function that admits may write an org's leases and credits and the usage table
        self._reclaims = reclaims

    async def _get(self, payload: dict[str, Any], what: str) -> dict[str, Any]:
        """A GetItem on a request's path (a cold cache's key or org), tried again, one call a try,
        while DynamoDB refuses it for a while (throttling, a 5xx, a lost answer: a read is safe to
        repeat): a burst of throttling that outlasts the AWS client's own three tries in a tenth
        of a second would otherwise answer the request 503, as the admission after it would not."""

        async def get() -> dict[str, Any]:
            try:
                return await tried_once(self._aws).dynamodb("GetItem", payload)
            except Exception as exc:  # noqa: BLE001 - translated into the storage error tree, as the ledger's calls are
                raise translate_storage_error(exc) from exc

        return await _READS.run(get, what=what)

    async def find_key(self, key_hash: str) -> KeyEntry | None:
        found = await self._get(
            {
                "TableName": self._keys_table,
                "Key": {KEY.hash_key: {"S": key_hash}},
                "ProjectionExpression": ", ".join(f"#a{index}" for index in range(len(_KEY_FIELDS))),
                "ExpressionAttributeNames": {f"#a{index}": name for index, name in enumerate(_KEY_FIELDS)},
                # read strongly: the answer is cached for the auth cache time, and a replica
                # behind a revocation would serve the key for that long again
                "ConsistentRead": True,
            },
            "key lookup",
        )
        item = found.get("Item")
        if not item:
            return None
        return key_entry(item)

    async def org_active(self, org_id: str) -> bool | None:
        found = await self._get(
            {
                "TableName": self._orgs_table,
                "Key": {ORG.hash_key: {"S": org_id}},
                # its leases too (a read costs the whole item's size whatever it projects)
                "ProjectionExpression": "#status, #leases",
                "ExpressionAttributeNames": {"#status": ORG.status, "#leases": ORG.leases},
                "ConsistentRead": True,  # cached as the key is (above)
            },
            "org lookup",
        )
        item = found.get("Item")
        if not item:
            return None
        active = item.get(ORG.status, {}).get("S") == "active"
        if not active and self._reclaims and self.ledger.holds_dead_leases(item):
            # its requests are refused from here on (403) with no admission, the one reader of its
            # leases: the dead ones it holds are reclaimed off the request's path
            self.ledger.reclaim_refused(org_id)
        return active

    async def touch_key(self, key_hash: str, when: str) -> None:
        await self._aws.dynamodb(
            "UpdateItem",
            {
                "TableName": self._keys_table,
                "Key": {KEY.hash_key: {"S": key_hash}},
                "UpdateExpression": "SET #used = :now",
                "ConditionExpression": "attribute_exists(#hash)",
                "ExpressionAttributeNames": {"#used": KEY.last_used_at, "#hash": KEY.hash_key},
                "ExpressionAttributeValues": {":now": {"S": when}},
            },
        )

    async def event_of_org(self, gen_id: str, org_id: str) -> UsageEvent | None:
        found = await self._aws.dynamodb(
            "GetItem",
            {"TableName": self._usage_table, "Key": {USAGE.hash_key: {"S": gen_id}}, "ConsistentRead": True},
        )
        item = found.get("Item")
        if not item or item.get(USAGE.org_id, {}).get("S") != org_id:
            return None
        return UsageEvent.from_item(item)
