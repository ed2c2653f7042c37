"""The embedded AWS for the local stack and the tests: moto's server, made faithful enough.

These things are changed from plain moto, each because the gateway depends on it:

1. **Serialized.** moto's DynamoDB is not atomic under concurrency (a `< 8` condition let
   15 of 32 concurrent callers through). One lock around request handling makes every
   conditional write and transaction atomic, as DynamoDB's are.
2. **Transactions cost what they touch.** moto deep-copies every table a transaction
   touches as its rollback backup, so a settle grew from 12 ms to over a second as the
   usage table filled. Here a transaction checks every condition first, then applies the
   writes, backing up only the items it writes.
3. **Exact numbers, DynamoDB's only.** Arithmetic in update expressions is done in Decimal
   whatever the spelling of the operands (moto reads `1E-7` as an integer and fails), and
   results are written without exponents, as DynamoDB returns them. A number DynamoDB cannot
   hold (more than 38 significant digits, a magnitude from 1E+126 up or below 1E-130),
   anywhere in a request or as the result of its arithmetic, is refused with DynamoDB's
   ValidationException; moto checks only an item's, through a float, and stores the rest.
4. **Idempotent transactions.** A `TransactWriteItems` with a `ClientRequestToken` seen in
   the last 10 minutes is answered as the first one was and not applied again (the same
   parameters), refused with `IdempotentParameterMismatchException` (others), or with
   `TransactionInProgressException` while the first is still being applied.
5. **Atomic updates.** An `UpdateItem` is applied whole or not at all: moto applies its
   actions one by one, so one refused (a sum out of range, an item over 400 KB) left those
   before it written (a refused admission's lease stayed, a slot AWS would never take).
6. **Items of 400 KB at most, by DynamoDB's count.** An update, in a transaction or not, that
   grows an item past 400 KB (its names and values counted as DynamoDB's guide counts them, a
   map's overhead included) is refused with DynamoDB's ValidationException (a transaction's as
   its cancellation reason): moto checked a plain update's top-level values only, by its own
   count, and a transaction's not at all, so settles and key changes grew items AWS refuses.

And, only when asked (`kiln emulator --faults …`, `kiln dev --faults …`, or
`KILN_EMULATOR_FAULTS`), DynamoDB under contention (`Faults`): transactions that take time,
during which a plain write to one of their items gets `TransactionConflictException` and a
transaction meeting them is cancelled with reason `TransactionConflict`; conflicts with
transactions of other clients at a given rate; random throttling; and answers lost after the
write was applied (the connection closed mid-answer).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from decimal import Context, Decimal, Inexact, InvalidOperation, Overflow, localcontext
from typing import Any

from kiln.store.codec import significant_digits, storage_problem
from kiln.store.keys import OPERATOR_AGENT

from .serve import read_body

__all__ = ["FAULTS_ENV", "EmbeddedAws", "Faults", "FaultyDynamoDB", "patch_moto", "serialized_app"]

FAULTS_ENV = "KILN_EMULATOR_FAULTS"

_patched = False


def _number(value: str) -> Decimal:
    return Decimal(value)


def _number_text(value: Decimal) -> str:
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


# DynamoDB's words for each number it cannot hold (kiln.store.codec.storage_problem)
_REFUSALS = {
    "digits": "Attempting to store more than 38 significant digits in a Number",
    "overflow": "Number overflow. Attempting to store a number with magnitude larger than supported range",
    "underflow": "Number underflow. Attempting to store a number with magnitude smaller than supported range",
}


# Exact sums and differences of DynamoDB numbers (38 digits, exponents from -130 to 125): a
# result is never rounded here, where DynamoDB would have to round or refuse it.
_EXACT = Context(prec=400, Emin=-999, Emax=999, traps=[Inexact, InvalidOperation, Overflow])


def _refuse_unholdable(text: Any) -> None:
    """DynamoDB's ValidationException for a number it cannot hold (others are left to moto)."""
    from moto.dynamodb.exceptions import MockValidationException

    if not isinstance(text, str):
        return
    try:
        value = Decimal(text)
    except InvalidOperation:
        return  # not a number: moto has its own answer
    problem = storage_problem(value) if value.is_finite() else None
    if problem is not None:
        raise MockValidationException(_REFUSALS[problem])


