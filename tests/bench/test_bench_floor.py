"""The bench's floor: a request's exchanges and nothing else, relayed as a gateway relays them."""

from __future__ import annotations

import json

import httpx
import pytest
from bench.floor import floor_app
from bench.standin import Store, app_for

from kiln_ops.mock_upstream import MockUpstream
from kiln_ops.serve import ServerThread

ORGS = "orgs"
ORG_ITEM = {"org_id": {"S": "o"}, "credits": {"N": "10"}}
BODY = {"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}


@pytest.fixture
def servers():
    store = Store({ORGS: ["org_id"]})
    store.put_seed(ORGS, ORG_ITEM)
    mock = MockUpstream()
    started = [ServerThread(mock).start(), ServerThread(app_for(store, 0.0)).start()]
    try:
        yield mock, started[0].url, started[1].url
    finally:
        for server in started:
            server.stop()


def floor(upstream: str, standin: str, calls: int) -> ServerThread:
    body = json.dumps({"TableName": ORGS, "Key": {"org_id": {"S": "o"}}, "ConsistentRead": True}).encode()
    return ServerThread(floor_app(f"{upstream}/v1/chat/completions", storage_url=standin, storage_calls=calls,
                                  storage_body=body)).start()


def standin_calls(standin: str) -> dict:
    return httpx.get(f"{standin}/__standin/stats", timeout=5).json()["by_operation"]


def test_a_buffered_answer_comes_whole_with_its_length_after_the_storage_calls(servers):
    mock, upstream, standin = servers
    server = floor(upstream, standin, calls=2)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(3):  # keep-alive connections, reused
                answer = client.post("/v1/chat/completions", json=BODY)
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("application/json")
                assert int(answer.headers["content-length"]) == len(answer.content)
                assert answer.json()["object"] == "chat.completion" and answer.json()["usage"]["completion_tokens"] > 0
        assert standin_calls(standin) == {"DynamoDB_20120810.GetItem": 6}  # two per request, every one answered
        assert mock.stats.requests == 3 and mock.stats.bodies[-1] == BODY  # the client's body, as it came
    finally:
        server.stop()


def test_a_stream_is_relayed_piece_by_piece_to_its_end(servers):
    mock, upstream, standin = servers
    server = floor(upstream, standin, calls=0)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as answer:
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/event-stream")
                events = [line for line in answer.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
        assert standin_calls(standin) == {}  # the one-exchange floor calls no storage
    finally:
        server.stop()
