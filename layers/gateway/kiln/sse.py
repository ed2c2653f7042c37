"""The SSE rewriter (contract §7).

Content events go out as the bytes the upstream sent (those that are no UTF-8 as the SSE
format reads them: U+FFFD); only the usage chunk is parsed, and
it is held back: the gateway settles first, then sends it (with `usage.cost`) if the client
asked for it, then exactly one `data: [DONE]`. The upstream's own `[DONE]` is swallowed.
While relaying, the completion tokens are counted from the bytes (one per non-empty text
delta), so that an upstream that never reports usage is still billed (contract §4).
"""

from __future__ import annotations

import re
from typing import Any, Collection

from .echo import Echoes
from .jsonio import BOM, dumps, loads_answer
from .metering import LONGEST_TOKEN, TOKEN_BYTES, TokenUsage, estimate_text_tokens, fewest_tokens
from .upstream import UpstreamStreamError

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES", "DONE", "KEEPALIVE", "EventTooLarge", "SseRelay", "as_utf8", "data_of", "error_event",
    "is_done", "is_error_object", "parse_json", "usage_event",
]

# the catalog's default (kiln.catalog.Limits.event_bytes); each model may set its own
DEFAULT_MAX_EVENT_BYTES = 1024 * 1024

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"
# A byte order mark may open a stream (the SSE format drops it) but no event's data: the SDKs'
# JSON readers refuse it there, raising no APIError, so such an event ends the stream unrelayed
MISPLACED_BOM = "it sent a byte order mark where no client reads one"
# a line a byte order mark opens, past the stream's start: a field no client knows, but one a
# client would read as what follows the mark if it opened the gateway's own stream
_BOM_LINE = re.compile(rb"^" + BOM + rb"[^\n]*\n?", re.MULTILINE)
# what may come before a byte order mark at the start of an event's data (JSON's whitespace)
_BEFORE_DATA = b" \t\r\n"

