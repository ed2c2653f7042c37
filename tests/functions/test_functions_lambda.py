"""The function apps as Lambda runs them: Mangum handlers (buffered mode) fed real API Gateway
REST and Function URL events, and the Web Adapter's run script (streaming mode)."""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kiln.web import openapi_path
from kiln_ops.serve import free_port
from kiln_ops.template import repo_root
from support import LAMBDA_CONTEXT as CONTEXT
from support import data_events

EVENTS = Path(__file__).resolve().parents[1] / "events"


@pytest.fixture
def lambda_env(stack, monkeypatch):
    """The function's environment pointed at the test stack; a fresh gateway per test."""
    for name, value in stack.settings.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POWERTOOLS_METRICS_DISABLED", "true")
    org_id, key = stack.org()
    yield SimpleNamespace(stack=stack, org_id=org_id, key=key)
    for module in ("chat_completions", "completions", "models", "generations"):
        app = importlib.import_module(f"kiln_functions.{module}.app").app
        app.state._state.pop("gateway", None)


def invoke(module: str, event_file: str, key: str) -> dict:
    event = json.loads((EVENTS / event_file).read_text().replace("${KILN_API_KEY}", key))
    handler = importlib.import_module(f"kiln_functions.{module}.app").handler
    return handler(event, CONTEXT)


def body_of(response: dict) -> str:
    raw = response["body"]
    return base64.b64decode(raw).decode() if response.get("isBase64Encoded") else raw


def header(response: dict, name: str) -> str | None:
    headers = {k.lower(): v for k, v in (response.get("headers") or {}).items()}
    for k, values in (response.get("multiValueHeaders") or {}).items():
        headers.setdefault(k.lower(), values[0])
    return headers.get(name.lower())


def test_rest_event_buffered_chat_completion(lambda_env, capsys):
    response = invoke("chat_completions", "rest-chat-completions.json", lambda_env.key)
    assert response["statusCode"] == 200
    answer = json.loads(body_of(response))
    assert answer["usage"]["total_tokens"] == 21 and '"cost":0.000001155' in body_of(response)
    gen_id = header(response, "x-neocloud-generation-id")
    assert gen_id and gen_id in {e.gen_id for e in lambda_env.stack.events(lambda_env.org_id)}
    assert lambda_env.key not in capsys.readouterr().out  # the request log holds no key


def test_rest_event_stream_request_is_answered_whole_in_buffered_mode(lambda_env):
    response = invoke("chat_completions", "rest-chat-completions-stream.json", lambda_env.key)
    assert response["statusCode"] == 200
    assert header(response, "content-type").startswith("text/event-stream")
    text = body_of(response)
    assert text.endswith("data: [DONE]\n\n") and text.count("data: [DONE]") == 1
    assert '"cost":0.000001155' in text


def test_rest_event_with_a_base64_body_completion(lambda_env):
    response = invoke("completions", "rest-completions.json", lambda_env.key)
    assert response["statusCode"] == 200
    assert json.loads(body_of(response))["choices"][0]["text"] == " Paris, a city on the Seine."


def test_rest_events_for_the_models(lambda_env):
    listing = invoke("models", "rest-models.json", lambda_env.key)
    assert listing["statusCode"] == 200
    assert {"qwen3-32b", "gpt-oss-120b"} <= {m["id"] for m in json.loads(body_of(listing))["data"]}
    one = invoke("models", "rest-model.json", lambda_env.key)
    assert one["statusCode"] == 200 and json.loads(body_of(one))["id"] == "qwen3-32b"


def test_function_url_events(lambda_env):
    chat = invoke("chat_completions", "url-chat-completions.json", lambda_env.key)
    assert chat["statusCode"] == 200 and json.loads(body_of(chat))["usage"]["completion_tokens"] == 12
    completion = invoke("completions", "url-completions.json", lambda_env.key)
    assert completion["statusCode"] == 200
    models = invoke("models", "url-models.json", lambda_env.key)
    assert models["statusCode"] == 200


