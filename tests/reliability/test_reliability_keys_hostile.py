"""Contract §10 under a hostile client and a careless customer: odd key attributes, odd
spans, odd paths, lost answers, keys changed and revoked while their requests run.

Every answer is in the contract's error shape (never a 500 or a cut connection), and after
each request the org's ledger still adds up: nothing left in flight, one usage event per
generation id, debits and each key's spend equal to the events' costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from decimal import Decimal

import httpx
import pytest

from kiln.store.keys import create_key, list_keys
from kiln.store.keyspend import KeyLimits
from support import EmulatorProcess, LedgerCheck, make_stack

CHAT = "/v1/chat/completions"
BODY = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x y z"}]}
ERROR_FIELDS = {"message", "type", "param", "code"}


def call(stack, method: str, path: str, key: str, body=None) -> httpx.Response:
    return stack.http.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})


def management_org(stack, **org) -> tuple[str, str]:
    """A new org and a management key of it: (org id, secret)."""
    org_id, _ = stack.org(**org)
    return org_id, create_key(stack.tables, org_id, role="management", label="console").secret


def assert_error(response: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and (error["param"], error["code"]) == (param, code), error


# -- GET /v1/usage: a span read in UTC --------------------------------------------------------------


@pytest.mark.parametrize(
    "params,param",
    [
        ({"since": "0001-01-01T00:00:00+01:00", "until": "0001-01-02T00:00:00Z"}, "since"),  # 0000-12-31 in UTC
        ({"since": "0001-01-01T00:30:00+01:00"}, "since"),
        ({"until": "0001-01-01T00:00:00+01:00"}, "until"),
        ({"since": "9999-12-30T00:00:00Z", "until": "9999-12-31T23:59:59-01:00"}, "until"),  # 10000-01-01 in UTC
        ({"since": "9999-12-30T00:00:00Z", "until": "9999-12-31T23:59:60Z"}, "until"),  # read as 10000-01-01
    ],
)
def test_a_usage_span_whose_offset_leaves_the_years_1_to_9999_is_a_400_not_a_500(stack, org, params, param):
    response = stack.http.get("/v1/usage", params=params, headers={"Authorization": f"Bearer {org[1]}"})
    assert_error(response, 400, param, "invalid_value")
    assert "out of range" in response.json()["error"]["message"]  # not "must be an RFC 3339 date": it is one
    # the same connection goes on serving
    assert stack.http.get("/v1/usage", headers={"Authorization": f"Bearer {org[1]}"}).status_code == 200


# -- POST / PATCH /v1/keys: attributes no key can work with are refused, not stored -----------------


@pytest.mark.parametrize("spend_limit", [10**40, "1e125", "1E+38"])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_spend_limit_too_large_to_store_is_400_not_a_key_that_answers_503(stack, spend_limit, method):
    org_id, admin = management_org(stack)
    target = create_key(stack.tables, org_id)
    path = "/v1/keys" if method == "POST" else f"/v1/keys/{target.key_id}"
    assert_error(call(stack, method, path, admin, {"spend_limit": spend_limit}), 400, "spend_limit", "invalid_value")
    assert stack.post(CHAT, BODY, target.secret).status_code == 200  # the key is as it was
    assert len(list_keys(stack.tables, org_id)) == 3  # the org's first key, the management key, the target


def test_the_largest_spend_limit_makes_a_key_that_works(stack):
    _, admin = management_org(stack)
    created = call(stack, "POST", "/v1/keys", admin, {"spend_limit": "9" * 38, "spend_period": "day"})
    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    assert stack.post(CHAT, BODY, secret).status_code == 200
    assert call(stack, "GET", "/v1/key", secret).json()["spend_limit"] == int("9" * 38)


@pytest.mark.parametrize("label", ["agent\nkey_0000000000000000  active", "\x1b[2J\x1b[H", "a\x00b", "\u202eevil",
                                   "tab\there", "\x7f", "two\u2028lines", "para\u2029graph", "pro\u200bd",
                                   "\ufeffprod", "pro\u00add", "prod\U000e0041",
                                   # invisible, though letters or marks: each would pass for "binf"
                                   "binf\u034f", "bin\u200df", "binf\ufe0f", "bi\u17b4nf", "binf\u3164",
                                   "binf\u115f", "binf\uffa0", "binf\u2800", "binf ", " binf", "binf\u00a0",
                                   "prod1\ufe0f", "prod-\ufe0fa", "\u2605\u200d\u2605"])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_label_with_control_characters_is_400(stack, label, method):
    """A label is shown in `kiln admin keys list` and in consoles: a newline would fake a
    row, an escape sequence would drive the operator's terminal, an invisible character would
    make "prod" and another label that looks the same two keys."""
    org_id, admin = management_org(stack)
    target = create_key(stack.tables, org_id, label="before")
    path = "/v1/keys" if method == "POST" else f"/v1/keys/{target.key_id}"
    assert_error(call(stack, method, path, admin, {"label": label}), 400, "label", "invalid_value")
    assert call(stack, "GET", f"/v1/keys/{target.key_id}", admin).json()["label"] == "before"


def test_labels_in_any_script_with_emoji_are_kept_as_given(stack):
    _, admin = management_org(stack)
    for label in ("équipe données 🧪", "👩‍💻 family: 👨‍👩‍👧", "مفتاح الفريق", "キー" * 50, "❤️‍🔥 1️⃣ ‼️ 👩🏽‍💻 ℹ️ 🙂‍↔️",
                  "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f", "ශ්‍රී ලංකා", "می\u200cخواهم"):
        created = call(stack, "POST", "/v1/keys", admin, {"label": label})
        assert created.status_code == 201, created.text
        assert call(stack, "GET", "/v1/key", created.json()["secret"]).json()["label"] == label


# -- lost answers --------------------------------------------------------------------------------------


def test_a_key_whose_creation_answer_was_lost_is_still_201_and_made_once(stack, storage_faults):
    """DynamoDB applied the PutItem and the answer was lost: the client sends it again, which
    finds the item it made itself. The caller gets its secret, not a 500 over a key it never sees."""
    org_id, admin = management_org(stack)
    lost = storage_faults.lose("PutItem", when=lambda payload: payload["TableName"] == stack.settings.keys_table,
                               times=1)
    created = call(stack, "POST", "/v1/keys", admin, {"label": "after a reset", "concurrency": 2})
    assert lost, "the fault was never injected"
    assert created.status_code == 201, created.text
    storage_faults.clear()
    key = created.json()
    labels = [item.label for item in list_keys(stack.tables, org_id)]
    assert labels.count("after a reset") == 1
    ledger = LedgerCheck(stack, org_id)
    assert ledger.saw(stack.post(CHAT, BODY, key["secret"])).status_code == 200
    ledger.check()


# -- keys changed while their requests run -------------------------------------------------------------


def test_a_key_changed_and_revoked_mid_stream_still_settles_exactly(stack):
    """The stream admitted before the change finishes and is billed to its key; the next
    request sees the change; nothing is left in the key's set of requests in flight."""
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": "5", "spend_period": "day", "concurrency": 2}).json()
    ledger = LedgerCheck(stack, org_id)
    slow = {**BODY, "stream": True, "mock": {"tokens": 12, "token_delay_ms": 40}}
    answers: list[httpx.Response] = []
    streams = [threading.Thread(target=lambda: answers.append(stack.post(CHAT, slow, key["secret"]))) for _ in range(2)]
    for thread in streams:
        thread.start()
    stack.mock.wait_for(lambda stats: stats["in_flight"] >= 2)
    assert call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_limit": 0, "concurrency": 1}).status_code == 200
    refused = stack.post(CHAT, BODY, key["secret"])
    assert refused.status_code in (402, 429) and refused.json()["error"]["code"] in (
        "key_spend_limit_exceeded", "rate_limit_exceeded")
    assert call(stack, "DELETE", f"/v1/keys/{key['id']}", admin).status_code == 200
    for thread in streams:
        thread.join()
    assert [answer.status_code for answer in answers] == [200, 200]
    assert all(answer.text.rstrip().endswith("data: [DONE]") for answer in answers)
    for answer in answers:
        ledger.saw(answer)
    events = ledger.check()
    assert {event.key_id for event in events} == {key["id"]}
    assert_error(stack.post(CHAT, BODY, key["secret"]), 401, None, "invalid_api_key")


