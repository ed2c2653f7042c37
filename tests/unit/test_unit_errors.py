"""kiln.errors: the error shape, statuses and codes, upstream re-shaping (contract §2, §5)."""

import json
import re
from pathlib import Path

import pytest

from kiln import errors as e


def parsed(error):
    return json.loads(error.body())


@pytest.mark.parametrize(
    "cls, status, code",
    [
        (e.InvalidJson, 400, "invalid_json"),
        (e.RequestTooLarge, 413, "request_too_large"),
        (e.InvalidApiKey, 401, "invalid_api_key"),
        (e.OrganizationDisabled, 403, "organization_disabled"),
        (e.EmptyArray, 400, "empty_array"),
        (e.InvalidType, 400, "invalid_type"),
        (e.UnsupportedParameter, 400, "unsupported_parameter"),
        (e.MissingParameter, 400, "missing_required_parameter"),
        (e.InsufficientCredits, 402, "insufficient_credits"),
        (e.RateLimitExceeded, 429, "rate_limit_exceeded"),
        (e.NoBackendAvailable, 503, "no_backend_available"),
    ],
)
def test_contract_status_and_code(cls, status, code):
    error = cls("Something went wrong.")
    assert error.status == status
    assert error.media_type == "application/json"
    assert set(parsed(error)) == {"error"}
    body = parsed(error)["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["code"] == code and body["message"] == "Something went wrong."
    assert body["param"] is None
    assert isinstance(body["type"], str) and body["type"]


def test_param_is_reported_and_code_is_null_where_none():
    assert parsed(e.InvalidType("bad", param="stream"))["error"]["param"] == "stream"
    assert parsed(e.GatewayError("boom"))["error"] == {"message": "boom", "type": "server_error", "param": None, "code": None}


def test_no_backend_and_rate_limit_carry_no_headers():
    # contract: 503 no_backend_available has no Retry-After; a 429 carries no rate-limit headers
    assert e.NoBackendAvailable("none").headers == {}
    assert e.RateLimitExceeded("slow down").headers == {}


def test_model_not_found_body_is_exactly_the_contracts():
    error = e.ModelNotFound("gpt-9")
    assert error.status == 404
    assert parsed(error) == {
        "error": {
            "message": "The model `gpt-9` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_non_ascii_message_survives_as_utf8():
    assert parsed(e.InvalidJson("본문이 JSON이 아닙니다"))["error"]["message"] == "본문이 JSON이 아닙니다"


def test_maintenance_has_retry_after_header():
    error = e.Maintenance("down", "Tue, 01 Dec 2026 03:00:00 GMT")
    assert error.status == 503 and parsed(error)["error"]["code"] == "maintenance"
    assert error.headers == {"Retry-After": "Tue, 01 Dec 2026 03:00:00 GMT"}


def test_upstream_failed_is_short_plain_text():
    error = e.UpstreamFailed("All model servers failed.")
    assert error.status == 502
    assert error.media_type.startswith("text/plain")
    assert error.body() == b"All model servers failed.\n"
    with pytest.raises(ValueError):
        json.loads(error.body())


def test_reshapes_openai_style_error():
    raw = json.dumps(
        {"error": {"message": "context too long", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
    ).encode()
    error = e.UpstreamRejected.from_upstream(400, raw)
    assert error.status == 400
    assert parsed(error) == {
        "error": {"message": "context too long", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
    }


def test_reshapes_vllm_style_error():
    raw = b'{"object":"error","message":"max_tokens is too large","type":"BadRequestError","param":null,"code":400}'
    error = e.UpstreamRejected.from_upstream(400, raw)
    body = parsed(error)["error"]
    assert body["message"] == "max_tokens is too large"
    assert body["type"] == "invalid_request_error"
    assert body["param"] is None and body["code"] is None  # a numeric code is not an error code


def test_reshapes_plain_text_and_keeps_status():
    error = e.UpstreamRejected.from_upstream(404, b"  Not Found\n")
    assert error.status == 404
    assert parsed(error)["error"] == {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": None}


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"detail": "Method Not Allowed"}', "Method Not Allowed"),
        (b'{"error": "model is loading"}', "model is loading"),
        (b"bad \xff byte", "bad \ufffd byte"),
    ],
)
def test_reshapes_other_upstream_bodies(raw, message):
    assert parsed(e.UpstreamRejected.from_upstream(422, raw))["error"]["message"] == message


@pytest.mark.parametrize("raw", [b"", b"   ", b'{"error": {"message": ""}}'])
def test_empty_upstream_message_still_explains(raw):
    message = parsed(e.UpstreamRejected.from_upstream(413, raw))["error"]["message"]
    assert "413" in message


# -- the error table of docs/design.md is the tree's stable API ------------------------------


def _documented_errors() -> dict[str, tuple[int, str]]:
    """code → (status, type) for every row of the design notes' error table with one code and status."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    table = text[text.index("| status | code | type | when |"):].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        status, code, type_ = (cell.strip() for cell in line.strip("|").split("|")[:3])
        for one_status, one_code in zip(status.split(" / "), re.findall(r"`([a-z_]+)`", code), strict=False):
            if one_status.isdigit():
                rows[one_code] = (int(one_status), type_.strip("`"))
    return rows


def _tree() -> list[type]:
    found, pending = [], [e.GatewayError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return [cls for cls in found if cls.code is not None]


def test_every_error_of_the_tree_has_the_status_and_type_of_the_documented_table():
    documented = _documented_errors()
    assert len(documented) >= 17  # the table was read
    tree = {cls.code: cls for cls in _tree()}
    for code, cls in tree.items():
        if code == "upstream_unavailable":
            continue  # the 502 is plain text: no code reaches the client
        assert code in documented, f"{cls.__name__} ({code}) is not in docs/design.md's error table"
        assert (cls.status, cls.type) == documented[code], cls.__name__
        error = cls("x", retry_after="60") if cls is e.Maintenance else cls("x")
        assert parsed(error)["error"]["type"] == documented[code][1]
    # and every documented code the gateway makes itself has its class
    # but upstream_error, an SSE event written by kiln.sse, and what API Gateway answers itself
    # (template.yaml's gateway responses)
    template = (Path(__file__).resolve().parents[2] / "template.yaml").read_text()
    api_gateways = set(re.findall(r'"code":"([a-z_]+)"', template))
    assert {"function_unavailable", "gateway_timeout"} <= api_gateways
    assert set(documented) - set(tree) <= {"upstream_error"} | api_gateways