@pytest.mark.parametrize("field", ["multiValueHeaders", "headers", "beside an odd header"])
def test_a_rest_event_with_two_keys_under_names_of_two_cases_is_no_key_at_all(lambda_env, field):
    """`Authorization` and `authorization` in one REST event: Mangum, lowering the names, kept
    the last, and served it billed to the second key's org; the local server answers such a
    request 401 (two keys are no key), as it should."""
    other_org, other_key = lambda_env.stack.org()
    event = json.loads((EVENTS / "rest-chat-completions.json").read_text().replace("${KILN_API_KEY}", lambda_env.key))
    event["multiValueHeaders"]["authorization"] = [f"Bearer {other_key}"]
    if field == "headers":
        event.pop("multiValueHeaders")
        event["headers"]["authorization"] = f"Bearer {other_key}"
    if field == "beside an odd header":  # a value Mangum reads as "" rather than refuse
        event["multiValueHeaders"]["X-Note"] = None
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert response["statusCode"] == 401, body_of(response)
    assert json.loads(body_of(response))["error"]["code"] == "invalid_api_key"
    assert lambda_env.stack.events(lambda_env.org_id) == [] and lambda_env.stack.events(other_org) == []


SIGNED = ("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261130/us-east-1/lambda/aws4_request, "
          "SignedHeaders=host;x-amz-date, Signature=" + "0" * 64)


@pytest.mark.parametrize("kind", ["rest names of two cases", "function url joined"])
def test_a_signature_joined_with_a_key_is_no_signature_and_the_key_beside_it_is_not_read(lambda_env, kind):
    """A signature and a client's own Authorization joined into one value (a Function URL joins
    a header given twice; a REST event's two names are merged) read as a signature, and the key
    in X-Kiln-Authorization was served: a client's own Authorization always stands."""
    other_org, other_key = lambda_env.stack.org()
    if kind == "rest names of two cases":
        event = json.loads((EVENTS / "rest-chat-completions.json").read_text().replace("${KILN_API_KEY}", lambda_env.key))
        event["multiValueHeaders"]["Authorization"] = [SIGNED]
        event["multiValueHeaders"]["authorization"] = [f"Bearer {lambda_env.key}"]
        event["multiValueHeaders"]["X-Kiln-Authorization"] = [f"Bearer {other_key}"]
    else:
        event = json.loads((EVENTS / "url-chat-completions.json").read_text())
        event["headers"]["authorization"] = f"{SIGNED},Bearer {lambda_env.key}"
        event["headers"]["x-kiln-authorization"] = f"Bearer {other_key}"
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert response["statusCode"] == 401, body_of(response)
    assert lambda_env.stack.events(other_org) == [] and lambda_env.stack.events(lambda_env.org_id) == []


@pytest.mark.parametrize("name,value", [("x-forwarded-port", "443"), ("host", "k1ln9x7q2a.execute-api.us-east-1.amazonaws.com:443"),
                                        ("content-type", "application/json")])
def test_another_header_named_in_two_cases_is_left_to_mangum_as_before(lambda_env, name, value):
    """Only the key's headers are merged: two ports or hosts merged would be none (a 400)."""
    event = json.loads((EVENTS / "rest-chat-completions.json").read_text().replace("${KILN_API_KEY}", lambda_env.key))
    event["multiValueHeaders"][name], event["headers"][name] = [value], value
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    assert handler(event, CONTEXT)["statusCode"] == 200


def test_a_key_header_of_no_header_type_beside_another_of_its_names_is_no_request(lambda_env):
    event = json.loads((EVENTS / "rest-chat-completions.json").read_text().replace("${KILN_API_KEY}", lambda_env.key))
    event["multiValueHeaders"]["authorization"] = None
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert response["statusCode"] == 400 and json.loads(body_of(response))["error"]["code"] == "invalid_event"
    assert lambda_env.stack.events(lambda_env.org_id) == []


def test_a_function_url_event_signed_for_iam_auth_carries_the_key_beside_the_signature(lambda_env, capsys):
    """`FunctionUrls=iam`: Lambda passes the caller's SigV4 Authorization header on; the key
    comes in X-Kiln-Authorization (deploy.md §2). Every such request was a 401."""
    event = json.loads((EVENTS / "url-chat-completions.json").read_text())
    event["headers"]["authorization"] = ("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261130/us-east-1/lambda/aws4_request, "
                                         "SignedHeaders=host;x-amz-date, Signature=" + "0" * 64)
    event["headers"]["x-kiln-authorization"] = f"Bearer {lambda_env.key}"
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert response["statusCode"] == 200 and json.loads(body_of(response))["usage"]["completion_tokens"] == 12
    assert lambda_env.key not in capsys.readouterr().out


