"""POST /v1/completions (contract §3): nothing of the body is validated but the model."""

from __future__ import annotations

from typing import Any

from .. import schemas
from ..echo import Echoes
from ..lax import server_bool, server_int
from ..metering import estimate_prompt_tokens, fewest_prompt_text_tokens
from .base import ChatStyleApi

__all__ = ["API", "CompletionsApi"]


class CompletionsApi(ChatStyleApi):
    name = "completions"
    openapi_body = staticmethod(schemas.completion_body)
    upstream_path = "/completions"
    token_limits = ("max_tokens", "n_predict")  # n_predict: llama.cpp's server, which takes it first

    def prompts(self, body: dict[str, Any]) -> int:
        """A list of strings, or of token-id lists, is a batch; a string or one list of token
        ids is one prompt. vLLM's `prompt_embeds` (one, or a list) are prompts too, beside
        those of `prompt`, which it serves as well: a batch of embeddings answers as many."""
        embeds = _embeds(body)
        prompt = body.get("prompt")
        if prompt is None and embeds:
            return embeds
        if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
            return len(prompt) + embeds
        return 1 + embeds

    def estimate_prompt(self, body: dict[str, Any]) -> int:
        """The prompt's text as estimated, and a token for each prompt of embeddings (their
        tensors are not read: at least a token each, never nothing)."""
        return estimate_prompt_tokens(body, chat=False) + _embeds(body)

    def echoes(self, body: dict[str, Any]) -> Echoes:
        """With `echo`, each reply starts with its prompt; a batch's choices are its prompts',
        `n` each, in order. A prompt of token ids comes back as text the gateway cannot know:
        never taken off the texts, its ids (once per choice) are taken off the counts."""
        if not server_bool(body.get("echo")):
            return Echoes(())
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return Echoes([prompt])
        if not isinstance(prompt, list):
            return Echoes(())
        if not any(isinstance(item, (str, list)) for item in prompt):
            return Echoes((), ids=[_token_ids(prompt)])  # one prompt of token ids
        n = server_int(body.get("n"))  # as the model server reads it: "2" and 2.0 are 2 choices
        return Echoes(prompt, per_prompt=n if n is not None and n >= 1 else 1,
                      ids=[_token_ids(item) if isinstance(item, list) else 0 for item in prompt])

    def fewest_prompt_tokens(self, body: dict[str, Any]) -> int:
        """Each prompt string's text, a token per token id and one per prompt of embeddings;
        none with vLLM's truncate_prompt_tokens, which keeps only the prompt's last tokens."""
        if body.get("truncate_prompt_tokens") is not None:
            return 0
        prompt = body.get("prompt")
        total = _embeds(body)  # a prompt of embeddings is a token at least
        for item in prompt if isinstance(prompt, list) else [prompt]:
            if isinstance(item, str):
                total += fewest_prompt_text_tokens(item)
            elif type(item) is int:
                total += 1
            elif isinstance(item, list):
                total += sum(1 for token in item if type(token) is int)
        return total


def _embeds(body: dict[str, Any]) -> int:
    """How many prompts of embeddings (vLLM's `prompt_embeds`: one, or a list) the body holds."""
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, list):
        return len(embeds)
    return 0 if embeds is None else 1


def _token_ids(prompt: list[Any]) -> int:
    """The token ids of a prompt given as ids: what its echo is, in tokens."""
    return sum(1 for token in prompt if type(token) is int)


API = CompletionsApi()
