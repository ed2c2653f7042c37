"""kiln.metering: cost in Decimal (contract §4), upstream usage, estimates."""

from decimal import Decimal, localcontext
from pathlib import Path

import pytest

from kiln.catalog import Catalog, Pricing
from kiln.jsonio import dumps
from kiln.metering import (
    TokenUsage,
    UsageBounds,
    billable_usage,
    content_texts,
    cost_of,
    estimate_prompt_tokens,
    estimate_text_tokens,
)

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
    short = estimate_prompt_tokens({"messages": [{"role": "user", "content": ""}]}, chat=True)
    long = estimate_prompt_tokens({"messages": [{"role": "user", "content": "x" * 4000}]}, chat=True)
    assert short > 0
    assert long >= 1000 > short
    two = estimate_prompt_tokens({"messages": [{"role": "user", "content": ""}] * 2}, chat=True)
    assert two > short


def test_prompt_estimate_reads_content_parts_and_tool_calls():
    parts = {"role": "user", "content": [{"type": "text", "text": "y" * 800}]}
    tool = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "z" * 800}}]}
    empty = estimate_prompt_tokens({"messages": [{"role": "user", "content": []}]}, chat=True)
    assert estimate_prompt_tokens({"messages": [parts]}, chat=True) >= empty + 200
    assert estimate_prompt_tokens({"messages": [tool]}, chat=True) >= empty + 200


def test_completion_prompt_estimates():
    assert estimate_prompt_tokens({"prompt": "a" * 40}, chat=False) == 10
    assert estimate_prompt_tokens({"prompt": ["a" * 20, "b" * 20]}, chat=False) == 10
    assert estimate_prompt_tokens({"prompt": [101, 102, 103]}, chat=False) == 3  # token ids: one each
    assert estimate_prompt_tokens({}, chat=False) == 0


@pytest.mark.parametrize("messages", [5, "a b", {"content": "x"}, [1, None, True, {"content": 7}], None, 1.5])
def test_prompt_estimate_of_odd_messages_never_fails(messages):
    assert estimate_prompt_tokens({"messages": messages}, chat=True) >= 0


def test_a_completion_request_is_estimated_from_its_prompt_whatever_else_it_holds():
    body = {"prompt": "a" * 40, "messages": 5}
    assert estimate_prompt_tokens(body, chat=False) == 10


CHAT_LIMITS = ("max_tokens", "max_completion_tokens", "n_predict")


def test_bounds_take_the_endpoints_token_limit_and_every_choice():
    assert UsageBounds.of_request({}, 4096, limits=CHAT_LIMITS) == UsageBounds(4096, 4096)
    assert UsageBounds.of_request({"max_tokens": 16}, 4096, limits=CHAT_LIMITS) == UsageBounds(4096, 16)
    assert UsageBounds.of_request({"max_tokens": 99999}, 4096, limits=CHAT_LIMITS) == UsageBounds(4096, 4096)
    assert UsageBounds.of_request({"max_output_tokens": 8, "n": 3}, 4096, limits=("max_output_tokens",)).completion == 24
    # values a client may send that bound nothing
    assert UsageBounds.of_request({"max_tokens": "16", "n": True}, 4096, limits=CHAT_LIMITS).completion == 4096
    assert UsageBounds.of_request({"max_tokens": None}, 4096, limits=CHAT_LIMITS).completion == 4096
    assert UsageBounds.of_request({"n": 200}, 10, limits=CHAT_LIMITS).completion == 10 * 200
    assert UsageBounds.of_request({"n": 10**90}, 10, limits=CHAT_LIMITS).completion == 10 * 1_000_000


def test_of_two_limits_a_server_may_honour_the_larger_bounds():
    both = {"max_tokens": 64, "max_completion_tokens": 32}
    assert UsageBounds.of_request(both, 4096, limits=CHAT_LIMITS).completion == 64
    assert UsageBounds.of_request({**both, "max_completion_tokens": 4000}, 4096, limits=CHAT_LIMITS).completion == 4000


