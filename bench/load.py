"""The load generator: async httpx, bounded by a request count AND a time limit, loopback only.

`run_cell` keeps `concurrency` requests in flight until `count` requests were sent or
`time_limit` seconds passed, whichever comes first, and reports per-request latency,
time to first body byte, status codes and errors. `stream_gaps` measures when each SSE
event reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

__all__ = ["check_loopback", "percentile", "run_cell", "stream_gaps", "summarize"]

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"the bench only sends traffic to loopback addresses, not {host!r}")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(round(q / 100 * len(ordered) + 0.5))))
    return ordered[rank - 1]


def summarize(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "min": None, "max": None}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), 3),
        "p90": round(percentile(values, 90), 3),
        "p99": round(percentile(values, 99), 3),
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _client(concurrency: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(30.0),
        trust_env=False,
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )


def _check_body(raw: bytes, stream: bool) -> str | None:
    """None if the answer looks complete and right, else why not."""
    if stream:
        if b"data: [DONE]" not in raw:
            return "stream ended without data: [DONE]"
        if b'"error"' in raw.split(b"data: [DONE]")[0][-600:]:
            return "stream carried an error event"
        return None
    try:
        answer = json.loads(raw)
    except ValueError:
        return "body is not JSON"
    if not isinstance(answer, dict) or not answer.get("choices"):
        return "no choices in the answer"
    return None


async def _one(client: httpx.AsyncClient, url: str, headers: dict, body: bytes, stream: bool) -> dict[str, Any]:
    started = time.perf_counter()
    first: float | None = None
    chunks: list[bytes] = []
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            async for chunk in response.aiter_raw():
                if chunk and first is None:
                    first = time.perf_counter()
                chunks.append(chunk)
            status = response.status_code
    except (httpx.HTTPError, OSError) as exc:
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"[:200],
                "latency_ms": (time.perf_counter() - started) * 1000, "ttfb_ms": None}
    ended = time.perf_counter()
    raw = b"".join(chunks)
    problem = None if status == 200 else f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"
    if problem is None:
        problem = _check_body(raw, stream)
    return {
        "ok": problem is None,
        "status": status,
        "error": problem,
        "latency_ms": (ended - started) * 1000,
        "ttfb_ms": ((first or ended) - started) * 1000,
    }


async def _run_cell(url: str, headers: dict, body: dict, *, stream: bool, concurrency: int, count: int,
                    time_limit: float, warmup: int) -> dict[str, Any]:
    check_loopback(url)
    payload = json.dumps({**body, "stream": stream} if stream else body).encode()
    headers = {"content-type": "application/json", **headers}
    async with _client(concurrency) as client:
        # warm-up: connections open, caches filled; not counted
        for _ in range(max(0, warmup) // max(1, concurrency) or (1 if warmup else 0)):
            await asyncio.gather(*(_one(client, url, headers, payload, stream) for _ in range(concurrency)))
        results: list[dict[str, Any]] = []
        sent = 0
        started = time.perf_counter()
        deadline = started + time_limit
        stopped_by = "count"

        async def worker() -> None:
            nonlocal sent, stopped_by
            while True:
                if sent >= count:
                    return
                if time.perf_counter() >= deadline:
                    stopped_by = "time"
                    return
                sent += 1
                results.append(await _one(client, url, headers, payload, stream))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - started
    ok = [r for r in results if r["ok"]]
    errors = [r for r in results if not r["ok"]]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    samples: list[str] = []
    for r in errors:
        if r["error"] not in samples and len(samples) < 5:
            samples.append(r["error"])
    latency = [r["latency_ms"] for r in ok]
    ttfb = [r["ttfb_ms"] for r in ok if r["ttfb_ms"] is not None]
    return {
        "concurrency": concurrency,
        "stream": stream,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(errors),
        "error_samples": samples,
        "statuses": statuses,
        "duration_s": round(duration, 3),
        "stopped_by": stopped_by,
        "req_per_s": round(len(ok) / duration, 2) if duration > 0 else None,
        "latency_ms": summarize(latency),
        "ttfb_ms": summarize(ttfb),
    }


def _run(coro):
    try:
        import uvloop  # the same loop uvicorn uses; less client overhead on a small box

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def run_cell(url: str, headers: dict, body: dict, *, stream: bool, concurrency: int, count: int, time_limit: float,
             warmup: int = 16) -> dict[str, Any]:
    return _run(_run_cell(url, headers, body, stream=stream, concurrency=concurrency, count=count,
                          time_limit=time_limit, warmup=warmup))


async def _stream_gaps(url: str, headers: dict, body: dict, requests: int, time_limit: float) -> dict[str, Any]:
    check_loopback(url)
    payload = json.dumps({**body, "stream": True}).encode()
    headers = {"content-type": "application/json", **headers}
    gaps: list[float] = []
    ttft: list[float] = []
    events_per_request: list[int] = []
    reads_per_request: list[int] = []
    errors: list[str] = []
    deadline = time.perf_counter() + time_limit
    async with _client(1) as client:
        for _ in range(requests):
            if time.perf_counter() > deadline:
                break
            started = time.perf_counter()
            arrivals: list[float] = []
            pending = b""
            reads = 0
            try:
                async with client.stream("POST", url, content=payload, headers=headers) as response:
                    if response.status_code != 200:
                        errors.append(f"HTTP {response.status_code}")
                        await response.aread()
                        continue
                    async for chunk in response.aiter_raw():
                        now = time.perf_counter()
                        reads += 1
                        pending += chunk
                        while b"\n\n" in pending:
                            event, pending = pending.split(b"\n\n", 1)
                            if event.startswith(b"data: ") and event != b"data: [DONE]" and b'"choices":[]' not in event:
                                arrivals.append(now)
            except (httpx.HTTPError, OSError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            if arrivals:
                ttft.append((arrivals[0] - started) * 1000)
            # gaps between consecutive content events; the first gap (role chunk → first token) included
            gaps.extend((b - a) * 1000 for a, b in zip(arrivals, arrivals[1:], strict=False))
            events_per_request.append(len(arrivals))
            reads_per_request.append(reads)
    return {
        "requests": len(events_per_request),
        "errors": len(errors),
        "error_samples": errors[:5],
        "gap_ms": summarize(gaps),
        "gaps_ms_all": [round(g, 3) for g in gaps],
        "ttft_ms": summarize(ttft),
        "events_per_request": summarize([float(e) for e in events_per_request]),
        "reads_per_request": summarize([float(r) for r in reads_per_request]),
        "coalesced_share": round(sum(1 for g in gaps if g < 5.0) / len(gaps), 4) if gaps else None,
    }


def stream_gaps(url: str, headers: dict, body: dict, *, requests: int, time_limit: float) -> dict[str, Any]:
    return _run(_stream_gaps(url, headers, body, requests, time_limit))
