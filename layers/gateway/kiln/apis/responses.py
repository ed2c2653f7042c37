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
from ..sse import _IN_BAND_ERROR, UNREAD, SseRelay, _is_error, is_done, parse_json
from .base import ModelApi, capability_check

__all__ = ["API", "ResponsesApi", "ResponsesRelay"]

FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_FINAL = re.compile(rb'"type"\s*:\s*"response\.(?:completed|incomplete|failed)"')
_ERROR = re.compile(rb'"type"\s*:\s*"error"')
# a non-empty delta of text, reasoning or tool-call arguments (counted as chat's texts are), in
# an event that is a delta (`response.output_text.delta`, …): the response an event echoes holds
# the request's metadata, whose values may be under a key "delta"
_DELTA = re.compile(rb'"delta"\s*:\s*"((?:[^"\\]|\\.)+)"')
_DELTA_EVENT = re.compile(rb'"type"\s*:\s*"response\.[a-z_.]+\.delta"')
# an event that may end the stream or give texts whole (a text, part or output item when it is
# added or done, the response so far), and any with an escape, which can spell one
_WHOLE = re.compile(rb'"type"\s*:\s*"response\.(?:[a-z_.]+\.(?:done|added)|created|in_progress|completed|incomplete|failed)"'
                    rb'|\\u')
# the most places in the output whose whole texts a stream's relay remembers (memory)
MAX_WHOLE_PLACES = 10_000


class ResponsesApi(ModelApi):
    name = "responses"
    openapi_body = staticmethod(schemas.responses_body)
    upstream_path = "/responses"
    token_limits = ("max_output_tokens",)
    choices_field = None  # a response is one reply: vLLM and SGLang ignore an `n` sent here
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
    for _, text in _output_parts(answer, offered):
        yield text


