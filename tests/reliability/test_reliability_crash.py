"""A gateway killed with SIGKILL mid-stream: its slots come back by themselves, nothing is lost.

The DynamoDB endpoint survives (`kiln emulator`, its own process); the gateway is `kiln dev
--aws-endpoint-url`, killed while 8 streams are in flight and started again. With the
production lease settings (60 s TTL, renewed every 20 s) the org's 8 slots must serve 8
concurrent requests again within 90 s of the kill. Under the emulator's fault mode, with a
short lease, the streams are killed after their leases were renewed: each `abandoned` event
is billed for the tokens its last renewal recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from decimal import Decimal

import httpx
import pytest

from conftest import STORAGE_FAULTS
from kiln.settings import Settings
from kiln.store import bind
from kiln.store.orgs import get_org
from kiln.store.usage import query_events
from kiln_ops.dev import read_exports
from support import EmulatorProcess

RECOVERY_LIMIT = 90.0  # seconds from the kill (contract §4)
CASES = {
    # the production settings: nothing about the lease is set
    "defaults": {"env": {}, "faults": None, "renewed": False},
    # a short lease, renewed every second, on DynamoDB under contention
    "faults": {"env": {"KILN_LEASE_TTL_SECONDS": "6", "KILN_LEASE_RENEW_SECONDS": "1"}, "faults": STORAGE_FAULTS,
               "renewed": True},
}


def _start_dev(emulator_url: str, tmp_path, lease_env: dict[str, str]) -> tuple[subprocess.Popen, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(lease_env)
    errors = tmp_path / f"dev-{len(list(tmp_path.glob('dev-*.err')))}.err"
    with errors.open("w") as said:
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0", "--aws-endpoint-url", emulator_url,
             "--mock-token-delay-ms", "400"],
            stdout=subprocess.PIPE, stderr=said, text=True, cwd=tmp_path, env=env,
            start_new_session=True,  # its own process group: the kill takes the gateway and its mock model server
        )
    exports = read_exports(process.stdout)
    assert exports, f"kiln dev stopped before it was ready: {errors.read_text()[-2000:]}"
    # keep reading its request log: a full pipe would block the gateway's event loop
    threading.Thread(target=process.stdout.read, daemon=True).start()
    return process, exports


def _leases_as_stored(tables, settings) -> dict[str, dict[str, str | None]]:
    item = tables.client.get_item(TableName=settings.orgs_table, Key={"org_id": {"S": "demo"}}, ConsistentRead=True)
    return {gen_id: {name: value.get("N") for name, value in lease["M"].items()}
            for gen_id, lease in item["Item"]["leases"]["M"].items()}


def _concurrently(base: str, key: str, count: int) -> list[httpx.Response]:
    quick = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    answers: list[httpx.Response] = []

    def one() -> None:
        answers.append(httpx.post(f"{base}/chat/completions", json=quick, headers={"Authorization": f"Bearer {key}"},
                                  timeout=30))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


@pytest.fixture
def case(request):
    return request.param


@pytest.fixture
def emulator(case):
    process = EmulatorProcess(faults=CASES[case]["faults"])
    yield process
    process.stop()


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_sigkill_mid_stream_the_slots_come_back_within_90_s_and_every_admission_has_one_event(case, emulator, tmp_path):
    lease_env, renewed = CASES[case]["env"], CASES[case]["renewed"]
    gateway, exports = _start_dev(emulator.url, tmp_path, lease_env)
    settings = replace(Settings.from_env(exports), aws_endpoint_url=emulator.url)
    tables = bind(settings)
    start_credits = get_org(tables, "demo").credits
    base, key = exports["KILN_BASE_URL"], exports["KILN_API_KEY"]
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"tokens": 60}}  # 24 s of tokens: still streaming when the gateway dies
    crashed_ids: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{base}/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=60) as response:
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
        if renewed:  # let every lease be renewed with what its stream relayed so far
            while not all("ct" in lease for lease in get_org(tables, "demo").leases.values()):
                assert time.monotonic() < deadline + 10, f"the leases were never renewed: {get_org(tables, 'demo').leases}"
                time.sleep(0.1)
        os.killpg(gateway.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(timeout=10)
        assert len(crashed_ids) == 8
        # the leases as their last renewals left them: a renewal sent just before the kill may
        # still land, so read until two reads a moment apart agree
        last_renewal, before = _leases_as_stored(tables, settings), None
        while last_renewal != before:
            time.sleep(0.5)
            before, last_renewal = last_renewal, _leases_as_stored(tables, settings)
        assert sorted(last_renewal) == sorted(crashed_ids)  # nobody settled: the leases are still held

        gateway, exports = _start_dev(emulator.url, tmp_path, lease_env)  # same tables, a fresh process and key
        base, key = exports["KILN_BASE_URL"], exports["KILN_API_KEY"]
        served: list[str] = []
        while True:  # 8 at once, until all 8 are served (429 while the dead requests hold the slots)
            answers = _concurrently(base, key, 8)
            served += [a.headers["X-Neocloud-Generation-Id"] for a in answers if a.status_code == 200]
            assert {a.status_code for a in answers} <= {200, 429}, [(a.status_code, a.text) for a in answers]
            if all(a.status_code == 200 for a in answers):
                break
            assert time.monotonic() - killed_at < RECOVERY_LIMIT, "the org was still locked out 90 s after the crash"
            time.sleep(1.0)
        recovery = time.monotonic() - killed_at
        assert recovery < RECOVERY_LIMIT
        print(f"\n[{case}] 8 concurrent requests served again {recovery:.1f} s after the SIGKILL")
        # The last admissions may have seen the last dead leases past their expiry below the limit:
        # those are reclaimed off the requests' paths, in the background (in rounds where storage
        # refuses them for now), so they are gone shortly after, with no request more.
        settled_by = time.monotonic() + 30
        while (org := get_org(tables, "demo")).leases:
            assert time.monotonic() < settled_by, f"dead leases never reclaimed: {org.leases}"
            time.sleep(0.2)
        assert org.in_flight == 0

        events = {event.gen_id: event for event in query_events(tables, "demo")}
        assert sorted(events) == sorted(crashed_ids + served)  # every admission ended with exactly one event
        for gen_id in crashed_ids:
            event, lease = events[gen_id], last_renewal[gen_id]
            assert event.status == "abandoned"
            # billed for what its last renewal recorded (nothing when it was never renewed)
            recorded = [int(lease[name]) if lease.get(name) else None for name in ("pt", "ct")]
            assert [event.prompt_tokens, event.completion_tokens] == recorded
            assert event.cost == Decimal(lease.get("cost") or 0)
            if renewed:
                assert event.completion_tokens > 0 and event.cost > 0
        assert {events[gen_id].status for gen_id in served} == {"success"}
        assert start_credits - org.credits == sum(event.cost for event in events.values())  # the ledger is exact
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGTERM)
            gateway.wait(timeout=15)
