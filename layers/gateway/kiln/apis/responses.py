"""POST /v1/responses, the OpenAI Responses API (contract §9).

The body is forwarded as sent (`input` is not validated), except for the capability checks
chat has (forced `tool_choice`, `text.format` of JSON types) and `background`, refused: a
background response runs on after its request, unmetered. Usage comes as
`input_tokens`/`output_tokens`; the stream is `event:`/`data:` pairs with no `[DONE]`, and
its final event (`response.completed`, `response.incomplete` or `response.failed`) carries
the usage under `response.usage`: that event is held back, settled, and sent with
`usage.cost` added. The gateway keeps no conversation state: `store` and
`previous_response_id` are the model server's business.
"""

from __future__ import annotations

import re
from typing import Any, Collection, Iterator

from .. import schemas
from ..echo import Echoes
from ..errors import UnsupportedParameter
from ..jsonio import dumps
from ..lax import server_bool
from ..metering import (
    TOKENS_PER_MESSAGE,
    TokenUsage,
    content_texts,
    estimate_input_tokens,
    estimate_rendered_tokens,
    estimate_text_tokens,
    fewest_prompt_text_tokens,
    fewest_tokens,
)
from ..sse import UNREAD, SseRelay, is_done, parse_json
from .base import ModelApi, capability_check

__all__ = ["API", "ResponsesApi", "ResponsesRelay"]

FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_FINAL = re.compile(rb'"type"\s*:\s*"response\.(?:completed|incomplete|failed)"')
_ERROR = re.compile(rb'"type"\s*:\s*"error"')
# a non-empty delta of text, reasoning or tool-call arguments (counted as chat's texts are)
_DELTA = re.compile(rb'"delta"\s*:\s*"((?:[^"\\]|\\.)+)"')
# an event that gives a whole text, part or output item when it is done (`response.output_text.done`,
# `response.content_part.done`, `response.output_item.done`, …)
_DONE = re.compile(rb'"type"\s*:\s*"response\.[a-z_.]+\.done"')
# what a done event holds whole: its text, its part or its item
_DONE_HOLDS = {"output_item": "item", "content_part": "part", "reasoning_summary_part": "part"}


