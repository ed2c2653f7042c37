"""`kiln admin`: orgs, keys, credits and the maintenance switch, against a running stack.

Most tests drive the CLI in-process (`build_parser()` + `run_admin`, what `kiln` itself
does); one runs the installed `kiln` script in a shell that holds only the exports, and
checks that the gateway sees what it did.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from decimal import Decimal
from email.utils import parsedate_to_datetime
from pathlib import Path

import pytest

from kiln.settings import Settings
from kiln.store import RecordNotFound
from kiln.store.clock import iso_ms
from kiln.store.keys import hash_secret, list_keys, looks_like_key
from kiln.store.keyspend import KeyLimits
from kiln_ops.admin import run_admin
from kiln_ops.cli import build_parser
from support import check_tallies, dead_url, made_before_tallies, older_event

CHAT = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
KILN = Path(sys.executable).parent / "kiln"
SECRET_LINE = re.compile(r"secret \(shown once, store it now\): (sk-kiln-\S+)$")
KEY_LINE = re.compile(r"created key (key_[0-9a-f]{16}) for org (\S+)$")


@dataclass
class Result:
    code: int
    lines: list[str]
    err: str

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture(scope="module")
def clients_by_settings():
    cache: dict = {}
    yield cache
    cache.clear()


def _reuse_clients(monkeypatch, cache: dict) -> None:
    """Each `kiln admin` process makes its own AWS clients (~60-250 ms in the emulator); the
    in-process calls here reuse them per settings. The subprocess test runs the real path."""
    import kiln.store
    import kiln_ops.provision

    real_bind, real_clients = kiln.store.bind, kiln_ops.provision.aws_clients

    def bind(settings):
        if ("tables", settings) not in cache:
            cache[("tables", settings)] = real_bind(settings)
        return cache[("tables", settings)]

    def aws_clients(settings, session=None):
        if ("aws", settings) not in cache:
            cache[("aws", settings)] = real_clients(settings, session)
        return cache[("aws", settings)]

    monkeypatch.setattr(kiln.store, "bind", bind)
    monkeypatch.setattr(kiln_ops.provision, "aws_clients", aws_clients)


@pytest.fixture
def admin(stack, capsys, monkeypatch, clients_by_settings):
    """admin("orgs", "show", "x") → Result; parse errors are returned the same way (exit 2)."""
    _reuse_clients(monkeypatch, clients_by_settings)

    def run(*argv: str) -> Result:
        capsys.readouterr()
        lines: list[str] = []
        if argv and argv[0] == "maintenance":
            stack.maintenance_changed = True  # the stack fixture switches it off afterwards
        try:
            args = build_parser().parse_args(["admin", *argv])
            code = run_admin(args, settings=stack.settings, out=lines.append)
        except SystemExit as exc:
            code = exc.code
        # (stdout is not checked here: the in-process gateway writes its metrics there)
        return Result(code, lines, capsys.readouterr().err)

    return run


def new_org_id() -> str:
    return f"adm-{secrets.token_hex(4)}"


def created_key(result: Result) -> tuple[str, str]:
    """(key id, secret) from the output of `keys create`."""
    assert result.code == 0, result.err
    key_id = KEY_LINE.fullmatch(result.lines[0]).group(1)
    secret = SECRET_LINE.search(result.lines[1]).group(1)
    return key_id, secret


def org_with_key(admin, *, credits: str) -> tuple[str, str, str]:
    """A new org with `credits` and one key, made through the CLI: (org id, key id, secret)."""
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", credits).code == 0
    key_id, secret = created_key(admin("keys", "create", org_id))
    return org_id, key_id, secret


def assert_fails(result: Result, *fragments: str, code: int = 1) -> str:
    """A non-zero exit with the reason on the last line of stderr and no traceback."""
    assert result.code == code, (result.code, result.lines, result.err)
    assert result.lines == []
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert lines, "a failure must say why"
    if code == 1:
        assert len(lines) == 1, result.err  # exactly one line from the command itself
        assert lines[0].startswith("kiln admin: ")
    else:
        # argparse: its usage block, then the one-line reason
        assert lines[0].startswith("usage: kiln admin ")
        assert all(line.startswith(" ") for line in lines[1:-1]), result.err
    reason = lines[-1]
    for fragment in fragments:
        assert fragment in reason, reason
    return reason


# -- orgs ---------------------------------------------------------------------------------------


def test_orgs_create_then_show_reports_the_settings(admin, stack):
    org_id = new_org_id()
    result = admin("orgs", "create", org_id, "--concurrency", "3", "--credits", "12.50")
    assert result.code == 0, result.err
    assert result.lines == [f"created org {org_id}: concurrency 3, credits $12.5"]
    info = stack.org_info(org_id)
    assert (info.status, info.concurrency_limit, info.credits) == ("active", 3, Decimal("12.5"))

    shown = admin("orgs", "show", org_id)
    assert shown.code == 0, shown.err
    assert shown.lines == [
        f"org {org_id}",
        "  status       active",
        "  concurrency  3",
        "  credits      $12.5",
        "  in flight    0",
        f"  created      {info.created_at}",
    ]


def test_orgs_create_defaults_to_the_default_limit_and_no_credits(admin, stack):
    org_id = new_org_id()
    result = admin("orgs", "create", org_id)
    assert result.code == 0, result.err
    info = stack.org_info(org_id)
    assert info.concurrency_limit == stack.settings.default_concurrency
    assert info.credits == 0


@contextmanager
def one_request_in_flight(stack, secret: str, hold_ms: int = 500):
    """A chat request of the key's org held open upstream (the mock waits before the first token)."""
    done: list[int] = []
    slow = {**CHAT, "stream": True, "mock": {"ttft_ms": hold_ms}}
    before = stack.mock.stats["requests"]
    thread = threading.Thread(target=lambda: done.append(stack.post("/v1/chat/completions", slow, secret).status_code))
    thread.start()
    try:
        # the mock has it (its in_flight count is not used: requests of earlier tests may still end)
        stack.mock.wait_for(lambda stats: stats["requests"] == before + 1)
        yield done
    finally:
        thread.join(10)


