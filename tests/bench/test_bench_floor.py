"""The bench's floor: a request's exchanges and nothing else, relayed as a gateway relays them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from bench.floor import GAPS_PREFIX, _Origin, floor_app
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


def floor(upstream: str, standin: str, calls: int, path: str = "/v1/chat/completions", gap_path: str = "") -> ServerThread:
    body = json.dumps({"TableName": ORGS, "Key": {"org_id": {"S": "o"}}, "ConsistentRead": True}).encode()
    return ServerThread(floor_app(f"{upstream}{path}", storage_url=standin, storage_calls=calls, storage_body=body,
                                  gap_upstream_url=f"{upstream}{gap_path}" if gap_path else "")).start()


def standin_stats(standin: str) -> dict:
    return httpx.get(f"{standin}/__standin/stats", timeout=5).json()


def test_a_buffered_answer_comes_whole_with_its_length_after_the_storage_calls(servers):
    mock, upstream, standin = servers
    server = floor(upstream, standin, calls=2)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(3):
                answer = client.post("/v1/chat/completions", json=BODY)
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("application/json")
                assert int(answer.headers["content-length"]) == len(answer.content)
                assert answer.json()["object"] == "chat.completion" and answer.json()["usage"]["completion_tokens"] > 0
        stats = standin_stats(standin)
        assert stats["by_operation"] == {"DynamoDB_20120810.GetItem": 6} and stats["errors"] == 0  # two per request
        assert mock.stats.requests == 3 and mock.stats.bodies[-1] == BODY  # the client's body, as it came
    finally:
        server.stop()


def test_a_refused_storage_call_fails_the_request():
    store = Store({ORGS: ["org_id"]})
    standin = ServerThread(app_for(store, 0.0)).start()
    upstream = ServerThread(MockUpstream()).start()
    server = ServerThread(floor_app(f"{upstream.url}/v1/chat/completions", storage_url=standin.url, storage_calls=2,
                                    storage_body=b'{"TableName": "missing", "Key": {}}')).start()
    try:
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=10)
        assert answer.status_code == 500  # not an answer relayed as if the storage had agreed
        assert standin_stats(standin.url)["errors"] == 1
    finally:
        for s in (server, upstream, standin):
            s.stop()


def test_the_end_of_a_stream_waits_for_the_storage_calls_after_the_upstream():
    store = Store({ORGS: ["org_id"]})
    store.put_seed(ORGS, ORG_ITEM)
    standin = ServerThread(app_for(store, 0.5)).start()  # each storage call takes half a second
    upstream = ServerThread(MockUpstream()).start()
    server = floor(upstream.url, standin.url, calls=2, path="/x/token_delay_ms=20,tokens=4/v1/chat/completions")
    try:
        arrivals = []
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as answer:
                for piece in answer.iter_raw():
                    arrivals.append((time.monotonic(), piece))
        assert b"data: [DONE]" in arrivals[-1][1] and b"[DONE]" not in b"".join(p for _, p in arrivals[:-1])
        # tokens 20 ms apart, then the settle's half second, then the tail
        assert arrivals[-1][0] - arrivals[-2][0] >= 0.4
    finally:
        for s in (server, upstream, standin):
            s.stop()


def test_a_stream_is_relayed_as_it_comes(servers):
    mock, upstream, standin = servers
    server = floor(upstream, standin, calls=2, path="/x/token_delay_ms=40,tokens=5/v1/chat/completions")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as answer:
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/event-stream")
                assert "content-length" not in answer.headers
                reads = list(answer.iter_raw())
        events = [line for line in b"".join(reads).decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "chat.completion.chunk"
        assert len(reads) >= 3  # tokens 40 ms apart reach the client apart: relayed, not buffered
        assert standin_stats(standin)["by_operation"] == {"DynamoDB_20120810.GetItem": 2}
    finally:
        server.stop()


def test_the_spaced_token_streams_go_to_their_own_upstream_under_the_gaps_prefix(servers):
    mock, upstream, standin = servers
    server = floor(upstream, standin, calls=2, gap_path="/x/token_delay_ms=30,tokens=4/v1/chat/completions")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            started = time.monotonic()
            with client.stream("POST", f"{GAPS_PREFIX}v1/chat/completions", json={**BODY, "stream": True}) as answer:
                assert answer.status_code == 200
                reads = list(answer.iter_raw())
            spaced = time.monotonic() - started
            texts = [json.loads(line[6:])["choices"][0]["delta"].get("content") for line in
                     b"".join(reads).decode().splitlines() if line.startswith("data: {")]
            assert len([t for t in texts if t]) == 4 and spaced >= 0.09  # four tokens 30 ms apart
            assert len(reads) >= 3  # one read each, relayed as they came
            assert client.post("/v1/chat/completions", json={**BODY, "stream": True}).status_code == 200  # the other
        assert standin_stats(standin)["by_operation"] == {"DynamoDB_20120810.GetItem": 4}  # the same exchanges
    finally:
        server.stop()
    without = floor(upstream, standin, calls=0)  # no spaced upstream given: nothing to relay them to
    try:
        assert httpx.post(f"{without.url}{GAPS_PREFIX}v1/chat/completions", json=BODY, timeout=10).status_code == 404
    finally:
        without.stop()


def test_connections_are_kept_alive_and_one_the_server_closed_is_replaced():
    answers_per_connection = [2]  # the server answers two requests on a connection, then closes it unasked
    accepted = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        for _ in range(answers_per_connection[0]):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    async def scenario() -> tuple[list[tuple[int, bytes]], list[int]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        origin = _Origin(f"http://127.0.0.1:{port}/")
        answers, opened = [], []
        for _ in range(2):
            status, _, body = await origin.exchange(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answers.append((status, body))
            opened.append(origin.opened)
        await asyncio.sleep(0.2)  # the server has closed the idle connection by now
        status, _, body = await origin.exchange(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answers.append((status, body))
        opened.append(origin.opened)
        server.close()
        return answers, opened

    answers, opened = asyncio.run(scenario())
    assert answers == [(200, b"ok")] * 3
    assert opened == [1, 1, 2]  # the second exchange reused the first's connection; the closed one was replaced
    assert len(accepted) == 2
