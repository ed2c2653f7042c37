"""An org's API keys: issue, read, list, change and revoke them (contract §10).

One implementation for both doors: the self-service API (`kiln.selfservice`, management
keys) and the operators' CLI (`kiln admin keys`, through the synchronous wrappers of
`kiln.store.keys`). It talks to DynamoDB over the lean client (`kiln.aws`) in wire form,
with every name from `kiln.store.schema`, so the request path never loads pynamodb.

A key's secret is made here, returned once and stored only as its SHA-256. A key is found
by id through the keys table's `by_key_id` index (eventually consistent: a key made a
moment ago may take a second to be found by id; its secret works at once), then written
by its hash with a condition naming its org, so an id of another org is never touched.
Changes are PATCH-like: a field given as null goes back to its default.

A key with a spend limit counts its spend in one figure on its org item, with a marker of
its kind of period (kiln.store.keyspend); key management keeps them in step with the key as
stored: a revocation or a limit removed takes them off, a limit set or a new spend period sets
the marker and brings the new period's figure up to what the key already spent in it (from its
tally). A key without a limit is shown its spend from its tally, which every write of one of
its usage events adds to (kiln.store.tally); a key made before tallies were kept, summed from
its events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Collection, Mapping, Sequence

from ..aws import tried_once
from ..errors import shortened
from ..shown import first_hidden
from ..usage_report import KeySpend
from .clock import iso_ms
from .codec import number
from .errors import (
    AlreadyRevoked,
    ConditionFailed,
    RecordNotFound,
    StorageError,
    TransactionCancelled,
    UnstorableValue,
    condition_failure,
    is_transient,
    may_have_been_applied,
    translate_storage_error,
)
from .keys import _SHOWN_PREFIX, KEY_PREFIX, IssuedKey, KeyInfo, hash_secret
from .keyspend import (
    PERIODS,
    KeyLimits,
    figures_of,
    kind_of_figure,
    marker_attribute,
    marker_of,
    period_over,
    period_start,
    resets_at,
    spend_attributes_by_key,
    spend_in,
)
from .retry import RetryPolicy, client_token
from .schema import KEY, ORG
from .tally import reads_for, tallied_spends
from .tally_backfill import TallyBackfill, tally_org
from .usage import key_costs

__all__ = [
    "EDITABLE",
    "KEY_ID",
    "MAX_LABEL",
    "MAX_LIMITED_KEYS",
    "ROLES",
    "InvalidKeyAttribute",
    "Keyring",
    "key_object",
    "validate_changes",
]

log = logging.getLogger("kiln.keys")

KEY_ID = re.compile(r"key_[0-9a-f]{16}")
ROLES = ("inference", "management")
# what a caller may set on a key, at creation or later
EDITABLE = ("label", "role", "models", "concurrency", "spend_limit", "spend_period")
# what an attribute cleared (null) goes back to; the others to None
_DEFAULTS = {"role": "inference", "spend_period": "total"}
# A key-management write to an org item meets the settle transactions of its requests, and
# one to a key item another change's transaction of that key: DynamoDB refuses it with
# TransactionConflictException, unapplied. A single write is tried again within the ledger's
# policy (_WRITES, in `_update`); a change read and then written, within _CONFLICT_ATTEMPTS.
_CONFLICT_ATTEMPTS = 20
_WRITES = RetryPolicy()
# A write reaches a global secondary index within about a second (AWS's figure): a key id not
# found in the index is looked for again after each of these pauses before it is no key's
_INDEX_WAITS = (0.1, 0.2, 0.4, 0.8)
# The keys this process made, changed or revoked lately, by (keys table, org): the by_org index
# may not hold them yet, or hold them as they were, so the org's list reads them from the table.
_RECENT_WRITE_SECONDS = 10.0
_recent_writes: dict[tuple[str, str], dict[str, tuple[float, bool]]] = {}  # hash -> (until, changed)
_recent_lock = threading.Lock()  # kiln admin and a test's stack may share a process, not a loop
MAX_LABEL = 100
# a spend limit is below this (38 digits before the point at most)
MAX_SPEND_LIMIT = Decimal("1E+38")
# the most active keys with a spend limit an org may have: each keeps its marker and figures on
# the org item (about 130 bytes at a period's turn), which every admission and settle writes,
# billed by its size (1 WCU a KB, 2 in a transaction), and one item's partition takes 1 000 WCU
# a second: at 100 (about 13 KB) the org is served some 24 requests a second before DynamoDB
# throttles it, at 1 000 only 2 or 3
MAX_LIMITED_KEYS = 100
# The org item's count of its active keys with a spend limit, changed in the same transaction as
# each key that gains or loses one (made with one, given one, its limit removed, revoked) and
# conditioned on the cap: limits set at once, from any number of processes, never pass it. An
# org that has none yet (its keys made before it was kept) has it counted from its keys first.
LIMITED_KEYS = "limited_keys"
# A request in flight when its key loses its limit (revoked, or the limit removed) adds its
# cost to the figure its lease names when it settles, after key management removed it: that
# figure is left where nothing reads it. Each call that may give a key a limit first clears
# what keys without one left (at most this many keys at a time), so those leftovers are held
# to the keys that had a limit since the last such call: the cap above bounds them too.
MAX_CLEARED = 100
_CLEAR_ATTEMPTS = 3
# the condition a key's write adds so as not to change, or revoke again, a revoked key
NOT_REVOKED = " AND #status <> :revoked"
# an amount as text: ASCII digits, a point, an exponent (a number's JSON form, or Decimal's)
_AMOUNT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
# the spend figures live on the org item: see kiln.store.keyspend


class InvalidKeyAttribute(ValueError):
    """A key attribute that cannot be stored; `param` names it (a 400 for the API)."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # invalid_value, invalid_type or unknown_parameter


def validate_changes(body: Mapping[str, Any], *, known_models: Collection[str] | None,
                     org_limit: int | None) -> dict[str, Any]:
    """The attributes to set (a value) or clear (None), checked: InvalidKeyAttribute otherwise.

    `known_models`: the catalog's ids (None: not checked); `org_limit`: the org's concurrency
    limit, the most a key may have (None: not checked).
    """
    unknown = sorted(name for name in body if name not in EDITABLE)
    if unknown:
        name = shortened(unknown[0])
        raise InvalidKeyAttribute(name, f"Unrecognized key attribute: {name!r}. A key has {', '.join(EDITABLE)}.",
                                  "unknown_parameter")
    changes: dict[str, Any] = {}
    for name, value in body.items():
        changes[name] = None if value is None else _CHECKS[name](value, known_models, org_limit)
    return changes


