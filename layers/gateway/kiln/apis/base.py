"""What a model endpoint declares, and what the chat-style endpoints share.

`kiln.normalize` and `kiln.exchange` know nothing of any one endpoint: they ask its
`ModelApi` which fields to check, how to forward, where its usage is, how to estimate it when
the model server reports none, and how its stream ends.
"""

from __future__ import annotations

from typing import Any, Collection, Iterator

from ..echo import Echoes
from ..errors import InvalidType, UnsupportedParameter
from ..jsonio import dumps
from ..lax import server_bool
from ..metering import TokenUsage, estimate_text_tokens, fewest_tokens, shown_usage
from ..sse import DONE, SseRelay, error_event, is_error_object, usage_event

__all__ = ["ChatStyleApi", "ModelApi", "stream_flag"]


def stream_flag(value: Any) -> bool:
    """true, "true", 1 → True; false, "false", 0, absent → False (contract §3)."""
    if value is True or value == "true" or (type(value) is int and value == 1):
        return True
    if value is False or value == "false" or (type(value) is int and value == 0):
        return False
    raise InvalidType(
        "Invalid type for 'stream': expected a boolean (true/false, \"true\"/\"false\" or 1/0).", param="stream"
    )


_NO_NAMES: frozenset[str] = frozenset()


# what an echoed prompt may take in an event against its bytes in the request: a server that
# escapes every non-ASCII character writes é (2 bytes) as \u00e9 (6)
ECHO_ESCAPED = 3


class ModelApi:
    """One model endpoint's rules. Subclasses fill in what differs."""

    name: str = ""  # as recorded in usage events
    openapi_body: Any = None  # () -> the OpenAPI description of its request body (kiln.schemas)
    upstream_path: str = ""  # appended to a backend's base URL
    # the message of the stream's error when the upstream's body ends before its last event
    unfinished = "the stream ended before [DONE]"
    # the request fields its model servers honour to cap a reply's tokens (contract §4)
    token_limits: tuple[str, ...] = ()
    # the field asking for several choices (each bounded as one reply); None: one reply only
    choices_field: str | None = "n"

    # -- validation (contract §2 step 4) ---------------------------------------------------

    def check_before_model(self, body: dict[str, Any]) -> None:
        """Checks the contract puts before the model lookup."""

    def check(self, body: dict[str, Any], model: Any) -> None:
        """Checks that need the catalog entry (capabilities) and field types."""

    def forward(self, body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], bool]:
        """The body to send upstream, and whether the client itself asked for the usage chunk."""
        forwarded = dict(body)
        if "stream" in body:
            forwarded["stream"] = stream
        return forwarded, False

    # -- metering (contract §4) --------------------------------------------------------------

    def reported_usage(self, usage: Any) -> Any:
        """The upstream's usage object in the chat names (prompt_tokens, …); anything else as is."""
        return usage

    def prompts(self, body: dict[str, Any]) -> int:
        """How many prompts the request carries, each answered on its own (a batch)."""
        return 1

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        raise NotImplementedError

    def fewest_prompt_tokens(self, body: dict[str, Any]) -> int:
        """The fewest tokens the request's prompt can be (`fewest_tokens` of each text the model
        reads as text, a token per token id); 0 where the model server may shorten it."""
        return 0

    def echoes(self, body: dict[str, Any]) -> Echoes:
        """The texts the replies may start with, repeated from the request (an `echo` the
        endpoint's servers honour): none by default."""
        return Echoes(())

    def estimate_completion(self, answer: dict[str, Any], offered: Collection[str] = ()) -> int:
        """A buffered answer's completion tokens by the estimate; `offered`: the names of the
        request's tools, which a server may write itself (`offered_names`)."""
        raise NotImplementedError

    def fewest_completion_tokens(self, answer: dict[str, Any], offered: Collection[str] = ()) -> int:
        """The fewest completion tokens a buffered answer can be (`fewest_tokens` of each text)."""
        raise NotImplementedError

    def offered_names(self, body: dict[str, Any]) -> frozenset[str]:
        """The names of the tools the request offers: a tool call's name that is one of them may
        be the server's writing (vLLM writes it for a named tool_choice), not the model's, so
        it is counted neither as a floor nor in an estimate; any other name is text."""
        if "tools" not in body and "functions" not in body:
            return _NO_NAMES
        names = set()
        for field in ("tools", "functions"):
            tools = body.get(field)
            for tool in tools if isinstance(tools, list) else []:
                if not isinstance(tool, dict):
                    continue
                function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
                if isinstance(function.get("name"), str):
                    names.add(function["name"])
        return frozenset(names)

    def shape_problem(self, answer: dict[str, Any]) -> str | None:
        """What makes a buffered 200 answer unreadable (→ 502), or None."""
        return None

    def with_usage(self, answer: dict[str, Any], usage: TokenUsage, cost: Any) -> None:
        """Write the billed usage, with its cost, into a buffered answer."""
        raise NotImplementedError

    def finish_reason(self, answer: dict[str, Any]) -> str | None:
        return None

    def failed(self, answer: dict[str, Any]) -> bool:
        """Whether a 200 answer says the model server failed the request (settled as `upstream_error`)."""
        return False

    # -- streaming (contract §7, §9) -----------------------------------------------------------

    def relay(self, *, client_wants_usage: bool, max_event_bytes: int, request_bytes: int = 0,
              echoes: Echoes | None = None, offered: Collection[str] = ()) -> SseRelay:
        """The stream's relay; `request_bytes`: the size of the request the model server was
        sent; `echoes`: what its replies may repeat of it (an `echo`, whose first event holds
        the prompt: the bound takes in the longest text repeated, as escaped, never more than
        the request's size); `offered`: its tools' names (`offered_names`)."""
        if echoes:
            max_event_bytes += ECHO_ESCAPED * min(echoes.longest_bytes, request_bytes)  # what one event repeats
        return SseRelay(client_wants_usage=client_wants_usage, max_event_bytes=max_event_bytes, echoes=echoes,
                        offered=offered)

    def stream_tail(self, relay: SseRelay, usage: TokenUsage, cost: Any, client_wants_usage: bool) -> bytes:
        """The last bytes of a stream that ended well (after the settle)."""
        raise NotImplementedError

    def stream_error(self, message: str, relay: SseRelay) -> bytes:
        """The one event that ends a stream that failed (§5), after what `relay` relayed."""
        return error_event(message)


