"""POST /v1/chat/completions (contract §3): messages, tools, capabilities, then forwarded."""

from __future__ import annotations

from typing import Any

from .. import schemas
from ..echo import Echoes
from ..errors import EmptyArray, InvalidType, MissingParameter, UnsupportedParameter
from ..lax import server_bool
from ..metering import content_texts, estimate_prompt_tokens, fewest_prompt_text_tokens
from .base import ChatStyleApi, capability_check, tool_choice_type_check

__all__ = ["API", "ChatApi"]


# The model servers' own ways to constrain a reply, beside response_format: vLLM's
# (guided_*, structured_outputs, structural_tag), SGLang's (regex, ebnf, json_schema), llama.cpp's (grammar,
# json_schema). Each needs the same capability as a JSON response_format.
CONSTRAINED_OUTPUT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                             "structural_tag", "regex", "ebnf", "json_schema", "grammar")


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
        if not model.capabilities.json_response_format:
            for field in CONSTRAINED_OUTPUT_FIELDS:
                if body.get(field) is not None:
                    raise UnsupportedParameter(
                        f"The model `{model.id}` does not support constrained output ({field}); "
                        "ask for the format in the prompt and validate it client-side.", param=field)
        if server_bool(body.get("ignore_eos")) and not model.capabilities.ignore_eos:
            raise UnsupportedParameter(
                f"The model `{model.id}` does not support ignore_eos; remove it from the request.", param="ignore_eos"
            )
        tool_choice_type_check(body.get("tool_choice"))
        if not isinstance(body["messages"], list):
            raise InvalidType("Invalid type for 'messages': expected an array of messages.", param="messages")
        if "tools" in body and body["tools"] is not None and not isinstance(body["tools"], list):
            raise InvalidType("Invalid type for 'tools': expected an array.", param="tools")

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        return estimate_prompt_tokens(body, chat=True)

    def fewest_prompt_tokens(self, body: dict[str, Any]) -> int:
        """Each message's text (its content string or text parts), but the assistant's: the
        model's own template may drop what it wrote before (Qwen3's and DeepSeek-R1's drop
        its reasoning). vLLM's truncate_prompt_tokens keeps only the prompt's last tokens, and
        a chat_template of the client's own may leave any text out: with either, no floor."""
        if body.get("truncate_prompt_tokens") is not None or body.get("chat_template") is not None:
            return 0
        return sum(fewest_prompt_text_tokens(text) for message in body["messages"]
                   if isinstance(message, dict) and message.get("role") != "assistant"
                   for text in content_texts(message.get("content")))

    def echoes(self, body: dict[str, Any]) -> Echoes:
        """vLLM's chat `echo` starts each reply with the last message when it has the reply's
        role: the assistant's, or any with add_generation_prompt false (its content, its text
        parts joined by a newline)."""
        messages = body.get("messages")
        if not server_bool(body.get("echo")) or not isinstance(messages, list) or not messages:
            return Echoes(())
        last = messages[-1]
        prompted = server_bool(body.get("add_generation_prompt"))
        if not isinstance(last, dict) or (prompted is not False and last.get("role") != "assistant"):
            return Echoes(())
        content = last.get("content")
        if isinstance(content, str):
            return Echoes([content])
        texts = list(content_texts(content))
        return Echoes(["\n".join(texts), "".join(texts)])


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
