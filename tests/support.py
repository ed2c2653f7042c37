"""What the tests share: a whole gateway stack on real ports, built like the local stack."""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from decimal import Decimal
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import botocore.session
import httpx

from kiln.aws import AwsClient
from kiln.gateway import Gateway
from kiln.http1 import ConnectFailed, HttpClient, ProtocolFailure, Response
from kiln.observability import Observer
from kiln.settings import Settings
from kiln.store import Tables, UsageEvent, bind, with_ledger
from kiln.store.clock import epoch_of
from kiln.store.codec import exact_sum
from kiln.store.keys import create_key, list_keys
from kiln.store.keyspend import period_kind, period_name
from kiln.store.ledger import ledger_of
from kiln.store.orgs import OrgInfo, create_org, get_org
from kiln.store.usage import query_events
from kiln.tls import client_context
from kiln_ops.app import combined_app
from kiln_ops.dev import local_catalog
from kiln_ops.provision import aws_clients, provision
from kiln_ops.serve import ServerThread, free_port, listening_socket
from kiln_ops.template import TABLES, repo_root

DEAD_URL_TEMPLATE = "http://127.0.0.1:{port}/v1"


def dead_url() -> str:
    """A loopback URL where nothing listens: connection refused."""
    return DEAD_URL_TEMPLATE.format(port=free_port())


def catalog_for_tests(mock_url: str) -> dict[str, Any]:
    """The default catalog served by the mock, plus models whose backends misbehave."""
    document = json.loads(local_catalog(repo_root() / "infra" / "catalog.json", mock_url))
    base = mock_url.rsplit("/v1", 1)[0]

    def model(model_id: str, backends: list[dict], **extra: Any) -> dict[str, Any]:
        entry = {
            "id": model_id,
            "owned_by": "kiln-tests",
            "created": 1,
            "context_length": 4096,
            "pricing": {"input": "1", "output": "2"},
            "backends": backends,
        }
        entry.update(extra)
        return entry

    document["models"] += [
        model("failover-model", [{"name": "dead", "url": dead_url()}, {"name": "b", "url": mock_url}]),
        model("failover-5xx-model", [{"name": "sick", "url": f"{base}/x/status=503/v1"}, {"name": "b", "url": mock_url}]),
        model(
            "all-down-model",
            [{"name": "dead", "url": dead_url()}, {"name": "sick", "url": f"{base}/x/status=500,plain_text=1/v1"}],
        ),
        model("no-backend-model", []),
        model("disabled-backend-model", [{"name": "off", "url": mock_url, "enabled": False}]),
        model(
            "hung-model",
            [{"name": "hung", "url": f"{base}/x/headers_delay_ms=3000/v1"}],
            timeouts={"first_byte": 0.3, "total": 0.3},
        ),
        model(
            "hung-then-ok-model",
            [{"name": "hung", "url": f"{base}/x/headers_delay_ms=3000/v1"}, {"name": "b", "url": mock_url}],
            timeouts={"first_byte": 0.3, "total": 1.0},
        ),
        model("idle-model", [{"name": "b", "url": mock_url}], timeouts={"idle": 0.3}),
        model("renamed-model", [{"name": "b", "url": mock_url, "model": "served-name"}]),
    ]
    return document


# the context Lambda hands a function's handler, as the functions' tests invoke them
LAMBDA_CONTEXT = SimpleNamespace(
    function_name="kiln-chat", aws_request_id="2f1c9e3a-1111-4c2b-9d8e-5a6b7c8d9e0f", memory_limit_in_mb=1024,
    invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:kiln-chat", get_remaining_time_in_millis=lambda: 29000,
)


