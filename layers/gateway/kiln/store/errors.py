"""Storage failures, translated from kiln.aws, botocore and pynamodb in exactly one place.

    StorageError                DynamoDB (or SSM) refused the call or could not be reached
     └── TransientStorageError  …in a way that another try may cure: a conflict with a
                                transaction in flight, throttling, a 5xx, a lost answer
    UnstorableValue             a value DynamoDB cannot store (a bug upstream of storage)
    ConditionFailed             a conditional write's condition was false (an answer, not a fault)
    TransactionCancelled        a transaction was cancelled; `reasons` says why, item by item

`translate_storage_error` maps any exception a storage call raised onto this tree;
`is_transient` says whether the ledger's retry policy (`kiln.store.retry`) tries again.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

from ..errors import StorageUnavailable

__all__ = [
    "AlreadyRevoked",
    "ConditionFailed",
    "NothingHeld",
    "RecordExists",
    "RecordNotFound",
    "StorageError",
    "TransactionCancelled",
    "TransientStorageError",
    "UnstorableValue",
    "condition_failure",
    "is_transient",
    "may_have_been_applied",
    "met_another_write",
    "translate_storage_error",
]

# Error codes of a refusal that says nothing about the request itself: the same call may pass.
TRANSIENT_CODES = frozenset(
    {
        "TransactionConflictException",  # a plain write met an item inside a transaction in flight
        "TransactionInProgressException",  # the same ClientRequestToken is still being applied
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        "InternalFailure",
        "ServiceUnavailable",
        "ConnectionError",  # kiln.aws: the answer never came (refused, reset, timed out)
    }
)
# Of those, the ones that say the call went unanswered (it may have been applied), and those
# of DynamoDB's own faults (a 5xx, whatever status it came with)
_UNANSWERED_CODES = frozenset({"ConnectionError", "InternalServerError", "InternalFailure", "ServiceUnavailable"})
# Of those, the ones that say the call met another write of its items.
_ANOTHER_WRITE_CODES = frozenset({"TransactionConflictException", "TransactionInProgressException"})
# Cancellation reasons of a transaction that another try may cure.
TRANSIENT_REASONS = frozenset({"TransactionConflict", "ThrottlingError", "ProvisionedThroughputExceeded"})


class StorageError(Exception):
    """DynamoDB (or SSM) could not be reached or refused the call: throttled, down, misconfigured."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    def as_gateway_error(self) -> StorageUnavailable:
        return StorageUnavailable("The gateway's storage is unavailable; retry with exponential backoff.")


class TransientStorageError(StorageError):
    """A refusal worth another try (conflict, throttling, 5xx, lost answer). `maybe_applied`:
    the call may have been applied all the same (its answer lost, or a 5xx, which "may or
    may not have succeeded"), where a refusal (conflict, throttling) says it was not."""

    def __init__(self, message: str, code: str | None = None, *, maybe_applied: bool = False) -> None:
        super().__init__(message, code)
        self.maybe_applied = maybe_applied


class NothingHeld(StorageError):
    """A settle of a generation whose lease is not held and whose event is not there: one this
    storage never admitted (a record edited by hand, or from elsewhere). Not retried; the
    caller keeps the record."""


class UnstorableValue(StorageError):
    """A value DynamoDB would reject for good (a number beyond 38 digits or its range):
    never sent, never retried; the caller keeps the record (the unsettled log)."""


class RecordNotFound(LookupError):
    """An operator named an org, key or generation that does not exist."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} not found")
        self.kind, self.ident = kind, ident


class AlreadyRevoked(Exception):
    """A revoke, or a change, of a key that is revoked."""

    def __init__(self, key_id: str, since: str | None) -> None:
        super().__init__(f"key {key_id!r} is already revoked" + (f" (since {since})" if since else ""))
        self.key_id, self.since = key_id, since


class RecordExists(Exception):
    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} already exists")
        self.kind, self.ident = kind, ident


class ConditionFailed(Exception):
    """A conditional write's condition was false; `old_item` holds the item as it was (ALL_OLD)."""

    def __init__(self, old_item: dict[str, Any] | None) -> None:
        super().__init__("condition failed")
        self.old_item = old_item


class TransactionCancelled(Exception):
    """A transaction was cancelled; `reasons` holds one code (or None) per item, in order."""

    def __init__(self, reasons: list[str | None]) -> None:
        super().__init__(f"transaction cancelled: {reasons}")
        self.reasons = reasons

    @property
    def transient(self) -> bool:
        """Cancelled by a conflict or throttling on some item, not (only) by its conditions."""
        return any(reason in TRANSIENT_REASONS for reason in self.reasons)

    def failed_condition(self, index: int) -> bool:
        return index < len(self.reasons) and self.reasons[index] == "ConditionalCheckFailed"


def is_transient(exc: BaseException) -> bool:
    """Would the same storage call, tried again a little later, possibly succeed?"""
    if isinstance(exc, TransactionCancelled):
        return exc.transient
    return isinstance(exc, TransientStorageError)


def met_another_write(exc: BaseException) -> bool:
    """Whether a transient refusal says only that the call met another write of its items (a
    transaction in flight, the same ClientRequestToken still being applied): one request's
    write meeting another's, not storage's own refusal (throttling, a 5xx, a lost answer)."""
    if isinstance(exc, TransactionCancelled):
        transient = [reason for reason in exc.reasons if reason in TRANSIENT_REASONS]
        return bool(transient) and all(reason == "TransactionConflict" for reason in transient)
    return isinstance(exc, TransientStorageError) and exc.code in _ANOTHER_WRITE_CODES


