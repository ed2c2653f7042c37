"""The OpenAI Agents SDK against the gateway, unchanged (contract §9: it calls POST /v1/responses).

It runs from an environment of its own (`.tools/agents`, made by `make setup`: the SDK's
dependencies are not the gateway's), as `tests/clients/py/openai_agents_run.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support import LedgerCheck

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".tools" / "agents" / "bin" / "python"
SCRIPT = Path(__file__).resolve().parent / "py" / "openai_agents_run.py"
REPLY = "Hello! How can I help you today? Ask me anything."


def test_an_agents_run_and_streamed_run_are_answered_billed_and_recorded(stack):
    if not PYTHON.exists():
        pytest.fail("the Agents SDK's environment is needed: `make setup` makes it (.tools/agents)")
    org_id, key = stack.org()
    ledger = LedgerCheck(stack, org_id)
    env = {**os.environ, "KILN_BASE_URL": stack.base_url, "KILN_API_KEY": key, "KILN_MODEL": "gpt-oss-120b"}
    done = subprocess.run([str(PYTHON), str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    ledger.gen_ids.extend(out["gen_ids"])
    events = {event.streamed: event for event in ledger.check()}
    assert sorted((event.endpoint, streamed, event.status) for streamed, event in events.items()) == [
        ("responses", False, "success"), ("responses", True, "success")]
    for run, streamed in (("run", False), ("streamed", True)):
        event = events[streamed]
        assert out[run]["text"] == REPLY
        # the usage the SDK counted is what was billed, as the model server reported it
        assert (out[run]["requests"], out[run]["input_tokens"], out[run]["output_tokens"]) == (
            1, event.prompt_tokens, event.completion_tokens), out[run]
        assert event.usage_source == "upstream" and event.completion_tokens == 12 and event.cost > 0
    assert out["streamed"]["deltas"] > 1