class StorageFaults:
    """What the gateway sends to DynamoDB and SSM, recorded; and failures injected into it.

    The gateway talks to AWS through kiln.aws over httpx: this sits in its transport and
    answers chosen calls the way a throttled or failing service would.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []  # (operation, payload)
        self._rules: list[dict[str, Any]] = []

    def fail(self, operation: str, *, code: str = "ProvisionedThroughputExceededException",
             when: Callable[[dict], bool] = lambda payload: True, times: int | None = None,
             reasons: list[str] | None = None) -> list[int]:
        """Fail `operation` calls whose payload matches `when` (`times` of them, or all);
        `reasons`: a TransactionCanceledException's cancellation reasons, item by item."""
        return self._rule("fail", operation, when, times, code=code, reasons=reasons)

    def lose(self, operation: str, *, when: Callable[[dict], bool] = lambda payload: True,
             times: int | None = None, answer: tuple[int, bytes] | None = None) -> list[int]:
        """Apply matching `operation` calls, then lose their answers (a reset after the write);
        `answer`: (status, body) answered instead, as a proxy in front of DynamoDB would (a 504)."""
        return self._rule("lose", operation, when, times, answer=answer)

    def late(self, operation: str, seconds: float, *, when: Callable[[dict], bool] = lambda payload: True,
             times: int | None = None) -> list[int]:
        """Lose the answer of matching `operation` calls at once, and apply them `seconds` later:
        a write held in the network that lands after the gateway's retry of it."""
        return self._rule("late", operation, when, times, delay=seconds)

    def unreachable(self, operation: str, *, when: Callable[[dict], bool] = lambda payload: True,
                    times: int | None = None) -> list[int]:
        """Refuse the connection for matching `operation` calls: nothing is sent."""
        return self._rule("unreachable", operation, when, times)

    def slow(self, operation: str, seconds: float, *, when: Callable[[dict], bool] = lambda payload: True,
             times: int | None = None) -> list[int]:
        """Hold matching `operation` calls for `seconds` before they are sent (a slow answer)."""
        return self._rule("slow", operation, when, times, delay=seconds)

    def reply(self, operation: str, answer: dict, *, when: Callable[[dict], bool] = lambda payload: True,
              times: int | None = None) -> list[int]:
        """Answer matching `operation` calls with `answer` without sending them: what an eventually
        consistent read (a global secondary index) may answer, a write not in it yet, or an old one."""
        return self._rule("reply", operation, when, times, answer=answer)

    def _rule(self, kind: str, operation: str, when: Callable[[dict], bool], times: int | None, **extra: Any) -> list[int]:
        rule = {"kind": kind, "operation": operation, "when": when, "times": times, "hits": [], **extra}
        self._rules.append(rule)
        return rule["hits"]

    def _firing(self, kind: str, operation: str, payload: dict) -> dict[str, Any] | None:
        """The first rule of `kind` this call triggers: every matching rule counts the call as a
        hit, and the first still within its `times` fires."""
        for rule in self._rules:
            if rule["kind"] == kind and rule["operation"] == operation and rule["when"](payload):
                rule["hits"].append(1)
                if rule["times"] is None or len(rule["hits"]) <= rule["times"]:
                    return rule
        return None

    def clear(self) -> None:
        self._rules.clear()

    def count(self, operation: str, when: Callable[[dict], bool] = lambda payload: True) -> int:
        return sum(1 for op, payload in self.calls if op == operation and when(payload))

    def answer(self, operation: str, payload: dict) -> Response | None:
        """The injected failure answering this call, if a rule fails it (every call is recorded)."""
        self.calls.append((operation, payload))
        replied = self._firing("reply", operation, payload)
        if replied is not None:
            return Response.complete(200, json.dumps(replied["answer"]).encode())
        rule = self._firing("fail", operation, payload)
        if rule is None:
            return None
        error = {"__type": f"com.amazonaws.dynamodb.v20120810#{rule['code']}", "message": "injected by the test"}
        if rule.get("reasons"):
            error["CancellationReasons"] = [{"Code": reason} for reason in rule["reasons"]]
        return Response.complete(400, json.dumps(error).encode())

    def delay(self, operation: str, payload: dict) -> float:
        """How long this call waits before it is sent."""
        rule = self._firing("slow", operation, payload)
        return rule["delay"] if rule is not None else 0.0

    def lost(self, operation: str, payload: dict) -> dict[str, Any] | None:
        """The rule losing the answer to this call, already applied, if one does."""
        return self._firing("lose", operation, payload)

    def held(self, operation: str, payload: dict) -> float | None:
        """How long this call is held before it lands, its answer lost, if a rule holds it."""
        rule = self._firing("late", operation, payload)
        return rule["delay"] if rule is not None else None

    def refused(self, operation: str, payload: dict) -> bool:
        """Is the connection for this call to be refused (nothing sent)?"""
        return self._firing("unreachable", operation, payload) is not None


