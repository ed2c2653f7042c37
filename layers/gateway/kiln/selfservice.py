"""An org manages itself (contract §10): its balance, its key, its usage, and its keys.

`GET /v1/credits`, `GET /v1/key` and `GET /v1/usage` answer any key of the org; the
`/v1/keys` routes only a management key (403 `management_key_required` otherwise). None
of them takes a slot or writes a usage event. Maintenance (§6) and authentication come
first, as on every endpoint; a body, where there is one, is read between them (§2).
Keys are managed by `kiln.store.keyring`, the implementation `kiln admin keys` uses too,
and usage is summed by `kiln.usage_report`, as `kiln admin usage` sums it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from .auth import Principal, bearer_token
from .errors import (
    GatewayError,
    InvalidJson,
    InvalidType,
    InvalidValue,
    KeyNotFound,
    KeyRevoked,
    ManagementKeyRequired,
    UnknownParameter,
    shortened,
)
from .gateway import Gateway
from .handlers import checks, credential, get_gateway, read_json
from .isotime import from_iso
from .jsonio import dumps
from .observability import RequestRecord, record_of
from .responses import error_response, json_response
from .store.errors import AlreadyRevoked, RecordNotFound
from .store.keyring import InvalidKeyAttribute, Keyring, key_object
from .store.keys import hash_secret
from .store.usage import org_events
from .usage_report import COLUMNS, Summary, in_span, stored_time

__all__ = ["HANDLERS", "MAX_USAGE_DAYS", "USAGE_DEFAULT_DAYS", "USAGE_GROUPINGS", "parse_rfc3339", "usage_span"]

MAX_USAGE_DAYS = 93
USAGE_DEFAULT_DAYS = 30
USAGE_GROUPINGS = ("day", "model", "key")
MANAGEMENT_REQUIRED = ("Managing keys needs a management key (role `management`); this is an inference key. "
                       "Ask your organization for one.")

# a key attribute's error, by InvalidKeyAttribute.code
_ATTRIBUTE_ERRORS: dict[str, type[GatewayError]] = {
    "invalid_value": InvalidValue, "invalid_type": InvalidType, "unknown_parameter": UnknownParameter}


def _keyring(gateway: Gateway) -> Keyring:
    settings = gateway.settings
    return Keyring(gateway.aws, keys_table=settings.keys_table, orgs_table=settings.orgs_table,
                   usage_table=settings.usage_table, clock=gateway.clock)


async def _checks(gateway: Gateway, request: Request, record: RequestRecord, *, body: bool = False,
                  management: bool = False) -> tuple[Principal, Any]:
    """Checks 1-3 of §2 (maintenance, the body if any, the key), then the key's role."""
    limit = gateway.settings.max_body_bytes
    principal, document, _ = await checks(gateway, request, read_body=(lambda raw: _read_body(raw, limit)) if body else None)
    record.org_id = principal.org_id
    if management and not principal.management:
        raise ManagementKeyRequired(MANAGEMENT_REQUIRED)
    return principal, document