def poll(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_orgs_show_counts_requests_in_flight(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="5")
    with one_request_in_flight(stack, secret) as done:
        assert "  in flight    1" in admin("orgs", "show", org_id).lines
    assert done == [200]
    poll(lambda: "  in flight    0" in admin("orgs", "show", org_id).lines)


def test_disable_turns_the_orgs_keys_away_with_403_and_enable_lets_them_in(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="5")
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200

    result = admin("orgs", "disable", org_id)
    assert result.code == 0, result.err
    assert result.lines == [f"org {org_id} is now disabled"]
    assert stack.org_info(org_id).status == "disabled"
    assert "  status       disabled" in admin("orgs", "show", org_id).lines
    requests_before = stack.mock.stats["requests"]
    denied = stack.post("/v1/chat/completions", CHAT, secret)
    assert denied.status_code == 403, denied.text
    assert "disabled" in denied.json()["error"]["message"]
    assert stack.mock.stats["requests"] == requests_before  # never reached a model

    result = admin("orgs", "enable", org_id)
    assert result.code == 0, result.err
    assert result.lines == [f"org {org_id} is now active"]
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200


def test_set_limit_changes_the_concurrency_limit(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--concurrency", "2").code == 0
    result = admin("orgs", "set-limit", org_id, "17")
    assert result.code == 0, result.err
    assert result.lines == [f"org {org_id}: concurrency limit 17"]
    assert stack.org_info(org_id).concurrency_limit == 17
    assert "  concurrency  17" in admin("orgs", "show", org_id).lines


def test_set_limit_is_enforced_by_the_gateway(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--concurrency", "5", "--credits", "5").code == 0
    _, secret = created_key(admin("keys", "create", org_id))
    assert admin("orgs", "set-limit", org_id, "1").code == 0
    with one_request_in_flight(stack, secret) as done:
        second = stack.post("/v1/chat/completions", CHAT, secret)
        assert second.status_code == 429, second.text
    assert done == [200]


# -- keys ---------------------------------------------------------------------------------------


def test_keys_create_prints_a_working_secret_that_is_stored_only_as_its_hash(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "5").code == 0
    result = admin("keys", "create", org_id)
    key_id, secret = created_key(result)
    assert KEY_LINE.fullmatch(result.lines[0]).group(2) == org_id
    assert looks_like_key(secret)

    response = stack.post("/v1/chat/completions", CHAT, secret)
    assert response.status_code == 200, response.text

    items = stack.dynamodb.scan(TableName=stack.settings.keys_table)["Items"]
    dump = json.dumps(items)
    assert secret not in dump
    assert secret[len("sk-kiln-") :] not in dump
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert digest == hash_secret(secret)
    assert digest in dump
    mine = [item for item in items if item["key_id"]["S"] == key_id]
    assert len(mine) == 1 and mine[0]["key_hash"]["S"] == digest and mine[0]["org_id"]["S"] == org_id


def test_each_key_create_issues_a_new_independent_key(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "5").code == 0
    first_id, first = created_key(admin("keys", "create", org_id))
    second_id, second = created_key(admin("keys", "create", org_id))
    assert first_id != second_id and first != second
    assert admin("keys", "revoke", first_id).code == 0
    assert stack.post("/v1/chat/completions", CHAT, first).status_code == 401
    assert stack.post("/v1/chat/completions", CHAT, second).status_code == 200


def test_keys_list_shows_ids_prefixes_and_status_but_never_the_secret(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    issued = [created_key(admin("keys", "create", org_id)) for _ in range(2)]
    assert admin("keys", "revoke", issued[0][0]).code == 0

    listing = admin("keys", "list", org_id)
    assert listing.code == 0, listing.err
    assert listing.lines[0].split()[:11] == ["KEY", "ID", "PREFIX", "STATUS", "CREATED", "AT", "LAST", "USED", "AT",
                                             "REVOKED", "AT"]
    rows = {line.split()[0]: line.split() for line in listing.lines[1:]}
    assert set(rows) == {key_id for key_id, _ in issued}
    for key_id, secret in issued:
        assert secret not in listing.text
        assert secret[len("sk-kiln-") :][:12] not in listing.text
        prefix = rows[key_id][1]
        assert prefix.endswith("…") and secret.startswith(prefix[:-1]) and len(prefix[:-1]) < len(secret) // 2
    assert rows[issued[0][0]][2] == "revoked"
    assert rows[issued[1][0]][2] == "active"


def test_keys_list_of_an_org_without_keys_is_just_the_header(admin):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    listing = admin("keys", "list", org_id)
    assert listing.code == 0 and len(listing.lines) == 1


def test_keys_list_does_not_show_another_orgs_keys(admin):
    mine, theirs = new_org_id(), new_org_id()
    assert admin("orgs", "create", mine).code == 0
    assert admin("orgs", "create", theirs).code == 0
    their_key, _ = created_key(admin("keys", "create", theirs))
    assert their_key not in admin("keys", "list", mine).text


def test_keys_tally_adds_an_older_versions_events_once_and_says_what_it_did(admin, stack):
    """A key and an event as a version that kept no tallies left them, and a request of this
    version: `keys tally` adds the older event to the key's tally, marks the key, and says so;
    `keys list` shows the same spend before and after; a second run finds nothing to do."""
    org_id, key_id, secret = org_with_key(admin, credits="5")
    made_before_tallies(stack, key_id)
    older_event(stack, org_id, key_id, iso_ms(time.time()), "0.25")
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200
    spend = Decimal(str(json.loads(admin("keys", "list", org_id, "--format", "json").text)[0]["spend"]))

    result = admin("keys", "tally", org_id)
    assert result.code == 0, result.err
    assert result.lines == [
        f"org {org_id}: 1 usage event added to the keys' tallies ($0.25); 1 key marked tallied",
        "tallied 1 org: 1 usage event added to the keys' tallies ($0.25); 1 key marked tallied"]
    check_tallies(stack, org_id, stack.events(org_id))
    assert Decimal(str(json.loads(admin("keys", "list", org_id, "--format", "json").text)[0]["spend"])) == spend
    # --progress says how far it got, the last count too (a run of fewer than 512 said nothing)
    older_event(stack, org_id, key_id, iso_ms(time.time()), "0.5")
    told = admin("keys", "tally", org_id, "--progress")
    assert told.code == 0 and "kiln admin: 1 usage events tallied…" in told.err.splitlines()
    again = admin("keys", "tally", org_id, org_id)
    assert again.lines[-1] == "tallied 2 orgs: 0 usage events added to the keys' tallies ($0); 0 keys marked tallied"
    assert_fails(admin("keys", "tally", "no-such-org"), "kiln admin: org 'no-such-org' not found")


def test_revoked_key_gets_401_and_revoking_twice_is_refused(admin, stack):
    org_id, key_id, secret = org_with_key(admin, credits="5")
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200

    result = admin("keys", "revoke", key_id)
    assert result.code == 0, result.err
    assert result.lines == [f"revoked key {key_id} ({secret[:12]}…) of org {org_id}"]
    denied = stack.post("/v1/chat/completions", CHAT, secret)
    assert denied.status_code == 401, denied.text
    assert denied.json()["error"]["code"] == "invalid_api_key"

    again = admin("keys", "revoke", key_id)
    assert_fails(again, f"key '{key_id}' is already revoked (since ")
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 401
    changed = admin("keys", "update", key_id, "--label", "again")
    assert_fails(changed, f"key '{key_id}' is already revoked (since ")


def test_keys_create_with_every_attribute_flag(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "5", "--concurrency", "4").code == 0
    result = admin("keys", "create", org_id, "--label", "batch", "--spend-limit", "5", "--spend-period", "day",
                   "--models", "qwen3-32b,gpt-oss-120b", "--concurrency", "2", "--role", "management")
    key_id, secret = created_key(result)  # the first two lines are as they always were
    assert result.lines[2:] == [
        "  label 'batch', role management, models gpt-oss-120b,qwen3-32b, concurrency 2, spend limit $5 per day"]
    seen = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {secret}"}).json()
    assert (seen["id"], seen["label"], seen["role"], seen["models"], seen["concurrency"]) == (
        key_id, "batch", "management", ["gpt-oss-120b", "qwen3-32b"], 2)
    assert (seen["spend_limit"], seen["spend_period"]) == (5, "day")
    # a management key manages keys: the API lists the org's keys for it
    assert stack.http.get("/v1/keys", headers={"Authorization": f"Bearer {secret}"}).status_code == 200


@pytest.mark.parametrize(
    "flags,reason",
    [
        (("--models", "no-such-model"), "The model `no-such-model` is not in the catalog."),
        (("--concurrency", "9"), "concurrency must be 1 to 8, the organization's limit; got 9."),
        (("--spend-limit", "-1"), "spend_limit must be a non-negative amount of USD."),
    ],
)
def test_keys_create_refuses_bad_attributes_and_creates_nothing(admin, flags, reason):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    assert_fails(admin("keys", "create", org_id, *flags), reason)
    assert len(admin("keys", "list", org_id).lines) == 1


def test_keys_recount_sets_an_orgs_count_of_keys_with_a_limit_from_its_keys(admin, stack):
    """After a rollback, functions of a version that kept no count changed limits: the count
    drifted (a key revoked there still counted, and the cap refused a limit there was room for)."""
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    for _ in range(2):
        assert admin("keys", "create", org_id, "--spend-limit", "5").code == 0
    stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                               UpdateExpression="SET limited_keys = :n", ExpressionAttributeValues={":n": {"N": "5"}})
    result = admin("keys", "recount", org_id)
    assert result.code == 0 and result.lines == [f"org {org_id}: 2 keys with a spend limit (the count was 5)",
                                                 "recounted 1 org: 1 changed"]
    item = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"]
    assert item["limited_keys"] == {"N": "2"}
    assert_fails(admin("keys", "recount", org_id, new_org_id()), "not found")


def test_keys_create_says_when_the_org_has_as_many_keys_with_a_limit_as_it_may(admin, monkeypatch):
    import kiln.store.keyring as keyring

    monkeypatch.setattr(keyring, "MAX_LIMITED_KEYS", 1)
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    assert admin("keys", "create", org_id, "--spend-limit", "5").code == 0
    assert_fails(admin("keys", "create", org_id, "--spend-limit", "5"),
                 "An organization may have at most 1 active keys with a spend limit, and this one has 1")
    assert len(admin("keys", "list", org_id).lines) == 2


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (("--spend-period", "year"), "one of day, week, month, total (or none)"),
        (("--role", "admin"), "one of inference, management (or none)"),
        (("--concurrency", "0"), "a whole number must be at least 1"),
        (("--spend-limit", "lots"), "not an amount of USD"),
        (("--models", ","), "name at least one model id"),
    ],
)
def test_keys_flags_are_checked_before_anything_is_read(admin, flags, fragment):
    assert_fails(admin("keys", "create", "any-org", *flags), fragment, code=2)


def test_keys_update_changes_the_given_flags_and_none_clears(admin, stack):
    org_id, key_id, secret = org_with_key(admin, credits="5")
    result = admin("keys", "update", key_id, "--spend-limit", "2.5", "--spend-period", "week", "--label", "ci")
    assert result.code == 0, result.err
    assert result.lines == [
        f"updated key {key_id} ({secret[:12]}…) of org {org_id}: label 'ci', role inference, every model, "
        "the org's concurrency, spend limit $2.5 per week",
        "  the gateway applies it within its auth cache time",
    ]
    seen = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {secret}"}).json()
    assert (seen["label"], seen["spend_limit"], seen["spend_period"]) == ("ci", 2.5, "week")

    cleared = admin("keys", "update", key_id, "--spend-limit", "none", "--spend-period", "none", "--label", "none",
                    "--models", "qwen3-32b", "--concurrency", "3")
    assert cleared.code == 0, cleared.err
    assert cleared.lines[0].endswith(": no label, role inference, models qwen3-32b, concurrency 3, no spend limit")
    again = admin("keys", "update", key_id, "--models", "none", "--concurrency", "none")
    assert again.lines[0].endswith(": no label, role inference, every model, the org's concurrency, no spend limit")
    seen = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {secret}"}).json()
    assert (seen["models"], seen["concurrency"], seen["spend_limit"], seen["spend_period"]) == (None, None, None, "total")


def test_keys_update_needs_a_flag_and_a_known_key(admin):
    _, key_id, _ = org_with_key(admin, credits="1")
    assert_fails(admin("keys", "update", key_id), "nothing to change")
    assert_fails(admin("keys", "update", "key_0000000000000000", "--label", "x"), "key 'key_0000000000000000' not found")
    assert_fails(admin("keys", "update", key_id, "--concurrency", "99"), "the organization's limit")


def test_keys_list_shows_labels_roles_limits_and_this_periods_spend(admin, stack):
    org_id, plain_id, plain = org_with_key(admin, credits="5")
    limited_id, limited = created_key(admin("keys", "create", org_id, "--label", "nightly", "--spend-limit", "1",
                                            "--spend-period", "month", "--models", "qwen3-32b", "--concurrency", "2"))
    answer = stack.post(CHAT_PATH, CHAT, limited)
    assert answer.status_code == 200, answer.text
    rows = {row["key_id"]: row for row in json.loads(admin("keys", "list", org_id, "--format", "json").text)}
    assert set(rows) == {plain_id, limited_id}
    row = rows[limited_id]
    assert (row["label"], row["role"], row["models"], row["concurrency"]) == ("nightly", "inference", "qwen3-32b", 2)
    assert (row["spend_limit"], row["spend_period"]) == ("1", "month")
    assert Decimal(row["spend"]) == stack.events(org_id)[0].cost > 0
    assert (rows[plain_id]["label"], rows[plain_id]["spend_limit"], rows[plain_id]["spend"]) == (None, None, "0")
    table = admin("keys", "list", org_id)
    assert table.lines[0].split()[11:] == ["LABEL", "ROLE", "MODELS", "CONCURRENCY", "SPEND", "LIMIT", "SPEND",
                                           "PERIOD", "SPEND"]
    assert plain not in table.text and limited not in table.text
    assert any(line.startswith(limited_id) and "nightly" in line and "month" in line for line in table.lines)


def _figures(stack, org_id: str, key_id: str) -> dict[str, Decimal]:
    return {name: value for name, value in stack.key_figures(org_id).items() if name.startswith(f"key_spend:{key_id}:")}


def test_keys_revoke_takes_the_keys_figure_off_its_org(admin, stack):
    org_id, plain_id, _ = org_with_key(admin, credits="5")
    limited_id, limited = created_key(admin("keys", "create", org_id, "--spend-limit", "1", "--spend-period", "total"))
    assert stack.post(CHAT_PATH, CHAT, limited).status_code == 200
    assert list(_figures(stack, org_id, limited_id)) == [f"key_spend:{limited_id}:total"]
    assert admin("keys", "revoke", limited_id).code == 0
    assert _figures(stack, org_id, limited_id) == {}
    row = {row["key_id"]: row for row in json.loads(admin("keys", "list", org_id, "--format", "json").text)}[limited_id]
    assert Decimal(row["spend"]) == stack.events(org_id)[0].cost  # from its events


def test_keys_update_seeds_a_new_limits_figure_and_none_removes_it(admin, stack):
    org_id, key_id, secret = org_with_key(admin, credits="5")
    for _ in range(2):
        assert stack.post(CHAT_PATH, CHAT, secret).status_code == 200
    spent = sum((event.cost for event in stack.events(org_id)), Decimal(0))
    assert _figures(stack, org_id, key_id) == {}
    assert admin("keys", "update", key_id, "--spend-limit", "5", "--spend-period", "day").code == 0
    day = KeyLimits(None, Decimal(5), "day").figure(key_id, time.time())
    assert _figures(stack, org_id, key_id) == {day: spent}
    assert admin("keys", "update", key_id, "--spend-period", "month").code == 0
    month = KeyLimits(None, Decimal(5), "month").figure(key_id, time.time())
    assert _figures(stack, org_id, key_id) == {month: spent}
    stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                               UpdateExpression="SET #f = :v", ExpressionAttributeNames={"#f": month},
                               ExpressionAttributeValues={":v": {"N": "4"}})
    assert admin("keys", "update", key_id, "--spend-limit", "7").code == 0  # the amount only: left alone
    assert _figures(stack, org_id, key_id) == {month: Decimal(4)}
    row = {row["key_id"]: row for row in json.loads(admin("keys", "list", org_id, "--format", "json").text)}[key_id]
    assert Decimal(row["spend"]) == 4  # a key with a limit shows its figure
    assert admin("keys", "update", key_id, "--spend-limit", "none").code == 0
    assert _figures(stack, org_id, key_id) == {}


