"""What one storage call costs the gateway's process, by what it is made of.

The gateway's client (`kiln.aws.AwsClient.call`: SigV4 + httpx) makes GetItem calls for the
bench org, sequentially, on uvloop as the function runs; its process CPU per call is taken
against two servers: the embedded AWS (which answers `Connection: close`, so every call opens
a TCP connection) and a stub that keeps the connection alive and answers `{}` at once (what a
pooled connection to DynamoDB looks like to the client, TLS aside). For reference, the same
calls with the same signing over a minimal HTTP/1.1 client on asyncio streams (not the
gateway's code: the floor of what a call needs in Python), and the signing alone.

Run in a child process of the project venv: `python -m bench.storageclient AWS_URL TABLE COUNT`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["measure"]

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


def measure(python: str, aws_url: str, table: str, *, count: int, env: dict[str, str]) -> dict[str, Any]:
    stub = subprocess.Popen([python, "-c", STUB], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(stub.stdout.readline())
        done = subprocess.run([python, "-m", "bench.storageclient", aws_url, f"http://127.0.0.1:{port}", table, str(count)],
                              capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=300)
        if done.returncode != 0:
            return {"error": done.stderr[-800:]}
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        stub.kill()
        stub.wait()


class _MinimalClient:
    """POST + JSON over HTTP/1.1 on asyncio streams, one kept-alive connection at a time."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port, self.netloc = parts.hostname, parts.port, parts.netloc
        self.idle: list = []

    async def call(self, sign, target: str, body: bytes) -> dict:
        import asyncio

        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        headers = sign(self.netloc, target, body)
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


def _run(aws_url: str, stub_url: str, table: str, count: int) -> dict[str, Any]:
    from datetime import datetime, timezone

    import uvloop

    from kiln.aws import AwsClient, Credentials, sign

    payload = {"TableName": table, "Key": {"org_id": {"S": "bench"}}, "ConsistentRead": True}
    credentials = Credentials("testing", "testing")
    keys: dict = {}

    def signer(host: str, target: str, body: bytes) -> dict:
        headers = {"content-type": "application/x-amz-json-1.0", "x-amz-target": target}
        return {**headers, **sign(credentials=credentials, region="us-east-1", service="dynamodb", host=host,
                                  headers=headers, body=body, now=datetime.now(timezone.utc), signing_keys=keys)}

    async def timed(call, n: int) -> dict[str, float]:
        for _ in range(20):
            await call()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            await call()
        return {"cpu_ms_per_call": round((time.process_time() - cpu) * 1000 / n, 3),
                "wall_ms_per_call": round((time.perf_counter() - wall) * 1000 / n, 3)}

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"count": count, "loop": "uvloop"}
        for name, url in (("embedded AWS (Connection: close)", aws_url), ("keep-alive stub", stub_url)):
            client = AwsClient(region="us-east-1", endpoint_url=url, credentials=lambda: credentials)
            answer = await client.dynamodb("GetItem", payload) if url == aws_url else None
            if answer is not None and "Item" not in answer:
                raise SystemExit(f"GetItem found no bench org: {answer}")
            out[f"kiln.aws.AwsClient.call, {name}"] = await timed(lambda c=client: c.dynamodb("GetItem", payload), count)
            await client.aclose()
            minimal = _MinimalClient(url)
            out[f"minimal asyncio-streams client (reference), {name}"] = await timed(
                lambda m=minimal: m.call(signer, "DynamoDB_20120810.GetItem",
                                         json.dumps(payload, separators=(",", ":")).encode()), count)
        body = json.dumps(payload, separators=(",", ":")).encode()
        started = time.process_time()
        for _ in range(count):
            signer("127.0.0.1:1", "DynamoDB_20120810.GetItem", body)
        out["SigV4 signing alone"] = {"cpu_ms_per_call": round((time.process_time() - started) * 1000 / count, 3)}
        return out

    return uvloop.run(main())


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
