"""Organisations: status, concurrency limit and prepaid credits (Decimal USD)."""

from __future__ import annotations

import random
import re
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Callable, TypeVar

from pynamodb.exceptions import DoesNotExist, PutError, TransactWriteError, UpdateError
from pynamodb.transactions import TransactWrite

from ..jsonio import decimal_places
from ..settings import MAX_ORG_CONCURRENCY
from .clock import iso_ms, now
from .errors import (
    RecordExists,
    RecordNotFound,
    StorageError,
    TransactionCancelled,
    TransientStorageError,
    condition_failure,
    may_have_been_applied,
    translate_storage_error,
)
from .records import Tables
from .schema import LEASE

__all__ = ["OrgInfo", "add_credits", "create_org", "get_org", "list_orgs", "set_limit", "set_status", "valid_org_id"]

T = TypeVar("T")
_ORG_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def valid_org_id(org_id: str) -> bool:
    return _ORG_ID.fullmatch(org_id) is not None


@dataclass(frozen=True)
class OrgInfo:
    org_id: str
    status: str
    concurrency_limit: int
    credits: Decimal
    created_at: str
    leases: dict = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        """Requests in flight: leases not past their expiry (a dead gateway's lease stops
        counting when it expires, before the next admission reclaims it)."""
        moment = now()
        return sum(1 for lease in self.leases.values() if _expiry(lease) > moment)

    @property
    def expired_leases(self) -> int:
        """Leases past their expiry, still on the item until an admission reclaims them."""
        return len(self.leases) - self.in_flight


def _expiry(lease: object) -> float:
    try:
        return float(lease.get(LEASE.exp, 0))  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return 0.0


def _info(record) -> OrgInfo:
    leases = record.leases.as_dict() if hasattr(record.leases, "as_dict") else dict(record.leases or {})
    return OrgInfo(record.org_id, record.status, int(record.concurrency_limit), record.credits, record.created_at, leases)


MAX_CONCURRENCY = MAX_ORG_CONCURRENCY  # kiln.settings says why


def _check_limit(concurrency: int) -> None:
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"the concurrency limit must be from 1 to {MAX_CONCURRENCY}")


# What an operator may put on a balance at once: a balance is debited costs of up to 15 decimal
# places (kiln.catalog.PRICE_DECIMALS), and stays exact in the 38 digits of a DynamoDB number
# while it has no more than 23 before the point; amounts below a trillion dollars, no finer than a
# cost, keep it there. Below 0 it goes only by the bills of the requests in flight when it reached
# 0, at most MAX_CONCURRENCY of them, each at most $2E12 (kiln.metering.MAX_REQUEST_TOKENS): not
# past -1E15.
MAX_CREDITS = Decimal("1e12")
CREDIT_DECIMALS = 15


def _check_credits(amount: Decimal) -> None:
    if amount.copy_abs() >= MAX_CREDITS or decimal_places(amount) > CREDIT_DECIMALS:  # exact: no context rounds
        raise ValueError(f"credits must be below ${MAX_CREDITS:,.0f} and have at most {CREDIT_DECIMALS} decimal "
                         f"places, so that every debit stays exact")


def create_org(tables: Tables, org_id: str, *, concurrency: int, credits: Decimal) -> OrgInfo:
    if not valid_org_id(org_id):
        raise ValueError("org ids are 1-63 characters: lower-case letters, digits, '-' and '_', the first a letter or a digit")
    _check_limit(concurrency)
    if not credits.is_finite() or credits < 0:
        raise ValueError("credits must be a non-negative amount of USD")
    _check_credits(credits)
    record = tables.orgs(
        org_id=org_id, status="active", concurrency_limit=concurrency, credits=credits, leases={}, created_at=iso_ms(now())
    )
    try:
        record.save(condition=tables.orgs.org_id.does_not_exist())
    except PutError as exc:
        if condition_failure(exc) is None:
            raise
        # The AWS client sends a write again when its answer was lost: the org the resend's
        # condition found may be this very call's, made at this millisecond with these values.
        found = get_org(tables, org_id)
        made = _info(record)
        if (found.created_at, found.status, found.concurrency_limit, found.credits) != (
                made.created_at, made.status, made.concurrency_limit, made.credits):
            raise RecordExists("org", org_id) from None
        return found
    return _info(record)


def get_org(tables: Tables, org_id: str) -> OrgInfo:
    try:
        return _info(tables.orgs.get(org_id, consistent_read=True))
    except DoesNotExist:
        raise RecordNotFound("org", org_id) from None


def list_orgs(tables: Tables) -> list[OrgInfo]:
    """Every org, by id (a scan: an operator's command, never on a request's path)."""
    return sorted((_info(record) for record in tables.orgs.scan()), key=lambda org: org.org_id)