def test_keys_list_shows_a_key_without_a_limit_its_spend_this_period(admin, stack):
    org_id, plain_id, plain = org_with_key(admin, credits="5")
    daily_id, daily = created_key(admin("keys", "create", org_id, "--spend-period", "day"))
    for secret in (plain, daily, daily):
        assert stack.post(CHAT_PATH, CHAT, secret).status_code == 200
    costs: dict[str, Decimal] = {}
    for event in stack.events(org_id):
        costs[event.key_id] = costs.get(event.key_id, Decimal(0)) + event.cost
    rows = {row["key_id"]: row for row in json.loads(admin("keys", "list", org_id, "--format", "json").text)}
    assert {key_id: Decimal(row["spend"]) for key_id, row in rows.items()} == costs
    assert stack.key_figures(org_id) == {}


@pytest.mark.parametrize("amount", ["1_000", "\u0661\u0660", "\uff15"])
def test_keys_spend_limit_in_other_digits_is_refused(admin, amount):
    assert_fails(admin("keys", "create", "any-org", "--spend-limit", amount), "not an amount of USD", code=2)


# -- credits ------------------------------------------------------------------------------------


def test_credits_add_is_exact_decimal(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    outputs = []
    for _ in range(3):
        result = admin("credits", "add", org_id, "0.1")
        assert result.code == 0, result.err
        outputs.append(result.lines)
    assert stack.org_info(org_id).credits == Decimal("0.3")
    assert outputs[-1] == [f"org {org_id}: added $0.1, balance $0.3"]
    assert "  credits      $0.3" in admin("orgs", "show", org_id).lines


def test_credits_add_keeps_tiny_amounts_and_corrects_with_negative(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "10").code == 0
    assert admin("credits", "add", org_id, "0.000000665").code == 0
    assert stack.org_info(org_id).credits == Decimal("10.000000665")
    result = admin("credits", "add", org_id, "-2.5")
    assert result.code == 0, result.err
    assert stack.org_info(org_id).credits == Decimal("7.500000665")
    assert result.lines == [f"org {org_id}: added $-2.5, balance $7.500000665"]


def test_credits_added_to_an_empty_org_let_its_key_in(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    _, secret = created_key(admin("keys", "create", org_id))
    broke = stack.post("/v1/chat/completions", CHAT, secret)
    assert broke.status_code == 402, broke.text
    assert admin("credits", "add", org_id, "1").code == 0
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200


# -- maintenance --------------------------------------------------------------------------------


def test_maintenance_on_with_until_and_message_then_off(admin, stack):
    result = admin("maintenance", "on", "--until", "2099-12-01T03:00:00Z", "--message", "Upgrading model servers.")
    assert result.code == 0, result.err
    assert result.lines[0].startswith("maintenance on: ")
    written = json.loads(stack.ssm.get_parameter(Name=stack.settings.maintenance_parameter)["Parameter"]["Value"])
    assert written == {"enabled": True, "until": "2099-12-01T03:00:00Z", "message": "Upgrading model servers."}

    _, secret = stack.org()
    response = stack.post("/v1/chat/completions", CHAT, secret)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "Tue, 01 Dec 2099 03:00:00 GMT"
    assert response.json()["error"]["message"] == "Upgrading model servers."
    assert stack.http.get("/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 503

    status = admin("maintenance", "status")
    assert status.code == 0, status.err
    assert status.lines[0].startswith("maintenance on: ")
    assert json.loads(status.lines[0].split(": ", 1)[1]) == written

    off = admin("maintenance", "off")
    assert off.code == 0 and off.lines == ["maintenance off"]
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200
    status = admin("maintenance", "status")
    assert status.lines == ['maintenance off: {"enabled": false}']


def test_maintenance_on_without_until_retries_after_seconds_with_a_default_message(admin, stack):
    assert admin("maintenance", "on").code == 0
    _, secret = stack.org()
    response = stack.post("/v1/completions", {"model": "qwen3-32b", "prompt": "x"}, secret)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(stack.settings.maintenance_retry_after_seconds)
    assert response.json()["error"]["message"]


def test_maintenance_until_with_an_offset_is_stored_and_sent_in_utc(admin, stack):
    assert admin("maintenance", "on", "--until", "2099-06-01T05:30:00+02:00").code == 0
    status = admin("maintenance", "status")
    assert json.loads(status.lines[0].split(": ", 1)[1])["until"] == "2099-06-01T03:30:00Z"
    _, secret = stack.org()
    response = stack.post("/v1/chat/completions", CHAT, secret)
    assert response.status_code == 503
    assert parsedate_to_datetime(response.headers["Retry-After"]).isoformat() == "2099-06-01T03:30:00+00:00"


def test_an_until_already_past_switches_on_and_says_clients_get_seconds(admin, stack):
    """A past --until (a day or a zone typed wrong) is no time for clients to come back: the
    switch goes on, and the operator is told clients are sent the default seconds instead."""
    result = admin("maintenance", "on", "--until", "2020-01-01T00:00:00Z")
    assert result.code == 0
    seconds = stack.settings.maintenance_retry_after_seconds
    assert result.lines[-1] == (f"note: --until 2020-01-01T00:00:00Z has passed: clients are told "
                                f"Retry-After: {seconds} (seconds) instead")
    _, secret = stack.org()
    assert stack.post("/v1/chat/completions", CHAT, secret).headers["Retry-After"] == str(seconds)


def test_an_until_that_is_no_time_is_a_malformed_argument_and_a_year_typed_short_is_still_a_switch(admin, stack):
    malformed = admin("maintenance", "on", "--until", "garbage")
    assert malformed.code == 2 and "--until" in malformed.err and "garbage" in malformed.err
    typo = admin("maintenance", "on", "--until", "0226-12-01T03:00:00Z")  # for 2026
    assert typo.code == 0
    assert typo.lines[-1].startswith("note: --until 0226-12-01T03:00:00Z has passed")
    status = admin("maintenance", "status")
    assert status.code == 0 and '"until": "0226-12-01T03:00:00Z"' in status.lines[0], status.err
    _, secret = stack.org()
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 503  # the gateway reads it on


def test_a_maintenance_message_too_long_for_a_standard_parameter_is_refused_here_as_on_aws(admin, stack):
    """The local switch is an advanced parameter (8 KB), a deployed stack's a standard one (4 KB)
    where kiln admin first writes it: a long message passed here and failed there."""
    result = admin("maintenance", "on", "--message", "x" * 4100)
    assert_fails(result, "shorten --message")
    assert admin("maintenance", "status").lines == ['maintenance off: {"enabled": false}']
    assert admin("maintenance", "on", "--message", "x" * 4000).code == 0


def test_maintenance_status_without_a_parameter_is_off(admin, stack):
    stack.ssm.delete_parameter(Name=stack.settings.maintenance_parameter)
    stack.maintenance_changed = True  # put it back afterwards
    status = admin("maintenance", "status")
    assert status.code == 0, status.err
    assert status.lines == ['maintenance off: {"enabled": false}']


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("orgs", "show", "no-such-org"),
        ("orgs", "disable", "no-such-org"),
        ("orgs", "enable", "no-such-org"),
        ("orgs", "set-limit", "no-such-org", "4"),
        ("keys", "create", "no-such-org"),
        ("keys", "list", "no-such-org"),
        ("credits", "add", "no-such-org", "5"),
    ],
    ids=lambda argv: "-".join(argv[:2]),
)
def test_unknown_org_fails_with_one_line(admin, stack, argv):
    reason = assert_fails(admin(*argv), "no-such-org", "not found")
    assert reason == "kiln admin: org 'no-such-org' not found"
    with pytest.raises(RecordNotFound):
        stack.org_info("no-such-org")  # nothing was created on the way


def test_unknown_key_id_fails_with_one_line(admin):
    assert_fails(admin("keys", "revoke", "key_0000000000000000"), "key 'key_0000000000000000' not found")


def test_duplicate_org_fails_and_leaves_the_first_untouched(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "5", "--concurrency", "2").code == 0
    assert_fails(admin("orgs", "create", org_id, "--credits", "99"), org_id, "already exists")
    info = stack.org_info(org_id)
    assert (info.credits, info.concurrency_limit) == (Decimal("5"), 2)


@pytest.mark.parametrize("org_id", ["Upper", "has space", "_leading-underscore", "a" * 64, "dot.ted", ""])
def test_invalid_org_id_fails(admin, org_id):
    assert_fails(admin("orgs", "create", org_id), "org ids are")


@pytest.mark.parametrize("until", ["tomorrow", "2099-13-01T00:00:00Z", "12/01/2099",
                                   "2099-12-01T00:00:00+00:99"])  # read by Python as +01:39
def test_bad_until_fails_and_leaves_the_switch_alone(admin, stack, until):
    # a malformed argument, as the docs say, exits 2
    assert_fails(admin("maintenance", "on", "--until", until), "--until", repr(until), code=2)
    assert admin("maintenance", "status").lines == ['maintenance off: {"enabled": false}']
    _, secret = stack.org()
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200


def test_negative_initial_credits_are_rejected(admin, stack):
    org_id = new_org_id()
    assert_fails(admin("orgs", "create", org_id, "--credits", "-5"), "credits must be a non-negative")
    with pytest.raises(RecordNotFound):
        stack.org_info(org_id)


@pytest.mark.parametrize("amount", ["1e125", "1000000000000", "-10000000000000", "0.0000000000000001",
                                    "1.00000000000000000000000000001"])  # places past a context's 28 digits
def test_credits_no_balance_could_stay_exact_with_are_refused(admin, stack, amount):
    """A balance is debited costs of up to 15 decimal places, in DynamoDB's 38 digits: an amount
    of a trillion dollars or more, or finer than a cost, would leave a balance whose debits are
    rounded (after $1e125 was added, the next adds vanished and kiln admin said they were made)."""
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "1").code == 0
    assert_fails(admin("credits", "add", org_id, amount), "credits")
    assert_fails(admin("orgs", "create", new_org_id(), "--credits", amount.lstrip("-")), "credits")
    assert stack.org_info(org_id).credits == Decimal("1")