class ResponsesApi(ModelApi):
    name = "responses"
    openapi_body = staticmethod(schemas.responses_body)
    upstream_path = "/responses"
    token_limits = ("max_output_tokens",)
    unfinished = "the stream ended before its final event"

    def check(self, body: dict[str, Any], model: Any) -> None:
        # a background response goes on after its request has ended (and is fetched by a
        # route the gateway does not have): its tokens would never be metered
        if server_bool(body.get("background")):
            raise UnsupportedParameter(
                "Background responses are not available through this gateway: they run on after the request "
                "ends, where they cannot be metered. Send background false and stream the response instead.",
                param="background",
            )
        text = body.get("text")
        capability_check(model, body.get("tool_choice"), (text.get("format") if isinstance(text, dict) else None,
                                                          "text.format"))

    def reported_usage(self, usage: Any) -> Any:
        if not isinstance(usage, dict):
            return usage
        details = usage.get("input_tokens_details")
        return {
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": {"cached_tokens": details.get("cached_tokens")} if isinstance(details, dict) else None,
        }

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        items = body.get("input")
        if not isinstance(items, list):
            items = [items] if items is not None else []
        instructions = body.get("instructions")
        tokens = estimate_text_tokens(instructions) if isinstance(instructions, str) else 0
        return (tokens + sum(TOKENS_PER_MESSAGE + estimate_input_tokens(item) for item in items)
                + estimate_rendered_tokens(body.get("tools")))

    def fewest_prompt_tokens(self, body: dict[str, Any]) -> int:
        """The instructions, and each input item's text (a string, the content of a message
        item, a tool's output) but the assistant's, which the model's template may drop (as
        chat's); none with `truncation` other than "disabled", which lets the server drop items."""
        if body.get("truncation") not in (None, "disabled"):
            return 0
        items = body.get("input")
        texts = [body.get("instructions")]
        for item in items if isinstance(items, list) else [items]:
            if not isinstance(item, dict):
                texts.append(item)
            elif item.get("role") != "assistant":
                texts += content_texts(item.get("content"))
                if item.get("type") == "function_call_output":
                    texts += content_texts(item.get("output"))
        return sum(fewest_prompt_text_tokens(text) for text in texts if isinstance(text, str))

    def shape_problem(self, answer: dict[str, Any]) -> str | None:
        output = answer.get("output", [])
        if not isinstance(output, list) or not all(isinstance(item, dict) for item in output):
            return "output is not an array of objects"
        return None

    def estimate_completion(self, answer: dict[str, Any], offered: Collection[str] = ()) -> int:
        return sum(estimate_text_tokens(text) for text in _output_texts(answer, offered))

    def fewest_completion_tokens(self, answer: dict[str, Any], offered: Collection[str] = ()) -> int:
        return sum(fewest_tokens(text) for text in _output_texts(answer, offered))

    def with_usage(self, answer: dict[str, Any], usage: TokenUsage, cost: Any) -> None:
        answer["usage"] = _with_cost(answer.get("usage"), usage, cost)

    def finish_reason(self, answer: dict[str, Any]) -> str | None:
        status = answer.get("status")
        return status if isinstance(status, str) else None

    def failed(self, answer: dict[str, Any]) -> bool:
        return answer.get("status") == "failed"

    def relay(self, *, client_wants_usage: bool, max_event_bytes: int, request_bytes: int = 0,
              echoes: Echoes | None = None, offered: Collection[str] = ()) -> SseRelay:
        # every event that carries the response object echoes the request (its instructions,
        # tools, metadata): the bound is the model's plus the request's own size
        return ResponsesRelay(max_event_bytes=max_event_bytes + request_bytes, offered=offered)

    def stream_tail(self, relay: SseRelay, usage: TokenUsage, cost: Any, client_wants_usage: bool) -> bytes:
        assert isinstance(relay, ResponsesRelay) and relay.final is not None
        response = dict(relay.final["response"])
        response["usage"] = _with_cost(response.get("usage"), usage, cost)
        return relay.final_name + b"data: " + dumps({**relay.final, "response": response}) + b"\n\n"

    def stream_error(self, message: str) -> bytes:
        return b"event: error\ndata: " + dumps({"type": "error", "code": "upstream_error", "message": message}) + b"\n\n"


def _with_cost(reported: Any, usage: TokenUsage, cost: Any) -> dict[str, Any]:
    """The upstream's usage object with `cost`, if it was believed; else the billed one."""
    if usage.source == "upstream" and isinstance(reported, dict):
        return {**reported, "cost": cost}
    billed: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
        "cost": cost,
    }
    return billed


def _output_texts(answer: dict[str, Any], offered: Collection[str] = ()) -> Iterator[str]:
    """Every text of a response's output items (`_item_texts`)."""
    output = answer.get("output")
    for item in output if isinstance(output, list) else []:
        yield from _item_texts(item, offered)


def _item_texts(item: Any, offered: Collection[str] = ()) -> Iterator[str]:
    """The texts the model wrote in an output item: its texts, refusals and reasoning, a tool
    call's name (but one of the request's tools', `offered`: a server may write it) and
    arguments (or a custom tool call's input)."""
    if not isinstance(item, dict):
        return
    name = item.get("name")
    texts: list[Any] = [None if isinstance(name, str) and name in offered else name, item.get("arguments"),
                        item.get("input")]
    for part_list in (item.get("content"), item.get("summary")):
        for part in part_list if isinstance(part_list, list) else []:
            texts += _part_texts(part)
    yield from (text for text in texts if isinstance(text, str))


def _part_texts(part: Any) -> list[Any]:
    return [part.get("text"), part.get("refusal")] if isinstance(part, dict) else []


def _done_texts(data: Any, offered: Collection[str] = ()) -> tuple[str, list[Any]]:
    """What a done event holds whole ("item", "part" or "text") and its texts."""
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        return "text", []
    holds = _DONE_HOLDS.get(kind[len("response."):-len(".done")], "text")
    if holds == "item":
        return holds, list(_item_texts(data.get("item"), offered))
    if holds == "part":
        return holds, _part_texts(data.get("part"))
    return holds, [data.get(name) for name in ("text", "refusal", "arguments", "input")]


