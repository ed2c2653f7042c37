"""Admission, renewal and settlement: the org's concurrency slots and credits, without a sweeper.

A lease is an entry of the org item's `leases` map (generation id → expiry, what the
request is, and what it had relayed at its last renewal). Its life is short
(`KILN_LEASE_TTL_SECONDS`, 60 s) and a running request renews it (`kiln.store.renewal`,
every `KILN_LEASE_RENEW_SECONDS`, 20 s), so a request that outlives its gateway holds its
slot for at most the TTL, and one that keeps running never loses it.

- **Admission** is one conditional UpdateItem on the org: it adds the lease while the org
  is active, has credits and holds fewer leases than its limit, *or* when the lease is
  already there as this try writes it (a retry of an admission that was applied but whose
  answer was lost is admitted, never refused; a late copy of an earlier try, finding the
  lease renewed or written later, changes nothing). A refusal hands back the item as it was
  (ReturnValuesOnConditionCheckFailure=ALL_OLD): 402 is told from 429 with no second read,
  and leases past their expiry are reclaimed on the spot before one more try. A success
  hands back the item as it was too (ReturnValues=ALL_OLD, no extra write): leases it shows
  past their expiry are reclaimed in the background, off the request's path, so an org
  that never reaches its limit keeps no dead lease either.
- **Renewal** is one UpdateItem, conditioned on the lease being held: a later expiry, and
  the tokens relayed so far and their cost.
- **Reclaiming** is one transaction: remove the expired leases (conditioned on their expiry
  being the one read, so a renewal in between wins), debit what their last renewals
  recorded, and write one `abandoned` usage event each, billed for exactly that. One that
  storage refuses past the retry budget (conflicts, throttling) goes on in rounds in the
  background; an admission at the limit that needed it is tried again as the item stands.
- **Settling** is one transaction: remove the lease, debit the cost, write the usage event.
  It is conditioned on the lease still being there, and carries a ClientRequestToken made
  from the generation id: a retry after a lost answer is recognised, by DynamoDB (the token)
  or by the conditions (no lease, an event already written: "already_settled"). A request
  whose lease was reclaimed meanwhile replaces its `abandoned` event and is debited only
  the difference, so every generation id ends with exactly one event and the org is
  charged exactly the event's cost.
- **A key's spend figure** (contract §10, kiln.store.keyspend) gets the cost of every request
  of the key admitted in its period, whichever limits the admitting gateway knew: one whose
  auth cache still held the key without its limit, or with another period, names no figure
  or another one in its lease. So the settle is also conditioned on the key's marker (the
  kind of period it counts in now) being what its lease assumed, or absent; when it is not
  (key management changed the key since), the settle reads the marker and adds the cost to
  the figure it says, under a token of its own. A reclaim and a late settle add to the
  figure the marker says in the org item they read, on the condition that it still says
  so (a reclaim that meets a change reads the org item again, and so does a late settle).
- **A key's tally** (kiln.store.tally): each of those transactions that writes a usage event
  also adds its cost (a replacement, the difference) to the key's tally of the event's
  month and day, so what a key spent is read without reading its events.

Every write goes through one retry policy (`kiln.store.retry`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import partial
from typing import Any, Awaitable, Callable, Coroutine, Iterator, TypeVar

from ..aws import AwsClient, tried_once
from ..errors import (
    GatewayError,
    InsufficientCredits,
    InvalidApiKey,
    KeySpendLimitExceeded,
    OrganizationDisabled,
    RateLimitExceeded,
)
from ..jsonio import decimal_text
from .clock import iso_ms, to_the_ms
from .codec import exact_sum, number, to_item, within_digits
from .errors import (
    ConditionFailed,
    NothingHeld,
    StorageError,
    TransactionCancelled,
    TransientStorageError,
    is_transient,
    may_have_been_applied,
    met_another_write,
    translate_storage_error,
)
from .keyspend import (
    KeyLimits,
    counted_in,
    kind_of_figure,
    leases_attribute,
    marker_attribute,
    marker_of,
    resets_at,
    spend_in,
    stale_spend_attributes,
)
from .retry import RetryPolicy, client_token
from .schema import LEASE, ORG, USAGE
from .tally import tally_updates
from .usage import UsageEvent

__all__ = ["Lease", "Ledger", "Progress", "new_generation_id", "with_ledger"]

T = TypeVar("T")

log = logging.getLogger("kiln.ledger")

# Conditions, named (see the module docstring for what each protects).
ORG_EXISTS = "attribute_exists(#org_id)"
ORG_ACTIVE = "#status = :active"
HAS_CREDITS = "#credits > :zero"
HAS_FREE_SLOT = "size(#leases) < #limit"
LEASE_HELD = "attribute_exists(#leases.#gen)"
# a settle's: held, and by its own key (a replayed line edited to another key is no settle of it)
LEASE_HELD_BY_ITS_KEY = f"{LEASE_HELD} AND #leases.#gen.#lease_key = :lease_key"
# an admission's own lease as it wrote it (a retry's), not one renewed since or written again later
OWN_LEASE_AS_ADMITTED = "attribute_exists(#leases.#gen) AND #leases.#gen.#exp <= :exp"
LEASE_NOT_HELD = "attribute_not_exists(#leases.#gen)"
ORG_CHECKS = (ORG_EXISTS, ORG_ACTIVE, HAS_CREDITS, HAS_FREE_SLOT)
# a key's own limits (contract §10), on its attributes of the org item (kiln.store.keyspend)
KEY_HAS_FREE_SLOT = "(attribute_not_exists(#key_leases) OR size(#key_leases) < :key_limit)"
KEY_HAS_BUDGET = "(attribute_not_exists(#key_spend) OR #key_spend < :key_budget)"
KEY_HAS_NO_BUDGET = "attribute_not_exists(#org_id)"  # a limit of 0: never true of an org that exists
# the key counts its spend as the settling lease assumed (or has no marker: kiln.store.keyspend)
MARKER_AS_ASSUMED = "(attribute_not_exists(#marker) OR #marker = :marker)"
EVENT_IS_NEW = "attribute_not_exists(#gen_id)"
EVENT_IS_ABANDONED = "#status = :abandoned"
EVENT_IS_THE_ABANDONED_ONE = "#status = :abandoned AND #cost = :billed AND #org_id = :org_id AND #key_id = :key_id"

# A reclaim is one transaction: at most this many leases at once (DynamoDB allows 100 items:
# the org's, and for each lease its event and at most one key's tally, kiln.store.tally).
MAX_RECLAIM = 49
# A late settle reads the abandoned event again when it changed between its read and its write
# (replaced by another settle: then it is done; tallied by `kiln admin keys tally`): this many times.
MAX_EVENT_READS = 3
# A reclaim that met the org item changed since its read reads it again, this many times.
MAX_RECLAIM_READS = 3
# Past periods' spend figures removed in one write, at most.
MAX_PRUNE = 100
# A settle that finds its key's marker changed reads it and tries again, this many times;
# then it settles adding to the figure last read, without that condition (the bill comes first).
MAX_FIGURE_READS = 3
# the pauses between a background settle's rounds (each one a whole retry budget): the first,
# then doubling up to the longest; and the most such settles a process keeps going at once
SETTLE_LATER_PAUSE = 1.0
SETTLE_LATER_MAX_PAUSE = 16.0
MAX_SETTLING_LATER = 256
MAX_TAKING_BACK = 256  # leases refused admissions may have written, taken back in rounds
MAX_RECLAIMING_LATER = 64  # reclaims storage refused for now, gone on with in rounds

ABANDONED_ERROR = "lease expired before the request settled (gateway crash or timeout)"

# (prompt tokens, completion tokens, cost so far): what a running request has relayed
Progress = tuple[int, int, Decimal]


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
    # what the request had relayed at its last renewal (None: never renewed)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: Decimal | None = None
    # the org item's attribute holding the key's spend against its limit, that this request's
    # cost is added to when it settles (None: the key has no spend limit; kiln.store.keyspend)
    spend_figure: str | None = None

    def to_attribute(self) -> dict[str, Any]:
        fields = {
            LEASE.exp: {"N": repr(round(self.expires, 3))},
            # to the millisecond, as the event's created_at is (admit makes it so)
            LEASE.started: {"N": repr(to_the_ms(self.started))},
            LEASE.key: {"S": self.key_id},
            LEASE.model: {"S": self.model},
            LEASE.endpoint: {"S": self.endpoint},
            LEASE.streamed: {"BOOL": self.streamed},
        }
        if self.spend_figure is not None:
            fields[LEASE.sf] = {"S": self.spend_figure}
        return {"M": fields}

    @classmethod
    def from_attribute(cls, gen_id: str, org_id: str, value: dict[str, Any]) -> "Lease":
        fields = value.get("M", {})

        def text(name: str) -> str:
            return fields.get(name, {}).get("S", "")

        def count(name: str) -> int | None:
            raw = fields.get(name, {}).get("N")
            return int(Decimal(raw)) if raw is not None else None

        cost = fields.get(LEASE.cost, {}).get("N")
        return cls(
            gen_id=gen_id,
            org_id=org_id,
            key_id=text(LEASE.key),
            model=text(LEASE.model),
            endpoint=text(LEASE.endpoint),
            streamed=bool(fields.get(LEASE.streamed, {}).get("BOOL", False)),
            started=float(fields.get(LEASE.started, {}).get("N", "0")),
            expires=_expiry(value),
            prompt_tokens=count(LEASE.pt),
            completion_tokens=count(LEASE.ct),
            cost=Decimal(cost) if cost is not None else None,
            spend_figure=fields.get(LEASE.sf, {}).get("S"),
        )

    def abandoned_event(self) -> UsageEvent:
        """The usage event of this lease reclaimed: billed for what its last renewal recorded."""
        renewed = self.cost is not None
        return UsageEvent(
            gen_id=self.gen_id,
            org_id=self.org_id,
            created_at=iso_ms(self.started),
            key_id=self.key_id,
            model=self.model,
            endpoint=self.endpoint,
            streamed=self.streamed,
            status="abandoned",
            cost=self.cost if renewed else Decimal(0),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            usage_source="estimated" if renewed else None,
            error=ABANDONED_ERROR,
        )


class Ledger:
    """Admission, renewal and settlement over DynamoDB, on the caller's event loop."""

    def __init__(
        self,
        aws: AwsClient,
        *,
        orgs_table: str,
        usage_table: str,
        lease_ttl: float,
        lease_renew: float | None = None,
        retry: RetryPolicy | None = None,
        retention_days: int = 0,
        clock: Callable[[], float] = time.time,
    ):
        self._aws = aws
        self._orgs_table = orgs_table
        self._usage_table = usage_table
        self._lease_ttl = lease_ttl
        self.renew_seconds = lease_renew if lease_renew is not None else lease_ttl / 3
        self._retry = retry or RetryPolicy()
        self._retention_seconds = retention_days * 86400
        self._clock = clock
        self._background: set[asyncio.Task] = set()
        self._settling_later: set[asyncio.Task] = set()  # settle_later's, stopped when the ledger closes
        self._taking_back: set[asyncio.Task] = set()  # _take_back_later's, stopped alike
        self._settle_later_turn = asyncio.Semaphore(1)
        self._reclaiming_later: set[asyncio.Task] = set()  # _reclaim_in_rounds's, stopped alike
        self._reclaiming: Counter[str] = Counter()  # generation ids reclaims of this process are working on
        self._in_rounds: Counter[str] = Counter()  # generation ids reclaims going on in rounds hold, between tries too
        self._closing = False  # drain() has begun: no write is gone on with later any more
        self._reclaim_ended: asyncio.Event | None = None  # set when a reclaim of this process ends
        self._pruning: set[str] = set()  # orgs whose past spend figures this process is removing
        self._looking: set[str] = set()  # refused orgs whose dead leases this process is looking for

    @property
    def lease_ttl(self) -> float:
        return self._lease_ttl

    def now(self) -> float:
        """The clock leases' expiries are written by (seconds since the epoch)."""
        return self._clock()

    # -- admission -------------------------------------------------------------------------

    async def admit(self, *, org_id: str, key_id: str, model: str, endpoint: str, streamed: bool,
                    limits: KeyLimits | None = None) -> Lease:
        """Take one of the org's slots, within the key's own limits, or raise 402 / 429 / 403
        (StorageError if DynamoDB fails)."""
        # the lease starts at the millisecond its event's created_at and the stored lease say:
        # a moment just before midnight rounded up by one of them, down by the other, would
        # count the request in two days (its key's figure, its tally)
        now = to_the_ms(self._clock())
        limits = limits or KeyLimits()
        lease = Lease(new_generation_id(now), org_id, key_id, model, endpoint, streamed, now, now + self._lease_ttl,
                      spend_figure=limits.figure(key_id, now))
        checks = list(ORG_CHECKS)
        names = {
            "#org_id": ORG.org_id,
            "#status": ORG.status,
            "#credits": ORG.credits,
            "#leases": ORG.leases,
            "#limit": ORG.concurrency_limit,
            "#gen": lease.gen_id,
            "#exp": LEASE.exp,
            "#key_leases": leases_attribute(key_id),
        }
        values: dict[str, Any] = {
            ":active": {"S": "active"},
            ":zero": {"N": "0"},
            **_as_written(lease),
            ":gen_ids": {"SS": [lease.gen_id]},
        }
        if limits.concurrency is not None:
            checks.append(KEY_HAS_FREE_SLOT)
            values[":key_limit"] = {"N": str(limits.concurrency)}
        if limits.spend_limit is not None and limits.spend_limit > 0:
            checks.append(KEY_HAS_BUDGET)
            names["#key_spend"] = lease.spend_figure
            values[":key_budget"] = {"N": number(limits.spend_limit)}
        elif limits.spend_limit is not None:
            checks.append(KEY_HAS_NO_BUDGET)
        payload = {
            "TableName": self._orgs_table,
            "Key": {ORG.hash_key: {"S": org_id}},
            # the key's set of generation ids in flight: ADD of a set, so a retry adds nothing twice
            "UpdateExpression": "SET #leases.#gen = :lease ADD #key_leases :gen_ids",
            # a copy of an earlier try landing late (held in the network) finds its lease renewed
            # or written again with a later expiry, and changes nothing
            "ConditionExpression": f"({OWN_LEASE_AS_ADMITTED}) OR ({LEASE_NOT_HELD} AND {' AND '.join(checks)})",
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
            "ReturnValues": "ALL_OLD",
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        applied_maybe = []  # a try whose answer was lost (or a 5xx) may have taken the slot
        own = lease.gen_id

        async def admission() -> Any:
            try:
                return await self._call("UpdateItem", payload)
            except StorageError as exc:
                if may_have_been_applied(exc):
                    applied_maybe.append(exc)
                raise

        for attempt in range(2):
            try:
                answer = await self._retry.run(admission, what="admission")
            except StorageError:
                # answered 503, it writes no event (§1): a lease one of its tries may have written
                # is taken back, not left to be reclaimed as an abandoned request
                if applied_maybe:
                    self._in_background(self._take_back(lease))
                raise
            except ConditionFailed as refused:
                old = refused.old_item
                refusal = self._refusal(old, key_id, limits, now)
                if attempt == 0 and isinstance(refusal, RateLimitExceeded) and await self._reclaim_now(org_id, old or {}):
                    # its expiry counted from now (the reclaim may have taken a while), never earlier
                    # than the first try's (a clock stepped back): that try, landing late, would
                    # leave its own lease newer than this one, which its condition then refuses
                    lease = replace(lease, expires=max(lease.expires, self._clock() + self._lease_ttl))
                    values.update(_as_written(lease))
                    continue
                if old and not isinstance(refusal, RateLimitExceeded):
                    # refused for the org's credits or status or the key's spend: the dead leases it
                    # shows are reclaimed all the same (their events written, their tokens billed),
                    # not left while the org stays refused
                    self._reclaim_seen(org_id, old, own)
                raise refusal from None
            old = (answer or {}).get("Attributes") or {}
            self._reclaim_seen(org_id, old, own)
            self._prune_later(org_id, stale_spend_attributes(old, now))
            return lease
        raise AssertionError("unreachable")

    def holds_dead_leases(self, org: dict[str, Any]) -> bool:
        """Whether an org item (as DynamoDB answers it, its leases at least) holds a lease past its
        expiry."""
        now = self._clock()
        return any(_expiry(value) <= now for value in org.get(ORG.leases, {}).get("M", {}).values())

    def reclaim_refused(self, org_id: str) -> None:
        """Reclaim, in a task of its own, the dead leases of an org whose requests are refused
        before any admission reads its item (a disabled org: authentication answers 403, its
        lookup having seen a dead lease). Its dead requests kept no event and their tokens
        stayed unbilled for as long as it stayed disabled. One look per org at a time, one read
        each; none once the process closes."""
        if self._closing or org_id in self._looking:
            return
        self._in_background(self._reclaim_refused(org_id))
        self._looking.add(org_id)

    async def _reclaim_refused(self, org_id: str) -> None:
        try:  # one read, no retries: the next lookup that finds the org refused looks again
            answer = await self._call("GetItem", self._whole_org(org_id))
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning(json.dumps({"event": "reclaim_failed", "org_id": org_id,
                                    "detail": f"{type(exc).__name__}: {exc}"}))
            return
        finally:
            self._looking.discard(org_id)
        org = (answer or {}).get("Item")
        if org:
            self._reclaim_seen(org_id, org, own="")

    def _whole_org(self, org_id: str) -> dict[str, Any]:
        """The GetItem of the org's whole item, read consistently (a reclaim's: its leases, markers
        and figures)."""
        return {"TableName": self._orgs_table, "Key": {ORG.hash_key: {"S": org_id}}, "ConsistentRead": True}

    def _reclaim_seen(self, org_id: str, old: dict[str, Any], own: str) -> None:
        """Reclaim off an admission's path the dead leases its answer showed (its own aside),
        but for those a reclaim of this process holds already."""
        self._reclaim_later(org_id, self._expired_leases(org_id, old, self._clock(),
                                                         lambda gen: gen != own and self._unheld(gen)), old)

    @staticmethod
    def _refusal(old: dict[str, Any] | None, key_id: str, limits: KeyLimits, now: float) -> GatewayError:
        """Why an admission was refused, from the org item as it was: the org's checks first,
        then the key's (contract §2 step 5, §10)."""
        if not old:
            return InvalidApiKey()
        if old.get(ORG.status, {}).get("S") != "active":
            return OrganizationDisabled("Your organization is disabled. Contact support.")
        if Decimal(old.get(ORG.credits, {}).get("N", "0")) <= 0:
            return InsufficientCredits("Your organization is out of credits. Add credits to continue.")
        stored_limit = old.get(ORG.concurrency_limit, {}).get("N", "?")
        limit = int(stored_limit) if stored_limit.isdigit() else None
        running = len(old.get(ORG.leases, {}).get("M", {}))
        org_full = RateLimitExceeded(_full_message("Your organization", running, stored_limit if limit is None else limit))
        if limit is None or running >= limit:
            return org_full
        if limits.spend_limit is not None:
            spent = spend_in(old, key_id, limits.spend_period, now)
            if limits.spend_limit <= 0 or spent >= limits.spend_limit:
                return KeySpendLimitExceeded(_spent_message(spent, limits, now))
        if limits.concurrency is None:
            return org_full
        key_running = len(old.get(leases_attribute(key_id), {}).get("SS", []))
        return RateLimitExceeded(_full_message("This key", key_running, limits.concurrency))

    async def _take_back(self, lease: Lease) -> None:
        """Remove a lease whose admission failed as far as its caller knows (a write that is
        not there removes nothing): at once, within the policy; where storage still refuses,
        in rounds as a late settle goes on (`_take_back_later`). A lease left would hold the
        org's slot until it expired, then be reclaimed as the `abandoned` event of a generation
        id no client saw, a request refused with 503 (§1: such a request writes no event)."""
        if not await self._taken_back(lease):
            self._go_on_later(self._take_back_later(lease), self._taking_back, MAX_TAKING_BACK,
                              "take_back_later", generation_id=lease.gen_id)

    async def _taken_back(self, lease: Lease, *, once: bool = False) -> bool:
        """One take-back within the policy (`once`: a single call): False where storage refused
        it for now."""
        payload = {
            "TableName": self._orgs_table,
            "Key": {ORG.hash_key: {"S": lease.org_id}},
            "UpdateExpression": "REMOVE #leases.#gen DELETE #key_leases :gen_ids",
            "ConditionExpression": LEASE_HELD,
            "ExpressionAttributeNames": {"#leases": ORG.leases, "#gen": lease.gen_id,
                                         "#key_leases": leases_attribute(lease.key_id)},
            "ExpressionAttributeValues": {":gen_ids": {"SS": [lease.gen_id]}},
        }
        try:
            if once:
                await self._call("UpdateItem", payload)
            else:
                await self._retried("take back", "UpdateItem", payload)
        except ConditionFailed:
            pass  # the admission was never applied, or its lease is gone already
        except Exception as exc:  # noqa: BLE001 - the lease expires and is reclaimed instead
            if is_transient(exc):
                return False
            log.warning(json.dumps({"event": "take_back_failed", "org_id": lease.org_id, "generation_id": lease.gen_id,
                                    "detail": type(exc).__name__}))
        return True

    async def _take_back_later(self, lease: Lease) -> None:
        """Rounds of the take-back, one call each, the pauses between them doubling as a late
        settle's do, for twice the lease time (a lease expired but not reclaimed yet is still
        worth taking back). They neither wait for the late settles' turn nor count against
        their bound: those carry bills, and a storm of refused admissions must not delay them."""
        # jittered: the take-backs of a storm of refusals do not come back all at once
        for pause in self._round_pauses(jitter=True):
            await asyncio.sleep(pause)
            if await self._taken_back(lease, once=True):
                log.info(json.dumps({"event": "taken_back_late", "generation_id": lease.gen_id}))
                return
        log.warning(json.dumps({"event": "take_back_failed", "org_id": lease.org_id, "generation_id": lease.gen_id,
                                "detail": "storage refused every round: the lease is reclaimed when it expires"}))

    # -- renewal ---------------------------------------------------------------------------

    async def renew(self, lease: Lease, progress: Progress | None = None) -> float | None:
        """Push the lease's expiry to now + TTL and record `progress`; the new expiry, or None
        when the lease is no longer held (settled, or reclaimed after it expired)."""
        expires = self._clock() + self._lease_ttl
        sets = ["#leases.#gen.#exp = :exp"]
        names = {"#leases": ORG.leases, "#gen": lease.gen_id, "#exp": LEASE.exp}
        values: dict[str, Any] = {":exp": {"N": repr(round(expires, 3))}}
        if progress is not None:
            prompt_tokens, completion_tokens, cost = progress
            for name, value in ((LEASE.pt, prompt_tokens), (LEASE.ct, completion_tokens), (LEASE.cost, within_digits(Decimal(cost)))):
                sets.append(f"#leases.#gen.#{name} = :{name}")
                names[f"#{name}"] = name
                values[f":{name}"] = {"N": number(value)}
        try:
            await self._retried(
                "renewal",
                "UpdateItem",
                {
                    "TableName": self._orgs_table,
                    "Key": {ORG.hash_key: {"S": lease.org_id}},
                    "UpdateExpression": "SET " + ", ".join(sets),
                    "ConditionExpression": LEASE_HELD,
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": values,
                },
            )
        except ConditionFailed:
            return None
        return expires

    # -- reclaiming ------------------------------------------------------------------------

    @staticmethod
    def _expired_leases(org_id: str, old: dict[str, Any], now: float,
                        wanted: Callable[[str], bool] = lambda gen_id: True) -> list[Lease]:
        """The leases of `old` (an org item) past their expiry at `now` whose generation ids are
        `wanted`, the oldest first, as many as one reclaim takes. Those not wanted are left out
        before the count: left out after it, the ones a reclaim already holds would take up the
        count, and the org's other dead leases, beyond it, go untried."""
        leases = old.get(ORG.leases, {}).get("M", {})
        # only the expired ones are read whole: an admission sees every lease of its org
        found = [Lease.from_attribute(gen, org_id, value) for gen, value in leases.items()
                 if _expiry(value) <= now and wanted(gen)]
        return sorted(found, key=lambda lease: lease.expires)[:MAX_RECLAIM]

    def _unheld(self, gen_id: str) -> bool:
        """Whether no reclaim of this process holds this lease (trying now, or in rounds)."""
        return gen_id not in self._reclaiming and gen_id not in self._in_rounds

    def _reclaim_later(self, org_id: str, leases: list[Lease], seen: dict[str, Any]) -> None:
        """Reclaim in a task of its own: the admission that noticed them does not wait. Its
        leases are held from now (not from the task's first step): another admission answered
        in the same turn of the loop leaves them to it."""
        if not leases:
            return
        gen_ids = [lease.gen_id for lease in leases]
        if self._closing:  # drain() has begun: the next admission that sees them reclaims them
            log.info(json.dumps({"event": "reclaim_later_stopped", "org_id": org_id, "gen_ids": gen_ids}))
            return
        task = self._in_background(self._reclaim_quietly(org_id, leases, seen))
        _hold(self._reclaiming, gen_ids)

        def ended(_: asyncio.Task) -> None:
            _release(self._reclaiming, gen_ids)
            self._tell_reclaim_ended()

        task.add_done_callback(ended)

    def _prune_later(self, org_id: str, stale: list[str]) -> None:
        """Remove spend figures of periods that are over, in a task of its own."""
        if not stale or org_id in self._pruning or self._closing:  # the next admission prunes them
            return
        self._pruning.add(org_id)
        self._in_background(self._prune(org_id, stale[:MAX_PRUNE]))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `work` in a task of its own, held until done (drain() waits for it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _prune(self, org_id: str, stale: list[str]) -> None:
        names = {f"#p{index}": name for index, name in enumerate(stale)}
        names["#org_id"] = ORG.org_id
        try:
            await self._retried(
                "prune",
                "UpdateItem",
                {
                    "TableName": self._orgs_table,
                    "Key": {ORG.hash_key: {"S": org_id}},
                    "UpdateExpression": "REMOVE " + ", ".join(f"#p{index}" for index in range(len(stale))),
                    "ConditionExpression": ORG_EXISTS,
                    "ExpressionAttributeNames": names,
                },
            )
        except Exception as exc:  # noqa: BLE001 - bookkeeping; the next admission tries again
            log.warning(json.dumps({"event": "prune_failed", "org_id": org_id, "detail": type(exc).__name__}))
        finally:
            self._pruning.discard(org_id)

    async def _reclaim_now(self, org_id: str, seen: dict[str, Any]) -> bool:
        """The reclaim of an admission refused at its org's limit, of the dead leases `seen` (the
        org item as refused) holds; whether it is worth trying the admission again.

        Dead leases another request of this process is reclaiming now are waited for, not sent
        again (the same transaction, or one over the same items, each conflicting with the
        others). The others are reclaimed within the retry budget; refused for now, they go on
        in rounds. Refused by the org item's conflicts (its own requests' writes, §2 step 5),
        that does not fail the admission, tried again as the item stands (429 while the dead
        leases hold the slots); by throttling, an outage or for good, it does (503). Where
        rounds hold every dead lease, pausing between their tries, one try is made here, a
        single call: storage answering again, the org is not refused until their next round."""
        now = self._clock()
        # under a try of this process now (a request's, a round's): waited for
        theirs = [lease.gen_id for lease in self._expired_leases(org_id, seen, now, self._reclaiming.__contains__)]
        mine = self._expired_leases(org_id, seen, now, self._unheld)
        if mine:
            try:
                await self._reclaim(org_id, mine, seen)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._reclaim_in_rounds(org_id, mine, seen)
                if not met_another_write(exc):
                    raise _storage_error(exc) from exc
        elif not theirs:
            pausing = self._expired_leases(org_id, seen, now, self._in_rounds.__contains__)
            if not pausing:
                return False
            try:
                await self._reclaim(org_id, pausing, seen, once=True)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                return False  # still refused: the rounds go on
        await self._until_reclaimed(theirs)
        return True

    async def _until_reclaimed(self, gen_ids: list[str]) -> None:
        """Wait until no reclaim of this process works on `gen_ids` any more (each ends within its
        retry budgets, one for each read of the org item again: landed, raced, or gone on in
        rounds)."""
        while any(gen_id in self._reclaiming for gen_id in gen_ids):
            if self._reclaim_ended is None:
                self._reclaim_ended = asyncio.Event()
            await self._reclaim_ended.wait()

    def _tell_reclaim_ended(self) -> None:
        ended, self._reclaim_ended = self._reclaim_ended, None
        if ended is not None:
            ended.set()

    async def _reclaim_quietly(self, org_id: str, leases: list[Lease], seen: dict[str, Any]) -> None:
        try:
            await self._reclaim(org_id, leases, seen)
        except Exception as exc:  # noqa: BLE001 - the next admission tries again
            if is_transient(exc):
                self._reclaim_in_rounds(org_id, leases, seen)
                return
            log.warning(json.dumps({"event": "reclaim_failed", "org_id": org_id, "detail": f"{type(exc).__name__}: {exc}"}))

    def _reclaim_in_rounds(self, org_id: str, leases: list[Lease], seen: dict[str, Any]) -> None:
        """Go on with a reclaim storage refused past its retry budget. Dropped, its dead leases
        stayed, their `abandoned` events unwritten and their tokens unbilled, until an
        admission came that saw them, which an org that stopped sending never makes."""
        leases = [lease for lease in leases if lease.gen_id not in self._in_rounds]
        if not leases:  # another reclaim of them, refused at the same moment, went on first
            return
        gen_ids = [lease.gen_id for lease in leases]
        task = self._go_on_later(self._reclaim_later_rounds(org_id, leases, seen), self._reclaiming_later,
                                 MAX_RECLAIMING_LATER, "reclaim_later", org_id=org_id, gen_ids=gen_ids)
        if task is not None:  # its leases are its own from now on, until it ends
            _hold(self._in_rounds, gen_ids)
            task.add_done_callback(lambda _: _release(self._in_rounds, gen_ids))
            log.info(json.dumps({"event": "reclaim_goes_on_later", "org_id": org_id, "gen_ids": gen_ids}))

    async def _reclaim_later_rounds(self, org_id: str, leases: list[Lease], seen: dict[str, Any]) -> None:
        """Rounds of the reclaim, each a whole retry budget, the pauses between them jittered and
        doubling as a late settle's, for twice the lease time; its leases are this process's
        meanwhile (an admission that sees them expired leaves them to it). A round that finds
        the org item changed since (leases renewed, settled or reclaimed elsewhere, a key's
        spend changed) reads it again and reclaims those still dead, as any reclaim does."""
        for pause in self._round_pauses(jitter=True):
            await asyncio.sleep(pause)
            try:
                await self._reclaim(org_id, leases, seen)
            except Exception as exc:  # noqa: BLE001 - a background task must not raise
                if is_transient(exc):
                    continue
                log.warning(json.dumps({"event": "reclaim_failed", "org_id": org_id,
                                        "detail": f"{type(exc).__name__}: {exc}"}))
            return
        log.warning(json.dumps({"event": "reclaim_failed", "org_id": org_id,
                                "gen_ids": [lease.gen_id for lease in leases],
                                "detail": "storage refused every round: the next admission reclaims them"}))

    async def _reclaim(self, org_id: str, leases: list[Lease], seen: dict[str, Any],
                       settled: frozenset[str] = frozenset(), reads: int = MAX_RECLAIM_READS, *,
                       once: bool = False) -> None:
        """Free expired leases; each gets an `abandoned` usage event billed as of its last renewal,
        added to its key's figures as `seen` (the org item the leases were read from) has them.
        A lease whose generation has its event already (`settled`: a late copy of its admission
        landed after its request settled, §2 step 5) is freed billed nothing more: its event
        stands. Its event written again cancelled the whole reclaim, every dead lease of the org
        held with it, for good. Where the org item changed since `seen` (some of the leases
        renewed, settled or reclaimed elsewhere, a key's spend changed), it is read again and
        those of the leases still dead are reclaimed (`reads` times at most). `once`: its
        transaction sent once, not tried again within the retry budget."""
        names = {"#leases": ORG.leases, "#exp": LEASE.exp, "#credits": ORG.credits}
        values: dict[str, Any] = {}
        removes, unchanged = [], []
        billable = [lease for lease in leases if lease.gen_id not in settled]
        events = [self._kept(lease.abandoned_event()) for lease in billable]
        for index, lease in enumerate(leases):
            names[f"#g{index}"] = lease.gen_id
            values[f":e{index}"] = {"N": repr(round(lease.expires, 3))}
            removes.append(f"#leases.#g{index}")
            unchanged.append(f"#leases.#g{index}.#exp = :e{index}")
        update = "REMOVE " + ", ".join(removes)
        billed = exact_sum(*(event.cost for event in events))
        if billed:
            update = f"SET #credits = #credits - :billed {update}"
            values[":billed"] = {"N": number(billed)}
        else:
            del names["#credits"]
        charges = [(lease, event.cost, _counted_in(lease, seen)) for lease, event in zip(billable, events, strict=True)]
        charges += [(lease, Decimal(0), ()) for lease in leases if lease.gen_id in settled]
        update += _key_bookkeeping(charges, names, values)
        # the figures are those the markers in `seen` say: a change of a key's spend since
        # (its marker set, changed or removed) makes this reclaim one that raced
        unchanged += _markers_as_read(sorted({lease.key_id for lease in leases}), seen, names, values)
        items = [self._org_update(org_id, update, " AND ".join(unchanged), names, values)]
        items += [self._put_event(event, EVENT_IS_NEW) for event in events]
        items += tally_updates(self._usage_table, [(lease.key_id, lease.started, event.cost)
                                                   for lease, event in zip(billable, events, strict=True)])
        gen_ids = [lease.gen_id for lease in leases]
        payload = {"TransactItems": items, "ClientRequestToken": client_token("r", json.dumps(items, sort_keys=True))}
        _hold(self._reclaiming, gen_ids)
        try:
            await (self._call if once else partial(self._retried, "reclaim"))("TransactWriteItems", payload)
            log.warning(json.dumps({"event": "leases_reclaimed", "org_id": org_id, "gen_ids": gen_ids,
                                    "billed": number(billed), "already_settled": sorted(settled)}))
        except TransactionCancelled as cancelled:
            if once:  # one call, whatever it met: the rounds go on with what is left
                if cancelled.transient:
                    raise
                log.info(json.dumps({"event": "reclaim_raced", "org_id": org_id, "reasons": cancelled.reasons}))
                return
            # events that exist, while the leases are as read (the org item's condition held): their
            # requests settled, and their leases came back. Where the leases are gone too, another
            # reclaim wrote those events: a race lost, nothing to try again
            found = {lease.gen_id for index, lease in enumerate(billable) if cancelled.failed_condition(1 + index)}
            if found and not cancelled.failed_condition(0):
                await self._reclaim(org_id, leases, seen, settled | found, reads)
                return
            if cancelled.transient:  # the retry budget spent on conflicts or throttling: not done
                raise
            if cancelled.failed_condition(0) and reads > 0:
                await self._reclaim_still_dead(org_id, gen_ids, reads - 1)
                return
            # Another admission reclaimed them first, one was renewed or settled just now: nothing to do.
            log.info(json.dumps({"event": "reclaim_raced", "org_id": org_id, "reasons": cancelled.reasons}))
        finally:
            _release(self._reclaiming, gen_ids)
            self._tell_reclaim_ended()

    async def _reclaim_still_dead(self, org_id: str, gen_ids: list[str], reads: int) -> None:
        """A reclaim met the org item changed since its read: some of its leases may be gone or
        alive, the rest still dead, and nothing else may come for them (another environment
        reclaimed part of them, an org that stopped sending). Read it again; reclaim those."""
        answer = await self._retried("reclaim", "GetItem", self._whole_org(org_id))
        org = (answer or {}).get("Item") or {}
        wanted = set(gen_ids)
        left = self._expired_leases(org_id, org, self._clock(), wanted.__contains__)
        if left:
            await self._reclaim(org_id, left, org, reads=reads)
        else:  # another admission reclaimed them first, or they were renewed or settled just now
            log.info(json.dumps({"event": "reclaim_raced", "org_id": org_id, "gen_ids": gen_ids}))

    def settle_later(self, lease: Lease, event: UsageEvent) -> None:
        """Go on settling in the background a request whose settle spent its retry budget on
        refusals that say nothing of it (conflicts, throttling, storage down), round after
        round, for as long as a reclaim could take its lease and a while after (a late settle
        then replaces the `abandoned` event and bills the rest). Without it the lease stayed
        held until it expired, and the request was billed what its last renewal recorded:
        nothing, for one shorter than the renewal interval. The caller has logged the event
        already (`usage_unsettled`): a replay of that line after this settled is told
        `already_settled`."""
        self._go_on_later(self._settle_later(lease, event), self._settling_later, MAX_SETTLING_LATER,
                          "settle_later", generation_id=lease.gen_id)

    def _go_on_later(self, work: Coroutine[Any, Any, None], tasks: set[asyncio.Task], bound: int, what: str,
                     **about: Any) -> asyncio.Task | None:
        """Run `work` (rounds of a write, `what`) in a task of `tasks`, which drain() stops, at
        most `bound` at once, and none once drain() has begun: the log keeps the rest (a
        settle's line is for the replay; a lease not taken back or not reclaimed is reclaimed
        by a later admission), and says which (`<what>_full`, `<what>_stopped`: the process
        closing) and what the write was `about`. The task, or None."""
        if self._closing or len(tasks) >= bound:
            work.close()
            if self._closing:
                log.info(json.dumps({"event": f"{what}_stopped", **about}))
            else:
                log.error(json.dumps({"event": f"{what}_full", **about}))
            return None
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def _settle_later(self, lease: Lease, event: UsageEvent) -> None:
        """Rounds of the settle, each a whole retry budget, one such settle of this process at
        a time (a storage storm is not met with a storm of retries), the pauses between them
        doubling up to SETTLE_LATER_MAX_PAUSE."""
        for pause in self._round_pauses():
            await asyncio.sleep(pause)
            try:
                async with self._settle_later_turn:
                    outcome = await self.settle(lease, event)
            except Exception as exc:  # noqa: BLE001 - a background task must not raise
                if is_transient(exc):
                    continue
                log.error(json.dumps({"event": "settle_later_failed", "generation_id": lease.gen_id,
                                      "detail": f"{type(exc).__name__}: {exc}"}))
                return
            log.warning(json.dumps({"event": "usage_settled_late", "generation_id": lease.gen_id, "outcome": outcome}))
            return
        log.error(json.dumps({"event": "settle_later_gave_up", "generation_id": lease.gen_id}))

    def _round_pauses(self, *, jitter: bool = False) -> Iterator[float]:
        """The waits before each round of a write gone on later: from SETTLE_LATER_PAUSE,
        doubling up to SETTLE_LATER_MAX_PAUSE (`jitter`: each a random half to whole of it),
        for twice the lease time."""
        until = time.monotonic() + 2 * self._lease_ttl
        pause = SETTLE_LATER_PAUSE
        while (left := until - time.monotonic()) > 0:
            yield min(pause * (0.5 + random.random() / 2) if jitter else pause, left)
            pause = min(2 * pause, SETTLE_LATER_MAX_PAUSE)

    async def drain(self) -> None:
        """Wait for the background reclaims started so far (before a loop or client closes);
        the settles going on in the background stop (their events are in the log)."""
        # a reclaim or first take-back that fails while this waits may start rounds of its own:
        # those are stopped too, until nothing is left
        self._closing = True
        while self._settling_later or self._taking_back or self._reclaiming_later or self._background:
            later = (*self._settling_later, *self._taking_back, *self._reclaiming_later)
            for task in later:
                task.cancel()
            await asyncio.gather(*later, *self._background, return_exceptions=True)

    # -- settlement ------------------------------------------------------------------------

    async def settle(self, lease: Lease, event: UsageEvent, *, request_token: bool | str = True) -> str:
        """Release the lease, debit `event.cost`, write the event; retried within the policy.

        Returns "settled", "replaced_abandoned" or "already_settled". Raises StorageError
        only after the retry budget is spent (or UnstorableValue, never sent; or NothingHeld,
        where neither the lease nor an event of the generation is there); the caller must
        then keep the event (log it). `request_token` (a ClientRequestToken made from
        the generation id) is for the gateway's own settle; a replay of an event logged
        earlier gives a text of its own run to make it with (or False: none), so that its own
        retry after a lost answer is told it succeeded, and the gateway's earlier success, or
        another run's, is told "already_settled" rather than repeated silently by DynamoDB.
        """
        event = self._kept(event)
        figures: tuple[str, ...] = (lease.spend_figure,) if lease.spend_figure is not None else ()
        marker = kind_of_figure(lease.spend_figure)  # what the lease assumes (None: no marker)
        for attempt in range(MAX_FIGURE_READS + 1):
            payload = self._settle_payload(lease, event, figures, marker, attempt=attempt, request_token=request_token)
            try:
                await self._retried("settle", "TransactWriteItems", payload)
                return "settled"
            except TransactionCancelled as cancelled:
                if not cancelled.failed_condition(0):
                    raise _settle_failed(cancelled) from None
            except StorageError as exc:
                if exc.code != "IdempotentParameterMismatchException":
                    raise
                # the token was spent on an earlier settle of this generation with another event
                return await self._settle_late(lease, event, request_token=request_token)
            # the lease is gone, or the key's marker is not what the lease assumed: read which
            item = await self._read_org(lease)
            held = item.get(ORG.leases, {}).get("M", {}).get(lease.gen_id)
            if held is None:
                return await self._settle_late(lease, event, item, request_token=request_token)
            if held.get("M", {}).get(LEASE.key, {}).get("S") != lease.key_id:
                # another key's request (a line of `kiln admin replay-usage` edited by hand): its
                # slot, its key's set and spend are not this event's to change
                raise NothingHeld(f"the lease held for it is another key's, not {str(lease.key_id)[:80]!r}'s")
            figures, marker = _counted_in(lease, item), marker_of(item, lease.key_id)
        raise AssertionError("unreachable: the last attempt is not conditioned on the marker")

    def _settle_payload(self, lease: Lease, event: UsageEvent, figures: tuple[str, ...], marker: str | None, *,
                        attempt: int, request_token: bool | str) -> dict[str, Any]:
        """The settle's transaction, adding the cost to `figures`, conditioned on the lease being
        held and (but on the last attempt) on the key's marker: on the first, what the lease
        assumes or none; after reading it, what was read (None: no marker)."""
        names = {"#credits": ORG.credits, "#leases": ORG.leases, "#gen": lease.gen_id, "#lease_key": LEASE.key}
        values: dict[str, Any] = {":cost": {"N": number(event.cost)}, ":lease_key": {"S": lease.key_id}}
        update = "SET #credits = #credits - :cost REMOVE #leases.#gen" + _key_bookkeeping(
            [(lease, event.cost, figures)], names, values)
        condition = LEASE_HELD_BY_ITS_KEY
        if attempt < MAX_FIGURE_READS:
            names["#marker"] = marker_attribute(lease.key_id)
            if marker is None:
                condition += " AND attribute_not_exists(#marker)"
            else:
                values[":marker"] = {"S": marker}
                guard = "#marker = :marker" if attempt else MARKER_AS_ASSUMED
                condition += f" AND {guard}"
        release = self._org_update(lease.org_id, update, condition, names, values)
        payload: dict[str, Any] = {"TransactItems": [
            release, self._put_event(event, EVENT_IS_NEW),
            *tally_updates(self._usage_table, [(lease.key_id, lease.started, event.cost)])]}
        if request_token:
            # each attempt after reading the marker is another transaction: its own token (a
            # retry of one after a lost answer, within the retry policy, keeps it)
            text = lease.gen_id if attempt == 0 else "|".join((lease.gen_id, str(attempt), str(marker), *figures))
            if isinstance(request_token, str):  # a replay's run
                text = f"{request_token}|{text}"
            payload["ClientRequestToken"] = client_token("s", text)
        return payload

    async def _read_org(self, lease: Lease) -> dict[str, Any]:
        """The lease and its key's marker, as the org item has them now."""
        answer = await self._retried("settle", "GetItem", {
            "TableName": self._orgs_table,
            "Key": {ORG.hash_key: {"S": lease.org_id}},
            "ProjectionExpression": "#leases.#gen, #marker",
            "ExpressionAttributeNames": {"#leases": ORG.leases, "#gen": lease.gen_id,
                                         "#marker": marker_attribute(lease.key_id)},
            "ConsistentRead": True,
        })
        return (answer or {}).get("Item") or {}

    async def _settle_late(self, lease: Lease, event: UsageEvent, org: dict[str, Any] | None = None, *,
                           request_token: bool | str = True) -> str:
        """The lease is gone: this settle already happened, or the lease expired and was
        reclaimed as `abandoned` (already billed for its last renewal). Replace that event,
        debiting only the difference, added to the key's figures as `org` (the org item read
        after the lease was found gone) has them, on the condition that the key's marker is
        still what it says: a change of the key's spend between the read and the write reads
        it again (MAX_FIGURE_READS times; then the bill goes first, as in `settle`). Each
        attempt's token is made from its items: its retry after a lost answer is told it
        succeeded, not that the event was replaced already."""
        for _ in range(MAX_EVENT_READS):
            found = await self._read_event(event.gen_id)
            if found is None:  # never held here, or settled and its event expired since
                raise NothingHeld(f"neither a lease nor a usage event of it is in org {str(event.org_id)[:80]!r}: "
                                  "an unknown org or generation, or an event past the usage retention")
            if not _same_request(found, event):
                # another org's or key's request (a line of `kiln admin replay-usage` edited by
                # hand): its event is not this one's to replace, nor its org this one's to debit
                raise NothingHeld(f"its usage event is another org's or key's request, not one of org "
                                  f"{str(event.org_id)[:80]!r}")
            if found.get(USAGE.status, {}).get("S") != "abandoned":
                return "already_settled"
            outcome = await self._replace_abandoned(lease, event, found, org, request_token=request_token)
            if outcome is not None:
                return outcome
        raise StorageError("settle cancelled: the abandoned event kept changing")

    async def _replace_abandoned(self, lease: Lease, event: UsageEvent, found: dict[str, Any],
                                 org: dict[str, Any] | None, *, request_token: bool | str) -> str | None:
        """`_settle_late`'s write, replacing the abandoned event `found` as read: None when it
        changed since (`kiln admin keys tally` added an event of an older version to its
        key's tally: the difference is then all the tally needs)."""
        billed = Decimal(found.get(USAGE.cost, {}).get("N", "0"))
        difference = exact_sum(event.cost, -billed)
        was_tallied = found.get(USAGE.tallied, {}).get("BOOL") is True
        put = self._put_event(event, EVENT_IS_THE_ABANDONED_ONE, billed=billed, was_tallied=was_tallied)
        # an abandoned event of an older version is in no tally: the tally gets the whole cost
        tally = tally_updates(self._usage_table, [(lease.key_id, lease.started,
                                                   difference if was_tallied else event.cost)])
        for attempt in range(MAX_FIGURE_READS + 1):
            if org is None:
                org = await self._read_org(lease)
            names = {"#credits": ORG.credits, "#org_id": ORG.org_id}
            values: dict[str, Any] = {":difference": {"N": number(difference)}}
            # the reclaim already took the lease out of the key's set: only the spend changes
            update = "SET #credits = #credits - :difference" + _key_bookkeeping(
                [(lease, difference, _counted_in(lease, org))], names, values, release=False)
            condition = ORG_EXISTS
            if attempt < MAX_FIGURE_READS:
                condition = " AND ".join([condition, *_markers_as_read([lease.key_id], org, names, values)])
            debit = self._org_update(lease.org_id, update, condition, names, values)
            payload: dict[str, Any] = {"TransactItems": [debit, put, *tally]}
            if request_token:
                payload["ClientRequestToken"] = client_token("l", json.dumps(payload["TransactItems"], sort_keys=True))
            try:
                await self._retried("settle", "TransactWriteItems", payload)
                return "replaced_abandoned"
            except TransactionCancelled as cancelled:
                if cancelled.failed_condition(1):
                    return None  # replaced by another settle of the same generation, or tallied: read it again
                if not cancelled.failed_condition(0):
                    raise _settle_failed(cancelled) from None
            org = None  # the key's marker changed (or the org is gone): read it again
        raise StorageError("settle cancelled: the org item is gone")

    def _org_update(self, org_id: str, update: str, condition: str, names: dict[str, str],
                    values: dict[str, Any]) -> dict[str, Any]:
        """A transaction's item that updates the org item."""
        return {"Update": {
            "TableName": self._orgs_table,
            "Key": {ORG.hash_key: {"S": org_id}},
            "UpdateExpression": update,
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }}

    async def _read_event(self, gen_id: str) -> dict[str, Any] | None:
        answer = await self._retried(
            "settle",
            "GetItem",
            {"TableName": self._usage_table, "Key": {USAGE.hash_key: {"S": gen_id}}, "ConsistentRead": True},
        )
        return (answer or {}).get("Item")

    def _kept(self, event: UsageEvent) -> UsageEvent:
        """The event as it will be stored: its expiry (retention) fixed, its cost within 38 digits."""
        if self._retention_seconds and event.expires_at is None:
            event = replace(event, expires_at=int(self._clock() + self._retention_seconds))
        rounded = within_digits(event.cost)
        if rounded != event.cost:
            log.warning(json.dumps({"event": "cost_rounded", "gen_id": event.gen_id, "digits": 38}))
            event = replace(event, cost=rounded)
        return event

    def _put_event(self, event: UsageEvent, condition: str, *, billed: Decimal | None = None,
                   was_tallied: bool = True) -> dict[str, Any]:
        """The event's Put, marked `tallied` (its transaction adds its cost to its key's tally);
        replacing the abandoned event, conditioned on its cost and its mark as read."""
        put: dict[str, Any] = {
            "TableName": self._usage_table,
            "Item": {**to_item(event), USAGE.tallied: {"BOOL": True}},
            "ConditionExpression": condition,
        }
        if condition == EVENT_IS_NEW:
            put["ExpressionAttributeNames"] = {"#gen_id": USAGE.gen_id}
        elif condition == EVENT_IS_THE_ABANDONED_ONE:
            mark = "attribute_exists(#tallied)" if was_tallied else "attribute_not_exists(#tallied)"
            put["ConditionExpression"] = f"{condition} AND {mark}"
            put["ExpressionAttributeNames"] = {"#status": USAGE.status, "#cost": USAGE.cost, "#tallied": USAGE.tallied,
                                               "#org_id": USAGE.org_id, "#key_id": USAGE.key_id}
            put["ExpressionAttributeValues"] = {":abandoned": {"S": "abandoned"}, ":billed": {"N": number(billed or 0)},
                                                ":org_id": {"S": event.org_id}, ":key_id": {"S": event.key_id}}
        else:
            put["ExpressionAttributeNames"] = {"#status": USAGE.status}
            put["ExpressionAttributeValues"] = {":abandoned": {"S": "abandoned"}}
        return {"Put": put}

    async def _retried(self, what: str, operation: str, payload: dict[str, Any]) -> Any:
        return await self._retry.run(lambda: self._call(operation, payload), what=what)

    async def _call(self, operation: str, payload: dict[str, Any]) -> Any:
        try:
            return await self._aws.dynamodb(operation, payload)
        except Exception as exc:  # noqa: BLE001 - translated into the storage error tree
            raise translate_storage_error(exc) from exc


def _as_written(lease: Lease) -> dict[str, Any]:
    """An admission's values for its lease: the lease as written, and its expiry as compared."""
    written = lease.to_attribute()  # built once: the lease's wire form is not cheap
    return {":lease": written, ":exp": written["M"][LEASE.exp]}


def _hold(held: Counter[str], gen_ids: list[str]) -> None:
    held.update(gen_ids)


def _release(held: Counter[str], gen_ids: list[str]) -> None:
    """Count `gen_ids` out of `held`, dropping those no one holds any more."""
    held.subtract(gen_ids)
    for gen_id in gen_ids:
        if held[gen_id] <= 0:
            del held[gen_id]


def _storage_error(exc: BaseException) -> BaseException:
    """A reclaim's failure past its retry budget as the storage error it is (a cancellation too)."""
    return _settle_failed(exc, "reclaim") if isinstance(exc, TransactionCancelled) else exc


def _settle_failed(cancelled: TransactionCancelled, what: str = "settle") -> StorageError:
    """A settle's (or `what`'s) cancellation past its retry budget: transient when conflicts or
    throttling spent it (refusals that say nothing of the write: it may go on in the background)."""
    error = TransientStorageError if cancelled.transient else StorageError
    return error(f"{what} cancelled: {cancelled.reasons}")


def _expiry(lease: dict[str, Any]) -> float:
    """A stored lease's expiry, read from its wire form."""
    return float(lease.get("M", {}).get(LEASE.exp, {}).get("N", "0"))


def _same_request(found: dict[str, Any], event: UsageEvent) -> bool:
    """Whether a stored usage event (its item) is of the same org and key as `event`."""
    return (found.get(USAGE.org_id, {}).get("S") == event.org_id
            and found.get(USAGE.key_id, {}).get("S") == event.key_id)


def _counted_in(lease: Lease, org: dict[str, Any]) -> tuple[str, ...]:
    return counted_in(org, lease.key_id, lease.started, lease.spend_figure)


def _markers_as_read(key_ids: list[str], org: dict[str, Any], names: dict[str, str],
                     values: dict[str, Any]) -> list[str]:
    """The conditions that each key's marker is what `org` (an org item as read) has: the
    figures worked out from it are still the ones its key counts in."""
    conditions = []
    for index, key_id in enumerate(key_ids):
        names[f"#mk{index}"] = marker_attribute(key_id)
        marker = marker_of(org, key_id)
        if marker is None:
            conditions.append(f"attribute_not_exists(#mk{index})")
        else:
            values[f":mk{index}"] = {"S": marker}
            conditions.append(f"#mk{index} = :mk{index}")
    return conditions


def _key_bookkeeping(charges: list[tuple[Lease, Decimal, tuple[str, ...]]], names: dict[str, str],
                     values: dict[str, Any], *, release: bool = True) -> str:
    """The ADD and DELETE clauses that keep each key's figures on the org item: its leases out
    of its set of requests in flight (`release`), and each cost added to the spend figures
    given with it (a key with a spend limit). Several leases of one key are summed: one update
    expression may name an attribute only once."""
    spend: dict[str, Decimal] = {}
    released: dict[str, list[str]] = {}
    for lease, cost, figures in charges:
        released.setdefault(lease.key_id, []).append(lease.gen_id)
        for figure in figures:
            spend[figure] = exact_sum(spend[figure], cost) if figure in spend else cost
    adds, deletes = [], []
    for index, (attribute, amount) in enumerate(spend.items()):
        names[f"#ks{index}"] = attribute
        values[f":ks{index}"] = {"N": number(within_digits(amount))}
        adds.append(f"#ks{index} :ks{index}")
    if release:
        for index, (key_id, gen_ids) in enumerate(released.items()):
            names[f"#kl{index}"] = leases_attribute(key_id)
            values[f":kl{index}"] = {"SS": gen_ids}
            deletes.append(f"#kl{index} :kl{index}")
    return (" ADD " + ", ".join(adds) if adds else "") + (" DELETE " + ", ".join(deletes) if deletes else "")


def _full_message(who: str, running: int, limit: int | str) -> str:
    """A 429's message: how many requests the org or key had in flight when it was refused, and
    its limit (an operator may have lowered it below what runs)."""
    where = "over" if isinstance(limit, int) and running > limit else "at"
    requests = "request" if running == 1 else "requests"
    return (f"{who} already has {running} {requests} in flight, {where} its limit of {limit}. "
            "Retry with exponential backoff.")


def _spent_message(spent: Decimal, limits: KeyLimits, now: float) -> str:
    limit = f"${decimal_text(limits.spend_limit)}" if limits.spend_limit else "$0"
    resets = resets_at(limits.spend_period, now)
    if resets is None:
        when = "This limit does not reset: ask your organization to raise it."
    else:
        when = f"The limit resets at {resets.strftime('%Y-%m-%dT%H:%M:%SZ')}."
    period = "in total" if limits.spend_period == "total" else f"this {limits.spend_period}"
    return f"This key has spent ${decimal_text(spent)} {period}, its limit of {limit}. {when}"


def ledger_of(aws: AwsClient, settings: Any, *, clock: Callable[[], float] = time.time) -> Ledger:
    """The ledger these settings describe (its calls tried once each: its policy retries them)."""
    return Ledger(
        tried_once(aws),
        orgs_table=settings.orgs_table,
        usage_table=settings.usage_table,
        lease_ttl=settings.lease_ttl_seconds,
        lease_renew=settings.lease_renew_seconds,
        retry=RetryPolicy(attempts=settings.storage_retry_attempts, budget_seconds=settings.storage_retry_seconds),
        retention_days=settings.usage_retention_days,
        clock=clock,
    )


def with_ledger(settings: Any, use: Callable[[Ledger], Awaitable[T]], *, http: Any = None) -> T:
    """For synchronous callers (operators' tools, tests): run `use(ledger)` on a fresh loop and client."""

    async def main() -> T:
        aws = AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url, http=http)
        ledger = ledger_of(aws, settings)
        try:
            return await use(ledger)
        finally:
            await ledger.drain()
            await aws.aclose()
            if http is not None:
                await http.aclose()

    return asyncio.run(main())