@pytest.mark.parametrize("away", [{"spend_limit": None}, {"spend_period": "week"}],
                         ids=["limit removed", "period changed"])
def test_a_limit_taken_away_and_back_while_a_request_runs_counts_all_the_keys_spend(stack, away):
    """The request in flight settles into the figure its lease names after that figure was
    removed, making it again with its own cost alone; the limit set back must still count
    everything the key spent in the period (contract §10), not that one request."""
    org_id, admin = management_org(stack)
    limits = {"spend_limit": "5", "spend_period": "day"}
    key = call(stack, "POST", "/v1/keys", admin, limits).json()
    ledger = LedgerCheck(stack, org_id)
    for _ in range(3):
        assert ledger.saw(stack.post(CHAT, BODY, key["secret"])).status_code == 200
    slow = {**BODY, "stream": True, "mock": {"tokens": 6, "token_delay_ms": 100}}
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(stack.post(CHAT, slow, key["secret"])))
    thread.start()
    stack.mock.wait_for(lambda stats: stats["in_flight"] >= 1)
    assert call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, away).status_code == 200
    thread.join()
    assert ledger.saw(answers[0]).status_code == 200
    back = call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, limits)
    assert back.status_code == 200, back.text
    events = ledger.check()  # and every figure on the org item is what its events add up to
    spent = sum((event.cost for event in events), Decimal(0))
    assert Decimal(str(back.json()["spend"])) == spent
    day = KeyLimits(None, Decimal(5), "day").figure(key["id"], time.time())
    assert {name: value for name, value in stack.key_figures(org_id).items() if name.startswith("key_spend:")} == {
        day: spent}


