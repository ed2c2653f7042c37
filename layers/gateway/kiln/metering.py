"""Token counts and their price (contract §4). All money is Decimal, never float.

What a model server reports is believed only within what the request could have produced
(`UsageBounds`): a count that is not a non-negative integer, or beyond the bounds, is
replaced by the gateway's own count or estimate, capped (`billable_usage`). So a bill is
always a finite number that DynamoDB can store, whatever the upstream says.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Context, Decimal
from typing import Any, Callable, Iterable, Iterator

from .catalog import PER_MILLION, Pricing
from .jsonio import dumps
from .lax import server_int

__all__ = [
    "TokenUsage",
    "UsageBounds",
    "billable_usage",
    "cost_of",
    "estimate_prompt_tokens",
    "estimate_text_tokens",
    "content_texts",
    "fewest_prompt_text_tokens",
    "fewest_tokens",
    "estimate_input_tokens",
    "estimate_rendered_tokens",
    "texts_of",
]

# Costs are computed exactly (bounded counts × catalog prices need far fewer digits than
# this), then kept to the 38 significant digits a DynamoDB number holds, so what is billed
# is exactly what is stored.
_EXACT = Context(prec=120)
_STORED = Context(prec=38)
# `n` beyond this is no request a model server serves (vLLM has no limit of its own, so an
# honest answer of 200 choices must be believed); it keeps every bound, and so every bill,
# a number DynamoDB stores.
MAX_CHOICES = 1_000_000
# No request uses more tokens than this, of its prompts or of its replies: a billion tokens a
# second for the fifteen minutes the longest function runs is less. It keeps a bill at most $2E12
# at the dearest price (kiln.catalog.MAX_PRICE), so that an org's balance, once it reached 0 and
# the most requests it can have in flight (kiln.settings.MAX_ORG_CONCURRENCY) each settle that,
# still has no more than 23 digits before the point: DynamoDB computes it exactly in its 38
# digits (kiln.store.orgs.MAX_CREDITS). The context length times the choices times the prompts
# of a request comes to 1E+21 and more.
MAX_REQUEST_TOKENS = 10**12

# A rough but stable rule for text we cannot tokenize: ~4 characters per token.
CHARS_PER_TOKEN = 4
# Longer than any token of the tokenizers model servers use (their longest are runs of
# spaces or punctuation), in characters or in bytes as sent: a text is at least its length
# over this many tokens, however it was tokenized.
LONGEST_TOKEN = 128
# the longest text a single token is (as sent, escapes included): longer deltas hold several
TOKEN_BYTES = 16
# What a chat template adds around each message.
TOKENS_PER_MESSAGE = 3
# The content parts whose `text` a model reads as text (chat's, the Responses API's).
TEXT_PARTS = ("text", "input_text", "output_text")
# The content parts that carry media (chat's, the Responses API's, vLLM's): their data (a
# data URL's base64, say) is no text the model reads. Each is estimated as a picture of
# middling size is to a vision model (Qwen2-VL: 256 tokens for 448 × 448 pixels).
MEDIA_PARTS = frozenset(("image_url", "input_image", "image", "image_embeds", "image_pil", "input_audio", "audio_url",
                         "audio", "audio_embeds", "video_url", "video", "video_embeds", "file", "input_file",
                         "computer_screenshot"))
MEDIA_PART_TOKENS = 256
# The request fields beside the messages that a chat template renders into the prompt.
CHAT_PROMPT_FIELDS = ("tools", "functions", "documents")


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


def shown_usage(reported: dict[str, Any], usage: TokenUsage, cost: Any) -> dict[str, Any]:
    """A believed usage object as the client is shown it: the model server's, with `cost` and its
    `total_tokens` the sum of the tokens billed (§4: a total nobody checked would show the client
    another figure than the one billed); a count below zero, at its top or in a breakdown (a
    server's `reasoning_tokens` of -5), is shown as 0. Everything else is as the server wrote it:
    lists per turn, counts of tool output (which may exceed the reply's tokens), fields of its own."""
    shown = dict(reported)
    for name, value in reported.items():
        if type(value) is int and value < 0:
            shown[name] = 0
        elif isinstance(value, dict) and any(type(count) is int and count < 0 for count in value.values()):
            shown[name] = {part: 0 if type(count) is int and count < 0 else count for part, count in value.items()}
    shown["total_tokens"], shown["cost"] = usage.total_tokens, cost  # the bill's, whatever the server wrote there
    return shown


@dataclass(frozen=True)
class UsageBounds:
    """The most a request can have used: each of its prompts within the model's context, its
    reply within its own token limit (per choice) and the context, for each of its `n`
    choices of each prompt; neither more than MAX_REQUEST_TOKENS."""

    prompt: int
    completion: int

    @classmethod
    def of_request(cls, body: dict[str, Any], context_length: int, *, limits: tuple[str, ...],
                   prompts: int = 1, choices_field: str | None = "n") -> "UsageBounds":
        """`limits`: the fields that cap a reply's tokens on the endpoint's model servers (a
        field of another endpoint, which they ignore, caps nothing); as servers differ on
        which of them wins, the largest given is the bound, and one given that is no count
        (llama.cpp reads `n_predict: -1` as no limit) or 0 (which some servers read as no
        limit, and which a server that produced tokens did not read as none) leaves only the
        context. `prompts`:
        how many the request carries (a batch of completions), each with its `n` choices;
        `choices_field`: the field that asks for several choices on the endpoint (None: the
        endpoint answers one reply, whatever the body says, as the Responses API does)."""
        given = [body[name] if _count(body[name]) and body[name] > 0 else context_length
                 for name in limits if body.get(name) is not None]
        per_choice = min(context_length, max(given)) if given else context_length
        # `n` as the model server reads it ("4" and 4.0 are 4 choices there); a cap is read
        # exactly: one the server might not honour caps nothing
        n = server_int(body.get(choices_field)) if choices_field is not None else None
        choices = min(n, MAX_CHOICES) if n is not None and n >= 1 else 1
        prompts = max(prompts, 1)
        return cls(prompt=min(context_length * prompts, MAX_REQUEST_TOKENS),
                   completion=min(per_choice * choices * prompts, MAX_REQUEST_TOKENS))


def billable_usage(
    reported: Any,
    bounds: UsageBounds,
    *,
    prompt_estimate: Callable[[], int],
    completion_count: Callable[[], int],
    completion_floor: int = 0,
    prompt_floor: Callable[[], int] | None = None,
) -> tuple[TokenUsage, list[str]]:
    """The usage to bill, and what was wrong with the reported one (empty when believed).

    No usage reported: the gateway's own count and estimate (`estimated`). A reported count
    that is not a non-negative integer, exceeds its bound, is below its floor (the fewest
    tokens the texts can be: `completion_floor` of those relayed or answered, `prompt_floor()`
    of the prompt's), or (prompt tokens) is 0 for a prompt the gateway counts tokens in: that
    count is replaced by the gateway's own, capped at the bound (`capped`). Cached tokens
    that are no count or more than the prompt tokens billed are none (`capped` too).
    """
    floor: list[int] = []  # the prompt's floor, once worked out

    def least_prompt() -> int:  # worked out at most once, and only when a count needs it
        if not floor:
            floor.append(min(prompt_floor(), bounds.prompt) if prompt_floor is not None else 0)
        return floor[0]

    def own_prompt() -> int:  # the estimate, never below the floor: no count is no way under it
        return min(max(prompt_estimate(), least_prompt()), bounds.prompt)

    if not isinstance(reported, dict) or (
        reported.get("prompt_tokens") is None and reported.get("completion_tokens") is None
    ):
        usage = TokenUsage(own_prompt(), min(completion_count(), bounds.completion), None, "estimated")
        return usage, []
    problems: list[str] = []
    prompt = reported.get("prompt_tokens")
    if not (_count(prompt) and prompt <= bounds.prompt):
        problems.append(f"prompt_tokens {_implausible(prompt, bounds.prompt)}")
        prompt = own_prompt()
    elif prompt == 0 and prompt_estimate() > 0:
        problems.append("prompt_tokens 0 for a prompt that is not empty")
        prompt = own_prompt()
    elif prompt < (least := least_prompt()):
        problems.append(f"prompt_tokens {_implausible(prompt, bounds.prompt, least)}")
        prompt = own_prompt()
    completion = reported.get("completion_tokens")
    floor = min(completion_floor, bounds.completion)
    if not (_count(completion) and floor <= completion <= bounds.completion):
        problems.append(f"completion_tokens {_implausible(completion, bounds.completion, floor)}")
        completion = min(max(completion_count(), floor), bounds.completion)
    details = reported.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if details is not None and not isinstance(details, dict):
        problems.append(f"prompt_tokens_details not an object ({type(details).__name__})")
    elif cached is not None and not (_count(cached) and cached <= prompt):
        # more cached than the prompt holds, or no count: none is believed cached (the
        # whole prompt at the input price), and the client is shown what was billed
        problems.append(f"cached_tokens {_implausible(cached, prompt)}")
        cached = None
    return TokenUsage(prompt, completion, cached, "capped" if problems else "upstream"), problems


def _implausible(value: Any, bound: int, floor: int = 0) -> str:
    if _count(value) and value < floor:
        return f"below the {floor} tokens its texts hold at the least"
    if _count(value):
        return f"above the bound of {bound}"
    return f"not a count ({type(value).__name__})"


def cost_of(usage: TokenUsage, pricing: Pricing) -> Decimal:
    """prompt × input + completion × output, cached prompt tokens at the cached price if any."""
    cached = usage.cached_tokens or 0
    exact = _EXACT
    if pricing.cached_input is None or cached == 0:
        prompt_cost = exact.multiply(usage.prompt_tokens, pricing.input)
    else:
        cached = min(cached, usage.prompt_tokens)
        prompt_cost = exact.add(
            exact.multiply(usage.prompt_tokens - cached, pricing.input), exact.multiply(cached, pricing.cached_input)
        )
    total = exact.add(prompt_cost, exact.multiply(usage.completion_tokens, pricing.output))
    return _STORED.plus(exact.divide(total, PER_MILLION))


def fewest_tokens(text: str | bytes) -> int:
    """The fewest tokens a text can be: at least one for any text, more for a long one."""
    return -(-len(text) // LONGEST_TOKEN)


def fewest_prompt_text_tokens(text: str) -> int:
    """The fewest tokens a prompt's text can be once a template has it: as `fewest_tokens`,
    with each run of blanks as one character and none at its ends (a template may trim a
    message, a tokenizer hold a long run of blanks in few tokens)."""
    return fewest_tokens(" ".join(text.split()))


def estimate_text_tokens(text: str | bytes) -> int:
    return -(-len(text) // CHARS_PER_TOKEN) if text else 0


def estimate_prompt_tokens(body: dict[str, Any], *, chat: bool) -> int:
    """Prompt tokens of a request whose model server did not report usage.

    Chat reads `messages`, text completions `prompt`, whatever else the body holds (a
    completion request may carry a `messages` field of any type: it is only forwarded).
    """
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            messages = [messages] if messages is not None else []
        return (sum(TOKENS_PER_MESSAGE + estimate_input_tokens(m) for m in messages)
                + sum(estimate_rendered_tokens(body.get(name)) for name in CHAT_PROMPT_FIELDS))
    return estimate_text_tokens("".join(texts_of(body.get("prompt"))))


def estimate_input_tokens(value: Any) -> int:
    """The estimate of a message or input item: its texts (`texts_of`), but each media part
    in it (an object whose type is one of MEDIA_PARTS, in a message's content, a tool's
    output, a computer call's output; the message itself is none, whatever its type says)
    counted as MEDIA_PART_TOKENS, not as the text of its data."""
    media = [0]
    if isinstance(value, dict):  # the message: its own type makes it no part
        texts = [text for item in value.values() for text in texts_of(item, media)]
    else:
        texts = list(texts_of(value, media))
    return estimate_text_tokens("".join(texts)) + media[0] * MEDIA_PART_TOKENS


def estimate_rendered_tokens(value: Any) -> int:
    """The estimate of a field a template renders as JSON (tool definitions, documents)."""
    if not value or not isinstance(value, (list, dict)):
        return 0
    try:
        return estimate_text_tokens(dumps(value))
    except (TypeError, ValueError):  # not JSON the gateway writes: its strings, then
        return estimate_text_tokens("".join(texts_of(value)))


def content_texts(content: Any) -> Iterator[str]:
    """The texts of a message's or input item's content that a model reads as text: the
    string, or the text parts (and bare strings) of a list. An image, audio or file part holds
    none (its data is not tokenized as text), nor does a part of a type the gateway does not know."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):  # a bare string part, which vLLM reads as text
                yield part
            elif isinstance(part, dict) and part.get("type") in TEXT_PARTS:
                text = part.get("text")
                if isinstance(text, str):
                    yield text


def texts_of(value: Any, media: list[int] | None = None) -> Iterable[str]:
    """Every string inside a message or prompt (content parts, tool calls, token arrays).
    With `media` (a one-item counter), an object whose type is a media type's name
    (MEDIA_PARTS) yields none of its data's strings and is counted there instead."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        if media is not None and isinstance(value.get("type"), str) and value["type"] in MEDIA_PARTS:
            media[0] += 1
            return
        for item in value.values():
            yield from texts_of(item, media)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                yield "tokn"  # a token id counts as one token
            else:
                yield from texts_of(item, media)
