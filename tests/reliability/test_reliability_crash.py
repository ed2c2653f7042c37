"""A gateway killed with SIGKILL mid-stream: its leases expire by themselves, nothing is lost.

The DynamoDB endpoint survives (`kiln emulator`, its own process); the gateway is `kiln dev
--aws-endpoint-url`, killed while 8 streams are in flight and started again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import httpx
import pytest

from kiln.settings import Settings
from kiln.store import bind
from kiln.store.orgs import get_org
from kiln.store.usage import query_events
from kiln_ops.dev import read_exports
from kiln_ops.serve import free_port
from support import EmulatorProcess

LEASE_TTL = 8.0  # seconds; the production default is 960


def _start_dev(emulator_url: str, tmp_path) -> tuple[subprocess.Popen, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_LEASE_TTL_SECONDS"] = str(LEASE_TTL)
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln_ops.cli", "dev", "--port", str(free_port()), "--aws-endpoint-url", emulator_url,
         "--mock-token-delay-ms", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env,
        start_new_session=True,  # its own process group: the kill takes the gateway and its mock model server
    )
    exports = read_exports(process.stdout)
    assert exports, "kiln dev stopped before it was ready"
    return process, exports


@pytest.fixture
def emulator():
    process = EmulatorProcess()
    yield process
    process.stop()


def test_sigkill_mid_stream_leases_expire_and_every_admission_has_one_event(emulator, tmp_path):
    gateway, exports = _start_dev(emulator.url, tmp_path)
    settings = replace(Settings.from_env(exports), aws_endpoint_url=emulator.url)
    tables = bind(settings)
    base, key = exports["KILN_BASE_URL"], exports["KILN_API_KEY"]
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True}
    crashed_ids: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{base}/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=30) as response:
                crashed_ids.append(response.headers["X-Neocloud-Generation-Id"])
                for _ in response.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the gateway died under us

    try:
        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(crashed_ids) < 8 or get_org(tables, "demo").in_flight < 8:  # all 8 streaming
            assert time.monotonic() < deadline, "the 8 streams never got in flight"
            time.sleep(0.05)
        os.killpg(gateway.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(timeout=10)
        assert len(crashed_ids) == 8
        assert get_org(tables, "demo").in_flight == 8  # nobody settled: the leases are still held

        gateway, exports = _start_dev(emulator.url, tmp_path)  # same tables, a fresh process and key
        base, key = exports["KILN_BASE_URL"], exports["KILN_API_KEY"]
        quick = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        if time.monotonic() - killed_at < LEASE_TTL - 1:
            refused = httpx.post(f"{base}/chat/completions", json=quick, headers={"Authorization": f"Bearer {key}"},
                                 timeout=30)
            assert refused.status_code == 429  # the dead requests still hold the org's slots
        time.sleep(max(0.0, LEASE_TTL - (time.monotonic() - killed_at)) + 0.5)
        admitted = httpx.post(f"{base}/chat/completions", json=quick, headers={"Authorization": f"Bearer {key}"},
                              timeout=30)
        assert admitted.status_code == 200  # no manual step: the expired leases were reclaimed
        assert get_org(tables, "demo").in_flight == 0

        events = {event.gen_id: event for event in query_events(tables, "demo")}
        assert {events[gen_id].status for gen_id in crashed_ids} == {"abandoned"}
        assert events[admitted.headers["X-Neocloud-Generation-Id"]].status == "success"
        assert len(events) == 9  # every admitted request ended with exactly one usage event
        assert all(events[gen_id].cost == 0 and events[gen_id].completion_tokens is None for gen_id in crashed_ids)
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGTERM)
            gateway.wait(timeout=15)
