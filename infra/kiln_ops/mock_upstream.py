"""A model server that answers like vLLM, with faults on request, for tests and the local stack.

Chat and text completions, buffered and streamed: a role chunk first (chat), one token per
chunk, a finish chunk, a usage chunk only when `stream_options` asks for it (`include_usage`,
true unless given otherwise, as vLLM has it),
then `data: [DONE]`. The Responses API (`/v1/responses`, `kiln_ops.mock_responses`): a
response object, or its event stream ending in `response.completed` with the usage. `n` choices, tool calls when tools are given, cached tokens on request.

Token counts are deterministic: a prompt costs one token per whitespace-separated word, a
word of more than 100 characters one per 100 begun, as no tokenizer has a token that long
(plus 3 per chat message); the reply is a fixed sentence (12 tokens for chat, 7 for text
completions), cut at `max_tokens`. So the reference pages' examples come out exactly:
"The capital of France is" → 5 prompt tokens; system "Answer briefly." + user "Hello!" → 9.

Per-request behaviour comes from a `mock` object in the request body (the gateway forwards
unknown fields), from a `/x/<k=v,k=v>/v1/...` path prefix (a whole backend that misbehaves),
or from the server's own defaults:

    status=N          answer HTTP N with a vLLM-style JSON error
    plain_text=true   …with a plain-text body instead ("Internal Server Error")
    headers_delay_ms  wait before answering at all (a backend that never gets to the first byte);
                      a client that leaves meanwhile ends the request (counted in `disconnects`)
    ttft_ms           wait before the first token (streams: after the 200 and headers)
    token_delay_ms    wait between tokens
    tokens=N          reply with N tokens (cut at max_tokens; at most 100 000 a request, every
                      choice's and tool call's together: else a 400)
    cut_after=N       drop the connection after N chunks, the role chunk included (mid-stream failure)
    no_done=true      end the stream cleanly but without [DONE]
    no_usage=true     never report usage, as llama.cpp's server does
    cached_tokens=N   report N prompt tokens as served from the prefix cache
    tool_calls=N      call N tools (default 1 when tools are given)
    spaced=true       write JSON with spaces after separators (byte-exact relaying shows)
    id=TEXT           use this completion id (and a fixed `created`), for comparing outputs
    tag=TEXT          count this request's concurrency under TEXT too (stats: in flight by tag)
    header_bytes=N    answer 200 with about N bytes of response headers (a hostile model server…)
    body_bytes=N      …a buffered 200 body of N bytes, sent in 1 MiB pieces
    event_bytes=N     …a stream of one event of N bytes that never ends (no blank line)
    endless=true      …a stream of content chunks until the client leaves (token_delay_ms apart)
    raw_body=TEXT     answer 200 with exactly these bytes as the buffered body (a hostile model server)
    raw_events=[...]  stream exactly these `data:` payloads (strings), then [DONE] unless no_done

GET /mock/stats reports requests, in-flight (now and at most), disconnects and the last
bodies received; POST /mock/reset clears them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from urllib.parse import unquote

from .mock_responses import ReplyTooLarge, ResponsesReply, check_size, reply_tokens, word_tokens
from .serve import read_body

__all__ = ["MockOptions", "MockUpstream"]

CHAT_REPLY = ["Hello", "!", " How", " can", " I", " help", " you", " today", "?", " Ask", " me", " anything."]
TEXT_REPLY = [" Paris", ",", " a", " city", " on", " the", " Seine."]


def _read_as_vllm(kind: type, value: Any) -> Any:
    """`value` as vLLM's request models read it (pydantic, lax: "4" and 4.0 are 4, "yes" is
    true); None when absent or refused."""
    from pydantic import ValidationError

    if value is None or (type(value) is kind):
        return value
    try:
        return _adapter(kind).validate_python(value)
    except ValidationError:
        return None


@cache
def _adapter(kind: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(kind)


@dataclass
class MockOptions:
    status: int | None = None
    plain_text: bool = False
    message: str | None = None
    headers_delay_ms: float = 0
    ttft_ms: float = 0
    token_delay_ms: float = 0
    tokens: int | None = None
    cut_after: int | None = None
    no_done: bool = False
    no_usage: bool = False
    cached_tokens: int | None = None
    tool_calls: int | None = None
    spaced: bool = False
    id: str | None = None
    tag: str | None = None
    header_bytes: int | None = None
    body_bytes: int | None = None
    event_bytes: int | None = None
    endless: bool = False
    raw_body: str | None = None
    raw_events: list | None = None

    def merged(self, overrides: dict[str, Any]) -> "MockOptions":
        values = dict(self.__dict__)
        for key, value in overrides.items():
            if key in values:
                values[key] = _coerce(values[key], value, key)
        return MockOptions(**values)


def _coerce(default: Any, value: Any, key: str) -> Any:
    if isinstance(value, str):
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes")
        if key in ("plain_text", "no_done", "no_usage", "spaced"):
            return value.lower() in ("1", "true", "yes")
        if key in ("message", "id", "tag", "raw_body"):
            return value
        return float(value) if "." in value else int(value)
    return value


@dataclass
class MockStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    completed: int = 0
    disconnects: int = 0
    bodies: deque = field(default_factory=lambda: deque(maxlen=50))
    in_flight_by_tag: dict = field(default_factory=dict)
    max_in_flight_by_tag: dict = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "completed": self.completed,
            "disconnects": self.disconnects,
            "bodies": list(self.bodies),
            "max_in_flight_by_tag": dict(self.max_in_flight_by_tag),
        }

    def enter(self, tag: str | None) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if tag is not None:
            self.in_flight_by_tag[tag] = self.in_flight_by_tag.get(tag, 0) + 1
            self.max_in_flight_by_tag[tag] = max(self.max_in_flight_by_tag.get(tag, 0), self.in_flight_by_tag[tag])

    def leave(self, tag: str | None) -> None:
        self.in_flight -= 1
        if tag is not None:
            self.in_flight_by_tag[tag] -= 1


class MockUpstream:
    """A raw ASGI app (fast, and in full control of when bytes go out and connections drop)."""

    def __init__(self, *, token_delay_ms: float = 0, ttft_ms: float = 0) -> None:
        self.defaults = MockOptions(token_delay_ms=token_delay_ms, ttft_ms=ttft_ms)
        self.stats = MockStats()

    def reset(self) -> None:
        """Fresh counters. Requests still in flight finish on the counters they started on."""
        self.stats = MockStats()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        options = self.defaults
        if path.startswith("/x/"):
            _, _, spec, rest = path.split("/", 3)
            options = options.merged(dict(pair.split("=", 1) for pair in unquote(spec).split(",") if "=" in pair))
            path = "/" + rest
        if method == "GET" and path == "/mock/stats":
            return await _send_json(send, 200, self.stats.as_dict())
        if method == "POST" and path == "/mock/reset":
            self.reset()
            return await _send_json(send, 200, {"reset": True})
        if method == "GET" and path == "/v1/models":
            return await _send_json(send, 200, {"object": "list", "data": []})
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            return await _send_json(send, 404, _error(f"no route {method} {path}", 404))
        raw = await read_body(receive)
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            return await _send_json(send, 400, _error("Invalid JSON body", 400))
        self.stats.requests += 1
        self.stats.bodies.append(body)
        if isinstance(body.get("mock"), dict):
            options = options.merged(body["mock"])
        stats = self.stats  # a reset during this request must not take it off the new counters
        stats.enter(options.tag)
        try:
            if path == "/v1/responses":
                await self._respond(body, options, receive, send)
            else:
                await self._answer(path == "/v1/chat/completions", body, options, receive, send)
        finally:
            stats.leave(options.tag)

    async def _waited(self, milliseconds: float, receive: Any) -> bool:
        """Wait; False if the client left meanwhile (counted, as vLLM aborts a request whose
        client has gone: it is in flight no longer)."""
        if not milliseconds:
            return True
        async with _disconnect_watch(receive) as gone:
            await _unless_gone(gone, milliseconds)
        if not gone.is_set():
            return True
        self.stats.disconnects += 1
        return False

    async def _answer(self, chat: bool, body: dict, options: MockOptions, receive: Any, send: Any) -> None:
        if not await self._waited(options.headers_delay_ms, receive):
            return
        if options.header_bytes or options.body_bytes or options.event_bytes or options.endless:
            if await _hostile(options, receive, send):
                self.stats.disconnects += 1
            return
        if options.status is not None and options.status >= 400:
            if options.plain_text:
                return await _send_text(send, options.status, options.message or "Internal Server Error")
            return await _send_json(send, options.status, _error(options.message or "mock failure", options.status))
        if not chat and "prompt" not in body:
            return await _send_json(send, 400, _error("'prompt' is a required property", 400))
        if options.raw_body is not None or options.raw_events is not None:
            return await self._scripted(body, options, send)
        try:
            reply = Reply.plan(chat, body, options)
        except ReplyTooLarge as too_large:
            return await _send_json(send, 400, _error(str(too_large), 400))
        except (TypeError, ValueError, AttributeError):
            # fields of types it cannot use: a validation error, as vLLM's is
            return await _send_json(send, 400, _error("Invalid request: a field has the wrong type", 400))
        if body.get("stream") is True:
            return await self._stream(reply, body, options, receive, send)
        if not await self._waited(options.ttft_ms + options.token_delay_ms * reply.length, receive):
            return
        answer = reply.buffered()
        if options.no_usage:
            answer.pop("usage")
        if options.cut_after is not None:
            # a body that stops half-way: the declared length is never reached
            data = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
            return
        self.stats.completed += 1
        await _send_json(send, 200, answer)

    async def _scripted(self, body: dict, options: MockOptions, send: Any) -> None:
        """Exactly the bytes a test asked for: what a broken or hostile model server sends."""
        self.stats.completed += 1
        if body.get("stream") is not True:
            data = (options.raw_body or "").encode("utf-8", "surrogatepass")
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data, "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for payload in options.raw_events or []:
            event = b"data: " + str(payload).encode("utf-8", "surrogatepass") + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        if options.cut_after is not None:
            return  # drop the connection
        await send({"type": "http.response.body", "body": b"" if options.no_done else b"data: [DONE]\n\n",
                    "more_body": False})

    async def _respond(self, body: dict, options: MockOptions, receive: Any, send: Any) -> None:
        """POST /v1/responses, as vLLM serves it (kiln_ops.mock_responses)."""
        if not await self._waited(options.headers_delay_ms, receive):
            return
        if options.status is not None and options.status >= 400:
            if options.plain_text:
                return await _send_text(send, options.status, options.message or "Internal Server Error")
            return await _send_json(send, options.status, _error(options.message or "mock failure", options.status))
        if options.raw_body is not None or options.raw_events is not None:
            return await self._scripted(body, options, send)
        if "input" not in body:
            return await _send_json(send, 400, _error("'input' is a required property", 400))
        try:
            reply = ResponsesReply.plan(body, options, CHAT_REPLY)
        except ReplyTooLarge as too_large:
            return await _send_json(send, 400, _error(str(too_large), 400))
        except (TypeError, ValueError, AttributeError):
            return await _send_json(send, 400, _error("Invalid request: a field has the wrong type", 400))
        if body.get("stream") is True:
            return await self._stream_events(reply.events(), b"", options, receive, send)
        if not await self._waited(options.ttft_ms, receive):
            return
        self.stats.completed += 1
        await _send_json(send, 200, reply.response("completed"))

    async def _stream(self, reply: "Reply", body: dict, options: MockOptions, receive: Any, send: Any) -> None:
        # vLLM's StreamOptions: include_usage defaults to true once stream_options is given
        stream_options = body.get("stream_options")
        asked = isinstance(stream_options, dict) and _read_as_vllm(bool, stream_options.get("include_usage", True))
        include_usage = asked is True and not options.no_usage
        tail = _event(reply.usage_chunk(), options.spaced) if include_usage else b""
        if not options.no_done:
            tail += b"data: [DONE]\n\n"
        events = (_event(chunk, options.spaced) for chunk in reply.chunks())
        await self._stream_events(events, tail, options, receive, send)

    async def _stream_events(self, events: Any, tail: bytes, options: MockOptions, receive: Any, send: Any) -> None:
        """Send `events` (bytes each) with the options' delays, faults and disconnect watch, then `tail`."""
        async with _disconnect_watch(receive) as gone:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            await send({"type": "http.response.body", "body": b"", "more_body": True})
            sent = 0
            for index, event in enumerate(events):
                delay = options.ttft_ms if index == 0 else options.token_delay_ms
                if delay:
                    await _unless_gone(gone, delay)
                if gone.is_set():
                    self.stats.disconnects += 1
                    return
                if options.cut_after is not None and sent >= options.cut_after:
                    return  # returning without finishing the body drops the connection
                await send({"type": "http.response.body", "body": event, "more_body": True})
                sent += 1
            self.stats.completed += 1
            await send({"type": "http.response.body", "body": tail, "more_body": False})