class FaultInjectingHttp(HttpClient):
    """The gateway's HTTP client, answering the calls StorageFaults picks itself."""

    def __init__(self, faults: StorageFaults) -> None:
        super().__init__(ssl_context=client_context)
        self._faults = faults
        self._landing: set[asyncio.Task] = set()  # the calls held, until they land

    async def request(self, method: str, url: str, *, headers: dict[str, str], body: bytes, **options: Any) -> Response:
        operation = headers.get("x-amz-target", "").rpartition(".")[2]
        payload = json.loads(body or b"{}")
        injected = self._faults.answer(operation, payload)
        if injected is not None:
            return injected
        if self._faults.refused(operation, payload):
            raise ConnectFailed("could not connect: connection refused (injected by the test)")
        held = self._faults.held(operation, payload)
        if held is not None:
            async def land() -> None:
                await asyncio.sleep(held)
                await (await super(FaultInjectingHttp, self).request(method, url, headers=headers, body=body,
                                                                     **options)).read()

            self._landing.add(task := asyncio.get_running_loop().create_task(land()))
            task.add_done_callback(self._landing.discard)
            raise ProtocolFailure("connection reset after the request was sent (injected by the test)")
        delay = self._faults.delay(operation, payload)
        if delay:
            await asyncio.sleep(delay)
        response = await super().request(method, url, headers=headers, body=body, **options)
        lost = self._faults.lost(operation, payload)
        if lost is not None:
            await response.read()  # applied by DynamoDB; its answer never reaches the gateway
            if lost["answer"] is not None:
                return Response.complete(*lost["answer"])
            raise ProtocolFailure("connection reset after the request was sent (injected by the test)")
        return response


class SyncLedger:
    """The ledger from synchronous test code: each call on its own loop and client."""

    def __init__(self, settings: Settings, faults: StorageFaults | None = None) -> None:
        self.settings = settings
        self.faults = faults

    def _http(self) -> HttpClient | None:
        return FaultInjectingHttp(self.faults) if self.faults else None

    def admit(self, **kwargs: Any):
        return with_ledger(self.settings, lambda ledger: ledger.admit(**kwargs), http=self._http())

    def settle(self, lease, event, **options: Any) -> str:
        return with_ledger(self.settings, lambda ledger: ledger.settle(lease, event, **options), http=self._http())

    def renew(self, lease, progress=None):
        return with_ledger(self.settings, lambda ledger: ledger.renew(lease, progress), http=self._http())