def test_rest_events_for_the_self_service_routes(lambda_env):
    """A query string and a POST body reach the generations function's self-service through Mangum."""
    from kiln.store.keys import create_key

    stack = lambda_env.stack
    invoke("chat_completions", "rest-chat-completions.json", lambda_env.key)
    usage = invoke("generations", "rest-usage.json", lambda_env.key)
    assert usage["statusCode"] == 200, body_of(usage)
    report = json.loads(body_of(usage))
    assert (report["object"], report["group_by"], report["since"]) == ("usage", "model", "2026-11-01T00:00:00.000Z")
    in_span = [e for e in stack.events(lambda_env.org_id) if report["since"] <= e.created_at < report["until"]]
    assert report["total"]["requests"] == len(in_span)

    refused = invoke("generations", "rest-keys-create.json", lambda_env.key)  # an inference key
    assert refused["statusCode"] == 403
    assert json.loads(body_of(refused))["error"]["code"] == "management_key_required"
    admin = create_key(stack.tables, lambda_env.org_id, role="management").secret
    created = invoke("generations", "rest-keys-create.json", admin)
    assert created["statusCode"] == 201, body_of(created)
    key = json.loads(body_of(created))
    assert (key["label"], key["spend_limit"], key["spend_period"]) == ("from a REST event", 5, "day")
    assert stack.post("/v1/chat/completions", {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}]},
                      key["secret"]).status_code == 200


def test_a_read_is_answered_before_the_invocation_runs_out_of_time(lambda_env, monkeypatch):
    """The generations function on a DynamoDB answering slowly, invoked with 3.4 s left (its
    timeout is 29 s; a warm environment's invocation may be given less): it answers 503
    `storage_unavailable` 3 s before Lambda would end it, a function error and API Gateway's
    answer instead of the contract's."""
    from kiln.aws import AwsClient

    sent = AwsClient.dynamodb

    async def slowly(self, operation, payload, **options):
        await asyncio.sleep(1.0)
        return await sent(self, operation, payload, **options)

    monkeypatch.setattr(AwsClient, "dynamodb", slowly)
    event = json.loads((EVENTS / "rest-usage.json").read_text().replace("${KILN_API_KEY}", lambda_env.key))
    handler = importlib.import_module("kiln_functions.generations.app").handler
    began = time.monotonic()
    response = handler(event, SimpleNamespace(**{**vars(CONTEXT), "get_remaining_time_in_millis": lambda: 3400}))
    took = time.monotonic() - began
    assert response["statusCode"] == 503, body_of(response)
    error = json.loads(body_of(response))["error"]
    assert error["code"] == "storage_unavailable" and "Nothing was changed" in error["message"]
    assert 0.4 <= took < 1.4  # 3.4 s less the 3 s kept for the answer, not the configured 25 s


def test_errors_keep_their_status_and_shape_through_mangum(lambda_env):
    response = invoke("chat_completions", "rest-chat-completions.json", "sk-kiln-" + "x" * 43)
    assert response["statusCode"] == 401
    assert json.loads(body_of(response))["error"]["code"] == "invalid_api_key"