def _result(number_type: Any, value: Decimal) -> Any:
    """The number an update's arithmetic made, as moto holds it; refused as DynamoDB refuses it:
    a magnitude past its range as an overflow (as DynamoDB words it, whatever the digits), else
    more than 38 digits as such (when the number is made)."""
    from moto.dynamodb.exceptions import MockValidationException
    from moto.dynamodb.models.dynamo_type import DDBType

    if value and value.adjusted() >= 126:
        raise MockValidationException(_REFUSALS["overflow"])
    return number_type({DDBType.NUMBER: _number_text(value)})


def patch_moto() -> None:
    """Apply changes 2 and 3 to moto's DynamoDB backend (idempotent)."""
    global _patched
    if _patched:
        return
    from moto.dynamodb.models import DynamoDBBackend
    from moto.dynamodb.models.dynamo_type import DDBType, DynamoType
    from moto.dynamodb.models.table import Table

    def validate_number_type(self: Table, value: Any) -> None:
        _refuse_unholdable(value)  # before moto's own check, which reads 1e1000000 as a float: inf
        _original_validate(self, value)

    def init(self: DynamoType, type_as_dict: Any) -> None:
        _original_init(self, type_as_dict)
        if self.type == DDBType.NUMBER:  # every number of a request, and every result of its arithmetic
            _refuse_unholdable(self.value)

    def add(self: DynamoType, other: DynamoType) -> DynamoType:
        if self.type != other.type or self.type != DDBType.NUMBER:
            return _original_add(self, other)
        with localcontext(_EXACT):  # the exact result: one that needs more than 38 digits is refused
            return _result(DynamoType, _number(self.value) + _number(other.value))

    def sub(self: DynamoType, other: DynamoType) -> DynamoType:
        if self.type != other.type or self.type != DDBType.NUMBER:
            return _original_sub(self, other)
        with localcontext(_EXACT):
            return _result(DynamoType, _number(self.value) - _number(other.value))

    _limit_parameter_sizes()
    _original_add, _original_sub, _original_init = DynamoType.__add__, DynamoType.__sub__, DynamoType.__init__
    _original_validate = Table._validate_number_type
    Table._validate_number_type = validate_number_type  # type: ignore[method-assign]
    DynamoType.__init__ = init  # type: ignore[method-assign]
    DynamoType.__add__ = add  # type: ignore[method-assign]
    DynamoType.__sub__ = sub  # type: ignore[method-assign]
    DynamoDBBackend.transact_write_items = _transact_write_items  # type: ignore[method-assign]
    global _plain_update_item
    _plain_update_item = DynamoDBBackend.update_item
    DynamoDBBackend.update_item = _atomic(_plain_update_item)  # type: ignore[method-assign]
    _patched = True


_plain_update_item: Any = None  # moto's own, for transactions (which back up what they write)

def _limit_parameter_sizes() -> None:
    """moto's PutParameter takes a value of any length; SSM refuses one beyond its tier's, so a
    catalog that fits locally fits in AWS."""
    from moto.ssm.exceptions import ValidationException
    from moto.ssm.models import SimpleSystemManagerBackend

    from .provision import PARAMETER_VALUE_LIMITS

    original = SimpleSystemManagerBackend.put_parameter

    def put_parameter(self: Any, name: str, description: str, value: str, *args: Any, **kwargs: Any) -> Any:
        tier = kwargs.get("tier") or (args[6] if len(args) > 6 else None) or "Standard"
        existing = self._parameters[name] if name in self._parameters else None  # both read names as moto does
        if existing and getattr(existing[-1], "tier", None) == "Advanced":
            tier = "Advanced"  # SSM never turns an advanced parameter back into a standard one
        limit = PARAMETER_VALUE_LIMITS.get(tier, PARAMETER_VALUE_LIMITS["Advanced"])  # Intelligent-Tiering: up to 8 KB
        if value and len(value) > limit:
            advice = (" To create a larger parameter value, upgrade the parameter to use the advanced-parameter tier."
                      if tier == "Standard" else "")
            raise ValidationException(f"{tier} tier parameters support a maximum parameter value of {limit} "
                                      f"characters.{advice}")
        return original(self, name, description, value, *args, **kwargs)

    SimpleSystemManagerBackend.put_parameter = put_parameter  # type: ignore[method-assign]