class _Kept:
    """The request as read_json reads it (its headers, its body's chunks), keeping the raw body."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self.headers = request.headers
        self.raw = bytearray()

    async def stream(self) -> AsyncIterator[bytes]:
        async for chunk in self._request.stream():
            self.raw += chunk
            yield chunk


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise _DuplicateName(name)
        seen[name] = value
    return seen


class _DuplicateName(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


async def _read_body(request: Request, limit: int) -> Any:
    """The body as read_json accepts it, its fractional numbers as Decimals, and 400
    invalid_json if an object in it names a member twice: JSON parsers keep the first or the
    last, so the key made would depend on who read it."""
    kept = _Kept(request)
    document = await read_json(kept, limit)  # type: ignore[arg-type]
    try:
        # read again, numbers with a fraction or exponent as Decimals: an amount is kept exactly (§10)
        return json.loads(bytes(kept.raw), object_pairs_hook=_unique_names, parse_float=Decimal)
    except _DuplicateName as duplicate:
        raise InvalidJson(f"The request body names {json.dumps(shortened(duplicate.name))} more than once; give each attribute "
                          f"once.") from None
    except ArithmeticError:
        # a number a float reads (as 0 or ∞: read_json took it) but whose exponent no Decimal holds
        raise InvalidJson("The request body holds a number whose exponent is too large to read; write "
                          "amounts as plain decimals.") from None
    except ValueError:  # read_json accepted the body: nothing else can fail here
        pass
    return document


def _served(endpoint: str, work: Callable[[Gateway, Request, RequestRecord], Awaitable[Response]]):
    """A handler: `work` answers; a GatewayError becomes its error response (and is recorded)."""

    async def handle(request: Request) -> Response:
        gateway = get_gateway(request)
        record = record_of(request)
        record.endpoint = endpoint
        try:
            return await work(gateway, request, record)
        except GatewayError as error:
            record.error_code = error.code
            return error_response(error)

    handle.__name__ = handle.__qualname__ = endpoint.replace(".", "_")
    return handle


async def _answer(call: Awaitable[Any], key_id: str | None = None) -> Any:
    """A keyring call with its domain errors as the API's (inside `Gateway.storage`, which
    makes every other failure a 503): a bad attribute is 400, a key of no concern 404, a
    change of a revoked key 409."""
    try:
        return await call
    except InvalidKeyAttribute as error:
        raise _ATTRIBUTE_ERRORS[error.code](str(error), param=error.param) from None
    except RecordNotFound as error:
        if error.kind == "org":
            raise  # the caller's own org gone: Gateway.storage answers it
        raise KeyNotFound(key_id if key_id is not None else error.ident) from None
    except AlreadyRevoked as error:  # a change of a revoked key (a revoke again answers the key as it is)
        raise KeyRevoked(error.key_id, error.since) from None


# -- any key of the org -------------------------------------------------------------------------


async def _credits(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, _ = await _checks(gateway, request, record)
    org = await gateway.storage(_keyring(gateway).org(principal.org_id))
    return json_response(dumps({"object": "credits", "balance": org.credits, "currency": "USD"}))


async def _current_key(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, _ = await _checks(gateway, request, record)
    keyring = _keyring(gateway)
    # the caller's own secret names its item: a consistent read, not the eventually consistent index
    key = await gateway.storage(keyring.by_hash(hash_secret(_secret(request))))
    if key is None or key.key_id != principal.key_id:
        key = await gateway.storage(keyring.get(principal.key_id, org_id=principal.org_id))
    (shown,) = await gateway.storage(keyring.describe(principal.org_id, [key]))
    return json_response(dumps(shown))


def _secret(request: Request) -> str:
    return bearer_token(credential(request)) or ""  # authentication accepted it


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)")


def parse_rfc3339(text: str) -> datetime | None:
    """An RFC 3339 full-date (midnight UTC) or date-time with its offset; None if it is neither.
    A leap second (seconds 60, which RFC 3339 allows at 23:59:60 in UTC and no datetime holds)
    is read as the next second begins: the moment a clock that does not count leap seconds
    shows after it. OverflowError for one that is RFC 3339 and no time of the years 1 to 9999."""
    if not (_DATE.fullmatch(text) or _DATE_TIME.fullmatch(text)):
        return None
    leap = len(text) > 19 and text[17:19] == "60"
    if leap:
        text = text[:17] + "59" + text[19:]
    try:
        moment = from_iso(text.replace("z", "Z").replace("t", "T"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    if leap:
        in_utc = moment.astimezone(timezone.utc)
        if (in_utc.hour, in_utc.minute, in_utc.second) != (23, 59, 59):
            return None  # a leap second is the last of a UTC day, or none
        moment += timedelta(seconds=1)
    return moment


def _each_once(query: Any, *names: str) -> None:
    """400 for a query parameter given twice: a proxy that reads the first of two would see
    another request than the one answered."""
    for name in names:
        if len(query.getlist(name)) > 1:
            raise InvalidValue(f"{name} may be given once.", param=name)


def usage_span(query: Any, now: datetime) -> tuple[datetime, datetime, str]:
    """`since`, `until` and `group_by` of a usage request, with their defaults: until now, since
    30 days before `until`, by day. The span is half-open and at most 93 days long; its ends are
    read to the millisecond, as events store time. Each parameter may be given once."""
    _each_once(query, "since", "until", "group_by")
    moments: dict[str, datetime | None] = {}
    for name in ("since", "until"):
        text = query.get(name)
        moments[name] = None
        if text is not None:
            try:  # the span is read in UTC: an offset may carry a time out of the years 1-9999
                moment = parse_rfc3339(text)
                if moment is None:
                    raise InvalidValue(f"{name} must be an RFC 3339 date (2026-11-01) or date-time "
                                       f"(2026-11-01T00:00:00Z); got {text[:40]!r}.", param=name)
                moment = moment.astimezone(timezone.utc)
            except OverflowError:
                raise InvalidValue(f"{name} is out of range: {text[:40]!r} is not a time of the years 1 to 9999 "
                                   f"in UTC.", param=name) from None
            moments[name] = moment.replace(microsecond=moment.microsecond // 1000 * 1000)
    until = moments["until"] or now
    try:
        since = moments["since"] or until - timedelta(days=USAGE_DEFAULT_DAYS)
    except OverflowError:  # an until in the first days of year 1
        raise InvalidValue("until is too early.", param="until") from None
    if since >= until:
        raise InvalidValue("since must be before until.", param="since")
    if until - since > timedelta(days=MAX_USAGE_DAYS):  # named as sent: since alone, until now, is too early
        raise InvalidValue(f"since and until may be at most {MAX_USAGE_DAYS} days apart.",
                           param="until" if moments["until"] is not None else "since")
    group_by = query.get("group_by", "day")
    if group_by not in USAGE_GROUPINGS:
        raise InvalidValue(f"group_by must be one of {', '.join(USAGE_GROUPINGS)}.", param="group_by")
    return since, until, group_by


async def _usage(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, _ = await _checks(gateway, request, record)
    now = datetime.fromtimestamp(gateway.clock(), timezone.utc)
    since, until, group_by = usage_span(request.query_params, now)
    first, end = stored_time(since), stored_time(until)

    async def read() -> Summary:
        summary = Summary(group_by)
        async for event in org_events(gateway.aws, gateway.settings.usage_table, principal.org_id, first, end):
            if in_span(event, end):
                summary.add(event)
        return summary

    summary = await gateway.storage(read())
    rows = [{group_by: row["group"], **{column: row[column] for column in COLUMNS}} for row in summary.rows()]
    total = {column: getattr(summary.total, column) for column in COLUMNS}
    document = {"object": "usage", "since": first, "until": end, "group_by": group_by, "currency": "USD",
                "data": rows, "total": total}
    return json_response(dumps(document))


# -- management keys: /v1/keys ----------------------------------------------------------------


async def _known_models(gateway: Gateway, attributes: dict[str, Any]) -> set[str] | None:
    """The catalog's ids, when the request names models (the catalog is read only then)."""
    if attributes.get("models") is None:
        return None
    return {model.id for model in await gateway.catalog()}