def _output_parts(answer: Any, offered: Collection[str] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(where, text) of every text of a response's output: its item's place, then the text's."""
    output = answer.get("output") if isinstance(answer, dict) else None
    for index, item in enumerate(output if isinstance(output, list) else []):
        for where, text in _item_parts(item, offered):
            yield (index, *where), text


# what the model writes in an output item beside its content: a tool call's arguments (or a
# custom tool's input), the code it runs in a code interpreter; the queries of a search, and
# what a search, a browser or a shell action says
_ITEM_TEXTS = ("arguments", "input", "code")
_ACTION_TEXTS = ("query", "url", "pattern")
_LISTED_TEXTS = ("queries", "command")


def _item_texts(item: Any, offered: Collection[str] = ()) -> Iterator[str]:
    for _, text in _item_parts(item, offered):
        yield text


def _item_parts(item: Any, offered: Collection[str] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(where, text) of each text the model wrote in an output item: its content's and its
    summary's texts and refusals (a content given as one text, or one part, is read too), a
    tool call's name (but one of the request's tools', `offered`: a server may write it) and
    what `_ITEM_TEXTS` and its action name."""
    if not isinstance(item, dict):
        return
    name = item.get("name")
    if isinstance(name, str) and name and name not in offered:
        yield ("name",), name
    for field in _ITEM_TEXTS:
        if isinstance(item.get(field), str):
            yield (field,), item[field]
    action = item.get("action")
    for holder, place in ((item, ()), (action, ("action",))):
        if not isinstance(holder, dict):
            continue
        if holder is action:
            for field in _ACTION_TEXTS:
                if isinstance(action.get(field), str):
                    yield ("action", field), action[field]
        for field in _LISTED_TEXTS:
            listed = holder.get(field)
            for index, text in enumerate(listed if isinstance(listed, list) else []):
                if isinstance(text, str):
                    yield (*place, field, index), text
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, (str, dict)):
            parts = [parts]
        for index, part in enumerate(parts if isinstance(parts, list) else []):
            for kind, text in _part_parts(part):
                yield (field, index, kind), text


def _part_parts(part: Any) -> list[tuple[str, str]]:
    """(kind, text) of a content part: its text and its refusal (a part that is a text: itself)."""
    if isinstance(part, str):
        return [("text", part)]
    if not isinstance(part, dict):
        return []
    return [(kind, part[kind]) for kind in ("text", "refusal") if isinstance(part.get(kind), str)]


# where the texts of an event that gives them whole are: by its kind (`response.<kind>.done`),
# the list they are in and the field of the text (or "item" and "part": an output item, a part)
_WHOLE_AT = {
    "output_item": ("item", None), "content_part": ("part", "content"), "reasoning_summary_part": ("part", "summary"),
    "output_text": ("text", "content"), "reasoning_text": ("text", "content"), "refusal": ("refusal", "content"),
    "reasoning_summary_text": ("text", "summary"), "function_call_arguments": ("arguments", None),
    "custom_tool_call_input": ("input", None), "code_interpreter_call_code": ("code", None),
}
_WHOLE_FIELDS = ("text", "refusal", "arguments", "input", "code")


def _whole_parts(data: dict[str, Any], kind: str, offered: Collection[str]) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(where, text) of the texts an event gives whole: `response.<kind>.done` or `.added` (an
    output item, a part, a text), a response (`response.created`, `response.in_progress`):
    placed as the final response would place them, so the same text is one text."""
    if kind in ("created", "in_progress"):
        yield from _output_parts(data.get("response"), offered)
        return
    at = _hashable(data.get("output_index"))
    holds, listed = _WHOLE_AT.get(kind, (None, None))
    index = _hashable(data.get("summary_index" if listed == "summary" else "content_index"))
    if holds == "item":
        for where, text in _item_parts(data.get("item"), offered):
            yield (at, *where), text
    elif holds == "part":
        for part_kind, text in _part_parts(data.get("part")):
            yield (at, listed, index, part_kind), text
    elif holds is not None:
        if isinstance(data.get(holds), str):
            yield ((at, listed, index, holds) if listed else (at, holds)), data[holds]
    else:  # a kind of event the gateway does not know: what it says whole, in a place of its own
        for field in _WHOLE_FIELDS:
            if isinstance(data.get(field), str):
                yield (at, kind, field), data[field]


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else hash(repr(value))


class ResponsesRelay(SseRelay):
    """The Responses API's stream: every event relayed as sent, but the final one, held back
    (its `response.usage` is billed, then sent with `cost`). It has no `[DONE]`: the final
    event is the end (`done`).

    What it relayed is counted from two sources: the deltas (a token each counts best), and
    the texts given whole, by the events that hold an item, a part, a text or the response
    so far (`*.added`, `*.done`, `response.created`, `response.in_progress`, the final): each
    place in the output (item, list, index, field) counts once, its longest text, since an
    honest server sends the same text in three or four of them. The bill's floor and its
    estimate are the most either source says (kiln.exchange)."""

    def __init__(self, *, max_event_bytes: int, offered: Collection[str] = ()) -> None:
        # place -> (fewest tokens, estimated tokens, characters) of its longest text; past
        # MAX_WHOLE_PLACES places, the others are added to `_unplaced`
        self._wholes: dict[tuple[Any, ...], tuple[int, int, int]] = {}
        self._whole_sums = [0, 0, 0]
        super().__init__(client_wants_usage=True, max_event_bytes=max_event_bytes, offered=offered)
        self.final: dict[str, Any] | None = None  # the final event's data
        self.final_name = b""  # its `event:` line, as the upstream wrote it

    @property
    def fewest_tokens(self) -> int:
        return max(self.text_fewest, self._whole_sums[0])

    @property
    def relayed_tokens(self) -> int:
        """The deltas' count, and what the whole texts hold beyond the deltas' text, by the
        estimate (a server may send a few deltas and the rest whole); with no delta, the whole
        texts' estimate."""
        if not self.relayed_texts:
            return self._whole_sums[1]
        beyond = self._whole_sums[2] - self.relayed_bytes  # as sent: never less for the same text
        return self.text_tokens + (estimate_text_tokens("x" * beyond) if beyond > 0 else 0)

    def _count_wholes(self, parts: Iterator[tuple[tuple[Any, ...], str]]) -> None:
        for where, text in parts:
            if not text:
                continue
            known = self._wholes.get(where)
            if known is not None and known[2] >= len(text):
                continue
            counted = (fewest_tokens(text), estimate_text_tokens(text), len(text))
            if known is None and len(self._wholes) >= MAX_WHOLE_PLACES:
                known = (0, 0, 0)  # not remembered: counted as a place of its own each time
            else:
                self._wholes[where] = counted
            for index in range(3):
                self._whole_sums[index] += counted[index] - (known[index] if known else 0)

    def _payload(self, event: bytes, payload: bytes) -> bytes | None:
        if is_done(payload):
            return None  # a chat-style end marker: the Responses API has none (the SDK would stop at it)
        # read what may end the stream or give texts whole: what looks like a final event, an
        # error (the Responses API's or chat's), an event holding an item, a part, a text or
        # the response so far, and any event with an escape (which can spell any of them)
        data = UNREAD
        whole_like = _WHOLE.search(payload)
        if whole_like or _ERROR.search(payload) or _IN_BAND_ERROR.search(payload):
            data = parse_json(payload)
            kind = data.get("type") if isinstance(data, dict) else None
            if kind in FINAL_EVENTS:
                if not isinstance(data.get("response"), dict):
                    return self._failed(f"its final event ({kind}) has no response object")
                return self._final(event, data)
            if kind == "error" or _is_error(data):
                # the stream ends with the gateway's one error event (§9), whether the server
                # wrote the Responses API's error event or chat's (`{"error": {...}}`)
                return self._failed("the model server sent an error event")
            if whole_like and data is None and _FINAL.search(payload):
                return self._failed("its final event is not JSON the gateway can read")
            if isinstance(kind, str) and kind.startswith("response."):
                kind = kind[len("response."):]
                if kind in ("created", "in_progress") or kind.endswith((".done", ".added")):
                    self._count_wholes(_whole_parts(data, kind.rpartition(".")[0] or kind, self._offered))
                elif kind.endswith(".delta"):
                    self._count(_DELTA, payload, data)
            return event
        if _DELTA_EVENT.search(payload):
            self._count(_DELTA, payload, data)  # a delta's text; `"delta"` elsewhere (an echo) is not
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
        self._count_wholes(_output_parts(data["response"], self._offered))
        status = data["response"].get("status")
        self.finish_reason = status if isinstance(status, str) else None
        self.upstream_failed = data["type"] == "response.failed"
        self.done = True
        return None


API = ResponsesApi()