def test_adding_zero_credits_is_rejected(admin, stack):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "1").code == 0
    assert_fails(admin("credits", "add", org_id, "0"), "non-zero")
    assert_fails(admin("credits", "add", org_id, "-0.00"), "non-zero")
    assert stack.org_info(org_id).credits == Decimal("1")


@pytest.mark.parametrize(
    "argv,reason",
    [
        (("credits", "add", "{org}", "ten"), "not an amount of USD: 'ten'"),
        (("credits", "add", "{org}", "NaN"), "not an amount of USD: 'NaN'"),
        (("credits", "add", "{org}", "Infinity"), "not an amount of USD: 'Infinity'"),
        (("credits", "add", "{org}", "$5"), "not an amount of USD: '$5'"),
        (("orgs", "create", "{new}", "--credits", "lots"), "not an amount of USD: 'lots'"),
        (("credits", "add", "{org}", "1e200"), "not an amount DynamoDB can store: '1e200'"),
        (("credits", "add", "{org}", "1e1000000"), "not an amount DynamoDB can store: '1e1000000'"),
        (("credits", "add", "{org}", "1e-1000000"), "not an amount DynamoDB can store: '1e-1000000'"),
        (("credits", "add", "{org}", "0." + "1" * 39), "not an amount DynamoDB can store: '0.1111"),
        (("orgs", "create", "{new}", "--credits", "1E+999999999"), "not an amount DynamoDB can store: '1E+999999999'"),
        (("orgs", "create", "{new}", "--concurrency", "0"), "must be 1-500, got 0"),
        (("orgs", "create", "{new}", "--concurrency", "two"), "not a concurrency limit: 'two'"),
        (("orgs", "set-limit", "{org}", "0"), "must be 1-500, got 0"),
        (("orgs", "set-limit", "{org}", "-3"), "must be 1-500, got -3"),
    ],
    ids=["usd-word", "usd-nan", "usd-inf", "usd-dollar", "create-credits", "usd-too-large", "usd-beyond-any-exponent",
         "usd-too-small", "usd-39-digits", "create-credits-beyond", "create-zero-limit", "create-word-limit",
         "limit-zero", "limit-negative"],
)
def test_bad_arguments_exit_2_with_the_reason(admin, stack, argv, reason):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id, "--credits", "1", "--concurrency", "3").code == 0
    fresh = new_org_id()
    argv = tuple(part.format(org=org_id, new=fresh) for part in argv)
    last = assert_fails(admin(*argv), reason, code=2)
    assert last.startswith("kiln admin ") and ": error: " in last
    info = stack.org_info(org_id)
    assert (info.credits, info.concurrency_limit) == (Decimal("1"), 3)
    with pytest.raises(RecordNotFound):
        stack.org_info(fresh)