async def _create(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, body = await _checks(gateway, request, record, body=True, management=True)
    keyring = _keyring(gateway)
    known = await _known_models(gateway, body)
    issued = await gateway.storage(_answer(keyring.create(principal.org_id, body, known_models=known)))
    gateway.auth.used(principal)
    # a new key has spent nothing: no read of its events
    document = {**key_object(issued, {}, keyring.clock(), spend=Decimal(0)), "secret": issued.secret}
    return json_response(dumps(document), status=201)


# a page of keys: 100 of the largest a catalog allows (every model in the allowlist) is under a
# megabyte, far inside the 6 MB a buffered Lambda function may answer
MAX_KEYS_PAGE = 100


def keys_page(query: Any) -> tuple[int, str | None]:
    """`limit` (1 to 100, default 100) and `after` (the id of the last key of the page before),
    as OpenAI's list endpoints take them."""
    _each_once(query, "limit", "after")
    text = query.get("limit")
    limit = MAX_KEYS_PAGE
    if text is not None:
        limit = int(text) if text.isascii() and text.isdigit() and len(text) <= 4 else 0
        if not 1 <= limit <= MAX_KEYS_PAGE:
            raise InvalidValue(f"limit must be an integer from 1 to {MAX_KEYS_PAGE}; got {shortened(text)!r}.",
                               param="limit")
    return limit, query.get("after")


async def _list(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    """The org's keys, oldest first, a page at a time (`has_more`: ask again `after` the last id)."""
    principal, _ = await _checks(gateway, request, record, management=True)
    limit, after = keys_page(request.query_params)
    keyring = _keyring(gateway)
    keys = sorted(await gateway.storage(keyring.list(principal.org_id)), key=_listed_order)
    if after is not None:
        # the cursor is read by its id, not looked for in the list: the list comes through an
        # index that may not hold yet a key another environment made a moment ago
        cursor = await gateway.storage(_key_or_none(keyring, after, principal.org_id))
        if cursor is None:  # an unknown id and another org's are told alike
            raise InvalidValue(f"after names no key of this organization: {shortened(after)!r}.", param="after")
        keys = [key for key in keys if _listed_order(key) > _listed_order(cursor)]
    page = keys[:limit]
    shown = await gateway.storage(keyring.describe(principal.org_id, page))
    return json_response(dumps({"object": "list", "data": shown, "first_id": page[0].key_id if page else None,
                                "last_id": page[-1].key_id if page else None, "has_more": len(keys) > limit}))


def _listed_order(key: Any) -> tuple[str, str]:
    return key.created_at, key.key_id


async def _key_or_none(keyring: Keyring, key_id: str, org_id: str) -> Any:
    try:
        return await keyring.get(key_id, org_id=org_id)
    except RecordNotFound:
        return None


async def _one(gateway: Gateway, principal: Principal, key_id: str, action: Awaitable[Any]) -> Response:
    """Run a keyring call on one key of the caller's org; any other id is 404 key_not_found."""
    keyring = _keyring(gateway)
    key = await gateway.storage(_answer(action, key_id))
    (shown,) = await gateway.storage(keyring.describe(principal.org_id, [key]))
    return json_response(dumps(shown))


async def _retrieve(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, _ = await _checks(gateway, request, record, management=True)
    key_id = request.path_params["key_id"]
    return await _one(gateway, principal, key_id, _keyring(gateway).get(key_id, org_id=principal.org_id))


async def _update(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, body = await _checks(gateway, request, record, body=True, management=True)
    key_id = request.path_params["key_id"]

    async def update() -> Any:
        known = await _known_models(gateway, body)
        return await _keyring(gateway).update(key_id, body, org_id=principal.org_id, known_models=known)

    try:
        answer = await _one(gateway, principal, key_id, update())
    finally:  # this process applies the change at once, others within the cache time; also one cut short
        gateway.auth.forget_key(key_id)
    gateway.auth.used(principal)
    return answer


async def _revoke(gateway: Gateway, request: Request, record: RequestRecord) -> Response:
    principal, _ = await _checks(gateway, request, record, management=True)
    key_id = request.path_params["key_id"]
    keyring = _keyring(gateway)

    async def revoke() -> Any:
        try:
            return await keyring.revoke(key_id, org_id=principal.org_id)
        except AlreadyRevoked:  # revoking is idempotent: the key as it is
            return await keyring.get(key_id, org_id=principal.org_id)

    try:
        answer = await _one(gateway, principal, key_id, revoke())
    finally:
        gateway.auth.forget_key(key_id)
    gateway.auth.used(principal)
    return answer


# the handlers by route name (kiln.endpoints), bound by kiln.web
HANDLERS: dict[str, Callable[[Request], Awaitable[Response]]] = {
    "credits.retrieve": _served("credits", _credits),
    "key.retrieve": _served("key", _current_key),
    "usage.retrieve": _served("usage", _usage),
    "keys.create": _served("keys", _create),
    "keys.list": _served("keys", _list),
    "keys.retrieve": _served("keys", _retrieve),
    "keys.update": _served("keys", _update),
    "keys.delete": _served("keys", _revoke),
}
