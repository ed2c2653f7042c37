"""One admitted request, from its lease to its settle (contract §4, §5, §7).

Whatever happens after admission (success, upstream error, a cut stream, a client that
leaves, a bug), the request is settled exactly once: lease released, cost debited, usage
event written, and that before the last byte reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from decimal import Decimal
from typing import Any, AsyncGenerator, AsyncIterator

import anyio
from starlette.responses import Response

from .auth import Principal
from .errors import GatewayError, InternalError, NoBackendAvailable, UpstreamFailed, UpstreamRejected
from .gateway import Gateway
from .jsonio import dumps
from .metering import TokenUsage, cost_of, estimate_prompt_tokens, estimate_text_tokens
from .normalize import ModelCall
from .observability import RequestRecord
from .responses import RelayResponse, error_response, json_response
from .sse import DONE, KEEPALIVE, SseRelay, error_event, usage_event
from .store import Lease, UsageEvent
from .store.clock import iso_ms
from .upstream import UpstreamExchange, UpstreamStreamError

__all__ = ["Exchange"]

log = logging.getLogger("kiln.exchange")

STREAM_CUT = "The model backend failed while streaming the response."


class Exchange:
    def __init__(
        self, gateway: Gateway, principal: Principal, call: ModelCall, lease: Lease, record: RequestRecord
    ) -> None:
        self.gateway = gateway
        self.record = record
        self.principal = principal
        self.call = call
        self.lease = lease
        self.started = time.monotonic()
        self.ttfb_ms: int | None = None
        self.upstream_name: str | None = None
        self._settled = False

    @property
    def gen_id(self) -> str:
        return self.lease.gen_id

    async def respond(self) -> Response:
        try:
            upstream = await self.gateway.upstream.open(
                self.call.model, self.call.endpoint.upstream_path, self.call.body, stream=self.call.stream,
                client=self.lease.org_id,
            )
        except GatewayError as error:
            return await self._refused(error)
        except BaseException as exc:
            return await self._crashed(exc)
        self.upstream_name = upstream.backend.name
        self.record.backend_failures = len(upstream.failures)
        if self.call.stream:
            return RelayResponse(self._relay(upstream), self.gen_id)
        try:
            return await self._buffered(upstream)
        except GatewayError as error:
            return await self._refused(error)
        except BaseException as exc:
            return await self._crashed(exc)
        finally:
            await upstream.aclose()

    # -- the ways an exchange ends ---------------------------------------------------------

    async def _refused(self, error: GatewayError) -> Response:
        status = {
            UpstreamRejected: "upstream_rejected",
            UpstreamFailed: "upstream_error",
            NoBackendAvailable: "no_backend_available",
        }.get(type(error), "gateway_error")
        self.record.error_code = error.code
        await self._settle(status, http_status=error.status, error=error.detail or error.message)
        return error_response(error, self.gen_id)

    async def _crashed(self, exc: BaseException) -> Response:
        if isinstance(exc, asyncio.CancelledError):  # the server is stopping, or the client left
            await self._settle("client_disconnected", http_status=None, error="cancelled before the answer was sent")
            raise exc
        log.exception("request %s failed inside the gateway", self.gen_id, exc_info=exc)
        await self._settle("gateway_error", http_status=500, error=type(exc).__name__)
        self.record.error_code = InternalError.code
        if not isinstance(exc, Exception):
            raise exc
        return error_response(InternalError("The gateway failed to process the request."), self.gen_id)

    async def _settle(
        self,
        status: str,
        *,
        http_status: int | None,
        usage: TokenUsage | None = None,
        cost: Decimal = Decimal(0),
        finish_reason: str | None = None,
        error: str | None = None,
    ) -> None:
        if self._settled:
            return
        self._settled = True
        event = UsageEvent(
            gen_id=self.gen_id,
            org_id=self.lease.org_id,
            created_at=iso_ms(self.lease.started),
            key_id=self.lease.key_id,
            model=self.call.model.id,
            endpoint=self.call.endpoint.name,
            streamed=self.call.stream,
            status=status,
            cost=cost,
            http_status=http_status,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cached_tokens=usage.cached_tokens if usage else None,
            usage_source=usage.source if usage else None,
            finish_reason=finish_reason,
            ttfb_ms=self.ttfb_ms,
            duration_ms=int((time.monotonic() - self.started) * 1000),
            upstream=self.upstream_name,
            error=error[:500] if error else None,
        )
        self.record.usage = event
        # A settle must finish even when the client's disconnect cancels this task.
        with anyio.CancelScope(shield=True):
            await self.gateway.settle(self.lease, event)

    def _price(self, usage: TokenUsage) -> Decimal:
        return cost_of(usage, self.call.model.pricing)

    # -- buffered --------------------------------------------------------------------------

    async def _buffered(self, upstream: UpstreamExchange) -> Response:
        self.ttfb_ms = int((time.monotonic() - self.started) * 1000)
        deadline = upstream.sent_at + self.call.model.timeouts.total
        raw = await upstream.read_body(deadline)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise UpstreamFailed(
                "Bad gateway: the model backend returned an invalid response.", detail="upstream body is not a JSON object"
            )
        upstream_usage = answer.get("usage")
        usage = TokenUsage.from_upstream(upstream_usage)
        if usage is None:
            usage = TokenUsage(
                estimate_prompt_tokens(self.call.body), _estimate_completion(answer.get("choices")), None, "estimated"
            )
            answer["usage"] = usage.as_openai(Decimal(0))
        cost = self._price(usage)
        answer["usage"]["cost"] = cost
        await self._settle(
            "success", http_status=200, usage=usage, cost=cost, finish_reason=_first_finish_reason(answer.get("choices"))
        )
        return json_response(dumps(answer), self.gen_id)

    # -- streamed --------------------------------------------------------------------------

    async def _relay(self, upstream: UpstreamExchange) -> AsyncGenerator[bytes, None]:
        relay = SseRelay(
            client_wants_usage=self.call.client_wants_usage, max_event_bytes=self.call.model.limits.event_bytes
        )
        deadline = upstream.sent_at + self.call.model.timeouts.total
        failure: str | None = None
        try:
            async with aclosing(_with_keepalive(upstream.chunks(), self.gateway.settings.keepalive_seconds)) as pieces:
                async for piece in pieces:
                    if time.monotonic() > deadline:
                        raise UpstreamStreamError("exceeded the model's total time")
                    if piece is None:
                        yield KEEPALIVE
                        continue
                    out = relay.feed(piece)
                    if out:
                        if self.ttfb_ms is None:
                            self.ttfb_ms = int((time.monotonic() - self.started) * 1000)
                        yield out
                    if relay.done:
                        break
                else:
                    raise UpstreamStreamError("the stream ended before [DONE]")
        except UpstreamStreamError as exc:
            failure = str(exc)
        except (asyncio.CancelledError, GeneratorExit):
            await self._end_stream(upstream, relay, "client_disconnected", "the client disconnected")
            raise
        except Exception as exc:  # a fault of ours: still settle, still end the stream clearly
            log.exception("stream %s failed inside the gateway", self.gen_id)
            failure = f"gateway error: {type(exc).__name__}"
            await self._end_stream(upstream, relay, "gateway_error", failure)
            yield error_event(STREAM_CUT)
            return
        if failure is not None:
            upstream.broke()
            await self._end_stream(upstream, relay, "stream_interrupted", failure)
            yield error_event(STREAM_CUT)
            return
        tail = await self._end_stream(upstream, relay, "success", None)
        yield tail + DONE

    async def _end_stream(self, upstream: UpstreamExchange, relay: SseRelay, status: str, error: str | None) -> bytes:
        """Close the upstream, settle, and return the usage chunk the client should get (if any)."""
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        usage = relay.usage
        if usage is None:
            usage = TokenUsage(estimate_prompt_tokens(self.call.body), relay.relayed_tokens, None, "estimated")
        cost = self._price(usage)
        await self._settle(
            status, http_status=200, usage=usage, cost=cost, finish_reason=relay.finish_reason, error=error
        )
        if status != "success" or not self.call.client_wants_usage:
            return b""
        if relay.usage_chunk is not None and relay.usage is not None:
            chunk_usage = dict(relay.usage_chunk["usage"])
            chunk_usage["cost"] = cost
            return usage_event(relay.usage_chunk, chunk_usage)
        return usage_event(relay.first_chunk or {}, usage.as_openai(cost))


async def _with_keepalive(chunks: AsyncIterator[bytes], interval: float) -> AsyncGenerator[bytes | None, None]:
    """The upstream's chunks, with None whenever it has been silent for `interval` seconds.

    Each read runs as its own task, so waiting with a timeout never interrupts it. A read
    is cancelled only when the stream is abandoned midway (client gone, upstream failed),
    and then its connection is closed, never returned to the pool half-read.
    """
    iterator = chunks.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait((pending,), timeout=interval)
            if not done:
                yield None
                continue
            read, pending = pending, None
            try:
                chunk = read.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
            with anyio.CancelScope(shield=True):
                try:
                    await pending
                except BaseException:  # noqa: BLE001 - a cancelled or failed read: nothing to keep
                    pass


def _estimate_completion(choices: Any) -> int:
    total = 0
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        texts = [choice.get("text"), message.get("content"), message.get("reasoning_content")]
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                texts.append(call["function"].get("arguments"))
        total += sum(estimate_text_tokens(text) for text in texts if isinstance(text, str))
    return total


def _first_finish_reason(choices: Any) -> str | None:
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    return None
