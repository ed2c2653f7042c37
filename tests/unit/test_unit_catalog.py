"""kiln.catalog: parsing infra/catalog.json, loud CatalogErrors, the public model object."""

import copy
import json
from decimal import Decimal
from pathlib import Path

import pytest

from kiln.catalog import Catalog, CatalogError

CATALOG_FILE = Path(__file__).resolve().parents[2] / "infra" / "catalog.json"

MODEL = {
    "id": "m",
    "owned_by": "acme",
    "created": 1700000000,
    "context_length": 8192,
    "pricing": {"input": "1.5", "output": "3"},
    "backends": [
        {"name": "a", "url": "http://a.internal/v1/", "model": "m-upstream", "api_key_env": "M_KEY"},
        {"name": "b", "url": "https://b.internal/v1", "enabled": False},
        {"name": "c", "url": "http://c.internal/v1"},
    ],
}


def one(**changes):
    entry = copy.deepcopy(MODEL)
    entry.update(changes)
    return {"models": [entry]}


@pytest.mark.parametrize("value, key", [("sk-up\n", "sk-up"), ("  sk-up\r\n", "sk-up"), ("\n", None), (None, None)])
def test_a_backends_key_is_read_without_the_blanks_around_it(monkeypatch, value, key):
    """A key written to its variable from a file keeps the file's newline: sent, it ended the
    Authorization line and began another; the HTTP client now refuses such a header, which
    would make every request to the backend fail."""
    if value is None:
        monkeypatch.delenv("M_KEY", raising=False)
    else:
        monkeypatch.setenv("M_KEY", value)
    assert Catalog.from_json(json.dumps(one()).encode()).get("m").backends[0].api_key() == key


def test_repository_catalog_parses():
    catalog = Catalog.from_json(CATALOG_FILE.read_bytes())
    assert [model.id for model in catalog] == ["qwen3-32b", "gpt-oss-120b"]
    oss = catalog.get("gpt-oss-120b")
    assert (oss.pricing.input, oss.pricing.output, oss.pricing.cached_input) == (
        Decimal("0.035"), Decimal("0.07"), Decimal("0.0175"),
    )
    assert oss.capabilities.ignore_eos is False and oss.capabilities.forced_tool_choice is True
    assert oss.context_length == 131072
    assert oss.backends[0].upstream_model == "gpt-oss-120b"
    assert catalog.get("qwen3-32b").capabilities.forced_tool_choice is False


def test_public_object_has_per_token_prices_and_no_backends():
    catalog = Catalog.from_json(CATALOG_FILE.read_text())
    public = catalog.get("gpt-oss-120b").public()
    assert public["id"] == "gpt-oss-120b" and public["object"] == "model"
    assert public["owned_by"] == "openai" and public["created"] == 1754352000
    assert public["pricing"] == {"prompt": "0.000000035", "completion": "0.00000007", "cached": "0.0000000175"}
    text = json.dumps(public)
    assert "127.0.0.1" not in text and "backends" not in text and "url" not in text


def test_price_without_cached_input_has_no_cached_key():
    public = Catalog.from_document(one()).get("m").public()
    assert public["pricing"] == {"prompt": "0.0000015", "completion": "0.000003"}


def test_backends_parsed_and_disabled_ones_skipped(monkeypatch):
    model = Catalog.from_document(one()).get("m")
    assert [b.name for b in model.backends] == ["a", "b", "c"]
    assert [b.name for b in model.available_backends()] == ["a", "c"]
    assert model.backends[0].url == "http://a.internal/v1"  # trailing slash dropped
    monkeypatch.setenv("M_KEY", "sk-upstream")
    assert model.backends[0].api_key() == "sk-upstream"
    assert model.backends[2].api_key() is None


def test_with_backend_url_points_every_model_at_one_server():
    catalog = Catalog.from_json(CATALOG_FILE.read_bytes())
    local = catalog.with_backend_url("http://127.0.0.1:9999/v1")
    assert len(local) == len(catalog)
    for model in local:
        assert [b.url for b in model.available_backends()] == ["http://127.0.0.1:9999/v1"]
        assert model.pricing == catalog.get(model.id).pricing
        assert model.capabilities == catalog.get(model.id).capabilities
    assert catalog.get("qwen3-32b").backends[0].url == "http://127.0.0.1:8001/v1"  # original untouched


