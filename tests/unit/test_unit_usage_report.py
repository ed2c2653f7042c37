"""kiln.usage_report: what a report sums (kiln admin usage and GET /v1/usage)."""

from decimal import Decimal

from kiln.store.usage import UsageEvent
from kiln.usage_report import KeySpend, summarize


def _event(n: int, cost: str, model: str = "m") -> UsageEvent:
    return UsageEvent(gen_id=f"gen-{n}", org_id="o", created_at="2026-12-06T00:00:00.000Z", key_id="key_1",
                      model=model, endpoint="chat.completions", streamed=False, status="success", cost=Decimal(cost))


def test_a_reports_cost_is_the_exact_sum_of_its_events_costs_however_many_digits_they_need():
    """The org is debited each event's cost exactly: a report that rounded its sum to Python's
    default 28 digits would not add up to what the org paid."""
    costs = ["123456.000000000000001", "0.000000000000000000000000000007", "0.00000000000000123456789"]
    summary = summarize([_event(n, cost, model=str(n % 2)) for n, cost in enumerate(costs)], "model")
    expected = Decimal("123456.000000000000002234567890000007")
    assert summary.total.cost == expected
    assert summary.lines["0"].cost == Decimal("123456.00000000000000223456789")


def test_a_keys_spend_is_the_exact_sum_of_its_events_costs():
    spend = KeySpend(starts={"key_1": "2026-12-01T00:00:00.000Z"})
    for cost in ("123456.000000000000001", "0.000000000000000000000000000007"):
        spend.add("key_1", "2026-12-06T00:00:00.000Z", Decimal(cost))
    assert spend.of("key_1") == Decimal("123456.000000000000001000000000000007")


def test_progress_says_each_count_once_and_the_last_count_whatever_it_is():
    """`kiln admin usage --progress` prints what it was told: the count of a span of exactly 1 000
    events was said twice, the second time as if more had been read."""
    from kiln.usage_report import PROGRESS_EVERY

    for total, said in ((0, [0]), (3, [3]), (PROGRESS_EVERY, [PROGRESS_EVERY]),
                        (2 * PROGRESS_EVERY + 1, [PROGRESS_EVERY, 2 * PROGRESS_EVERY, 2 * PROGRESS_EVERY + 1])):
        told: list[int] = []
        summary = summarize((_event(n, "0.1") for n in range(total)), "model", told.append)
        assert told == said
        assert summary.total.requests == total
