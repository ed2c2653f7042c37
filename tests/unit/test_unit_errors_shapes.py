"""kiln.errors: what a client reads in the messages the tree writes, and how an upstream's
error body is cut down to the contract's shape (contract §2, §5)."""

import json

import pytest

from kiln import errors as e


def parsed(error):
    return json.loads(error.body())


def test_the_message_is_the_exceptions_text_and_the_detail_stays_out_of_the_body():
    error = e.UpstreamFailed("All model servers failed.", detail="b1: connect timeout after 5.0 s")
    assert str(error) == "All model servers failed."  # what logs and tracebacks show
    assert error.detail == "b1: connect timeout after 5.0 s"  # for logs and usage events only
    assert b"connect timeout" not in error.body()
    maintenance = e.Maintenance("Back at 03:00 UTC.", "Tue, 01 Dec 2026 03:00:00 GMT")
    assert str(maintenance) == "Back at 03:00 UTC."
    assert parsed(maintenance)["error"]["message"] == "Back at 03:00 UTC."


@pytest.mark.parametrize(
    "gen_id, shown",
    [
        ("gen-01HZX", "gen-01HZX"),
        ("g" * 64, "g" * 64),
        ("g" * 65, "g" * 64 + "…"),
        ("x" * 10_000, "x" * 64 + "…"),
    ],
)
def test_generation_not_found_names_the_id_cut_to_64_characters(gen_id, shown):
    error = e.GenerationNotFound(gen_id)
    assert error.status == 404
    assert parsed(error)["error"] == {
        "message": f"No generation `{shown}` was found for your organization "
                   "(a request's generation is recorded when it ends).",  # one still running is not found yet
        "type": "invalid_request_error",
        "param": "id",
        "code": "generation_not_found",
    }


@pytest.mark.parametrize(
    "message, body",
    [
        ("All model servers failed.", b"All model servers failed.\n"),
        ("All model servers failed.\n\n", b"All model servers failed.\n"),
        ("No backend answered for model-X", b"No backend answered for model-X\n"),
        ("\nfirst line kept", b"\nfirst line kept\n"),
    ],
)
def test_upstream_failed_body_is_the_message_and_one_newline(message, body):
    assert e.UpstreamFailed(message).body() == body


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"x" * 5000, id="plain-text"),
        pytest.param(json.dumps({"error": "x" * 5000}).encode(), id="error-string"),
        pytest.param(json.dumps({"error": {"message": "x" * 5000}}).encode(), id="error-object"),
        pytest.param(json.dumps({"message": "x" * 5000}).encode(), id="vllm-object"),
    ],
)
def test_a_long_upstream_message_reaches_the_client_cut_to_2000_characters(raw):
    assert parsed(e.UpstreamRejected.from_upstream(400, raw))["error"]["message"] == "x" * 2000


def test_a_json_upstream_body_that_is_no_object_is_passed_on_as_text_cut_to_2000():
    raw = json.dumps(["x" * 5000]).encode()
    assert parsed(e.UpstreamRejected.from_upstream(400, raw))["error"]["message"] == raw.decode()[:2000]


def test_a_structured_upstream_detail_is_passed_on_as_its_json_text():
    # FastAPI-style validation errors: `detail` is a list of objects
    detail = [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer", "type": "int_parsing"}]
    body = parsed(e.UpstreamRejected.from_upstream(422, json.dumps({"detail": detail}).encode()))["error"]
    assert json.loads(body["message"]) == detail
    assert body["param"] is None and body["code"] is None


@pytest.mark.parametrize("param, code", [(3, 400), (["messages"], {"n": 1}), (None, None)])
def test_upstream_param_and_code_reach_the_client_only_as_strings(param, code):
    raw = json.dumps({"error": {"message": "bad", "param": param, "code": code}}).encode()
    body = parsed(e.UpstreamRejected.from_upstream(400, raw))["error"]
    assert body == {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