def test_the_run_script_serves_as_the_web_adapter_starts_it_and_streams_chunk_by_chunk(stack, tmp_path):
    """run.sh in a function's artifact layout: ready on /healthz, then a stream, token by token."""
    task_root = tmp_path / "task"
    task_root.mkdir()
    shutil.copy(repo_root() / "functions" / "chat_completions" / "app.py", task_root / "app.py")
    shutil.copy(repo_root() / "functions" / "run.sh", task_root / "run.sh")
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KILN_")},
        **stack.settings.to_env(),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "LAMBDA_TASK_ROOT": str(task_root),
        "AWS_LWA_PORT": str(port),
        "POWERTOOLS_METRICS_DISABLED": "true",
    }
    log = (tmp_path / "run.log").open("w")
    process = subprocess.Popen([str(task_root / "run.sh")], cwd=task_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # the adapter's readiness check: poll until 2xx
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, (tmp_path / "run.log").read_text()
            assert time.monotonic() < deadline, "run.sh never became ready"
            time.sleep(0.01)

        _, key = stack.org()
        body = {
            "model": "qwen3-32b",
            "messages": [{"role": "user", "content": "Hello!"}],
            "stream": True,
            "mock": {"token_delay_ms": 100},
        }
        stack.mock.reset()
        arrivals, states = [], []  # per data line: when, and how many streams the mock had finished
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    states.append(stack.mock.stats["completed"])
        assert len(arrivals) == 15  # role, 12 tokens, finish, [DONE]
        # each token reached the client while the model was still generating: not buffered
        assert states[:-2] == [0] * 13
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()
    assert key not in (tmp_path / "run.log").read_text()


@pytest.mark.parametrize("function", ["chat_completions", "completions", "responses", "models", "generations"])
def test_a_function_starts_without_the_framework_it_only_needs_for_its_schema(function, tmp_path):
    """Lambda's init imports the function's module: FastAPI (with pydantic, most of a bare
    FastAPI app's cold start) is imported only once /openapi.json is asked for, and then
    describes every route of the function."""
    root = repo_root()
    script = (
        "import sys, app\n"
        "from starlette.testclient import TestClient\n"
        "loaded = sorted(name for name in ('fastapi', 'pydantic') if name in sys.modules)\n"
        "with TestClient(app.app) as client:\n"
        "    schema = client.get('/openapi.json').json()\n"
        "print(loaded, sorted(schema['paths']), 'fastapi' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root / "layers" / "gateway"), "POWERTOOLS_METRICS_DISABLED": "true",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=root / "functions" / function, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    module = importlib.import_module(f"kiln_functions.{function}.app")
    expected = sorted({openapi_path(route.path) for route in module.routes})
    assert out.stdout.strip().endswith(f"[] {expected} True"), out.stdout[-2000:]


def _rest_event(key: str) -> dict:
    return json.loads((EVENTS / "rest-models.json").read_text().replace("${KILN_API_KEY}", key))


def _url_event(key: str) -> dict:
    return json.loads((EVENTS / "url-models.json").read_text().replace("${KILN_API_KEY}", key))


def _spoiled(event: dict, **changes) -> dict:
    spoiled = json.loads(json.dumps(event))
    for path, value in changes.items():
        where = spoiled
        *parents, last = path.split("__")
        for name in parents:
            where = where[name]
        if value is _DROP:
            where.pop(last, None)
        else:
            where[last] = value
    return spoiled


_DROP = object()


@pytest.mark.parametrize("spoil", [
    lambda key: _spoiled(_rest_event(key), body="%%% not base64 %%%", isBase64Encoded=True),
    lambda key: _spoiled(_rest_event(key), requestContext__identity=None),
    lambda key: _spoiled(_url_event(key), headers=None),
    lambda key: _spoiled(_url_event(key), requestContext__http=_DROP),
    lambda key: _spoiled(_rest_event(key), body="\ud800", httpMethod="POST"),
    lambda key: {"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}},  # a warmer
    lambda key: {},  # the console's test event
], ids=["bad-base64", "null-identity", "null-v2-headers", "v2-without-http", "lone-surrogate", "warmer", "empty"])
def test_an_event_no_http_request_could_make_is_answered_400_in_the_contracts_shape(lambda_env, spoil, caplog):
    """An invoke that API Gateway or a Function URL would never send (a direct invoke, a warmer, a
    console test) gets an answer, not a function error that pages whoever watches the alarm."""
    for module in ("models", "generations", "chat_completions"):
        handler = importlib.import_module(f"kiln_functions.{module}.app").handler
        response = handler(spoil(lambda_env.key), CONTEXT)
        assert response["statusCode"] == 400, response
        assert header(response, "content-type") == "application/json"
        error = json.loads(body_of(response))["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_event", None)
    assert "unusable Lambda event" in caplog.text and lambda_env.key not in caplog.text  # no header logged
    assert lambda_env.stack.org_info(lambda_env.org_id).in_flight == 0


def test_a_gateway_that_cannot_be_built_answers_500_in_the_contracts_shape_and_recovers(lambda_env, monkeypatch):
    """A setting that cannot be read fails each request with the contract's 500, not an empty body;
    once it is mended, the next request is served without a new process."""
    monkeypatch.setenv("KILN_LEASE_TTL_SECONDS", "abc")
    event = _rest_event(lambda_env.key)
    for module in ("models", "generations"):
        importlib.import_module(f"kiln_functions.{module}.app").app.state._state.pop("gateway", None)
    failed = invoke("models", "rest-models.json", lambda_env.key)
    assert failed["statusCode"] == 500
    error = json.loads(body_of(failed))["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    monkeypatch.setenv("KILN_LEASE_TTL_SECONDS", lambda_env.stack.settings.to_env()["KILN_LEASE_TTL_SECONDS"])
    served = importlib.import_module("kiln_functions.models.app").handler(event, CONTEXT)
    assert served["statusCode"] == 200, body_of(served)


def test_a_fault_in_turning_the_apps_answer_into_lambdas_is_a_function_error_not_the_events(lambda_env, monkeypatch):
    """Only the event's reading is answered 400 invalid_event: a fault after it (here an answer
    Mangum cannot turn into Lambda's) is the gateway's, raised so that the errors alarm sees it."""
    import kiln_functions.models.app as models

    class Spoiled:  # a header value that is no text: no Lambda answer can hold it
        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"\xff\xfe")]})
            await send({"type": "http.response.body", "body": b"{}"})

    async def spoiled(request):
        return Spoiled()

    monkeypatch.setitem(models.app._fixed["/v1/models"], "GET", spoiled)
    with pytest.raises(UnicodeDecodeError):
        invoke("models", "rest-models.json", lambda_env.key)


