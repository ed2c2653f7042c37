"""What a synchronous Lambda invocation can carry: 6 MB of event in, 6 MB of answer out.

API Gateway (REST) and Function URLs hand a function its request as one JSON event: the body as a
JSON string (each `"` and `\\` escaped, so written twice), the headers twice (`headers` and
`multiValueHeaders`) and the request's context. An event over Lambda's limit never reaches the
function: locally (`kiln dev`, the tests' stacks) such a request is refused as AWS refuses it,
413, not served. A buffered function (Mangum) answers with one JSON document too, its body
escaped by the runtime (non-ASCII characters included): an answer over the limit would be lost
after the request was settled, so it is refused before.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

__all__ = ["LAMBDA_PAYLOAD_BYTES", "answer_limit", "answer_size", "escaped_size", "event_size", "event_too_large"]

# a synchronous invocation's request and response payloads, each (AWS Lambda quotas)
LAMBDA_PAYLOAD_BYTES = 6 * 1024 * 1024
# what an event holds besides the body and the headers (requestContext, path, stage, …), and
# an answer besides its body (status, headers), at the most
_EVENT_CONTEXT_BYTES = 4096
_ANSWER_ENVELOPE_BYTES = 2048
_CONTROL = bytes(range(32))


def event_size(body: bytes, headers: Iterable[tuple[str, str]]) -> int:
    """At least the bytes of the event that carries this request: its body as a JSON string
    (only what surely grows counted: quotes, backslashes, control bytes), its headers twice."""
    escaped = body.count(b'"') + body.count(b"\\") + len(body) - len(body.translate(None, _CONTROL))
    header_bytes = sum(len(name) + len(value) + 8 for name, value in headers)
    return len(body) + escaped + 2 * header_bytes + _EVENT_CONTEXT_BYTES


def event_too_large(body: bytes, headers: Iterable[tuple[str, str]]) -> bool:
    """Whether the event that carries this request is over what Lambda takes; a body under a
    quarter of it (escaped, at most twice its size) is not measured."""
    return 4 * len(body) > LAMBDA_PAYLOAD_BYTES and event_size(body, headers) > LAMBDA_PAYLOAD_BYTES


def answer_limit(scope: dict[str, Any]) -> int | None:
    """The most bytes a buffered answer may take, JSON-escaped: Lambda's, for a request that came
    in a Lambda event (Mangum's scope has it); none where the answer is streamed or served plainly."""
    return LAMBDA_PAYLOAD_BYTES - _ANSWER_ENVELOPE_BYTES if "aws.event" in scope else None


def answer_size(body: bytes) -> int:
    """The bytes of the body as the runtime writes it in its answer: a JSON string, every
    character past ASCII escaped (the most it may take)."""
    if 6 * len(body) < LAMBDA_PAYLOAD_BYTES // 2:  # however it is escaped: far within
        return 6 * len(body)
    return escaped_size(body) + 2


def escaped_size(piece: bytes) -> int:
    """The bytes of a piece of a body (whole characters) inside the answer's JSON string."""
    return len(json.dumps(piece.decode("utf-8", "replace"))) - 2
