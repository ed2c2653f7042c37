"""A small asynchronous client for the AWS JSON APIs the gateway calls on every request.

DynamoDB and SSM speak JSON over HTTPS, signed with Signature Version 4. The request path
needs five of their operations (GetItem, UpdateItem, TransactWriteItems, PutItem,
GetParameter), so it talks to them directly on the gateway's own event loop (`kiln.http1`):
no botocore (its imports and a client to build at every cold start, more CPU per call, and
a worker thread per call since it blocks). Operators' tools keep using
pynamodb and botocore, which remain the schema of record.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import json
import os
import random
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Callable
from urllib.parse import quote, urlsplit, urlunsplit

from .http1 import HttpClient, HttpError, Response, canonical_host
from .jsonio import compact, loads_trusted
from .tls import client_context

__all__ = ["AwsClient", "AwsError", "Credentials", "canonical_query", "canonical_uri", "resolve_credentials", "sign",
           "tried_once"]

_SERVICES = {
    # service: (X-Amz-Target prefix, content type)
    "dynamodb": ("DynamoDB_20120810", "application/x-amz-json-1.0"),
    "ssm": ("AmazonSSM", "application/x-amz-json-1.1"),
}
# Errors worth another try: the service was busy or failed, not the request.
_RETRYABLE = {
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalServerError",
    "ServiceUnavailable",
    "TransactionInProgressException",
}


class AwsError(Exception):
    """An AWS error answer, by its code (the part of `__type` after `#`), with its whole body."""

    def __init__(self, code: str, message: str, body: dict[str, Any] | None = None, status: int = 400) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.body = body or {}
        self.status = status


class Credentials:
    """Signing keys (no repr: they must never reach a log)."""

    __slots__ = ("access_key", "secret_key", "token")

    def __init__(self, access_key: str, secret_key: str, token: str | None = None) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self.token = token


def resolve_credentials(endpoint_url: str | None) -> Callable[[], Credentials]:
    """Where the signing keys come from: the environment (Lambda puts them there), else the
    usual AWS configuration (profiles, SSO; loaded only then), else — for an emulator only —
    dummy ones (an emulator checks no signature)."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        fixed = Credentials(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None)
        return lambda: fixed
    try:
        import botocore.session  # the full credential chain; not in the Lambda layer, where keys are in the environment
    except ImportError:
        found = None
    else:
        found = botocore.session.get_session().get_credentials()
    if found is not None:

        def current() -> Credentials:
            frozen = found.get_frozen_credentials()  # refreshes expiring credentials
            return Credentials(frozen.access_key, frozen.secret_key, frozen.token)

        return current
    if endpoint_url:
        dummy = Credentials("emulator", "emulator")
        return lambda: dummy
    raise AwsError("NoCredentials", "no AWS credentials found (environment, profile or SSO)")


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.digest(key, text.encode(), "sha256")


def _without_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4, and no empty segments (AWS services want `//` collapsed)."""
    kept: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if kept:
                kept.pop()
        elif segment and segment != ".":
            kept.append(segment)
    lead = "/" if path.startswith("/") else ""
    trail = "/" if path.endswith("/") and kept else ""
    return lead + "/".join(kept) + trail


def canonical_uri(path: str) -> str:
    """The path as SigV4 signs it for every service but S3: normalized, then URI-encoded (an
    encoded path is encoded once more)."""
    return quote(_without_dot_segments(path) or "/", safe="/~")


def canonical_query(query: str) -> str:
    """The URL's query as SigV4 signs it: its pairs sorted, as written."""
    if not query:
        return ""
    pairs = sorted(pair.partition("=")[::2] for pair in query.split("&"))
    return "&".join(f"{key}={value}" for key, value in pairs)


def _canonical_header(name: str, value: str) -> str:
    """A header as SigV4 signs it: the value trimmed, inner runs of whitespace made one space."""
    return f"{name}:{' '.join(value.split())}\n"


@lru_cache(maxsize=64)
def _signed_url(url: str) -> tuple[str, str, str]:
    """A URL's Host, canonical URI and canonical query string, worked out once per URL."""
    parts = urlsplit(url)
    return canonical_host(parts), canonical_uri(parts.path), canonical_query(parts.query)