class ResponsesRelay(SseRelay):
    """The Responses API's stream: every event relayed as sent, but the final one, held back
    (its `response.usage` is billed, then sent with `cost`). It has no `[DONE]`: the final
    event is the end (`done`)."""

    def __init__(self, *, max_event_bytes: int, offered: Collection[str] = ()) -> None:
        # what the texts relayed hold, by where they came: deltas, done events (a whole text,
        # part or item each: the three kinds hold the same texts, so each is summed apart), the
        # final response; the bill's floor and estimate are the most any of them says
        # [fewest tokens, estimated tokens, characters]
        self._done: dict[str, list[int]] = {"text": [0, 0, 0], "part": [0, 0, 0], "item": [0, 0, 0]}
        self._final_tokens = (0, 0, 0)
        super().__init__(client_wants_usage=True, max_event_bytes=max_event_bytes, offered=offered)
        self.final: dict[str, Any] | None = None  # the final event's data
        self.final_name = b""  # its `event:` line, as the upstream wrote it

    @property  # type: ignore[override]
    def fewest_tokens(self) -> int:
        return max(self._delta_fewest, self._final_tokens[0], *(kind[0] for kind in self._done.values()))

    @fewest_tokens.setter
    def fewest_tokens(self, value: int) -> None:  # the deltas' (SseRelay._count)
        self._delta_fewest = value

    @property  # type: ignore[override]
    def relayed_tokens(self) -> int:
        """The deltas' count (a token each counts best), and what the whole texts hold beyond
        the deltas' text, by the estimate (a server may send a few deltas and the rest whole);
        with no delta, the whole texts' estimate."""
        wholes = [self._final_tokens, *self._done.values()]
        if not self.relayed_texts:
            return max(whole[1] for whole in wholes)
        beyond = max(whole[2] for whole in wholes) - self.relayed_bytes  # as sent: never less for the same text
        return self._delta_tokens + (estimate_text_tokens("x" * beyond) if beyond > 0 else 0)

    @relayed_tokens.setter
    def relayed_tokens(self, value: int) -> None:
        self._delta_tokens = value

    def _count_done(self, data: Any) -> None:
        holds, texts = _done_texts(data, self._offered)
        counts = self._done[holds]
        for text in texts:
            if isinstance(text, str) and text:
                counts[0] += fewest_tokens(text)
                counts[1] += estimate_text_tokens(text)
                counts[2] += len(text)

    def _payload(self, event: bytes, payload: bytes) -> bytes | None:
        if is_done(payload):
            return None  # a chat-style end marker: the Responses API has none (the SDK would stop at it)
        final_like = _FINAL.search(payload)
        # read what may end the stream: what looks like a final or an error event, and any
        # event with an escape (which can spell either type)
        data = UNREAD
        done_like = _DONE.search(payload)
        if final_like or done_like or _ERROR.search(payload) or b"\\u" in payload:
            data = parse_json(payload)
            kind = data.get("type") if isinstance(data, dict) else None
            if kind in FINAL_EVENTS:
                if not isinstance(data.get("response"), dict):
                    return self._failed(f"its final event ({kind}) has no response object")
                return self._final(event, data)
            if kind == "error":  # the stream ends with the gateway's one error event (§9)
                return self._failed("the model server sent an error event")
            if final_like and data is None:
                return self._failed("its final event is not JSON the gateway can read")
            if isinstance(kind, str) and kind.endswith(".done"):
                self._count_done(data)
        self._count(_DELTA, payload, data)
        return event

    def _final(self, event: bytes, data: dict[str, Any]) -> None:
        self.final = data
        self.final_name = b"".join(line + b"\n" for line in event.split(b"\n") if line.startswith(b"event:"))
        usage = data["response"].get("usage")
        if isinstance(usage, dict):
            self.reported_usage = usage
        # the final response holds the whole output: its texts bound the bill from below whether
        # or not they came as deltas (a server may send them only in *.done events, or only
        # here), and are the estimate when no delta came (deltas, a token each, count better)
        texts = list(_output_texts(data["response"], self._offered))
        self._final_tokens = (sum(fewest_tokens(text) for text in texts), sum(estimate_text_tokens(text) for text in texts),
                              sum(len(text) for text in texts))
        status = data["response"].get("status")
        self.finish_reason = status if isinstance(status, str) else None
        self.upstream_failed = data["type"] == "response.failed"
        self.done = True
        return None


API = ResponsesApi()