@dataclass
class Stack:
    """A running gateway (all endpoints, one port) over the embedded AWS and the mock."""

    settings: Settings
    tables: Tables
    gateway: Gateway
    server: ServerThread
    mock: "MockHandle"
    ssm: Any
    dynamodb: Any
    faults: StorageFaults
    http: httpx.Client = field(init=False)
    maintenance_changed: bool = False

    @property
    def ledger(self) -> SyncLedger:
        return SyncLedger(self.settings)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=30)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"

    def org(self, org_id: str | None = None, *, credits: str = "10", concurrency: int = 8) -> tuple[str, str]:
        """A new org with one key: (org id, secret)."""
        org_id = org_id or f"org-{secrets.token_hex(4)}"
        create_org(self.tables, org_id, concurrency=concurrency, credits=Decimal(credits))
        return org_id, create_key(self.tables, org_id).secret

    def key(self, org_id: str, **attributes: Any) -> str:
        """A new key of the org with attributes of contract §10 (label, spend_limit,
        spend_period, models, concurrency, role): its secret."""
        return create_key(self.tables, org_id, **attributes).secret

    def key_figures(self, org_id: str) -> dict[str, Any]:
        """The org item's per-key attributes (kiln.store.keyspend), as stored: name → value."""
        item = self.dynamodb.get_item(TableName=self.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                      ConsistentRead=True).get("Item", {})
        figures = {}
        for name, value in item.items():
            if name.startswith("key_spend:"):
                figures[name] = Decimal(value["N"])
            elif name.startswith("key_leases:"):
                figures[name] = set(value["SS"])
        return figures

    def key_tallies(self, org_id: str) -> dict[tuple[str, str, str], Decimal]:
        """(key id, month, attribute) → value of every tally item of the org's keys
        (kiln.store.tally), read consistently: `month` and `d01`..`d31`."""
        tallies: dict[tuple[str, str, str], Decimal] = {}
        for key in list_keys(self.tables, org_id):
            pages = self.dynamodb.get_paginator("scan").paginate(
                TableName=self.settings.usage_table, ConsistentRead=True,
                FilterExpression="begins_with(gen_id, :prefix)",
                ExpressionAttributeValues={":prefix": {"S": f"tally:{key.key_id}:"}})
            for page in pages:
                for item in page["Items"]:
                    month = item["gen_id"]["S"].rpartition(":")[2]
                    for name, value in item.items():
                        if name != "gen_id":
                            tallies[(key.key_id, month, name)] = Decimal(value["N"])
        return tallies

    def org_info(self, org_id: str) -> OrgInfo:
        return get_org(self.tables, org_id)

    def events(self, org_id: str) -> list[UsageEvent]:
        return list(query_events(self.tables, org_id))

    def post(self, path: str, body: Any, key: str | None, **kwargs: Any) -> httpx.Response:
        headers = kwargs.pop("headers", {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if isinstance(body, (bytes, str)):
            return self.http.post(path, content=body, headers=headers, **kwargs)
        return self.http.post(path, json=body, headers=headers, **kwargs)

    def stream(self, path: str, body: Any, key: str) -> httpx.Response:
        """POST and read the whole streamed body (as the client sees it)."""
        return self.post(path, body, key)

    def set_maintenance(self, value: dict[str, Any]) -> None:
        self.maintenance_changed = True
        self.ssm.put_parameter(
            Name=self.settings.maintenance_parameter, Value=json.dumps(value), Type="String", Overwrite=True
        )

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        for field_name in TABLES.values():
            try:
                self.dynamodb.delete_table(TableName=getattr(self.settings, field_name))
            except Exception:  # noqa: BLE001 - best effort cleanup of the emulator
                pass


@dataclass
class MockHandle:
    url: str  # ends in /v1
    app: Any

    @property
    def stats(self) -> dict[str, Any]:
        return self.app.stats.as_dict()

    def reset(self) -> None:
        self.app.reset()

    def last_body(self) -> dict[str, Any]:
        return self.app.stats.bodies[-1]

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.stats
            if predicate(stats):
                return stats
            time.sleep(0.02)
        raise AssertionError(f"mock never reached the expected state: {self.stats}")


class EmulatorProcess:
    """`kiln emulator` in its own process, as the local stack runs it (no GIL shared with the tests);
    `faults` turns on its DynamoDB fault mode (`kiln emulator --help`)."""

    def __init__(self, faults: str | None = None) -> None:
        import subprocess
        import sys

        self.faults = faults
        # its socket bound here and handed over: a port found free and let go could be taken by
        # another worker's emulator before this one bound it, and its tests run on that one
        with listening_socket("127.0.0.1", 0) as sock:
            self.port = sock.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            self._process = subprocess.Popen(
                [sys.executable, "-m", "kiln_ops.cli", "emulator", "--fd", str(sock.fileno()),
                 *(["--faults", faults] if faults else [])],
                stdout=subprocess.DEVNULL, pass_fds=(sock.fileno(),),
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.url, timeout=1)
                return
            except httpx.HTTPError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kiln emulator did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


class Telemetry(io.TextIOBase):
    """Everything the gateway logs or emits as metrics during the tests (one stream)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        with self._lock:
            self._parts.append(text)
        return len(text)

    def text(self) -> str:
        with self._lock:
            return "".join(self._parts)

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text().splitlines() if line.startswith("{")]


TELEMETRY = Telemetry()
_OBSERVER: Observer | None = None


def observer() -> Observer:
    global _OBSERVER
    if _OBSERVER is None:
        _OBSERVER = Observer(stream=TELEMETRY, metrics_enabled=True)
    return _OBSERVER


def make_stack(aws_url: str, mock: MockHandle, **overrides: Any) -> Stack:
    prefix = f"t{secrets.token_hex(5)}"
    settings = Settings(
        keys_table=f"{prefix}-keys",
        orgs_table=f"{prefix}-orgs",
        usage_table=f"{prefix}-usage",
        maintenance_parameter=f"/{prefix}/maintenance",
        catalog_parameter=f"/{prefix}/catalog",
        aws_endpoint_url=aws_url,
        maintenance_cache_seconds=0.0,
        catalog_cache_seconds=60.0,
        auth_cache_seconds=0.0,
        keepalive_seconds=5.0,
        # faults are injected per request into the shared mock: no backend is taken out of
        # service unless a test asks for it
        backend_failure_threshold=1_000_000,
        backend_error_min_requests=1_000_000,
    )
    catalog = overrides.pop("catalog", None) or catalog_for_tests(mock.url)
    settings = replace(settings, **overrides)
    tables = bind(settings)
    dynamodb, ssm = aws_clients(settings, _SESSION)
    provision(settings, catalog_json=json.dumps(catalog), dynamodb=dynamodb, ssm=ssm)
    faults = StorageFaults()
    aws = AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url, http=FaultInjectingHttp(faults))
    gateway = Gateway(settings, aws=aws)
    server = ServerThread(combined_app(gateway, observer())).start()
    return Stack(settings, tables, gateway, server, mock, ssm, dynamodb, faults)


# One botocore session for the tests' own clients (making one costs ~80 ms).
_SESSION = botocore.session.get_session()


def wait_for_events(stack: Stack, org_id: str, count: int, timeout: float = 5.0) -> list[UsageEvent]:
    """The org's usage events once there are `count` of them (settles after a disconnect run on)."""
    deadline = time.monotonic() + timeout
    while True:
        events = stack.events(org_id)
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.02)


def assert_a_plain_429(response: httpx.Response) -> None:
    """§8: a 429 carries no rate-limit headers; §1: no generation id before admission."""
    assert response.status_code == 429
    assert not [h for h in response.headers if h.lower().startswith(("x-ratelimit", "retry-after"))], response.headers
    assert "X-Neocloud-Generation-Id" not in response.headers


def sse_events(text: str) -> Iterator[str]:
    """The raw events of an SSE body, in order (comments included)."""
    for block in text.split("\n\n"):
        if block.strip():
            yield block


def data_events(text: str) -> list[Any]:
    """The parsed `data:` payloads of an SSE body; [DONE] as the string "[DONE]"."""
    out = []
    for block in sse_events(text):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


__all__ = ["TELEMETRY", "EmulatorProcess", "FaultInjectingHttp", "LedgerCheck", "stacks_on", "MockHandle", "StorageFaults", "SyncLedger", "Stack", "catalog_for_tests", "data_events", "dead_url", "make_stack", "sse_events", "wait_for_events"]


class LedgerCheck:
    """The ledger's invariants for one org, checked after every hostile request.

    Whatever a request did, once it is over: the org's in-flight count is back where it
    started, every generation id a client saw has exactly one usage event (and no event
    exists that no client saw), the credits debited equal the events' costs, exactly, and so
    does each key's spend (contract §10), while no key holds a request in flight any more.
    """

    def __init__(self, stack: "Stack", org_id: str) -> None:
        self.stack, self.org_id = stack, org_id
        start = stack.org_info(org_id)
        self.credits, self.in_flight = start.credits, start.in_flight
        self.spend = stack.key_figures(org_id)
        self.tallies = stack.key_tallies(org_id)
        self.before = {event.gen_id for event in stack.events(org_id)}  # events of earlier requests
        self.gen_ids: list[str] = []

    def saw(self, response: httpx.Response) -> httpx.Response:
        gen_id = response.headers.get("X-Neocloud-Generation-Id")
        if gen_id:
            self.gen_ids.append(gen_id)
        return response

    def check(self, timeout: float = 5.0) -> list[UsageEvent]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.stack.org_info(self.org_id)
            events = [event for event in self.stack.events(self.org_id) if event.gen_id not in self.before]
            settled = info.in_flight == self.in_flight and len(events) >= len(self.gen_ids)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert info.in_flight == self.in_flight, f"{info.in_flight - self.in_flight} slot(s) leaked: {info.leases}"
        counts: dict[str, int] = {}
        for event in events:
            counts[event.gen_id] = counts.get(event.gen_id, 0) + 1
        assert counts == {gen_id: 1 for gen_id in self.gen_ids}, f"events {counts} for the ids seen {self.gen_ids}"
        debited = self.credits - info.credits
        assert debited == sum((event.cost for event in events), Decimal(0)), (debited, [e.cost for e in events])
        check_key_figures(self.stack, self.org_id, events, self.spend, self.tallies)
        return events


def check_tallies(stack: "Stack", org_id: str, events: list[UsageEvent],
                  before: dict[tuple[str, str, str], Decimal] | None = None) -> None:
    """Each of the org's keys' tallies grew by exactly its events' costs, month by month and
    day by day: none counts a cost no event has, or misses one."""
    expected: dict[tuple[str, str, str], Decimal] = dict(before or {})
    for event in events:
        if not event.cost:
            continue
        month, day = event.created_at[:7], "d" + event.created_at[8:10]
        for name in ("month", day):
            expected[(event.key_id, month, name)] = exact_sum(expected.get((event.key_id, month, name), Decimal(0)),
                                                              event.cost)
    found = stack.key_tallies(org_id)
    assert {name: value for name, value in found.items() if value} == {
        name: value for name, value in expected.items() if value}, (found, expected)



def made_before_tallies(stack: "Stack", key_id: str, created_at: str | None = None) -> None:
    """The key as a version that kept no tallies made it: no `tallied` mark (made at `created_at`)."""
    (item,) = stack.dynamodb.query(TableName=stack.settings.keys_table, IndexName="by_key_id",
                                   KeyConditionExpression="key_id = :id",
                                   ExpressionAttributeValues={":id": {"S": key_id}})["Items"]
    made = {"UpdateExpression": "SET created_at = :made REMOVE tallied",
            "ExpressionAttributeValues": {":made": {"S": created_at}}} if created_at else {
        "UpdateExpression": "REMOVE tallied"}
    stack.dynamodb.update_item(TableName=stack.settings.keys_table, Key={"key_hash": item["key_hash"]}, **made)


def older_event(stack: "Stack", org_id: str, key_id: str, created_at: str, cost: str) -> str:
    """An event as a version that kept no tallies wrote it (no mark, in no tally): its generation id."""
    gen_id = f"gen-{secrets.token_hex(8)}"
    stack.dynamodb.put_item(TableName=stack.settings.usage_table, Item={
        "gen_id": {"S": gen_id}, "org_id": {"S": org_id}, "created_at": {"S": created_at},
        "key_id": {"S": key_id}, "model": {"S": "gpt-oss-120b"}, "endpoint": {"S": "chat.completions"},
        "streamed": {"BOOL": False}, "status": {"S": "success"}, "cost": {"N": cost}})
    return gen_id

def key_totals(figures: dict[str, Any]) -> dict[str, Decimal]:
    """key id → its spend figure (a key with a spend limit has one), from Stack.key_figures."""
    return {name.split(":")[1]: value for name, value in figures.items() if name.startswith("key_spend:")}


def with_clocked_ledger(settings: Settings, clock: Callable[[], float], use: Callable[[Any], Any]) -> Any:
    """`use(ledger)` on a fresh loop with a ledger whose clock is `clock` (admission times,
    expiries, reclaims, periods); its background work drained before the loop closes."""

    async def main():
        aws = AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url)
        ledger = ledger_of(aws, settings, clock=clock)
        try:
            return await use(ledger)
        finally:
            await ledger.drain()
            await aws.aclose()

    return asyncio.run(main())


