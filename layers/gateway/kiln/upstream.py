"""The model-server client: pooled connections, per-model timeouts, failover before the first byte.

A backend that refuses the connection, times out before answering, or answers 5xx is
skipped for the model's next one; when none is left the client gets 502 (contract §5).
A 4xx is the request's own fault: it is passed on at once, never retried elsewhere.
Once a backend has answered 2xx the exchange is committed to it. Backends that keep
failing are taken out of service for a while (`kiln.health`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from .catalog import Backend, ModelEntry
from .errors import NoBackendAvailable, UpstreamFailed, UpstreamRejected
from .health import BackendHealth
from .http1 import ConnectFailed, HttpClient, HttpError, ProtocolFailure, Response, Timeout
from .jsonio import compact
from .tls import client_context

__all__ = ["UpstreamClient", "UpstreamExchange", "UpstreamStreamError", "describe_transport_error"]

log = logging.getLogger("kiln.upstream")

# Error bodies are read up to this size; more is never useful and could be hostile.
MAX_ERROR_BODY = 64 * 1024
BAD_GATEWAY = "Bad gateway: the model backend returned an error or could not be reached. Retry with exponential backoff."


class UpstreamStreamError(Exception):
    """The upstream failed after it had answered 200: cut, reset, silent for too long."""


def describe_transport_error(exc: BaseException) -> str:
    """One short, stable description per kind of transport failure (for logs and usage events)."""
    if isinstance(exc, ConnectFailed):
        return "connection failed"
    if isinstance(exc, (Timeout, TimeoutError, asyncio.TimeoutError)):
        return "timed out"
    if isinstance(exc, ProtocolFailure):
        return "connection closed mid-response"
    if isinstance(exc, HttpError):
        return f"transport error ({type(exc).__name__})"
    return f"{type(exc).__name__}"


class UpstreamExchange:
    """A committed (2xx) answer of one backend, body not read yet."""

    __slots__ = ("backend", "response", "failures", "sent_at", "health")

    def __init__(
        self,
        backend: Backend,
        response: Response,
        failures: list[str] | None = None,  # backends tried before this one, and why they failed
        sent_at: float = 0.0,
        health: BackendHealth | None = None,
    ) -> None:
        self.backend = backend
        self.response = response
        self.failures = failures if failures is not None else []
        self.sent_at = sent_at
        self.health = health

    def broke(self) -> None:
        """The backend failed after answering 2xx (a cut or silent stream, a truncated body)."""
        if self.health is not None:
            self.health.failed(self.backend)

    async def read_body(self, deadline: float) -> bytes:
        """The whole body (buffered requests), within the model's total time."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await self.response.read()
        except (HttpError, TimeoutError) as exc:
            self.broke()
            raise UpstreamFailed(BAD_GATEWAY, detail=f"{self.backend.name}: {describe_transport_error(exc)}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; transport failures become UpstreamStreamError."""
        try:
            async for chunk in self.response.chunks():
                yield chunk
        except HttpError as exc:
            raise UpstreamStreamError(describe_transport_error(exc)) from exc

    async def aclose(self) -> None:
        await self.response.aclose()


class UpstreamClient:
    def __init__(self, *, http: HttpClient | None = None, health: BackendHealth | None = None) -> None:
        self.health = health or BackendHealth(threshold=3, cooldown=10.0)
        self._owns_http = http is None
        # the TLS context is made on the first https backend, if any
        self.http = http or HttpClient(ssl_context=client_context)

    async def aclose(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    async def open(self, model: ModelEntry, path: str, body: dict[str, Any], *, stream: bool) -> UpstreamExchange:
        backends = [backend for backend in model.available_backends() if self.health.usable(backend)]
        if not backends:
            raise NoBackendAvailable(f"The model `{model.id}` has no backend available right now. Retry later.")
        timeouts = model.timeouts
        # A stream's headers come at once (then keepalives cover the wait); a buffered answer
        # only arrives when generation is done, so it may take the whole budget.
        header_budget = timeouts.first_byte if stream else timeouts.total
        shared = compact(body)
        failures: list[str] = []
        for backend in backends:
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
            try:
                async with asyncio.timeout(header_budget):
                    response = await self.http.request(
                        "POST",
                        backend.url + path,
                        headers=headers,
                        body=content,
                        connect_timeout=timeouts.connect,
                        read_timeout=timeouts.idle,
                    )
            except (HttpError, TimeoutError) as exc:
                failures.append(f"{backend.name}: {describe_transport_error(exc)}")
                self.health.failed(backend)
                continue
            status = response.status
            if 200 <= status < 300:
                self.health.succeeded(backend)
                return UpstreamExchange(backend, response, failures, sent_at, self.health)
            raw = await _read_error_body(response)
            if 400 <= status < 500:
                self.health.succeeded(backend)  # it answered: the request was at fault, not the backend
                raise UpstreamRejected.from_upstream(status, raw)
            failures.append(f"{backend.name}: HTTP {status}")
            self.health.failed(backend)
        log.warning(json.dumps({"event": "upstream_failed", "model": model.id, "failures": failures}))
        raise UpstreamFailed(BAD_GATEWAY, detail="; ".join(failures))


async def _read_error_body(response: Response) -> bytes:
    try:
        async with asyncio.timeout(5):
            return await response.read(limit=MAX_ERROR_BODY)
    except (HttpError, TimeoutError):
        return b""
    finally:
        await response.aclose()