def may_have_been_applied(exc: BaseException) -> bool:
    """Whether a write that failed so may have been applied (its answer lost, or a 5xx)."""
    return isinstance(exc, TransientStorageError) and exc.maybe_applied


def condition_failure(exc: BaseException) -> BaseException | None:
    """The domain exception for a failed condition or cancelled transaction, else None."""
    answer = _answer(exc)
    return _from_code(*answer) if answer is not None else None


def _answer(exc: BaseException) -> tuple[str | None, dict[str, Any]] | None:
    """An AWS error answer's code and body, from kiln.aws's AwsError or a botocore ClientError
    (inside a pynamodb exception or not); None for an exception that carries none."""
    code = getattr(exc, "code", None)
    if isinstance(getattr(exc, "body", None), dict) and isinstance(code, str):  # kiln.aws.AwsError
        return code, exc.body
    error = _client_error(exc)
    if error is None:
        return None
    response = getattr(error, "response", {}) or {}
    return response.get("Error", {}).get("Code"), response


def _from_code(code: str | None, body: dict[str, Any]) -> BaseException | None:
    if code == "ConditionalCheckFailedException":
        return ConditionFailed(body.get("Item"))
    if code == "TransactionCanceledException":
        codes = [(reason or {}).get("Code") for reason in body.get("CancellationReasons") or []]
        reasons = [None if code in (None, "None") else code for code in codes]
        if any(reason not in _OUTCOMES for reason in reasons):
            # an item refused the write itself (ValidationError: a number out of range, an item
            # over 400 KB; ItemCollectionSizeLimitExceeded): no condition's answer and no race,
            # a failure of the call, as the same write outside a transaction would be
            return None
        return TransactionCancelled(reasons)
    return None


# What a transaction's cancellation may say of an item as a condition's answer or a race.
_OUTCOMES = frozenset({None, "ConditionalCheckFailed"}) | TRANSIENT_REASONS


def translate_storage_error(exc: BaseException) -> BaseException:
    """Map any exception raised by a storage call onto the tree above."""
    mapped = condition_failure(exc)
    if mapped is not None:
        return mapped
    if isinstance(exc, StorageError):
        return exc
    code, status = _code_and_status(exc)
    detail = f"{type(exc).__name__}: {code or exc}{_reasons_of(exc) if code == 'TransactionCanceledException' else ''}"
    server_fault = status is not None and status >= 500
    transport = _lost_answer(exc)
    if code in TRANSIENT_CODES or server_fault or transport:
        # sent and not answered, or answered by a fault of the server's: perhaps applied; a
        # connection that was never made carried no call
        maybe = (server_fault or transport or code in _UNANSWERED_CODES) and not _never_sent(exc)
        return TransientStorageError(detail, code, maybe_applied=maybe)
    return StorageError(detail, code)


def _reasons_of(exc: BaseException) -> str:
    """A cancellation's reasons that are not condition answers, with their messages, for the log."""
    _, body = _answer(exc) or (None, {})
    reasons = [reason for reason in body.get("CancellationReasons") or [] if isinstance(reason, dict)
               and reason.get("Code") not in (None, "None") and reason.get("Code") not in _OUTCOMES]
    return "".join(f" ({reason.get('Code')}: {str(reason.get('Message', ''))[:200]})" for reason in reasons)


def _code_and_status(exc: BaseException) -> tuple[str | None, int | None]:
    code = getattr(exc, "code", None)
    if isinstance(getattr(exc, "body", None), dict) and isinstance(code, str):  # kiln.aws.AwsError
        status = getattr(exc, "status", None)
        # kiln.aws reports an answer that never came with status 0
        return (code if status != 0 else "ConnectionError"), (status or None)
    error = _client_error(exc)
    if error is None:
        return None, None
    response = getattr(error, "response", {}) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return response.get("Error", {}).get("Code"), status if isinstance(status, int) else None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those it was raised from or while handling, five deep at most."""
    current: BaseException | None = exc
    for _ in range(5):
        if current is None:
            return
        yield current
        current = current.__cause__ or current.__context__


def _never_sent(exc: BaseException) -> bool:
    """A connection that could not be made: the call never left."""
    from ..http1 import ConnectFailed, ConnectTimeout

    return any(isinstance(cause, (ConnectFailed, ConnectTimeout))
               or type(cause).__name__ in ("EndpointConnectionError", "ConnectTimeoutError")  # botocore's
               for cause in _causes(exc))


def _lost_answer(exc: BaseException) -> bool:
    """A transport failure: the call may or may not have been applied, its answer is lost."""
    from ..http1 import HttpError

    # botocore's by name, without importing botocore on the request path
    return any(isinstance(cause, (HttpError, ConnectionError, TimeoutError, asyncio.TimeoutError))
               or type(cause).__name__ in ("ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
                                           "ConnectionClosedError")
               for cause in _causes(exc))


def _client_error(exc: BaseException) -> BaseException | None:
    """The botocore ClientError inside a pynamodb exception, or the exception itself."""
    seen = 0
    while exc is not None and seen < 5:
        if hasattr(exc, "response") and isinstance(exc.response, dict):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None