def _run_elsewhere(capsys, settings, *argv: str) -> Result:
    """run_admin with other settings and its own fresh clients (no reuse)."""
    capsys.readouterr()
    lines: list[str] = []
    code = run_admin(build_parser().parse_args(["admin", *argv]), settings=settings, out=lines.append)
    return Result(code, lines, capsys.readouterr().err)


def _unreachable(stack):
    return replace(stack.settings, aws_endpoint_url=dead_url().rsplit("/v1", 1)[0])


TABLE_COMMANDS = [
    ("orgs", "show", "some-org"),
    ("keys", "revoke", "key_0000000000000000"),
    ("credits", "add", "some-org", "1"),
]


@pytest.mark.parametrize("argv", TABLE_COMMANDS + [("maintenance", "status")], ids=lambda argv: "-".join(argv[:2]))
def test_unreachable_storage_fails_with_one_line(capsys, stack, argv):
    result = _run_elsewhere(capsys, _unreachable(stack), *argv)
    assert_fails(result, "Could not connect to the endpoint URL")


def test_unreachable_ssm_says_aws_cannot_be_reached(capsys, stack):
    result = _run_elsewhere(capsys, _unreachable(stack), "maintenance", "status")
    assert_fails(result, "kiln admin: cannot reach AWS: ")


@pytest.mark.parametrize("argv", TABLE_COMMANDS, ids=lambda argv: "-".join(argv[:2]))
def test_unreachable_dynamodb_says_aws_cannot_be_reached(capsys, stack, argv):
    result = _run_elsewhere(capsys, _unreachable(stack), *argv)
    assert_fails(result, "kiln admin: cannot reach AWS: ")


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask an instance metadata service
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)


def _real_aws(stack):
    return replace(stack.settings, aws_endpoint_url=None)


def test_without_credentials_the_maintenance_commands_say_how_to_get_them(capsys, stack, no_credentials):
    result = _run_elsewhere(capsys, _real_aws(stack), "maintenance", "status")
    assert_fails(result, "no AWS credentials", "kiln dev")


@pytest.mark.parametrize("argv", TABLE_COMMANDS[:2], ids=lambda argv: "-".join(argv[:2]))
def test_without_credentials_the_table_commands_say_how_to_get_them(capsys, stack, no_credentials, argv):
    result = _run_elsewhere(capsys, _real_aws(stack), *argv)
    assert_fails(result, "no AWS credentials", "kiln dev")


@pytest.mark.parametrize("command", ["create", "add"])
def test_amounts_are_printed_as_plain_numbers(admin, command):
    org_id = new_org_id()
    if command == "create":
        result = admin("orgs", "create", org_id, "--credits", "1e3")
        assert result.lines == [f"created org {org_id}: concurrency 8, credits $1000"]
    else:
        assert admin("orgs", "create", org_id).code == 0
        result = admin("credits", "add", org_id, "1e3")
        assert result.lines == [f"org {org_id}: added $1000, balance $1000"]


# -- the installed command, in a shell with the exports -------------------------------------------