def test_unknown_model_and_defaults():
    catalog = Catalog.from_document({"models": [{"id": "x", "context_length": 1, "pricing": {"input": 0, "output": "0"}}]})
    assert catalog.get("nope") is None
    model = catalog.get("x")
    assert model.backends == () and model.available_backends() == ()
    assert model.pricing.input == 0


@pytest.mark.parametrize(
    "document, message",
    [
        ('{"models": [', "not valid JSON"),
        ("[]", '"models" array'),
        ('{"models": {}}', '"models" array'),
        ('{"models": ["m"]}', r"models\[0\] must be an object"),
        ('{"models": [{"context_length": 1, "pricing": {}}]}', "'id' is required"),
    ],
)
def test_bad_document_raises_catalog_error(document, message):
    with pytest.raises(CatalogError, match=message):
        Catalog.from_json(document)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"pricing": "cheap"}, "'pricing' is required"),
        ({"pricing": {"input": 0.035, "output": "3"}}, "pricing.input"),  # floats never touch money
        ({"pricing": {"input": "1", "output": "-1"}}, "pricing.output"),
        ({"pricing": {"input": "NaN", "output": "1"}}, "pricing.input"),
        ({"pricing": {"input": "Infinity", "output": "1"}}, "pricing.input"),
        ({"pricing": {"input": "free", "output": "1"}}, "pricing.input"),
        ({"pricing": {"input": True, "output": "1"}}, "pricing.input"),
        ({"pricing": {"input": "1", "output": "1", "cached_input": None}}, "pricing.cached_input"),
        ({"pricing": {"input": "1"}}, "pricing.output"),
        ({"context_length": True}, "'context_length' is required"),
        ({"context_length": "8192"}, "'context_length' is required"),
        ({"capabilities": ["json"]}, "capabilities, timeouts and limits must be objects"),
        ({"limits": {"header_bytes": 0}}, "limits.header_bytes"),
        ({"limits": {"body_bytes": 1.5}}, "limits.body_bytes"),
        ({"limits": {"event_bytes": "1MiB"}}, "limits.event_bytes"),
        ({"limits": [1]}, "limits must be objects"),
        ({"backends": {"url": "http://x"}}, "backends an array"),
        ({"backends": ["http://x"]}, r"backends\[0\] must be an object"),
        ({"backends": [{"name": "n"}]}, "'url' is required"),
        ({"backends": [{"url": "ftp://x"}]}, "http:// or https://"),
        # what no request can be billed or sent for, refused where it is written (kiln admin
        # catalog set) and where it is read (an SSM value written by other means)
        ({"pricing": {"input": "1e200", "output": "1"}}, "pricing.input"),
        ({"pricing": {"input": "1", "output": "1e-200"}}, "pricing.output"),
        ({"pricing": {"input": "1", "output": "1", "cached_input": "2e6"}}, "pricing.cached_input"),
        # digits finer than a billionth of a dollar per 1M tokens: credits minus such a cost
        # needs more digits than a DynamoDB number holds, so the debit could not be the cost
        ({"context_length": -5}, "context_length"),
        ({"context_length": 0}, "context_length"),
        ({"context_length": 10**12}, "context_length"),
        ({"timeouts": {"total": 0}}, "timeouts.total"),
        ({"timeouts": {"connect": 0}}, "timeouts.connect"),
        ({"timeouts": {"idle": 1e300 * 1e300}}, "timeouts.idle"),
        ({"backends": [{"url": "http://[::1/v1"}]}, "url"),
        ({"backends": [{"url": "http:///v1"}]}, "url"),
        ({"backends": [{"url": "http://x:99999/v1"}]}, "url"),
        ({"backends": [{"url": "http://x/v1", "api_key_env": ["KILN_X"]}]}, "api_key_env"),
    ],
)
def test_bad_model_raises_catalog_error_naming_the_field(changes, message):
    for written in (False, True):
        with pytest.raises(CatalogError, match=message) as info:
            Catalog.from_document(one(**changes), written=written)
        assert "'m'" in str(info.value)  # names the model


