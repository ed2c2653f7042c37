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

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        return estimate_prompt_tokens(body, chat=False)


API = CompletionsApi()
