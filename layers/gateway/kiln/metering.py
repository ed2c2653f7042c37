"""Token counts and their price (contract §4). All money is Decimal, never float."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Iterable

from .catalog import PER_MILLION, Pricing

__all__ = ["TokenUsage", "cost_of", "estimate_prompt_tokens", "estimate_text_tokens"]

# A rough but stable rule for text we cannot tokenize: ~4 characters per token.
CHARS_PER_TOKEN = 4
# What a chat template adds around each message.
TOKENS_PER_MESSAGE = 3


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    # "upstream" when the model server reported it, "estimated" when the gateway counted
    source: str = "upstream"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_upstream(cls, usage: Any) -> "TokenUsage | None":
        """The usage object a model server sent, or None if it is missing or unusable."""
        if not isinstance(usage, dict):
            return None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not (_count(prompt) and _count(completion)):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(prompt, completion, cached if _count(cached) else None, "upstream")

    def as_openai(self, cost: Decimal) -> dict[str, Any]:
        """A usage object as clients see it, when the gateway has to write one itself."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        usage["cost"] = cost
        return usage


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def cost_of(usage: TokenUsage, pricing: Pricing) -> Decimal:
    """prompt × input + completion × output, cached prompt tokens at the cached price if any."""
    cached = usage.cached_tokens or 0
    if pricing.cached_input is None or cached == 0:
        prompt_cost = usage.prompt_tokens * pricing.input
    else:
        cached = min(cached, usage.prompt_tokens)
        prompt_cost = (usage.prompt_tokens - cached) * pricing.input + cached * pricing.cached_input
    return (prompt_cost + usage.completion_tokens * pricing.output) / PER_MILLION


def estimate_text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN) if text else 0


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a request whose model server did not report usage."""
    if "messages" in body:
        messages = body.get("messages") or []
        return sum(TOKENS_PER_MESSAGE + estimate_text_tokens("".join(_texts(m))) for m in messages)
    prompt = body.get("prompt")
    return estimate_text_tokens("".join(_texts(prompt)))


def _texts(value: Any) -> Iterable[str]:
    """Every string inside a message or prompt (content parts, tool calls, token arrays)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                yield "tokn"  # a token id counts as one token
            else:
                yield from _texts(item)