def _label(value: Any, known_models: Any, org_limit: Any) -> str:
    if not isinstance(value, str):
        raise InvalidKeyAttribute("label", "label must be a string.", "invalid_type")
    if len(value) > MAX_LABEL:
        raise InvalidKeyAttribute("label", f"label must be at most {MAX_LABEL} characters.")
    if value != value.strip():  # a blank at an end, which no table shows: "prod " passes for "prod"
        raise InvalidKeyAttribute("label", "label must not begin or end with a blank.")
    hidden = first_hidden(value, emoji=True)  # a label may hold emoji sequences
    if hidden is not None:
        # a label is shown to people (`kiln admin keys list`, consoles): a newline, an escape
        # sequence, a direction override or an invisible character would let it pass for
        # other rows or other text
        raise InvalidKeyAttribute(
            "label", f"label must not hold control or invisible characters; it holds U+{ord(hidden):04X}.")
    return value


def _role(value: Any, known_models: Any, org_limit: Any) -> str:
    if value not in ROLES:
        raise InvalidKeyAttribute("role", f"role must be one of {', '.join(ROLES)}.")
    return value


def _models(value: Any, known_models: Collection[str] | None, org_limit: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(item, str) for item in value):
        raise InvalidKeyAttribute("models", "models must be a non-empty list of model ids (null: every model).")
    if known_models is not None:
        unknown = [item for item in value if item not in known_models]
        if unknown:
            raise InvalidKeyAttribute("models", f"The model `{shortened(unknown[0])}` is not in the catalog.")
    return tuple(sorted(set(value)))