def _shell_env(stack) -> tuple[dict[str, str], str]:
    exports = {
        **stack.settings.to_env(),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # A clean environment: only what a shell needs plus the exports (no AWS profile, no venv vars).
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR") if name in os.environ}
    env["PATH"] = f"{KILN.parent}{os.pathsep}{env.get('PATH', '')}"
    script = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in exports.items())
    return env, script


def test_the_kiln_command_in_a_shell_with_the_exports(stack):
    assert KILN.exists(), f"the kiln script is not installed at {KILN}"
    env, exports = _shell_env(stack)
    org_id = new_org_id()
    script = exports + (
        "set -e\n"
        f"kiln admin orgs create {org_id} --concurrency 2 --credits 1.25\n"
        f"kiln admin credits add {org_id} 0.1\n"
        f"kiln admin keys create {org_id}\n"
    )
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"created org {org_id}: concurrency 2, credits $1.25"
    assert lines[1] == f"org {org_id}: added $0.1, balance $1.35"
    secret = SECRET_LINE.search(lines[3]).group(1)
    info = stack.org_info(org_id)
    assert (info.concurrency_limit, info.credits) == (2, Decimal("1.35"))
    response = stack.post("/v1/chat/completions", CHAT, secret)
    assert response.status_code == 200, response.text

    # A failure is one line on stderr and a non-zero exit status, never a traceback.
    failed = subprocess.run(
        ["bash", "-c", exports + "kiln admin orgs show no-such-org"], env=env, capture_output=True, text=True, timeout=60
    )
    assert failed.returncode == 1
    assert failed.stdout == ""
    assert failed.stderr == "kiln admin: org 'no-such-org' not found\n"


def test_a_listing_whose_reader_left_ends_quietly(stack):
    """`kiln admin catalog show | head -1`: the reader may leave before the listing is written
    (here at once: `true` reads nothing); the listing stops there as a Unix command does (the
    status of a pipe's broken end), with no line on stderr saying the pipe broke, and no
    traceback at exit."""
    env, exports = _shell_env(stack)
    script = exports + "set -o pipefail\nkiln admin catalog show | true\n"
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.stderr == "" and done.returncode == 141


def test_a_key_whose_secret_could_not_be_written_is_named_for_revocation(stack):
    """`kiln admin keys create ORG | …` whose reader left: the key exists, its secret is lost;
    the operator is told which key to revoke, not nothing."""
    env, exports = _shell_env(stack)
    org_id, _ = stack.org()
    done = subprocess.run(["bash", "-c", exports + f"set -o pipefail\nkiln admin keys create {org_id} | true\n"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 141
    made = {key.key_id for key in list_keys(stack.tables, org_id)}
    named = re.search(r"kiln admin keys revoke (key_\w+)", done.stderr)
    assert named and named.group(1) in made and len(made) == 2, done.stderr  # the stack's own, and this one


def test_catalog_set_validates_and_replaces_the_catalog(admin, stack, tmp_path):
    import json as _json

    from support import catalog_for_tests

    original = admin("catalog", "show").lines[0]
    document = catalog_for_tests(stack.mock.url)
    document["models"] = [m for m in document["models"] if m["id"] == "qwen3-32b"]
    good = tmp_path / "catalog.json"
    good.write_text("\ufeff" + _json.dumps(document), encoding="utf-8")  # with a byte order mark, as some editors save
    try:
        result = admin("catalog", "set", str(good))
        assert result.code == 0 and "1 models (qwen3-32b)" in result.lines[0], result.err
        shown = admin("catalog", "show")
        assert _json.loads(shown.lines[0])["models"][0]["id"] == "qwen3-32b"  # stored without it

        bad = tmp_path / "bad.json"
        bad.write_text('{"models": [{"id": "x"}]}')
        result = admin("catalog", "set", str(bad))
        assert result.code == 1 and "pricing" in result.err
        assert _json.loads(admin("catalog", "show").lines[0])["models"][0]["id"] == "qwen3-32b"  # unchanged
    finally:
        (tmp_path / "original.json").write_text(original)
        assert admin("catalog", "set", str(tmp_path / "original.json")).code == 0


def test_an_emulator_needs_no_credentials(capsys, stack, no_credentials):
    org_id = new_org_id()
    result = _run_elsewhere(capsys, stack.settings, "orgs", "create", org_id)
    assert result.code == 0, result.err
    assert _run_elsewhere(capsys, stack.settings, "orgs", "show", org_id).code == 0
    assert _run_elsewhere(capsys, stack.settings, "maintenance", "status").code == 0


# -- listings, usage reports, generations, --stack ------------------------------------------------


def test_orgs_list_shows_every_org_in_every_format(admin):
    first, second = new_org_id(), new_org_id()
    assert admin("orgs", "create", first, "--credits", "2").code == 0
    assert admin("orgs", "create", second, "--concurrency", "3").code == 0
    table = admin("orgs", "list")
    assert table.lines[0].split()[:2] == ["ORG", "ID"]
    assert any(line.startswith(first) and " 2 " in f" {line} " for line in table.lines)
    listed = {row["org_id"]: row for row in json.loads(admin("orgs", "list", "--format", "json").text)}
    assert listed[first]["credits"] == "2" and listed[second]["concurrency_limit"] == 3
    csv_lines = admin("orgs", "list", "--format", "csv").lines
    assert csv_lines[0] == "org_id,status,concurrency_limit,credits,in_flight,created_at"
    assert any(line.startswith(f"{second},active,3,0,0,") for line in csv_lines)


def _traffic(stack, key: str) -> list[str]:
    """A mixed workload: successes, an upstream 400 and 500, a cut stream, estimated usage, no backend."""
    chat = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}]}
    bodies = [
        (CHAT_PATH, chat),
        (CHAT_PATH, {**chat, "stream": True}),
        (CHAT_PATH, {**chat, "model": "qwen3-32b", "mock": {"cached_tokens": 2}}),
        ("/v1/completions", {"model": "gpt-oss-120b", "prompt": "The capital of France is"}),
        (CHAT_PATH, {**chat, "mock": {"status": 400}}),
        (CHAT_PATH, {**chat, "mock": {"status": 500}}),
        (CHAT_PATH, {**chat, "stream": True, "mock": {"cut_after": 3}}),
        (CHAT_PATH, {**chat, "mock": {"no_usage": True}}),
        (CHAT_PATH, {**chat, "model": "no-backend-model"}),
    ]
    return [stack.post(path, body, key).headers["X-Neocloud-Generation-Id"] for path, body in bodies]


CHAT_PATH = "/v1/chat/completions"


def test_usage_totals_equal_the_ledger(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="3")
    gen_ids = _traffic(stack, secret) + _traffic(stack, secret)
    report = json.loads(admin("usage", org_id, "--format", "json").text)
    total = report["total"]
    debited = Decimal("3") - stack.org_info(org_id).credits
    assert Decimal(total["cost"]) == debited > 0
    assert total["requests"] == len(gen_ids) == 18
    assert total["errors"] == 2 * 4  # 400, 500, a cut stream, no backend (estimated usage is a success)
    events = stack.events(org_id)
    assert total["prompt_tokens"] == sum(e.prompt_tokens or 0 for e in events)
    assert total["completion_tokens"] == sum(e.completion_tokens or 0 for e in events)
    assert total["cached_tokens"] == 4
    by_model = {row["group"]: row for row in report["rows"]}
    assert set(by_model) == {"gpt-oss-120b", "qwen3-32b", "no-backend-model"}
    assert sum(Decimal(row["cost"]) for row in by_model.values()) == debited

    table = admin("usage", org_id, "--by", "key")
    assert table.lines[0].startswith(f"usage of org {org_id}, the start to now, by key:")
    assert table.lines[-1].split()[0] == "TOTAL" and table.lines[-1].split()[1] == "18"