class ChatStyleApi(ModelApi):
    """Chat and text completions: `choices`, `usage` in prompt/completion tokens, SSE `data:`
    events ending in `[DONE]`, usage forced upstream and hidden unless asked for."""

    def forward(self, body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], bool]:
        forwarded, _ = super().forward(body, stream)
        if not stream:
            return forwarded, False
        options = body.get("stream_options")
        if options is None:
            options = {}
        elif not isinstance(options, dict):
            raise InvalidType("Invalid type for 'stream_options': expected an object.", param="stream_options")
        forwarded["stream_options"] = {**options, "include_usage": True}
        return forwarded, server_bool(options.get("include_usage")) is True

    def shape_problem(self, answer: dict[str, Any]) -> str | None:
        if is_error_object(answer):
            # what ends a stream with the error event (§5) is no completion either: the SDK
            # would hand the client one with no choices
            return "an error object, not a completion"
        choices = answer.get("choices", [])
        if not isinstance(choices, list):
            return "choices is not an array"
        for choice in choices:
            if not isinstance(choice, dict):
                return "a choice is not an object"
            message = choice.get("message")
            if message is None:
                continue
            if not isinstance(message, dict):
                return "a message is not an object"
            calls = message.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(isinstance(call, dict) for call in calls)):
                return "tool_calls is not an array of objects"
        return None

    def estimate_completion(self, answer: dict[str, Any], offered: Collection[str] = ()) -> int:
        return sum(estimate_text_tokens(text) for text in _answer_texts(answer, offered))

    def fewest_completion_tokens(self, answer: dict[str, Any], offered: Collection[str] = ()) -> int:
        return sum(fewest_tokens(text) for text in _answer_texts(answer, offered))

    def with_usage(self, answer: dict[str, Any], usage: TokenUsage, cost: Any) -> None:
        if usage.source == "upstream":
            answer["usage"] = shown_usage(answer["usage"], usage, cost)
        else:
            answer["usage"] = usage.as_openai(cost)

    def finish_reason(self, answer: dict[str, Any]) -> str | None:
        choices = answer.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            reason = choices[0].get("finish_reason")
            return reason if isinstance(reason, str) else None
        return None

    def stream_tail(self, relay: SseRelay, usage: TokenUsage, cost: Any, client_wants_usage: bool) -> bytes:
        """The usage chunk for a client that asked for it (the upstream's own, cost added, if its
        usage is the one billed and was believed; else one the gateway writes with what it
        billed: a later content chunk may have carried other usage), then `[DONE]`."""
        if not client_wants_usage:
            return DONE
        if (relay.usage_chunk is not None and usage.source == "upstream"
                and relay.usage_chunk.get("usage") is relay.reported_usage):
            return usage_event(relay.usage_chunk, shown_usage(relay.usage_chunk["usage"], usage, cost)) + DONE
        return usage_event(relay.usage_chunk or relay.first_chunk or {}, usage.as_openai(cost)) + DONE