def test_a_limit_read_as_none_at_all_leaves_only_the_context():
    """llama.cpp's server takes n_predict before max_tokens, and -1 there is no limit."""
    assert UsageBounds.of_request({"max_tokens": 1, "n_predict": -1}, 4096, limits=CHAT_LIMITS).completion == 4096
    assert UsageBounds.of_request({"max_tokens": 1, "n_predict": 4000}, 8192, limits=CHAT_LIMITS).completion == 4000


@pytest.mark.parametrize("body", [{"max_tokens": 0}, {"max_completion_tokens": 0, "max_tokens": 0}, {"n_predict": 0}])
def test_a_limit_of_zero_tokens_bounds_nothing(body):
    """A server that produced tokens did not read 0 as none (some read it as no limit)."""
    assert UsageBounds.of_request(body, 4096, limits=CHAT_LIMITS).completion == 4096
    # beside a limit of 9 tokens: a server that takes the zero first may not stop at 9
    assert UsageBounds.of_request({"max_completion_tokens": 9, **body}, 4096, limits=CHAT_LIMITS).completion == 4096


def test_a_limit_the_endpoint_does_not_have_bounds_nothing():
    body = {"max_output_tokens": 1, "max_completion_tokens": 1}
    assert UsageBounds.of_request(body, 4096, limits=("max_tokens",)).completion == 4096


def test_every_prompt_of_a_batch_has_its_context_and_its_choices():
    bounds = UsageBounds.of_request({"max_tokens": 10, "n": 2}, 4096, limits=("max_tokens",), prompts=20)
    assert bounds == UsageBounds(prompt=4096 * 20, completion=10 * 2 * 20)


@pytest.mark.parametrize(("prompt", "count"), [
    ("one", 1), (["a", "b", "c"], 3), ([1, 2, 3], 1), ([[1, 2], [3]], 2), ([], 1), (None, 1), (["a", 1], 1)])
def test_a_completion_counts_its_prompts(prompt, count):
    from kiln.apis.completions import API

    assert API.prompts({"prompt": prompt}) == count


BOUNDS = UsageBounds(prompt=100, completion=16)


def bill(reported):
    return billable_usage(reported, BOUNDS, prompt_estimate=lambda: 7, completion_count=lambda: 5)


def test_plausible_usage_is_believed():
    usage, problems = bill({"prompt_tokens": 100, "completion_tokens": 16, "prompt_tokens_details": {"cached_tokens": 100}})
    assert (usage, problems) == (TokenUsage(100, 16, 100, "upstream"), [])


@pytest.mark.parametrize("reported", [None, "xx", [1], 5, {}, {"prompt_tokens": None, "completion_tokens": None}])
def test_no_usage_is_estimated(reported):
    assert bill(reported) == (TokenUsage(7, 5, None, "estimated"), [])


def test_estimates_are_capped_too():
    usage, _ = billable_usage(None, BOUNDS, prompt_estimate=lambda: 10**6, completion_count=lambda: 10**6)
    assert (usage.prompt_tokens, usage.completion_tokens) == (100, 16)


@pytest.mark.parametrize(
    "reported, expected",
    [
        ({"prompt_tokens": 3, "completion_tokens": 17}, (3, 5)),
        ({"prompt_tokens": 3, "completion_tokens": 10**200}, (3, 5)),
        ({"prompt_tokens": 101, "completion_tokens": 4}, (7, 4)),
        ({"prompt_tokens": -1, "completion_tokens": 4}, (7, 4)),
        ({"prompt_tokens": "3", "completion_tokens": 4.0}, (7, 5)),
        ({"prompt_tokens": 3}, (3, 5)),
    ],
)
def test_implausible_counts_are_replaced_by_our_own_and_marked_capped(reported, expected):
    usage, problems = bill(reported)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.source) == (*expected, "capped")
    assert problems and all(len(problem) < 80 for problem in problems)  # the log never holds a 200-digit number