# found by a hostile client: what a Lambda invocation carries, in and out (kiln.lambda_payload)

def test_a_request_whose_event_lambda_cannot_carry_is_413_before_admission(stack):
    """A body within 6 MiB whose event is not: its quotes are written twice in the event (as
    JSON-escaped quotes in a tool result are, four bytes each). AWS refuses it before the
    function runs; locally it was served and billed. One a Lambda event carries is served."""
    org_id, key = stack.org()
    quoted = {"model": "qwen3-32b", "messages": [{"role": "user", "content": '"' * 1_600_000}]}
    refused = stack.post("/v1/chat/completions", quoted, key)
    assert refused.status_code == 413, refused.text[:300]
    error = refused.json()["error"]
    assert error["code"] == "request_too_large" and "Lambda invocation" in error["message"]
    assert stack.events(org_id) == [] and stack.org_info(org_id).in_flight == 0
    # as large, with nothing that grows: read and checked past the body (a model no catalog has:
    # 404), sent to no model server
    plain = {"model": "no-such-model", "messages": [{"role": "user", "content": "word " * 600_000}]}
    assert stack.post("/v1/chat/completions", plain, key).status_code == 404


def test_a_stream_lambda_cannot_carry_whole_ends_within_it_billed_for_what_it_carries(lambda_env, monkeypatch):
    """In buffered mode a stream is answered whole too, in one JSON document of at most 6 MB: a
    stream larger than that (some 30 000 tokens of vLLM's chunks) was settled as a success and
    then lost, billed. It now ends before the bound with the error event, billed for the chunks
    it carries, which reach the client. The bound made small here."""
    import kiln.lambda_payload as payload

    monkeypatch.setattr(payload, "LAMBDA_PAYLOAD_BYTES", 64 * 1024)
    event = json.loads((EVENTS / "rest-chat-completions-stream.json").read_text()
                       .replace("${KILN_API_KEY}", lambda_env.key))
    body = json.loads(event["body"])
    event["body"] = json.dumps({**body, "max_tokens": 20000, "mock": {"tokens": 20000}})
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert len(json.dumps(response)) <= 64 * 1024  # what the runtime can hand back
    assert response["statusCode"] == 200
    chunks = data_events(body_of(response))
    assert "[DONE]" not in chunks and "larger than" in chunks[-1]["error"]["message"]
    delivered = [chunk for chunk in chunks[:-1] if chunk["choices"] and chunk["choices"][0]["delta"].get("content")]
    (settled,) = lambda_env.stack.events(lambda_env.org_id)
    assert settled.status == "stream_interrupted" and 0 < settled.completion_tokens <= len(delivered)
    assert lambda_env.stack.org_info(lambda_env.org_id).in_flight == 0
    assert lambda_env.stack.org_info(lambda_env.org_id).credits == Decimal(10) - settled.cost


