"""The bench's probe, loaded into a gateway process through PYTHONPATH (functions/run.sh keeps
the PYTHONPATH it is given after /opt/python and the task root), only when BENCH_PROBE=1.

It changes nothing the gateway does; it watches:
- every storage call (DynamoDB, SSM): the request path makes them all through
  `kiln.aws.AwsClient.call(service, operation, payload)`, a coroutine on the event loop, which
  is wrapped to record service, operation, read/write, wall time (retries included), the
  time spent in the HTTP exchange for it (`kiln.http1.HttpClient.request`, connect if needed,
  request, status line and headers, plus `Response.read`, the body), the TCP connections it
  opened, whether the server let the connection be kept alive, and the CPU of its own steps:
  the wrapped coroutine is driven step by step and the loop thread's CPU clock is read around
  each step, so the CPU of other requests' steps, which run while this one awaits, is not
  counted (asyncio's transport callbacks for its socket are not counted either: no
  coroutine frame is on the stack then);
- the upstream's first byte: `kiln.http1.HttpClient.request` returning (status line and
  headers in) for a request that is not a storage call (a contextvar set inside the
  AwsClient.call wrapper tells them apart: storage and model servers share one HttpClient);
  also the TCP connections each request opened to a model server (a pooled one is reused);
- the gateway's HttpClient instances, so that the side channel can say how many connections
  are open (`HttpClient.open_connections`) and how many idle in each origin's pool;
- each HTTP request, through an ASGI wrapper around the app uvicorn loads, which also
  answers GET /__bench/stats and POST /__bench/reset (the side channel).
Everything runs on the event loop, so each storage call is charged to the request whose task
(or a task it started: asyncio copies the context) made it. Calls made from
`Authenticator._touch` (a key's last_used_at, written off the request path in its own task)
are marked `background` and are not counted as the request's.

kiln is patched when uvicorn loads the app (kiln is imported by then), so the probe itself
imports neither kiln nor any HTTP client before the gateway does. A gateway older than
kiln.http1 (httpx inside) gets the same hooks on httpx, and only if it imported httpx itself:
the probe never imports a client the gateway does not use. `hooks` in the stats says which
were installed, and a request whose upstream first byte was not seen is counted as such
(never as "no write before it").
"""

import os