def _concurrency(value: Any, known_models: Any, org_limit: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidKeyAttribute("concurrency", "concurrency must be an integer.", "invalid_type")
    if value < 1 or (org_limit is not None and value > org_limit):
        bound = f"1 to {org_limit}, the organization's limit" if org_limit is not None else "at least 1"
        raise InvalidKeyAttribute("concurrency", f"concurrency must be {bound}; got {value}.")
    return value


def _spend_limit(value: Any, known_models: Any, org_limit: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise InvalidKeyAttribute("spend_limit", "spend_limit must be an amount of USD (a number or a decimal string).",
                                  "invalid_type")
    text = value.strip(" \t\r\n") if isinstance(value, str) else str(value)  # JSON's blanks, not Unicode's
    try:
        # Decimal() would take digits of any script and underscores between them ("1_000",
        # "١٠"): an amount is written in ASCII digits, as JSON writes numbers
        amount = Decimal(text) if _AMOUNT.fullmatch(text) else None
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite() or amount < 0:
        raise InvalidKeyAttribute("spend_limit", "spend_limit must be a non-negative amount of USD.")
    try:
        number(amount)
    except UnstorableValue:
        raise InvalidKeyAttribute("spend_limit", "spend_limit has too many digits or is out of range.") from None
    if amount >= MAX_SPEND_LIMIT:
        # stored as a plain number: beyond 38 digits before the point DynamoDB's readers round it
        raise InvalidKeyAttribute("spend_limit", "spend_limit must be below 1e38 USD.")
    return amount


def _spend_period(value: Any, known_models: Any, org_limit: Any) -> str:
    if value not in PERIODS:
        raise InvalidKeyAttribute("spend_period", f"spend_period must be one of {', '.join(PERIODS)}.")
    return value


_CHECKS: dict[str, Callable[[Any, Any, Any], Any]] = {
    "label": _label,
    "role": _role,
    "models": _models,
    "concurrency": _concurrency,
    "spend_limit": _spend_limit,
    "spend_period": _spend_period,
}


# -- items ---------------------------------------------------------------------------------


def _wire(name: str, value: Any) -> dict[str, Any]:
    if name == "models":
        return {"SS": list(value)}
    if name in ("concurrency", "spend_limit"):
        return {"N": number(value)}
    return {"S": value}


def _info(item: dict[str, Any]) -> KeyInfo:
    def text(name: str) -> str | None:
        return item.get(name, {}).get("S")

    concurrency = item.get(KEY.concurrency, {}).get("N")
    spend_limit = item.get(KEY.spend_limit, {}).get("N")
    models = item.get(KEY.models, {}).get("SS")
    return KeyInfo(
        key_id=item[KEY.key_id]["S"],
        org_id=item[KEY.org_id]["S"],
        status=text(KEY.status) or "active",
        prefix=text(KEY.prefix) or "",
        created_at=text(KEY.created_at) or "",
        revoked_at=text(KEY.revoked_at),
        last_used_at=text(KEY.last_used_at),
        label=text(KEY.label),
        role=text(KEY.role) or "inference",
        models=tuple(sorted(models)) if models is not None else None,
        concurrency=int(concurrency) if concurrency is not None else None,
        spend_limit=Decimal(spend_limit) if spend_limit is not None else None,
        spend_period=text(KEY.spend_period) or "total",
        tallied=item.get(KEY.tallied, {}).get("BOOL") is True,
    )


def key_object(key: KeyInfo, org_item: Mapping[str, Any], now: float, *, spend: Decimal | None = None) -> dict[str, Any]:
    """A key as its org sees it (never its secret or hash); `spend` is the current period's
    (given, as Keyring.spends sums it; else the key's figure on `org_item`)."""
    resets = resets_at(key.spend_period, now)
    if spend is None:
        spend = spend_in(dict(org_item), key.key_id, key.spend_period, now)
    return {
        "object": "key",
        "id": key.key_id,
        "label": key.label,
        "role": key.role,
        "models": list(key.models) if key.models is not None else None,
        "concurrency": key.concurrency,
        "spend_limit": key.spend_limit,
        "spend_period": key.spend_period,
        "spend": spend,
        "period_resets_at": iso_ms(resets.timestamp()) if resets is not None else None,
        "created_at": key.created_at,
        "last_used_at": key.last_used_at,
        "revoked_at": key.revoked_at,
        "status": key.status,
        "prefix": key.prefix,
    }


@dataclass(frozen=True)
class OrgView:
    """What key management reads of an org item (wire form kept for the keys' spend)."""

    org_id: str
    active: bool
    concurrency_limit: int
    credits: Decimal
    item: dict[str, Any]


def _forget_old_writes() -> None:
    """Drop what _recent_writes holds longer than _RECENT_WRITE_SECONDS, of every org (the
    caller holds _recent_lock)."""
    now = time.monotonic()
    for place in list(_recent_writes):
        writes = _recent_writes[place]
        for key_hash in [key_hash for key_hash, (until, _) in writes.items() if until <= now]:
            del writes[key_hash]
        if not writes:
            del _recent_writes[place]


class Keyring:
    """Key management over the lean client; raises RecordNotFound, AlreadyRevoked, InvalidKeyAttribute."""

    def __init__(self, aws: Any, *, keys_table: str, orgs_table: str, usage_table: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._aws = aws
        self._keys_table, self._orgs_table, self._usage_table = keys_table, orgs_table, usage_table
        self.clock = clock

    # -- orgs --------------------------------------------------------------------------------

    async def org(self, org_id: str) -> OrgView:
        """The org item, read consistently (its credits, limit and every key's spend figures)."""
        found = await self._aws.dynamodb(
            "GetItem", {"TableName": self._orgs_table, "Key": {ORG.hash_key: {"S": org_id}}, "ConsistentRead": True}
        )
        item = found.get("Item")
        if not item:
            raise RecordNotFound("org", org_id)
        limit = item.get(ORG.concurrency_limit, {}).get("N")
        credits = item.get(ORG.credits, {}).get("N")
        return OrgView(
            org_id,
            item.get(ORG.status, {}).get("S") == "active",
            int(limit) if limit is not None else 0,
            Decimal(credits) if credits is not None else Decimal(0),
            item,
        )

    # -- reading ---------------------------------------------------------------------------

    async def by_hash(self, key_hash: str) -> KeyInfo | None:
        item = await self._current(key_hash)
        return _info(item) if item else None

    async def _item(self, key_id: str, org_id: str | None) -> dict[str, Any]:
        """The key item with this id (of `org_id`, when given), as it is now, or RecordNotFound.

        The id is looked up in a global secondary index, which DynamoDB brings up to date
        within about a second of a write, never at once: a key made a moment ago may not be
        in it yet (it is looked for again, for 1.5 s in all (_INDEX_WAITS), before the id is
        taken for no key of the org's), and what it holds of a key may be older than the key
        (the key item itself is read, consistently)."""
        if not KEY_ID.fullmatch(key_id):
            raise RecordNotFound("key", key_id)
        for wait in (*_INDEX_WAITS, None):
            found = await self._aws.dynamodb(
                "Query",
                {
                    "TableName": self._keys_table,
                    "IndexName": "by_key_id",
                    "KeyConditionExpression": "#id = :id",
                    "ExpressionAttributeNames": {"#id": KEY.key_id},
                    "ExpressionAttributeValues": {":id": {"S": key_id}},
                },
            )
            listed = found.get("Items", [])
            for entry in listed:
                if org_id is None or entry.get(KEY.org_id, {}).get("S") == org_id:
                    item = await self._current(entry[KEY.hash_key]["S"])
                    if item is not None and item.get(KEY.key_id, {}).get("S") == key_id:
                        return item
            if wait is None:
                break
            # an id the index holds for another org is waited for as long as one it does not
            # hold: how long the 404 took must not tell whether the id is a key somewhere
            await asyncio.sleep(wait)
        raise RecordNotFound("key", key_id)

    async def _current(self, key_hash: str) -> dict[str, Any] | None:
        found = await self._aws.dynamodb(
            "GetItem", {"TableName": self._keys_table, "Key": {KEY.hash_key: {"S": key_hash}}, "ConsistentRead": True}
        )
        return found.get("Item")

    async def get(self, key_id: str, *, org_id: str | None = None) -> KeyInfo:
        return _info(await self._item(key_id, org_id))

    async def list(self, org_id: str) -> list[KeyInfo]:
        """The org's keys, oldest first (revoked ones included)."""
        return [_info(item) for item in await self._key_items(org_id)]

    async def _key_items(self, org_id: str) -> list[dict[str, Any]]:
        """The org's key items in wire form, oldest first (from an eventually consistent index)."""
        items: list[dict[str, Any]] = []
        payload: dict[str, Any] = {
            "TableName": self._keys_table,
            "IndexName": "by_org",
            "KeyConditionExpression": "#org = :org",
            "ExpressionAttributeNames": {"#org": KEY.org_id},
            "ExpressionAttributeValues": {":org": {"S": org_id}},
        }
        while True:
            page = await self._aws.dynamodb("Query", payload)
            items += page.get("Items", [])
            if not page.get("LastEvaluatedKey"):
                return await self._as_now(org_id, items)
            payload["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    async def _as_now(self, org_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The index's items of the org with the keys this process wrote lately read from the
        table (consistently, all at once): a key just made that the index has not got is in,
        one just changed or revoked is as it is now."""
        with _recent_lock:
            _forget_old_writes()
            recent = dict(_recent_writes.get((self._keys_table, org_id), {}))
        by_hash = {item[KEY.hash_key]["S"]: item for item in items}
        stale = [key_hash for key_hash, (_, changed) in recent.items() if changed or key_hash not in by_hash]
        if not stale:
            return items
        for key_hash, current in zip(stale, await asyncio.gather(*(self._current(h) for h in stale)), strict=True):
            if current is not None and current.get(KEY.org_id, {}).get("S") == org_id:
                by_hash[key_hash] = current
        return sorted(by_hash.values(), key=lambda item: item.get(KEY.created_at, {}).get("S", ""))

    def _wrote(self, org_id: str, key_hash: str, *, changed: bool = True) -> None:
        """Note a write of a key item (`changed`: of one that was there), before it is sent: an
        answer may be lost, the write not."""
        with _recent_lock:
            _forget_old_writes()
            writes = _recent_writes.setdefault((self._keys_table, org_id), {})
            writes[key_hash] = (time.monotonic() + _RECENT_WRITE_SECONDS,
                                changed or writes.get(key_hash, (0, False))[1])

    # -- spend -----------------------------------------------------------------------------

    async def spends(self, org_id: str, keys: Sequence[KeyInfo], org_item: Mapping[str, Any],
                     now: float) -> dict[str, Decimal]:
        """Key id -> its spend in the current period of its spend_period at `now`: a key with a
        spend limit, its figure on `org_item`; any other (or a revoked key, whose figures are
        gone), its tally (kiln.store.tally), all of them read in batches; a key made before
        tallies were kept, summed from its usage events (since its creation, for `total`),
        all of those from one read of the org's events."""
        spent: dict[str, Decimal] = {}
        starts: dict[str, str] = {}
        tallies: dict[str, list[tuple[str, str]]] = {}
        for key in keys:
            if _counted_on_org(key):
                spent[key.key_id] = spend_in(dict(org_item), key.key_id, key.spend_period, now)
            elif key.tallied:
                tallies[key.key_id] = reads_for(key.key_id, key.spend_period, key.created_at, now)
            else:
                starts[key.key_id] = _period_began(key, now)
        if tallies:
            spent.update(await tallied_spends(self._aws, self._usage(), tallies))
        if starts:
            summed = KeySpend(starts)
            only = next(iter(starts)) if len(starts) == 1 else None
            async for key_id, created_at, cost in key_costs(self._aws, self._usage(), org_id, summed.since or "",
                                                             key_id=only):
                summed.add(key_id, created_at, cost)
            spent.update({key_id: summed.of(key_id) for key_id in starts})
        return spent

    async def describe(self, org_id: str, keys: Sequence[KeyInfo]) -> list[dict[str, Any]]:
        """The keys (of `org_id`) as their org sees them (key_object), each with its spend."""
        now = self.clock()
        org = await self.org(org_id)
        spent = await self.spends(org_id, keys, org.item, now)
        return [key_object(key, org.item, now, spend=spent[key.key_id]) for key in keys]

    def _usage(self) -> str:
        if self._usage_table is None:
            raise ValueError("this keyring reads no usage table: a key's spend without a limit cannot be summed")
        return self._usage_table

    # -- the keys' figures on the org item (kiln.store.keyspend) ------------------------------

    async def _org_write(self, org_id: str, update: str, names: dict[str, str],
                         values: dict[str, Any] | None = None, condition: str = "", *, idempotent: bool = True) -> bool:
        """One UpdateItem of an org item that exists, tried again while it meets settle
        transactions; False if its condition (or the org) failed."""
        payload: dict[str, Any] = {
            "TableName": self._orgs_table,
            "Key": {ORG.hash_key: {"S": org_id}},
            "UpdateExpression": update,
            "ConditionExpression": "attribute_exists(#org_id)" + (f" AND {condition}" if condition else ""),
            "ExpressionAttributeNames": {**names, "#org_id": ORG.org_id},
        }
        if values:
            payload["ExpressionAttributeValues"] = values
        try:
            await self._update(payload, idempotent=idempotent)
        except Exception as exc:
            if isinstance(condition_failure(exc), ConditionFailed):
                return False
            raise
        return True

    async def _update(self, payload: dict[str, Any], *, idempotent: bool = True) -> dict[str, Any]:
        """One UpdateItem, tried again (one call a try, within the ledger's policy) while DynamoDB
        refuses it for a reason that another try may cure: its item inside a transaction in
        flight (an org item in its requests' settles, a key item in a change of its spend
        limit), throttling, a 5xx, and, for an `idempotent` write (one that sets values: applied
        twice, it is applied once), a lost answer. Any other failure, a failed condition
        included, is raised at once; so is a lost answer to a write that adds."""

        async def update() -> dict[str, Any]:
            try:
                # a write that adds is not sent again by the HTTP client either, on a kept-alive
                # connection closed unanswered
                return await tried_once(self._aws).dynamodb("UpdateItem", payload, resend_unanswered=idempotent)
            except Exception as exc:
                failure = translate_storage_error(exc)
                if is_transient(failure) and (idempotent or not may_have_been_applied(failure)):
                    raise failure from exc
                raise

        return await _WRITES.run(update, what="key")

    async def remove_figures(self, org_id: str, key_id: str) -> list[str]:
        """REMOVE the key's spend figures and its marker from its org item, as a consistent read
        finds them: the figures removed."""
        item = (await self.org(org_id)).item
        stale = figures_of(item, key_id)
        names = {f"#f{index}": name for index, name in enumerate(stale)}
        if marker_of(item, key_id) is not None:
            names["#marker"] = marker_attribute(key_id)
        if names:
            await self._org_write(org_id, "REMOVE " + ", ".join(names), names)
        return stale

    async def _clear_leftovers(self, org_id: str, items: Sequence[dict[str, Any]]) -> None:
        """Remove the figures and markers of the org's keys that have no limit (or are revoked),
        left by requests that settled after the change, each key's in a transaction that checks
        its key item still has none: a listing from the index may be behind, the item is not."""
        keys = {item[KEY.key_id]["S"]: item for item in items}
        left = [(key_id, names) for key_id, names in spend_attributes_by_key((await self.org(org_id)).item).items()
                if key_id in keys and not _counted_on_org(_info(keys[key_id]))]
        for key_id, names in left[:MAX_CLEARED]:
            check = {
                "TableName": self._keys_table,
                "Key": {KEY.hash_key: keys[key_id][KEY.hash_key]},
                "ConditionExpression": "#status = :revoked OR attribute_not_exists(#limit)",
                "ExpressionAttributeNames": {"#status": KEY.status, "#limit": KEY.spend_limit},
                "ExpressionAttributeValues": {":revoked": {"S": "revoked"}},
            }
            shown = {f"#l{index}": name for index, name in enumerate(names)}
            removal = {
                "TableName": self._orgs_table,
                "Key": {ORG.hash_key: {"S": org_id}},
                "UpdateExpression": "REMOVE " + ", ".join(shown),
                "ConditionExpression": "attribute_exists(#org_id)",
                "ExpressionAttributeNames": {**shown, "#org_id": ORG.org_id},
            }
            if not await self._clear(org_id, [{"ConditionCheck": check}, {"Update": removal}]):
                return

    async def _clear(self, org_id: str, items: list[dict[str, Any]]) -> bool:
        """One key's clearing, tried again while it meets settles; False if storage failed
        (logged: the next call that may set a limit tries again)."""
        for attempt in range(1, _CLEAR_ATTEMPTS + 1):
            try:
                await self._aws.dynamodb("TransactWriteItems", {"TransactItems": items})
                return True
            except Exception as exc:  # noqa: BLE001 - housekeeping, never the call's failure
                failure = translate_storage_error(exc)
                if isinstance(failure, TransactionCancelled) and not failure.transient:
                    return True  # the key has a limit again: its figures count
                if not is_transient(failure) or attempt == _CLEAR_ATTEMPTS:
                    log.warning(json.dumps({"event": "key_leftovers_not_cleared", "org_id": org_id,
                                            "detail": f"{type(exc).__name__}: {exc}"[:300]}))
                    return False
            await _backoff(attempt)
        raise AssertionError("unreachable")

    async def _tidy(self, key: KeyInfo, *, why: str) -> None:
        """remove_figures after a revocation, which stands whatever comes of it: a failure is
        logged (the figures left only take room on the org item; revoking again removes them)."""
        try:
            await self.remove_figures(key.org_id, key.key_id)
        except Exception as exc:  # noqa: BLE001 - the key's change is made; this is housekeeping
            log.warning(json.dumps({"event": "key_figures_not_removed", "org_id": key.org_id, "key_id": key.key_id,
                                    "after": why, "detail": f"{type(exc).__name__}: {exc}"[:300]}))

    def _following(self, key: KeyInfo, org: Mapping[str, Any], now: float,
                   seed: Decimal | None = None) -> tuple[dict[str, Any], str | None]:
        """The org item's update that brings the key's marker and figures in line with `key` as
        it will be stored, conditioned on the marker as `org` has it; and the figure the key
        will count in now (None: no limit). `seed`: what the key spent in that figure's period,
        the figure's value if it has none yet (one that has is counting: it is never lowered).

        A key that counts against a limit gets its marker (`key_period:<key id>`, its kind of
        period) and loses its figures but those of its kind's periods not over
        (kiln.store.keyspend.period_over: the current one, a later one, the one just ended); a
        key with no limit, or revoked, loses its marker and figures (a request in flight across
        the change that settles into the figure its lease names makes it again, with its own
        cost, where no admission reads it: `_clear_leftovers` removes it later). From then on every settle of
        the key's requests adds its cost to the figure the marker says, those admitted by a
        gateway that does not know the change yet too (kiln.store.ledger: a settle reads the
        marker its lease did not assume)."""
        figure = _limits(key).figure(key.key_id, now) if _counted_on_org(key) else None
        wanted = key.spend_period if figure is not None else None
        found = marker_of(dict(org), key.key_id)
        # its figures but the one it counts in now, of another kind of period, or whose period
        # is over: one of a later period than this clock's (a gateway whose clock runs ahead
        # counts in it) or of the period just ended (one behind still does) stays
        others = [name for name in figures_of(dict(org), key.key_id) if name != figure and (
            wanted is None or kind_of_figure(name) != wanted or period_over(name, now))]
        names = {"#org_id": ORG.org_id, "#marker": marker_attribute(key.key_id),
                 **{f"#o{i}": name for i, name in enumerate(others)}}
        removes = [f"#o{i}" for i in range(len(others))]
        values: dict[str, Any] = {}
        if wanted is None:
            update = "REMOVE " + ", ".join(["#marker", *removes])
        else:
            values[":wanted"] = {"S": wanted}
            update = "SET #marker = :wanted"
            if seed and figure is not None:  # a key that spent nothing has no figure yet
                names["#figure"], values[":seed"] = figure, {"N": number(seed)}
                update += ", #figure = if_not_exists(#figure, :seed)"
            update += " REMOVE " + ", ".join(removes) if removes else ""
        if found is None:
            condition = "attribute_exists(#org_id) AND attribute_not_exists(#marker)"
        else:
            condition, values[":found"] = "attribute_exists(#org_id) AND #marker = :found", {"S": found}
        payload: dict[str, Any] = {
            "TableName": self._orgs_table,
            "Key": {ORG.hash_key: {"S": key.org_id}},
            "UpdateExpression": update,
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
        }
        if values:
            payload["ExpressionAttributeValues"] = values
        return payload, figure

    async def _spent_in_period(self, key: KeyInfo, now: float) -> Decimal:
        """What the key spent in the current period of its spend_period, by its tally (or events)."""
        return (await self.spends(key.org_id, [replace(key, spend_limit=None)], {}, now))[key.key_id]

    async def _raise_to_events(self, key: KeyInfo, figure: str, now: float) -> str:
        """Raise the figure to what the key's tally (or events) says it spent in the period, never
        lowering it, on the condition that it is what was read. A key whose settles keep
        landing between the reads and the write gets, at the last try, what was missing added
        instead: the settles that landed during that read are then counted twice, the side a
        limit errs on."""
        for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
            if attempt > 1:  # the key's settles are landing: let them
                await _backoff(attempt)
            found = (await self.org(key.org_id)).item.get(figure, {}).get("N")
            spent = await self._spent_in_period(key, now)
            counted = Decimal(found) if found is not None else Decimal(0)
            if spent <= counted:
                return figure  # counting already
            if attempt == _CONFLICT_ATTEMPTS:
                await self._org_write(key.org_id, "ADD #f :missing", {"#f": figure},
                                      {":missing": {"N": number(spent - counted)}}, idempotent=False)
                return figure
            values = {":spent": {"N": number(spent)}}
            if found is None:
                condition = "attribute_not_exists(#f)"
            else:
                condition, values[":found"] = "#f = :found", {"N": found}
            if await self._org_write(key.org_id, "SET #f = :spent", {"#f": figure}, values, condition):
                return figure
        raise AssertionError("unreachable: the last try adds what is missing")

    # -- writing ---------------------------------------------------------------------------

    async def create(self, org_id: str, attributes: Mapping[str, Any] | None = None, *,
                     known_models: Collection[str] | None = None) -> IssuedKey:
        """A new key of the org, with `attributes` (validated); its secret is in the answer only."""
        org = await self.org(org_id)
        changes = validate_changes(attributes or {}, known_models=known_models, org_limit=org.concurrency_limit)
        limited = changes.get("spend_limit") is not None
        if limited:
            await self._room_for_a_limit(org_id)
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = KeyInfo(
            key_id=f"key_{secrets.token_hex(8)}",
            org_id=org_id,
            status="active",
            prefix=secret[:_SHOWN_PREFIX],
            created_at=iso_ms(self.clock()),
            tallied=True,
        )
        key = replace(key, **{name: value for name, value in changes.items() if value is not None})
        item = {
            KEY.key_hash: {"S": hash_secret(secret)},
            KEY.key_id: {"S": key.key_id},
            KEY.org_id: {"S": org_id},
            KEY.status: {"S": key.status},
            KEY.prefix: {"S": key.prefix},
            KEY.created_at: {"S": key.created_at},
            KEY.tallied: {"BOOL": True},
        }
        for name, value in changes.items():
            if value is not None:
                item[name] = _wire(name, value)
        self._wrote(org_id, item[KEY.key_hash]["S"], changed=False)

        async def put() -> None:
            try:
                await tried_once(self._aws).dynamodb(
                    "PutItem",
                    {
                        "TableName": self._keys_table,
                        "Item": item,
                        "ConditionExpression": "attribute_not_exists(#hash)",
                        "ExpressionAttributeNames": {"#hash": KEY.hash_key},
                    },
                )
            except Exception as exc:
                # A write is sent again when its answer was lost: the first attempt was
                # applied, so the second finds the item. A hash of 256 random bits is this key's
                # alone: the item holding it with this key id is this very write's.
                if not isinstance(condition_failure(exc), ConditionFailed):
                    raise translate_storage_error(exc) from exc
                found = await self.by_hash(item[KEY.key_hash]["S"])
                if found is None or found.key_id != key.key_id:
                    raise

        # tried on while DynamoDB refuses it for a while (throttled, a 5xx, an answer lost), as
        # the ledger's writes are: a failure answered after a try that was applied would leave
        # a key whose secret no one has, and the caller's retry would make another
        if limited:
            await self._put_counted(org_id, item)
        else:
            await _WRITES.run(put, what="key")
        return IssuedKey(**key.__dict__, secret=secret)

    async def _put_counted(self, org_id: str, item: dict[str, Any]) -> None:
        """Put a new key with a spend limit and count it on its org item, in one transaction
        conditioned on the org having room for it (InvalidKeyAttribute if it has none)."""
        put = {"Put": {"TableName": self._keys_table, "Item": item, "ConditionExpression": "attribute_not_exists(#hash)",
                       "ExpressionAttributeNames": {"#hash": KEY.hash_key}}}
        items = [put, {"Update": _counted(org_id, self._orgs_table, +1)}]
        for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
            if attempt > 1:
                await _backoff(attempt)
            # a try's token: sent again after a lost answer (within the ledger's policy, as a key's
            # put is), it is recognised, not applied twice
            token = client_token("n", f"{item[KEY.key_hash]['S']}|{attempt}")
            try:
                await _WRITES.run(lambda token=token, items=items: self._transact(items, token), what="key")
                return
            except _Cancelled as refused:
                cancelled = refused.cancelled
            if cancelled.failed_condition(0):  # made already: by this very call, its answer lost
                found = await self.by_hash(item[KEY.key_hash]["S"])
                if found is not None and found.key_id == item[KEY.key_id]["S"]:
                    return
                raise StorageError(f"key change cancelled: {cancelled.reasons}")
            if cancelled.failed_condition(1) and (limited := await self._limited_keys(org_id)) >= MAX_LIMITED_KEYS:
                raise _no_room(limited)
            if not (cancelled.failed_condition(1) or cancelled.transient):
                raise StorageError(f"key change cancelled: {cancelled.reasons}")
        raise StorageError("the org's count of keys with a limit kept changing", "SeedRaced")

    async def _transact(self, items: list[dict[str, Any]], token: str) -> None:
        """One TransactWriteItems; a cancellation raised as _Cancelled (not tried again here), a
        failure that another try may cure as the storage's transient error."""
        try:
            await tried_once(self._aws).dynamodb("TransactWriteItems", {"TransactItems": items, "ClientRequestToken": token})
        except Exception as exc:
            cancelled = condition_failure(exc)
            if isinstance(cancelled, TransactionCancelled):
                raise _Cancelled(cancelled) from None
            failure = translate_storage_error(exc)
            if is_transient(failure):
                raise failure from exc
            raise

    async def update(self, key_id: str, attributes: Mapping[str, Any], *, org_id: str | None = None,
                     known_models: Collection[str] | None = None) -> KeyInfo:
        """Set or clear (None) the given attributes of a key; the others are left as they are."""
        item = await self._item(key_id, org_id)
        owner = item[KEY.org_id]["S"]
        limit = None
        if attributes.get("concurrency") is not None:
            limit = (await self.org(owner)).concurrency_limit
        changes = validate_changes(attributes, known_models=known_models, org_limit=limit)
        before = _info(item)
        if before.status == "revoked":  # revoking is final: a change, even of nothing, would say otherwise
            raise AlreadyRevoked(key_id, before.revoked_at)
        if not changes:
            return before
        if changes.get("spend_limit") is not None and before.spend_limit is None:
            await self._room_for_a_limit(owner, changing=key_id)  # one more key with a limit
        # the key's write is conditioned on it not being revoked since it was read
        names = {"#hash": KEY.hash_key, "#org": KEY.org_id, "#status": KEY.status}
        values: dict[str, Any] = {":org": {"S": owner}, ":revoked": {"S": "revoked"}}
        sets, removes = [], []
        for index, (name, value) in enumerate(sorted(changes.items())):
            names[f"#a{index}"] = name
            if value is None:
                removes.append(f"#a{index}")
            else:
                values[f":a{index}"] = _wire(name, value)
                sets.append(f"#a{index} = :a{index}")
        expression = (" SET " + ", ".join(sets) if sets else "") + (" REMOVE " + ", ".join(removes) if removes else "")
        if "spend_limit" not in changes and "spend_period" not in changes:
            return _info(await self._write(item, expression.strip(), names, values, extra_condition=NOT_REVOKED))
        return await self._change_spend(item, changes, expression.strip(), names, values)

    async def _room_for_a_limit(self, org_id: str, *, changing: str | None = None) -> None:
        """InvalidKeyAttribute if the org has MAX_LIMITED_KEYS active keys with a spend limit (the
        write that gives one more key a limit is conditioned on it too: this is the answer
        before any write). First, what keys without a limit left on the org item is cleared
        (MAX_CLEARED), but for the key `changing`: a figure it has counts, and its new limit's
        seed never lowers it."""
        items = await self._key_items(org_id)
        await self._clear_leftovers(org_id, [item for item in items if item[KEY.key_id]["S"] != changing])
        limited = await self._limited_keys(org_id, items)
        if limited >= MAX_LIMITED_KEYS:
            raise _no_room(limited)

    async def recount_limited(self, org_id: str) -> tuple[int | None, int]:
        """Set the org item's count of keys with a spend limit to what its keys say (the count it
        had, None if none; the count now): after functions of a version that kept no count
        changed limits (a rollback, an upgrade's last requests). Made while no key's limit
        changes: the keys are read through an index about a second behind."""
        found = _stored_count((await self.org(org_id)).item)
        limited = _limited_among(await self._key_items(org_id))
        await self._store_count(org_id, limited)
        return found, limited

    async def _limited_keys(self, org_id: str, items: Sequence[dict[str, Any]] | None = None,
                            org_item: Mapping[str, Any] | None = None) -> int:
        """The org item's count of its active keys with a spend limit (`org_item`: the org item
        as just read, or read); first counted from its keys (`items`, or read) and stored, if it
        has none yet."""
        for _ in range(_CONFLICT_ATTEMPTS):
            found = _stored_count(org_item if org_item is not None else (await self.org(org_id)).item)
            if found is not None:
                return found
            org_item = None  # read again after a count another call stored first
            if items is None:
                items = await self._key_items(org_id)
            limited = _limited_among(items)
            if await self._store_count(org_id, limited, only_if_none=True):
                return limited
        raise StorageError("the org's key count kept changing", "SeedRaced")

    async def _store_count(self, org_id: str, limited: int, *, only_if_none: bool = False) -> bool:
        """Set the org item's count of keys with a spend limit (`only_if_none`: if it has none)."""
        return await self._org_write(org_id, "SET #n = :n", {"#n": LIMITED_KEYS}, {":n": {"N": str(limited)}},
                                     "attribute_not_exists(#n)" if only_if_none else "")

    async def _change_spend(self, item: dict[str, Any], changes: Mapping[str, Any], expression: str,
                            names: dict[str, str], values: dict[str, Any]) -> KeyInfo:
        """A change of the key's limit or period: the key and its org item's marker and figures
        written in one transaction, so that neither is ever left without the other (a failure
        writes nothing), the org's part conditioned on the marker as read (a change of the same
        key at once: read both again). Then the figure the key counts in is brought up to what
        its tally (or events) says it spent in the period: the settles before the transaction
        are in the tally, those after it in the figure."""
        key_hash, owner = item[KEY.hash_key]["S"], item[KEY.org_id]["S"]
        key_id = item[KEY.key_id]["S"]
        self._wrote(owner, key_hash)
        # each change its own token: the same items sent by a later change (a key blocked again
        # after it was unblocked) are a new transaction, not a resend DynamoDB would answer as
        # done; a resend of one attempt after a lost answer keeps its token
        change = secrets.token_hex(8)
        seeds: dict[str, Decimal] = {}  # figure → what the key spent in its period, read once
        for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
            if attempt > 1:
                await _backoff(attempt)
            stored = await self._unrevoked(key_hash, owner, key_id)
            after = replace(stored, **{name: (_DEFAULTS.get(name) if value is None else value)
                                       for name, value in changes.items()})
            now = self.clock()
            # what the key spent in the period it will count in, read before the change is made:
            # the change then brings its figure along, even if its answer is lost or what
            # follows fails (a read that fails makes no change at all)
            seed = None
            if _counted_on_org(after):
                period = _limits(after).figure(after.key_id, now)
                if period not in seeds:
                    seeds[period] = await self._spent_in_period(after, now)
                seed = seeds[period]
            org_item = (await self.org(owner)).item
            org_update, figure = self._following(after, org_item, now, seed=seed)
            gained = _counted_on_org(after) - _counted_on_org(stored)  # one more key with a limit, or one less
            if gained:
                await self._limited_keys(owner, org_item=org_item)  # counted, if it was not yet
                org_update = _counted(owner, self._orgs_table, gained, org_update)
            as_read, read_names, read_values = _spend_as_read(stored)
            key_update = {
                "TableName": self._keys_table,
                "Key": {KEY.hash_key: {"S": key_hash}},
                "UpdateExpression": expression,
                # the key as this change was worked out from: another change of its spend between
                # (whose marker may be the one read) makes this one read both again
                "ConditionExpression": "attribute_exists(#hash) AND #org = :org" + NOT_REVOKED + as_read,
                "ExpressionAttributeNames": {**names, **read_names},
                "ExpressionAttributeValues": {**values, **read_values},
            }
            items = [{"Update": key_update}, {"Update": org_update}]
            token = client_token("k", f"{change}|{attempt}|{json.dumps(items, sort_keys=True)}")
            try:
                await self._aws.dynamodb("TransactWriteItems", {"TransactItems": items, "ClientRequestToken": token})
            except Exception as exc:
                cancelled = condition_failure(exc)
                if not isinstance(cancelled, TransactionCancelled):
                    raise
                if gained > 0 and cancelled.failed_condition(1) and (limited := await self._limited_keys(owner)) \
                        >= MAX_LIMITED_KEYS:
                    raise _no_room(limited) from None
                if cancelled.failed_condition(1) or cancelled.failed_condition(0) or cancelled.transient:
                    # the key was revoked (the next read says so), its marker changed, or a settle held
                    # the org item: read both again
                    continue
                raise StorageError(f"key change cancelled: {cancelled.reasons}") from None
            break
        else:
            raise StorageError(f"the spend figures of {key_id} kept changing", "SeedRaced")
        if figure is not None:
            await self._raise_to_events(after, figure, now)
        return await self.by_hash(key_hash) or after

    async def tally_events(self, org_id: str, *,
                           progress: Callable[[TallyBackfill], None] | None = None) -> tuple[TallyBackfill, list[str]]:
        """Add the org's events that are in no tally to their keys' tallies, then have each of
        its keys made before tallies were kept read its spend from them (kiln.store.tally_backfill):
        what was done, and the ids of the keys marked."""
        await self.org(org_id)  # RecordNotFound
        done = await tally_org(self._aws, self._usage(), org_id, progress=progress)
        marked = []
        for key in await self.list(org_id):
            if not key.tallied:
                await self.mark_tallied(key.key_id, org_id)
                marked.append(key.key_id)
        return done, marked

    async def mark_tallied(self, key_id: str, org_id: str) -> KeyInfo:
        """Read the key's spend from its tallies from now on (once every event of it is in them)."""
        item = await self._item(key_id, org_id)
        return _info(await self._write(item, "SET #tallied = :yes", {"#hash": KEY.hash_key, "#org": KEY.org_id,
                                                                      "#tallied": KEY.tallied},
                                       {":org": {"S": org_id}, ":yes": {"BOOL": True}}))

    async def revoke(self, key_id: str, *, org_id: str | None = None) -> KeyInfo:
        """Refuse the key from now on (within the gateway's auth cache time), and take its spend
        figures off its org item; AlreadyRevoked if it was (its figures are removed again:
        a request in flight at the revocation adds to its figure when it settles)."""
        item = await self._item(key_id, org_id)
        if item.get(KEY.status, {}).get("S") == "revoked":
            await self._tidy(_info(item), why="revoked")
            raise AlreadyRevoked(key_id, item.get(KEY.revoked_at, {}).get("S"))
        names = {"#hash": KEY.hash_key, "#org": KEY.org_id, "#status": KEY.status, "#revoked": KEY.revoked_at}
        values = {":org": {"S": item[KEY.org_id]["S"]}, ":revoked": {"S": "revoked"},
                  ":now": {"S": iso_ms(self.clock())}}
        try:
            revoked = await self._revoke_key(item, names, values)
        except AlreadyRevoked:
            # revoked meanwhile, or by this very write, whose answer was lost and whose resend
            # found it done (then at the moment this call wrote): the figures come off either way
            current = await self._item(key_id, org_id)
            await self._tidy(_info(current), why="revoked")
            revoked_at = current.get(KEY.revoked_at, {}).get("S")
            if revoked_at != values[":now"]["S"]:
                raise AlreadyRevoked(key_id, revoked_at) from None
            return _info(current)
        await self._tidy(revoked, why="revoked")
        return revoked

    async def _revoke_key(self, item: dict[str, Any], names: dict[str, str], values: dict[str, Any]) -> KeyInfo:
        """Revoke a key: one with a spend limit counted off its org item in the same transaction,
        the key's part conditioned on its limit as read; one without, by its own item's write,
        conditioned on its having none still (a limit given meanwhile is counted: read again).
        The key as revoked; AlreadyRevoked if it is revoked (by this very call too, its answer lost)."""
        key_hash, owner = item[KEY.hash_key]["S"], item[KEY.org_id]["S"]
        key_id = item[KEY.key_id]["S"]
        for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
            if attempt > 1:
                await _backoff(attempt)
            stored = await self._unrevoked(key_hash, owner, key_id)
            if not _counted_on_org(stored):
                revoked = await self._revoke_unlimited(item, names, values)
                if revoked is not None:
                    return revoked
                continue  # revoked meanwhile, or given a limit: read again
            await self._limited_keys(owner)  # counted, if it was not yet
            self._wrote(owner, key_hash)
            as_read, read_names, read_values = _spend_as_read(stored)
            key_update = {
                "TableName": self._keys_table,
                "Key": {KEY.hash_key: {"S": key_hash}},
                "UpdateExpression": "SET #status = :revoked, #revoked = :now",
                "ConditionExpression": "attribute_exists(#hash) AND #org = :org" + NOT_REVOKED + as_read,
                "ExpressionAttributeNames": {**names, **read_names},
                "ExpressionAttributeValues": {**values, **read_values},
            }
            items = [{"Update": key_update}, {"Update": _counted(owner, self._orgs_table, -1)}]
            # a try's token: sent again after a lost answer, it is recognised, not applied twice
            token = client_token("r", f"{key_hash}|{values[':now']['S']}|{attempt}")
            try:
                await _WRITES.run(lambda token=token, items=items: self._transact(items, token), what="key")
            except _Cancelled as refused:
                cancelled = refused.cancelled
                if cancelled.failed_condition(0) or cancelled.failed_condition(1) or cancelled.transient:
                    continue  # revoked, its limit changed, the count not there, or a settle held the org: read again
                raise StorageError(f"key change cancelled: {cancelled.reasons}") from None
            return await self.by_hash(key_hash) or replace(stored, status="revoked", revoked_at=values[":now"]["S"])
        raise StorageError(f"the spend figures of {key_id} kept changing", "SeedRaced")

    async def _unrevoked(self, key_hash: str, owner: str, key_id: str) -> KeyInfo:
        """The key as stored now: RecordNotFound if it is gone (or another org's), AlreadyRevoked
        if it is revoked."""
        stored = await self.by_hash(key_hash)
        if stored is None or stored.org_id != owner:
            raise RecordNotFound("key", key_id)
        if stored.status == "revoked":
            raise AlreadyRevoked(key_id, stored.revoked_at)
        return stored

    async def _revoke_unlimited(self, item: dict[str, Any], names: dict[str, str],
                                values: dict[str, Any]) -> KeyInfo | None:
        """Revoke a key that has no spend limit, on that condition: None if it failed (revoked
        meanwhile, or given a limit, which the org item counts)."""
        try:
            return _info(await self._write(item, "SET #status = :revoked, #revoked = :now",
                                           {**names, "#no_limit": KEY.spend_limit}, values,
                                           extra_condition=NOT_REVOKED + " AND attribute_not_exists(#no_limit)"))
        except AlreadyRevoked:  # what any failed condition of _write's with one of its own is
            return None

    async def _write(self, item: dict[str, Any], expression: str, names: dict[str, str], values: dict[str, Any], *,
                     extra_condition: str = "") -> dict[str, Any]:
        key_id = item[KEY.key_id]["S"]
        self._wrote(item[KEY.org_id]["S"], item[KEY.hash_key]["S"])
        try:
            answer = await self._update(
                {
                    "TableName": self._keys_table,
                    "Key": {KEY.hash_key: item[KEY.hash_key]},
                    "UpdateExpression": expression,
                    "ConditionExpression": "attribute_exists(#hash) AND #org = :org" + extra_condition,
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": values,
                    "ReturnValues": "ALL_NEW",
                },
            )
        except Exception as exc:
            if isinstance(condition_failure(exc), ConditionFailed):
                if extra_condition:
                    raise AlreadyRevoked(key_id, None) from None
                raise RecordNotFound("key", key_id) from None
            raise
        return answer["Attributes"]


class _Cancelled(Exception):
    """A transaction DynamoDB cancelled: its reasons are the caller's to read, not a retry's."""

    def __init__(self, cancelled: TransactionCancelled) -> None:
        super().__init__(str(cancelled))
        self.cancelled = cancelled


def _counted(org_id: str, table: str, change: int, update: dict[str, Any] | None = None) -> dict[str, Any]:
    """An UpdateItem of the org item (`update`, or one of its own) that also counts one key with
    a spend limit more (conditioned on the org having room for it) or one less."""
    update = dict(update or {"TableName": table, "Key": {ORG.hash_key: {"S": org_id}},
                             "ConditionExpression": "attribute_exists(#org_id)"})
    names = {**update.get("ExpressionAttributeNames", {}), "#org_id": ORG.org_id, "#limited_keys": LIMITED_KEYS}
    values = {**update.get("ExpressionAttributeValues", {}), ":limited_change": {"N": str(change)}}
    condition = update["ConditionExpression"] + " AND attribute_exists(#limited_keys)"
    if change > 0:
        condition += " AND #limited_keys < :limited_most"
        values[":limited_most"] = {"N": str(MAX_LIMITED_KEYS - change + 1)}
    expression = update.get("UpdateExpression", "")
    update.update(UpdateExpression=f"{expression} ADD #limited_keys :limited_change".strip(),
                  ConditionExpression=condition, ExpressionAttributeNames=names, ExpressionAttributeValues=values)
    return update


def _limited_among(items: Sequence[dict[str, Any]]) -> int:
    """How many of these key items are active with a spend limit."""
    return sum(1 for item in items if _counted_on_org(_info(item)))


def _stored_count(org_item: Mapping[str, Any]) -> int | None:
    """The org item's count of keys with a spend limit, None if it has none yet."""
    found = org_item.get(LIMITED_KEYS, {}).get("N")
    return int(Decimal(found)) if found is not None else None


def _no_room(limited: int) -> InvalidKeyAttribute:
    return InvalidKeyAttribute(
        "spend_limit", f"An organization may have at most {MAX_LIMITED_KEYS} active keys with a spend limit, "
        f"and this one has {limited}: remove the limit of a key, or revoke one, first.")


def _spend_as_read(key: KeyInfo) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The condition that a key item's spend limit and period are still `key`'s (a period
    stored as none is `total`), with its names and values."""
    names = {"#read_limit": KEY.spend_limit, "#read_period": KEY.spend_period}
    values: dict[str, Any] = {":read_period": {"S": key.spend_period}}
    if key.spend_limit is None:
        condition = " AND attribute_not_exists(#read_limit)"
    else:
        condition = " AND #read_limit = :read_limit"
        values[":read_limit"] = _wire("spend_limit", key.spend_limit)
    if key.spend_period == "total":
        condition += " AND (attribute_not_exists(#read_period) OR #read_period = :read_period)"
    else:
        condition += " AND #read_period = :read_period"
    return condition, names, values


def _limits(key: KeyInfo) -> KeyLimits:
    return KeyLimits(key.concurrency, key.spend_limit, key.spend_period)


async def _backoff(attempt: int) -> None:
    """The jittered wait before the next try of an org write that met a settle."""
    await asyncio.sleep(random.random() * min(0.25, 0.01 * 2**attempt))


def _counted_on_org(key: KeyInfo) -> bool:
    """Whether the key's spend is a figure on its org item: a key with a spend limit, not revoked."""
    return key.spend_limit is not None and key.status != "revoked"


def _period_began(key: KeyInfo, now: float) -> str:
    """Where the key's current period began, as usage events store time (`total`: its creation)."""
    start = period_start(key.spend_period, now)
    return iso_ms(start.timestamp()) if start is not None else key.created_at