def test_a_stream_whose_last_event_grows_as_written_again_still_fits_its_invocation(lambda_env, monkeypatch):
    """A stream's last event (chat's usage chunk, the Responses API's final event) is the model
    server's, written again with the bill in it. Written again it can grow far past the room kept
    for it (`1E15` is `1000000000000000.0`): the answer outgrew what the invocation can hand back,
    billed as a success. It now ends with the error event, the content the client got billed."""
    import kiln.lambda_payload as payload

    monkeypatch.setattr(payload, "LAMBDA_PAYLOAD_BYTES", 64 * 1024)
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-oss-120b",
             "choices": [{"index": 0, "delta": {"content": "Hello there"}, "finish_reason": None}]}
    last = {**chunk, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
            "x": "[" + ",".join(["1E15"] * 6000) + "]"}
    raw_last = json.dumps(last).replace('"x": "[', '"x": [').replace(']"}', ']}')  # numbers, as sent
    event = json.loads((EVENTS / "rest-chat-completions-stream.json").read_text()
                       .replace("${KILN_API_KEY}", lambda_env.key))
    event["body"] = json.dumps({**json.loads(event["body"]), "mock": {"raw_events": [json.dumps(chunk), raw_last]}})
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert len(json.dumps(response)) <= payload.LAMBDA_PAYLOAD_BYTES
    chunks = data_events(body_of(response))
    assert "larger than" in chunks[-1]["error"]["message"] and chunks[0]["choices"][0]["delta"]["content"]
    (settled,) = lambda_env.stack.events(lambda_env.org_id)
    assert settled.status == "stream_interrupted" and settled.completion_tokens == 2
    assert lambda_env.stack.org_info(lambda_env.org_id).in_flight == 0


def test_a_stream_answered_whole_counts_its_keepalives_against_the_bound(lambda_env, monkeypatch):
    """A silent model server's stream is kept alive with `: keepalive` comments; answered whole,
    they are part of the answer too, and at a short interval over a long wait they outgrew the
    room its last event keeps. The bound made small here, and the interval."""
    import kiln.lambda_payload as payload

    monkeypatch.setattr(payload, "LAMBDA_PAYLOAD_BYTES", 2048 + 8192 + 300)
    monkeypatch.setenv("KILN_KEEPALIVE_SECONDS", "0.002")
    event = json.loads((EVENTS / "rest-chat-completions-stream.json").read_text()
                       .replace("${KILN_API_KEY}", lambda_env.key))
    event["body"] = json.dumps({**json.loads(event["body"]), "mock": {"ttft_ms": 3000}})
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert len(json.dumps(response)) <= payload.LAMBDA_PAYLOAD_BYTES
    assert "larger than" in data_events(body_of(response))[-1]["error"]["message"]
    assert lambda_env.stack.org_info(lambda_env.org_id).in_flight == 0


def test_a_buffered_answer_lambda_cannot_carry_is_502_and_not_billed(lambda_env, monkeypatch):
    """Mangum answers with one JSON document of at most 6 MB: an answer larger than that, once
    escaped, was settled as a success and then lost (API Gateway's 5xx, which the SDKs retry,
    each try billed). It is refused before its settle, billed nothing; the same answer where
    it is not bound (streamed, or served plainly) is served. The bound made small here."""
    import kiln.lambda_payload as payload

    monkeypatch.setattr(payload, "LAMBDA_PAYLOAD_BYTES", 64 * 1024)
    event = json.loads((EVENTS / "rest-chat-completions.json").read_text().replace("${KILN_API_KEY}", lambda_env.key))
    body = json.loads(event["body"])
    event["body"] = json.dumps({**body, "max_tokens": 20000, "mock": {"tokens": 20000}})
    handler = importlib.import_module("kiln_functions.chat_completions.app").handler
    response = handler(event, CONTEXT)
    assert response["statusCode"] == 502 and "larger than a buffered answer" in body_of(response)
    assert header(response, "x-neocloud-generation-id")
    (settled,) = lambda_env.stack.events(lambda_env.org_id)
    assert settled.cost == 0 and settled.status == "upstream_error"
    assert lambda_env.stack.org_info(lambda_env.org_id).in_flight == 0
    served = lambda_env.stack.post("/v1/chat/completions", {**body, "max_tokens": 20000, "mock": {"tokens": 20000}},
                                   lambda_env.key)
    assert served.status_code == 200 and len(served.content) > 64 * 1024
