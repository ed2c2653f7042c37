"""The Vercel AI SDK's default OpenAI provider against the gateway, unchanged (contract §9).

`createOpenAI({baseURL, apiKey})(model)` sends every call to POST /v1/responses: this runs
its generateText and streamText in Node (`tests/clients/js`, installed by `make test`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support import LedgerCheck

JS = Path(__file__).resolve().parent / "js"
REPLY = "Hello! How can I help you today? Ask me anything."


def run_node(script: str, env: dict[str, str]) -> dict:
    if shutil.which("node") is None or not (JS / "node_modules" / "@ai-sdk" / "openai").exists():
        pytest.fail("Node and the pinned AI SDK are needed: `make test` installs them (npm ci in tests/clients/js)")
    done = subprocess.run(["node", str(JS / script)], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_generate_text_and_stream_text_with_usage(stack):
    org_id, key = stack.org()
    ledger = LedgerCheck(stack, org_id)
    out = run_node("vercel_ai.mjs", {"KILN_BASE_URL": stack.base_url, "KILN_API_KEY": key, "KILN_MODEL": "gpt-oss-120b"})
    for call in ("generate", "stream"):
        ledger.gen_ids.append(out[call]["genId"])  # the generation-id header, as the SDK exposes it
        assert out[call]["text"] == REPLY
        usage = out[call]["usage"]
        assert (usage["inputTokens"], usage["outputTokens"], usage["totalTokens"]) == (8, 12, 20)
    events = ledger.check()
    assert sorted((event.endpoint, event.streamed, event.status) for event in events) == [
        ("responses", False, "success"), ("responses", True, "success")]
    assert all(event.prompt_tokens == 8 and event.completion_tokens == 12 for event in events)


def test_a_stream_cut_by_the_model_server_reaches_stream_texts_on_error_as_the_gateways_error(stack):
    """§9: the stream ends with the gateway's one error event. Without a sequence number the
    SDK's schema refused that event: onError got "Type validation failed", and the app never
    learnt the code or the message."""
    org_id, key = stack.org()
    ledger = LedgerCheck(stack, org_id)
    out = run_node("vercel_ai_cut.mjs", {"KILN_BASE_URL": stack.base_url, "KILN_API_KEY": key,
                                         "KILN_MODEL": "gpt-oss-120b", "KILN_MOCK": json.dumps({"cut_after": 6})})
    ledger.gen_ids.append(out["genId"])
    assert len(out["errors"]) == 1, out
    (error,) = out["errors"]
    assert "Type validation" not in error["message"] and "backend failed while streaming" in error["message"], error
    (event,) = ledger.check()
    assert event.status == "stream_interrupted"
