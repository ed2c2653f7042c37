"""Storage failures, translated from botocore and pynamodb in exactly one function."""

from __future__ import annotations

from typing import Any

from ..errors import StorageUnavailable

__all__ = [
    "AlreadyRevoked",
    "RecordExists",
    "RecordNotFound",
    "ConditionFailed", "StorageError", "TransactionConflict", "condition_failure", "translate_storage_error"]


class StorageError(Exception):
    """DynamoDB (or SSM) could not be reached or refused the call: throttled, down, misconfigured."""

    def as_gateway_error(self) -> StorageUnavailable:
        return StorageUnavailable("The gateway's storage is unavailable; retry with exponential backoff.")


class RecordNotFound(LookupError):
    """An operator named an org, key or generation that does not exist."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} not found")
        self.kind, self.ident = kind, ident


class AlreadyRevoked(Exception):
    def __init__(self, key_id: str, since: str | None) -> None:
        super().__init__(f"key {key_id!r} is already revoked" + (f" (since {since})" if since else ""))


class RecordExists(Exception):
    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} already exists")
        self.kind, self.ident = kind, ident


class ConditionFailed(Exception):
    """A conditional write's condition was false; `old_item` holds the item as it was (ALL_OLD)."""

    def __init__(self, old_item: dict[str, Any] | None) -> None:
        super().__init__("condition failed")
        self.old_item = old_item


class TransactionConflict(Exception):
    """A transaction was cancelled; `reasons` holds one code (or None) per item, in order."""

    def __init__(self, reasons: list[str | None]) -> None:
        super().__init__(f"transaction cancelled: {reasons}")
        self.reasons = reasons


def condition_failure(exc: BaseException) -> BaseException | None:
    """The domain exception for a failed condition or cancelled transaction, else None."""
    code = getattr(exc, "code", None)
    if isinstance(getattr(exc, "body", None), dict) and isinstance(code, str):  # kiln.aws.AwsError
        return _from_code(code, exc.body)
    error = _client_error(exc)
    if error is None:
        return None
    response = getattr(error, "response", {}) or {}
    return _from_code(response.get("Error", {}).get("Code"), response)


def _from_code(code: str | None, body: dict[str, Any]) -> BaseException | None:
    if code == "ConditionalCheckFailedException":
        return ConditionFailed(body.get("Item"))
    if code == "TransactionCanceledException":
        codes = [(reason or {}).get("Code") for reason in body.get("CancellationReasons") or []]
        return TransactionConflict([None if code in (None, "None") else code for code in codes])
    return None


def translate_storage_error(exc: BaseException) -> BaseException:
    """Map any exception raised by a storage call onto ConditionFailed / TransactionConflict / StorageError."""
    mapped = condition_failure(exc)
    if mapped is not None:
        return mapped
    if isinstance(exc, StorageError):
        return exc
    return StorageError(f"{type(exc).__name__}: {getattr(exc, 'code', None) or _code(exc) or exc}")


def _client_error(exc: BaseException) -> BaseException | None:
    """The botocore ClientError inside a pynamodb exception, or the exception itself."""
    seen = 0
    while exc is not None and seen < 5:
        if hasattr(exc, "response") and isinstance(exc.response, dict):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None


def _code(exc: BaseException) -> str | None:
    error = _client_error(exc)
    if error is None:
        return None
    return (getattr(error, "response", {}) or {}).get("Error", {}).get("Code")