@pytest.mark.parametrize("details, problem", [
    ({"cached_tokens": 4}, "cached_tokens above the bound of 3"),
    ({"cached_tokens": 1_000_000_000}, "cached_tokens above the bound of 3"),
    ({"cached_tokens": -1}, "cached_tokens not a count (int)"),
    ({"cached_tokens": "2"}, "cached_tokens not a count (str)"),
    ("x", "prompt_tokens_details not an object (str)"),
])
def test_cached_tokens_the_prompt_cannot_hold_are_none_and_the_usage_capped(details, problem):
    """§4: usage the model cannot have produced is not believed: no token is billed as cached,
    and the event (and what the client is shown) is the gateway's, `capped`."""
    usage, problems = bill({"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": details})
    assert usage == TokenUsage(3, 4, None, "capped")
    assert problems == [problem]


@pytest.mark.parametrize("details", [None, {}, {"cached_tokens": None}, {"cached_tokens": 0}, {"cached_tokens": 3}])
def test_cached_tokens_within_the_prompt_or_none_are_believed(details):
    usage, problems = bill({"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": details})
    cached = details.get("cached_tokens") if details else None
    assert usage == TokenUsage(3, 4, cached, "upstream") and problems == []


def test_cost_is_exact_beyond_the_default_decimal_precision():
    """28 significant digits (Python's default context) would round this; DynamoDB keeps 38."""
    pricing = Pricing(input=Decimal("0.123456789012345678901"), output=Decimal("0.987654321098765432109"))
    usage = TokenUsage(123456789, 987654321)
    exact = (123456789 * Decimal("0.123456789012345678901") + 987654321 * Decimal("0.987654321098765432109"))
    with localcontext() as context:
        context.prec = 100
        expected = (123456789 * Decimal("0.123456789012345678901") + 987654321 * Decimal("0.987654321098765432109")) / 1_000_000
    assert exact != expected  # the default context rounds
    cost = cost_of(usage, pricing)
    assert cost == expected and len(cost.as_tuple().digits) <= 38


def test_cost_keeps_at_most_the_38_digits_dynamodb_stores():
    pricing = Pricing(input=Decimal("0." + "3" * 45), output=Decimal(0))
    cost = cost_of(TokenUsage(7, 0), pricing)
    assert len(cost.as_tuple().digits) == 38 and cost == Decimal("0.000002" + "3" * 37)


@pytest.mark.parametrize(("reported", "floor", "expected"), [
    (0, 4, (5, "capped")),  # fewer than the texts relayed: the gateway's own count
    (3, 4, (5, "capped")),
    (4, 4, (4, "upstream")),
    (9, 4, (9, "upstream")),
    (0, 40, (16, "capped")),  # the bound still caps
])
def test_completion_tokens_below_the_texts_relayed_are_not_believed(reported, floor, expected):
    usage, problems = billable_usage({"prompt_tokens": 7, "completion_tokens": reported}, BOUNDS,
                                     prompt_estimate=lambda: 7, completion_count=lambda: 5, completion_floor=floor)
    assert (usage.completion_tokens, usage.source) == expected
    assert bool(problems) == (expected[1] == "capped")


@pytest.mark.parametrize(("estimate", "expected"), [(7, (7, "capped")), (0, (0, "upstream"))],
                         ids=["a prompt with tokens", "an empty prompt"])
def test_zero_prompt_tokens_are_believed_only_of_a_prompt_with_none(estimate, expected):
    usage, problems = billable_usage({"prompt_tokens": 0, "completion_tokens": 3}, BOUNDS,
                                     prompt_estimate=lambda: estimate, completion_count=lambda: 5)
    assert (usage.prompt_tokens, usage.source) == expected
    assert bool(problems) == (expected[1] == "capped")


@pytest.mark.parametrize(("reported", "floor", "expected"), [
    (1, 3, (7, "capped")),  # fewer than the prompt's texts hold: the estimate
    (1, 9, (9, "capped")),  # …or the floor, whichever is more
    (3, 3, (3, "upstream")),
    (5, 3, (5, "upstream")),
    (1, 10**6, (7 * 10**3, "capped")),  # the bound still caps
])
def test_prompt_tokens_below_the_prompts_texts_are_not_believed(reported, floor, expected):
    bounds = UsageBounds(prompt=7000, completion=16)
    usage, problems = billable_usage({"prompt_tokens": reported, "completion_tokens": 3}, bounds,
                                     prompt_estimate=lambda: 7, completion_count=lambda: 5, prompt_floor=lambda: floor)
    assert (usage.prompt_tokens, usage.source) == expected
    assert bool(problems) == (expected[1] == "capped")