def test_a_management_key_that_revokes_itself_is_refused_at_once(stack_factory):
    stack = stack_factory(auth_cache_seconds=60)  # lookups cached, as deployed
    org_id, admin = management_org(stack)
    assert call(stack, "GET", "/v1/keys", admin).status_code == 200  # cached now
    (mine,) = [item.key_id for item in list_keys(stack.tables, org_id) if item.role == "management"]
    assert call(stack, "DELETE", f"/v1/keys/{mine}", admin).json()["status"] == "revoked"
    for method, path in (("GET", "/v1/keys"), ("POST", "/v1/keys"), ("GET", "/v1/key"), ("GET", "/v1/credits")):
        assert_error(call(stack, method, path, admin, {} if method == "POST" else None), 401, None, "invalid_api_key")
    assert len(list_keys(stack.tables, org_id)) == 2  # it made nothing after its revocation


def test_a_key_at_its_own_concurrency_racing_its_settles_leaks_nothing(stack):
    """Refusals of a key at its own limit, interleaved with its settles and another key's
    requests: only 200s and 429s, and the ledger adds up to the last decimal. The org's limit
    is above what both keys can hold at once (the other key's 14 requests, the limited one's 2):
    every 429 is the key's own."""
    org_id, _ = stack.org(concurrency=20)
    limited = stack.key(org_id, concurrency=2, spend_limit="100", spend_period="day")
    free = stack.key(org_id)
    ledger = LedgerCheck(stack, org_id)
    slow = {**BODY, "stream": True, "mock": {"tokens": 4, "token_delay_ms": 20}}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            async def one(index: int) -> httpx.Response:
                key = limited if index % 3 else free
                return await client.post(CHAT, json=slow if index % 2 else BODY,
                                         headers={"Authorization": f"Bearer {key}"})

            return await asyncio.gather(*(one(index) for index in range(40)))

    responses = asyncio.run(run())
    for response in responses:
        ledger.saw(response)
    assert {response.status_code for response in responses} <= {200, 429}
    assert any(response.status_code == 429 for response in responses)
    for response in responses:
        if response.status_code == 429:
            assert "This key already has 2 requests in flight" in response.json()["error"]["message"]
    events = ledger.check()
    assert sum((event.cost for event in events), Decimal(0)) > 0



