"""POST /v1/chat/completions (contract §3): messages, tools, capabilities, then forwarded."""

from __future__ import annotations

from typing import Any

from .. import schemas
from ..errors import EmptyArray, InvalidType, MissingParameter, UnsupportedParameter
from ..lax import server_bool
from ..metering import estimate_prompt_tokens
from .base import ChatStyleApi, capability_check

__all__ = ["API", "ChatApi"]


class ChatApi(ChatStyleApi):
    name = "chat.completions"
    openapi_body = staticmethod(schemas.chat_body)
    upstream_path = "/chat/completions"
    # vLLM takes max_completion_tokens over max_tokens, other servers the reverse, and
    # llama.cpp's server n_predict over both
    token_limits = ("max_tokens", "max_completion_tokens", "n_predict")

    def check_before_model(self, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if messages is None or messages == []:
            raise EmptyArray("Invalid 'messages': the array must contain at least one message.", param="messages")

    def check(self, body: dict[str, Any], model: Any) -> None:
        _check_tool_descriptions(body)
        capability_check(model, body.get("tool_choice"), (body.get("response_format"), "response_format"))
        if server_bool(body.get("ignore_eos")) and not model.capabilities.ignore_eos:
            raise UnsupportedParameter(
                f"The model `{model.id}` does not support ignore_eos; remove it from the request.", param="ignore_eos"
            )
        if not isinstance(body["messages"], list):
            raise InvalidType("Invalid type for 'messages': expected an array of messages.", param="messages")
        if "tools" in body and body["tools"] is not None and not isinstance(body["tools"], list):
            raise InvalidType("Invalid type for 'tools': expected an array.", param="tools")

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        return estimate_prompt_tokens(body, chat=True)


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


API = ChatApi()