def check_key_figures(stack: "Stack", org_id: str, events: list[UsageEvent],
                      before: dict[str, Decimal] | None = None,
                      tallies: dict[tuple[str, str, str], Decimal] | None = None) -> None:
    """Each key's spend figure grew by exactly the costs of its events admitted in the
    figure's period, and no key counts a request in flight once the org has none; each
    key's tally (its month's and each day's sums) grew by exactly its events' costs in them.
    `before` and `tallies`: the figures and tallies before `events` (none: a new org)."""
    check_tallies(stack, org_id, events, tallies)
    figures = stack.key_figures(org_id)
    if stack.org_info(org_id).in_flight == 0:
        assert not [name for name in figures if name.startswith("key_leases:")], figures
    for name, value in figures.items():
        if not name.startswith("key_spend:"):
            continue
        _, key_id, period = name.split(":")
        kind = period_kind(period)
        counted = sum((event.cost for event in events if event.key_id == key_id
                       and period_name(kind, epoch_of(event.created_at)) == period), Decimal(0))
        assert value - (before or {}).get(name, Decimal(0)) == counted, (name, value, counted)


def stacks_on(aws_url: str, mock):
    """Yields make(**settings overrides) → a running Stack over `aws_url`; all torn down after."""
    made: list[Stack] = []

    def make(**overrides) -> Stack:
        stack = make_stack(aws_url, mock, **overrides)
        made.append(stack)
        return stack

    mock.wait_for(lambda stats: stats["in_flight"] <= 0, timeout=10)
    mock.reset()
    yield make
    for stack in made:
        stack.close()
