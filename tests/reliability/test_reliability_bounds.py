"""Bounds on what a model server sends, against a gateway in its own process (contract §5).

The gateway is `kiln dev` (its own process, so its memory can be measured alone) over the
suite's `kiln emulator`, with its own mock model server as a child process: headers of
10 MB, a buffered body of 100 MB, a 50 MB event without a blank line, an endless stream.
Each is answered within its bound (502 before the stream, the error event after), the
gateway's resident memory stays within 50 MB of its idle size, and every request settles:
the org's slots free again, one usage event per generation id. KILN_TEST_HOSTILE_SCALE
multiplies the sizes for a longer soak.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kiln.settings import Settings
from kiln.store import bind
from kiln.store.orgs import get_org
from kiln.store.usage import query_events
from kiln_ops.dev import DEMO_ORG, read_exports
from kiln_ops.provision import aws_clients
from support import data_events

SCALE = int(os.environ.get("KILN_TEST_HOSTILE_SCALE", "1"))
MB = 1_000_000
RSS_GROWTH_LIMIT = 50 * 1024 * 1024
TOTAL_SECONDS = 3  # the hostile model's total time (the endless stream's bound)
MESSAGES = [{"role": "user", "content": "x"}]


def rss(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


class PeakMemory:
    """The process's largest resident size from now on: the kernel's high-water mark (reset
    first), and samples taken meanwhile where the kernel does not allow the reset."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss(pid), threading.Event()
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.kernel = True
        except OSError:
            self.kernel = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss(self.pid, "VmHWM")) if self.kernel else self.peak


@pytest.fixture(scope="module")
def gateway(aws, tmp_path_factory):
    """`kiln dev` on the suite's emulator, with its own tables and a model with short timeouts."""
    prefix = f"h{secrets.token_hex(4)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_KEYS_TABLE=f"{prefix}-keys", KILN_ORGS_TABLE=f"{prefix}-orgs", KILN_USAGE_TABLE=f"{prefix}-usage",
               KILN_CATALOG_PARAMETER=f"/{prefix}/catalog", KILN_MAINTENANCE_PARAMETER=f"/{prefix}/maintenance",
               KILN_CATALOG_CACHE_SECONDS="0", POWERTOOLS_METRICS_DISABLED="true")
    where = tmp_path_factory.mktemp("dev")
    with (where / "dev.err").open("w") as said:
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0", "--aws-endpoint-url", aws.url,
             "--mock-token-delay-ms", "5"],
            stdout=subprocess.PIPE, stderr=said, text=True, cwd=where, env=env, start_new_session=True,
        )
    try:
        exports = read_exports(process.stdout)
        assert exports, f"kiln dev stopped before it was ready: {(where / 'dev.err').read_text()[-2000:]}"
        threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe drained
        settings = replace(Settings.from_env(exports), aws_endpoint_url=aws.url)
        _, ssm = aws_clients(settings)
        document = json.loads(ssm.get_parameter(Name=settings.catalog_parameter)["Parameter"]["Value"])
        hostile = {**document["models"][0], "id": "hostile-model",
                   "timeouts": {"connect": 2, "first_byte": 2, "idle": 2, "total": TOTAL_SECONDS}}
        document["models"].append(hostile)
        ssm.put_parameter(Name=settings.catalog_parameter, Value=json.dumps(document), Type="String", Overwrite=True,
                          Tier="Advanced")
        yield process, exports, settings
    finally:
        os.killpg(process.pid, 15)
        process.wait(timeout=10)


def test_hostile_answers_are_bounded_in_memory_and_time_and_every_request_settles(gateway):
    process, exports, settings = gateway
    tables = bind(settings)
    client = httpx.Client(base_url=exports["KILN_BASE_URL"], timeout=60,
                          headers={"Authorization": f"Bearer {exports['KILN_API_KEY']}"})
    seen: list[str] = []

    def post(stream: bool, **mock) -> httpx.Response:
        response = client.post("/chat/completions", json={"model": "hostile-model", "messages": MESSAGES,
                                                          "stream": stream, "mock": mock})
        seen.append(response.headers["X-Neocloud-Generation-Id"])
        return response

    for stream in (False, True, False, True):  # warm: every code path loaded, pools open
        assert post(stream).status_code == 200
    time.sleep(0.5)
    idle = rss(process.pid)
    peak = PeakMemory(process.pid)
    try:
        for stream in (False, True):  # 10 MB of headers: 502 before any stream
            response = post(stream, header_bytes=10 * MB * SCALE)
            assert response.status_code == 502 and response.headers["content-type"].startswith("text/plain")
        response = post(False, body_bytes=100 * MB * SCALE)  # 100 MB body: over the 16 MiB bound
        assert response.status_code == 502 and response.headers["content-type"].startswith("text/plain")
        for hostile in ({"event_bytes": 50 * MB * SCALE}, {"endless": True}):  # after the 200: the error event
            response = post(True, **hostile)
            assert response.status_code == 200
            chunks = data_events(response.text)
            assert chunks[-1]["error"]["code"] == "upstream_error" and "[DONE]" not in chunks
        assert post(False).status_code == 200  # and the gateway still serves
    finally:
        growth = peak.stop() - idle
    assert growth < RSS_GROWTH_LIMIT, f"the gateway grew by {growth / 2**20:.1f} MiB over its idle size"

    deadline = time.monotonic() + 10
    while True:
        org, events = get_org(tables, DEMO_ORG), list(query_events(tables, DEMO_ORG))
        mine = [event for event in events if event.gen_id in seen]
        if (org.in_flight == 0 and len(mine) >= len(seen)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert org.in_flight == 0
    assert sorted(event.gen_id for event in mine) == sorted(seen)  # exactly one event each
    by_id = {event.gen_id: event for event in mine}
    hostile = [by_id[gen_id] for gen_id in seen[4:-1]]
    assert [event.status for event in hostile] == ["upstream_error"] * 3 + ["stream_interrupted"] * 2
    assert [event.error for event in hostile] == [
        "local: response headers over the bound", "local: response headers over the bound",
        "local: response body over the bound", "an SSE event over 1048576 bytes", "exceeded the model's total time",
    ]
