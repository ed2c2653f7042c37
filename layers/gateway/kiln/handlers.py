"""The endpoints, each the contract's order of checks (§2) over the layer's services."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .apis import ModelApi
from .auth import Principal
from .catalog import Catalog
from .errors import (
    GatewayError,
    GenerationNotFound,
    InvalidJson,
    ManagementKeyForbidden,
    ModelNotFound,
    RequestTooLarge,
)
from .exchange import Exchange
from .gateway import Gateway
from .jsonio import dumps, loads_strict
from .lambda_payload import LAMBDA_PAYLOAD_BYTES, answer_limit, event_too_large
from .normalize import normalize
from .observability import RequestRecord, record_of
from .responses import error_response, json_response

__all__ = ["checks", "complete", "get_gateway", "list_models", "retrieve_generation", "retrieve_model"]


MANAGEMENT_KEY_ON_A_MODEL = (
    "This is a management key: it manages your organization's keys (/v1/keys) and cannot call models. "
    "Use an inference key."
)

# what new_generation_id makes; anything else cannot exist
GENERATION_ID = re.compile(r"gen-[0-9a-f]{26}")


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def complete(request: Request, api: ModelApi) -> Response:
    """POST to a model endpoint (chat and text completions, responses)."""
    gateway = get_gateway(request)
    record = record_of(request)
    record.endpoint = api.name
    try:
        # 1, 2, 3 (and the catalog 4 needs)
        principal, body, catalog = await checks(gateway, request, read_body=_model_call_body, catalog=True,
                                                catalog_failure_later=True)
        record.org_id = principal.org_id
        if principal.management:
            raise ManagementKeyForbidden(MANAGEMENT_KEY_ON_A_MODEL)
        call = normalize(api, body, catalog, principal.may_use)  # 4
        record.model = call.model.id
        gateway.auth.used(principal)  # admission writes, admitted or refused: the key's use is recorded
        lease = await gateway.storage(  # 5
            gateway.ledger.admit(
                org_id=principal.org_id,
                key_id=principal.key_id,
                model=call.model.id,
                endpoint=api.name,
                streamed=call.stream,
                limits=principal.limits,
            )
        )
    except GatewayError as error:
        record.error_code = error.code
        return error_response(error)
    return await Exchange(gateway, principal, call, lease, record,
                          answer_limit=answer_limit(request.scope)).respond(request.receive)  # 6


def credential(request: Request) -> str | None:
    """The caller's Authorization header. Two of them are no key at all: which one a proxy
    meant to win cannot be known. A caller of a Function URL with IAM auth (deploy.md §2)
    signs its requests, its Authorization header the signature Lambda checked: its key is in
    X-Kiln-Authorization, read only then (a client's own Authorization always stands)."""
    credentials = request.headers.getlist(AUTHORIZATION)
    if len(credentials) == 1 and SIGV4.fullmatch(credentials[0]):
        credentials = request.headers.getlist(KILN_AUTHORIZATION)
    return credentials[0] if len(credentials) == 1 else None


# a SigV4 signature's Authorization header, and nothing else: two headers joined into one (a
# Function URL's, or a REST event's names of two cases) hold a second one after it
SIGV4 = re.compile(r"AWS4-HMAC-SHA256 Credential=[^\s,]+, ?SignedHeaders=[^\s,]+, ?Signature=[0-9a-f]{64}")
AUTHORIZATION, KILN_AUTHORIZATION = "authorization", "x-kiln-authorization"
KEY_HEADERS = frozenset({AUTHORIZATION, KILN_AUTHORIZATION})  # the headers `credential` reads


def _model_call_body(request: Request) -> Awaitable[object]:
    return read_json(request, get_gateway(request).settings.max_body_bytes)


async def checks(
    gateway: Gateway,
    request: Request,
    *,
    read_body: Callable[[Request], Awaitable[Any]] | None = None,
    catalog: bool = False,
    catalog_failure_later: bool = False,
) -> tuple[Principal, Any, Any]:
    """Checks 1 to 3 of §2: maintenance, the body (when `read_body` reads one), the key; and,
    with `catalog`, the catalog check 4 needs, answered in the contract's order. With
    `catalog_failure_later`, a catalog that could not be read is handed back as its error, for
    the checks of step 4 that come before the model's lookup to be answered first.

    The maintenance flag comes first and alone: while it is on, nothing else is read, not even
    the body. Then, with every cache warm (nearly every request), the others run one after
    the other with no I/O and no task; on a cold cache (a new execution environment, an entry
    that expired) the key's and the catalog's reads run at once, beside the body's upload, and
    a bad body is still answered before a bad key, a bad key before the catalog's state."""
    given = credential(request)
    await gateway.check_maintenance()
    if gateway.warm(given, catalog=catalog) or (read_body is None and not catalog):
        body = await read_body(request) if read_body is not None else None
        principal = await gateway.storage(gateway.auth.authenticate(given))
        return principal, body, (await gateway.catalog() if catalog else None)
    async def key() -> Principal:  # the key's read made in its task: a task stopped unstarted leaves none behind
        return await gateway.storage(gateway.auth.authenticate(given))

    reads = asyncio.gather(key(), *((gateway.catalog(),) if catalog else ()), return_exceptions=True)
    body: Any = None
    try:
        if read_body is not None:
            body = await read_body(request)
    except GatewayError as error:
        body = error  # answered before the key
    except BaseException:
        reads.cancel()
        reads.add_done_callback(_retrieved)  # its outcome is this exception's, already on its way
        raise
    principal, *rest = await reads
    models = rest[0] if catalog else None
    for outcome in (body, principal, models):
        if isinstance(outcome, BaseException) and not (
                outcome is models and catalog_failure_later and isinstance(outcome, GatewayError)):
            raise outcome
    return principal, body, models


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _reader_checks(gateway: Gateway, request: Request, record: RequestRecord, *,
                         catalog: bool = False) -> tuple[Principal, Catalog | None]:
    """Checks 1 and 3 of §2 for the endpoints that read (they have no body and admit nothing)."""
    principal, _, models = await checks(gateway, request, catalog=catalog)
    record.org_id = principal.org_id
    return principal, models


async def list_models(request: Request) -> Response:
    """GET /v1/models: the catalog with prices and capabilities."""
    gateway = get_gateway(request)
    record = record_of(request)
    record.endpoint = "models"
    try:
        principal, catalog = await _reader_checks(gateway, request, record, catalog=True)
    except GatewayError as error:
        record.error_code = error.code
        return error_response(error)
    models = [model.public() for model in catalog if principal.may_use(model.id)]  # the key's allowlist
    return json_response(dumps({"object": "list", "data": models}))


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model_id+} (the id may hold slashes)."""
    gateway = get_gateway(request)
    record = record_of(request)
    record.endpoint = "models"
    model_id = request.path_params["model_id"]
    try:
        principal, catalog = await _reader_checks(gateway, request, record, catalog=True)
        model = catalog.get(model_id)
        if model is None or not principal.may_use(model_id):
            raise ModelNotFound(model_id)
    except GatewayError as error:
        record.error_code = error.code
        return error_response(error)
    return json_response(dumps(model.public()))


async def retrieve_generation(request: Request) -> Response:
    """GET /v1/generations/{gen_id}: the caller's own usage event; anyone else's is 404."""
    gateway = get_gateway(request)
    record = record_of(request)
    record.endpoint = "generations"
    gen_id = request.path_params["gen_id"]
    try:
        principal, _ = await _reader_checks(gateway, request, record)
        event = None
        if GENERATION_ID.fullmatch(gen_id):
            event = await gateway.storage(gateway.store.event_of_org(gen_id, principal.org_id))
        if event is None:
            raise GenerationNotFound(gen_id)
    except GatewayError as error:
        record.error_code = error.code
        return error_response(error)
    return json_response(dumps(generation_object(event)))


def generation_object(event) -> dict:
    """A usage event as its org sees it (no backend names, no internal error detail)."""
    usage: dict = {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": None
        if event.prompt_tokens is None or event.completion_tokens is None
        else event.prompt_tokens + event.completion_tokens,
        "cost": event.cost,
    }
    if event.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": event.cached_tokens}
    return {
        "id": event.gen_id,
        "object": "generation",
        "created_at": event.created_at,
        "model": event.model,
        "endpoint": event.endpoint,
        "streamed": event.streamed,
        "status": event.status,
        "http_status": event.http_status,
        "finish_reason": event.finish_reason,
        "usage": usage,
        "usage_source": event.usage_source,
        "ttfb_ms": event.ttfb_ms,
        "duration_ms": event.duration_ms,
        "key_id": event.key_id,
    }


async def read_json(request: Request, limit: int) -> object:
    """The body as JSON: 413 beyond `limit` bytes (checked before reading when declared), 400 if not JSON."""
    declared = request.headers.get("content-length")
    # isascii: "²" is a digit to str.isdigit, not to int
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body exceeds the limit of {limit} bytes.")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"The request body exceeds the limit of {limit} bytes.")
            chunks.append(chunk)
    except ClientDisconnect:
        raise InvalidJson("The request body was not received completely.") from None
    raw = b"".join(chunks)
    if event_too_large(raw, request.headers.items()):
        # AWS would refuse it before any function ran (docs/design.md: what Lambda carries)
        raise RequestTooLarge(
            f"The request is too large for the gateway's functions: its body ({len(raw)} bytes), JSON-escaped "
            f"(each quote and backslash twice), and its headers exceed the {LAMBDA_PAYLOAD_BYTES} bytes a Lambda "
            "invocation carries. Send a smaller body.")
    if not raw.strip():
        raise InvalidJson("The request body is empty; send a JSON object.")
    try:
        body = loads_strict(raw)
    except ValueError as exc:
        raise InvalidJson(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidJson("The request body must be a JSON object.")
    return body