def _atomic(update_item: Any) -> Any:
    """UpdateItem as DynamoDB applies it, all its actions or none: moto applies them one by
    one, so one refused (a sum out of range, an item over 400 KB) left those before it written."""

    def atomic_update_item(self: Any, table_name: str, key: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        table = self.get_table(table_name)
        hash_value, range_value = self.get_keys_value(table, key)
        before = table.get_item(hash_value, range_value)
        saved = copy.deepcopy(before.attrs) if before is not None else None
        size = item_size(before.to_json()["Attributes"]) if before is not None else 0  # updated in place
        try:
            updated = update_item(self, table_name, key, *args, **kwargs)
            _refuse_oversized(table.get_item(hash_value, range_value), size)
            return updated
        except Exception:
            after = table.get_item(hash_value, range_value)
            if saved is None and after is not None:
                table.delete_item(hash_value, range_value)
            elif after is not None:
                after.attrs = saved
            raise

    return atomic_update_item


# The most an item may hold, by DynamoDB's count (its guide's "Item sizes and formats").
MAX_ITEM_BYTES = 400 * 1024


def value_size(value: dict[str, Any]) -> int:
    """An attribute value's size as DynamoDB counts it: a string's UTF-8 bytes, a number's
    significant digits two to a byte plus one, a map's or list's 3 bytes and a byte per element
    beside its elements (a map's names included), a set's elements."""
    ((kind, raw),) = value.items()
    if kind == "S":
        return len(raw.encode())
    if kind == "N":  # its significant digits: zeros at either end and an exponent are not stored
        return (significant_digits(Decimal(raw)) + 1) // 2 + 1
    if kind == "B":
        return len(raw if isinstance(raw, bytes) else raw.encode())
    if kind in ("BOOL", "NULL"):
        return 1
    if kind in ("SS", "NS", "BS"):
        return sum(value_size({kind[0]: element}) for element in raw)
    if kind == "M":
        return 3 + sum(len(name.encode()) + value_size(inner) + 1 for name, inner in raw.items())
    if kind == "L":
        return 3 + sum(value_size(inner) + 1 for inner in raw)
    raise ValueError(f"no DynamoDB type: {kind}")


def item_size(attributes: dict[str, Any]) -> int:
    """An item's size as DynamoDB counts it: its attributes' names and values."""
    return sum(len(name.encode()) + value_size(value) for name, value in attributes.items())


def _refuse_oversized(item: Any, before: int) -> None:
    """DynamoDB's ValidationException for an item grown past 400 KB by a write (moto checks a
    plain update's top-level values only, by its own count, and a transaction's not at all);
    `before`: its size before the write (one that shrinks an item is never refused for it)."""
    from moto.dynamodb.exceptions import MockValidationException

    size = item_size(item.to_json()["Attributes"]) if item is not None else 0
    if size > MAX_ITEM_BYTES and size > before:
        raise MockValidationException("Item size to update has exceeded the maximum allowed size")


_VALUE_PLACEHOLDER = re.compile(r":[A-Za-z0-9_]+")


def _refuse_unused_values(op: dict[str, Any]) -> None:
    """DynamoDB refuses a value placeholder that no expression of the item uses (moto checks the
    names of a transaction's items, not their values)."""
    from moto.dynamodb.exceptions import MockValidationException

    used = set()
    for expression in (op.get("ConditionExpression"), op.get("UpdateExpression")):
        used.update(_VALUE_PLACEHOLDER.findall(expression or ""))
    unused = sorted(set(op.get("ExpressionAttributeValues") or {}) - used)
    if unused:
        raise MockValidationException(f"Value provided in ExpressionAttributeValues unused in expressions: "
                                      f"keys: {{{', '.join(unused)}}}")


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
    writes: list[tuple[int, str, dict[str, Any], str, dict[str, Any]]] = []
    for index, entry in enumerate(transact_items):
        if len(entry) > 1:
            raise TransactWriteSingleOpException
        op_type, op = next(iter(entry.items()))
        if op_type not in {"ConditionCheck", "Put", "Delete", "Update"}:
            raise ValueError("Unsupported transaction operation")
        _refuse_unused_values(op)
        table_name = op["TableName"]
        table = self.get_table(table_name)
        if op_type == "Put":
            for name in (table.hash_key_attr, table.range_key_attr):
                if name is not None and name not in op["Item"]:  # DynamoDB's answer, not a 500
                    raise MockValidationException(
                        f"One or more parameter values were invalid: Missing the key {name} in the item")
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
            writes.append((index, op_type, op, table_name, key))
    if any(code is not None for code, _, _ in errors):
        raise TransactionCanceledException(errors)

    backups = []
    for _, _, _, table_name, key in writes:
        current = self.get_item(table_name, key)
        backups.append((table_name, key, copy.deepcopy(current.to_json()["Attributes"]) if current else None))
    applying = None
    try:
        for (applying, op_type, op, table_name, key), (_, _, before) in zip(writes, backups, strict=True):  # noqa: B007 - read when one fails
            if op_type == "Put":
                self.put_item(table_name, op["Item"])
            elif op_type == "Delete":
                self.delete_item(table_name, key)
            else:
                _plain_update_item(
                    self,
                    table_name,
                    key,
                    update_expression=op["UpdateExpression"],
                    expression_attribute_names=op.get("ExpressionAttributeNames"),
                    expression_attribute_values=op.get("ExpressionAttributeValues"),
                )
            if op_type != "Delete":
                _refuse_oversized(self.get_item(table_name, key), item_size(before) if before else 0)
    except Exception as exc:
        for table_name, key, attributes in reversed(backups):
            if attributes is None:
                self.delete_item(table_name, key)
            else:
                self.put_item(table_name, attributes)
        if not isinstance(exc, MockValidationException) or applying is None:
            raise
        # DynamoDB reports a write its item refuses (a number out of range, an item over 400 KB,
        # a path the item does not have) as the transaction's cancellation, with a reason for
        # that item: ValidationError and its message
        reasons: list[tuple[Any, Any, Any]] = [(None, None, None)] * len(transact_items)
        reasons[applying] = ("ValidationError", exc.message, None)
        raise TransactionCanceledException(reasons) from None


class _Serialized:
    """WSGI middleware: one request at a time."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        with self._lock:
            # moto answers with a list body, so the whole response is made inside the lock
            return list(self._app(environ, start_response))


def serialized_app(faults: "Faults | None" = None) -> Any:
    """moto's WSGI app, patched and serialized, as an ASGI app for uvicorn (with DynamoDB's
    idempotency tokens, and its behaviour under contention when `faults` are on).

    Served by uvicorn rather than werkzeug's development server, which answers every
    request with `Connection: close` (a TCP connection and a server thread per call)."""
    patch_moto()
    from a2wsgi import WSGIMiddleware
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    app = WSGIMiddleware(_Serialized(DomainDispatcherApplication(create_backend_app)), workers=16)
    return FaultyDynamoDB(app, faults or Faults())


class EmbeddedAws:
    """moto's server (DynamoDB, SSM, …), serialized and patched, on a loopback port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, faults: "Faults | None" = None) -> None:
        self._host, self._port = host, port
        self._faults = faults
        self._server: Any = None

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> "EmbeddedAws":
        from .serve import ServerThread

        self.faults_layer = serialized_app(self._faults)
        self._server = ServerThread(self.faults_layer, host=self._host, port=self._port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


# -- DynamoDB under contention ------------------------------------------------------------------

_WRITES = frozenset({"PutItem", "UpdateItem", "DeleteItem"})
_DATA_CALLS = frozenset(
    {"GetItem", "PutItem", "UpdateItem", "DeleteItem", "TransactWriteItems", "TransactGetItems", "Query", "Scan",
     "BatchGetItem", "BatchWriteItem"}
)
_TOKEN_SECONDS = 600  # DynamoDB keeps a ClientRequestToken for 10 minutes
_ERROR_PREFIX = "com.amazonaws.dynamodb.v20120810#"


@dataclass(frozen=True)
class Faults:
    """How hostile the emulator's DynamoDB is; all rates are per call, in [0, 1].

    conflict  a write (plain or in a transaction) to an item that transactions write meets
              another client's transaction: a plain write gets TransactionConflictException,
              a transaction is cancelled with reason TransactionConflict on that item
    throttle  a data-plane call gets ProvisionedThroughputExceededException
    lost      a write is applied, then its answer is cut off (the connection closes mid-answer)
    txn_ms    how long a transaction holds its items (always, also at rate 0): a plain write to
              one of them meanwhile conflicts, and so does another transaction (not the time
              it then waits for its turn at moto, which DynamoDB has no counterpart of)
    index_ms  how long a write takes to reach the tables' global secondary indexes (DynamoDB:
              within about a second): a Query of an index meanwhile leaves out the items it
              wrote (an item created is not found yet; one changed is missing, where DynamoDB
              would show its old version; a write its condition refused counts too: the
              emulator errs towards more lag, not less)
    ssm_tps   the most SSM GetParameter calls answered in any one second (Parameter Store's
              default: 40 per account and Region); the others get ThrottlingException
    seed      the random draws' seed (runs under concurrency still interleave differently)
    scope     `all` calls, or only the `gateway`'s (not operators' tools and set-up: botocore's
              calls and kiln admin's own, `user-agent: kiln-admin`)
    """

    conflict: float = 0.0
    throttle: float = 0.0
    lost: float = 0.0
    txn_ms: float = 0.0
    index_ms: float = 0.0
    ssm_tps: float = 0.0
    seed: int | None = None
    scope: str = "all"

    @property
    def enabled(self) -> bool:
        return bool(self.conflict or self.throttle or self.lost or self.txn_ms or self.index_ms or self.ssm_tps)

    @classmethod
    def parse(cls, text: str | None) -> "Faults":
        """`conflict=0.5,throttle=0.05,lost=0.05,txn_ms=5,index_ms=500,seed=7,scope=gateway` (any subset;
        an empty text turns nothing on). ValueError names what is wrong."""
        values: dict[str, Any] = {}
        known = {field.name for field in fields(cls)}
        for part in (text or "").replace(" ", "").split(","):
            if not part:
                continue
            name, sep, raw = part.partition("=")
            if not sep or name not in known:
                raise ValueError(f"unknown fault {part!r}: use {', '.join(sorted(known))} as name=value")
            if name == "scope":
                if raw not in ("all", "gateway"):
                    raise ValueError("scope is all or gateway")
                values[name] = raw
                continue
            try:
                number = int(raw) if name == "seed" else float(raw)
            except ValueError:
                raise ValueError(f"{name} needs a number, got {raw!r}") from None
            if name in ("conflict", "throttle", "lost") and not 0.0 <= number <= 1.0:
                raise ValueError(f"{name} is a rate between 0 and 1, got {raw}")
            if name in ("txn_ms", "index_ms", "ssm_tps") and not 0.0 <= number <= 60_000:
                raise ValueError(f"{name} is between 0 and 60000, got {raw}")
            values[name] = number
        return cls(**values)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Faults":
        return cls.parse((os.environ if env is None else env).get(FAULTS_ENV))

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        parts = [f"conflict={self.conflict:g}", f"throttle={self.throttle:g}", f"lost={self.lost:g}",
                 f"txn_ms={self.txn_ms:g}", f"index_ms={self.index_ms:g}", f"ssm_tps={self.ssm_tps:g}",
                 f"scope={self.scope}"]
        return ",".join(parts + ([f"seed={self.seed}"] if self.seed is not None else []))


class _LostAnswers(logging.Filter):
    """uvicorn logs each answer cut off on purpose as an error; those are not errors here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing response" not in record.getMessage()


class FaultyDynamoDB:
    """ASGI middleware in front of the serialized moto app: ClientRequestToken idempotency,
    and, when `faults` are on, DynamoDB's behaviour under contention (see `Faults`).

    Transactions hold their items *outside* the serialization lock for `txn_ms`, so that
    other calls can meet them, as they meet a transaction in flight in DynamoDB."""

    def __init__(self, app: Any, faults: Faults) -> None:
        self._app = app
        self.faults = faults
        self._random = random.Random(faults.seed)
        self._held: dict[tuple[str, str], int] = {}  # items inside a transaction in flight
        self._transactional: set[tuple[str, str]] = set()  # items some transaction has written
        self._tokens: dict[str, tuple[str, float, tuple[int, list, bytes] | None]] = {}
        self._key_names: dict[str, list[str]] = {}
        self._written: dict[tuple[str, str], float] = {}  # item → when a write last reached it (index_ms)
        self._parameter_reads: deque[float] = deque()  # when the GetParameter calls of the last second came
        if faults.lost:
            logging.getLogger("uvicorn.error").addFilter(_LostAnswers())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self._app(scope, receive, send)
        body = await read_body(receive)
        headers = {name.decode().lower(): value.decode() for name, value in scope.get("headers", [])}
        service, _, operation = headers.get("x-amz-target", "").partition(".")
        faulty = self.faults.enabled and (self.faults.scope == "all" or not _an_operators(headers.get("user-agent", "")))
        if service == "AmazonSSM" and operation == "GetParameter" and faulty and self.faults.ssm_tps:
            if self._over_parameter_rate():
                return await _error(send, "ThrottlingException", "Rate exceeded", prefix="", json_version="1.1")
        if not service.startswith("DynamoDB"):
            return await self._forward(scope, body, send)
        try:
            payload = json.loads(body or b"{}")
        except ValueError:
            return await self._forward(scope, body, send)
        if faulty and operation in _DATA_CALLS and self._draw(self.faults.throttle):
            return await _error(send, "ProvisionedThroughputExceededException",
                                "The level of configured provisioned throughput for the table was exceeded.")
        if operation == "TransactWriteItems":
            return await self._transaction(scope, body, payload, send, faulty)
        if faulty and operation in _WRITES:
            item = self._item(payload.get("TableName", ""), payload.get("Item") or payload.get("Key") or {})
            if item in self._held or (item in self._transactional and self._draw(self.faults.conflict)):
                return await _error(send, "TransactionConflictException",
                                    "Transaction is ongoing for the item")
            self._wrote([item])
        if faulty and operation == "Query" and payload.get("IndexName") and self.faults.index_ms:
            return await self._lagging_index(scope, body, payload, send)
        await self._forward(scope, body, send, lose=faulty and operation in _WRITES and self._draw(self.faults.lost))

    def _over_parameter_rate(self) -> bool:
        """Whether a GetParameter now is one more than ssm_tps in the last second (else counted)."""
        now = time.monotonic()
        reads = self._parameter_reads
        while reads and reads[0] <= now - 1.0:
            reads.popleft()
        if len(reads) >= self.faults.ssm_tps:
            return True
        reads.append(now)
        return False

    async def _transaction(self, scope: dict, body: bytes, payload: dict, send: Any, faulty: bool) -> None:
        token = payload.get("ClientRequestToken")
        digest = hashlib.sha256(body).hexdigest()
        now = time.monotonic()
        if token:
            for old in [key for key, (_, expires, _) in self._tokens.items() if expires < now]:
                del self._tokens[old]
            seen = self._tokens.get(token)
            if seen is not None:
                if seen[0] != digest:
                    return await _error(send, "IdempotentParameterMismatchException",
                                        "The ClientRequestToken was used with different parameters")
                if seen[2] is None:
                    return await _error(send, "TransactionInProgressException", "The transaction is still in progress")
                return await _answer(send, *seen[2])
            self._tokens[token] = (digest, now + _TOKEN_SECONDS, None)
        items = [self._transact_item(entry) for entry in payload.get("TransactItems") or []]
        if faulty:
            reasons = [
                "TransactionConflict" if item in self._held or (item in self._transactional and self._draw(self.faults.conflict))
                else None
                for item in items
            ]
            if any(reasons):
                if token:
                    del self._tokens[token]
                return await _error(send, "TransactionCanceledException",
                                    f"Transaction cancelled, please refer cancellation reasons for specific reasons {reasons}",
                                    CancellationReasons=[{"Code": "TransactionConflict", "Message": "Transaction is ongoing for the item"}
                                                         if reason else {"Code": "None"} for reason in reasons])
        for item in items:
            self._transactional.add(item)
        if faulty:  # a condition check writes nothing
            self._wrote([item for item, entry in zip(items, payload.get("TransactItems") or [], strict=True)
                         if "ConditionCheck" not in entry])
        if self.faults.txn_ms:
            # its items held for txn_ms, as DynamoDB holds them while a transaction runs; not
            # while it waits its turn for moto's lock, which DynamoDB has no counterpart of
            # (held then, a storm's load made one org's item held for seconds on end)
            for item in items:
                self._held[item] = self._held.get(item, 0) + 1
            try:
                await asyncio.sleep(self.faults.txn_ms / 1000)
            finally:
                for item in items:
                    self._held[item] -= 1
                    if not self._held[item]:
                        del self._held[item]
        answer = await _capture(self._app, scope, body)
        if token:
            if answer[0] == 200:
                self._tokens[token] = (digest, now + _TOKEN_SECONDS, answer)
            else:
                del self._tokens[token]  # a refused transaction leaves its token free
        await _answer(send, *answer, lose=faulty and self._draw(self.faults.lost))

    def _wrote(self, items: list[tuple[str, str]]) -> None:
        """Note the items a write reaches (for index_ms), forgetting those whose index caught up."""
        if not self.faults.index_ms:
            return
        now = time.monotonic()
        caught_up = now - self.faults.index_ms / 1000
        if len(self._written) > 10_000:
            self._written = {item: when for item, when in self._written.items() if when > caught_up}
        for item in items:
            self._written[item] = now

    async def _lagging_index(self, scope: dict, body: bytes, payload: dict, send: Any) -> None:
        """A Query of an index, without the items written less than index_ms ago."""
        status, headers, answer = await _capture(self._app, scope, body)
        if status == 200:
            table = payload.get("TableName", "")
            caught_up = time.monotonic() - self.faults.index_ms / 1000
            result = json.loads(answer)
            items = [item for item in result.get("Items", [])
                     if self._written.get(self._item(table, item), caught_up) <= caught_up]
            if len(items) != len(result.get("Items", [])):
                result["Items"], result["Count"] = items, len(items)
                answer = json.dumps(result).encode()
                headers = [(name, value) for name, value in headers if name.lower() != b"content-length"]
                headers.append((b"content-length", str(len(answer)).encode()))
        await _answer(send, status, headers, answer)

    def _transact_item(self, entry: dict) -> tuple[str, str]:
        (kind, op), = entry.items()
        return self._item(op.get("TableName", ""), op.get("Item") if kind == "Put" else op.get("Key") or {})

    def _item(self, table: str, item: dict) -> tuple[str, str]:
        """The item's identity: its table and key (a Put's item holds more than its key)."""
        names = self._key_names.get(table)
        if names is None:
            names = self._describe_key(table)
            if names is None:
                names = sorted(item)
            else:
                self._key_names[table] = names
        return table, json.dumps({name: item.get(name) for name in names}, sort_keys=True)

    @staticmethod
    def _describe_key(table: str) -> list[str] | None:
        try:
            from moto.core import DEFAULT_ACCOUNT_ID
            from moto.dynamodb.models import dynamodb_backends

            for backend in dynamodb_backends[DEFAULT_ACCOUNT_ID].values():
                if table in backend.tables:
                    found = backend.tables[table]
                    return [name for name in (found.hash_key_attr, found.range_key_attr) if name]
        except Exception:  # noqa: BLE001 - fall back to the attributes given
            return None
        return None

    def holding(self) -> bool:
        """Is some transaction in flight, holding its items?"""
        return bool(self._held)

    def _draw(self, rate: float) -> bool:
        return rate > 0 and self._random.random() < rate

    async def _forward(self, scope: dict, body: bytes, send: Any, *, lose: bool = False) -> None:
        if not lose:
            return await self._app(scope, _replay(body), send)
        await _answer(send, *await _capture(self._app, scope, body), lose=True)


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # nothing more: the client stays connected
        return {"type": "http.disconnect"}

    return receive


async def _capture(app: Any, scope: dict, body: bytes) -> tuple[int, list, bytes]:
    status, headers, parts = 500, [], []

    async def send(message: dict) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, _replay(body), send)
    return status, headers, b"".join(parts)


async def _answer(send: Any, status: int, headers: list, body: bytes, *, lose: bool = False) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if lose:  # half an answer, then the server closes the connection: the call was applied
        await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
        return
    await send({"type": "http.response.body", "body": body})


async def _error(send: Any, code: str, message: str, *, prefix: str = _ERROR_PREFIX, json_version: str = "1.0",
                 **extra: Any) -> None:
    body = json.dumps({"__type": prefix + code, "message": message, **extra}).encode()
    headers = [(b"content-type", f"application/x-amz-json-{json_version}".encode()),
               (b"content-length", str(len(body)).encode()),
               (b"x-amzn-errortype", code.encode())]
    await _answer(send, 400, headers, body)


def _an_operators(user_agent: str) -> bool:
    """Whether a call comes from an operator's tool or set-up (botocore, or kiln admin's own
    client), which `scope=gateway` spares."""
    agent = user_agent.lower()
    return "botocore" in agent or OPERATOR_AGENT in agent
