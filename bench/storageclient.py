"""What one storage call costs the gateway's process, by what it is made of.

The gateway's storage client (`kiln.aws.AwsClient.call`: SigV4 over the gateway's own HTTP/1.1
client, `kiln.http1`) makes GetItem calls for the bench org, sequentially, on uvloop as the
function runs; its process CPU per call is taken against two servers: the embedded AWS (since
400f7f0 served by uvicorn, which keeps connections alive; before, werkzeug closed every one) and
a stub that keeps the connection alive and answers `{}` at once (what a pooled connection to
DynamoDB looks like to the client, TLS aside).

Then the transport alone, the same signed request each time: `kiln.http1.HttpClient` (request +
read), httpx's `AsyncClient.post` as the reference general-purpose client (what the gateway used
until 2e3c924), and a bare HTTP/1.1 exchange on asyncio streams (the floor of what a call needs
in Python); and the signing alone. Each client's TCP connects per call are counted, so a server
that closes connections shows.

Older versions of the gateway that have a `kiln.aws` (3360189: the same SigV4 over httpx) are
measured the same way in their own process, their layer first on PYTHONPATH: whole
`AwsClient.call`s, as their gateway made them.

Run in a child process of the project venv:
`python -m bench.storageclient AWS_URL STUB_URL TABLE COUNT [--aws-client-only]`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["measure"]

ROOT = Path(__file__).resolve().parents[1]

STUB = r'''
import asyncio, sys
RESP = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-amz-json-1.0\r\nContent-Length: 2\r\n"
        b"x-amzn-RequestId: stub\r\n\r\n{}")
class Stub(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in self.buffer[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(RESP)
async def main():
    server = await asyncio.get_running_loop().create_server(Stub, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
'''


def measure(python: str, aws_url: str, table: str, *, count: int, env: dict[str, str],
            versions: dict[str, Path] | None = None) -> dict[str, Any]:
    """This tree's client and transports; then each older version's whole AwsClient.call, if it has one."""
    stub = subprocess.Popen([python, "-c", STUB], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(stub.stdout.readline())
        argv = [python, "-m", "bench.storageclient", aws_url, f"http://127.0.0.1:{port}", table, str(count)]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        if done.returncode != 0:
            return {"error": done.stderr[-800:]}
        out = json.loads(done.stdout.strip().splitlines()[-1])
        out["versions"] = {}
        for label, tree in (versions or {}).items():
            if not (tree / "layers" / "gateway" / "kiln" / "aws.py").exists():
                out["versions"][label] = {"skipped": "no kiln.aws at this version (botocore, in a worker thread)"}
                continue
            old_env = {**env, "PYTHONPATH": str(tree / "layers" / "gateway")}
            done = subprocess.run([*argv, "--aws-client-only"], capture_output=True, text=True, env=old_env, cwd=ROOT,
                                  timeout=300)
            out["versions"][label] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                      else {"error": done.stderr[-800:]})
        return out
    finally:
        stub.kill()
        stub.wait()


_CONNECTS = {"n": 0}


def _count_connects() -> None:
    """Count TCP connections opened: asyncio.open_connection (kiln.http1, the bare client) and
    httpcore's connection set-up (httpx)."""
    import asyncio

    original = asyncio.open_connection

    async def open_connection(*args, **kwargs):
        _CONNECTS["n"] += 1
        return await original(*args, **kwargs)

    asyncio.open_connection = open_connection
    try:
        from httpcore._async.connection import AsyncHTTPConnection
    except ImportError:
        return
    connect = AsyncHTTPConnection._connect

    async def _connect(self, *args, **kwargs):
        _CONNECTS["n"] += 1
        return await connect(self, *args, **kwargs)

    AsyncHTTPConnection._connect = _connect


