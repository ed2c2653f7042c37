"""One error tree for everything the gateway answers with an error.

    GatewayError                      JSON body {"error": {message, type, param, code}}
    ├── InvalidJson                   400 invalid_json
    ├── RequestTooLarge               413 request_too_large
    ├── InvalidApiKey                 401 invalid_api_key
    ├── OrganizationDisabled          403 organization_disabled
    ├── ManagementKeyForbidden        403 management_key (a management key on a model endpoint)
    ├── ManagementKeyRequired         403 management_key_required (an inference key on /v1/keys)
    ├── MissingParameter              400 missing_required_parameter
    ├── EmptyArray                    400 empty_array
    ├── InvalidType                   400 invalid_type
    ├── InvalidValue                  400 invalid_value (a self-service parameter or key attribute)
    ├── UnknownParameter              400 unknown_parameter (a key attribute that does not exist)
    ├── UnsupportedParameter          400 unsupported_parameter
    ├── ModelNotFound                 404 model_not_found
    ├── GenerationNotFound            404 generation_not_found
    ├── KeyNotFound                   404 key_not_found
    ├── KeyRevoked                    409 key_revoked (a revoked key cannot be changed)
    ├── UnknownUrl / MethodNotAllowed 404 / 405
    ├── InsufficientCredits           402 insufficient_credits
    ├── KeySpendLimitExceeded         402 key_spend_limit_exceeded
    ├── RateLimitExceeded             429 rate_limit_exceeded
    ├── Maintenance                   503 maintenance (+ Retry-After)
    ├── NoBackendAvailable            503 no_backend_available
    ├── StorageUnavailable            503 storage_unavailable
    ├── UpstreamRejected              the upstream's 4xx, re-shaped
    ├── UpstreamFailed                502, plain text (contract §5)
    └── InternalError                 500 internal_error

Clients branch on status and ``error.code``: both are stable API. Messages may change.
Foreign failures are translated into this tree at the edges: a model server's transport
failures in `kiln.upstream` (`describe_transport_error`, then `UpstreamFailed`) and its error
bodies by `UpstreamRejected.from_upstream`; storage failures in
`kiln.store.errors.translate_storage_error`, made a 503 by `Gateway.storage`; and the web
framework's own 404/405/500 by `kiln.web`'s exception handlers.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable
from urllib.parse import quote

from .jsonio import compact, loads_answer

__all__ = [
    "GatewayError",
    "shortened",
    "InvalidJson",
    "RequestTooLarge",
    "InvalidApiKey",
    "OrganizationDisabled",
    "ManagementKeyForbidden",
    "ManagementKeyRequired",
    "MissingParameter",
    "EmptyArray",
    "InvalidType",
    "InvalidValue",
    "UnknownParameter",
    "UnsupportedParameter",
    "ModelNotFound",
    "GenerationNotFound",
    "KeyNotFound",
    "KeyRevoked",
    "UnknownUrl",
    "MethodNotAllowed",
    "InsufficientCredits",
    "KeySpendLimitExceeded",
    "RateLimitExceeded",
    "Maintenance",
    "NoBackendAvailable",
    "StorageUnavailable",
    "UpstreamRejected",
    "UpstreamFailed",
    "InternalError",
    "error_body",
]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """The contract's error shape, serialized."""
    payload = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return compact(payload)


# the most of a client's own text (an id, a name) that an error message quotes
QUOTED_CHARS = 64


def shortened(text: str) -> str:
    """A client's text as an error quotes it: whole if short, else its start and "…" (a name or
    id of any length must not make the answer as long)."""
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + "…"


