"""The embedded AWS for the local stack and the tests: moto's server, made faithful enough.

Three things are changed from plain moto, each because the gateway depends on it:

1. **Serialized.** moto's DynamoDB is not atomic under concurrency (a `< 8` condition let
   15 of 32 concurrent callers through). One lock around request handling makes every
   conditional write and transaction atomic, as DynamoDB's are.
2. **Transactions cost what they touch.** moto deep-copies every table a transaction
   touches as its rollback backup, so a settle grew from 12 ms to over a second as the
   usage table filled. Here a transaction checks every condition first, then applies the
   writes, backing up only the items it writes.
3. **Exact numbers.** Arithmetic in update expressions is done in Decimal whatever the
   spelling of the operands (moto reads `1E-7` as an integer and fails), and results are
   written without exponents, as DynamoDB returns them.
"""

from __future__ import annotations

import copy
import threading
from decimal import Decimal, localcontext
from typing import Any

__all__ = ["EmbeddedAws", "patch_moto", "serialized_app"]

_patched = False


def _number(value: str) -> Decimal:
    return Decimal(value)


def _number_text(value: Decimal) -> str:
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def patch_moto() -> None:
    """Apply changes 2 and 3 to moto's DynamoDB backend (idempotent)."""
    global _patched
    if _patched:
        return
    from moto.dynamodb.models import DynamoDBBackend
    from moto.dynamodb.models.dynamo_type import DDBType, DynamoType

    def add(self: DynamoType, other: DynamoType) -> DynamoType:
        if self.type != other.type or self.type != DDBType.NUMBER:
            return _original_add(self, other)
        with localcontext() as context:
            context.prec = 38  # DynamoDB's precision
            return DynamoType({DDBType.NUMBER: _number_text(_number(self.value) + _number(other.value))})

    def sub(self: DynamoType, other: DynamoType) -> DynamoType:
        if self.type != other.type or self.type != DDBType.NUMBER:
            return _original_sub(self, other)
        with localcontext() as context:
            context.prec = 38
            return DynamoType({DDBType.NUMBER: _number_text(_number(self.value) - _number(other.value))})

    _original_add, _original_sub = DynamoType.__add__, DynamoType.__sub__
    DynamoType.__add__ = add  # type: ignore[method-assign]
    DynamoType.__sub__ = sub  # type: ignore[method-assign]
    DynamoDBBackend.transact_write_items = _transact_write_items  # type: ignore[method-assign]
    _patched = True


def _transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
    """TransactWriteItems: every condition checked first, then the writes; only written items backed up."""
    from moto.dynamodb.comparisons import get_filter_expression
    from moto.dynamodb.exceptions import (
        MockValidationException,
        MultipleTransactionsException,
        TooManyTransactionsException,
        TransactionCanceledException,
        TransactWriteSingleOpException,
    )

    if len(transact_items) > 100:
        raise TooManyTransactionsException()
    seen: set[tuple[str, str]] = set()
    errors: list[tuple[Any, Any, Any]] = []
    writes: list[tuple[str, dict[str, Any], str, dict[str, Any]]] = []
    for entry in transact_items:
        if len(entry) > 1:
            raise TransactWriteSingleOpException
        op_type, op = next(iter(entry.items()))
        if op_type not in {"ConditionCheck", "Put", "Delete", "Update"}:
            raise ValueError("Unsupported transaction operation")
        table_name = op["TableName"]
        table = self.get_table(table_name)
        if op_type == "Put":
            key = {table.hash_key_attr: op["Item"][table.hash_key_attr]}
            if table.range_key_attr is not None:
                key[table.range_key_attr] = op["Item"][table.range_key_attr]
        else:
            key = op["Key"]
        identity = (str(table_name), str(dict(sorted(key.items()))))
        if identity in seen:
            raise MultipleTransactionsException()
        seen.add(identity)
        current = self.get_item(table_name, key)
        condition = op.get("ConditionExpression")
        if condition is not None:
            try:
                passed = get_filter_expression(
                    condition, op.get("ExpressionAttributeNames"), op.get("ExpressionAttributeValues")
                ).expr(current)
            except MockValidationException:
                raise
            if not passed:
                old = None
                if op.get("ReturnValuesOnConditionCheckFailure") == "ALL_OLD" and current:
                    old = current.to_json()["Attributes"]
                errors.append(("ConditionalCheckFailed", "The conditional request failed", old))
                continue
        errors.append((None, None, None))
        if op_type != "ConditionCheck":
            writes.append((op_type, op, table_name, key))
    if any(code is not None for code, _, _ in errors):
        raise TransactionCanceledException(errors)

    backups = []
    for _, _, table_name, key in writes:
        current = self.get_item(table_name, key)
        backups.append((table_name, key, copy.deepcopy(current.to_json()["Attributes"]) if current else None))
    try:
        for op_type, op, table_name, key in writes:
            if op_type == "Put":
                self.put_item(table_name, op["Item"])
            elif op_type == "Delete":
                self.delete_item(table_name, key)
            else:
                self.update_item(
                    table_name,
                    key,
                    update_expression=op["UpdateExpression"],
                    expression_attribute_names=op.get("ExpressionAttributeNames"),
                    expression_attribute_values=op.get("ExpressionAttributeValues"),
                )
    except Exception:
        for table_name, key, attributes in reversed(backups):
            if attributes is None:
                self.delete_item(table_name, key)
            else:
                self.put_item(table_name, attributes)
        raise


class _Serialized:
    """WSGI middleware: one request at a time."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        with self._lock:
            # moto answers with a list body, so the whole response is made inside the lock
            return list(self._app(environ, start_response))


def serialized_app() -> Any:
    """moto's WSGI app, patched and serialized, as an ASGI app for uvicorn.

    Served by uvicorn rather than werkzeug's development server, which answers every
    request with `Connection: close` (a TCP connection and a server thread per call)."""
    patch_moto()
    from a2wsgi import WSGIMiddleware
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    return WSGIMiddleware(_Serialized(DomainDispatcherApplication(create_backend_app)), workers=16)


class EmbeddedAws:
    """moto's server (DynamoDB, SSM, …), serialized and patched, on a loopback port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        self._server: Any = None

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> "EmbeddedAws":
        from .serve import ServerThread

        self._server = ServerThread(serialized_app(), host=self._host, port=self._port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
