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

import hashlib
import json
import re
from typing import Any, Collection, Iterator

from .. import schemas
from ..echo import Echoes
from ..errors import UnsupportedParameter
from ..jsonio import dumps
from ..lax import server_bool
from ..metering import (
    CHARS_PER_TOKEN,
    LONGEST_TOKEN,
    TOKENS_PER_MESSAGE,
    TokenUsage,
    content_texts,
    estimate_input_tokens,
    estimate_rendered_tokens,
    estimate_text_tokens,
    fewest_prompt_text_tokens,
    fewest_tokens,
    shown_usage,
)
from ..sse import NON_EMPTY_STRING, STRING, SseRelay, is_done, is_error_object, may_be_error, parse_json
from .base import ECHO_ESCAPED, ModelApi, capability_check, tool_choice_type_check

__all__ = ["API", "ResponsesApi", "ResponsesRelay"]

FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_FINAL = re.compile(rb'"type"\s*:\s*"response\.(?:completed|incomplete|failed)"')
_ERROR = re.compile(rb'"type"\s*:\s*"error"')
# a non-empty delta of text, reasoning or tool-call arguments (counted as chat's texts are), in
# an event that is a delta (`response.output_text.delta`, …): the response an event echoes holds
# the request's metadata, whose values may be under a key "delta"
_DELTA = re.compile(rb'"delta"\s*:\s*"(' + NON_EMPTY_STRING + rb')"')
_DELTA_EVENT = re.compile(rb'"type"\s*:\s*"response\.([a-z_.]+)\.delta"')
# a delta that is no string (an array, an object, a number, NaN), read as JSON (`_text_of`)
_UNSTRUNG_DELTA = re.compile(rb'"delta"\s*:\s*[^"\s]')
_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d{1,18})[\s,}]')
_ITEM_ID = re.compile(rb'"item_id"\s*:\s*"(' + STRING + rb')"')
# an event that may end the stream or give texts whole (a text, part or output item when it is
# added or done, the response so far); any with an escape, which can spell one, is read too
_WHOLE = re.compile(rb'"type"\s*:\s*"response\.(?:[a-z_.]+\.(?:done|added)|queued|created|in_progress|completed|'
                    rb'incomplete|failed)"')


def _read(payload: bytes) -> bool:
    """Whether the relay reads an event as JSON: one of `_WHOLE`, one with an escape, and what
    may be an error (the Responses API's, or chat's). Each part is looked for by its literal
    first: an alternation with none first is tried at every byte of every event."""
    if payload.find(b"\\u") >= 0 or _WHOLE.search(payload) is not None:
        return True
    return payload.find(b'"error"') >= 0 and (_ERROR.search(payload) is not None or may_be_error(payload))


# what a stream's relay remembers (memory): the output items it counts one by one, and the
# distinct texts given apart of one item; past them, texts count as they come (more, never less)
MAX_ITEMS = 1_000
MAX_ITEM_PARTS = 32
# an item's id is remembered as itself up to this length, past it by a digest (an id as long as
# an event, a thousand times over, would be a gigabyte)
MAX_ID_BYTES = 256
MAX_SEEN_TEXTS = 4_096
# the deltas' text a stream's relay keeps to find the texts given whole in (past it, what those
# hold beyond it counts again), and the bytes it may search for them
MAX_KEPT_DELTA_BYTES = 2 << 20
MAX_SEARCHED_BYTES = 64 << 20
LINEAR_SEARCH_BYTES = 30_000


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
        tool_choice_type_check(body.get("tool_choice"))

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
        if is_error_object(answer) and not _a_response(answer):
            return "an error object, not a response"
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
        # tools, metadata): the bound is the model's plus the request's own size, as a server
        # escaping its non-ASCII text may write it (ECHO_ESCAPED, as an echoed prompt)
        return ResponsesRelay(max_event_bytes=max_event_bytes + ECHO_ESCAPED * request_bytes, offered=offered)

    def stream_tail(self, relay: SseRelay, usage: TokenUsage, cost: Any, client_wants_usage: bool) -> bytes:
        assert isinstance(relay, ResponsesRelay) and relay.final is not None
        response = dict(relay.final["response"])
        response["usage"] = _with_cost(response.get("usage"), usage, cost)
        # named by its type, whatever the server named it: openai-python reads an event named
        # `thread.*` as an Assistants event, and would never see this one (nor its usage)
        kind = relay.final["type"].encode()
        return b"event: " + kind + b"\ndata: " + dumps({**relay.final, "response": response}) + b"\n\n"

    def stream_error(self, message: str, relay: SseRelay) -> bytes:
        # the Responses API's error event, as the SDKs read it: the Vercel AI SDK refuses one
        # without a sequence number (and so loses the error), openai-python types it as an int
        event = {"type": "error", "code": "upstream_error", "message": message, "param": None,
                 "sequence_number": relay.next_sequence if isinstance(relay, ResponsesRelay) else 0}
        return b"event: error\ndata: " + dumps(event) + b"\n\n"


