"""POST /v1/completions (contract §3): nothing of the body is validated but the model."""

from __future__ import annotations

from typing import Any

from .. import schemas
from ..metering import estimate_prompt_tokens
from .base import ChatStyleApi

__all__ = ["API", "CompletionsApi"]


class CompletionsApi(ChatStyleApi):
    name = "completions"
    openapi_body = staticmethod(schemas.completion_body)
    upstream_path = "/completions"
    token_limits = ("max_tokens", "n_predict")  # n_predict: llama.cpp's server, which takes it first

    def prompts(self, body: dict[str, Any]) -> int:
        """A list of strings, or of token-id lists, is a batch; a string or one list of token
        ids is one prompt."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
            return len(prompt)
        return 1

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        return estimate_prompt_tokens(body, chat=False)


API = CompletionsApi()
