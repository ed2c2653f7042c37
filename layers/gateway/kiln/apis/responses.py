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
_DELTA_EVENT = re.compile(rb'"type"\s*:\s*"response\.([a-z_.]+)\.delta"')
_ITEM_ID = re.compile(rb'"item_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
_SUMMARY_INDEX = re.compile(rb'"summary_index"\s*:\s*(-?[0-9]+)')
# an event that may end the stream or give texts whole (a text, part or output item when it is
# added or done, the response so far), and any with an escape, which can spell one
_WHOLE = (rb'"type"\s*:\s*"response\.(?:[a-z_.]+\.(?:done|added)|queued|created|in_progress|completed|'
          rb'incomplete|failed)"|\\u')
# what the relay reads as JSON: those, and what may be an error (the Responses API's, or chat's)
_READ = re.compile(_WHOLE + rb"|" + _ERROR.pattern + rb"|" + _IN_BAND_ERROR.pattern)
# what a stream's relay remembers of the texts it relayed, to tell the whole texts from the
# deltas (memory): the bytes of both, the deltas' items, and the bytes compared at the end;
# past them, a text is counted whole as it comes (more, never less)
MAX_WHOLE_BYTES = 16 << 20
MAX_DELTA_GROUPS = 10_000
MAX_COMPARED_BYTES = 64 << 20


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


def _output_texts(answer: Any, offered: Collection[str] = ()) -> Iterator[str]:
    """Every text of a response's output items (`_item_texts`)."""
    output = answer.get("output") if isinstance(answer, dict) else None
    for item in output if isinstance(output, list) else []:
        yield from _item_texts(item, offered)


# what the model writes in an output item beside its content: a tool call's arguments (or a
# custom tool's input), the code it runs in a code interpreter; the queries of a search, and
# what a search, a browser or a shell action says
_ITEM_TEXTS = ("arguments", "input", "code")
_ACTION_TEXTS = ("query", "url", "pattern")
_LISTED_TEXTS = ("queries", "command")


def _item_texts(item: Any, offered: Collection[str] = ()) -> Iterator[str]:
    """The texts the model wrote in an output item: its content's and its summary's texts and
    refusals (a content given as one text, or one part, is read too), a tool call's name (but
    one of the request's tools', `offered`: a server may write it) and what `_ITEM_TEXTS` and
    its action name."""
    if not isinstance(item, dict):
        return
    name = item.get("name")
    if isinstance(name, str) and name not in offered:
        yield name
    yield from (item[field] for field in _ITEM_TEXTS if isinstance(item.get(field), str))
    action = item.get("action")
    if isinstance(action, dict):
        yield from (action[field] for field in _ACTION_TEXTS if isinstance(action.get(field), str))
    for holder in (item, action):
        for field in _LISTED_TEXTS if isinstance(holder, dict) else ():
            listed = holder.get(field)
            yield from (text for text in (listed if isinstance(listed, list) else []) if isinstance(text, str))
    for field in ("content", "summary"):
        parts = item.get(field)
        for part in [parts] if isinstance(parts, (str, dict)) else parts if isinstance(parts, list) else []:
            yield from _part_texts(part)


def _part_texts(part: Any) -> list[str]:
    """A content part's text and refusal (a part that is a text: itself)."""
    if isinstance(part, str):
        return [part]
    if not isinstance(part, dict):
        return []
    return [part[kind] for kind in ("text", "refusal") if isinstance(part.get(kind), str)]


# the fields of an event that give a text whole (`response.output_text.done`'s text,
# `response.function_call_arguments.done`'s arguments, `response.code_interpreter_call_code.done`'s code, …)
_WHOLE_FIELDS = ("text", "refusal", "arguments", "input", "code")
# the events that hold the response so far
_SNAPSHOTS = ("queued", "created", "in_progress")


def _whole_texts(data: dict[str, Any], kind: str, offered: Collection[str]) -> list[str]:
    """The texts an event gives whole: a response so far (`_SNAPSHOTS`), or, in a `*.added` or
    `*.done` event, its item, its part and its own text fields."""
    if kind in _SNAPSHOTS:
        return list(_output_texts(data.get("response"), offered))
    texts = list(_item_texts(data.get("item"), offered)) + _part_texts(data.get("part"))
    return texts + [data[field] for field in _WHOLE_FIELDS if isinstance(data.get(field), str)]


class ResponsesRelay(SseRelay):
    """The Responses API's stream: every event relayed as sent, but the final one, held back
    (its `response.usage` is billed, then sent with `cost`). It has no `[DONE]`: the final
    event is the end (`done`).

    What it relayed is counted from two sources: the deltas (a token each counts best), kept
    by item and kind (`output_text`, `function_call_arguments`, …), and the texts given whole
    by the events that hold an item, a part, a text or the response so far (`*.added`,
    `*.done`, `response.queued`, `response.created`, `response.in_progress`, the final). An
    honest server gives each text whole in three or four events, after its deltas, however
    it numbers them: so a whole text counts once, as many times as one event holds it, and
    only what the deltas did not spell already (the whole of an item's deltas, a part of it,
    or what a text holds beyond the deltas that began it)."""

    def __init__(self, *, max_event_bytes: int, offered: Collection[str] = ()) -> None:
        # (item, kind) -> the deltas' texts as sent (JSON string contents, joined when read)
        self._deltas: dict[tuple[bytes, bytes], list[bytes]] = {}
        # each whole text -> the most times one event held it; past MAX_WHOLE_BYTES of them
        # remembered, what comes is counted as it comes (`_unremembered`)
        self._wholes: dict[str, int] = {}
        self._remembered = 0  # the bytes of deltas and whole texts remembered
        self._unremembered = [0, 0]  # fewest and estimated tokens of texts not remembered
        self._counted: tuple[int, tuple[int, int]] | None = None  # (version, what `_beyond` said)
        self._version = 0
        super().__init__(client_wants_usage=True, max_event_bytes=max_event_bytes, offered=offered)
        self.final: dict[str, Any] | None = None  # the final event's data
        self.final_name = b""  # its `event:` line, as the upstream wrote it

    @property
    def fewest_tokens(self) -> int:
        return self.text_fewest + self._beyond()[0]

    @property
    def relayed_tokens(self) -> int:
        """The deltas' count (a token each counts best), and the whole texts' estimate for what
        they hold that the deltas did not spell."""
        return self.text_tokens + self._beyond()[1]

    def _beyond(self) -> tuple[int, int]:
        """(fewest, estimated) tokens of what the whole texts hold beyond the deltas."""
        if self._counted is not None and self._counted[0] == self._version:
            return self._counted[1]
        spelled: dict[str, None] = {}
        for parts in self._deltas.values():
            text = parse_json(b'"' + b"".join(parts) + b'"')
            if isinstance(text, str) and text:
                spelled[text] = None
        fewest, estimated = self._unremembered
        budget = MAX_COMPARED_BYTES
        for text, times in self._wholes.items():
            extra, rest = times, ""
            if text in spelled:
                extra = times - 1
            else:
                for deltas in spelled:
                    if budget <= 0:
                        break
                    budget -= len(deltas)
                    if text in deltas:
                        extra = times - 1
                        break
                    if text.startswith(deltas):
                        extra, rest = times - 1, text[len(deltas):]
                        break
            for counted in ([rest] if rest else []) + [text] * max(extra, 0):
                fewest += fewest_tokens(counted)
                estimated += estimate_text_tokens(counted)
        self._counted = (self._version, (fewest, estimated))
        return fewest, estimated

    def _remember(self, size: int) -> bool:
        self._version += 1
        if self._remembered + size > MAX_WHOLE_BYTES:
            return False
        self._remembered += size
        return True

    def _count_wholes(self, texts: list[str]) -> None:
        held: dict[str, int] = {}
        for text in texts:
            if text:
                held[text] = held.get(text, 0) + 1
        for text, times in held.items():
            known = self._wholes.get(text)
            if known is not None:
                if times > known:
                    self._wholes[text] = times
                    self._version += 1
            elif self._remember(len(text)):
                self._wholes[text] = times
            else:
                self._unremembered[0] += fewest_tokens(text) * times
                self._unremembered[1] += estimate_text_tokens(text) * times

    def _count_delta(self, payload: bytes, data: Any, kind: re.Match[bytes] | None = None) -> None:
        """A delta event: its text counted as chat's are (SseRelay._count), and kept by its item
        and kind (a reasoning summary's by its part too) to be told from the whole texts.
        `data`: the event read (UNREAD: not read, then `kind` is its type found as sent)."""
        if isinstance(data, dict):
            self._count(_DELTA, payload, data)
            delta, name = data.get("delta"), data.get("type")
            if not isinstance(delta, str) or not delta or not isinstance(name, str):
                return
            raw = [dumps(delta)[1:-1]]
            item = data.get("item_id")
            group = (dumps(item) if item is not None else b"", name.encode("utf-8", "surrogatepass"),
                     dumps(data.get("summary_index")))
        else:
            raw = _DELTA.findall(payload)
            for text in raw:  # as SseRelay._count, the event having no escape
                self._add_text(text)
            if not raw or kind is None:
                return
            item_found = _ITEM_ID.search(payload)
            summary = _SUMMARY_INDEX.search(payload) if kind.group(1) == b"reasoning_summary_text" else None
            group = (b'"' + item_found.group(1) + b'"' if item_found else b"",
                     b"response." + kind.group(1) + b".delta", summary.group(1) if summary else b"null")
        size = sum(len(part) for part in raw)
        if (group in self._deltas or len(self._deltas) < MAX_DELTA_GROUPS) and self._remember(size):
            self._deltas.setdefault(group, []).extend(raw)

    def _payload(self, event: bytes, payload: bytes) -> bytes | None:
        if is_done(payload):
            return None  # a chat-style end marker: the Responses API has none (the SDK would stop at it)
        # read what may end the stream or give texts whole: what looks like a final event, an
        # error (the Responses API's or chat's), an event holding an item, a part, a text or
        # the response so far, and any event with an escape (which can spell any of them)
        data = UNREAD
        if _READ.search(payload):
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
            if data is None and _FINAL.search(payload):
                return self._failed("its final event is not JSON the gateway can read")
            if isinstance(kind, str) and kind.startswith("response."):
                kind = kind[len("response."):]
                if kind in _SNAPSHOTS or kind.endswith((".done", ".added")):
                    self._count_wholes(_whole_texts(data, kind, self._offered))
                elif kind.endswith(".delta"):
                    self._count_delta(payload, data)
            return event
        kind_found = _DELTA_EVENT.search(payload)
        if kind_found is not None:
            self._count_delta(payload, UNREAD, kind_found)  # a delta's text; `"delta"` elsewhere (an echo) is not
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
        self._count_wholes(list(_output_texts(data["response"], self._offered)))
        status = data["response"].get("status")
        self.finish_reason = status if isinstance(status, str) else None
        self.upstream_failed = data["type"] == "response.failed"
        self.done = True
        return None


API = ResponsesApi()
