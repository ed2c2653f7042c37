"""The model-server client: pooled connections, per-model timeouts and bounds, failover before the first byte.

A backend that refuses the connection, times out before answering, or answers 5xx is
skipped for the model's next one; when none is left the client gets 502 (contract §5).
A 4xx is the request's own fault: it is passed on at once, never retried elsewhere.
Once a backend has answered 2xx the exchange is committed to it (a 204 or 205 has no body:
no completion, no stream, and the next backend is tried). The whole request, every
backend tried included, shares one deadline: the model's `total` timeout. What a backend
sends is bounded by the model's `limits` (headers, a buffered body; one SSE event in
`kiln.sse`). Each outcome is reported to `kiln.health` by its cause.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from functools import partial
from typing import Any, Callable

from .catalog import Backend, ModelEntry
from .errors import NoBackendAvailable, UpstreamFailed, UpstreamRejected
from .health import BackendHealth, Probe
from .http1 import (
    BodyTooLarge,
    ConnectFailed,
    ConnectTimeout,
    HttpClient,
    HttpError,
    ProtocolFailure,
    Response,
    ResponseTooLarge,
    Timeout,
    Unaddressable,
    sooner,
)
from .jsonio import compact
from .tls import client_context

__all__ = ["UpstreamClient", "UpstreamExchange", "UpstreamStreamError", "describe_transport_error"]

log = logging.getLogger("kiln.upstream")

# An error answer's body is read up to this (within the model's body bound): a validation error
# may quote a long input before its code, and one cut short is no JSON; past it, what it holds is
# not worth the parse (16 MiB of nested arrays took 2.7 s and 485 MB)
MAX_ERROR_BODY = 1 << 20
BAD_GATEWAY = "Bad gateway: the model backend returned an error or could not be reached. Retry with exponential backoff."
# what ended a request, for the RequestsTimedOut metric's `timeout` dimension
TIMEOUT_KINDS = ("connect", "first_byte", "idle", "total")


class UpstreamStreamError(Exception):
    """The upstream failed after it had answered 200: cut, reset, silent for too long, over a bound."""

    def __init__(self, message: str, *, timeout: str | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout  # which of the model's timeouts ended it, if one did


class _TotalTimeExceeded(Exception):
    """The request's deadline (the model's total time) passed."""


def describe_transport_error(exc: BaseException) -> str:
    """One short, stable description per kind of transport failure (for logs and usage events)."""
    if isinstance(exc, _TotalTimeExceeded):
        return "exceeded the model's total time"
    if isinstance(exc, Unaddressable):
        return "backend URL cannot be called as written"
    if isinstance(exc, ConnectFailed):
        return "connection failed"
    if isinstance(exc, (Timeout, TimeoutError, asyncio.TimeoutError)):
        return "timed out"
    if isinstance(exc, ResponseTooLarge):
        return "response headers over the bound"
    if isinstance(exc, BodyTooLarge):
        return "response body over the bound"
    if isinstance(exc, ProtocolFailure):
        return "connection closed mid-response"
    if isinstance(exc, HttpError):
        return f"transport error ({type(exc).__name__})"
    return f"{type(exc).__name__}"


def _is_backend_failure(exc: BaseException) -> bool:
    """The backend itself failed, whatever the request (contract §5): refused, reset before
    any answer, TLS, a timeout before the first byte. Counted per backend by kiln.health."""
    if isinstance(exc, (ConnectFailed, Timeout, TimeoutError)):
        return True
    return isinstance(exc, ProtocolFailure) and exc.nothing_received and not isinstance(exc, ResponseTooLarge)


TimedOut = Callable[[str, str], None]  # (model id, timeout kind)


def report_timeout(model_id: str, kind: str) -> None:
    """The default: the RequestsTimedOut metric, dimension `timeout` (connect, first_byte, idle, total)."""
    from .telemetry import metric

    metric("RequestsTimedOut", 1, timeout=kind)


class UpstreamExchange:
    """A committed (2xx) answer of one backend, body not read yet."""

    __slots__ = ("backend", "response", "failures", "sent_at", "health", "model", "deadline", "request", "client",
                 "timed_out", "sent_bytes", "after_failure")

    def __init__(
        self,
        backend: Backend,
        response: Response,
        failures: list[str] | None = None,  # backends tried before this one, and why they failed
        sent_at: float = 0.0,
        health: BackendHealth | None = None,
        *,
        model: ModelEntry | None = None,
        deadline: float | None = None,  # the request's, failover included (monotonic)
        request: str = "",
        client: str = "",
        timed_out: TimedOut | None = None,
        sent_bytes: int = 0,  # the body this backend was sent, in bytes
        after_failure: bool = False,  # another backend answered the request with a failure first
    ) -> None:
        self.backend = backend
        self.response = response
        self.failures = failures if failures is not None else []
        self.sent_at = sent_at
        self.health = health
        self.model = model
        self.deadline = deadline
        self.request = request
        self.client = client
        self.timed_out = timed_out
        self.sent_bytes = sent_bytes
        self.after_failure = after_failure

    def broke(self) -> None:
        """The backend failed after answering 2xx (a cut or silent stream, a truncated body,
        an answer over its bound): counted with its 5xx answers, by rate (kiln.health). Not on
        a backend that took a request another answered with a failure before it (a failover
        sees only such requests: their content may be at fault); its 2xx goes uncounted too,
        and the failures before it stand (they count as where another backend served the
        request: a backend that fails every request still goes out, and then its failover's
        failures count as any first backend's)."""
        if self.health is None or self.model is None:
            return
        if self.after_failure:
            self.health.forget(self.backend, self.request)
        else:
            self.health.answered(self.model.id, self.backend, self.request, self.client, failed=True,
                                 models_backends=self.model.available_backends())

    def _deadline(self, deadline: float | None = None) -> float | None:
        return sooner(deadline, self.deadline)

    def _timed_out(self, kind: str) -> None:
        if self.timed_out is not None and self.model is not None:
            try:
                self.timed_out(self.model.id, kind)
            except Exception:  # noqa: BLE001 - reporting must never fail a request
                log.exception("could not report a timeout")

    async def read_body(self, deadline: float | None = None) -> bytes:
        """The whole body (buffered requests), within the request's deadline and the model's body bound."""
        limit = self.model.limits.body_bytes if self.model is not None else None
        until = self._deadline(deadline)
        try:
            try:
                async with asyncio.timeout(None if until is None else max(0.0, until - time.monotonic())):
                    return await self.response.read(max_bytes=limit)
            except TimeoutError:
                raise _TotalTimeExceeded() from None
        except (HttpError, _TotalTimeExceeded) as exc:
            if isinstance(exc, (Timeout, _TotalTimeExceeded)):
                self._timed_out("total" if isinstance(exc, _TotalTimeExceeded) else "idle")
            self.broke()
            raise UpstreamFailed(BAD_GATEWAY, detail=f"{self.backend.name}: {describe_transport_error(exc)}") from exc

    async def next_piece(self, quiet_until: float | None = None) -> bytes | None:
        """The body's next piece as it arrives, b"" at its end; None if the backend was silent
        until `quiet_until` (a `time.monotonic()` instant: the caller's keep-alive), nothing
        lost. Within the request's deadline; transport failures become UpstreamStreamError
        (and close the connection)."""
        until = self._deadline(quiet_until)
        try:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise _TotalTimeExceeded()
            piece = await self.response.next_piece(until)
            if piece is None and self.deadline is not None and time.monotonic() >= self.deadline:
                raise _TotalTimeExceeded()
            return piece
        except _TotalTimeExceeded as exc:
            await self.response.aclose()
            self._timed_out("total")
            raise UpstreamStreamError(describe_transport_error(exc), timeout="total") from None
        except HttpError as exc:
            kind = "idle" if isinstance(exc, Timeout) else None
            if kind:
                self._timed_out(kind)
            raise UpstreamStreamError(describe_transport_error(exc), timeout=kind) from exc

    async def aclose(self) -> None:
        await self.response.aclose()


def fingerprint(client: str, path: str, content: bytes) -> str:
    """Who sent what: a resend of the same body by the same client is the same request."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(client.encode())
    digest.update(b"\0")
    digest.update(path.encode())
    digest.update(b"\0")
    digest.update(content)
    return digest.hexdigest()


_ERROR_BODY_SECONDS = 5.0  # an error answer's body, at most


class _NoHeadersInTime(Timeout):
    """The request's budget ran out before its answer's headers came (not a connect or send
    timeout of the HTTP client: those say the backend failed, whatever the request)."""


class UpstreamClient:
    def __init__(
        self,
        *,
        http: HttpClient | None = None,
        health: BackendHealth | None = None,
        timed_out: TimedOut | None = None,
    ) -> None:
        self.health = health or BackendHealth()
        self.timed_out = timed_out or report_timeout
        self._owns_http = http is None
        # the TLS context is made on the first https backend, if any
        self.http = http or HttpClient(ssl_context=client_context)

    async def aclose(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    async def open(
        self, model: ModelEntry, path: str, body: dict[str, Any], *, stream: bool, client: str = "",
        sent: list[str] | None = None,
    ) -> UpstreamExchange:
        """The first backend's 2xx, within the model's total time (shared by every backend
        tried). `client` (the org) tells one client's requests from another's for kiln.health;
        `sent` gets the name of each backend as the request is written to it (the caller's
        record of whether any model server was sent it, should the wait be cut short)."""
        enabled = model.available_backends()
        if not enabled:
            raise NoBackendAvailable(f"The model `{model.id}` has no backend available right now. Retry later.")
        health = self.health
        if sent is None:
            sent = []  # whether each attempt made its connection is read from it
        timeouts, limits = model.timeouts, model.limits
        started = time.monotonic()
        deadline = started + timeouts.total
        shared = compact(body)
        request = fingerprint(client, path, shared)
        failures: list[str] = []
        # the attempts a backend answered with a failure: told to kiln.health once it is known
        # whether a backend served the request (`_tell_failed_answers`)
        failed_answers: list[tuple[Backend, Probe | None]] = []
        last_timeout: str | None = None
        candidates, panic = health.candidates(model.id, enabled)
        try:
            for backend in candidates:
                remaining = deadline - time.monotonic()
                if remaining <= 0.001:
                    failures.append(f"{backend.name}: not tried, the model's total time was spent")
                    last_timeout = "total"
                    break
                # A stream's headers come at once (then keepalives cover the wait); a buffered answer
                # only arrives when generation is done, so it may take what is left of the total.
                budget = min(timeouts.first_byte, remaining) if stream else remaining
                claimed = health.claim(backend, panic=panic, lasting=budget)
                if not claimed:
                    continue  # another request is probing it
                probe = claimed if isinstance(claimed, Probe) else None  # this attempt probes it
                content = compact({**body, "model": backend.upstream_model}) if backend.upstream_model else shared
                headers = {
                    "content-type": "application/json",
                    "accept": "text/event-stream" if stream else "application/json",
                    # the bytes are relayed as they come: no compression in between
                    "accept-encoding": "identity",
                }
                api_key = backend.api_key()
                if api_key:
                    headers["authorization"] = f"Bearer {api_key}"
                sent_at = time.monotonic()
                written = len(sent)
                try:
                    try:
                        async with asyncio.timeout(budget):
                            response = await self.http.request(
                                "POST",
                                backend.url + path,
                                headers=headers,
                                body=content,
                                connect_timeout=min(timeouts.connect, budget),
                                read_timeout=timeouts.idle,
                                head_timeout=None,  # bounded by the budget above
                                max_header_bytes=limits.header_bytes,
                                on_sending=partial(sent.append, backend.name),
                            )
                    except TimeoutError:
                        raise _NoHeadersInTime("no response headers in time") from None
                except HttpError as exc:
                    failures.append(f"{backend.name}: {describe_transport_error(exc)}")
                    if isinstance(exc, Timeout):
                        if isinstance(exc, ConnectTimeout):
                            last_timeout = "connect"
                        else:
                            # the first byte's bound, unless what was left of the total was shorter
                            last_timeout = "first_byte" if stream and timeouts.first_byte < remaining + 0.01 else "total"
                    else:
                        last_timeout = None
                    # A buffered answer's headers come when its generation is done: a wait for them
                    # that outlasts the total says what the request asked for as much as that the
                    # backend failed, so it counts as a failed answer (by rate, over clients). A
                    # wait cut before a connection was even made (the attempt's budget shorter than
                    # the connect timeout) is the backend's: unreachable, as a connect timeout. A
                    # probe given half the total or more is no answer either way: its backend is
                    # out for not answering (or failing), and one that still does not answer stays
                    # out; one left with less (the attempts before it took the rest) says nothing.
                    connected = len(sent) > written
                    waited_for_generation = not stream and isinstance(exc, _NoHeadersInTime) and connected
                    if waited_for_generation and probe is not None and budget < timeouts.total / 2:
                        health.released(backend, probe)
                    elif _is_backend_failure(exc) and (not waited_for_generation or probe is not None):
                        # refused, TLS, a connect timeout, or any bound that ended the wait first: no
                        # connection was made (kiln.http1 writes the request only on one)
                        health.transport_failed(model.id, backend, enabled, probe=probe, panic=panic,
                                                unreachable=not connected)
                    else:  # an answer that broke its bounds or its framing
                        failed_answers.append((backend, probe))
                    continue
                except BaseException:
                    health.released(backend, probe)
                    raise
                last_timeout = None
                status = response.status
                # a 2xx with no body, or in a content coding (asked for none: it would be relayed
                # coded), is no answer to a completion (a proxy's): counted as a 5xx, the next tried
                coding = _content_coded(response) if 200 <= status < 300 else ""
                unreadable = status in _NO_BODY or bool(coding)
                if 200 <= status < 300 and not unreadable:
                    after_failure = bool(failed_answers)
                    _tell_failed_answers(health, model.id, request, client, enabled, failed_answers, served=True)
                    health.answered(model.id, backend, request, client, failed=False, models_backends=enabled,
                                    probe=probe)
                    return UpstreamExchange(
                        backend, response, failures, sent_at, health,
                        model=model, deadline=deadline, request=request, client=client, timed_out=self.timed_out,
                        sent_bytes=len(content), after_failure=after_failure,
                    )
                # any answer below 500 means the backend works: the request was at fault, not the backend
                if status >= 500 or unreadable:
                    failed_answers.append((backend, probe))
                else:
                    health.answered(model.id, backend, request, client, failed=False, models_backends=enabled,
                                    probe=probe)
                if 400 <= status < 500:
                    # its message reaches the client; any other answer's body is nobody's: not read
                    raw = await _read_error_body(response, deadline, min(limits.body_bytes, MAX_ERROR_BODY))
                    rejected = UpstreamRejected.from_upstream(status, raw, secret=api_key)
                    rejected.backend = backend.name  # the upstream that answered, for the usage event
                    raise rejected
                await response.aclose()
                failures.append(f"{backend.name}: HTTP {status}" + (f" in content coding {coding[:40]!r}" if coding else ""))
        finally:  # anything left untold: no backend served it (all failed, a 4xx to answer, a cancellation)
            _tell_failed_answers(health, model.id, request, client, enabled, failed_answers, served=False)
        if not failures:  # every backend was out of service or being probed by another request
            raise NoBackendAvailable(f"The model `{model.id}` has no backend available right now. Retry later.")
        if last_timeout is not None:
            try:
                self.timed_out(model.id, last_timeout)
            except Exception:  # noqa: BLE001 - reporting must never fail a request
                log.exception("could not report a timeout")
        log.warning(json.dumps({"event": "upstream_failed", "model": model.id, "failures": failures}))
        raise UpstreamFailed(BAD_GATEWAY, detail="; ".join(failures))


# 2xx statuses that have no body (RFC 9110): no completion, no stream; the next backend is tried
_NO_BODY = frozenset({204, 205})


def _content_coded(response: Response) -> str:
    """The content codings an answer is in, every Content-Encoding header read ("" for none): the
    gateway asks for identity and decodes nothing. `none`, which no registry has, is how servers
    keep a proxy from compressing a stream: it names no coding either."""
    codings: list[str] = []
    for name, value in response.headers:  # nearly every answer has none: one pass, nothing made
        if name == b"content-encoding":
            codings += (coding.strip(" \t") for coding in value.decode("latin-1").split(","))
    return ", ".join(coding for coding in codings if coding.lower() not in ("", "identity", "none")) if codings else ""


def _tell_failed_answers(health: BackendHealth, model_id: str, request: str, client: str, backends: list[Backend],
                         failed_answers: list[tuple[Backend, Probe | None]], *, served: bool) -> None:
    """Tell kiln.health of the failed answers of one request's attempts, once (the list is
    emptied): each counts on its backend where another backend served the request, or where
    only one backend answered it with a failure; a request that two backends or more answered
    with a failure, and none served, is its own failure and counts on none of them (§5: a
    model's failover backend sees only the requests that failed before it)."""
    told = list(failed_answers)
    failed_answers.clear()
    counted = served or len(told) < 2
    for backend, probe in told:
        health.answered(model_id, backend, request, client, failed=True, models_backends=backends, probe=probe,
                        counted=counted)


async def _read_error_body(response: Response, deadline: float, limit: int) -> bytes:
    """An error answer's body, for its message: what comes within 5 s, and within the
    request's deadline (a body that trickles must not hold the request past its total), up
    to `limit` (MAX_ERROR_BODY)."""
    try:
        async with asyncio.timeout(max(0.0, min(_ERROR_BODY_SECONDS, deadline - time.monotonic()))):
            return await response.read(limit=limit)
    except (HttpError, TimeoutError):
        return b""
    finally:
        await response.aclose()