# sent, not signed, as botocore leaves them: a proxy on the way may change or drop them (a
# user-agent, hop-by-hop fields, tracing), which would make the signature fail
UNSIGNED_HEADERS = frozenset({
    "baggage", "connection", "expect", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "traceparent",
    "tracestate", "trailer", "transfer-encoding", "upgrade", "user-agent", "x-amzn-trace-id",
})


@lru_cache(maxsize=64)
def _undated(headers: tuple[tuple[str, str], ...], host: str, token: str | None) -> tuple[dict[str, str], str, str, str]:
    """Everything a request's signed headers are but its date, worked out once per set of
    headers (a client sends the same few over and over): the headers sent, by lower-case name,
    X-Amz-Date aside; the canonical headers before its line and after it; the signed names."""
    sent = {name.lower(): value for name, value in headers}
    sent.pop("x-amz-date", None)  # the signature's own date, whatever was given
    sent["host"] = host
    if token:
        sent["x-amz-security-token"] = token  # sent as given, signed trimmed
    names = sorted([*(name for name in sent if name not in UNSIGNED_HEADERS), "x-amz-date"])
    at = names.index("x-amz-date")
    before = "".join([_canonical_header(name, sent[name]) for name in names[:at]])
    after = "".join([_canonical_header(name, sent[name]) for name in names[at + 1:]])
    return sent, before, after, ";".join(names)


@lru_cache(maxsize=4)
def _amz_date(second: datetime) -> str:
    """X-Amz-Date's text of a moment, worked out once a second."""
    return second.strftime("%Y%m%dT%H%M%SZ")


def sign(
    *,
    credentials: Credentials,
    region: str,
    service: str,
    url: str,
    headers: dict[str, str],
    body: bytes,
    now: datetime,
    signing_keys: dict[tuple[str, str, str, str], bytes] | None = None,
) -> dict[str, str]:
    """SigV4 headers (Host included: send it as it is) for a POST of `body` to `url`."""
    amz_date = _amz_date(now.replace(microsecond=0))
    date = amz_date[:8]
    host, uri, query = _signed_url(url)
    undated, before, after, signed_names = _undated(tuple(headers.items()), host, credentials.token)
    sent = dict(undated)
    sent["x-amz-date"] = amz_date
    canonical = (f"POST\n{uri}\n{query}\n{before}x-amz-date:{amz_date}\n{after}\n{signed_names}\n"
                 f"{hashlib.sha256(body).hexdigest()}")
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    cache_key = (credentials.secret_key, date, region, service)
    key = signing_keys.get(cache_key) if signing_keys is not None else None
    if key is None:
        key = _hmac(_hmac(_hmac(_hmac(f"AWS4{credentials.secret_key}".encode(), date), region), service), "aws4_request")
        if signing_keys is not None:
            signing_keys.clear()  # one day's keys at a time
            signing_keys[cache_key] = key
    signature = hmac.digest(key, to_sign.encode(), "sha256").hex()
    sent["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={signed_names}, Signature={signature}"
    )
    return sent