def forced_tool_choice(tool_choice: Any) -> bool:
    """Does this tool_choice force a tool call? "required" (any case), a named tool of any type
    (function, custom, mcp, hosted tools), or an allowed-tools list whose mode is not "auto"
    (chat nests the mode under `allowed_tools`, the Responses API does not)."""
    if isinstance(tool_choice, str):
        return tool_choice.strip().lower() == "required"
    if not isinstance(tool_choice, dict) or tool_choice.get("type") in ("auto", "none"):
        return False
    if tool_choice.get("type") != "allowed_tools":
        return True
    nested = tool_choice.get("allowed_tools")
    mode = tool_choice.get("mode", nested.get("mode") if isinstance(nested, dict) else None)
    return mode != "auto"


def tool_choice_type_check(tool_choice: Any) -> None:
    """A tool_choice that is neither a string nor an object is refused (`invalid_type`, after
    every `unsupported_parameter` check: §2 step 4's order): forwarded, it would be whatever
    the model server makes of it, whatever the model's capabilities."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise InvalidType("Invalid type for 'tool_choice': expected a string or an object.", param="tool_choice")


def capability_check(model: Any, tool_choice: Any, formats: tuple[Any, str]) -> None:
    """Forced tool choice and JSON output, on a model whose catalog entry lacks them (§3, §9)."""
    caps = model.capabilities
    if forced_tool_choice(tool_choice) and not caps.forced_tool_choice:
        raise UnsupportedParameter(
            f"The model `{model.id}` does not support forced tool choice; send tool_choice \"auto\" instead.",
            param="tool_choice",
        )
    # any constrained format (json_object, json_schema, vLLM's and SGLang's structural_tag,
    # regex, …) needs it; plain text, or a format with no type to serve, is the server's to answer
    value, param = formats
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind != "text" and not caps.json_response_format:
        raise UnsupportedParameter(
            f"The model `{model.id}` does not support {param} {kind!r}; "
            "ask for JSON in the prompt and validate it client-side.",
            param=param,
        )


def _answer_texts(answer: dict[str, Any], offered: Collection[str] = ()) -> Iterator[str]:
    """Every text of a chat or text completion the model wrote: text, content (a string, its
    text parts, or whatever else the SDKs hand the client: strings and numbers of an array, an
    object's text, a number), reasoning (once, under whichever names a server gives it), refusal,
    and the arguments of tool calls and of the older function_call (any JSON but a string, as
    JSON) and their names (but those of the request's tools, `offered`: a server may write
    them), and an audio reply's transcript."""
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        reasoning = message.get("reasoning")
        if reasoning == message.get("reasoning_content"):  # one text under both names (vllm-mlx, mlx-vlm)
            reasoning = None
        texts = [*_written(choice.get("text")), *_written(message.get("reasoning_content")), *_written(reasoning),
                 *_written(message.get("refusal")), *_written(message.get("content"))]
        calls = message.get("tool_calls")
        functions = [call.get("function") for call in calls if isinstance(call, dict)] if isinstance(calls, list) else []
        for function in [*functions, message.get("function_call")]:
            if isinstance(function, dict):
                name = function.get("name")
                arguments = function.get("arguments")
                if arguments is not None and not isinstance(arguments, (str, bool)):
                    arguments = dumps(arguments).decode("utf-8", "surrogatepass")
                texts += [None if isinstance(name, str) and name in offered else name, arguments]
        audio = message.get("audio")
        if isinstance(audio, dict):
            texts.append(audio.get("transcript"))
        yield from (text for text in texts if isinstance(text, str))


def _written(value: Any) -> list[str]:
    """The texts of a field that holds what the model wrote: a string; an array's strings,
    numbers and parts' texts; an object's text (a part); a number."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [text for item in value for text in _written(item)]
    if isinstance(value, dict):
        return _written(value.get("text"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [dumps(value).decode()]
    return []
