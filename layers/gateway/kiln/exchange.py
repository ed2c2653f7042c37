"""One admitted request, from its lease to its settle (contract §4, §5, §7).

Whatever happens after admission (success, upstream error, a cut stream, a client that
leaves, a bug), the request is settled exactly once: lease released, cost debited, usage
event written, and that before the last byte reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from decimal import Decimal
from typing import Any, AsyncGenerator, Callable

from starlette.responses import Response
from starlette.types import Receive

from .apis import ModelApi
from .auth import Principal
from .departure import ClientLeft, unless_the_client_leaves
from .echo import Echoes
from .errors import (
    GatewayError,
    InternalError,
    NoBackendAvailable,
    StorageUnavailable,
    UpstreamFailed,
    UpstreamRejected,
    scrubbed,
)
from .gateway import Gateway
from .jsonio import dumps, loads_answer
from .lambda_payload import answer_size, escaped_size
from .metering import TokenUsage, UsageBounds, billable_usage, cost_of
from .normalize import ModelCall
from .observability import RequestRecord
from .responses import LastPiece, RelayResponse, error_response, json_response
from .shielded import to_the_end
from .sse import KEEPALIVE, EventTooLarge, SseRelay
from .store import Lease, UsageEvent
from .store.clock import iso_ms
from .store.renewal import LeaseKeeper
from .upstream import UpstreamExchange, UpstreamStreamError

__all__ = ["Exchange"]

log = logging.getLogger("kiln.exchange")


def _echoes_of(call: ModelCall) -> Echoes:
    """What the request's replies may repeat of it; none if that cannot be worked out (the
    reply's texts are then all counted as the model's: the side that loses nothing)."""
    try:
        return call.api.echoes(call.body)
    except Exception:  # noqa: BLE001 - a request any client may shape: never a failure here
        log.exception("the echo of a request could not be worked out")
        return Echoes(())


STREAM_CUT = "The model backend failed while streaming the response."
GATEWAY_CUT = "The gateway failed while streaming the response."
INVALID_ANSWER = "Bad gateway: the model backend returned an invalid response."
LEASE_NOT_KEPT = "its lease could not be kept: storage unavailable"  # what its usage event says
EVENT_NOT_MADE = "gateway error: its usage event could not be made whole"
TOO_LARGE_TO_ANSWER = ("Bad gateway: the model's answer is larger than a buffered answer of the gateway can be "
                       "(a Lambda invocation's 6 MB, JSON-escaped). Ask for fewer tokens, or stream it.")
CLIENT_READ_TOO_SLOWLY = "the client did not read the stream within the model's total time"  # its event's
READ_TOO_SLOWLY = "The stream was ended: it was not read within the model's total time."  # the client's
TOO_LARGE_TO_STREAM = ("The stream was ended: it is larger than an answer of this deployment can be (a Lambda "
                       "invocation's 6 MB, JSON-escaped, in buffered mode). Ask for fewer tokens.")
OUTGREW = "the stream outgrew what its invocation can answer"  # its event's
SLOT_LOST = ("The request was stopped: storage was unavailable for too long to keep its concurrency slot. "
             "Please retry.")
# a stream's event status, by how it ended where that is no status of its own
_SETTLED_AS = {
    "lease_lost": "gateway_error",
    "read_too_slowly": "client_disconnected",  # as a client that reads nothing is, cut at its deadline
    "too_large_to_answer": "stream_interrupted",
}
# a stream's last event, by how it ended (any other: the model server's failure)
_CUT_MESSAGES = {"gateway_error": GATEWAY_CUT, "lease_lost": SLOT_LOST, "read_too_slowly": READ_TOO_SLOWLY,
                 "too_large_to_answer": TOO_LARGE_TO_STREAM}


# a write that takes longer waited on the client's reading (flow control): a write alone takes well
# under a millisecond, and a client slower than a model's tokens holds each for seconds; a function
# on Lambda's smaller sizes, its CPU share spent, is paused for most of each 100 ms quota period
# (CFS), so a write across two such pauses is still not taken for the client's
_HELD = 0.25
# what a stream answered whole (kiln.lambda_payload) keeps for its last event, at the most
_TAIL_ROOM = 8192


class _TooLargeToAnswer(Exception):
    """A stream answered whole would outgrow what its invocation can answer; `relayed`: the
    events made of its last read before the line that would."""

    def __init__(self, relayed: bytes) -> None:
        super().__init__()
        self.relayed = relayed


def _deadline_of(upstream: UpstreamExchange, total: float) -> float:
    """The request's deadline (monotonic), every backend tried included, as the upstream's reads
    are cut at it."""
    return upstream.deadline if upstream.deadline is not None else upstream.sent_at + total


def _room_after(comment: bytes, room: int) -> int:
    """The room left once `comment` (a keep-alive, nothing to bill) is in the answer."""
    if len(comment) > room:
        raise _TooLargeToAnswer(b"")
    return room - len(comment)


def _fed_within(relay: SseRelay, piece: bytes, room: int) -> tuple[bytes, int]:
    """What the relay makes of `piece` within `room` (bytes as the answer's JSON string holds
    them: what it is relayed as, near enough, the tail's room kept for the difference), and the
    room left. A piece that would outgrow it is fed a line at a time, up to the line that would:
    what the stream bills is then what the client gets."""
    size = escaped_size(piece)
    if size <= room:
        return relay.feed(piece), room - size
    made: list[bytes] = []
    for line in piece.splitlines(keepends=True):
        room -= escaped_size(line)
        if room < 0:
            raise _TooLargeToAnswer(b"".join(made))
        try:
            made.append(relay.feed(line))
        except EventTooLarge as exc:
            exc.relayed = b"".join(made) + exc.relayed
            raise
    return b"".join(made), room


class _LeaseLost(Exception):
    """The request's lease could not be kept (kiln.store.renewal): it stops where it is."""


class Exchange:
    def __init__(
        self, gateway: Gateway, principal: Principal, call: ModelCall, lease: Lease, record: RequestRecord,
        *, answer_limit: int | None = None,
    ) -> None:
        self.gateway = gateway
        self._answer_limit = answer_limit  # the most a buffered answer may take (kiln.lambda_payload)
        self.record = record
        self.principal = principal
        self.call = call
        self.lease = lease
        self.started = time.monotonic()
        self.ttfb_ms: int | None = None
        self.upstream_name: str | None = None
        self.bounds = UsageBounds.of_request(call.body, call.model.context_length, limits=call.api.token_limits,
                                             prompts=call.api.prompts(call.body), choices_field=call.api.choices_field)
        self._prompt_estimate: int | None = None
        self._echoes = _echoes_of(call)  # what the replies may repeat of the request: not the model's
        self._offered = call.api.offered_names(call.body)  # tool names a server may write itself
        self._upstream: UpstreamExchange | None = None
        self._relay_state: SseRelay | None = None
        # renews the lease while the request runs, recording what it has relayed (§4)
        self._keeper = LeaseKeeper(gateway.ledger, lease, progress=self._progress, on_lost=self._lease_lost,
                                   max_seconds=call.model.timeouts.total + gateway.ledger.lease_ttl)
        self._settled = False
        gateway.unsettled += 1  # until its settle ends (the gateway's close waits for it)
        # what a lost lease stops: the task waiting for the model server, until `respond` hands
        # a stream's response over (every other way out of it settles first, and a settled
        # request is stopped no more), then that response (kiln.responses.RelayResponse.interrupt)
        self._worker: asyncio.Task | None = None
        self._response: RelayResponse | None = None
        self._lease_gone = False
        self._sent_to: list[str] = []  # the backends the request went to, as it went

    @property
    def gen_id(self) -> str:
        return self.lease.gen_id

    async def respond(self, receive: Receive | None = None) -> Response:
        """Forward the request and answer; every way out of here settles exactly once.
        `receive`: the request's ASGI channel, its body read: a stream's client that leaves
        while the model server has not answered yet stops the wait (§7), its slot released."""
        self._keeper.start()
        self._worker = asyncio.current_task()  # until the response is made, or the request settled
        try:
            # a stream's client that leaves is noticed from here on (§7); a buffered request
            # runs to its answer, which alone says what the model generated (docs/design.md)
            upstream = await unless_the_client_leaves(self.gateway.upstream.open(
                self.call.model, self.call.api.upstream_path, self.call.body, stream=self.call.stream,
                client=self.lease.org_id, sent=self._sent_to,
            ), receive if self.call.stream else None)
        except GatewayError as error:
            return await self._refused(error)
        except ClientLeft:
            return await self._left()
        except BaseException as exc:
            return await self._crashed(exc)
        self._upstream = upstream
        self.upstream_name = upstream.backend.name
        self.record.backend_failures = len(upstream.failures)
        if self.call.stream:
            # the upstream's part is bounded by the model's total time, every backend tried included
            # (kiln.http1, _relay); the client's by the same, plus one keep-alive interval for the last bytes
            deadline = _deadline_of(upstream, self.call.model.timeouts.total) + self.gateway.settings.keepalive_seconds
            self._worker = None  # this task sends the stream from here: the response is interrupted instead
            self._response = RelayResponse(self._relay(upstream), self.gen_id, on_close=self._never_relayed,
                                           deadline=deadline)
            return self._response
        try:
            return await self._buffered(upstream)
        except GatewayError as error:
            return await self._refused(error)
        except BaseException as exc:
            return await self._crashed(exc)
        finally:
            await upstream.aclose()

    def _lease_lost(self) -> None:
        """The lease could not be kept: the request stops rather than run on without its slot,
        its org over its limit (§4). A wait for the model server is cancelled, and so is a
        stream's (its relay then ends it with the error event; one not begun yet looks at
        `_lease_gone` first); a stream held by a client that does not read is closed as if the
        client had left."""
        if self._settled:
            return
        self._lease_gone = True
        if self._worker is not None:
            self._worker.cancel()
        elif self._response is not None:
            self._response.interrupt()

    async def _never_relayed(self) -> None:
        """The stream's response ended before its body ran (the client left first, or its lease
        was lost while the response's start waited on a client that does not read): settle it."""
        if self._settled:
            return
        if self._upstream is not None:
            await self._upstream.aclose()
        if self._lease_gone:  # the gateway's failure, before any answer: billed nothing
            await self._settle("gateway_error", http_status=None, error=LEASE_NOT_KEPT)
            return
        await self._settle_left("the client left before the stream began")

    # -- the ways an exchange ends ---------------------------------------------------------

    async def _refused(self, error: GatewayError) -> Response:
        status = {
            UpstreamRejected: "upstream_rejected",
            UpstreamFailed: "upstream_error",
            NoBackendAvailable: "no_backend_available",
        }.get(type(error), "gateway_error")
        if isinstance(error, UpstreamRejected):
            self.upstream_name = error.backend  # the upstream used: it answered, with a refusal
            # its code is the model server's own text: counted under the gateway's word for it,
            # logged beside it only if it is a word
            self.record.error_code = "upstream_rejected"
            self.record.upstream_code = short_word(error.upstream_code)
        else:
            self.record.error_code = error.code
        await self._settle(status, http_status=error.status, error=_stored_error(error))
        return error_response(error, self.gen_id)

    async def _left(self) -> Response:
        """The client of a stream left before the model server answered; its request to the
        model server was closed (so generation stops)."""
        await self._settle_left("the client left before the model server answered")
        return Response(status_code=499)  # goes nowhere: the connection is closed

    async def _settle_left(self, error: str) -> None:
        """A client gone before anything was relayed: billed for what was relayed (nothing) and
        the prompt, if a model server was sent it, as a stream it left is. (A request the gateway
        or the model servers failed before any answer is billed nothing: the client is told to
        try again, and an SDK's retries would pay for the same failure each time.)"""
        if not self._sent_to:
            await self._settle("client_disconnected", http_status=None, error=error + ", before it was sent")
            return
        try:
            usage = self._fallback_usage(0)
            cost = self._price(usage)
        except Exception:  # noqa: BLE001 - a bug here must not skip the settle
            log.exception("request %s: its prompt could not be priced", self.gen_id)
            usage, cost = None, Decimal(0)
        await self._settle("client_disconnected", http_status=None, usage=usage, cost=cost, error=error)

    async def _crashed(self, exc: BaseException) -> Response:
        if isinstance(exc, asyncio.CancelledError):
            if self._cancelled_for_the_lease():
                return await self._stopped_for_its_lease()
            # the server is stopping, or the client left
            await self._settle("client_disconnected", http_status=None, error="cancelled before the answer was sent")
            raise exc
        log.exception("request %s failed inside the gateway", self.gen_id, exc_info=exc)
        await self._settle("gateway_error", http_status=500, error=type(exc).__name__)  # its failure: billed nothing
        self.record.error_code = InternalError.code
        if not isinstance(exc, Exception):
            raise exc
        return error_response(InternalError("The gateway failed to process the request."), self.gen_id)

    def _cancelled_for_the_lease(self) -> bool:
        """Whether the cancellation this task got is the lost lease's, and no other's. It is
        then taken back (`uncancel`): the task goes on, to end the request as it should."""
        if not self._lease_gone:
            return False
        task = asyncio.current_task()
        return task is not None and task.uncancel() == 0

    async def _stopped_for_its_lease(self) -> Response:
        """503 for a request stopped before its answer, the gateway's failure: billed nothing."""
        error = StorageUnavailable(SLOT_LOST)
        self.record.error_code = error.code
        await self._settle("gateway_error", http_status=error.status, error=LEASE_NOT_KEPT)
        return error_response(error, self.gen_id)

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
        try:
            event = self._event(status, http_status, usage, cost, finish_reason=finish_reason, error=error)
        except Exception:  # noqa: BLE001 - a bug here must not leave the request unsettled
            log.exception("request %s: its usage event could not be made as it was", self.gen_id)
            try:  # what it is billed, without what describes it
                event = self._event(status, http_status, usage, cost, error=EVENT_NOT_MADE, described=False)
            except BaseException:
                self._settled = True
                await to_the_end(self._give_up())
                raise
        self._settled = True
        # nothing stops a settled request: what it kept for that goes (a stream's response holds
        # its body, which holds this exchange: a cycle left to the collector)
        self._worker = self._response = None
        self.record.usage = event
        # A settle must finish even when this task is cancelled (the client left, or a server
        # that stops): it runs in a task of its own, which this one waits for whatever it is told.
        await to_the_end(self._stop_keeper_and_settle(event))

    def _event(self, status: str, http_status: int | None, usage: TokenUsage | None, cost: Decimal, *,
               finish_reason: str | None = None, error: str | None = None, described: bool = True) -> UsageEvent:
        """The request's usage event; not `described`: what it is billed, without what tells
        how it went (its finish, timings, upstream)."""
        fields = dict(
            gen_id=self.gen_id,
            org_id=self.lease.org_id,
            created_at=iso_ms(self.lease.started),
            key_id=self.lease.key_id,
            model=self.call.model.id,
            endpoint=self.call.api.name,
            streamed=self.call.stream,
            status=status,
            cost=cost,
            http_status=http_status,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cached_tokens=usage.cached_tokens if usage else None,
            usage_source=usage.source if usage else None,
            error=error[:500] if error else None,
        )
        if described:
            fields.update(finish_reason=_stored_finish_reason(finish_reason), ttfb_ms=self.ttfb_ms,
                          duration_ms=int((time.monotonic() - self.started) * 1000), upstream=self.upstream_name)
        return UsageEvent(**fields)

    async def _give_up(self) -> None:
        """No usage event could be made: the lease is left to expire, and a later admission
        reclaims it as `abandoned` (billed what its last renewal recorded), as a dead gateway's."""
        try:
            await self._keeper.stop()
        finally:
            self.gateway.unsettled -= 1
            log.error(json.dumps({"event": "request_unsettled", "generation_id": self.gen_id,
                                  "org_id": self.lease.org_id}))

    async def _stop_keeper_and_settle(self, event: UsageEvent) -> None:
        try:
            await self._keeper.stop()  # no renewal may race the settle
            await self.gateway.settle(self.lease, event)
        finally:
            self.gateway.unsettled -= 1

    def _price(self, usage: TokenUsage) -> Decimal:
        return cost_of(usage, self.call.model.pricing)

    def _progress(self) -> tuple[int, int, Decimal]:
        """What the request has used so far, as its lease renewal records it: the prompt and
        the tokens relayed (a buffered answer relays nothing before it is whole)."""
        relayed = self._relay_state.relayed_tokens if self._relay_state is not None else 0
        usage = TokenUsage(min(self.prompt_estimate(), self.bounds.prompt), min(relayed, self.bounds.completion))
        return usage.prompt_tokens, usage.completion_tokens, self._price(usage)

    def _fallback_usage(self, relayed: int) -> TokenUsage:
        """What is billed when the reported usage could not even be read: the gateway's own counts."""
        try:
            prompt = min(self.prompt_estimate(), self.bounds.prompt)
        except Exception:  # noqa: BLE001 - the estimate is best effort here
            prompt = 0
        return TokenUsage(prompt, min(relayed, self.bounds.completion), None, "estimated")

    def prompt_estimate(self) -> int:
        """The request's prompt tokens by the gateway's own rule (computed once, when needed)."""
        if self._prompt_estimate is None:
            self._prompt_estimate = self.call.api.estimate_prompt(self.call.body)
        return self._prompt_estimate

    def _billable(self, reported: Any, completion_count: Callable[[], int], completion_floor: int = 0) -> TokenUsage:
        """The usage to bill (kiln.metering.billable_usage); the replies' texts counted less what
        each may echo of a prompt the gateway holds as token ids, not text (kiln.echo)."""
        if unseen := self._echoes.unseen_floor:
            completion_floor = max(completion_floor - unseen, 0)
        if unseen := self._echoes.unseen_count:
            counted = completion_count
            completion_count = lambda: max(counted() - unseen, 0)  # noqa: E731 - as it was given, a callable
        usage, problems = billable_usage(
            self.call.api.reported_usage(reported), self.bounds, prompt_estimate=self.prompt_estimate,
            completion_count=completion_count, completion_floor=completion_floor,
            prompt_floor=lambda: self.call.api.fewest_prompt_tokens(self.call.body),
        )
        if problems:
            log.warning(json.dumps({"event": "usage_capped", "generation_id": self.gen_id, "model": self.call.model.id,
                                    "problems": problems}))
        return usage

    # -- buffered --------------------------------------------------------------------------

    async def _buffered(self, upstream: UpstreamExchange) -> Response:
        self.ttfb_ms = int((time.monotonic() - self.started) * 1000)
        raw = await upstream.read_body(_deadline_of(upstream, self.call.model.timeouts.total))
        api = self.call.api
        answer = _parse_answer(raw, api)
        # the answer's texts are at least their fewest tokens, as a stream's are; what they
        # repeat of the request (echo) is not the model's
        written = self._echoes.answer(answer)
        usage = self._billable(answer.get("usage"), lambda: api.estimate_completion(written, self._offered),
                               completion_floor=api.fewest_completion_tokens(written, self._offered))
        cost = self._price(usage)
        if api.failed(answer):  # its error is the model server's text, as a 4xx's message is
            answer = scrubbed(answer, upstream.backend.api_key())
        api.with_usage(answer, usage, cost)
        body = dumps(answer)
        if self._answer_limit is not None and answer_size(body) > self._answer_limit:
            # it would be lost after its settle (the client's retry billed again): refused before
            raise UpstreamFailed(TOO_LARGE_TO_ANSWER)
        await self._settle(
            "upstream_error" if api.failed(answer) else "success", http_status=200, usage=usage, cost=cost,
            finish_reason=api.finish_reason(answer),
        )
        return json_response(body, self.gen_id)

    # -- streamed --------------------------------------------------------------------------

    async def _relay(self, upstream: UpstreamExchange) -> AsyncGenerator[bytes, None]:
        relay = self._relay_state = self.call.api.relay(
            client_wants_usage=self.call.client_wants_usage, max_event_bytes=self.call.model.limits.event_bytes,
            request_bytes=upstream.sent_bytes, echoes=self._echoes, offered=self._offered,
        )
        deadline = _deadline_of(upstream, self.call.model.timeouts.total)
        keepalive = self.gateway.settings.keepalive_seconds
        status, failure = "success", None
        cut_while_held = False  # the deadline passed while the client held a write
        # answered whole (buffered mode), a stream is bounded as a buffered answer is: it ends,
        # its last event kept room for, before what it has relayed (JSON-escaped) could be lost
        room = None if self._answer_limit is None else self._answer_limit - _TAIL_ROOM
        try:
            # One read at a time, each bounded by the keep-alive: `: keepalive` goes out whenever
            # the client has been sent nothing for that long (an upstream that is silent, or one
            # that trickles an event no faster than that), and the read it interrupted loses
            # nothing (kiln.http1).
            sent_at = time.monotonic()
            if self._lease_gone:  # lost before the response could be interrupted; from here on, it is
                raise _LeaseLost()
            while True:
                piece = await upstream.next_piece(sent_at + keepalive)
                now = time.monotonic()
                if now > deadline:
                    raise UpstreamStreamError("exceeded the model's total time", timeout="total")
                if piece == b"":
                    raise UpstreamStreamError(self.call.api.unfinished)
                if piece is None:
                    out = KEEPALIVE  # silent for the interval
                    if room is not None:
                        room = _room_after(KEEPALIVE, room)
                else:
                    try:
                        if room is None:
                            out = relay.feed(piece)
                        else:
                            out, room = _fed_within(relay, piece, room)
                    except (EventTooLarge, _TooLargeToAnswer) as exc:
                        if exc.relayed:  # the events before the one over the bound are the client's
                            yield exc.relayed
                        raise
                    if out and self.ttfb_ms is None:
                        self.ttfb_ms = int((now - self.started) * 1000)
                    elif not out and now - sent_at >= keepalive:
                        out = KEEPALIVE  # always between two whole events: the relay sends only those
                        if room is not None:
                            room = _room_after(KEEPALIVE, room)
                if out:
                    yield out
                    sent_at = time.monotonic()
                    if sent_at > deadline and sent_at - now > _HELD:  # (`now` was within it)
                        cut_while_held = True
                if relay.failure:
                    raise UpstreamStreamError(relay.failure)
                if relay.done:
                    break
        except UpstreamStreamError as exc:
            if exc.timeout == "total" and cut_while_held:
                # the total ran out while the gateway waited on the client's reading, what the
                # backend sent piling up: not the backend's failure, and its health is not told
                # (one client cannot take it out, §5); a backend that never ends is cut as it
                # streams, the client reading or not
                status, failure = "read_too_slowly", CLIENT_READ_TOO_SLOWLY
            else:
                upstream.broke()
                status, failure = "stream_interrupted", str(exc)
        except _LeaseLost:  # storage's failure, not the model server's: its health is not told
            status, failure = "lease_lost", LEASE_NOT_KEPT
        except _TooLargeToAnswer:  # the deployment's bound, not the model server's failure
            status, failure = "too_large_to_answer", OUTGREW
        except asyncio.CancelledError:
            if not self._cancelled_for_the_lease():
                await self._end_stream(upstream, relay, "client_disconnected", self._why_cut(deadline))
                raise
            status, failure = "lease_lost", LEASE_NOT_KEPT
        except GeneratorExit:  # the client left, or, not reading, was cut for a lost lease
            if self._lease_gone:
                await self._end_stream(upstream, relay, "lease_lost", LEASE_NOT_KEPT)
            else:
                await self._end_stream(upstream, relay, "client_disconnected", self._why_cut(deadline))
            raise
        except Exception as exc:  # a fault of ours: still settle, still end the stream clearly
            log.exception("stream %s failed inside the gateway", self.gen_id)
            status, failure = "gateway_error", f"gateway error: {type(exc).__name__}"
        yield LastPiece(await self._end_stream(upstream, relay, status, failure, room=room))

    @staticmethod
    def _why_cut(deadline: float) -> str:
        if time.monotonic() > deadline:
            return CLIENT_READ_TOO_SLOWLY
        return "the client disconnected"

    async def _end_stream(self, upstream: UpstreamExchange, relay: SseRelay, status: str, error: str | None,
                          *, room: int | None = None) -> bytes:
        """Close the upstream, settle, and return the stream's last bytes; never raises.
        `room`: what is left of a stream answered whole (buffered mode), its last event's room aside.

        A success ends with the usage chunk (if the client asked) and `[DONE]`; any other
        end with the §5 error event (nothing, for a client that is gone). Should billing or
        the last bytes fail, the request still settles (as `gateway_error`), billed for what
        the gateway could establish: a failure writing the tail never loses the usage.
        """
        await upstream.aclose()  # no wait: it only closes or keeps the connection
        try:
            usage = self._billable(relay.reported_usage, lambda: relay.relayed_tokens, relay.fewest_tokens)
        except Exception as exc:  # noqa: BLE001 - a bug here must not skip the settle
            log.exception("stream %s could not be billed as reported", self.gen_id)
            status, error = "gateway_error", f"gateway error: {type(exc).__name__}"
            usage = self._fallback_usage(relay.relayed_tokens)
        try:
            cost = self._price(usage)
        except Exception as exc:  # noqa: BLE001 - as above: settled, billed nothing it cannot price
            log.exception("stream %s could not be priced", self.gen_id)
            status, error, cost = "gateway_error", f"gateway error: {type(exc).__name__}", Decimal(0)
        tail = b""
        if status == "success":
            try:
                if relay.upstream_failed and isinstance(getattr(relay, "final", None), dict):
                    # a failed response's error is the model server's text, as a 4xx's message is
                    relay.final = scrubbed(relay.final, upstream.backend.api_key())
                tail = self.call.api.stream_tail(relay, usage, cost, self.call.client_wants_usage)
            except Exception as exc:  # noqa: BLE001 - the usage stands; only the last bytes failed
                log.exception("stream %s: its last event could not be written", self.gen_id)
                status, error = "gateway_error", f"gateway error: {type(exc).__name__}"
            if room is not None and escaped_size(tail) > room + _TAIL_ROOM:
                # the model server's last event, written again with the bill in it, can outgrow its
                # room (`1E15` is `1000000000000000.0`): not sent, the stream ends within its bound
                status, error, tail = "too_large_to_answer", OUTGREW, b""
        settled = "upstream_error" if status == "success" and relay.upstream_failed else _SETTLED_AS.get(status, status)
        await self._settle(
            settled, http_status=200, usage=usage, cost=cost, finish_reason=relay.finish_reason, error=error
        )
        if status == "success":
            return tail
        if status == "client_disconnected":
            return b""
        return self.call.api.stream_error(_CUT_MESSAGES.get(status, STREAM_CUT), relay)


def _parse_answer(raw: bytes, api: ModelApi) -> dict[str, Any]:
    """A buffered answer, if it has the shape the gateway reads; otherwise 502 (§5).

    The gateway reads the answer's content (to estimate it) and `usage`; a body where those
    have other types than the endpoint's is not an answer the client's SDK could read either.
    """
    try:
        # as strict as for clients (NaN and Infinity are nothing the client's SDK could read
        # either), as an answer may repeat a request (kiln.jsonio)
        answer = loads_answer(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise UpstreamFailed(INVALID_ANSWER, detail="upstream body is not a JSON object a client can read")
    problem = api.shape_problem(answer)
    if problem:
        raise UpstreamFailed(INVALID_ANSWER, detail=f"upstream body: {problem}")
    return answer


# what finish reasons and error codes are ("stop", "tool_calls", "context_length_exceeded", …)
_SHORT_WORD = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def short_word(text: str | None) -> str | None:
    """`text` if it is a short word (a finish reason, an error code), else None: what a model
    server sends is stored and logged only in that shape."""
    return text if text is not None and _SHORT_WORD.fullmatch(text) else None


def _stored_finish_reason(reason: str | None) -> str | None:
    """What the usage event keeps of the model server's finish reason: a short word, as finish
    reasons are. Anything else (text of any length, which may quote the prompt, §4) is none:
    an item DynamoDB refuses for its size would leave the request unsettled."""
    return short_word(reason) if isinstance(reason, str) else None


def _stored_error(error: GatewayError) -> str:
    """What the usage event keeps of an error: never a model server's message, which may quote
    the prompt (§4), only its status and error code; the gateway's own words otherwise."""
    if isinstance(error, UpstreamRejected):
        word = short_word(error.upstream_code)  # a code that is not a word may be any text: not kept
        return f"upstream HTTP {error.status} {word}" if word else f"upstream HTTP {error.status}"
    return error.detail or error.message