# What kiln admin refuses in a catalog it writes (the docs' rules: a misspelt field would be a
# silent default), and the gateway serves in a stored one as it always read it, so that a
# newer gateway never stops serving a catalog an older writer made.
WRITTEN_ONLY = [
    ({"timeout": {"total": 30}}, "'timeout'", lambda m: m.timeouts.total == 600.0),
    ({"pricing": {"input": "1.5", "output": "3", "cached_imput": "0.1"}}, "'cached_imput'",
     lambda m: m.pricing.cached_input is None),
    ({"capabilities": {"vision": True}}, "'vision'", lambda m: m.capabilities == type(m.capabilities)()),
    ({"timeouts": {"forever": 1}}, "'forever'", lambda m: m.timeouts.total == 600.0),
    ({"limits": {"everything": 1}}, "'everything'", lambda m: m.limits == type(m.limits)()),
    ({"timeouts": {"total": 3600}}, "timeouts.total", lambda m: m.timeouts.total == 3600.0),
    # the function's own timeout, with no room left to settle: killed before its usage is written
    ({"timeouts": {"total": 900}}, "at most 870 seconds", lambda m: m.timeouts.total == 900.0),
    ({"timeouts": {"idle": 871}}, "timeouts.idle", lambda m: m.timeouts.idle == 871.0),
    ({"owned_by": 5}, "owned_by", lambda m: m.owned_by == "5"),
    # a Unix time, whole, that any client reads exactly (10^30 was served as 31 digits)
    ({"created": 1.5}, "created must be a whole Unix time", lambda m: m.created == 1),
    ({"created": 10**30}, "created must be a whole Unix time", lambda m: m.created == 0),
    # digits finer than a billionth of a dollar per 1M tokens: credits minus such a cost needs
    # more digits than a DynamoDB number holds, so the debit could not be the cost; a catalog
    # stored by other means is served with its prices rounded to 9 places (served as it was,
    # an org's credits drifted from the sum of its costs)
    ({"pricing": {"input": "0.123456789012345678901234567890123456789", "output": "1"}}, "decimal places",
     lambda m: str(m.pricing.input) == "0.123456789"),
    ({"pricing": {"input": "1", "output": "0.0000000015"}}, "pricing.output must have at most 9",
     lambda m: str(m.pricing.output) == "2E-9"),
    ({"pricing": {"input": "0.0350000000000000000000000000001", "output": "1"}}, "decimal places",  # past 28 digits
     lambda m: m.pricing.input == Decimal("0.035")),
    # a price is written in ASCII digits, unsigned, as kiln admin's amounts are
    ({"pricing": {"input": "1_000", "output": "1"}}, "ASCII digits", lambda m: m.pricing.input == 1000),
    ({"pricing": {"input": "\u0661\u0662", "output": "1"}}, "ASCII digits", lambda m: m.pricing.input == 12),
    ({"pricing": {"input": " 5 ", "output": "1"}}, "ASCII digits", lambda m: m.pricing.input == 5),
    ({"pricing": {"input": "-0", "output": "1"}}, "ASCII digits",
     lambda m: m.pricing.input == 0 and not m.pricing.input.is_signed()),
    # a name shown in kiln admin's tables and CSV holds nothing that passes for other text there
    ({"owned_by": "\x1b[31macme"}, "owned_by", lambda m: m.owned_by == "\x1b[31macme"),
    ({"owned_by": ""}, "owned_by", lambda m: m.owned_by == "kiln"),
    ({"backends": [{"url": "http://x/v1", "name": "a\nTOTAL  999"}]}, "name",
     lambda m: m.backends[0].name == "a\nTOTAL  999"),
    ({"backends": [{"url": "http://x/v1", "model": "m\u2028=1+2"}]}, "model",
     lambda m: m.backends[0].upstream_model == "m\u2028=1+2"),
    ({"backends": [{"url": "http://x/v1", "enable": False}]}, "'enable'", lambda m: m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": "false"}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": 0}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": None}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "model": 123}]}, "model", lambda m: m.backends[0].upstream_model == "123"),
    ({"backends": [{"url": "http://x/v1", "name": {"a": 1}}]}, "name", lambda m: m.backends[0].name == "{'a': 1}"),
    ({"backends": [{"url": "http://x/v1", "enabled": "off"}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": "Disabled"}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": "0.0"}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": "perhaps"}]}, "enabled", lambda m: m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "enabled": []}]}, "enabled", lambda m: not m.backends[0].enabled),
    ({"backends": [{"url": "http://x/v1", "api_key_env": "NOT A NAME"}]}, "api_key_env",
     lambda m: m.backends[0].api_key_env == "NOT A NAME"),
    # a path outside ASCII is called as a browser calls it, escaped; a host outside it is left
    # as written (not guessed at: the HTTP client fails it as a connection it cannot make)
    ({"backends": [{"url": "http://x/v1 beta"}]}, "url", lambda m: m.backends[0].url == "http://x/v1%20beta"),
    ({"backends": [{"url": "http://h:8000/モデル"}]}, "url",
     lambda m: m.backends[0].url == "http://h:8000/%E3%83%A2%E3%83%87%E3%83%AB"),
    ({"backends": [{"url": "http://gpü.internal/v1"}]}, "url", lambda m: m.backends[0].url == "http://gpü.internal/v1"),
    ({"backends": [{"url": "http://x/v1\x7fbeta"}]}, "url", lambda m: m.backends[0].url == "http://x/v1%7Fbeta"),
    ({"backends": [{"url": "http://a..b.example.com/v1"}]}, "url", lambda m: m.backends[0].url == "http://a..b.example.com/v1"),
    ({"backends": [{"url": "http://user:pass@x/v1"}]}, "user info", lambda m: m.backends[0].url == "http://x/v1"),  # the password, never sent, dropped
    ({"backends": [{"url": "http://x/v1?key=1"}]}, "url", lambda m: m.backends[0].url == "http://x/v1?key=1"),
]


@pytest.mark.parametrize("changes, message, read_as", WRITTEN_ONLY)
def test_what_kiln_admin_refuses_the_gateway_still_serves_as_it_always_read_it(changes, message, read_as):
    with pytest.raises(CatalogError, match=message):
        Catalog.from_document(one(**changes), written=True)
    assert read_as(Catalog.from_document(one(**changes)).get("m"))


@pytest.mark.parametrize("model_id", ["none", "a,b", "qwen3-32b ", " m"])
def test_an_id_kiln_admins_models_flag_could_not_name_is_refused_where_written(model_id):
    """`--models` takes ids comma-separated, blanks around them dropped, and "none" for every
    model: an id "none" made a key for every model, "qwen3-32b " one for "qwen3-32b"."""
    with pytest.raises(CatalogError, match="--models could not name it"):
        Catalog.from_document(one(id=model_id), written=True)
    assert Catalog.from_document(one(id=model_id)).get(model_id).id == model_id


def test_a_document_field_the_catalog_does_not_know_is_refused_only_where_written():
    document = {**one(), "defaults": {}}
    with pytest.raises(CatalogError, match="'defaults'"):
        Catalog.from_document(document, written=True)
    assert len(Catalog.from_document(document)) == 1


def test_duplicate_model_id_rejected():
    document = one()
    document["models"].append(copy.deepcopy(document["models"][0]))
    with pytest.raises(CatalogError, match="twice"):
        Catalog.from_document(document)


# Regression: at dff3098, capabilities went through bool(), so "false" granted the capability.
def test_capability_written_as_string_false_does_not_grant_it():
    try:
        model = Catalog.from_document(one(capabilities={"forced_tool_choice": "false"})).get("m")
    except CatalogError:
        return  # rejecting the document is fine too
    assert model.capabilities.forced_tool_choice is False


# Regression: at dff3098, int()/float() on 'created' and 'timeouts' raised bare ValueErrors
# that were not CatalogErrors and did not name the field.
@pytest.mark.parametrize("changes", [{"created": "yesterday"}, {"timeouts": {"idle": "long"}}])
def test_non_numeric_created_or_timeout_raises_catalog_error(changes):
    with pytest.raises(CatalogError, match="created|idle"):
        Catalog.from_document(one(**changes))


def test_bounds_on_an_upstream_answer_have_defaults_and_each_model_may_set_its_own():
    default = Catalog.from_document(one()).get("m")
    assert (default.limits.header_bytes, default.limits.body_bytes, default.limits.event_bytes) == (
        64 * 1024, 16 * 1024 * 1024, 1024 * 1024,
    )
    own = Catalog.from_document(one(limits={"event_bytes": 4096})).get("m")
    assert own.limits.event_bytes == 4096 and own.limits.body_bytes == 16 * 1024 * 1024


def test_the_repository_catalogs_timeouts_fit_in_the_function_timeout():
    # docs/operations.md: the whole request (failover included) ends within `total`, which
    # leaves the 900 s function time for the settle
    for model in Catalog.from_json(CATALOG_FILE.read_bytes()):
        timeouts = model.timeouts
        assert timeouts.connect < timeouts.first_byte < timeouts.total < 900
        assert timeouts.idle < timeouts.total


def test_every_bill_the_catalog_allows_is_a_number_dynamodb_stores():
    """Contract §4: a bill is always a finite number DynamoDB can store. Prices and context
    lengths are bounded where the catalog is read, so the dearest and the cheapest requests
    the usage bounds allow are both stored as billed."""
    from kiln.metering import MAX_CHOICES, TokenUsage, cost_of
    from kiln.store.codec import storage_problem

    dearest = Catalog.from_document(one(context_length=1_000_000_000, pricing={
        "input": "1000000", "output": "1000000"})).get("m")
    cheapest = Catalog.from_document(one(context_length=1, pricing={"input": "0.000000001", "output": "0"})).get("m")
    prompts = 6 * 1024 * 1024  # more prompts than a body within the size limit can hold
    most = dearest.context_length * MAX_CHOICES * prompts
    for usage, model in ((TokenUsage(most, most, None, "capped"), dearest), (TokenUsage(1, 0, None, "upstream"), cheapest)):
        cost = cost_of(usage, model.pricing)
        assert cost > 0 and storage_problem(cost) is None, cost


def test_a_balance_debited_the_dearest_bills_of_every_request_in_flight_stays_exact():
    """Admission needs credits above 0, and the requests in flight then settle whatever they
    cost. The bounds let a request's bill reach $2E21 (a billion-token context × a million
    choices × the prompts of a 6 MB batch, at $1 a token): 500 of them took a balance past 23
    digits before the point, where a cost's 15 decimals no longer fit DynamoDB's 38 digits and
    the debit was rounded (or refused). A request's tokens are bounded too, and the worst balance
    the bounds allow is still a number DynamoDB computes exactly."""
    from kiln.metering import MAX_CHOICES, MAX_REQUEST_TOKENS, UsageBounds, cost_of
    from kiln.settings import MAX_ORG_CONCURRENCY
    from kiln.store.codec import significant_digits, storage_problem
    from kiln.store.orgs import CREDIT_DECIMALS

    dearest = Catalog.from_document(one(context_length=1_000_000_000, pricing={
        "input": "1000000", "output": "1000000", "cached_input": "1000000"})).get("m")
    bounds = UsageBounds.of_request({"n": MAX_CHOICES, "max_tokens": 10**30}, dearest.context_length,
                                    limits=("max_tokens",), prompts=6 * 1024 * 1024)
    assert (bounds.prompt, bounds.completion) == (MAX_REQUEST_TOKENS, MAX_REQUEST_TOKENS)
    from kiln.metering import TokenUsage

    dearest_bill = cost_of(TokenUsage(bounds.prompt, bounds.completion, None, "capped"), dearest.pricing)
    assert dearest_bill == 2 * MAX_REQUEST_TOKENS
    finest = Decimal(1).scaleb(-CREDIT_DECIMALS)  # a balance and a bill both carry up to 15 decimals
    worst = finest - MAX_ORG_CONCURRENCY * (dearest_bill - finest)
    assert storage_problem(worst) is None and significant_digits(worst) <= 38, worst
    assert significant_digits(worst - finest) <= 38  # one more debit of the finest cost, still exact


def test_a_name_given_twice_in_an_object_is_refused_only_where_written():
    raw = json.dumps(one()).replace('"input": "1.5"', '"input": "0.01", "input": "1.5"')
    with pytest.raises(CatalogError, match="'input' twice"):
        Catalog.from_json(raw, written=True)
    assert Catalog.from_json(raw).get("m").pricing.input == Decimal("1.5")


def test_a_price_written_with_trailing_zeros_is_its_value():
    catalog = Catalog.from_document(one(pricing={"input": "0.035000000000000", "output": "1e-9"}), written=True)
    assert catalog.get("m").pricing.input == Decimal("0.035")


@pytest.mark.parametrize("model_id", ["gpt\u2028=1+2", "\x1b[31mred", "", "  ", "a\u202eb"])
def test_a_model_id_that_would_pass_for_other_text_is_refused_where_written(model_id):
    """An id is shown in kiln admin's tables and CSV (usage by model, backends): a newline, an
    escape sequence or a line separator there once made rows of its own."""
    with pytest.raises(CatalogError, match="'id'"):
        Catalog.from_document(one(id=model_id), written=True)
    assert Catalog.from_document(one(id=model_id)).get(model_id).id == model_id  # a stored one is served


def test_two_backends_of_one_model_never_share_a_name():
    """Two backends of one name shared one health record and one metric dimension: one failing
    took both out of service, and their requests were counted as one backend's. A written
    catalog is refused; a stored one has the later renamed, and both are served apart."""
    backends = [{"name": "a", "url": "http://one:8000/v1"}, {"name": "a", "url": "http://two:8000/v1"},
                {"url": "http://three:8000/v1"}, {"name": "backend-2", "url": "http://four:8000/v1"}]
    with pytest.raises(CatalogError, match=r"backends\[1\]: the name 'a' is another backend's"):
        Catalog.from_document(one(backends=backends), written=True)
    served = Catalog.from_document(one(backends=backends)).get("m").backends
    names = [backend.name for backend in served]
    assert names == ["a", "a#1", "backend-2", "backend-2#3"]
    assert [backend.url for backend in served] == [b["url"] for b in backends]


def test_a_model_id_longer_than_its_leases_can_hold_is_refused_where_written():
    """Each request in flight holds its model's id on its org's one item (400 KB at most in
    DynamoDB): an id of 8 000 characters filled it at 47 requests, the 48th refused 503."""
    from kiln.catalog import MAX_MODEL_ID_BYTES

    longest = "m" * MAX_MODEL_ID_BYTES
    assert Catalog.from_document(one(id=longest), written=True).get(longest).id == longest
    for too_long in ("m" * (MAX_MODEL_ID_BYTES + 1), "é" * (MAX_MODEL_ID_BYTES // 2 + 1)):
        with pytest.raises(CatalogError, match=f"'id' must be at most {MAX_MODEL_ID_BYTES} bytes"):
            Catalog.from_document(one(id=too_long), written=True)


@pytest.mark.parametrize("written", [False, True])
def test_a_refused_backend_url_is_named_without_its_password(written):
    """A stored URL with user info and a port out of range: the error, logged as the catalog's
    being unreadable, held the password."""
    for url in ("http://user:s3cretpw@x:99999/v1", "http://user:s3cretpw@/v1", "http://admin:s3cretpw#x@host:8000/v1",
                "http://admin:s3c/retpw@host/v1", "http://admin:s3cretpw?@host/v1", "http://s3cretpw@host:bad/v1"):
        with pytest.raises(CatalogError) as refused:
            Catalog.from_document(one(backends=[{"url": url}]), written=written)
        assert "s3cretpw" not in str(refused.value) and "s3c/retpw" not in str(refused.value), str(refused.value)
        assert "url 'http://" in str(refused.value)