class _MinimalClient:
    """POST + JSON over HTTP/1.1 on asyncio streams, one kept-alive connection at a time."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port, self.netloc = parts.hostname, parts.port, parts.netloc
        self.idle: list = []

    async def call(self, headers: dict, body: bytes) -> dict:
        import asyncio

        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"POST / HTTP/1.1\r\nhost: {self.netloc}\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body)
        raw = await reader.readuntil(b"\r\n\r\n")
        length, close = 0, False
        for line in raw.decode("latin-1").split("\r\n")[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
        data = await reader.readexactly(length)
        if close:
            writer.close()
        else:
            self.idle.append((reader, writer))
        return json.loads(data) if data else {}


def _run(aws_url: str, stub_url: str, table: str, count: int, aws_client_only: bool) -> dict[str, Any]:
    import inspect
    from datetime import datetime, timezone
    from urllib.parse import urlsplit

    import uvloop

    import kiln.aws
    from kiln.aws import AwsClient, Credentials, sign

    _count_connects()
    payload = {"TableName": table, "Key": {"org_id": {"S": "bench"}}, "ConsistentRead": True}
    body = json.dumps(payload, separators=(",", ":")).encode()
    credentials = Credentials("testing", "testing")
    keys: dict = {}

    def signed(url: str) -> dict:
        headers = {"content-type": "application/x-amz-json-1.0", "x-amz-target": "DynamoDB_20120810.GetItem"}
        # since 7259304 sign() takes the whole URL (and returns Host), as botocore signs; before, the host
        where = {"url": f"{url}/"} if "url" in inspect.signature(sign).parameters else {"host": urlsplit(url).netloc}
        return {**headers, **sign(credentials=credentials, region="us-east-1", service="dynamodb", headers=headers,
                                  body=body, now=datetime.now(timezone.utc), signing_keys=keys, **where)}

    async def timed(call, n: int) -> dict[str, float]:
        for _ in range(20):
            await call()
        connects0 = _CONNECTS["n"]
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            await call()
        return {"cpu_ms_per_call": round((time.process_time() - cpu) * 1000 / n, 3),
                "wall_ms_per_call": round((time.perf_counter() - wall) * 1000 / n, 3),
                "tcp_connects_per_call": round((_CONNECTS["n"] - connects0) / n, 3)}

    servers = (("embedded AWS", aws_url), ("keep-alive stub", stub_url))

    async def main() -> dict[str, Any]:
        transport = "kiln.http1" if hasattr(kiln, "http1") or "kiln.http1" in sys.modules else "httpx"
        out: dict[str, Any] = {"count": count, "loop": "uvloop", "kiln_aws": str(Path(kiln.aws.__file__).parent.parent),
                               "aws_client_transport": transport, "clients": {}}
        for server, url in servers:
            client = AwsClient(region="us-east-1", endpoint_url=url, credentials=lambda: credentials)
            if url == aws_url and "Item" not in await client.dynamodb("GetItem", payload):
                raise SystemExit("GetItem found no bench org")
            out["clients"].setdefault(f"kiln.aws.AwsClient.call ({transport})", {})[server] = await timed(
                lambda c=client: c.dynamodb("GetItem", payload), count)
            await client.aclose()
        if aws_client_only:
            return out

        import httpx

        from kiln.http1 import HttpClient
        from kiln.tls import client_context

        for server, url in servers:
            own = HttpClient(ssl_context=client_context)

            async def own_call(url=url, own=own):
                response = await own.request("POST", url + "/", headers=signed(url), body=body, connect_timeout=5,
                                             read_timeout=5)
                return json.loads(await response.read() or b"{}")

            out["clients"].setdefault("kiln.http1.HttpClient: request + read", {})[server] = await timed(own_call, count)
            await own.aclose()
            async with httpx.AsyncClient(timeout=5.0, trust_env=False, verify=False) as reference:
                async def httpx_call(url=url, reference=reference):
                    return (await reference.post(url + "/", content=body, headers=signed(url))).json()

                out["clients"].setdefault("httpx.AsyncClient.post (reference)", {})[server] = await timed(httpx_call, count)
            minimal = _MinimalClient(url)
            out["clients"].setdefault("bare asyncio-streams exchange (floor)", {})[server] = await timed(
                lambda m=minimal, url=url: m.call(signed(url), body), count)
        started = time.process_time()
        for _ in range(count):
            signed("http://127.0.0.1:1")
        out["signing_cpu_ms_per_call"] = round((time.process_time() - started) * 1000 / count, 3)
        return out

    return uvloop.run(main())


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), "--aws-client-only" in sys.argv[5:])))
