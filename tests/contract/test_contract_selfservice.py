"""Contract §10: an org reads its own balance, key and usage (GET /v1/credits, /v1/key, /v1/usage).

Any key of the org may call them; they take no slot, write no usage event and bill nothing.
`GET /v1/usage` sums exactly what `kiln admin usage` sums for the same org and span.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.store.keys import create_key, list_keys
from kiln.store.orgs import add_credits
from kiln_ops.admin import run_admin
from kiln_ops.cli import build_parser

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}]}


def get(stack, path: str, key: str, **params):
    return stack.http.get(path, params=params, headers={"Authorization": f"Bearer {key}"})


def sdk(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)


def admin_usage(stack, org_id: str, *flags: str) -> dict:
    """`kiln admin usage ORG … --format json`, run in-process as `kiln` runs it."""
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "usage", org_id, *flags, "--format", "json"])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0
    return json.loads("\n".join(lines))


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def tomorrow() -> str:
    return (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%Y-%m-%d")


# -- GET /v1/credits ----------------------------------------------------------------------------


def test_credits_are_the_orgs_balance_exactly(stack):
    org_id, key = stack.org(credits="12.345678901")
    client = sdk(stack, key)
    credits = client.get("/credits", cast_to=object)
    assert credits == {"object": "credits", "balance": pytest.approx(12.345678901), "currency": "USD"}
    assert Decimal(json.dumps(credits["balance"])) == stack.org_info(org_id).credits

    client.chat.completions.create(**BODY)
    add_credits(stack.tables, org_id, Decimal("0.5"))
    raw = get(stack, "/v1/credits", key)
    balance = Decimal(raw.text.split('"balance":')[1].split(",")[0])  # as written, not as a float reads it
    assert balance == stack.org_info(org_id).credits < Decimal("12.845678901")


def test_a_read_is_free_and_takes_no_slot(stack):
    org_id, key = stack.org(concurrency=1)
    before = stack.org_info(org_id)
    for path in ("/v1/credits", "/v1/key", "/v1/usage"):
        response = get(stack, path, key)
        assert response.status_code == 200, response.text
        assert "X-Neocloud-Generation-Id" not in response.headers
    after = stack.org_info(org_id)
    assert (after.credits, after.leases) == (before.credits, before.leases)
    assert stack.events(org_id) == []


@pytest.mark.parametrize("path", ["/v1/credits", "/v1/key", "/v1/usage"])
def test_self_service_needs_a_key_and_follows_maintenance(stack, org, path):
    assert stack.http.get(path).status_code == 401
    assert get(stack, path, "sk-kiln-" + "x" * 43).json()["error"]["code"] == "invalid_api_key"
    stack.set_maintenance({"enabled": True, "message": "Upgrading."})
    response = get(stack, path, org[1])
    assert response.status_code == 503 and response.json()["error"]["code"] == "maintenance"


# -- GET /v1/key ----------------------------------------------------------------------------------


def test_the_key_describes_itself_and_never_its_secret(stack):
    org_id, _ = stack.org()
    issued = create_key(stack.tables, org_id, label="batch jobs", models=["qwen3-32b"], concurrency=2,
                        spend_limit="5", spend_period="day")
    response = get(stack, "/v1/key", issued.secret)
    assert response.status_code == 200
    key = response.json()
    assert issued.secret not in response.text
    midnight = (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%Y-%m-%dT00:00:00.000Z")
    assert key == {
        "object": "key", "id": issued.key_id, "label": "batch jobs", "role": "inference", "models": ["qwen3-32b"],
        "concurrency": 2, "spend_limit": 5, "spend_period": "day", "spend": 0, "period_resets_at": midnight,
        "created_at": issued.created_at, "last_used_at": key["last_used_at"], "revoked_at": None,
        "status": "active", "prefix": issued.secret[:12],
    }


def test_the_keys_spend_is_what_its_requests_cost_this_period(stack):
    org_id, key = stack.org()
    _, other = stack.org()
    client = sdk(stack, key)
    costs = [client.chat.completions.create(**BODY).usage.model_extra["cost"] for _ in range(2)]
    sdk(stack, other).chat.completions.create(**BODY)  # another org's spend is not this key's
    mine = get(stack, "/v1/key", key).json()
    (event, _) = stack.events(org_id)
    assert (mine["spend_period"], mine["period_resets_at"]) == ("total", None)
    assert Decimal(str(mine["spend"])) == 2 * event.cost
    assert mine["spend"] == pytest.approx(sum(costs))
    assert mine["id"] == event.key_id


# -- GET /v1/usage --------------------------------------------------------------------------------


@pytest.fixture
def busy_org(stack):
    """An org whose two keys made requests of two models, one of them failed: (org id, key, key ids)."""
    org_id, key = stack.org()
    second = create_key(stack.tables, org_id, label="second").secret
    for secret, model, extra in [
        (key, "gpt-oss-120b", {}),
        (key, "qwen3-32b", {"mock": {"cached_tokens": 2}}),
        (second, "qwen3-32b", {}),
        (second, "qwen3-32b", {"mock": {"status": 500}}),
    ]:
        stack.post(CHAT, {**BODY, "model": model, **extra}, secret)
    return org_id, key, [info.key_id for info in list_keys(stack.tables, org_id)]


def _decimal_row(row: dict, columns=("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens")):
    return {**{column: row[column] for column in columns}, "cost": Decimal(str(row["cost"]))}


@pytest.mark.parametrize("group_by", ["day", "model", "key"])
def test_usage_totals_and_rows_equal_kiln_admin_usage(stack, busy_org, group_by):
    org_id, key, _ = busy_org
    since, until = today(), tomorrow()
    usage = get(stack, "/v1/usage", key, since=since, until=until, group_by=group_by)
    assert usage.status_code == 200, usage.text
    mine = usage.json()
    report = admin_usage(stack, org_id, "--since", since, "--until", until, "--by", group_by)
    assert _decimal_row(mine["total"]) == _decimal_row(report["total"])
    assert mine["total"]["requests"] == 4 and mine["total"]["errors"] == 1 and mine["total"]["cached_tokens"] == 2
    assert [{group_by: row[group_by], **_decimal_row(row)} for row in mine["data"]] == [
        {group_by: row["group"], **_decimal_row(row)} for row in report["rows"]]
    assert (mine["object"], mine["group_by"], mine["currency"]) == ("usage", group_by, "USD")
    assert (mine["since"], mine["until"]) == (f"{since}T00:00:00.000Z", f"{until}T00:00:00.000Z")
    # Σ cost of the events = what the org was debited
    events = stack.events(org_id)
    assert Decimal(str(mine["total"]["cost"])) == sum(event.cost for event in events) == Decimal(10) - stack.org_info(org_id).credits


def test_usage_groups_by_day_model_and_key(stack, busy_org):
    org_id, key, key_ids = busy_org
    by_day = get(stack, "/v1/usage", key, group_by="day").json()
    assert [row["day"] for row in by_day["data"]] == [today()]
    by_model = get(stack, "/v1/usage", key, group_by="model").json()
    assert {row["model"]: row["requests"] for row in by_model["data"]} == {"gpt-oss-120b": 1, "qwen3-32b": 3}
    by_key = get(stack, "/v1/usage", key, group_by="key").json()
    assert {row["key"]: row["requests"] for row in by_key["data"]} == dict(zip(key_ids, [2, 2], strict=True))
    assert by_day["total"] == by_model["total"] == by_key["total"]


def test_usage_defaults_to_the_last_30_days_by_day(stack, busy_org):
    _, key, _ = busy_org
    usage = get(stack, "/v1/usage", key).json()
    since = datetime.fromisoformat(usage["since"].replace("Z", "+00:00"))
    until = datetime.fromisoformat(usage["until"].replace("Z", "+00:00"))
    assert until - since == timedelta(days=30)
    assert abs((datetime.now(timezone.utc) - until).total_seconds()) < 60
    assert usage["group_by"] == "day" and usage["total"]["requests"] == 4


def test_usage_is_the_callers_orgs_only_and_splits_exactly_at_a_time(stack, busy_org):
    org_id, key, _ = busy_org
    _, stranger = stack.org()
    assert get(stack, "/v1/usage", stranger).json()["total"]["requests"] == 0
    events = sorted(stack.events(org_id), key=lambda event: event.created_at)
    middle = events[2].created_at  # until is exclusive, since inclusive: the halves add up
    before = get(stack, "/v1/usage", key, since=today(), until=middle).json()["total"]
    after = get(stack, "/v1/usage", key, since=middle, until=tomorrow()).json()["total"]
    assert before["requests"] + after["requests"] == 4
    assert after["requests"] == sum(1 for event in events if event.created_at >= middle)
    cli = admin_usage(stack, org_id, "--since", middle, "--until", tomorrow())["total"]
    assert _decimal_row(after) == _decimal_row(cli)


@pytest.mark.parametrize(
    "params,param",
    [
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-13-01"}, "until"),
        ({"since": "2026-11-01T00:00:00"}, "since"),  # a date-time needs its offset
        ({"since": "2026-11-01", "until": "2026-11-01"}, "since"),
        ({"since": "2026-11-02", "until": "2026-11-01"}, "since"),
        ({"since": "2026-08-01", "until": "2026-11-03"}, "until"),  # 94 days
        ({"group_by": "endpoint"}, "group_by"),
        ({"group_by": ""}, "group_by"),
        # since alone, 100 days ago: the span is too long by the parameter the client sent
        ({"since": (datetime.now(timezone.utc) - timedelta(days=100)).strftime("%Y-%m-%d")}, "since"),
        # ends read to the millisecond, as events store time: this span is empty
        ({"since": "2026-11-01T00:00:00.0001Z", "until": "2026-11-01T00:00:00.0009Z"}, "since"),
    ],
)
def test_bad_usage_parameters_are_400_naming_the_parameter(stack, org, params, param):
    response = get(stack, "/v1/usage", org[1], **params)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "invalid_value")
    assert error["message"]


@pytest.mark.parametrize("query, param", [("group_by=model&group_by=day", "group_by"),
                                          ("since=2026-01-01&since=2026-02-01&until=2026-02-15", "since"),
                                          ("until=2026-02-15&until=2026-02-16", "until")])
def test_a_usage_parameter_given_twice_is_400_not_the_last_one(stack, org, query, param):
    """A proxy or cache that reads the first of two values would see another request."""
    response = stack.http.get(f"/v1/usage?{query}", headers={"Authorization": f"Bearer {org[1]}"})
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("invalid_value", param)


def test_a_span_of_93_days_and_offsets_are_accepted(stack, busy_org):
    _, key, _ = busy_org
    assert get(stack, "/v1/usage", key, since="2026-08-01", until="2026-11-02").status_code == 200  # 93 days
    start = (datetime.now(timezone.utc) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S+00:00")
    shifted = (datetime.now(timezone.utc) + timedelta(hours=1)).astimezone(timezone(timedelta(hours=9)))
    usage = get(stack, "/v1/usage", key, since=start, until=shifted.isoformat()).json()
    assert usage["total"]["requests"] == 4 and usage["until"].endswith("Z")


def test_a_leap_second_is_an_rfc_3339_time_read_as_the_second_after_it(stack, busy_org):
    """§10: `since`/`until` are RFC 3339 times, whose seconds run to 60 at a leap second
    (2016-12-31T23:59:60Z was one): it was a 400. It is read as the next second begins, the
    moment every clock that does not count leap seconds shows after it."""
    _, key, _ = busy_org
    usage = get(stack, "/v1/usage", key, since="2016-12-31T23:59:60Z", until="2017-01-01T08:59:60.5+09:00")
    assert usage.status_code == 200, usage.text
    assert (usage.json()["since"], usage.json()["until"]) == ("2017-01-01T00:00:00.000Z", "2017-01-01T00:00:00.500Z")
    assert get(stack, "/v1/usage", key, since="2016-12-31T23:59:61Z").status_code == 400


@pytest.mark.parametrize("since", ["2026-12-01T00:00:00+00:60", "2026-12-01T00:00:00+00:99",
                                   "2026-12-01T00:00:00-00:75", "2026-12-01T00:00:00+24:00",
                                   "2026-12-01T12:34:60Z", "2026-12-01T23:59:60+01:00"])
def test_an_offset_or_leap_second_rfc_3339_has_no_place_for_is_400_not_another_time(stack, busy_org, since):
    """RFC 3339's offset minutes run to 59 and a leap second is 23:59:60 in UTC: +00:99 was read as
    +01:39 and 12:34:60 as 12:35:00, a span other than the one written, answered 200."""
    _, key, _ = busy_org
    response = get(stack, "/v1/usage", key, since=since, until="2026-12-05")
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == ("since", "invalid_value")
    assert "RFC 3339" in response.json()["error"]["message"]


def test_a_leap_second_in_an_offset_is_read_where_it_falls_in_utc(stack, busy_org):
    _, key, _ = busy_org
    usage = get(stack, "/v1/usage", key, since="2016-12-31T22:59:60-01:00", until="2017-01-01T01:00:01+01:00")
    assert usage.status_code == 200, usage.text
    assert (usage.json()["since"], usage.json()["until"]) == ("2017-01-01T00:00:00.000Z", "2017-01-01T00:00:01.000Z")


def test_a_span_before_the_year_1000_is_echoed_in_rfc_3339_and_read_in_order(stack, busy_org):
    """Years before 1000 once lost their leading zero ("999-12-01T…"): not RFC 3339, and a
    read whose lower bound sorted above its upper one (which DynamoDB refuses)."""
    _, key, _ = busy_org
    stack.faults.calls.clear()
    usage = get(stack, "/v1/usage", key, since="0999-12-01", until="1000-01-15").json()
    assert (usage["since"], usage["until"]) == ("0999-12-01T00:00:00.000Z", "1000-01-15T00:00:00.000Z")
    assert usage["total"]["requests"] == 0
    bounds = [payload["ExpressionAttributeValues"] for op, payload in stack.faults.calls
              if op == "Query" and payload.get("TableName") == stack.settings.usage_table]
    assert bounds and all(b[":since"]["S"] <= b[":until"]["S"] for b in bounds if ":until" in b), bounds


# -- hostile parameters: never a 5xx, always the contract's error shape ---------------------------

@pytest.fixture(scope="module")
def fuzz_key(shared_stack) -> str:
    return shared_stack.org()[1]


texts = st.text(max_size=30) | st.sampled_from(["2026-11-01", "0001-01-01", "9999-12-31", "2026-02-30",
                                                 "2026-11-01T24:00:00Z", "2026-11-01T00:00:00+99:99",
                                                 "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999Z"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(since=texts | st.none(), until=texts | st.none(), group_by=st.sampled_from(["day", "model", "key", "x"]) | st.none())
def test_any_usage_parameters_get_200_or_a_400(shared_stack, fuzz_key, since, until, group_by):
    key = fuzz_key
    params = {name: value for name, value in (("since", since), ("until", until), ("group_by", group_by))
              if value is not None}
    response = get(shared_stack, "/v1/usage", key, **params)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] in ("since", "until", "group_by")