@pytest.mark.parametrize("reported", [
    None, {"completion_tokens": 3}, {"prompt_tokens": 10**9, "completion_tokens": 3},
    {"prompt_tokens": 0, "completion_tokens": 3}, {"prompt_tokens": "60", "completion_tokens": 3},
    {"prompt_tokens": 1, "completion_tokens": 3}])
def test_a_prompt_count_the_gateway_replaces_is_never_below_the_floor(reported):
    """Whatever the reason the count is replaced (none, not a count, absurd, zero, too few),
    the estimate (7) is raised to the floor (60): reporting nothing is no way under it."""
    usage, _ = billable_usage(reported, BOUNDS, prompt_estimate=lambda: 7, completion_count=lambda: 5,
                              prompt_floor=lambda: 60)
    assert usage.prompt_tokens == 60
    capped, _ = billable_usage(reported, BOUNDS, prompt_estimate=lambda: 7, completion_count=lambda: 5,
                               prompt_floor=lambda: 10**6)
    assert capped.prompt_tokens == BOUNDS.prompt


@pytest.mark.parametrize(("content", "texts"), [
    ("hello", ["hello"]),
    ([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "output_text", "text": "c"}],
     ["a", "b", "c"]),
    # no text: an image's or a file's data, a part of an unknown or unreadable type, text of another type
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "file", "text": "x"},
      {"type": {"x": 1}, "text": "y"}, {"type": ["text"], "text": "z"}, {"type": "text", "text": 5}, 7], []),
    # a bare string part vLLM reads as text
    (["bare", {"type": "text", "text": "a"}], ["bare", "a"]),
    (None, []),
    ({"text": "nested"}, []),
])
def test_content_texts_are_what_a_model_reads_as_text(content, texts):
    assert list(content_texts(content)) == texts


def test_the_prompt_floor_is_worked_out_at_most_once():
    asked = []
    for reported in (None, {"prompt_tokens": 1, "completion_tokens": 3}, {"prompt_tokens": 0, "completion_tokens": 3}):
        asked.clear()
        billable_usage(reported, BOUNDS, prompt_estimate=lambda: 7, completion_count=lambda: 5,
                       prompt_floor=lambda: asked.append(1) or 60)
        assert asked == [1]


# -- media in the prompt estimate -------------------------------------------------------------

MEDIA_DATA = "data:image/png;base64," + "iVBORw0KGgo" * 10_000  # 110 000 characters of base64


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "text", "text": "What is said?"}, {"type": "audio_embeds", "audio_embeds": MEDIA_DATA}]},
    {"role": "user", "content": [{"type": "video_embeds", "video_embeds": MEDIA_DATA}]},
    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": MEDIA_DATA}]},
    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_file", "file_data": MEDIA_DATA}]},
    {"type": "computer_call_output", "call_id": "c1", "output": {"type": "computer_screenshot", "image_url": MEDIA_DATA}},
], ids=["audio_embeds", "video_embeds", "tool-output-image", "tool-output-file", "computer-screenshot"])
def test_a_media_part_anywhere_in_a_list_is_estimated_as_a_picture(item):
    """vLLM's embedding parts, and the parts a function call's output may hold in the
    Responses API (a screenshot tool), are media: their data is no text."""
    from kiln.metering import MEDIA_PART_TOKENS, estimate_input_tokens

    assert MEDIA_PART_TOKENS <= estimate_input_tokens(item) <= MEDIA_PART_TOKENS + 20


def test_a_message_that_calls_itself_media_is_read_for_its_text():
    from kiln.metering import estimate_input_tokens

    text = "word " * 1000
    assert estimate_input_tokens({"role": "user", "type": "image", "content": text}) >= len(text) // 4
    assert estimate_input_tokens({"role": "user", "type": [], "content": [{"type": {"a": 1}, "text": text}]}) >= len(text) // 4
