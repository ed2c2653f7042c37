"""A storage stand-in for the bench only: DynamoDB and SSM answers after a fixed service time, no lock.

The embedded AWS (`kiln emulator`: moto behind one lock) spends ~8 ms of CPU per Kiln request and
serializes every call, so at concurrency 8 and 16 the bench measured it, not the gateway. This
stand-in answers the operations the request path makes (GetItem, PutItem, UpdateItem, DeleteItem,
TransactWriteItems; SSM GetParameter) from memory, each after `service_ms` (default 4 ms, DynamoDB
in-region), and lets any number of calls wait at once. Each operation is applied in one go on the
event loop, before the wait, so it is atomic per item and a transaction is atomic as a whole,
which is all the bench's load needs; nothing else of DynamoDB is modelled (no capacity, no
conflicts, no TTL, no size limits).

The expressions are a small subset, the one the gateway writes: conditions with `AND`/`OR`/`NOT`,
parentheses, `attribute_exists`, `attribute_not_exists`, `size`, and the comparisons; updates
with `SET` (a value, or `a + b` / `a - b` on numbers) and `REMOVE`; projections of top-level
names. Parses are cached by expression text; names and values are bound on each call.

It is seeded from the embedded AWS after provisioning (`seed_from`), so both hold the same org,
key and catalog. Run it as `python -m bench.standin --port P --service-ms 4 --seed seed.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import re
import time
from decimal import Decimal
from functools import lru_cache
from typing import Any, Callable

from kiln_ops.serve import read_body

__all__ = ["ConditionFailed", "Store", "StoreError", "TransactionCanceled", "condition", "item_size", "projection",
           "read_units", "seed_from", "update", "write_units"]

_DYNAMODB = "com.amazonaws.dynamodb.v20120810#"


class StoreError(Exception):
    """An answer DynamoDB or SSM gives as an error: its `__type` and message."""

    def __init__(self, code: str, message: str, extra: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra or {}

    def body(self) -> dict[str, Any]:
        return {"__type": self.code, "message": self.message, **self.extra}


class ConditionFailed(StoreError):
    def __init__(self, old: dict | None) -> None:
        super().__init__(_DYNAMODB + "ConditionalCheckFailedException", "The conditional request failed",
                         {"Item": old} if old is not None else None)


class TransactionCanceled(StoreError):
    def __init__(self, reasons: list[str]) -> None:
        super().__init__(_DYNAMODB + "TransactionCanceledException",
                         f"Transaction cancelled, please refer cancellation reasons for specific reasons [{', '.join(reasons)}]",
                         {"CancellationReasons": [{"Code": r} if r == "None" else {"Code": r, "Message": "The conditional request failed"}
                                                  for r in reasons]})


# -- expressions ------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(<>|<=|>=|[=<>(),.+\-\[\]])|([#:]?[A-Za-z_][A-Za-z0-9_]*)|(\d+))")
_KEYWORDS = {"AND", "OR", "NOT", "SET", "REMOVE", "ADD", "DELETE"}


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise StoreError(_DYNAMODB + "ValidationException", f"Invalid expression near {text[pos:pos + 20]!r}")
        out.append(match.group(1) or match.group(2) or match.group(3))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens, self.at = _tokens(text), 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token.upper() != expected):
            raise StoreError(_DYNAMODB + "ValidationException", f"expected {expected or 'a token'}, found {token!r}")
        self.at += 1
        return token

    def path(self) -> tuple[str, ...]:
        parts = [self.take()]
        while self.peek() == ".":
            self.take()
            parts.append(self.take())
        return tuple(parts)

    # conditions: or → and → not → comparison
    def condition(self) -> Callable:
        left = self.conjunction()
        while (self.peek() or "").upper() == "OR":
            self.take()
            left = (lambda a, b: lambda item, ns, vs: a(item, ns, vs) or b(item, ns, vs))(left, self.conjunction())
        return left

    def conjunction(self) -> Callable:
        left = self.negation()
        while (self.peek() or "").upper() == "AND":
            self.take()
            left = (lambda a, b: lambda item, ns, vs: a(item, ns, vs) and b(item, ns, vs))(left, self.negation())
        return left

    def negation(self) -> Callable:
        if (self.peek() or "").upper() == "NOT":
            self.take()
            inner = self.negation()
            return lambda item, ns, vs: not inner(item, ns, vs)
        return self.comparison()

    def comparison(self) -> Callable:
        if self.peek() == "(":
            self.take()
            inner = self.condition()
            self.take(")")
            return inner
        name = self.peek() or ""
        if name in ("attribute_exists", "attribute_not_exists"):
            self.take()
            self.take("(")
            path = self.path()
            self.take(")")
            exists = name == "attribute_exists"
            return lambda item, ns, vs: (_get(item, path, ns) is not None) == exists
        left = self.operand()
        op = self.take()
        if op not in ("=", "<>", "<", "<=", ">", ">="):
            raise StoreError(_DYNAMODB + "ValidationException", f"unsupported comparison {op!r}")
        right = self.operand()
        return lambda item, ns, vs: _compare(left(item, ns, vs), op, right(item, ns, vs))

    def operand(self) -> Callable:
        token = self.peek() or ""
        if token == "size":
            self.take()
            self.take("(")
            path = self.path()
            self.take(")")
            return lambda item, ns, vs: _size(_get(item, path, ns))
        if token.startswith(":"):
            self.take()
            return lambda item, ns, vs: vs[token]
        path = self.path()
        return lambda item, ns, vs: _get(item, path, ns)

    # updates: SET a = v, b = c - :d REMOVE e, f ADD g :n DELETE h :set
    def update(self) -> list[tuple[str, tuple[str, ...], Callable | None]]:
        actions: list[tuple[str, tuple[str, ...], Callable | None]] = []
        while self.peek() is not None:
            clause = self.take().upper()
            if clause not in ("SET", "REMOVE", "ADD", "DELETE"):
                raise StoreError(_DYNAMODB + "ValidationException", f"unsupported update clause {clause!r}")
            while True:
                path = self.path()
                if clause in ("ADD", "DELETE"):  # top-level attributes only, as in DynamoDB
                    if len(path) != 1:
                        raise StoreError(_DYNAMODB + "ValidationException", f"{clause} takes a top-level attribute")
                    actions.append((clause, path, self.operand()))
                elif clause == "SET":
                    self.take("=")
                    value = self.operand()
                    if self.peek() in ("+", "-"):
                        sign = self.take()
                        value = (lambda a, b, s: lambda item, ns, vs: _arith(a(item, ns, vs), s, b(item, ns, vs)))(
                            value, self.operand(), sign)
                    actions.append(("SET", path, value))
                else:
                    actions.append(("REMOVE", path, None))
                if self.peek() != ",":
                    break
                self.take(",")
        return actions


@lru_cache(maxsize=512)
def condition(text: str) -> Callable[[dict | None, dict, dict], bool]:
    """A condition expression, parsed once: call it with (item, names, values)."""
    parser = _Parser(text)
    test = parser.condition()
    if parser.peek() is not None:
        raise StoreError(_DYNAMODB + "ValidationException", f"unexpected {parser.peek()!r} in condition")
    return lambda item, names, values: bool(test(item or {}, names, values))


@lru_cache(maxsize=512)
def update(text: str) -> list[tuple[str, tuple[str, ...], Callable | None]]:
    """An update expression, parsed once: its actions (SET path value | REMOVE path)."""
    return _Parser(text).update()


@lru_cache(maxsize=128)
def projection(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(","))


def _name(part: str, names: dict) -> str:
    return names[part] if part.startswith("#") else part


def _get(item: dict, path: tuple[str, ...], names: dict) -> dict | None:
    value: Any = {"M": item}
    for part in path:
        inner = value.get("M") if isinstance(value, dict) else None
        if inner is None:
            return None
        value = inner.get(_name(part, names))
        if value is None:
            return None
    return value


def _size(value: dict | None) -> dict | None:
    if value is None:
        return None
    (kind, inner), = value.items()
    return {"N": str(len(inner))} if kind in ("S", "B", "M", "L", "SS", "NS", "BS") else None


def _compare(left: dict | None, op: str, right: dict | None) -> bool:
    if left is None or right is None:
        return op == "<>" and (left is None) != (right is None)
    (lkind, lval), = left.items()
    (rkind, rval), = right.items()
    if lkind != rkind:
        return op == "<>"
    if lkind == "N":
        lval, rval = Decimal(lval), Decimal(rval)
    if op == "=":
        return lval == rval
    if op == "<>":
        return lval != rval
    if lkind not in ("N", "S"):
        return False
    return {"<": lval < rval, "<=": lval <= rval, ">": lval > rval, ">=": lval >= rval}[op]


def _number_text(value: Decimal) -> str:
    return "0" if value == 0 else format(value.normalize(), "f")


def _arith(left: dict | None, sign: str, right: dict | None) -> dict:
    if left is None or right is None or "N" not in left or "N" not in right:
        raise StoreError(_DYNAMODB + "ValidationException", "An operand in the update expression has an incorrect data type")
    a, b = Decimal(left["N"]), Decimal(right["N"])
    return {"N": _number_text(a + b if sign == "+" else a - b)}


def _add_or_delete(action: str, current: dict | None, operand: dict) -> dict | None:
    """ADD a number or set members, DELETE set members (a set left empty is removed)."""
    (kind, members), = operand.items()
    if kind == "N" and action == "ADD":
        return {"N": _number_text(Decimal(current["N"]) + Decimal(members))} if current else operand
    if kind not in ("SS", "NS", "BS") or (current is not None and kind not in current):
        raise StoreError(_DYNAMODB + "ValidationException", "An operand in the update expression has an incorrect data type")
    had = set(current[kind]) if current else set()
    kept = had | set(members) if action == "ADD" else had - set(members)
    return {kind: sorted(kept)} if kept else None


def _with(container: dict, path: tuple[str, ...], names: dict, value: dict | None) -> dict:
    """`container` (an item's attribute map) with `path` set to `value` (None removes it); the maps
    along the path are copied, never changed in place, so an item read before stays as it was."""
    key = _name(path[0], names)
    out = dict(container)
    if len(path) == 1:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
        return out
    inner = container.get(key)
    if inner is None or "M" not in inner:
        if value is None:
            return out
        raise StoreError(_DYNAMODB + "ValidationException", "The document path provided in the update expression is invalid for update")
    out[key] = {"M": _with(inner["M"], path[1:], names, value)}
    return out


# -- what DynamoDB would bill -----------------------------------------------------------------

def value_size(value: dict) -> int:
    """Bytes of one attribute value as DynamoDB sizes items (numbers: about one byte per two digits)."""
    (kind, inner), = value.items()
    if kind in ("S", "B"):
        return len(inner.encode()) if kind == "S" else len(inner)
    if kind == "N":
        digits = len(inner.lstrip("-").replace(".", "").lstrip("0")) or 1
        return (digits + 1) // 2 + 1
    if kind in ("BOOL", "NULL"):
        return 1
    if kind == "M":
        return 3 + sum(len(k.encode()) + value_size(v) + 1 for k, v in inner.items())
    if kind == "L":
        return 3 + sum(value_size(v) + 1 for v in inner)
    return sum(len(str(v)) for v in inner)  # sets


def item_size(item: dict | None) -> int:
    return sum(len(name.encode()) + value_size(value) for name, value in (item or {}).items())


def write_units(old: dict | None, new: dict | None, *, transactional: bool = False) -> int:
    """Write request units of one write: 1 per KB of the larger of the item before and after (at
    least 1), twice that in a transaction."""
    units = max(1, math.ceil(max(item_size(old), item_size(new)) / 1024))
    return units * (2 if transactional else 1)


def read_units(item: dict | None, *, consistent: bool) -> float:
    """Read request units of one GetItem: 1 per 4 KB of the whole item (a projection is not cheaper),
    at least 1; half for an eventually consistent read."""
    units = max(1, math.ceil(item_size(item) / 4096))
    return units if consistent else units / 2


# -- the store -------------------------------------------------------------------------------

class Store:
    """Tables (key attribute names, items by key) and SSM parameters, in memory."""

    def __init__(self, tables: dict[str, list[str]], parameters: dict[str, dict] | None = None) -> None:
        self.keys = dict(tables)
        self.items: dict[str, dict[tuple, dict]] = {name: {} for name in tables}
        self.parameters = dict(parameters or {})
        self.tokens: dict[str, tuple[str, float]] = {}  # ClientRequestToken → (payload digest, when)
        self.write_units = 0.0  # what DynamoDB on demand would bill for what was served
        self.read_units = 0.0

    def _table(self, name: str) -> dict[tuple, dict]:
        if name not in self.items:
            raise StoreError(_DYNAMODB + "ResourceNotFoundException", f"Requested resource not found: Table: {name} not found")
        return self.items[name]

    def _key(self, table: str, key: dict) -> tuple:
        return tuple(json.dumps(key.get(name), sort_keys=True) for name in self.keys[table])

    def put_seed(self, table: str, item: dict) -> None:
        self._table(table)[self._key(table, item)] = item

    # each operation: its payload in, its answer out (or StoreError)
    def handle(self, target: str, payload: dict) -> dict:
        service, _, operation = target.partition(".")
        method = getattr(self, f"_{'ssm' if service == 'AmazonSSM' else 'ddb'}_{operation}", None)
        if method is None:
            raise StoreError("UnknownOperationException", f"the stand-in does not answer {target}")
        return method(payload)

    def _ddb_GetItem(self, p: dict) -> dict:
        item = self._table(p["TableName"]).get(self._key(p["TableName"], p["Key"]))
        self.read_units += read_units(item, consistent=bool(p.get("ConsistentRead")))
        if item is None:
            return {}
        if p.get("ProjectionExpression"):
            names = p.get("ExpressionAttributeNames") or {}
            wanted = [_name(part, names) for part in projection(p["ProjectionExpression"])]
            item = {k: item[k] for k in wanted if k in item}
        return {"Item": item}

    def _check(self, p: dict, old: dict | None) -> None:
        if p.get("ConditionExpression") and not condition(p["ConditionExpression"])(
                old, p.get("ExpressionAttributeNames") or {}, p.get("ExpressionAttributeValues") or {}):
            raise ConditionFailed(old if p.get("ReturnValuesOnConditionCheckFailure") == "ALL_OLD" else None)

    def _updated(self, p: dict, old: dict | None) -> dict:
        names, values = p.get("ExpressionAttributeNames") or {}, p.get("ExpressionAttributeValues") or {}
        item = dict(old) if old is not None else dict(p["Key"])
        for action, path, value in update(p["UpdateExpression"]):
            if action in ("ADD", "DELETE"):
                item = _with(item, path, names, _add_or_delete(action, _get(item, path, names), value(item, names, values)))
            else:
                item = _with(item, path, names, value(item, names, values) if action == "SET" else None)
        return item

    @staticmethod
    def _returned(p: dict, old: dict | None, new: dict | None) -> dict:
        wanted = p.get("ReturnValues", "NONE")
        if wanted == "ALL_OLD" and old is not None:
            return {"Attributes": old}
        if wanted == "ALL_NEW" and new is not None:
            return {"Attributes": new}
        return {}

    def _ddb_PutItem(self, p: dict) -> dict:
        table = self._table(p["TableName"])
        key = self._key(p["TableName"], p["Item"])
        old = table.get(key)
        self.write_units += write_units(old, p["Item"])
        self._check(p, old)
        table[key] = p["Item"]
        return self._returned(p, old, None)

    def _ddb_UpdateItem(self, p: dict) -> dict:
        table = self._table(p["TableName"])
        key = self._key(p["TableName"], p["Key"])
        old = table.get(key)
        self.write_units += write_units(old, None)  # a refused write is billed too
        self._check(p, old)
        new = table[key] = self._updated(p, old)
        self.write_units += write_units(old, new) - write_units(old, None)
        return self._returned(p, old, new)

    def _ddb_DeleteItem(self, p: dict) -> dict:
        table = self._table(p["TableName"])
        key = self._key(p["TableName"], p["Key"])
        old = table.get(key)
        self.write_units += write_units(old, None)
        self._check(p, old)
        table.pop(key, None)
        return self._returned(p, old, None)

    def _ddb_TransactWriteItems(self, p: dict) -> dict:
        token = p.get("ClientRequestToken")
        if token:
            digest = hashlib.sha256(json.dumps(p["TransactItems"], sort_keys=True).encode()).hexdigest()
            now = time.monotonic()
            seen = self.tokens.get(token)
            if seen is not None and now - seen[1] < 600:
                if seen[0] != digest:
                    raise StoreError(_DYNAMODB + "IdempotentParameterMismatchException",
                                     "The request uses the same client token as a previous, but non-identical request.")
                return {}
        # every condition first, on the items as they are; then every write
        plans, reasons = [], []
        for entry in p["TransactItems"]:
            (kind, op), = entry.items()
            table = self._table(op["TableName"])
            key = self._key(op["TableName"], op.get("Key") or op.get("Item"))
            old = table.get(key)
            try:
                self._check(op, old)
                reasons.append("None")
            except ConditionFailed:
                reasons.append("ConditionalCheckFailed")
            plans.append((kind, op, table, key, old))
        if any(r != "None" for r in reasons):
            self.write_units += sum(write_units(old, None, transactional=True) for *_, old in plans)
            raise TransactionCanceled(reasons)
        for kind, op, table, key, old in plans:
            if kind == "Put":
                new = table[key] = op["Item"]
            elif kind == "Update":
                new = table[key] = self._updated(op, old)
            else:
                new = None
                table.pop(key, None)
            self.write_units += write_units(old, new, transactional=True)
        if token:
            self.tokens[token] = (digest, now)
            if len(self.tokens) > 50_000:
                for stale in [t for t, (_, when) in self.tokens.items() if now - when >= 600]:
                    del self.tokens[stale]
        return {}

    def _ssm_GetParameter(self, p: dict) -> dict:
        found = self.parameters.get(p["Name"])
        if found is None:
            raise StoreError("ParameterNotFound", f"Parameter {p['Name']} not found.")
        return {"Parameter": found}


def seed_from(dynamodb: Any, ssm: Any) -> dict[str, Any]:
    """Every table's key schema and items, and every SSM parameter, read from an AWS (boto3 clients)."""
    tables: dict[str, Any] = {}
    for name in dynamodb.list_tables()["TableNames"]:
        schema = dynamodb.describe_table(TableName=name)["Table"]["KeySchema"]
        keys = [k["AttributeName"] for k in sorted(schema, key=lambda k: k["KeyType"] != "HASH")]
        items, start = [], None
        while True:
            page = dynamodb.scan(TableName=name, **({"ExclusiveStartKey": start} if start else {}))
            items += page["Items"]
            start = page.get("LastEvaluatedKey")
            if not start:
                break
        tables[name] = {"keys": keys, "items": items}
    parameters: dict[str, Any] = {}
    for page in ssm.get_paginator("get_parameters_by_path").paginate(Path="/", Recursive=True, WithDecryption=True):
        for parameter in page["Parameters"]:
            parameters[parameter["Name"]] = {"Name": parameter["Name"], "Type": parameter["Type"],
                                             "Value": parameter["Value"], "Version": parameter.get("Version", 1),
                                             "DataType": parameter.get("DataType", "text")}
    return {"tables": tables, "parameters": parameters}


def store_from_seed(seed: dict[str, Any]) -> Store:
    store = Store({name: t["keys"] for name, t in seed["tables"].items()}, seed.get("parameters"))
    for name, table in seed["tables"].items():
        for item in table["items"]:
            store.put_seed(name, item)
    return store


# -- the server --------------------------------------------------------------------------------

def app_for(store: Store, service_s: float) -> Callable:
    """The ASGI app: POST / with X-Amz-Target; GET /__standin/stats says what it served."""
    stats = {"calls": 0, "errors": 0, "by_operation": {}, "waited_s": 0.0, "in_flight_max": 0}
    in_flight = [0]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            body = json.dumps({**stats, "service_ms": service_s * 1000,
                               "waited_ms_mean": round(stats["waited_s"] * 1000 / stats["calls"], 3) if stats["calls"] else None}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        request_body = await read_body(receive)
        target = next((v.decode() for k, v in scope["headers"] if k == b"x-amz-target"), "")
        started = time.perf_counter()
        in_flight[0] += 1
        stats["in_flight_max"] = max(stats["in_flight_max"], in_flight[0])
        try:
            status, answer = 200, store.handle(target, json.loads(request_body or b"{}"))
        except StoreError as exc:
            status, answer = 400, exc.body()
            stats["errors"] += 1
        except (KeyError, ValueError, TypeError) as exc:
            status, answer = 400, {"__type": _DYNAMODB + "ValidationException", "message": f"{type(exc).__name__}: {exc}"}
            stats["errors"] += 1
        stats["calls"] += 1
        stats["write_units"], stats["read_units"] = store.write_units, store.read_units
        stats["by_operation"][target] = stats["by_operation"].get(target, 0) + 1
        # the service time: the answer leaves service_s after the request arrived
        # (epoll waits in whole milliseconds, rounded up: asking 0.5 ms less lands closer to service_s)
        left = service_s - (time.perf_counter() - started) - 0.0005
        if left > 0:
            await asyncio.sleep(left)
        in_flight[0] -= 1
        stats["waited_s"] += time.perf_counter() - started
        payload = json.dumps(answer, separators=(",", ":")).encode()
        content_type = b"application/x-amz-json-1.1" if target.startswith("AmazonSSM") else b"application/x-amz-json-1.0"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type), (b"x-amzn-requestid", b"standin")]})
        await send({"type": "http.response.body", "body": payload})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service-ms", type=float, default=4.0)
    parser.add_argument("--seed", required=True, help="JSON written by seed_from")
    args = parser.parse_args(argv)
    import uvicorn

    with open(args.seed) as f:
        store = store_from_seed(json.load(f))
    # asyncio's own loop: its timers take fractions of a millisecond (the service time is short)
    uvicorn.run(app_for(store, args.service_ms / 1000), host=args.host, port=args.port, loop="asyncio",
                http="httptools", log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=75)


if __name__ == "__main__":
    main()