if os.environ.get("BENCH_PROBE") == "1":
    import collections
    import contextvars
    import json
    import threading
    import time

    _CURRENT = contextvars.ContextVar("bench_request", default=None)
    _AWS_CALL = contextvars.ContextVar("bench_aws_call", default=None)  # the storage call in progress, if any
    _BACKGROUND = contextvars.ContextVar("bench_background", default=False)
    _LOCK = threading.Lock()
    READS = {"GetItem", "Query", "Scan", "BatchGetItem", "TransactGetItems", "GetParameter", "GetParameters",
             "GetParametersByPath", "DescribeTable"}

    class _State:
        def __init__(self):
            self.reset()

        def reset(self):
            self.since = time.monotonic()
            self.cpu0 = time.process_time()
            self.requests = collections.deque(maxlen=20000)
            self.outside = []  # storage calls made outside any request (none expected)
            self.background = []  # storage calls made off the request path (Authenticator._touch)
            self.ops = collections.Counter()

    STATE = _State()
    HOOKS = []  # which hooks were installed (the stats say so)
    import weakref

    CLIENTS = weakref.WeakSet()  # the gateway's kiln.http1.HttpClient instances

    class _Request:
        __slots__ = ("path", "start", "answered", "end", "first_upstream_byte", "calls", "status",
                     "upstream_connects", "upstream_requests")

        def __init__(self, path):
            self.path = path
            self.start = time.perf_counter()
            self.answered = None  # the last body byte handed to the server: the client has its answer
            self.end = None  # the app returned: work done after the answer (telemetry) included
            self.first_upstream_byte = None
            self.calls = []
            self.status = None
            self.upstream_connects = 0  # new TCP connections to a model server
            self.upstream_requests = 0

        def as_dict(self):
            return {
                "path": self.path,
                "status": self.status,
                "start": self.start,
                "duration_ms": (self.end - self.start) * 1000 if self.end else None,
                "answered_ms": (self.answered - self.start) * 1000 if self.answered else None,
                "upstream_first_byte_ms": (self.first_upstream_byte - self.start) * 1000
                if self.first_upstream_byte else None,
                "calls": self.calls,
                "upstream_connects": self.upstream_connects,
                "upstream_requests": self.upstream_requests,
            }

    # -- CPU of one coroutine's own steps --------------------------------------------------

    class _StepCpu:
        """Await `coro`, adding the loop thread's CPU time over each of its steps to `cpu`."""

        __slots__ = ("coro", "cpu")

        def __init__(self, coro):
            self.coro = coro
            self.cpu = 0.0

        def __await__(self):
            coro, clock = self.coro, time.thread_time
            value, error = None, None
            while True:
                c0 = clock()
                try:
                    yielded = coro.send(value) if error is None else coro.throw(error)
                except StopIteration as stop:
                    self.cpu += clock() - c0
                    return stop.value
                except BaseException:
                    self.cpu += clock() - c0
                    raise
                self.cpu += clock() - c0
                value, error = None, None
                try:
                    value = yield yielded
                except BaseException as exc:  # cancellation, close: handed to the coroutine
                    error = exc

    # -- storage: kiln.aws.AwsClient.call ------------------------------------------------------

    def _patch_kiln():
        import kiln.aws

        cls = kiln.aws.AwsClient
        if getattr(cls.call, "_bench_probe", False):
            return
        original = cls.call

        async def call(self, service, operation, payload, **options):
            record = {
                "service": service,
                "op": operation,
                "kind": "read" if operation in READS else "write",
                "start": time.perf_counter(),
                "wire_ms": 0.0,  # in the HTTP exchange (request + body read), summed over attempts
                "sends": 0,
                "connects": 0,
                "connection_close": False,
                "background": _BACKGROUND.get(),
                "error": None,
            }
            token = _AWS_CALL.set(record)
            timed = _StepCpu(original(self, service, operation, payload, **options))
            try:
                return await timed
            except BaseException as exc:
                record["error"] = getattr(exc, "code", None) or type(exc).__name__
                raise
            finally:
                _AWS_CALL.reset(token)
                record["ms"] = (time.perf_counter() - record["start"]) * 1000
                record["cpu_ms"] = timed.cpu * 1000
                request = _CURRENT.get()
                with _LOCK:
                    STATE.ops[f"{service}.{operation}"] += 1
                    if record["background"]:
                        STATE.background.append(record)
                    elif request is not None:
                        request.calls.append(record)
                    else:
                        STATE.outside.append(record)

        call._bench_probe = True
        cls.call = call
        HOOKS.append("kiln.aws.AwsClient.call")

        try:
            import kiln.auth

            auth = kiln.auth.Authenticator
            touch = auth._touch

            async def _touch(self, *args, **kwargs):
                _BACKGROUND.set(True)  # this task's own context: the request's is not affected
                return await touch(self, *args, **kwargs)

            auth._touch = _touch
        except (ImportError, AttributeError):
            pass

    # -- kiln.http1: the HTTP part of storage calls, the upstream's first byte, connections ---

    def _upstream_answered():
        current = _CURRENT.get()
        if current is not None:
            current.upstream_requests += 1
            if current.first_upstream_byte is None:
                current.first_upstream_byte = time.perf_counter()

    def _count_connect():
        """A new TCP connection: to storage while a storage call runs, otherwise upstream."""
        aws = _AWS_CALL.get()
        if aws is not None:
            aws["connects"] += 1
            return
        current = _CURRENT.get()
        if current is not None:
            current.upstream_connects += 1

    async def _timed_aws_send(aws, send):
        """Await one storage exchange, adding its wire time to the storage call's record."""
        t0 = time.perf_counter()
        try:
            return await send
        finally:
            aws["wire_ms"] += (time.perf_counter() - t0) * 1000
            aws["sends"] += 1

    def _patch_http1():
        try:
            import kiln.http1 as http1
        except ImportError:  # a gateway from before kiln.http1
            return
        client = http1.HttpClient
        if getattr(client.request, "_bench_probe", False):
            return
        init_original, request_original = client.__init__, client.request
        connection_original, read_original = client._connection, http1.Response.read

        def __init__(self, *args, **kwargs):
            init_original(self, *args, **kwargs)
            CLIENTS.add(self)

        async def request(self, method, url, **kwargs):
            aws = _AWS_CALL.get()
            if aws is None:
                response = await request_original(self, method, url, **kwargs)
                _upstream_answered()
                return response
            response = await _timed_aws_send(aws, request_original(self, method, url, **kwargs))
            message = getattr(response, "_message", None)
            if (response.header("connection") or "").lower() == "close" or (
                    message is not None and not message.keep_alive):
                aws["connection_close"] = True
            return response

        async def _connection(self, origin, connect_timeout):
            connection = await connection_original(self, origin, connect_timeout)
            if not connection.reused:  # just opened (a pooled one is marked reused when taken)
                _count_connect()
            return connection

        async def read(self, *args, **kwargs):
            aws = _AWS_CALL.get()
            if aws is None:
                return await read_original(self, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return await read_original(self, *args, **kwargs)
            finally:
                aws["wire_ms"] += (time.perf_counter() - t0) * 1000

        request._bench_probe = True
        client.__init__, client.request, client._connection = __init__, request, _connection
        http1.Response.read = read
        HOOKS.append("kiln.http1.HttpClient.request/_connection, Response.read")

    # -- httpx (a gateway from before kiln.http1): the same, only if the gateway imported it ---

    def _patch_httpx():
        import sys

        httpx = sys.modules.get("httpx")
        if httpx is None:
            return
        send_original = httpx.AsyncClient.send
        if getattr(send_original, "_bench_probe", False):
            return

        async def send(self, request, **kwargs):
            aws = _AWS_CALL.get()
            if aws is not None:
                response = await _timed_aws_send(aws, send_original(self, request, **kwargs))
                if response.headers.get("connection", "").lower() == "close":
                    aws["connection_close"] = True
                return response
            response = await send_original(self, request, **kwargs)
            _upstream_answered()
            return response

        send._bench_probe = True
        httpx.AsyncClient.send = send
        HOOKS.append("httpx.AsyncClient.send")

        try:  # new TCP connections opened for storage calls
            from httpcore._async.connection import AsyncHTTPConnection

            connect_original = AsyncHTTPConnection._connect

            async def _connect(self, *args, **kwargs):
                _count_connect()
                return await connect_original(self, *args, **kwargs)

            AsyncHTTPConnection._connect = _connect
        except (ImportError, AttributeError):
            pass

    # -- the app ---------------------------------------------------------------------------

    def _stats():
        with _LOCK:
            requests = [r.as_dict() for r in STATE.requests]
            outside = list(STATE.outside)
            background = list(STATE.background)
            ops = dict(STATE.ops)
        return {
            "pid": os.getpid(),
            "seconds": time.monotonic() - STATE.since,
            "process_cpu_s": time.process_time() - STATE.cpu0,
            "threads": threading.active_count(),
            "requests": requests,
            "outside_calls": outside,
            "background_calls": background,
            "ops": ops,
            "hooks": list(HOOKS),
            "http_clients": _clients(),
        }

    def _clients():
        out = []
        for client in list(CLIENTS):
            idle = getattr(client, "_idle", {}) or {}
            out.append({
                "open_connections": getattr(client, "open_connections", None),
                "idle": {f"{scheme}://{host}:{port}": len(pool) for (scheme, host, port), pool in idle.items()},
            })
        return out

    class Probe:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            path = scope.get("path", "")
            if path.startswith("/__bench/"):
                if path == "/__bench/reset":
                    with _LOCK:
                        STATE.reset()
                    body = b'{"reset":true}'
                else:
                    body = json.dumps(_stats()).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
            request = _Request(path)
            token = _CURRENT.set(request)

            async def observed(message):
                if message["type"] == "http.response.start":
                    request.status = message["status"]
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    request.answered = time.perf_counter()

            try:
                await self.app(scope, receive, observed)
            finally:
                request.end = time.perf_counter()
                _CURRENT.reset(token)
                if path != "/healthz":
                    with _LOCK:
                        STATE.requests.append(request)

    import uvicorn.config

    _load = uvicorn.config.Config.load

    def load(self):
        _load(self)
        for patch in (_patch_http1, _patch_httpx, _patch_kiln):
            try:
                patch()
            except Exception as exc:  # noqa: BLE001 - a probe never breaks the gateway; it says so
                print(f"bench probe: {patch.__name__} failed: {type(exc).__name__}: {exc}", flush=True)
        self.loaded_app = Probe(self.loaded_app)

    uvicorn.config.Config.load = load


if os.environ.get("BENCH_CALL_COUNT"):
    # A measure of the gateway's work that the machine's load does not change: the Python function
    # calls (cProfile's count, builtins included) the loop thread makes between SIGUSR1 and SIGUSR2,
    # written as JSON to the file BENCH_CALL_COUNT names. Independent of the probe above.
    import cProfile
    import json
    import signal

    _COUNTER = cProfile.Profile()

    def _count(signum, frame):  # noqa: ARG001
        if signum == signal.SIGUSR1:
            _COUNTER.enable()
            return
        _COUNTER.disable()
        stats = _COUNTER.getstats()
        calls = sum(entry.callcount for entry in stats)
        with open(os.environ["BENCH_CALL_COUNT"], "w") as out:
            json.dump({"calls": calls}, out)

    signal.signal(signal.SIGUSR1, _count)
    signal.signal(signal.SIGUSR2, _count)