# An operator's write to an org item meets the settle transactions of its requests: DynamoDB
# refuses it with TransactionConflictException, which botocore does not retry. Such a refusal
# was not applied, so trying again is safe. (The writes here SET; botocore sends one again after
# a lost answer, which would apply an ADD twice: `add_credits` goes with a token.)
_CONFLICT_ATTEMPTS = 20


def _over_conflicts(write: Callable[[], T], conflicted: Callable[[Exception], bool]) -> T:
    """`write()`, tried again after a random pause while it fails as `conflicted` says (a
    refusal that was not applied), up to _CONFLICT_ATTEMPTS times."""
    for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
        try:
            return write()
        except Exception as exc:
            if attempt == _CONFLICT_ATTEMPTS or not conflicted(exc):
                raise
        time.sleep(random.random() * min(0.25, 0.01 * 2**attempt))
    raise AssertionError("unreachable")


def _update(tables: Tables, org_id: str, actions) -> OrgInfo:
    record = tables.orgs(org_id=org_id)

    def write() -> OrgInfo:
        try:
            record.update(actions=actions, condition=tables.orgs.org_id.exists())
        except UpdateError as exc:
            if condition_failure(exc) is not None:
                raise RecordNotFound("org", org_id) from None
            raise
        return _info(record)

    return _over_conflicts(write, lambda exc: getattr(translate_storage_error(exc), "code", None)
                           == "TransactionConflictException")


def set_status(tables: Tables, org_id: str, status: str) -> OrgInfo:
    if status not in ("active", "disabled"):
        raise ValueError("status is active or disabled")
    return _update(tables, org_id, [tables.orgs.status.set(status)])


def set_limit(tables: Tables, org_id: str, concurrency: int) -> OrgInfo:
    _check_limit(concurrency)
    return _update(tables, org_id, [tables.orgs.concurrency_limit.set(concurrency)])


def add_credits(tables: Tables, org_id: str, amount: Decimal) -> OrgInfo:
    """Atomic top-up (ADD), safe while requests of the org are settling, and applied once.

    An ADD sent again is applied again, and the AWS client sends a write again when its
    answer is lost (a reset connection, a 5xx): a top-up of $1 added $2. So it goes as a
    transaction with a ClientRequestToken, which DynamoDB applies once however often it is
    sent within 10 minutes; a new token for each try after a conflict (not applied)."""
    if not amount.is_finite() or amount == 0:
        raise ValueError("the amount must be a non-zero number of USD")
    _check_credits(amount)
    record = tables.orgs(org_id=org_id)
    connection = tables.orgs._get_connection().connection
    token = [f"credits-{uuid.uuid4().hex}"]
    lost = [0]  # answers lost: sent again a few times (each with the AWS client's own tries), then told

    def write() -> OrgInfo:
        try:
            with TransactWrite(connection=connection, client_request_token=token[0]) as transaction:
                transaction.update(record, actions=[tables.orgs.credits.add(amount)],
                                   condition=tables.orgs.org_id.exists())
        except TransactWriteError as exc:
            reasons = [reason.code if reason is not None else None for reason in exc.cancellation_reasons or []]
            if reasons[:1] == ["ConditionalCheckFailed"]:
                raise RecordNotFound("org", org_id) from None
            # the item's own refusal (a balance DynamoDB cannot hold: ValidationError), or the
            # conflict, in DynamoDB's words
            refusals = [reason for reason in exc.cancellation_reasons or []
                        if reason is not None and reason.code not in (None, "None")]
            if refusals:
                if TransactionCancelled(reasons).transient:
                    token[0] = f"credits-{uuid.uuid4().hex}"  # not applied: the next try is a new one
                    raise _Cancelled("; ".join(f"{reason.code}: {reason.message}" for reason in refusals),
                                     refusals[0].code) from None
                raise StorageError("; ".join(f"{reason.code}: {reason.message}" for reason in refusals),
                                   refusals[0].code) from None
            failure = translate_storage_error(exc)
            # in progress: the same token's first send is still being applied (its answer lost)
            if may_have_been_applied(failure) or getattr(failure, "code", None) == "TransactionInProgressException":
                # sent again with its token, it is applied once and answered as the first was
                lost[0] += 1
                raise (_MaybeApplied if lost[0] < _LOST_ANSWER_TRIES else StorageError)(
                    f"DynamoDB's answer was lost ({failure}): the top-up may have been applied. Look at the "
                    f"balance (kiln admin credits show {org_id}) before adding it again.", failure.code) from exc
            raise failure from exc
        return get_org(tables, org_id)

    return _over_conflicts(write, lambda exc: isinstance(exc, (_Cancelled, _MaybeApplied)))


class _Cancelled(TransientStorageError):
    """A transaction cancelled by a conflict or throttling on its item: not applied, tried again."""


_LOST_ANSWER_TRIES = 3


class _MaybeApplied(TransientStorageError):
    """A top-up whose answer was lost: perhaps applied, sent again with the same token."""