# what a missing, malformed, unknown or revoked key is told (auth, and an admission that finds no org)
INVALID_KEY = "Incorrect API key provided. Check the key, or ask your organization's administrator for one."


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    media_type: str = "application/json"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        # for logs and usage events only, never sent to the client
        self.detail = detail
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    @property
    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidJson(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_json"


class RequestTooLarge(GatewayError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeout(GatewayError):
    """The request's body did not arrive in time (the local server says the same, kiln_ops.serve)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class InvalidApiKey(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def __init__(self, message: str = INVALID_KEY) -> None:
        super().__init__(message)


class OrganizationDisabled(GatewayError):
    status, type, code = 403, "permission_error", "organization_disabled"


class ManagementKeyForbidden(GatewayError):
    """A management key manages keys; it cannot call a model (contract §10)."""

    status, type, code = 403, "permission_error", "management_key"


class ManagementKeyRequired(GatewayError):
    """Only a management key may manage its org's keys (contract §10)."""

    status, type, code = 403, "permission_error", "management_key_required"


class MissingParameter(GatewayError):
    status, type, code = 400, "invalid_request_error", "missing_required_parameter"


class EmptyArray(GatewayError):
    status, type, code = 400, "invalid_request_error", "empty_array"


class InvalidType(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_type"


class InvalidValue(GatewayError):
    """A parameter of the right type but not a value it may take (`param` names it)."""

    status, type, code = 400, "invalid_request_error", "invalid_value"


class UnknownParameter(GatewayError):
    """A field the endpoint does not take, where an unknown one cannot be forwarded (keys)."""

    status, type, code = 400, "invalid_request_error", "unknown_parameter"


class UnsupportedParameter(GatewayError):
    status, type, code = 400, "invalid_request_error", "unsupported_parameter"


class ModelNotFound(GatewayError):
    status, type, code, param = 404, "invalid_request_error", "model_not_found", "model"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")


class GenerationNotFound(GatewayError):
    """Unknown, malformed, or another org's generation id: one answer for all (no existence leak)."""

    status, type, code, param = 404, "invalid_request_error", "generation_not_found", "id"

    def __init__(self, gen_id: str) -> None:
        super().__init__(f"No generation `{shortened(gen_id)}` was found for your organization "
                         "(a request's generation is recorded when it ends).")


class KeyNotFound(GatewayError):
    """No key of the caller's org has this id (another org's key is not found either)."""

    status, type, code, param = 404, "invalid_request_error", "key_not_found", "id"

    def __init__(self, key_id: str) -> None:
        super().__init__(f"No key with id {shortened(key_id)!r} in your organization.")


class KeyRevoked(GatewayError):
    """A change of a key that is revoked: revoking is final, so there is nothing to change."""

    status, type, code, param = 409, "invalid_request_error", "key_revoked", "id"

    def __init__(self, key_id: str, since: str | None = None) -> None:
        when = f" at {since}" if since else ""
        super().__init__(f"The key {shortened(key_id)!r} was revoked{when}: a revoked key cannot be changed. "
                         "Create a new key instead.")


class UnknownUrl(GatewayError):
    status, type, code = 404, "invalid_request_error", "unknown_url"


class InvalidEvent(GatewayError):
    """A Lambda invoke that no HTTP request through API Gateway or a Function URL makes (a
    direct invoke, a warmer, a console test event)."""

    status, type, code = 400, "invalid_request_error", "invalid_event"


class MethodNotAllowed(GatewayError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    def __init__(self, message: str, allowed: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.allowed = ", ".join(sorted(allowed))

    @property
    def headers(self) -> dict[str, str]:
        return {"Allow": self.allowed}  # RFC 9110 §15.5.6: a 405 names the methods the URL has


class InsufficientCredits(GatewayError):
    status, type, code = 402, "billing_error", "insufficient_credits"


class KeySpendLimitExceeded(GatewayError):
    """The key has spent its limit for the current period (contract §10)."""

    status, type, code = 402, "billing_error", "key_spend_limit_exceeded"


class RateLimitExceeded(GatewayError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class Maintenance(GatewayError):
    status, type, code = 503, "service_unavailable", "maintenance"

    def __init__(self, message: str, retry_after: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": self.retry_after}


class NoBackendAvailable(GatewayError):
    status, type, code = 503, "service_unavailable", "no_backend_available"


class StorageUnavailable(GatewayError):
    status, type, code = 503, "service_unavailable", "storage_unavailable"


class UpstreamRejected(GatewayError):
    """The model server answered 4xx: same status, its message in the contract's shape. Its
    code is passed on unless it is one of the gateway's own that speak of the caller's key, org,
    limits or the gateway (`RESERVED_CODES`): clients branch on those (§5), and a model
    server's `invalid_api_key` or `insufficient_credits` is not the gateway's word on the key
    or the org. Such a code is null to the client, kept in `upstream_code` (the usage event)."""

    type = "invalid_request_error"

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=None if code in RESERVED_CODES else code)
        self.upstream_code = code
        self.status = status
        self.backend: str | None = None  # the backend that answered so

    @classmethod
    def from_upstream(cls, status: int, raw: bytes, *, secret: str | None = None) -> "UpstreamRejected":
        """Re-shape whatever error body a model server sent (OpenAI, vLLM or plain text). The
        key the gateway sent it (`secret`) is taken out wherever the body echoes it (a server
        that writes its request's headers into its error), before the message is cut to its
        bound; a param or code longer than any is none."""
        spellings = secret_spellings(secret)
        message, param, code = (_redacted(part, spellings) if part else part for part in _describe_upstream_error(raw))
        message = (message or "")[:MAX_UPSTREAM_MESSAGE]
        if not message:
            message = f"The model server rejected the request (HTTP {status})."
        return cls(status, message, param=_short(param), code=_short(code))


class UpstreamFailed(GatewayError):
    """No backend produced a response: 502 with a short plain-text body (contract §5)."""

    status, type, code = 502, "server_error", "upstream_unavailable"
    media_type = "text/plain; charset=utf-8"

    def body(self) -> bytes:
        return (self.message.rstrip("\n") + "\n").encode()


class InternalError(GatewayError):
    status, type, code = 500, "server_error", "internal_error"


def _own_codes(root: type[GatewayError]) -> frozenset[str]:
    """Every code the gateway answers with of its own but those that speak of a request's content
    (400): a 400 `invalid_value` from the model server says the same of the same request."""
    codes, classes = set(), [root]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if cls is not UpstreamRejected and cls.code is not None and cls.status != 400:
            codes.add(cls.code)
    return frozenset(codes)


# with those API Gateway answers with (template.yaml) and a stream's error event
RESERVED_CODES = _own_codes(GatewayError) | {"function_unavailable", "gateway_timeout", "upstream_error"}


# what of a model server's error reaches the client: its message cut to this many characters,
# its param and code only as long as any a client would branch on
MAX_UPSTREAM_MESSAGE = 2000
MAX_UPSTREAM_WORD = 256
REDACTED = "[redacted]"


# a key shorter than this is a placeholder (vLLM's "EMPTY"), not a secret: taking it out of a
# message would mangle its words ("x" out of "max_tokens")
SHORTEST_REDACTED = 8


def secret_spellings(secret: str | None) -> tuple[str, ...]:
    """How a model server's text may spell the key it was sent: as it is, with its slashes
    escaped as JSON may write them (once, or inside a JSON string written into another), and
    percent-encoded (its slashes too or not, escapes in either case). None for a key too short
    to be a secret."""
    if not secret or len(secret) < SHORTEST_REDACTED:
        return ()
    encoded = (quote(secret, safe=""), quote(secret))  # every reserved character, or all but "/"
    spellings = (secret, secret.replace("/", "\\/"), secret.replace("/", "\\\\/"), *encoded,
                 *(_lower_hex(spelling) for spelling in encoded))
    return tuple(dict.fromkeys(spellings))


def _lower_hex(encoded: str) -> str:
    """A percent-encoded text with its escapes in lower case (%2f), as some encoders write them."""
    return re.sub(r"%[0-9A-F]{2}", lambda escape: escape.group().lower(), encoded)


def _redacted(text: str, spellings: tuple[str, ...]) -> str:
    """`text` with each of `spellings` (a key's, `secret_spellings`) written REDACTED."""
    for spelling in spellings:
        if spelling in text:
            text = text.replace(spelling, REDACTED)
    return text


def scrubbed(value: Any, secret: str | None) -> Any:
    """A JSON value with every spelling of `secret` taken out of its strings (keys included)."""
    spellings = secret_spellings(secret)
    return _scrubbed(value, spellings) if spellings else value


def _scrubbed(value: Any, spellings: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return _redacted(value, spellings)
    if isinstance(value, list):
        return [_scrubbed(item, spellings) for item in value]
    if isinstance(value, dict):
        return {_scrubbed(key, spellings): _scrubbed(item, spellings) for key, item in value.items()}
    return value


def _short(word: str | None) -> str | None:
    return word if word is not None and len(word) <= MAX_UPSTREAM_WORD else None


def _describe_upstream_error(raw: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an error body, whole: the caller bounds them."""
    text = raw.decode("utf-8", errors="replace").removeprefix("\ufeff").strip()  # a mark opening it is none of its text
    try:
        # read as a model server's answers are (kiln.jsonio); a body nested past that raises
        # ValueError, not RecursionError, and so does a lone surrogate escape, which no UTF-8
        # answer could carry on
        payload: Any = loads_answer(text.encode(), lone_surrogates=False)
    except ValueError:
        return text, None, None
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, str):
            return inner, None, None
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("detail") or ""
            if not isinstance(message, str):
                message = json.dumps(message)
            param = inner.get("param") if isinstance(inner.get("param"), str) else None
            code = inner.get("code") if isinstance(inner.get("code"), str) else None
            return message, param, code
    return text, None, None