# a JSON string's content, not empty, up to its closing quote: a character or an escape, then
# runs of characters between escapes (one repeat of a character class per run, not an
# alternation tried at every character: `(?:[^"\\]|\\.)+`, which it matches exactly, is twice as slow)
NON_EMPTY_STRING = rb'(?:[^"\\]|\\.)[^"\\]*(?:\\.[^"\\]*)*'
STRING = rb'[^"\\]*(?:\\.[^"\\]*)*'  # the same, maybe empty
_USAGE_PRESENT = re.compile(rb'"usage"\s*:(?!\s*null)')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
# a non-empty text of a chunk the model wrote (its content, reasoning, refusal, a tool call's
# arguments, an audio reply's transcript), as sent; b"" where such a field holds no string but
# an array, an object or a number, NaN and Infinity too (`_unstrung_texts` reads it)
_TEXT_KEYS = rb"content|text|reasoning_content|reasoning|refusal|arguments|transcript"
_TEXT_DELTA = re.compile(rb'"(?:' + _TEXT_KEYS + rb')"\s*:\s*(?:"(' + NON_EMPTY_STRING + rb')"|(?=[\[{0-9NI-]))')
# the most tool calls whose last name is remembered, by a hash (a name sent again for the same
# call of the same choice, as vLLM 0.6-0.7 does in every chunk for a named tool_choice, counts once)
MAX_NAMED_CALLS = 10_000
# a name as sent, read from the bytes where the chunk is no JSON the gateway reads
_NAME = re.compile(rb'"name"\s*:\s*"(' + NON_EMPTY_STRING + rb')"')
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([^"]+)"')
# the longest text that counts as one token and is one at fewest (a model server's usual chunk)
ONE_TOKEN_BYTES = min(TOKEN_BYTES, LONGEST_TOKEN)
# what an error the upstream sends in the stream looks like (vLLM: {"error": {...}}; older
# servers: {"object": "error", ...}; the OpenAI SDKs raise on any "error" that is not null or
# false); an escape can spell it too
_IN_BAND_ERROR = re.compile(rb'"error"\s*:\s*[^\sn]|"object"\s*:\s*"error"|\\u')


# Bytes are looked for in a chunk with `bytes.find`, not `in`: CPython's bytes.__contains__ first
# reads its argument as a byte's value, and for bytes raises and clears a TypeError, formatted,
# each time (about 0.3 µs on 3.13, 4 times `find`), on every chunk of every stream.


def may_be_error(payload: bytes) -> bool:
    """`_IN_BAND_ERROR.search(payload)`, at the cost of two scans for its literals where neither
    is there (nearly every chunk): an alternation with no literal first is tried at every byte."""
    return (payload.find(b'"error"') >= 0 or payload.find(b"\\u") >= 0) and _IN_BAND_ERROR.search(payload) is not None


def reads_further(event: bytes) -> bool:
    """Whether a content chunk is one `_event` reads further: [DONE], an escape, a tool call's name,
    what may be an error, usage. Each is a literal first, looked for as such."""
    if event.find(b"[DONE]") >= 0 or event.find(b"\\u") >= 0 or event.find(b'"name"') >= 0:
        return True
    if event.find(b'"error"') >= 0 and _IN_BAND_ERROR.search(event) is not None:
        return True
    return event.find(b'"usage"') >= 0 and _USAGE_PRESENT.search(event) is not None


# an event's JSON not read yet (parse_json's None is JSON it could not read)
UNREAD: Any = object()
# fields of the upstream's own stream, not of its events (a reconnection's id and pause): the
# gateway's stream is another one, which no client resumes. Relayed, an id would make the
# OpenAI Python SDK read every later blank line, the gateway's keepalive's too, as an event
# with empty data, and raise on it.
_STREAM_FIELD = re.compile(rb"^(?:id|retry)(?::[^\n]*)?(?:\n|$)", re.M)
# an event named `error` (the OpenAI Node SDK raises on it, whatever its data but [DONE]), or an
# `error:` field, as llama.cpp's server writes an error mid-stream
_ERROR_SAID = re.compile(rb"^(?:event: ?error|error:.*)$", re.M)
# an event's name, of any value
_EVENT_FIELD = re.compile(rb"^event(?::|$)", re.M)


def error_event(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_error"}}
    return b"data: " + dumps(payload) + b"\n\n"


def usage_event(template: dict[str, Any], usage: dict[str, Any]) -> bytes:
    """The final usage chunk: the upstream's own (or a copy of its first chunk's header) with `usage`."""
    chunk = {key: value for key, value in template.items() if key not in ("choices", "usage")}
    chunk["choices"] = []
    chunk["usage"] = usage
    return b"data: " + dumps(chunk) + b"\n\n"


class EventTooLarge(UpstreamStreamError):
    """One SSE event went beyond the model's bound (contract §5): the stream ends with the error
    event, after `relayed`, the events that came before it in the same read."""

    def __init__(self, message: str, *, relayed: bytes = b"") -> None:
        super().__init__(message)
        self.relayed = relayed


class SseRelay:
    """Feed it the upstream's bytes; it returns what to send on now.

    Linear in the bytes fed: each byte is normalized, searched and split once, whatever the
    pieces it comes in (an unfinished event is kept as a list of pieces, never re-scanned).
    `bytes_scanned` counts that work, for the test that holds the relay to it.
    """

    def __init__(self, *, client_wants_usage: bool, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 echoes: Echoes | None = None, offered: Collection[str] = ()) -> None:
        self._client_wants_usage = client_wants_usage
        self._echoes = echoes if echoes else None  # what the replies may repeat of the request (kiln.echo)
        self._max_event_bytes = max_event_bytes
        self._pending: list[bytes] = []  # pieces of the event not finished yet
        self._pending_size = 0
        self._after_cr = False
        # the stream's first bytes, until a byte order mark (the SSE format drops one) is told from data
        self._head: bytes | None = b""
        self.bytes_scanned = 0
        self.done = False  # the upstream sent [DONE]
        self.usage_chunk: dict[str, Any] | None = None  # the upstream's usage chunk, held back
        self.reported_usage: dict[str, Any] | None = None  # its usage object, as the upstream sent it
        self.usage: TokenUsage | None = None
        self.first_chunk: dict[str, Any] | None = None
        self.text_tokens = 0  # the completion tokens of the texts relayed, by the gateway's estimate
        self.relayed_texts = 0  # the non-empty texts relayed: a model writes at least a token for each
        self.relayed_bytes = 0  # their length, as sent
        self._names: dict[tuple[Any, Any], int] = {}  # (choice, tool call) -> the hash of the name last counted
        self._offered = frozenset(offered)  # the request's tools' names: a server may write them itself
        self.text_fewest = 0  # the fewest tokens those texts can be (kiln.metering.fewest_tokens)
        self.finish_reason: str | None = None
        self.upstream_failed = False  # the stream ended as the upstream's failure (a 200 all the same)
        self.failure: str | None = None  # why the stream cannot end as the upstream ended it

    @property
    def relayed_tokens(self) -> int:
        """The completion tokens relayed, by the gateway's estimate (what a bill falls back on)."""
        return self.text_tokens

    @property
    def fewest_tokens(self) -> int:
        """The fewest tokens what was relayed can be (the bill's floor)."""
        return self.text_fewest

    def feed(self, data: bytes) -> bytes:
        if not data:
            return b""
        # One whole event in one read, on one `data:` line, that the relay takes as sent (nearly
        # every read of a model server's stream): what the general way below does with it, without
        # its splitting and joining. A property test holds the two to the same output and counts.
        last = len(data) - 2  # where the event's blank line begins
        if (not self._after_cr and not self._pending and data.find(b"\n") == last and data[-1] == 10
                and last <= self._max_event_bytes and data.find(b"\r") < 0 and data.isascii()
                and self._takes_as_sent  # its first chunk was read: no byte order mark is held
                and self._taken_as_sent(data[:last])):
            self.bytes_scanned += 3 * len(data)  # as below: searched, then joined and split
            return data
        if self._head is not None:
            data = self._start(data)
            if not data:
                return b""
        if self._after_cr or data.find(b"\r") >= 0:
            # CRLF and CR line ends become LF. A CR that ends a chunk becomes LF at once; if
            # the next chunk starts with the LF of that CRLF, that LF is dropped.
            if self._after_cr and data.startswith(b"\n"):
                data = data[1:]
            self._after_cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            self.bytes_scanned += len(data)
        # the last blank line: in this piece, or across its start (the pending part ends in LF)
        self.bytes_scanned += len(data)
        end = data.rfind(b"\n\n")
        if end >= 0:
            end += 2
        elif data.startswith(b"\n") and self._pending and self._pending[-1].endswith(b"\n"):
            end = 1
        if end < 0:
            if data and not self.done:  # after the stream's end nothing counts (as `rest` below)
                self._pending.append(data)
                self._pending_size += len(data)
                if self._pending_size > self._max_event_bytes:
                    self._oversize()
            return b""
        if self._pending:
            self._pending.append(data[:end])
            complete = b"".join(self._pending)
            self._pending = []
        else:
            complete = data[:end]
        self.bytes_scanned += 2 * len(complete)  # joined, then split
        out: list[bytes] = []
        # a content chunk after the first, in one `data:` line read as sent, with nothing in it
        # that `_event` reads further (nearly every chunk): relayed and counted here, as
        # `_event` relays and counts it
        plain = self._takes_as_sent
        for event in complete.split(b"\n\n"):
            if self.done:
                break  # after the stream's end (or its failure) nothing counts, whatever its size
            if len(event) > self._max_event_bytes:
                self._oversize(out)
            event = event.strip(b"\n")
            if not event:
                continue
            if not event.isascii():  # a whole event: no sequence is cut at its ends; the bound is on what was sent
                event = as_utf8(event)
                if event.find(BOM) >= 0:
                    unmarked = self._unmarked(event)
                    if unmarked is None:
                        continue  # nothing left, or the stream's end (the loop stops at `done`)
                    event = unmarked
            if plain and self._taken_as_sent(event):
                out.append(event)
                out.append(b"\n\n")
                continue
            forwarded = self._event(event)
            if forwarded:
                out.append(forwarded)
                out.append(b"\n\n")
            plain = self._takes_as_sent
        rest = data[end:] if not self.done else b""  # after the stream's end nothing counts
        self._pending_size = len(rest)
        if rest:
            self._pending.append(rest)
            if self._pending_size > self._max_event_bytes:
                self._oversize(out)
        return b"".join(out)

    def _taken_as_sent(self, event: bytes) -> bool:
        """Count a whole event as `_event` would and say True, if it is a content chunk in one
        `data:` line, not blank at its end, with nothing in it that `_event` reads further (nearly
        every chunk): the caller relays it as sent. False: `_event` is to read it."""
        if not (event.startswith(b"data:") and event.find(b"\n") < 0 and len(event) > 5
                and event[-1] not in b" \t\r\x0b\x0c" and not reads_further(event)):
            return False
        found = _TEXT_DELTA.findall(event)
        if (len(found) != 1 or not found[0]) and _read_in_json(found, event):
            return False  # `_event` reads the chunk
        self._count_found(found)
        finish = _FINISH_REASON.findall(event)
        if finish:
            self.finish_reason = finish[-1].decode(errors="replace")
        return True

    @property
    def _takes_as_sent(self) -> bool:
        """Content chunks may be relayed and counted as sent: the stream's first chunk was read,
        it has not ended, and no echo is to be taken off the replies."""
        return not self.done and self.first_chunk is not None and self._echoes is None

    def _start(self, data: bytes) -> bytes:
        """The stream's first bytes without the BOM that may start it (held while they could be one)."""
        head = self._head + data if self._head else data
        if len(head) < len(BOM) and BOM.startswith(head):
            self._head = head
            return b""
        self._head = None
        return head[len(BOM):] if head.startswith(BOM) else head

    def _count_reply(self, payload: bytes, data: Any = UNREAD) -> None:
        """Count a chunk's texts; of a request with an echo, those the model wrote (its chunks
        are read, the echoed text taken off, and the rest counted as written again)."""
        if self._echoes is not None:
            if data is UNREAD:
                data = parse_json(payload)
            if isinstance(data, dict):
                data = self._echoes.answer(data)
                payload = dumps(data)
        self._count(_TEXT_DELTA, payload, data)
        if payload.find(b'"name"') >= 0 or payload.find(b"\\u") >= 0:
            self._count_names(payload, data)

    def _count_names(self, payload: bytes, data: Any) -> None:
        """A chunk's tool call names (and the older function_call's), each counted as a text
        once for its choice and call: a name sent again as it was, in every chunk, is not
        written again; a name of one of the request's tools is not the model's to count. A
        chunk that is no JSON the gateway reads (NaN, too deep: a client may read it) has its
        names counted as sent."""
        if data is UNREAD:
            data = parse_json(payload)
        if data is None:
            for text in _NAME.findall(payload):
                self._add_text(text)
            return
        choices = data.get("choices") if isinstance(data, dict) else None
        for position, choice in enumerate(choices if isinstance(choices, list) else []):
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            index = choice.get("index", position)
            calls = delta.get("tool_calls")
            named = [(call.get("index", number), call.get("function")) for number, call in
                     enumerate(calls if isinstance(calls, list) else []) if isinstance(call, dict)]
            named.append(("function_call", delta.get("function_call")))
            for call, function in named:
                name = function.get("name") if isinstance(function, dict) else None
                if not isinstance(name, str) or not name or name in self._offered:
                    continue
                key, seen = (_hashable(index), _hashable(call)), hash(name)
                if self._names.get(key) == seen:
                    continue
                if len(self._names) < MAX_NAMED_CALLS or key in self._names:
                    self._names[key] = seen
                self._add_text(name.encode("utf-8", "surrogatepass"))  # a lone surrogate escape is kept

    def _count(self, texts: re.Pattern[bytes], payload: bytes, data: Any = UNREAD) -> None:
        """Count the texts an event relays, and their tokens: model servers stream a token at a
        time, so a text no longer than a token (`TOKEN_BYTES`) counts one; a longer one (a
        server that sends its answer in one piece) counts as text is estimated, 4 bytes a token.
        An event with an escape is read as its JSON says it (an escape can spell a key: the
        SDKs read `"\\u0063ontent"` as content), the rest as sent; `data` is the event's JSON
        where the caller has read it already."""
        if payload.find(b"\\u") >= 0:
            if data is UNREAD:
                data = parse_json(payload)
            if data is not None:
                payload = dumps(data)
        found = texts.findall(payload)
        if (len(found) != 1 or not found[0]) and _read_in_json(found, payload):
            if data is UNREAD:
                data = parse_json(payload)
            if data is not None and len(found) > 1:
                found = _reasoning_once(found, data)
            if b"" in found:  # a text field holding no string
                # an unreadable chunk's (NaN, too deep) whole bytes, as a text: a client may read it
                found = [text for text in found if text] + (_unstrung_texts(data) if data is not None else [payload])
        self._count_found(found)

    def _count_found(self, found: list[bytes]) -> None:
        """Count texts relayed: each is at least a token, and at least its fewest tokens; one no
        longer than a token counts one, a longer one as text is estimated."""
        if len(found) == 1 and 0 < len(found[0]) <= ONE_TOKEN_BYTES:  # one token's text: nearly every chunk
            self.relayed_texts += 1
            self.relayed_bytes += len(found[0])
            self.text_fewest += 1
            self.text_tokens += 1
            return
        if not found:
            return
        size = tokens = fewest = 0
        for text in found:
            size += len(text)
            fewest += fewest_tokens(text)
            tokens += 1 if len(text) <= TOKEN_BYTES else estimate_text_tokens(text)
        self.relayed_texts += len(found)
        self.relayed_bytes += size
        self.text_fewest += fewest
        self.text_tokens += tokens

    def _add_text(self, text: bytes) -> None:
        self._count_found([text])

    def _failed(self, reason: str) -> None:
        """The stream cannot end as the upstream ended it: nothing more is relayed, and the
        request ends with the error event (the exchange reads `failure`)."""
        self.failure = reason
        self.done = True
        return None

    def _oversize(self, before: list[bytes] | None = None) -> None:
        """The event is over the bound: nothing of it is kept, and what the same read held
        before it is handed over with the error (it is the client's, and counted)."""
        self._pending, self._pending_size = [], 0
        raise EventTooLarge(f"an SSE event over {self._max_event_bytes} bytes", relayed=b"".join(before or ()))

    def _unmarked(self, event: bytes) -> bytes | None:
        """An event holding a byte order mark (past the stream's start: `_start` drops one there)
        without the lines one opens, which are never relayed; None if nothing is left, or if its
        data opens with one, after JSON's whitespace or not, which ends the stream (`_failed`).
        A mark within a line is text like any other."""
        event = _BOM_LINE.sub(b"", event).strip(b"\n")
        if not event:
            return None
        payload = data_of(event)
        if payload is not None and payload.lstrip(_BEFORE_DATA).startswith(BOM):
            return self._failed(MISPLACED_BOM)
        return event

    def _event(self, event: bytes) -> bytes | None:
        """One upstream event: relayed as it came, unless it is [DONE] or carries usage.

        Whatever the event holds (not JSON, an array, usage of the wrong type), the relay
        only reads what has the type it expects; the rest is the upstream's to answer for.
        """
        if self.done:
            return None  # nothing after the stream's end ([DONE]) is relayed
        if event.find(b"\n") < 0:  # one line (nearly every event): data, or a comment
            if event.startswith(b"data:"):
                payload = event[5:].lstrip(b" ")
                # empty data is no chunk, and the Python SDK raises on reading it as JSON
                return self._payload(event, payload) if payload.strip() else None
            if event == b"data":  # a data field with no value: empty data too
                return None
            if event.startswith(b":"):
                return event  # an upstream comment (its own keepalive): harmless, pass it on
        if _STREAM_FIELD.search(event):
            event = _STREAM_FIELD.sub(b"", event).strip(b"\n")
            if not event:
                return None
        payload = data_of(event)
        if _ERROR_SAID.search(event) and (payload is None or not is_done(payload)):  # the SDKs end at [DONE] first
            return self._failed("the model server sent an error event")
        if payload is None:
            # no data: an event with a name (`event: ping`) the Python SDK reads as one with empty
            # data, and raises on it; comments and fields it ignores pass on
            return None if _EVENT_FIELD.search(event) else event
        if not payload.strip():
            return None  # empty data: no chunk, and the Python SDK raises on reading it as JSON
        return self._payload(event, payload)

    def _payload(self, event: bytes, payload: bytes) -> bytes | None:
        """An event with data: chat and text completions' chunks, their usage chunk, [DONE]."""
        if is_done(payload):
            self.done = True
            return None
        # what may be an error is read (any escape may spell one), once for every use below
        data = parse_json(payload) if may_be_error(payload) else UNREAD
        if data is not UNREAD and is_error_object(data, streamed=True):
            # the upstream failed mid-stream: the stream ends with the gateway's one error event (§5)
            return self._failed("the model server sent an error in the stream")
        if self.first_chunk is None:
            first = parse_json(payload) if data is UNREAD else data
            if isinstance(first, dict):
                self.first_chunk = first
        # usage as sent, or as an event read for its escapes says it (`"\\u0075sage"` is usage)
        if _USAGE_PRESENT.search(payload) or (data is not UNREAD and isinstance(data, dict)
                                              and data.get("usage") is not None):
            return self._usage(event, payload, data)
        self._count_reply(payload, data)
        finish = _FINISH_REASON.findall(payload)
        if finish:
            self.finish_reason = finish[-1].decode(errors="replace")
        return event

    def _usage(self, event: bytes, payload: bytes, data: Any = UNREAD) -> bytes | None:
        chunk = parse_json(payload) if data is UNREAD else data
        if not isinstance(chunk, dict):
            # Unreadable (nested too deep, NaN, 1e999…), its usage can be neither read nor taken
            # out; the bill is the gateway's own count, and a client that asked for usage gets it
            # in the gateway's own usage chunk, with its cost. A content chunk carrying usage is
            # passed on as it came (its content is the client's: §7).
            if b'"choices"' in payload and not _NO_CHOICES.search(payload):
                self._count_reply(payload, chunk)
                return event
            return None
        if isinstance(chunk.get("usage"), dict):
            self.reported_usage = chunk["usage"]
            self.usage = TokenUsage.from_upstream(self.reported_usage)  # well-formed; bounds are the caller's
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            # the usage chunk (or one whose choices are unusable): held back, rewritten at the end
            if self.reported_usage is chunk.get("usage"):
                self.usage_chunk = chunk
            return None
        # usage riding on a content chunk (continuous usage stats): keep the content
        self._count_reply(payload, chunk)
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        if self._client_wants_usage:
            return event
        chunk.pop("usage", None)
        return b"data: " + dumps(chunk)

    def leftover(self) -> bytes:
        """Bytes of an event the upstream never finished (a cut stream)."""
        return b"".join(self._pending)


def _read_in_json(found: list[bytes], payload: bytes) -> bool:
    """Whether a chunk's texts (`found`, as `_TEXT_DELTA` finds them) are counted from its JSON:
    one of its text fields holds no string, or it holds several texts, reasoning among them,
    which a server may give under several names (`_reasoning_once`)."""
    return b"" in found or (len(found) > 1 and payload.find(b'"reasoning') >= 0)


def _reasoning_once(found: list[bytes], data: Any) -> list[bytes]:
    """`found`, the texts of a chunk as sent, less the copies of one choice's reasoning that a
    server writes under several names at once (vllm-mlx and mlx-vlm write both `reasoning` and
    `reasoning_content`; OpenRouter repeats it as its `reasoning_details`' text): in each
    choice, each text counts as often as the name that gives it most. Choices apart, and a
    content part's text, count each."""
    found = list(found)
    for copy in _reasoning_copies(data):
        try:
            found.remove(dumps(copy)[1:-1])  # as the chunk was read (a chunk with an escape, as dumps writes it)
        except ValueError:
            pass  # written otherwise: counted, as sent
    return found


def _reasoning_copies(data: Any) -> list[str]:
    """The copies of each choice's reasoning given under more names than one (see above)."""
    copies: list[str] = []
    choices = data.get("choices") if isinstance(data, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            continue
        named = [(name, delta.get(name)) for name in ("reasoning", "reasoning_content")]
        details = delta.get("reasoning_details")
        named += [("details", detail.get("text")) for detail in (details if isinstance(details, list) else [])
                  if isinstance(detail, dict)]
        times: dict[str, dict[str, int]] = {}
        for name, text in named:
            if isinstance(text, str) and text:
                by_name = times.setdefault(text, {})
                by_name[name] = by_name.get(name, 0) + 1
        for text, by_name in times.items():
            copies += [text] * (sum(by_name.values()) - max(by_name.values()))
    return copies


# a chunk's fields that hold what the model wrote (`_unstrung_texts`): the delta's, the text
# completion's `text`; a tool call's arguments and an audio reply's transcript apart
_DELTA_TEXTS = ("content", "reasoning_content", "reasoning", "refusal", "reasoning_details")
# the names of a text field, in a part or a detail too (`_TEXT_KEYS`)
_TEXT_NAMES = frozenset(name.decode() for name in _TEXT_KEYS.split(b"|"))


def _unstrung_texts(data: Any) -> list[bytes]:
    """What the text fields of a chunk hold that is no string (the SDKs hand it to the client
    as it came): strings and numbers in an array, each a text, and a number, in those fields
    and in the text fields of their objects (a part, a detail); an object's strings are found
    as sent (`_TEXT_DELTA`), and a part's `type` is no text. A tool call's arguments or a
    transcript that is no string counts whole, as JSON."""
    texts: list[bytes] = []
    choices = data.get("choices") if isinstance(data, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        _add_unstrung(texts, choice.get("text"))
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        for field in _DELTA_TEXTS:
            _add_unstrung(texts, delta.get(field))
        calls = delta.get("tool_calls")
        functions = [call.get("function") for call in calls if isinstance(call, dict)] if isinstance(calls, list) else []
        wholes = [function.get("arguments") for function in [*functions, delta.get("function_call")]
                  if isinstance(function, dict)]
        audio = delta.get("audio")
        if isinstance(audio, dict):
            wholes.append(audio.get("transcript"))
        texts += [dumps(whole) for whole in wholes if whole is not None and not isinstance(whole, (str, bool))]
    return texts


def _add_unstrung(texts: list[bytes], value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                if item:
                    texts.append(dumps(item)[1:-1])
            else:
                _add_unstrung(texts, item)
    elif isinstance(value, dict):  # a part or a detail: its text fields that are no string
        for name, inner in value.items():
            if name in _TEXT_NAMES and not isinstance(inner, str):
                _add_unstrung(texts, inner)
    elif _a_number(value):
        texts.append(dumps(value))


def _a_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_utf8(data: bytes) -> bytes:
    """`data` as the SSE format reads it: UTF-8, each invalid sequence read as U+FFFD (the
    WHATWG decoder EventSource and the Node SDK use). The OpenAI Python SDK decodes strictly,
    and raises UnicodeDecodeError, no APIError, on what a model server's bug may send."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace").encode("utf-8")
    return data


def _hashable(value: Any) -> Any:
    """A key part of what a server sent as an index: itself, or a hash of anything else."""
    return value if isinstance(value, (str, int, float, bool, type(None))) else hash(repr(value))


def is_done(payload: bytes) -> bool:
    """The upstream's end of stream: data that starts with [DONE], as the OpenAI SDKs read it
    (`[DONE] ` with a trailing space ends their stream too)."""
    return payload.startswith(b"[DONE]")


def is_error_object(data: Any, *, streamed: bool = False) -> bool:
    """An upstream's error, as a buffered body or (`streamed`) in an event: an object that is an
    error, or whose `error` is anything but null, false, 0 or empty. In a stream, as the OpenAI
    SDKs read its events, an empty object or array is an error too: the Node SDK raises on it,
    JavaScript holding it true. Neither SDK looks for an `error` in a buffered answer."""
    if not isinstance(data, dict):
        return False
    if data.get("object") == "error":
        return True
    error = data.get("error")
    if streamed:
        return error is not None and error is not False and error != 0 and error != ""
    return bool(error)


def data_of(event: bytes) -> bytes | None:
    """The data of an SSE event (several data lines are joined with newlines)."""
    if event.startswith(b"data:") and event.find(b"\n") < 0:
        return event[5:].lstrip(b" ")
    # a `data` line with no colon is a data field with an empty value, as the SSE format reads it
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:") or line == b"data"]
    return b"\n".join(lines) if lines else None


def parse_json(payload: bytes) -> Any:
    """An event's data as JSON, or None: read as a model server's answer is (kiln.jsonio: no
    NaN, nested no deeper than a repeated request, a lone surrogate escape kept), but for a
    byte order mark, which no client reads in an event's data."""
    try:
        return loads_answer(payload, body=False)
    except ValueError:
        return None