def test_a_key_at_its_own_limit_with_dead_gateways_leases_is_served_once_they_expire(stack_factory):
    """Two requests of a key with a concurrency of 2 were admitted by gateways that died: the
    key's next request, once their leases have expired, reclaims them (each an `abandoned`
    event) and is served, while the org itself was never at its limit."""
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.25)
    org_id, _ = stack.org(concurrency=8)
    issued = create_key(stack.tables, org_id, concurrency=2, spend_limit="5", spend_period="day")
    ledger = LedgerCheck(stack, org_id)
    dead = [stack.ledger.admit(org_id=org_id, key_id=issued.key_id, model="qwen3-32b", endpoint="chat.completions",
                               streamed=False, limits=KeyLimits(concurrency=2)) for _ in range(2)]
    refused = stack.post(CHAT, BODY, issued.secret)
    assert_error(refused, 429, None, "rate_limit_exceeded")
    assert "This key already has 2 requests in flight" in refused.json()["error"]["message"]
    time.sleep(1.2)
    assert ledger.saw(stack.post(CHAT, BODY, issued.secret)).status_code == 200
    ledger.gen_ids += [lease.gen_id for lease in dead]
    events = ledger.check()
    assert sorted(event.status for event in events) == ["abandoned", "abandoned", "success"]


# -- paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,path", [("GET", "/v1/keys/"), ("POST", "/v1/keys/"),
                                         ("PATCH", "/v1/keys/key_0000000000000000/"), ("GET", "/v1/key/"),
                                         ("GET", "/v1/usage/"), ("GET", "/v1/credits/"), ("GET", "/v1/models/"),
                                         ("POST", "/v1/chat/completions/"), ("POST", "/v1/completions/")])
def test_a_trailing_slash_is_a_404_in_the_error_shape_not_a_redirect(stack, method, path):
    """Starlette would answer a 307 to the path without it, its Location built from the
    client's Host header (and without an API Gateway stage)."""
    _, admin = management_org(stack)
    response = stack.http.request(method, path, json=BODY if method in ("POST", "PATCH") else None,
                                  headers={"Authorization": f"Bearer {admin}", "Host": "evil.example"})
    assert response.status_code == 404 and response.headers["content-type"].startswith("application/json")
    assert "location" not in response.headers
    assert_error(response, 404, None, "unknown_url")


# -- hostile bodies and values -----------------------------------------------------------------------