@dataclass
class Reply:
    chat: bool
    model: str
    n: int
    prompt_tokens: int
    tokens: list[str]
    finish_reason: str
    tools: list[dict]
    tool_calls: int
    cached_tokens: int | None
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def plan(cls, chat: bool, body: dict, options: MockOptions) -> "Reply":
        base = CHAT_REPLY if chat else TEXT_REPLY
        wanted = options.tokens if options.tokens is not None else len(base)
        # as vLLM takes them: chat's max_completion_tokens, then the deprecated max_tokens
        max_tokens = (_read_as_vllm(int, body.get("max_completion_tokens")) if chat else None) \
            or _read_as_vllm(int, body.get("max_tokens"))
        tokens, cut = reply_tokens(base, wanted, max_tokens)
        finish = "length" if cut else "stop"
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        calls = 0
        if chat and tools and body.get("tool_choice") != "none":
            calls = options.tool_calls if options.tool_calls is not None else 1
            finish = "tool_calls" if calls else finish
        prompt = _prompt_tokens(body, chat)
        cached = min(options.cached_tokens, prompt) if options.cached_tokens is not None else None
        n = _read_as_vllm(int, body.get("n"))
        n = n if n is not None and n > 0 else 1
        check_size(len(tokens) + calls, n)
        reply = cls(chat, str(body.get("model")), n, prompt, tokens, finish, tools, calls, cached)
        if options.id:
            reply.id, reply.created = options.id, 1700000000
        return reply

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _call(self, index: int) -> dict:
        tool = self.tools[index % len(self.tools)]["function"]
        return {"id": f"call_{self.id[:8]}{index}", "type": "function",
                "function": {"name": tool.get("name", "tool"), "arguments": json.dumps({"city": "Paris", "n": index})}}

    def _arguments_pieces(self, index: int) -> list[str]:
        text = self._call(index)["function"]["arguments"]
        return [text[i : i + 6] for i in range(0, len(text), 6)]

    def completion_tokens(self) -> int:
        if self.tool_calls:
            return self.n * sum(len(self._arguments_pieces(i)) for i in range(self.tool_calls))
        return self.n * len(self.tokens)

    def usage(self) -> dict:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens(),
            "total_tokens": self.prompt_tokens + self.completion_tokens(),
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def _header(self) -> dict:
        if self.chat:
            return {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created, "model": self.model}

    def buffered(self) -> dict:
        text = "".join(self.tokens)
        choices = []
        for index in range(self.n):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tool_calls:
                    message = {"role": "assistant", "content": None,
                               "tool_calls": [self._call(i) for i in range(self.tool_calls)]}
                choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": self.finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": self.finish_reason})
        header = self._header()
        header["object"] = "chat.completion" if self.chat else "text_completion"
        return {**header, "choices": choices, "usage": self.usage()}

    def chunks(self):
        header = self._header()
        for index in range(self.n):
            if self.chat:
                yield {**header, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
            if self.tool_calls:
                for call in range(self.tool_calls):
                    first = self._call(call)
                    first["function"]["arguments"] = ""
                    yield {**header, "choices": [{"index": index, "delta": {"tool_calls": [{"index": call, **first}]},
                                                  "logprobs": None, "finish_reason": None}]}
                    for piece in self._arguments_pieces(call):
                        delta = {"tool_calls": [{"index": call, "function": {"arguments": piece}}]}
                        yield {**header, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                      "finish_reason": None}]}
            else:
                for token in self.tokens:
                    if self.chat:
                        choice = {"index": index, "delta": {"content": token}, "logprobs": None, "finish_reason": None}
                    else:
                        choice = {"index": index, "text": token, "logprobs": None, "finish_reason": None}
                    yield {**header, "choices": [choice]}
            final = {"index": index, "delta": {}} if self.chat else {"index": index, "text": ""}
            yield {**header, "choices": [{**final, "logprobs": None, "finish_reason": self.finish_reason}]}

    def usage_chunk(self) -> dict:
        return {**self._header(), "choices": [], "usage": self.usage()}


