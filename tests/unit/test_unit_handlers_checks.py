"""kiln.handlers.checks: the contract's first checks (§2 steps 1-3, and the catalog), answered in
its order: the maintenance flag first and alone, then, when a cache is cold, the key's and the
catalog's reads at once beside the body's upload; with every cache warm, no I/O and no task."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from kiln.errors import InvalidApiKey, InvalidJson, Maintenance
from kiln.handlers import checks, read_json

READ_S = 0.2


class FakeGateway:
    """The gateway's check methods, each read taking READ_S unless its cache is warm."""

    def __init__(self, *, warm: bool = False, maintenance: bool = False, key_ok: bool = True) -> None:
        self.is_warm = warm
        self.maintenance_on = maintenance
        self.key_ok = key_ok
        self.settings = SimpleNamespace(max_body_bytes=1024)
        self.auth = SimpleNamespace(authenticate=self._authenticate)
        self.reads: list[str] = []
        self.in_flight = self.most_in_flight = 0

    def warm(self, authorization, *, catalog=True) -> bool:
        return self.is_warm

    async def _read(self, what: str) -> None:
        self.reads.append(what)
        if self.is_warm:
            return
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(READ_S)
        finally:
            self.in_flight -= 1

    async def check_maintenance(self) -> None:
        await self._read("maintenance")
        if self.maintenance_on:
            raise Maintenance("down", "60")

    async def _authenticate(self, credential):
        await self._read("key")
        if not self.key_ok:
            raise InvalidApiKey("bad key")
        return SimpleNamespace(org_id="org-1", credential=credential)

    async def storage(self, call):
        return await call

    async def catalog(self):
        await self._read("catalog")
        return ["a catalog"]


def request_with(body: bytes, *, upload_s: float = 0.0, length: bytes | None = None) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
        (b"authorization", b"Bearer sk-test"), (b"content-length", str(len(body)).encode() if length is None else length)]}
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            await asyncio.sleep(upload_s)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    return Request(scope, receive)


def body_reader(request: Request):
    return read_json(request, 1024)


@pytest.mark.parametrize("length", ["\u00b2".encode("latin-1"), b"\xb9\xb2", b"+8"], ids=["superscript-two", "two-digits", "signed"])
def test_a_declared_length_int_cannot_read_is_no_failure(length):
    """"²" is a digit to str.isdigit, not to int: the declared length is not believed, and the
    body as read is what counts (a server in front may pass such a header on)."""
    assert asyncio.run(read_json(request_with(b'{"a": 1}', length=length), 1024)) == {"a": 1}


def test_on_cold_caches_the_reads_run_at_once_beside_the_upload():
    gateway = FakeGateway()

    async def main():
        started = time.monotonic()
        principal, body, catalog = await checks(gateway, request_with(b'{"a": 1}', upload_s=READ_S),
                                                read_body=body_reader, catalog=True)
        return time.monotonic() - started, principal, body, catalog

    elapsed, principal, body, catalog = asyncio.run(main())
    assert body == {"a": 1} and catalog == ["a catalog"] and principal.credential == "Bearer sk-test"
    assert gateway.reads[0] == "maintenance" and sorted(gateway.reads[1:]) == ["catalog", "key"]
    assert gateway.most_in_flight == 2  # the key and the catalog, together
    # the flag's read, then one read's time for the key, the catalog and the upload together
    # (one after the other: the flag, the upload, then the key and catalog, 3 × READ_S)
    assert elapsed < 2.5 * READ_S


def test_while_maintenance_is_on_nothing_else_is_read_not_even_the_body():
    gateway = FakeGateway(maintenance=True, key_ok=False)

    async def main():
        started = time.monotonic()
        with pytest.raises(Maintenance):
            await checks(gateway, request_with(b"{}", upload_s=5), read_body=body_reader, catalog=True)
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    assert gateway.reads == ["maintenance"]
    assert elapsed < 2 * READ_S  # not the stalled upload's 5 s


def test_with_warm_caches_the_checks_run_in_order_with_no_task():
    gateway = FakeGateway(warm=True)

    async def main():
        made = []
        loop = asyncio.get_running_loop()
        loop.set_task_factory(lambda loop, coro, **kw: made.append(coro) or asyncio.Task(coro, loop=loop, **kw))
        result = await checks(gateway, request_with(b"{}"), read_body=body_reader, catalog=True)
        return result, len(made)

    (_, body, _), new_tasks = asyncio.run(main())
    assert body == {} and new_tasks == 0
    assert gateway.reads == ["maintenance", "key", "catalog"]


@pytest.mark.parametrize("warm", [False, True])
def test_answers_keep_the_contracts_order_whichever_read_ends_first(warm):
    async def answer(gateway, body):
        with pytest.raises(Exception) as raised:
            await checks(gateway, request_with(body), read_body=body_reader, catalog=True)
        return type(raised.value)

    # maintenance before a bad body and a bad key; a bad body before a bad key
    assert asyncio.run(answer(FakeGateway(warm=warm, maintenance=True, key_ok=False), b"not json")) is Maintenance
    assert asyncio.run(answer(FakeGateway(warm=warm, key_ok=False), b"not json")) is InvalidJson
    assert asyncio.run(answer(FakeGateway(warm=warm, key_ok=False), b"{}")) is InvalidApiKey


def test_a_client_gone_during_the_upload_leaves_no_read_running():
    gateway = FakeGateway()

    async def main():
        task = asyncio.ensure_future(checks(gateway, request_with(b"{}", upload_s=5), read_body=body_reader,
                                            catalog=True))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
    assert gateway.in_flight == 0


@pytest.mark.parametrize("failure", [RuntimeError, asyncio.CancelledError])
def test_a_body_read_that_fails_unexpectedly_leaves_no_read_unawaited_or_unretrieved(failure):
    """A fault, or the request's cancellation, while the key's and the catalog's reads run beside
    the body's: the reads are stopped, and nothing is left for the event loop to complain of
    (a coroutine never awaited, a gathered exception never retrieved)."""
    import gc
    import warnings

    complaints: list[str] = []

    async def failing_body(request):  # fails before the reads beside it have started
        raise failure("a fault in reading the body")

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: complaints.append(context["message"]))
        raised = False
        try:
            await checks(FakeGateway(), request_with(b"{}"), read_body=failing_body, catalog=True)
        except failure:
            raised = True  # (no reference to it is kept: what it holds is collected below)
        assert raised
        await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert complaints == [] and [str(w.message) for w in caught] == []