@pytest.mark.parametrize("raw,name", [(b'{"role":"inference","role":"management"}', "role"),
                                      (b'{"label":"a","spend_limit":"1","label":"b"}', "label"),
                                      (b'{"models":["qwen3-32b"],"x":{"y":1,"y":2}}', "y")])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_body_naming_an_attribute_twice_is_400_naming_it(stack, raw, name, method):
    """Parsers keep the first or the last of duplicate names: which role a key got would
    depend on who read the body. Nothing is made or changed."""
    org_id, admin = management_org(stack)
    target = create_key(stack.tables, org_id, label="before")
    path = "/v1/keys" if method == "POST" else f"/v1/keys/{target.key_id}"
    response = stack.http.request(method, path, content=raw, headers={"Authorization": f"Bearer {admin}",
                                                                       "Content-Type": "application/json"})
    assert_error(response, 400, None, "invalid_json")
    assert f'"{name}"' in response.json()["error"]["message"]
    keys = list_keys(stack.tables, org_id)
    assert len(keys) == 3 and {key.role for key in keys} == {"inference", "management"}
    assert call(stack, "GET", f"/v1/keys/{target.key_id}", admin).json()["label"] == "before"


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_an_unknown_model_id_is_not_echoed_whole(stack, method):
    org_id, admin = management_org(stack)
    target = create_key(stack.tables, org_id)
    path = "/v1/keys" if method == "POST" else f"/v1/keys/{target.key_id}"
    long_id = "m" * 50_000
    response = call(stack, method, path, admin, {"models": [long_id]})
    assert_error(response, 400, "models", "invalid_value")
    assert len(response.text) < 1_000 and "m" * 64 + "…" in response.json()["error"]["message"]


@pytest.mark.parametrize("spend_limit", ["1_000", "1_0.5", "١٠", "５", "𝟓", "\u0661", "1 000", "0x10", "Infinity",
                                         "NaN", "+", ".", "1e", "--1"])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_spend_limit_in_other_digits_or_with_underscores_is_400(stack, spend_limit, method):
    """Decimal() reads "1_000" as 1000 and digits of any script as theirs: a limit is written
    in ASCII digits, as a JSON number is."""
    org_id, admin = management_org(stack)
    target = create_key(stack.tables, org_id)
    path = "/v1/keys" if method == "POST" else f"/v1/keys/{target.key_id}"
    assert_error(call(stack, method, path, admin, {"spend_limit": spend_limit}), 400, "spend_limit", "invalid_value")
    assert call(stack, "GET", f"/v1/keys/{target.key_id}", admin).json()["spend_limit"] is None


@pytest.mark.parametrize("spend_limit,stored", [("1000", 1000), (" 2.50 ", 2.5), ("1e2", 100), (".5", 0.5),
                                                ("0", 0), (7, 7), (0.25, 0.25)])
def test_spend_limits_in_plain_digits_are_taken(stack, spend_limit, stored):
    _, admin = management_org(stack)
    created = call(stack, "POST", "/v1/keys", admin, {"spend_limit": spend_limit})
    assert created.status_code == 201, created.text
    assert created.json()["spend_limit"] == stored


# -- many keys in one org: the org item holds a figure per key with a limit, and no more ----------------


def _key_attributes(stack, org_id: str, key_id: str) -> list[str]:
    return [name for name in stack.key_figures(org_id) if name.split(":")[1] == key_id]


def test_a_revoked_key_leaves_nothing_on_its_orgs_item(stack):
    """An org that makes a key per job (management keys are for that) and revokes it after:
    each had a limit, so a figure while it lived."""
    org_id, admin = management_org(stack)
    ledger = LedgerCheck(stack, org_id)
    rotated = []
    for period in ("day", "week", "month", "total"):
        key = call(stack, "POST", "/v1/keys", admin, {"label": "one job", "spend_limit": 1,
                                                      "spend_period": period}).json()
        assert ledger.saw(stack.post(CHAT, BODY, key["secret"])).status_code == 200
        assert len(_key_attributes(stack, org_id, key["id"])) == 1
        assert call(stack, "DELETE", f"/v1/keys/{key['id']}", admin).status_code == 200
        rotated.append(key["id"])
    ledger.check()
    left = [name for name in stack.key_figures(org_id) if any(key_id in name for key_id in rotated)]
    assert left == []


def test_a_key_whose_limit_is_removed_leaves_nothing_on_its_orgs_item(stack):
    org_id, admin = management_org(stack)
    ledger = LedgerCheck(stack, org_id)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": 1, "spend_period": "week"}).json()
    assert ledger.saw(stack.post(CHAT, BODY, key["secret"])).status_code == 200
    assert call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_limit": None}).status_code == 200
    assert _key_attributes(stack, org_id, key["id"]) == []
    assert ledger.saw(stack.post(CHAT, BODY, key["secret"])).status_code == 200
    assert _key_attributes(stack, org_id, key["id"]) == []  # and it gains none by being used
    ledger.check()


