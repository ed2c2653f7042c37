"""The mock model server's Responses API (`POST /v1/responses`), shaped as vLLM answers it.

Buffered: one `response` object. Streamed: `response.created`, `response.in_progress`, per
output item `response.output_item.added`, its deltas (`response.output_text.delta` one token
each, or `response.function_call_arguments.delta`), the `.done` events, and last
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the reply) with
the usage. Token counts follow the chat rule of `kiln_ops.mock_upstream`: a prompt costs one
token per word of `input` and `instructions` (`word_tokens`, plus 3 per input item); the reply is the chat
sentence, one token per delta. The same options apply (`no_usage`, `cached_tokens`,
`tool_calls`, `tokens`, `cut_after`, delays, …).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["ResponsesReply", "word_tokens"]

# no tokenizer has a token this long: a longer word is one token per this many characters begun
WORD_CHARS = 100


def word_tokens(text: str) -> int:
    """A text's prompt tokens, the mock's way: one per whitespace-separated word, a word of more
    than WORD_CHARS characters one per WORD_CHARS begun."""
    return sum(-(-len(word) // WORD_CHARS) for word in text.split())


def _words(value: Any) -> int:
    if isinstance(value, str):
        return word_tokens(value)
    if isinstance(value, list):
        return sum(_words(item) for item in value)
    if isinstance(value, dict):
        return _words(value.get("text", "")) + _words(value.get("content", ""))
    return 0


# what one reply may hold: a mock in a developer's process must not take the machine's memory
# (vLLM has no bound on `n`, nor has the mock: tests ask for more choices than OpenAI's 128)
MAX_REPLY_TOKENS = 100_000  # every choice's together


class ReplyTooLarge(ValueError):
    """A reply the mock does not make: its 400 says why."""


def check_size(tokens: int, choices: int) -> None:
    if max(tokens, 1) * choices > MAX_REPLY_TOKENS:
        raise ReplyTooLarge(f"{tokens} tokens for each of {choices} choices: the mock answers at most "
                            f"{MAX_REPLY_TOKENS} tokens a request")


def reply_tokens(sentence: list[str], wanted: int, limit: int | None) -> tuple[list[str], bool]:
    """`wanted` tokens, `sentence` over and over, cut at `limit` (a request's max tokens) as a
    slice cuts them; and whether they were cut. Only the tokens kept are made, and they are
    bounded (a negative limit, which a server refuses, is held to the tokens wanted)."""
    cut = limit is not None and limit < wanted
    kept = range(wanted)[:limit] if cut else range(wanted)
    check_size(len(kept) if limit is None or limit >= 0 else wanted, 1)
    return [sentence[i % len(sentence)] for i in kept], cut


@dataclass
class ResponsesReply:
    model: str
    prompt_tokens: int
    tokens: list[str]
    tools: list[dict]
    tool_calls: int
    cached_tokens: int | None
    report_usage: bool
    body: dict
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    incomplete: bool = False

    @classmethod
    def plan(cls, body: dict, options: Any, sentence: list[str]) -> "ResponsesReply":
        wanted = options.tokens if options.tokens is not None else len(sentence)
        limit = body.get("max_output_tokens")
        tokens, incomplete = reply_tokens(sentence, wanted,
                                          limit if isinstance(limit, int) and not isinstance(limit, bool) else None)
        tools = [tool for tool in body.get("tools") or [] if isinstance(tool, dict) and tool.get("type") == "function"]
        calls = 0
        if tools and body.get("tool_choice") != "none":
            calls = options.tool_calls if options.tool_calls is not None else 1
            check_size(len(tokens) + calls, 1)
        items = body.get("input")
        prompt = _words(items) + (3 * len(items) if isinstance(items, list) else 3) + _words(body.get("instructions"))
        cached = min(options.cached_tokens, prompt) if options.cached_tokens is not None else None
        reply = cls(str(body.get("model")), prompt, tokens, tools, calls, cached, not options.no_usage, body,
                    incomplete=incomplete and not calls)
        if options.id:
            reply.id, reply.created = options.id, 1700000000
        return reply

    # -- what the reply is made of ------------------------------------------------------------

    def _arguments(self, index: int) -> str:
        return json.dumps({"city": "Paris", "n": index})

    def _pieces(self, index: int) -> list[str]:
        text = self._arguments(index)
        return [text[i : i + 6] for i in range(0, len(text), 6)]

    def output_tokens(self) -> int:
        if self.tool_calls:
            return sum(len(self._pieces(i)) for i in range(self.tool_calls))
        return len(self.tokens)

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens or 0},
            "output_tokens": self.output_tokens(),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.output_tokens(),
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": f"msg_{self.id}", "status": status, "role": "assistant", "content": content}

    def _call(self, index: int, arguments: str, status: str) -> dict[str, Any]:
        name = self.tools[index % len(self.tools)].get("name", "tool")
        return {"type": "function_call", "id": f"fc_{self.id[:8]}{index}", "call_id": f"call_{self.id[:8]}{index}",
                "name": name, "arguments": arguments, "status": status}

    def _output(self) -> list[dict[str, Any]]:
        if self.tool_calls:
            return [self._call(i, self._arguments(i), "completed") for i in range(self.tool_calls)]
        return [self._message("".join(self.tokens), "completed")]

    def response(self, status: str, *, output: list | None = None, usage: bool = True) -> dict[str, Any]:
        if status == "completed" and self.incomplete:
            status = "incomplete"
        return {
            "id": f"resp_{self.id}",
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "metadata": {},
            "output": self._output() if output is None else output,
            "parallel_tool_calls": True,
            "previous_response_id": self.body.get("previous_response_id"),
            "reasoning": None,
            "store": False,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": self.body.get("tool_choice", "auto"),
            "tools": self.tools,
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": self.usage() if usage and self.report_usage else None,
            "user": None,
        }

    # -- the stream ---------------------------------------------------------------------------

    def events(self) -> Iterator[bytes]:
        sequence = iter(range(1_000_000))

        def event(kind: str, **data: Any) -> bytes:
            payload = {"type": kind, "sequence_number": next(sequence), **data}
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

        yield event("response.created", response=self.response("in_progress", output=[], usage=False))
        yield event("response.in_progress", response=self.response("in_progress", output=[], usage=False))
        if self.tool_calls:
            for index in range(self.tool_calls):
                item = self._call(index, "", "in_progress")
                yield event("response.output_item.added", output_index=index, item=item)
                for piece in self._pieces(index):
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=piece)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=self._arguments(index))
                yield event("response.output_item.done", output_index=index,
                            item=self._call(index, self._arguments(index), "completed"))
        else:
            text = "".join(self.tokens)
            item_id = f"msg_{self.id}"
            yield event("response.output_item.added", output_index=0, item=self._message("", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)
            for token in self.tokens:
                yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=token,
                            logprobs=[])
            yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                        part={**part, "text": text})
            yield event("response.output_item.done", output_index=0, item=self._message(text, "completed"))
        final = self.response("completed")
        yield event(f"response.{final['status']}", response=final)