def test_usage_since_and_until_split_the_period_exactly(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="3")
    _traffic(stack, secret)
    events = sorted(stack.events(org_id), key=lambda e: e.created_at)
    middle = events[4].created_at
    before = json.loads(admin("usage", org_id, "--until", middle, "--format", "json").text)["total"]
    after = json.loads(admin("usage", org_id, "--since", middle, "--format", "json").text)["total"]
    whole = json.loads(admin("usage", org_id, "--format", "json").text)["total"]
    assert before["requests"] + after["requests"] == whole["requests"] == 9
    assert Decimal(before["cost"]) + Decimal(after["cost"]) == Decimal(whole["cost"])
    by_day = json.loads(admin("usage", org_id, "--by", "day", "--since", "2026-01-01", "--format", "json").text)
    assert [row["group"] for row in by_day["rows"]] == [middle[:10]]
    assert_fails(admin("usage", org_id, "--since", "yesterday"), "not an ISO 8601 date or time", code=2)
    # minutes past 59 in an offset: Python reads on (+00:99 as +01:39), another time than the one typed
    assert_fails(admin("usage", org_id, "--since", "2026-01-01T00:00:00+00:99"), "not an ISO 8601", code=2)


def test_usage_reports_progress_while_it_pages(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="3")
    _traffic(stack, secret)
    result = admin("usage", org_id, "--progress", "--format", "csv")
    assert "kiln admin: 9 usage events read…" in result.err
    assert result.lines[0].startswith("group,")  # stdout stays clean for scripts
    assert "read…" not in admin("usage", org_id).err  # not a terminal, not asked: quiet


def test_usage_by_endpoint_shows_the_responses_api_beside_chat(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="3")
    stack.post(CHAT_PATH, {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}]}, secret)
    for stream in (False, True):
        stack.post("/v1/responses", {"model": "gpt-oss-120b", "input": "hi", "stream": stream}, secret)
    report = json.loads(admin("usage", org_id, "--by", "endpoint", "--format", "json").text)
    rows = {row["group"]: row for row in report["rows"]}
    assert {name: row["requests"] for name, row in rows.items()} == {"chat.completions": 1, "responses": 2}
    assert sum(Decimal(row["cost"]) for row in rows.values()) == Decimal("3") - stack.org_info(org_id).credits


def test_usage_of_an_unknown_org_fails(admin):
    assert_fails(admin("usage", "no-such-org"), "org 'no-such-org' not found")


def test_credits_show_has_the_balance_and_latest_debits(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="1")
    gen_ids = _traffic(stack, secret)
    table = admin("credits", "show", org_id, "--last", "3")
    balance = stack.org_info(org_id).credits
    assert table.lines[0] == f"org {org_id}: balance ${balance}"
    assert table.lines[1] == "latest 3 debits:"
    assert gen_ids[-1] in table.lines[3]  # newest first
    document = json.loads(admin("credits", "show", org_id, "--format", "json").text)
    assert Decimal(document["balance"]) == balance
    assert len(document["debits"]) == 9
    assert Decimal("1") - sum(Decimal(d["cost"]) for d in document["debits"]) == balance


def test_generation_shows_the_full_usage_event(admin, stack):
    org_id, _, secret = org_with_key(admin, credits="1")
    gen_id = _traffic(stack, secret)[0]
    table = admin("generation", gen_id)
    fields = dict(line.split(None, 1) for line in table.lines)
    assert fields["gen_id"] == gen_id and fields["org_id"] == org_id and fields["status"] == "success"
    assert fields["cost"] == "0.00000098" and fields["upstream"] == "local"
    event = json.loads(admin("generation", gen_id, "--format", "json").text)
    assert event["prompt_tokens"] == 4 and event["cost"] == "0.00000098" and event["key_id"].startswith("key_")
    assert_fails(admin("generation", "gen-" + "0" * 26), "generation 'gen-00000000000000000000000000' not found")
    # the key's tally beside the events is not a generation (kiln.store.tally)
    tally = f"tally:{event['key_id']}:{event['created_at'][:7]}"
    assert_fails(admin("generation", tally), f"generation '{tally}' not found")
    assert_fails(admin("generation", ""), "generation '' not found")  # no key DynamoDB takes, not its error


def test_keys_list_shows_when_a_key_was_last_used(admin, stack):
    org_id, key_id, secret = org_with_key(admin, credits="1")
    (row,) = json.loads(admin("keys", "list", org_id, "--format", "json").text)
    assert row["last_used_at"] is None
    assert stack.post(CHAT_PATH, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}]}, secret).status_code == 200
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # written off the request path
        (row,) = json.loads(admin("keys", "list", org_id, "--format", "json").text)
        if row["last_used_at"]:
            break
        time.sleep(0.05)
    assert row["key_id"] == key_id and row["last_used_at"] >= row["created_at"]
    assert secret not in admin("keys", "list", org_id, "--format", "csv").text


def _deploy(stack, parameters: dict | None = None, values: dict | None = None):
    """A CloudFormation stack (in the emulator) whose outputs name the test stack's tables."""
    import botocore.session

    from kiln_ops.stack import OUTPUTS

    client = botocore.session.get_session().create_client(
        "cloudformation", region_name="us-east-1", endpoint_url=stack.settings.aws_endpoint_url
    )
    name = f"kiln-{secrets.token_hex(3)}"
    outputs = {output: {"Value": getattr(stack.settings, field)} for output, field in OUTPUTS.items()}
    outputs["Region"] = {"Value": "us-east-1"}
    template = {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Parameters": parameters or {},
        "Resources": {"Marker": {"Type": "AWS::SNS::Topic"}},
        "Outputs": outputs,
    }
    client.create_stack(StackName=name, TemplateBody=json.dumps(template),
                        Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in (values or {}).items()])
    return client, name


@pytest.fixture
def deployed_stack(stack):
    client, name = _deploy(stack)
    yield name
    client.delete_stack(StackName=name)


def test_stack_option_takes_the_usage_retention_the_stacks_functions_have(stack):
    """`kiln admin --stack` kept the usage events it writes (replay-usage) forever, while the
    stack's functions, by its UsageRetentionDays (400 by default), let theirs expire."""
    from kiln.settings import SettingsError
    from kiln_ops.stack import settings_from_stack

    elsewhere = replace(Settings(), aws_endpoint_url=stack.settings.aws_endpoint_url)
    retention = {"UsageRetentionDays": {"Type": "Number", "Default": 400}}
    for values, days in (({}, 400), ({"UsageRetentionDays": "30"}, 30), ({"UsageRetentionDays": "0"}, 0)):
        client, name = _deploy(stack, retention, values)
        try:
            assert settings_from_stack(name, elsewhere).usage_retention_days == days
        finally:
            client.delete_stack(StackName=name)
    # a value the functions could not read either (CloudFormation's Number takes 30.5): one line
    client, name = _deploy(stack, retention, {"UsageRetentionDays": "30.5"})
    try:
        with pytest.raises(SettingsError, match=f"stack '{name}': its parameter UsageRetentionDays: "
                                                "KILN_USAGE_RETENTION_DAYS must be an integer, got '30.5'"):
            settings_from_stack(name, elsewhere)
    finally:
        client.delete_stack(StackName=name)


def test_stack_option_reads_the_tables_from_the_stack_outputs(capsys, stack, deployed_stack):
    org_id = new_org_id()
    elsewhere = replace(Settings(), aws_endpoint_url=stack.settings.aws_endpoint_url)  # no table names at all
    created = _run_elsewhere(capsys, elsewhere, "--stack", deployed_stack, "orgs", "create", org_id)
    assert created.code == 0, created.err
    assert stack.org_info(org_id).org_id == org_id  # it landed in the stack's tables


