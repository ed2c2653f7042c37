"""kiln.metering: cost in Decimal (contract §4), upstream usage, estimates."""

from decimal import Decimal
from pathlib import Path

import pytest

from kiln.catalog import Catalog, Pricing
from kiln.jsonio import dumps
from kiln.metering import TokenUsage, cost_of, estimate_prompt_tokens, estimate_text_tokens

GPT_OSS = Pricing(input=Decimal("0.035"), output=Decimal("0.07"))
QWEN = Pricing(input=Decimal("0.08"), output=Decimal("0.24"), cached_input=Decimal("0.04"))
CATALOG = Catalog.from_json((Path(__file__).resolve().parents[2] / "infra" / "catalog.json").read_bytes())


@pytest.mark.parametrize(
    "prompt, completion, cost, json_number",
    [(5, 7, Decimal("0.000000665"), b"0.000000665"), (9, 12, Decimal("0.000001155"), b"0.000001155")],
)
def test_contract_worked_examples(prompt, completion, cost, json_number):
    usage = TokenUsage(prompt, completion)
    for pricing in (GPT_OSS, CATALOG.get("gpt-oss-120b").pricing):
        assert cost_of(usage, pricing) == cost
        assert isinstance(cost_of(usage, pricing), Decimal)
    assert dumps({"cost": cost_of(usage, GPT_OSS)}) == b'{"cost":' + json_number + b"}"


def test_cached_tokens_billed_at_cached_price():
    # 600 × 0.08 + 400 × 0.04 + 100 × 0.24 = 88 USD per million → 0.000088
    assert cost_of(TokenUsage(1000, 100, cached_tokens=400), QWEN) == Decimal("0.000088")


def test_cached_tokens_without_cached_price_cost_full_input_price():
    assert cost_of(TokenUsage(1000, 100, cached_tokens=400), GPT_OSS) == cost_of(TokenUsage(1000, 100), GPT_OSS)


def test_cached_count_above_prompt_never_bills_below_all_cached():
    all_cached = cost_of(TokenUsage(1000, 0, cached_tokens=1000), QWEN)
    assert cost_of(TokenUsage(1000, 0, cached_tokens=5000), QWEN) == all_cached == Decimal("0.00004")


def test_zero_tokens_cost_zero():
    assert cost_of(TokenUsage(0, 0), QWEN) == 0


def test_from_upstream_reads_usage_and_cached_tokens():
    usage = TokenUsage.from_upstream(
        {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21, "prompt_tokens_details": {"cached_tokens": 4}}
    )
    assert usage == TokenUsage(9, 12, 4, "upstream")
    assert usage.total_tokens == 21


@pytest.mark.parametrize(
    "usage",
    [
        None,
        "9 tokens",
        [9, 12],
        {"completion_tokens": 12},
        {"prompt_tokens": 9},
        {"prompt_tokens": -1, "completion_tokens": 12},
        {"prompt_tokens": 9, "completion_tokens": -3},
        {"prompt_tokens": True, "completion_tokens": 12},
        {"prompt_tokens": 9, "completion_tokens": False},
        {"prompt_tokens": 9.0, "completion_tokens": 12},
        {"prompt_tokens": "9", "completion_tokens": 12},
        {"prompt_tokens": None, "completion_tokens": 12},
    ],
)
def test_from_upstream_rejects_unusable_usage(usage):
    assert TokenUsage.from_upstream(usage) is None


@pytest.mark.parametrize("details", [None, {}, {"cached_tokens": -1}, {"cached_tokens": True}, "4"])
def test_from_upstream_ignores_bad_cached_tokens(details):
    usage = TokenUsage.from_upstream({"prompt_tokens": 9, "completion_tokens": 12, "prompt_tokens_details": details})
    assert usage == TokenUsage(9, 12, None)


def test_as_openai_adds_cost_and_cached_details_only_when_known():
    plain = TokenUsage(5, 7).as_openai(Decimal("0.000000665"))
    assert plain == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "cost": Decimal("0.000000665")}
    cached = TokenUsage(5, 7, 2).as_openai(Decimal("1"))
    assert cached["prompt_tokens_details"] == {"cached_tokens": 2}


def test_text_estimate_is_about_four_characters_per_token():
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abc") == 1
    assert estimate_text_tokens("a" * 400) == 100
    assert estimate_text_tokens("a" * 401) == 101


def test_prompt_estimate_never_zero_for_a_chat_and_grows_with_text():
    short = estimate_prompt_tokens({"messages": [{"role": "user", "content": ""}]})
    long = estimate_prompt_tokens({"messages": [{"role": "user", "content": "x" * 4000}]})
    assert short > 0
    assert long >= 1000 > short
    two = estimate_prompt_tokens({"messages": [{"role": "user", "content": ""}] * 2})
    assert two > short


def test_prompt_estimate_reads_content_parts_and_tool_calls():
    parts = {"role": "user", "content": [{"type": "text", "text": "y" * 800}]}
    tool = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "z" * 800}}]}
    empty = estimate_prompt_tokens({"messages": [{"role": "user", "content": []}]})
    assert estimate_prompt_tokens({"messages": [parts]}) >= empty + 200
    assert estimate_prompt_tokens({"messages": [tool]}) >= empty + 200


def test_completion_prompt_estimates():
    assert estimate_prompt_tokens({"prompt": "a" * 40}) == 10
    assert estimate_prompt_tokens({"prompt": ["a" * 20, "b" * 20]}) == 10
    assert estimate_prompt_tokens({"prompt": [101, 102, 103]}) == 3  # token ids: one each
    assert estimate_prompt_tokens({}) == 0
