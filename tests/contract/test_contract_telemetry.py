"""One JSON log line and EMF metrics per request, with ids and numbers only (kiln/observability.py)."""

from __future__ import annotations

import re

from support import TELEMETRY

CHAT = "/v1/chat/completions"


def _records_since(mark: int) -> list[dict]:
    import json

    text = TELEMETRY.text()[mark:]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_request_logs_its_generation_org_model_status_and_latency(stack, org):
    org_id, key = org
    mark = len(TELEMETRY.text())
    response = stack.post(CHAT, {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "secret plans"}]}, key)
    gen_id = response.headers["X-Neocloud-Generation-Id"]
    records = _records_since(mark)
    (log,) = [r for r in records if r.get("message") == "request"]
    assert log["generation_id"] == gen_id
    assert (log["org_id"], log["model"], log["status"], log["usage_status"]) == (org_id, "gpt-oss-120b", 200, "success")
    assert log["latency_ms"] >= 0 and log["completion_tokens"] == 12 and log["cost"]
    assert "secret plans" not in TELEMETRY.text() and key not in TELEMETRY.text()

    (metrics,) = [r for r in records if "_aws" in r and "Requests" in r]
    names = {m["Name"] for m in metrics["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert {"Requests", "Latency", "TimeToFirstByte", "PromptTokens", "CompletionTokens", "CostUSD"} <= names
    assert metrics["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["service"], ["service", "endpoint"]]
    assert metrics["endpoint"] == "chat.completions" and metrics["CompletionTokens"] == [12.0]


def test_errors_are_counted_by_code_and_429s_and_upstream_failures_have_their_own_metrics(stack):
    org_id, key = stack.org(credits="0")
    mark = len(TELEMETRY.text())
    assert stack.post(CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}]}, key).status_code == 402
    records = _records_since(mark)
    (errors,) = [r for r in records if "Errors" in r]
    assert errors["code"] == "insufficient_credits"

    _, key = stack.org()
    mark = len(TELEMETRY.text())
    stack.post(CHAT, {"model": "failover-model", "messages": [{"role": "user", "content": "x"}]}, key)
    stack.post(CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "mock": {"no_usage": True}}, key)
    requests = [r for r in _records_since(mark) if "Requests" in r]
    assert requests[0]["UpstreamFailures"] == [1.0]  # the dead backend, before failing over
    assert requests[1]["UsageEstimated"] == [1.0]


def test_readiness_probes_leave_no_request_records(stack):
    mark = len(TELEMETRY.text())
    for _ in range(3):
        assert stack.http.get("/healthz").status_code == 200
    assert stack.http.get("/v1/models").status_code == 401  # a customer request still gets its record
    paths = [r.get("path") for r in _records_since(mark) if r.get("message") == "request"]
    assert paths == ["/v1/models"]


def test_what_a_client_or_model_server_chose_never_becomes_a_secret_in_logs_or_a_new_metric(stack):
    """The path is the client's text: a key pasted into it is not logged, and an unknown URL is
    one `unmatched` endpoint in the metrics, not a metric of its own (each dimension value
    CloudWatch sees is a metric it bills). A model server's error code is its own text too:
    logged if it is a short word, and counted under the gateway's `upstream_rejected`."""
    import json
    import secrets

    from kiln.store.keys import create_key

    org_id, key = stack.org()
    admin = create_key(stack.tables, org_id, role="management").secret
    mark = len(TELEMETRY.text())
    pasted = "sk-kiln-" + secrets.token_urlsafe(32)
    assert stack.http.get(f"/v1/keys/{pasted}", headers={"Authorization": f"Bearer {admin}"}).status_code == 404
    # the same secret's body behind its prefix spelled otherwise, or none: the body is the secret
    misspelled = []
    while len(misspelled) < 8:  # secrets with 10 letters and digits in a row of both cases and a digit, as all but 0.3 %
        body = secrets.token_urlsafe(32)
        if any(not s.isalpha() and not s.isdigit() and not s.islower() and not s.isupper()
               for s in re.findall(r"[A-Za-z0-9]{10,}", body)):
            misspelled.append(body)
    spellings = ("/v1/keys/SK-KILN-{}", "/v1/keys/sk_kiln_{}", "/v1/keys/{}", "/v1/models/sk-{}", "/v1/models/kiln-{}",
                 "/v1/models/{}-x", "/v1/generations/sk-kiln{}", "/v1/x{}")
    for spelling, body in zip(spellings, misspelled, strict=True):
        stack.http.get(spelling.format(body), headers={"Authorization": f"Bearer {admin}"})
    # a model id with a long run of such characters is no secret: the operator sees which one was asked for
    model_path = "/v1/models/deepseek-ai/DeepSeek-R1-Distill-Llama-70B-abliterated/task-classifier-for-long-documents"
    assert stack.http.get(model_path, headers={"Authorization": f"Bearer {key}"}).status_code == 404
    scanned = f"/v1/{secrets.token_hex(8)}/" + "x" * 5000
    assert stack.http.get(scanned, headers={"Authorization": f"Bearer {key}"}).status_code == 404
    hostile = json.dumps({"error": {"message": "no", "code": "c" + secrets.token_hex(4) + " " * 10 + "y" * 200}})
    rejected = stack.post(CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}],
                                 "mock": {"status": 400, "plain_text": True, "message": hostile}}, key)
    assert rejected.status_code == 400 and rejected.json()["error"]["code"].startswith("c")  # the client's answer
    worded = json.dumps({"error": {"message": "no", "code": "context_length_exceeded"}})
    stack.post(CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}],
                      "mock": {"status": 400, "plain_text": True, "message": worded}}, key)
    text = TELEMETRY.text()[mark:]
    assert pasted not in text and pasted[8:] not in text
    assert not any(body in text for body in misspelled)
    assert model_path in text
    records = _records_since(mark)
    logs = [r for r in records if r.get("message") == "request"]
    assert all(len(r["path"]) <= 300 for r in logs)
    assert {r["endpoint"] for r in records if "Requests" in r} <= {"keys", "unmatched", "chat.completions", "models", "generations"}
    assert "unmatched" in {r["endpoint"] for r in records if "Requests" in r}
    codes = [r["code"] for r in records if "Errors" in r]
    assert codes.count("upstream_rejected") == 2 and all(len(code) <= 64 for code in codes)
    assert [r.get("upstream_code") for r in logs[-2:]] == [None, "context_length_exceeded"]
    stored = sorted(event.error for event in stack.events(org_id))  # the usage events keep only a word too
    assert stored == ["upstream HTTP 400", "upstream HTTP 400 context_length_exceeded"]