def test_an_unknown_stack_fails_with_one_line(capsys, stack):
    elsewhere = replace(Settings(), aws_endpoint_url=stack.settings.aws_endpoint_url)
    result = _run_elsewhere(capsys, elsewhere, "--stack", "no-such-stack", "orgs", "list")
    assert_fails(result, "kiln admin: stack 'no-such-stack' not found in us-east-1")


# -- what an operator types by mistake: one line, exit 2, nothing changed ------------------------


@pytest.mark.parametrize("amount", ["١٠", "1_000", "٠.٥"])
def test_credits_are_ascii_digits_as_spend_limits_are(admin, amount):
    """Decimal() alone reads "1_000" as 1000 and digits of any script: an amount pasted from
    elsewhere is refused rather than read as something else."""
    org_id = new_org_id()
    created = admin("orgs", "create", org_id, "--credits", amount)
    assert created.code == 2 and "not an amount of USD" in created.err, created
    assert admin("orgs", "create", org_id, "--credits", "10").code == 0
    added = admin("credits", "add", org_id, amount)
    assert added.code == 2 and "not an amount of USD" in added.err, added
    assert "$10" in " ".join(admin("orgs", "show", org_id).lines)  # unchanged


@pytest.mark.parametrize("flag, value", [("--since", "0001-01-01T00:00:00+01:00"),
                                         ("--until", "9999-12-31T23:59:59-01:00")])
def test_a_time_with_no_date_in_utc_is_one_line_not_a_traceback(admin, flag, value):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    result = admin("usage", org_id, flag, value)
    assert result.code == 2 and "Traceback" not in result.err and value in result.err, result


def test_since_after_until_is_refused_not_an_empty_report(admin):
    org_id = new_org_id()
    assert admin("orgs", "create", org_id).code == 0
    result = admin("usage", org_id, "--since", "2026-12-01", "--until", "2026-11-01")
    assert result.code == 1 and "--since" in result.err and not result.lines, result


def test_csv_cells_a_spreadsheet_would_run_as_formulas_are_quoted_as_text(admin, stack):
    """Labels are the customer's (POST /v1/keys): a label that a spreadsheet reads as a formula
    (= + - @) is written with a leading ' so that it opens as the text it is. Numbers, negative
    ones included, are written as they are."""
    org_id, key_id, _ = org_with_key(admin, credits="10")
    label = '=HYPERLINK("http://example.invalid","x")'
    assert admin("keys", "update", key_id, "--label", label).code == 0
    listed = admin("keys", "list", org_id, "--format", "csv")
    assert listed.code == 0, listed.err
    rows = list(csv.DictReader(listed.lines))
    assert [row["label"] for row in rows] == ["'" + label]
    assert admin("keys", "list", org_id, "--format", "json").lines  # JSON is data, unchanged:
    assert json.loads("\n".join(admin("keys", "list", org_id, "--format", "json").lines))[0]["label"] == label


def test_an_org_limit_its_item_could_not_hold_leases_for_is_refused(admin, stack):
    """Each request in flight holds a lease on the org's item (DynamoDB: 400 KB at most); after a
    crash the expired leases stay beside new ones until reclaimed. A limit above 500 would let
    that item pass 400 KB on AWS, and every admission of the org fail."""
    org_id = new_org_id()
    refused = admin("orgs", "create", org_id, "--concurrency", "501")
    assert refused.code == 2 and "1-500" in refused.err, refused
    assert admin("orgs", "create", org_id, "--concurrency", "500").code == 0
    too_many = admin("orgs", "set-limit", org_id, "1000")
    assert too_many.code == 2 and "1-500" in too_many.err
    assert "500" in " ".join(admin("orgs", "show", org_id).lines)


@pytest.mark.parametrize("argv, option", [
    (["admin", "credits", "add", "org-x", "--", "--"], "usd"),
    (["admin", "keys", "create", "org-x", "--label=--"], "--label"),
])
def test_a_value_of_double_dash_is_a_usage_error(argv, option, capsys):
    """Python's argparse drops a `--` value and hands its type an empty list: the command ended
    in "AttributeError: 'list' object has no attribute 'is_finite'" (exit 1)."""
    from kiln_ops.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert f"argument {option}: '--' is not a value" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["admin", "replay-usage", "-"], "the events it settled stand; replaying the same lines again settles the others"),
    (["admin", "credits", "add", "org-x", "5"], "what it changed before it stopped stands"),
    (["admin", "orgs", "list"], "it changed nothing"),
])
def test_ctrl_c_is_one_line_saying_what_stands_never_a_traceback(argv, said, stack, capsys):
    """Ctrl-C during a long replay-usage printed a 40-line KeyboardInterrupt traceback and no
    word of what had been settled."""
    from kiln_ops.cli import build_parser

    args = build_parser().parse_args(argv)

    def interrupted(*_):
        raise KeyboardInterrupt

    args.run = interrupted
    assert run_admin(args, settings=stack.settings, out=lambda line: None) == 130
    err = capsys.readouterr().err
    assert err.startswith("kiln admin: interrupted; ") and said in err and "Traceback" not in err, err


def test_a_maintenance_message_in_korean_is_stored_and_shown_as_written(admin, stack):
    """The switch was written with every character escaped (`\\ud55c`: 6 bytes where UTF-8 takes
    3), so 680 Korean characters were over SSM's 4 KB, and the command echoed them escaped."""
    message = "서버 점검 중입니다. " * 100  # 1 200 characters, 3 000 bytes of UTF-8
    result = admin("maintenance", "on", "--message", message)
    assert result.code == 0, result.err
    assert message in result.lines[0]
    try:
        _, secret = stack.org()
        answered = stack.post("/v1/chat/completions", CHAT, secret)
        assert answered.status_code == 503 and answered.json()["error"]["message"] == message
    finally:
        assert admin("maintenance", "off").code == 0


def test_keys_list_of_an_org_id_no_org_can_have_is_not_found(admin):
    """`keys list ""` answered DynamoDB's ValidationException (an empty key in a query)."""
    for org_id in ("", "_x", "Acme"):
        assert_fails(admin("keys", "list", org_id), f"org {org_id!r} not found")


def test_a_usage_report_reaching_past_the_usage_retention_says_it_may_be_short(admin, stack, capsys):
    """With a usage retention, events expire (DynamoDB's TTL) while the org's credits and its keys'
    spend still count them: a report over all time, or from before the retention, summed what was
    left and said nothing, its total no longer what was debited. It says so now, on stderr."""
    org_id, _, secret = org_with_key(admin, credits="3")
    _traffic(stack, secret)

    def report(*since: str, retention_days: int = 30) -> tuple[list[str], str]:
        lines: list[str] = []
        capsys.readouterr()
        args = build_parser().parse_args(["admin", "usage", org_id, "--format", "json", *since])
        settings = replace(stack.settings, usage_retention_days=retention_days)
        assert run_admin(args, settings=settings, out=lines.append) == 0
        return lines, capsys.readouterr().err

    lines, err = report()  # all time, of an org made just now: nothing of it can have expired
    assert "may be missing" not in err
    assert json.loads("\n".join(lines))["total"]["requests"] == 9
    stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                               UpdateExpression="SET created_at = :long_ago",
                               ExpressionAttributeValues={":long_ago": {"S": "2020-01-01T00:00:00.000Z"}})
    lines, err = report()  # all time, of an org older than the retention
    assert "usage events expire 30 days after they are written" in err and "may be missing from this report" in err
    assert json.loads("\n".join(lines))["total"]["requests"] == 9  # stdout is the report alone
    _, err = report("--since", "2020-01-01")
    assert "may be missing" in err
    recent = stack.events(org_id)[0].created_at[:10]
    _, err = report("--since", recent)
    assert "may be missing" not in err  # within the retention: nothing has expired
    _, err = report(retention_days=0)  # no retention: events are kept
    assert "may be missing" not in err