def _org_item_bytes(stack, org_id: str) -> int:
    """The org item's size as DynamoDB bills a write of it, near enough: names and values."""
    item = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"]
    return len(json.dumps(item))


def test_the_org_item_does_not_grow_with_the_number_of_keys_used(stack):
    """Every admission, renewal and settle writes the org item whole: keys without limits
    add nothing to it, however many an org uses."""
    org_id, first = stack.org()
    ledger = LedgerCheck(stack, org_id)
    assert ledger.saw(stack.post(CHAT, BODY, first)).status_code == 200
    one_key = _org_item_bytes(stack, org_id)
    for _ in range(20):
        assert ledger.saw(stack.post(CHAT, BODY, stack.key(org_id, spend_period="day"))).status_code == 200
    ledger.check()
    assert stack.key_figures(org_id) == {}
    assert _org_item_bytes(stack, org_id) - one_key < 50  # the credits' digits, no more


def test_keys_with_limits_add_one_figure_each(stack):
    org_id, _ = stack.org()
    ledger = LedgerCheck(stack, org_id)
    keys = {}
    for index in range(20):
        period = ("day", "week", "month", "total")[index % 4]
        issued = create_key(stack.tables, org_id, spend_limit="5", spend_period=period)
        assert ledger.saw(stack.post(CHAT, BODY, issued.secret)).status_code == 200
        keys[issued.key_id] = KeyLimits(None, Decimal(5), period).figure(issued.key_id, time.time())
    events = ledger.check()
    figures = stack.key_figures(org_id)
    assert set(figures) == set(keys.values())
    costs = {event.key_id: event.cost for event in events}
    assert all(figures[keys[key_id]] == costs[key_id] for key_id in keys)


# -- the org item under contention -----------------------------------------------------------------


def test_keys_with_limits_and_their_reads_under_conflicting_writes_add_up(faulty_aws, mock):
    """The emulator's fault mode (conflicts on half the org item's writes, throttling, lost
    answers): requests of keys at their own limits, interleaved with each key's reads of
    itself and of the org's usage, are answered 200 or 429, never 503, and the ledger is exact."""
    stack = make_stack(faulty_aws.url, mock)
    try:
        org_id, _ = stack.org(concurrency=6)
        keys = [stack.key(org_id, concurrency=2, spend_limit="1", spend_period="day") for _ in range(3)]
        ledger = LedgerCheck(stack, org_id)

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
                async def one(index: int) -> httpx.Response:
                    headers = {"Authorization": f"Bearer {keys[index % 3]}"}
                    if index % 5 == 0:
                        return await client.get("/v1/key", headers=headers)
                    if index % 7 == 0:
                        return await client.get("/v1/usage", headers=headers, params={"group_by": "key"})
                    body = {**BODY, "stream": bool(index % 2), "mock": {"tokens": 3, "token_delay_ms": 5}}
                    return await client.post(CHAT, json=body, headers=headers)

                return await asyncio.gather(*(one(index) for index in range(90)))

        responses = asyncio.run(run())
        for response in responses:
            ledger.saw(response)
        assert {response.status_code for response in responses} <= {200, 429}, [
            response.text for response in responses if response.status_code not in (200, 429)]
        ledger.check(timeout=20)
    finally:
        stack.close()


@contextlib.contextmanager
def on_lagging_index(mock):
    """A stack on the emulator's fault mode with its indexes a second behind the table
    (DynamoDB's figure)."""
    emulator = EmulatorProcess(faults="index_ms=1000,scope=gateway")
    try:
        stack = make_stack(emulator.url, mock)
        try:
            yield stack
        finally:
            stack.close()
    finally:
        emulator.stop()