def _words(value: Any) -> int:
    if isinstance(value, str):
        return word_tokens(value)
    if isinstance(value, list):
        return sum(_words(item) if not isinstance(item, int) else 1 for item in value)
    if isinstance(value, dict):
        return _words(value.get("text", "")) + _words(value.get("content", ""))
    return 0


def _prompt_tokens(body: dict, chat: bool) -> int:
    if chat:
        messages = body.get("messages") or []
        return sum(3 + _words(m.get("content")) for m in messages if isinstance(m, dict))
    return _words(body.get("prompt"))


def _error(message: str, status: int) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError" if status < 500 else "InternalServerError",
            "param": None, "code": status}


def _event(chunk: dict, spaced: bool = False) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(", ", ": ") if spaced else (",", ":")).encode() + b"\n\n"


async def _send_json(send: Any, status: int, payload: Any) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


async def _send_text(send: Any, status: int, text: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
    await send({"type": "http.response.body", "body": text.encode()})


async def _hostile(options: MockOptions, receive: Any, send: Any) -> bool:
    """A model server that sends without end or bound; it stops once the client has left
    (True then)."""
    stream = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    async with _disconnect_watch(receive) as gone:
        if options.header_bytes:
            pad = b"p" * 8192
            headers = [(b"x-pad-%d" % i, pad) for i in range(options.header_bytes // (len(pad) + 12) + 1)]
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), *headers]})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        if options.body_bytes:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await _pour(send, gone, b'{"pad":"', options.body_bytes, 1024 * 1024)
        elif options.event_bytes:
            await send({"type": "http.response.start", "status": 200, "headers": stream})
            await _pour(send, gone, b'data: {"pad":"', options.event_bytes, 64 * 1024)
        else:
            await send({"type": "http.response.start", "status": 200, "headers": stream})
            chunk = _event({"id": "chatcmpl-endless", "object": "chat.completion.chunk", "created": 1, "model": "m",
                            "choices": [{"index": 0, "delta": {"content": "more"}, "finish_reason": None}]})
            while not gone.is_set():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await _unless_gone(gone, options.token_delay_ms)
        if not gone.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return gone.is_set()


async def _unless_gone(gone: asyncio.Event, milliseconds: float) -> None:
    """Wait `milliseconds`, or until the client has gone (`gone`, of _disconnect_watch)."""
    try:
        await asyncio.wait_for(gone.wait(), milliseconds / 1000)
    except asyncio.TimeoutError:
        pass


@asynccontextmanager
async def _disconnect_watch(receive: Any):
    """An event set when the client leaves (its `http.disconnect`), watched while the block runs."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:
        yield gone
    finally:
        watcher.cancel()


async def _pour(send: Any, gone: asyncio.Event, start: bytes, size: int, piece: int) -> None:
    """`size` bytes (`start`, then filler) in pieces, unless the client leaves first."""
    await send({"type": "http.response.body", "body": start, "more_body": True})
    filler, sent = b"a" * piece, len(start)
    while sent < size and not gone.is_set():
        await send({"type": "http.response.body", "body": filler[: size - sent], "more_body": True})
        sent += piece
        await asyncio.sleep(0)