def _a_response(answer: dict[str, Any]) -> bool:
    """Whether an answer is a response object, failed ones included (their `error` is theirs):
    named one, or with a response's status or output, which an error object has not."""
    return answer.get("object") == "response" or "status" in answer or "output" in answer


def _with_cost(reported: Any, usage: TokenUsage, cost: Any) -> dict[str, Any]:
    """The upstream's usage object with `cost`, if it was believed; else the billed one."""
    if usage.source == "upstream" and isinstance(reported, dict):
        return shown_usage(reported, usage, cost)
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
    yield from (text for text in (_text_of(item.get(field)) for field in _ITEM_TEXTS) if text is not None)
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
    """A content part's text and refusal (a part that is no object: itself, `_text_of`)."""
    if not isinstance(part, dict):
        text = _text_of(part)
        return [] if text is None else [text]
    return [text for text in (_text_of(part.get(kind)) for kind in ("text", "refusal")) if text is not None]


def _text_of(value: Any) -> str | None:
    """What a field that holds text gives the client: a string, itself; an array, an object or
    a number (no text a model server should send, but the SDKs hand it to the client as it
    came, and it is counted as chat's are), its JSON; nothing else (null, a boolean, an empty
    array or object) is text."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool) or (isinstance(value, (list, dict)) and not value):
        return None
    return dumps(value).decode("utf-8", "surrogatepass")


# the fields of an event that give a text whole (`response.output_text.done`'s text,
# `response.function_call_arguments.done`'s arguments, `response.code_interpreter_call_code.done`'s code, …)
_WHOLE_FIELDS = ("text", "refusal", "arguments", "input", "code")
# the events that hold the response so far
_SNAPSHOTS = ("queued", "created", "in_progress")


def _measured(texts: Any) -> tuple[int, int, int]:
    """(fewest tokens, estimated tokens, characters) of the texts."""
    fewest = estimated = chars = 0
    for text in texts:
        if text:
            fewest, estimated, chars = fewest + fewest_tokens(text), estimated + estimate_text_tokens(text), chars + len(text)
    return fewest, estimated, chars


def _plus(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


class _Tellings:
    """Texts of an item given whole, summed: their tokens (fewest, estimated), and what of them
    the item's deltas did not spell (fewest, estimated) or did (bytes as sent)."""

    __slots__ = ("fewest", "estimated", "uncovered_fewest", "uncovered_estimated", "covered")

    def __init__(self) -> None:
        self.fewest = self.estimated = self.uncovered_fewest = self.uncovered_estimated = self.covered = 0

    def add(self, text: _Text) -> None:
        self.fewest += text.fewest
        self.estimated += text.estimated
        self.uncovered_fewest += text.uncovered_fewest
        self.uncovered_estimated += text.uncovered_estimated
        self.covered += text.covered

    def counted(self, item: _Item) -> tuple[int, int]:
        """(fewest, estimated) tokens of the item by these tellings: with no delta, theirs; else
        the deltas' count, what they hold that the deltas did not spell, and, by the estimate,
        what they hold of the deltas' text beyond the deltas' bytes (texts spelled by the same
        deltas); the floor at least theirs."""
        if not item.delta_bytes:
            return self.fewest, self.estimated
        beyond = max(self.covered - item.delta_bytes, 0)  # as sent: never less for the same text
        return (max(item.delta_fewest + self.uncovered_fewest + -(-beyond // LONGEST_TOKEN), self.fewest),
                item.delta_tokens + self.uncovered_estimated + -(-beyond // CHARS_PER_TOKEN))


class _Text:
    """One text given whole, measured: its tokens, and what of it the item's deltas did not
    spell (when it was first given) or did."""

    __slots__ = ("fewest", "estimated", "uncovered_fewest", "uncovered_estimated", "covered")

    def __init__(self, text: str, uncovered: str, covered: int) -> None:
        self.fewest, self.estimated = fewest_tokens(text), estimate_text_tokens(text)
        self.uncovered_fewest = fewest_tokens(uncovered) if uncovered else 0
        self.uncovered_estimated = estimate_text_tokens(uncovered)
        self.covered = covered


class _Item:
    """What the relay knows of one output item: its deltas' count (tokens a token each, their
    floor, their bytes as sent), their text as sent (the first MAX_KEPT_DELTA_BYTES of a
    stream's), and its texts given whole (the item in an event, a part, a text:
    `output_text.done`, …) twice over: each distinct text once (`distinct`, by hash, for
    MAX_ITEM_PARTS texts), and every text each telling gave (`told`: by the kind of event,
    `item.done`, `part.done`, `text.done`, the final, …), however often. An honest server
    gives each of an item's parts once in each kind of event; a text given many times over
    (parts of one character, in the item or in as many done events) counts as often."""

    __slots__ = ("delta_tokens", "delta_fewest", "delta_bytes", "sent", "texts", "distinct", "told")

    def __init__(self) -> None:
        self.delta_tokens = self.delta_fewest = self.delta_bytes = 0
        self.sent = bytearray()  # the deltas' texts as sent, one after the other
        self.texts: dict[int, _Text] = {}  # the distinct texts given whole, by hash
        self.distinct = _Tellings()
        self.told: dict[str, _Tellings] = {}

    def counted(self) -> tuple[int, int]:
        """(fewest, estimated) tokens: the most the distinct texts or any one kind of telling say."""
        fewest, estimated = self.distinct.counted(self)
        for tellings in self.told.values():
            other = tellings.counted(self)
            fewest, estimated = max(fewest, other[0]), max(estimated, other[1])
        return fewest, estimated


def _held(needle: bytes, haystack: bytearray, budget: list[int]) -> tuple[int, int]:
    """How much of `needle` `haystack` holds: (its longest prefix, its longest suffix) found in
    it, the whole as the prefix when it is there. An honest server's whole text is its deltas'
    text, a part of it, or it with a start or an end more (a first token never streamed, the
    rest of a text sent whole): those need at most one search. Each search takes its
    haystack's length, at least LINEAR_SEARCH_BYTES, from `budget`: with none left, nothing
    is found (what is not found is counted again: more, never less)."""
    if not haystack or not needle:
        return 0, 0
    if needle.startswith(haystack):
        return len(haystack), 0
    if needle.endswith(haystack):
        return 0, len(haystack)
    # CPython searches a haystack of fewer than 30 000 bytes naively (its time, the haystack's
    # length times the needle's): padded with NUL, which no text as sent holds, it is searched
    # in linear time
    padded = bytes(haystack) + b"\0" * max(LINEAR_SEARCH_BYTES - len(haystack), 0)

    def found(piece: bytes) -> bool:
        if budget[0] <= 0:
            return False
        budget[0] -= len(padded)
        return _contains(padded, piece)

    if found(needle):
        return len(needle), 0
    ends = []
    for piece in (lambda k: needle[:k], lambda k: needle[-k:]):
        held, missing = 0, min(len(needle), len(haystack) + 1)  # held is found, missing is not
        while missing - held > 1:
            middle = (held + missing) // 2
            held, missing = (middle, missing) if found(piece(middle)) else (held, middle)
        ends.append(held)
    return ends[0], ends[1]


def _contains(haystack: bytes, piece: bytes) -> bool:
    return piece in haystack


def _as_sent(text: str) -> bytes:
    """A text as JSON writes it, quotes aside (as `dumps` does, and the deltas are kept)."""
    try:
        return json.dumps(text, ensure_ascii=False)[1:-1].encode()
    except UnicodeEncodeError:  # a lone surrogate: written as an escape, as `dumps` does
        return json.dumps(text)[1:-1].encode()


class ResponsesRelay(SseRelay):
    """The Responses API's stream: every event relayed as sent, but the final one, held back
    (its `response.usage` is billed, then sent with `cost`). It has no `[DONE]`: the final
    event is the end (`done`).

    What it relayed is counted item by item (by the id the server gives each output item,
    in its deltas, its parts and texts, the item itself and the response's output), from
    two sources: the deltas (a token each counts best), and the texts given whole by the
    events that hold an item, a part, a text or the response so far (`*.added`, `*.done`,
    `response.queued`, `response.created`, `response.in_progress`, the final). An honest
    server gives an item's texts whole in three or four events after its deltas, however it
    numbers them: an item counts its deltas and what the distinct texts it was given whole in
    hold beyond them, in what they spell and in bytes (`_Item.counted`); items are summed. A response's item that names no item seen yet (vLLM's
    final output mints new ids) adds only what it does not restate of the texts given whole
    before (`_snapshot`); whole texts of no id count each as an item of their own."""

    def __init__(self, *, max_event_bytes: int, offered: Collection[str] = ()) -> None:
        self._items: dict[Any, _Item] = {}
        # the texts given whole so far, by hash: how many copies of each are billed at least
        # (an item's distinct texts it remembers, once each, `_part`; texts apart, each time):
        # what `_snapshot` may take a new item's text for a restatement of
        self._seen: dict[int, int] = {}
        self._overflow_sum = (0, 0, 0)  # whole texts of items past MAX_ITEMS (and of none), summed
        self._kept = MAX_KEPT_DELTA_BYTES  # the deltas' bytes it may still keep
        self._search = [MAX_SEARCHED_BYTES]  # the bytes it may still search
        super().__init__(client_wants_usage=True, max_event_bytes=max_event_bytes, offered=offered)
        self.final: dict[str, Any] | None = None  # the final event's data
        # the sequence number an event the gateway adds takes: one past the last relayed
        # event's, else (an event with none the gateway can read) one more than the last
        self.next_sequence = 0

    def _item(self, key: Any) -> _Item | None:
        """The item of this id (None: no id, or past MAX_ITEMS: its texts count apart)."""
        if not isinstance(key, (str, bytes)):
            return None
        item = self._items.get(key)
        if item is None and len(self._items) < MAX_ITEMS:
            item = self._items[key] = _Item()
        return item

    def _totals(self) -> tuple[int, int]:
        fewest, estimated = self._overflow_sum[:2]
        for item in self._items.values():
            counted = item.counted()
            fewest, estimated = fewest + counted[0], estimated + counted[1]
        # deltas of items not remembered are in the relay's own count only
        remembered = sum(item.delta_tokens for item in self._items.values())
        remembered_fewest = sum(item.delta_fewest for item in self._items.values())
        return fewest + self.text_fewest - remembered_fewest, estimated + self.text_tokens - remembered

    @property
    def fewest_tokens(self) -> int:
        return self._totals()[0]

    @property
    def relayed_tokens(self) -> int:
        return self._totals()[1]

    def _whole(self, key: Any, texts: list[str], telling: str) -> None:
        """Texts of an item given whole (the item, a part, a text) by an event of the kind `telling`."""
        item = self._item(key)
        if item is None:
            for text in texts:
                if text:
                    self._note_seen(hash(text))
            self._add_apart(texts)
            return
        told = item.told.get(telling)
        if told is None:
            told = item.told[telling] = _Tellings()
        for text in texts:
            if text:
                self._part(item, text, told)

    def _part(self, item: _Item, text: str, told: _Tellings) -> None:
        """A text of the item given whole: counted in its telling every time, and among the
        item's distinct texts once (by its hash, for MAX_ITEM_PARTS of them; past them, every
        time, and not searched for in the deltas), with what of it the deltas did not spell."""
        seen = hash(text)
        measured = item.texts.get(seen)
        if measured is None:
            remembered = len(item.texts) < MAX_ITEM_PARTS
            measured = self._measure(item, text, search=remembered)
            item.distinct.add(measured)
            if remembered:
                item.texts[seen] = measured
                self._note_seen(seen)  # one of the item's distinct texts: billed at least once
        told.add(measured)

    def _measure(self, item: _Item, text: str, *, search: bool) -> _Text:
        if not item.sent or not search:
            return _Text(text, text, 0)
        sent = _as_sent(text)
        prefix, suffix = _held(sent, item.sent, self._search)
        uncovered = sent[prefix:len(sent) - suffix] if prefix + suffix < len(sent) else b""
        return _Text(text, uncovered.decode("utf-8", "ignore"), len(sent) - len(uncovered))

    def _add_apart(self, texts: list[str]) -> None:
        self._overflow_sum = _plus(self._overflow_sum, _measured(texts))

    def _note_seen(self, seen: int) -> None:
        if seen in self._seen or len(self._seen) < MAX_SEEN_TEXTS:
            self._seen[seen] = self._seen.get(seen, 0) + 1

    def _snapshot(self, response: Any, telling: str) -> None:
        """The response so far (the final one, `response.created`, …): its items, each by its id.
        An item that names no item seen before it (vLLM's final output mints new ids) may restate
        an item the stream gave whole before and this event does not hold: each copy billed of
        a text (`_seen`), but those of the items this event holds again, is taken off one new
        item's texts at most; the other texts of new items count. So what a stream's texts given
        whole bill is never less than this event alone would bill (a delta counts a token), and
        items first given here all count."""
        output = response.get("output") if isinstance(response, dict) else None
        given = [(_id_of(item), list(_item_texts(item, self._offered)))
                 for item in (output if isinstance(output, list) else []) if isinstance(item, dict)]
        restated: dict[int, int] = {}  # the copies of `_seen` not left to restate, by hash
        named: set[Any] = set()
        new = []
        for position, (key, _) in enumerate(given):
            if key not in self._items and (key is None or key not in named):
                new.append(position)
            elif key not in named:  # an item seen before, held again: its copies are its own
                for seen in self._items[key].texts:
                    restated[seen] = restated.get(seen, 0) + 1
            named.add(key)
        for position in new:
            key, texts = given[position]
            given[position] = (key, _unrestated(texts, self._seen, restated))
        for key, texts in given:
            self._whole(key, texts, telling)

    def _count_wholes(self, data: dict[str, Any], kind: str) -> None:
        if kind in _SNAPSHOTS:
            self._snapshot(data.get("response"), kind)
            return
        ending = "added" if kind.endswith(".added") else "done"
        item = data.get("item")
        key = _item_key(data.get("item_id"))
        if isinstance(item, dict):
            # vLLM's gpt-oss function call item has no id, but the item_id of its deltas
            self._whole(_id_of(item) or key, list(_item_texts(item, self._offered)), "item." + ending)
        parts = _part_texts(data.get("part"))
        if parts:
            self._whole(key, parts, "part." + ending)
        texts = [text for text in (_text_of(data.get(field)) for field in _WHOLE_FIELDS) if text is not None]
        if texts:
            self._whole(key, texts, "text." + ending)

    def _delta_value(self, key: Any, delta: Any) -> None:
        """A delta read as JSON: its text (`_text_of`), as sent."""
        text = _text_of(delta)
        if text:
            self._delta_of(key, [dumps(text)[1:-1]])

    def _delta_of(self, key: Any, texts: list[bytes]) -> None:
        """Texts of an item's deltas (as sent), counted as chat's are (SseRelay._add_text)."""
        item = self._item(key)
        for text in texts:
            before_tokens, before_fewest = self.text_tokens, self.text_fewest
            self._add_text(text)
            if item is not None:
                item.delta_tokens += self.text_tokens - before_tokens
                item.delta_fewest += self.text_fewest - before_fewest
                item.delta_bytes += len(text)
                if len(text) <= self._kept:
                    self._kept -= len(text)
                    item.sent += _canonical(text)

    def _payload(self, event: bytes, payload: bytes) -> bytes | None:
        if is_done(payload):
            return None  # a chat-style end marker: the Responses API has none (the SDK would stop at it)
        # read what may end the stream or give texts whole: what looks like a final event, an
        # error (the Responses API's or chat's), an event holding an item, a part, a text or
        # the response so far, and any event with an escape (which can spell any of them)
        kind_found = _DELTA_EVENT.search(payload)
        if _read(payload):
            data = parse_json(payload)
            if data is None:
                # not JSON the gateway reads, though a client's parser may (1e999; a type given
                # twice, the last one the client's): what it holds cannot be counted, so it is
                # not relayed
                return self._failed("it sent an event that is not JSON the gateway can read")
            kind = data.get("type") if isinstance(data, dict) else None
            if kind == "error" or is_error_object(data, streamed=True):
                # the stream ends with the gateway's one error event (§9), whether the server
                # wrote the Responses API's error event or chat's (`{"error": {...}}`), or put
                # an error on any other event, the final one included: the SDKs raise on it
                return self._failed("the model server sent an error event")
            if kind in FINAL_EVENTS:
                if not isinstance(data.get("response"), dict):
                    return self._failed(f"its final event ({kind}) has no response object")
                return self._final(data)
            number = data.get("sequence_number") if isinstance(data, dict) else None
            self.next_sequence = number + 1 if type(number) is int and number >= 0 else self.next_sequence + 1
            if isinstance(kind, str) and kind.startswith("response."):
                kind = kind[len("response."):]
                if kind in _SNAPSHOTS or kind.endswith((".done", ".added")):
                    self._count_wholes(data, kind)
                elif kind.endswith(".delta"):
                    self._delta_value(_item_key(data.get("item_id")), data.get("delta"))
            return event
        if kind_found is not None:  # a delta's text; `"delta"` elsewhere (an echo) is not
            found = _DELTA.findall(payload)
            if len(found) == payload.count(b'"delta"'):  # every delta a non-empty string (nearly every event)
                self._delta_of(_raw_item(payload), found)
            else:
                # an empty delta, one that is no string (an array, an object, a number, NaN), or a
                # string one beside or within another: read as the client reads it, its object's
                # last `delta`
                data = parse_json(payload)
                if isinstance(data, dict):
                    self._delta_value(_item_key(data.get("item_id")), data.get("delta"))
                elif _UNSTRUNG_DELTA.search(payload) is not None:
                    # not JSON the gateway reads, though a client's parser may: its bytes, as a text
                    self._delta_of(_raw_item(payload), [payload])
                else:  # unreadable beside its deltas (logprobs of -Infinity), each a string: those
                    self._delta_of(_raw_item(payload), found)
        number = _SEQUENCE.search(payload)
        self.next_sequence = int(number[1]) + 1 if number else self.next_sequence + 1
        return event

    def _final(self, data: dict[str, Any]) -> None:
        self.final = data
        usage = data["response"].get("usage")
        if isinstance(usage, dict):
            self.reported_usage = usage
        # the final response holds the whole output: its texts bound the bill from below whether
        # or not they came as deltas (a server may send them only in *.done events, or only
        # here), and are the estimate when no delta came (deltas, a token each, count better)
        self._snapshot(data["response"], "final")
        status = data["response"].get("status")
        self.finish_reason = status if isinstance(status, str) else None
        self.upstream_failed = data["type"] == "response.failed"
        self.done = True
        return None


def _unrestated(texts: list[str], seen: dict[int, int], restated: dict[int, int]) -> list[str]:
    """`texts` but those that restate a text given whole before, as often as `seen` says it
    was (less what `restated` has taken already, which it counts)."""
    kept = []
    for text in texts:
        key = hash(text)
        taken = restated.get(key, 0)
        if taken < seen.get(key, 0):
            restated[key] = taken + 1
        else:
            kept.append(text)
    return kept


def _canonical(sent: bytes) -> bytes:
    """A delta's text as sent, written as `dumps` writes it (what the whole texts are compared
    in): only `\\/` can be sent otherwise by a stream the relay did not parse (it has no `\\u`)."""
    if sent.find(b"\\/") < 0:  # (not `in`: see kiln.sse)
        return sent
    try:
        return dumps(json.loads(b'"' + sent + b'"'))[1:-1]
    except ValueError:
        return sent


def _id_of(item: dict[str, Any]) -> Any:
    """An output item's key: its id, or the item_id a server may give it instead."""
    return _item_key(item.get("id")) or _item_key(item.get("item_id"))


def _item_key(item_id: Any) -> Any:
    """An item's id as the relay keys it (its JSON form: the same whether read or as sent); None: no id."""
    return _bounded(dumps(item_id)) if isinstance(item_id, str) and item_id else None


def _raw_item(payload: bytes) -> bytes:
    """A delta's item id as sent (an event with no `\\u` escape: its JSON form is what was sent,
    but for a `\\/`, written as `dumps` writes it); b"": none given (the deltas of no id are one item)."""
    found = _ITEM_ID.search(payload)
    return _bounded(b'"' + _canonical(found.group(1)) + b'"') if found else b""


def _bounded(key: bytes) -> bytes:
    """An id's JSON form, or past MAX_ID_BYTES its digest (which no JSON form starts like)."""
    return key if len(key) <= MAX_ID_BYTES else b"#" + hashlib.blake2b(key, digest_size=16).digest()


API = ResponsesApi()