def _management(stack) -> dict[str, str]:
    org_id, _ = stack.org()
    return {"Authorization": f"Bearer {stack.key(org_id, role='management')}"}


def test_keys_are_managed_at_once_on_an_index_that_lags_as_dynamodbs_does(mock):
    """On the emulator's fault mode with its indexes a second behind the table (DynamoDB's
    figure), a key made through /v1/keys is shown, renamed and revoked at once, and the new
    key reads itself through /v1/key at once: never 404 `key_not_found`."""
    with on_lagging_index(mock) as stack:
        admin = _management(stack)
        for _ in range(3):
            made = stack.http.post("/v1/keys", json={"label": "new"}, headers=admin)
            assert made.status_code == 201, made.text
            key_id, secret = made.json()["id"], made.json()["secret"]
            own = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {secret}"})
            shown = stack.http.get(f"/v1/keys/{key_id}", headers=admin)
            renamed = stack.http.patch(f"/v1/keys/{key_id}", json={"label": "renamed"}, headers=admin)
            revoked = stack.http.delete(f"/v1/keys/{key_id}", headers=admin)
            assert [own.status_code, shown.status_code, renamed.status_code, revoked.status_code] == [200] * 4, [
                own.text, shown.text, renamed.text, revoked.text]
            assert renamed.json()["label"] == "renamed" and revoked.json()["status"] == "revoked"


def test_the_list_of_keys_shows_what_was_just_done_on_an_index_that_lags(mock):
    """GET /v1/keys reads the by_org index, which holds a write a second late (DynamoDB's
    figure): a key made, changed or revoked a moment ago by this environment was left out of
    the list, or listed as it was. The list shows each as it is now."""
    with on_lagging_index(mock) as stack:
        admin = _management(stack)

        def listed() -> dict[str, dict]:
            answer = stack.http.get("/v1/keys", headers=admin)
            assert answer.status_code == 200, answer.text
            return {key["id"]: key for key in answer.json()["data"]}

        made = stack.http.post("/v1/keys", json={"label": "new"}, headers=admin)
        assert made.status_code == 201, made.text
        key_id = made.json()["id"]
        assert listed()[key_id]["label"] == "new"
        time.sleep(1.5)  # in the index now, as it was made
        assert stack.http.patch(f"/v1/keys/{key_id}", json={"label": "renamed", "spend_limit": "3"},
                                headers=admin).status_code == 200
        shown = listed()[key_id]
        assert (shown["label"], shown["spend_limit"]) == ("renamed", 3)
        time.sleep(1.5)
        assert stack.http.delete(f"/v1/keys/{key_id}", headers=admin).json()["status"] == "revoked"
        assert listed()[key_id]["status"] == "revoked"
        ids = list(listed())
        assert ids.index(key_id) == len(ids) - 1  # oldest first: the newest key last


def test_the_keys_of_an_org_whose_item_is_gone_are_401_everywhere_not_503(stack_factory):
    """An org item deleted by other means (no kiln command deletes one), its keys still in the
    auth cache: they are keys of no org, 401 on every endpoint as on the model endpoints, not a
    503 that tells the client to retry and logs a storage failure."""
    stack = stack_factory(auth_cache_seconds=60)
    org_id, admin = management_org(stack)
    key = create_key(stack.tables, org_id).secret
    assert call(stack, "GET", "/v1/credits", key).status_code == 200  # both keys cached
    assert call(stack, "GET", "/v1/keys", admin).status_code == 200
    stack.dynamodb.delete_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}})
    for method, path, secret, body in (("POST", CHAT, key, BODY), ("GET", "/v1/credits", key, None),
                                       ("GET", "/v1/key", key, None),  # (/v1/usage reads no org: the cache's time)
                                       ("GET", "/v1/keys", admin, None), ("POST", "/v1/keys", admin, {"label": "x"})):
        assert_error(call(stack, method, path, secret, body), 401, None, "invalid_api_key")