class AwsClient:
    """DynamoDB and SSM calls on the event loop, retried with backoff on throttling and 5xx."""

    def __init__(
        self,
        *,
        region: str,
        endpoint_url: str | None = None,
        http: HttpClient | None = None,
        credentials: Callable[[], Credentials] | None = None,
        timeout: float = 5.0,
        max_attempts: int = 3,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        user_agent: str | None = None,
    ) -> None:
        """`user_agent`: who calls, for an operator's tool (the gateway's own calls send none)."""
        self._region = region
        self._user_agent = user_agent
        # each service's URL, worked out once
        self._urls = {service: endpoint(service, region, endpoint_url) for service in _SERVICES}
        self._clock = clock
        self._credentials = credentials or resolve_credentials(endpoint_url)
        self._timeout = timeout
        self._max_attempts = max_attempts
        self._owns_http = http is None
        # the TLS context is made on the first https connection: an emulator needs none
        self._http = http or HttpClient(ssl_context=client_context)
        self._signing_keys: dict = {}

    async def call(self, service: str, operation: str, payload: dict[str, Any], *,
                   resend_unanswered: bool = True) -> dict[str, Any]:
        """The call's answer, or AwsError. `resend_unanswered`: whether a call whose kept-alive
        connection closed without a word is sent again on a new one (kiln.http1): not for a
        write that must not be applied twice, whose caller judges a lost answer itself."""
        body = compact(payload)
        url = self._urls[service]
        headers_of = _headers_of(service, operation)
        if self._user_agent:
            headers_of = {**headers_of, "user-agent": self._user_agent}
        delay = 0.025
        for attempt in range(1, self._max_attempts + 1):
            headers = sign(
                credentials=self._credentials(),
                region=self._region,
                service=service,
                url=url,
                headers=headers_of,
                body=body,
                now=self._clock(),
                signing_keys=self._signing_keys,
            )
            try:
                response = await self._http.request(
                    "POST", url, headers=headers, body=body, connect_timeout=self._timeout, read_timeout=self._timeout,
                    resend_unanswered=resend_unanswered,
                )
                content = await response.read()
            except HttpError as exc:
                if attempt == self._max_attempts:
                    raise AwsError("ConnectionError", f"{type(exc).__name__}: {exc}", status=0) from exc
            else:
                if response.status == 200:
                    return loads_trusted(content) if content else {}  # UTF-8, as AWS answers
                error = _error_of(response, content)
                if (error.code not in _RETRYABLE and response.status < 500) or attempt == self._max_attempts:
                    raise error
            await asyncio.sleep(delay * (1 + random.random()))
            delay *= 2
        raise AssertionError("unreachable")

    def once(self) -> "AwsClient":
        """The same client (its connections, credentials and signing keys) trying each call
        once: for callers with their own retries (the ledger's policy, the parameter cache's
        back-off), whose every try would otherwise be this client's tries, against the very
        quota that refused them."""
        single = copy.copy(self)
        single._max_attempts, single._owns_http = 1, False
        return single

    async def dynamodb(self, operation: str, payload: dict[str, Any], *, resend_unanswered: bool = True) -> dict[str, Any]:
        return await self.call("dynamodb", operation, payload, resend_unanswered=resend_unanswered)


    async def ssm(self, operation: str, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.call("ssm", operation, payload)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()


@lru_cache(maxsize=64)
def _headers_of(service: str, operation: str) -> dict[str, str]:
    """The headers of an operation's calls, before signing (made once per operation; never changed)."""
    prefix, content_type = _SERVICES[service]
    return {"content-type": content_type, "x-amz-target": f"{prefix}.{operation}"}


def tried_once(aws: Any) -> Any:
    """`aws.once()` for the gateway's own client; any other (a test's stand-in) as it is."""
    return aws.once() if isinstance(aws, AwsClient) else aws


def endpoint(service: str, region: str, endpoint_url: str | None) -> str:
    """Where a service's calls go: its regional endpoint, or `endpoint_url` as botocore uses it
    (path, port and query kept; `/` only when it has no path)."""
    if not endpoint_url:
        # the China partition's hosts end in .com.cn (its ARNs are template.yaml's AWS::Partition)
        suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
        return f"https://{service}.{region}.{suffix}/"
    parts = urlsplit(endpoint_url.strip())
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here, not on the first call
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise AwsError("InvalidEndpoint", f"the endpoint URL must be http:// or https:// with a host: {endpoint_url!r}")
    return urlunsplit((parts.scheme, parts.netloc, parts.path or "/", parts.query, ""))


def _error_of(response: Response, content: bytes) -> AwsError:
    try:
        body = json.loads(content)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    kind = str(body.get("__type") or response.header("x-amzn-errortype") or f"HTTP{response.status}")
    code = kind.rsplit("#", 1)[-1].split(":", 1)[0]
    message = str(body.get("message") or body.get("Message") or f"HTTP {response.status}")
    return AwsError(code, message, body, response.status)
