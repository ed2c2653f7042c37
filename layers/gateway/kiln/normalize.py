"""Request normalization and validation, contract §3, before any slot or upstream call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .catalog import Catalog, ModelEntry
from .errors import EmptyArray, InvalidJson, InvalidType, MissingParameter, ModelNotFound, UnsupportedParameter

__all__ = ["CHAT", "COMPLETIONS", "Endpoint", "ModelCall", "normalize"]


class Endpoint:
    """One of the two completion endpoints (CHAT, COMPLETIONS: compared by identity)."""

    __slots__ = ("name", "upstream_path")

    def __init__(self, name: str, upstream_path: str) -> None:
        self.name = name  # as recorded in usage events
        self.upstream_path = upstream_path  # appended to a backend's base URL

    @property
    def is_chat(self) -> bool:
        return self is CHAT


CHAT = Endpoint("chat.completions", "/chat/completions")
COMPLETIONS = Endpoint("completions", "/completions")


@dataclass(frozen=True)
class ModelCall:
    """A validated request, ready to be forwarded."""

    endpoint: Endpoint
    model: ModelEntry
    stream: bool
    # whether the client itself asked for the usage chunk (we always ask upstream)
    client_wants_usage: bool
    body: dict[str, Any]


def _stream_flag(value: Any) -> bool:
    """true, "true", 1 → True; false, "false", 0, absent → False (contract §3)."""
    if value is True or value == "true" or (type(value) is int and value == 1):
        return True
    if value is False or value == "false" or (type(value) is int and value == 0):
        return False
    raise InvalidType(
        "Invalid type for 'stream': expected a boolean (true/false, \"true\"/\"false\" or 1/0).", param="stream"
    )


def normalize(endpoint: Endpoint, body: Any, catalog: Catalog) -> ModelCall:
    """Validate in the contract's order (§2 step 4), then build the body to forward.

    missing model → empty messages → unknown model → tool descriptions → capabilities →
    field types. Unknown fields are forwarded untouched.
    """
    if not isinstance(body, dict):
        raise InvalidJson("The request body must be a JSON object.")
    model_id = body.get("model")
    if not isinstance(model_id, str):
        raise MissingParameter("You must provide a model parameter (a string).", param="model")
    if endpoint.is_chat:
        _check_messages_present(body)
    model = catalog.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    if endpoint.is_chat:
        _check_tool_descriptions(body)
        _check_capabilities(body, model)
        _check_chat_types(body)

    stream = _stream_flag(body["stream"]) if "stream" in body else False
    client_wants_usage = False
    forwarded = dict(body)
    if "stream" in body:
        forwarded["stream"] = stream
    if stream:
        options = body.get("stream_options")
        if options is None:
            options = {}
        elif not isinstance(options, dict):
            raise InvalidType("Invalid type for 'stream_options': expected an object.", param="stream_options")
        client_wants_usage = options.get("include_usage") is True
        forwarded["stream_options"] = {**options, "include_usage": True}
    return ModelCall(endpoint, model, stream, client_wants_usage, forwarded)


def _check_messages_present(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None or messages == []:
        raise EmptyArray("Invalid 'messages': the array must contain at least one message.", param="messages")


def _check_chat_types(body: dict[str, Any]) -> None:
    if not isinstance(body["messages"], list):
        raise InvalidType("Invalid type for 'messages': expected an array of messages.", param="messages")
    if "tools" in body and body["tools"] is not None and not isinstance(body["tools"], list):
        raise InvalidType("Invalid type for 'tools': expected an array.", param="tools")


def _check_tool_descriptions(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("description"), str):
            raise MissingParameter(
                f"Missing required parameter: 'tools[{index}].function.description'. "
                "Every function tool must say what it does.",
                param=f"tools[{index}].function.description",
            )


def _check_capabilities(body: dict[str, Any], model: ModelEntry) -> None:
    caps = model.capabilities
    tool_choice = body.get("tool_choice")
    forced = tool_choice == "required" or (isinstance(tool_choice, dict) and tool_choice.get("type") == "function")
    if forced and not caps.forced_tool_choice:
        raise UnsupportedParameter(
            f"The model `{model.id}` does not support forced tool choice; send tool_choice \"auto\" instead.",
            param="tool_choice",
        )
    response_format = body.get("response_format")
    if (
        isinstance(response_format, dict)
        and response_format.get("type") in ("json_object", "json_schema")
        and not caps.json_response_format
    ):
        raise UnsupportedParameter(
            f"The model `{model.id}` does not support response_format {response_format['type']!r}; "
            "ask for JSON in the prompt and validate it client-side.",
            param="response_format",
        )
    if body.get("ignore_eos") is True and not caps.ignore_eos:
        raise UnsupportedParameter(
            f"The model `{model.id}` does not support ignore_eos; remove it from the request.", param="ignore_eos"
        )
