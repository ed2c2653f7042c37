"""kiln.metering at its edges: zero counts, one cached token, what is reported as wrong."""

from decimal import Decimal

import pytest

from kiln.catalog import Pricing
from kiln.metering import TokenUsage, UsageBounds, billable_usage, cost_of, estimate_prompt_tokens

QWEN = Pricing(input=Decimal("0.08"), output=Decimal("0.24"), cached_input=Decimal("0.04"))
BOUNDS = UsageBounds(prompt=100, completion=50)


def bill(reported, prompt=10, completion=5):
    return billable_usage(reported, BOUNDS, prompt_estimate=lambda: prompt, completion_count=lambda: completion)


def test_zero_tokens_reported_are_believed():
    assert TokenUsage.from_upstream({"prompt_tokens": 0, "completion_tokens": 0}) == TokenUsage(0, 0, None, "upstream")
    usage = {"prompt_tokens": 12, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
    assert TokenUsage.from_upstream(usage) == TokenUsage(12, 0, 0, "upstream")
    assert bill(usage) == (TokenUsage(12, 0, 0, "upstream"), [])


def test_one_cached_token_is_billed_at_the_cached_price():
    # (9 × 0.08 + 1 × 0.04 + 1 × 0.24) / 1M
    assert cost_of(TokenUsage(10, 1, cached_tokens=1), QWEN) == Decimal("0.000001")
    assert cost_of(TokenUsage(10, 1, cached_tokens=0), QWEN) == Decimal("0.00000104")


def test_a_usage_with_only_one_count_is_no_missing_usage():
    # the missing count is the problem reported, the other one believed
    usage, problems = bill({"completion_tokens": 7})
    assert usage == TokenUsage(10, 7, None, "capped")
    assert problems == ["prompt_tokens not a count (NoneType)"]
    usage, problems = bill({"prompt_tokens": 9, "completion_tokens": None})
    assert usage == TokenUsage(9, 5, None, "capped")
    assert problems == ["completion_tokens not a count (NoneType)"]


@pytest.mark.parametrize(
    "reported, problems",
    [
        ({"prompt_tokens": 101, "completion_tokens": 3}, ["prompt_tokens above the bound of 100"]),
        ({"prompt_tokens": 3, "completion_tokens": 51}, ["completion_tokens above the bound of 50"]),
        (
            {"prompt_tokens": "3", "completion_tokens": 2.5},
            ["prompt_tokens not a count (str)", "completion_tokens not a count (float)"],
        ),
        ({"prompt_tokens": -1, "completion_tokens": True}, ["prompt_tokens not a count (int)", "completion_tokens not a count (bool)"]),
    ],
)
def test_what_was_wrong_with_a_reported_usage_is_said_in_words(reported, problems):
    assert bill(reported)[1] == problems


def test_one_choice_is_one_choice():
    limits = ("max_tokens",)
    assert UsageBounds.of_request({"n": 1, "max_tokens": 10}, 4096, limits=limits) == UsageBounds(4096, 10)
    assert UsageBounds.of_request({"n": 0, "max_tokens": 10}, 4096, limits=limits) == UsageBounds(4096, 10)


def test_chat_messages_that_are_no_array_count_as_one_message():
    assert estimate_prompt_tokens({"messages": "hello there!"}, chat=True) == 3 + 3
    assert estimate_prompt_tokens({"messages": {"role": "user", "content": "abcd"}}, chat=True) == 3 + 2  # "user" + "abcd"
    assert estimate_prompt_tokens({}, chat=True) == 0
    assert estimate_prompt_tokens({"messages": None}, chat=True) == 0


def test_the_texts_of_one_message_are_counted_together():
    parts = {"role": "u", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}
    # "u" + "text" + "ab" + "text" + "cd": 13 characters, 4 tokens, and the message's own 3
    assert estimate_prompt_tokens({"messages": [parts]}, chat=True) == 3 + 4
