"""The measurements: latency matrix, where Kiln's time goes, chunk gaps, SSE cost, memory."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from .load import run_cell, stream_gaps, summarize
from .procs import Child, cpu_seconds, peak_rss_mb, rss_mb
from .stack import GAP_DELAY_MS, GAP_MODEL, GAP_TOKENS, MODEL, Stack

__all__ = ["BODY", "Target", "ab_versions", "chunk_gaps", "latency_matrix", "memory", "profile_gateway", "sse_cost",
           "where_time_goes"]

BODY = {
    "model": MODEL,
    "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}],
    "max_tokens": 32,
    "stream_options": {"include_usage": True},
}


def _body(stream: bool, model: str = MODEL) -> dict:
    body = {**BODY, "model": model}
    if not stream:
        body.pop("stream_options")
    return body


class Target:
    """Something that serves /v1/chat/completions: its base URL, headers, and the process to watch."""

    def __init__(self, name: str, base: str, headers: dict, child: Child | None = None,
                 restart: Callable[[], "Target"] | None = None, gap_base: str | None = None, gap_headers: dict | None = None,
                 concurrencies: tuple[int, ...] | None = None, after_cell: Callable[["Target"], dict] | None = None,
                 gaps: bool = True):
        self.name, self.base, self.headers, self.child = name, base, headers, child
        self.restart = restart
        self.concurrencies = concurrencies  # None: every concurrency of the matrix
        self.after_cell = after_cell  # what else to record after each cell (e.g. the probe's storage wait)
        self.gaps = gaps  # measured in the chunk-gap scenario too
        self.gap_base = gap_base or base
        self.gap_headers = gap_headers if gap_headers is not None else headers
        self.problems: list[str] = []
        self.crashed = False

    @property
    def url(self) -> str:
        return f"{self.base}/chat/completions"

    def start_fresh(self) -> None:
        """A fresh process in place of this one, if the target is restartable (its URLs follow)."""
        if self.restart is not None:
            fresh = self.restart()
            self.child, self.base, self.gap_base = fresh.child, fresh.base, fresh.gap_base

    def check_alive(self) -> bool:
        if self.child is not None and not self.child.alive() and not self.crashed:
            self.crashed = True
            self.problems.append(f"crashed: {self.child.describe_death()}")
        return not self.crashed


def _established_to(pid: int, port: int) -> int | None:
    """ESTABLISHED TCP sockets of process `pid` whose remote port is `port` (from /proc)."""
    try:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = fd.readlink().as_posix()
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        count = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                parts = line.split()
                remote_port = int(parts[2].rsplit(":", 1)[1], 16)
                if parts[3] == "01" and remote_port == port and parts[9] in inodes:
                    count += 1
        return count
    except OSError:
        return None


def latency_matrix(targets: list[Target], *, modes: tuple[bool, ...], concurrencies: tuple[int, ...], count: int,
                   time_limit: float, warmup: int, mock_port: int, log: Callable[[str], None],
                   others: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Every target × mode × concurrency, cells interleaved by target within each (mode, concurrency)
    so that slow drifts of the machine hit every target alike."""
    cells = []
    for stream in modes:
        for concurrency in concurrencies:
            for target in targets:
                if target.concurrencies is not None and concurrency not in target.concurrencies:
                    continue
                cell: dict[str, Any] = {"target": target.name, "mode": "stream" if stream else "buffered",
                                        "concurrency": concurrency}
                # a fresh process per cell: one cell's state (caches, leaks) never spills into the next
                target.start_fresh()
                if not target.check_alive():
                    cell.update(skipped="target crashed earlier: " + target.problems[-1][:300])
                    cells.append(cell)
                    log(f"  {target.name:8s} {cell['mode']:8s} c={concurrency:<2d} SKIPPED (crashed)")
                    continue
                watched = {**(others or {})}
                if target.child is not None:
                    watched[target.name] = target.child.pid
                before = {name: cpu_seconds(pid, tree=True) for name, pid in watched.items()}
                before["load generator"] = time.process_time()
                result = run_cell(target.url, target.headers, _body(stream), stream=stream, concurrency=concurrency,
                                  count=count, time_limit=time_limit, warmup=warmup)
                after = {name: cpu_seconds(pid, tree=True) for name, pid in watched.items()}
                after["load generator"] = time.process_time()
                sent = result["requests"] + (max(0, warmup) // max(1, concurrency) or (1 if warmup else 0)) * concurrency
                cell.update(result)
                # CPU per request of every process in the path (warm-up requests included in the count)
                cell["cpu_ms_per_request"] = {
                    name: round((after[name] - before[name]) * 1000 / sent, 3)
                    for name in after if before.get(name) is not None and after[name] is not None and sent}
                if target.child is not None:
                    cell["target_rss_mb"] = rss_mb(target.child.pid, tree=True)
                    cell["target_peak_rss_mb"] = peak_rss_mb(target.child.pid, tree=True)
                    cell["upstream_sockets_open"] = _established_to(target.child.pid, mock_port)
                if target.after_cell is not None and target.check_alive():
                    try:
                        cell.update(target.after_cell(target))
                    except Exception as exc:  # noqa: BLE001 - the cell stays; it says what is missing
                        cell["after_cell_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if not target.check_alive():
                    cell["crashed"] = target.problems[-1][:1000]
                cells.append(cell)
                lat, ttfb = result["latency_ms"], result["ttfb_ms"]
                log(f"  {target.name:8s} {cell['mode']:8s} c={concurrency:<2d} n={result['requests']:<4d} "
                    f"err={result['errors']:<4d} p50={lat['p50']} p99={lat['p99']} ttfb50={ttfb['p50']} "
                    f"rps={result['req_per_s']}" + (f" sockets→mock={cell.get('upstream_sockets_open')}"
                                                    if target.name == "kiln" else ""))
    return cells


# -- where Kiln's time goes ----------------------------------------------------------------

def cpu_rounds(targets: list[Target], *, modes: tuple[bool, ...], concurrencies: tuple[int, ...], rounds: int,
               count: int, warmup: int, log: Callable[[str], None], spaced: tuple[Target, ...] = (),
               spaced_counts: dict[int, int] | None = None) -> dict[str, Any]:
    """CPU per request of each target's own process, `rounds` times per mode and concurrency, the
    targets side by side (their order reversed every other round), each time over `count` requests
    after `warmup` that are not counted; a target the matrix restarts gets a fresh process each time.

    One matrix cell of a few hundred requests moves by tens of percent from run to run on this
    machine, for every gateway; the median of rounds taken side by side, with their range, is the
    figure the CPU goal compares.

    The streams of `modes` come from the mock at once, in one or two reads: what a gateway does per
    chunk, most of a real stream's cost, is barely in them. With `spaced` (targets that serve the
    spaced-token model: GAP_MODEL, a token every GAP_DELAY_MS, each its own read), the same rounds
    are taken of those streams too (`spaced_c{N}`), `spaced_counts[N]` requests at concurrency N
    (fewer: each takes over a second), after one wave not counted."""
    cells: dict[str, dict[str, Any]] = {}

    def take(key: str, members: list[Target], *, stream: bool, concurrency: int, n: int, first: int,
             spaced_stream: bool = False) -> None:
        raw: dict[str, list[dict[str, Any]]] = {t.name: [] for t in members}
        body = _body(True, GAP_MODEL) if spaced_stream else _body(stream)
        for round_ in range(rounds):
            for target in (members if round_ % 2 == 0 else list(reversed(members))):
                target.start_fresh()
                if target.child is None or not target.check_alive():
                    raw[target.name].append({"error": "not running: " + "; ".join(target.problems)[:300]})
                    continue
                url = f"{target.gap_base}/chat/completions" if spaced_stream else target.url
                headers = target.gap_headers if spaced_stream else target.headers
                run_cell(url, headers, body, stream=stream, concurrency=concurrency, count=first, time_limit=30, warmup=0)
                before = cpu_seconds(target.child.pid, tree=True)
                result = run_cell(url, headers, body, stream=stream, concurrency=concurrency, count=n,
                                  time_limit=90 if spaced_stream else 60, warmup=0)
                after = cpu_seconds(target.child.pid, tree=True)
                done = result["requests"]
                raw[target.name].append({
                    "requests": done, "errors": result["errors"],
                    "cpu_ms_per_request": round((after - before) * 1000 / done, 3)
                    if done and None not in (before, after) else None})
        cells[key] = {name: _spread(runs) for name, runs in raw.items()}
        log(f"  CPU rounds {key:12s} " + "  ".join(
            f"{name}={cells[key][name]['median']} ms/req [{cells[key][name]['min']}–{cells[key][name]['max']}]"
            for name in raw))

    for stream in modes:
        for concurrency in concurrencies:
            take(f"{'stream' if stream else 'buffered'}_c{concurrency}", targets, stream=stream,
                 concurrency=concurrency, n=count, first=warmup)
    for concurrency, n in (spaced_counts or {}).items() if spaced else ():
        take(f"spaced_c{concurrency}", list(spaced), stream=True, concurrency=concurrency, n=n, first=concurrency,
             spaced_stream=True)
    return {"rounds": rounds, "count": count, "warmup": warmup, "targets": [t.name for t in targets], "cells": cells,
            **({"spaced": {"targets": [t.name for t in spaced], "counts": dict(spaced_counts or {})}} if spaced else {})}


def _spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    values = [r["cpu_ms_per_request"] for r in runs if r.get("cpu_ms_per_request") is not None and not r.get("errors")]
    return {"values": values, "median": round(statistics.median(values), 3) if values else None,
            "min": min(values, default=None), "max": max(values, default=None),
            "errors": sum(r.get("errors") or 0 for r in runs),
            "rounds_not_run": sum(1 for r in runs if r.get("error")), "runs": runs}


def _probe(url: str, what: str) -> dict:
    if what == "reset":
        return httpx.post(f"{url}/__bench/reset", timeout=10, trust_env=False).json()
    return httpx.get(f"{url}/__bench/stats", timeout=30, trust_env=False).json()


def _union_ms(calls: list[dict]) -> float:
    """Time during which at least one of `calls` was in flight (= their sum when sequential)."""
    spans = sorted((c["start"], c["start"] + c["ms"] / 1000) for c in calls)
    total, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total * 1000


def _storage_summary(stats: dict) -> dict[str, Any]:
    requests = [r for r in stats["requests"] if r["path"].startswith("/v1/")]
    n = len(requests)
    per_request = []
    for r in requests:
        first = r["upstream_first_byte_ms"]
        calls = [c for c in r["calls"] if not c.get("background")]
        writes = [c for c in calls if c["kind"] == "write"]
        reads = [c for c in calls if c["kind"] == "read"]
        before = [c for c in writes if first is not None and (c["start"] - r["start"]) * 1000 < first]
        per_request.append({
            "calls": len(calls),
            "writes": len(writes),
            "reads": len([c for c in reads if c["service"] == "dynamodb"]),
            "ssm_reads": len([c for c in reads if c["service"] == "ssm"]),
            "writes_before_first_byte": len(before),
            "storage_ms": _union_ms(calls),
            "storage_ms_sum": sum(c["ms"] for c in calls),
            "storage_cpu_ms": sum(c["cpu_ms"] for c in calls),
            "server_ms": r["duration_ms"],
            "answered_ms": r.get("answered_ms"),
            "upstream_first_byte_ms": first,
            "upstream_connects": r.get("upstream_connects"),
            "status": r["status"],
        })
    all_calls = [c for r in requests for c in r["calls"] if not c.get("background")]
    background = list(stats.get("background_calls") or []) + [c for r in requests for c in r["calls"] if c.get("background")]
    by_op: dict[str, Any] = {}
    for op in sorted({f"{c['service']}.{c['op']}" for c in all_calls}):
        chosen = [c for c in all_calls if f"{c['service']}.{c['op']}" == op]
        by_op[op] = {
            "count": len(chosen),
            "per_request": round(len(chosen) / n, 4) if n else None,
            "ms": summarize([c["ms"] for c in chosen]),
            "wire_ms": summarize([c["wire_ms"] for c in chosen if c.get("wire_ms") is not None]),
            "client_cpu_ms": summarize([c["cpu_ms"] for c in chosen]),
            "errors": sum(1 for c in chosen if c.get("error")),
            "tcp_connects_per_call": round(sum(c.get("connects", 0) for c in chosen) / len(chosen), 3) if chosen else None,
            "connection_close_share": round(sum(1 for c in chosen if c.get("connection_close")) / len(chosen), 3)
            if chosen else None,
        }
    extra = list(stats["outside_calls"]) + background
    storage_cpu_s = (sum(c["cpu_ms"] for c in all_calls) + sum(c["cpu_ms"] for c in extra)) / 1000
    return {
        "requests": n,
        "statuses": {str(s): sum(1 for p in per_request if p["status"] == s) for s in {p["status"] for p in per_request}},
        "window_s": round(stats["seconds"], 2),
        "calls_per_request": round(sum(p["calls"] for p in per_request) / n, 4) if n else None,
        "writes_per_request": round(sum(p["writes"] for p in per_request) / n, 4) if n else None,
        "max_writes_per_request": max((p["writes"] for p in per_request), default=None),
        "dynamodb_reads_per_request": round(sum(p["reads"] for p in per_request) / n, 4) if n else None,
        "ssm_reads_per_request": round(sum(p["ssm_reads"] for p in per_request) / n, 4) if n else None,
        # a request whose upstream first byte the probe did not see cannot say what came before it
        "requests_without_upstream_first_byte": sum(1 for p in per_request if p["upstream_first_byte_ms"] is None),
        "writes_before_first_byte_max": max((p["writes_before_first_byte"] for p in per_request), default=None)
        if all(p["upstream_first_byte_ms"] is not None for p in per_request) else None,
        "writes_before_first_byte_mean": round(statistics.fmean(p["writes_before_first_byte"] for p in per_request), 4) if n else None,
        "storage_ms_per_request": summarize([p["storage_ms"] for p in per_request]),
        "storage_ms_sum_per_request": summarize([p["storage_ms_sum"] for p in per_request]),
        "storage_client_cpu_ms_per_request": summarize([p["storage_cpu_ms"] for p in per_request]),
        "server_ms": summarize([p["server_ms"] for p in per_request if p["server_ms"] is not None]),
        "answered_ms": summarize([p["answered_ms"] for p in per_request if p["answered_ms"] is not None]),
        "upstream_first_byte_ms": summarize([p["upstream_first_byte_ms"] for p in per_request if p["upstream_first_byte_ms"]]),
        "process_cpu_ms_per_request": round(stats["process_cpu_s"] * 1000 / n, 3) if n else None,
        "gateway_cpu_ms_per_request_without_storage": round((stats["process_cpu_s"] - storage_cpu_s) * 1000 / n, 3) if n else None,
        "threads": stats.get("threads"),
        "upstream_connects_per_request": round(sum(p["upstream_connects"] or 0 for p in per_request) / n, 4)
        if n and all(p["upstream_connects"] is not None for p in per_request) else None,
        "tcp_connects_per_storage_call": round(sum(c.get("connects", 0) for c in all_calls) / len(all_calls), 4)
        if all_calls else None,
        "http_clients": stats.get("http_clients"),
        "probe_hooks": stats.get("hooks"),
        "calls_outside_requests": len(stats["outside_calls"]),
        "background_calls": len(background),
        "by_operation": by_op,
    }


def storage_wait(url: str) -> dict[str, Any]:
    """What a probed gateway's requests waited for storage (the probe's side channel), in brief."""
    summary = _storage_summary(_probe(url, "stats"))
    return {"storage_wait": {
        "requests": summary["requests"],
        "calls_per_request": summary["calls_per_request"],
        "storage_ms_per_request": summary["storage_ms_per_request"],
        "writes_per_request": summary["writes_per_request"],
        "process_cpu_ms_per_request": summary["process_cpu_ms_per_request"],
        "storage_client_cpu_ms_per_request": summary["storage_client_cpu_ms_per_request"],
        "server_ms": summary["server_ms"],
    }}


def where_time_goes(stack: Stack, *, count: int, steady_seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    """The probed gateway (bench/instrument): storage round trips and CPU, per request."""
    out: dict[str, Any] = {"method": (
        "chat/completions served by functions/run.sh with the bench's probe loaded through PYTHONPATH "
        "(bench/instrument/sitecustomize.py): kiln.aws.AwsClient.call wrapped (every DynamoDB/SSM call of the "
        "request path; wall time, time in kiln.http1's request + Response.read, TCP connects, and the loop thread's "
        "CPU over the call's own coroutine steps), the upstream's first byte when kiln.http1.HttpClient.request "
        "returns for a request that is not a storage call, process CPU from time.process_time; storage CPU is the "
        "CPU of the storage calls' own steps.")}
    headers = {"authorization": f"Bearer {stack.key}"}
    for name, stream, concurrency in (("buffered_c1", False, 1), ("stream_c1", True, 1), ("buffered_c16", False, 16)):
        child, url = stack.start_function(f"kiln-probe-{name}", probe=True)
        try:
            # the first request of a fresh process: caches empty
            run_cell(f"{url}/v1/chat/completions", headers, _body(stream), stream=stream, concurrency=1, count=1,
                     time_limit=30, warmup=0)
            first = _storage_summary(_probe(url, "stats"))
            run_cell(f"{url}/v1/chat/completions", headers, _body(stream), stream=stream, concurrency=concurrency,
                     count=max(16, count // 10), time_limit=30, warmup=0)
            _probe(url, "reset")
            load = run_cell(f"{url}/v1/chat/completions", headers, _body(stream), stream=stream, concurrency=concurrency,
                            count=count, time_limit=60, warmup=0)
            summary = _storage_summary(_probe(url, "stats"))
            summary["client_latency_ms"] = load["latency_ms"]
            summary["client_errors"] = load["errors"]
            out[name] = {"first_request": first, "steady": summary}
            if summary.get("requests_without_upstream_first_byte"):
                log(f"  {name}: WARNING the probe saw no upstream first byte for "
                    f"{summary['requests_without_upstream_first_byte']} requests (hooks: {summary.get('probe_hooks')})")
            log(f"  {name}: writes/req={summary['writes_per_request']} reads/req={summary['dynamodb_reads_per_request']} "
                f"ssm/req={summary['ssm_reads_per_request']} writes-before-first-byte(max)={summary['writes_before_first_byte_max']} "
                f"storage p50={summary['storage_ms_per_request']['p50']} ms, gateway CPU w/o storage="
                f"{summary['gateway_cpu_ms_per_request_without_storage']} ms/req, TCP connects/storage call="
                f"{summary['tcp_connects_per_storage_call']}, upstream connects/req={summary['upstream_connects_per_request']}, "
                f"open connections={[c.get('open_connections') for c in summary.get('http_clients') or []]}")
        finally:
            stack.procs.stop(child)
    # steady-state reads: a window longer than the auth cache (10 s) and the maintenance cache (5 s)
    child, url = stack.start_function("kiln-probe-steady", probe=True)
    try:
        run_cell(f"{url}/v1/chat/completions", headers, _body(False), stream=False, concurrency=1, count=20,
                 time_limit=30, warmup=0)
        _probe(url, "reset")
        run_cell(f"{url}/v1/chat/completions", headers, _body(False), stream=False, concurrency=1, count=1_000_000,
                 time_limit=steady_seconds, warmup=0)
        summary = _storage_summary(_probe(url, "stats"))
        out["steady_window"] = summary
        log(f"  steady window {summary['window_s']} s, {summary['requests']} requests: writes/req="
            f"{summary['writes_per_request']} dynamodb reads/req={summary['dynamodb_reads_per_request']} "
            f"ssm reads/req={summary['ssm_reads_per_request']}")
    finally:
        stack.procs.stop(child)
    return out


# -- the same cells, two versions of the gateway, back to back --------------------------------

def ab_versions(stack: Stack, versions: dict[str, Path], *, count: int, rounds: int, log: Callable[[str], None],
                cells: tuple[tuple[bool, int], ...] = ((False, 1), (True, 1), (False, 16))) -> dict[str, Any]:
    """Each version's chat function (a fresh process per cell, no probe) on the same stack, the
    versions alternating cell by cell, `rounds` times: differences between runs minutes apart
    (the machine drifts) do not enter. CPU per request from /proc, the measured requests only
    (after 50 warm-up requests)."""
    headers = {"authorization": f"Bearer {stack.key}"}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {label: {} for label in versions}
    for round_ in range(rounds):
        for stream, concurrency in cells:
            key = f"{'stream' if stream else 'buffered'}_c{concurrency}"
            order = list(versions.items()) if round_ % 2 == 0 else list(reversed(versions.items()))
            for label, tree in order:
                try:
                    child, url = stack.start_function_at(f"ab-{label}", tree)
                except Exception as exc:  # noqa: BLE001 - e.g. the old version needs a package the venv lost
                    raw[label].setdefault(key, []).append({"error": f"{type(exc).__name__}: {exc}"[:400]})
                    continue
                try:
                    target = f"{url}/v1/chat/completions"
                    run_cell(target, headers, _body(stream), stream=stream, concurrency=concurrency, count=50,
                             time_limit=30, warmup=0)
                    before = cpu_seconds(child.pid, tree=True), cpu_seconds(stack.emulator.pid, tree=True)
                    result = run_cell(target, headers, _body(stream), stream=stream, concurrency=concurrency,
                                      count=count, time_limit=60, warmup=0)
                    after = cpu_seconds(child.pid, tree=True), cpu_seconds(stack.emulator.pid, tree=True)
                    n = result["requests"] or 1
                    try:
                        threads = len(list(Path(f"/proc/{child.pid}/task").iterdir()))
                    except OSError:
                        threads = None
                    raw[label].setdefault(key, []).append({
                        "requests": result["requests"], "errors": result["errors"],
                        "p50": result["latency_ms"]["p50"], "p99": result["latency_ms"]["p99"],
                        "ttfb_p50": result["ttfb_ms"]["p50"], "req_per_s": result["req_per_s"],
                        "cpu_ms_per_request": round((after[0] - before[0]) * 1000 / n, 3)
                        if None not in (after[0], before[0]) else None,
                        "emulator_cpu_ms_per_request": round((after[1] - before[1]) * 1000 / n, 3)
                        if None not in (after[1], before[1]) else None,
                        "threads": threads,
                    })
                    last = raw[label][key][-1]
                    log(f"  {label:8s} {key:12s} p50={last['p50']} req/s={last['req_per_s']} "
                        f"CPU={last['cpu_ms_per_request']} ms/req emulator={last['emulator_cpu_ms_per_request']} "
                        f"threads={threads} err={last['errors']}")
                finally:
                    stack.procs.stop(child)

    def median(values: list[Any]) -> Any:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    summary: dict[str, Any] = {}
    for label, per_cell in raw.items():
        summary[label] = {}
        for key, runs in per_cell.items():
            good = [r for r in runs if "error" not in r]
            summary[label][key] = {name: median([r[name] for r in good]) for name in (
                "p50", "p99", "ttfb_p50", "req_per_s", "cpu_ms_per_request", "emulator_cpu_ms_per_request", "threads")}
            summary[label][key]["errors"] = sum(r.get("errors") or 0 for r in good)
            summary[label][key]["failed_starts"] = [r["error"] for r in runs if "error" in r]
    calls = call_counts(stack, versions, count=min(count, 200), log=log)
    for label, per_cell in calls.items():
        for key, value in per_cell.items():
            summary.setdefault(label, {}).setdefault(key, {})["python_calls_per_request"] = value
    return {"versions": {label: str(tree) for label, tree in versions.items()}, "rounds": rounds, "count": count,
            "median": summary, "runs": raw, "call_count_requests": min(count, 200)}


def call_counts(stack: Stack, versions: dict[str, Path], *, count: int, log: Callable[[str], None],
                cells: tuple[tuple[bool, int], ...] = ((False, 1), (True, 1))) -> dict[str, dict[str, Any]]:
    """Python function calls per request of each version (cProfile's count on the loop thread, over
    `count` requests after 50 warm-up ones): the same whatever else the machine runs, where CPU time
    moves by tens of percent. One cell each, after the timed rounds (counting slows the process)."""
    headers = {"authorization": f"Bearer {stack.key}"}
    out: dict[str, dict[str, Any]] = {label: {} for label in versions}
    for stream, concurrency in cells:
        key = f"{'stream' if stream else 'buffered'}_c{concurrency}"
        for label, tree in versions.items():
            counted = stack.procs.log_dir / f"calls-{label}-{key}.json"
            counted.unlink(missing_ok=True)
            try:
                child, url = stack.start_function_at(f"calls-{label}", tree, call_count=counted)
            except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                out[label][key] = None
                log(f"  {label} {key}: no call count ({type(exc).__name__}: {exc})"[:300])
                continue
            try:
                target = f"{url}/v1/chat/completions"
                run_cell(target, headers, _body(stream), stream=stream, concurrency=concurrency, count=50,
                         time_limit=30, warmup=0)
                child.popen.send_signal(10)  # SIGUSR1: start counting
                time.sleep(0.2)
                result = run_cell(target, headers, _body(stream), stream=stream, concurrency=concurrency,
                                  count=count, time_limit=120, warmup=0)
                child.popen.send_signal(12)  # SIGUSR2: stop, write the count
                for _ in range(100):
                    if counted.exists() and counted.stat().st_size:
                        break
                    time.sleep(0.05)
                n = result["requests"] or 0
                calls = json.loads(counted.read_text())["calls"] if counted.exists() else None
                out[label][key] = round(calls / n) if calls is not None and n and not result["errors"] else None
                log(f"  {label:8s} {key:12s} Python calls/request {out[label][key]} (errors {result['errors']})")
            except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                out[label][key] = None
                log(f"  {label} {key}: no call count ({type(exc).__name__}: {exc})"[:300])
            finally:
                stack.procs.stop(child)
    return out


# -- profiles ------------------------------------------------------------------------------

def _stacks(raw: str) -> Iterator[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: each stack's frames, root first, and its sample count."""
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def _collapse(raw: str, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's raw (collapsed) output."""
    self_counts: dict[str, int] = {}
    incl_counts: dict[str, int] = {}
    total = 0
    for frames, n in _stacks(raw):
        total += n
        leaf = frames[-1]
        self_counts[leaf] = self_counts.get(leaf, 0) + n
        for frame in set(frames):
            incl_counts[frame] = incl_counts.get(frame, 0) + n

    def table(counts: dict[str, int]) -> list[dict[str, Any]]:
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [{"frame": frame, "share": round(n / total, 4), "samples": n} for frame, n in ranked]

    return {"samples": total, "self": table(self_counts), "inclusive": table(incl_counts)}


STORAGE = "storage client (kiln.aws: SigV4, JSON, its HTTP exchanges; kiln.store payloads)"
UPSTREAM = "upstream client (kiln.upstream and its kiln.http1 exchanges; httpx/httpcore before 2e3c924)"
# A stack that passes through one of these frames is inside a storage call, whatever its leaf
# (the HTTP client, JSON, hashing): the whole call is the storage client's.
STORAGE_FRAMES = ("kiln/aws.py", "kiln/store/ledger.py", "kiln/store/codec.py", "botocore/", "pynamodb/", "boto3/",
                  "urllib3/")
# Any other stack inside the gateway's HTTP client is the upstream client's, its socket calls
# included (anyio under httpx was also the HTTP server's: by the leaf alone it would count as the server's).
UPSTREAM_FRAMES = ("kiln/http1.py", "kiln/upstream.py", "httpx/", "httpcore/")
CONNECTIONS = "client connections' transport callbacks (asyncio streams: storage and upstream alike)"

# Leaf-most known frame → part, for stacks not inside a storage or upstream call.
GATEWAY_GROUPS = {
    "logging + EMF metrics (Powertools, kiln.observability.Observer)": (
        "aws_lambda_powertools/", "logging/", "Observer.", "RequestRecord."),
    "SSE relay (kiln.sse)": ("kiln/sse.py",),
    "JSON": ("json/", "kiln/jsonio.py"),
    "thread pool hand-off (run_in_executor, to_thread)": (
        "concurrent/futures/", "run_in_executor", "asyncio/threads.py", "_chain_future", "run_in_threadpool",
        "run_sync_in_worker_thread"),
    # the gateway's outgoing connections are asyncio streams (uvicorn's own server protocol is not)
    CONNECTIONS: ("asyncio/streams.py",),
    "HTTP server + framework (uvicorn/starlette/fastapi/anyio)": ("uvicorn/", "starlette/", "fastapi/", "anyio/", "h11/"),
    "kiln request handling (auth, normalize, exchange, handlers)": ("kiln/",),
}
EMULATOR_GROUPS = {
    "moto (DynamoDB emulation)": ("moto/",),
    "flask/werkzeug (moto's WSGI app: routing, request and response objects)": ("werkzeug/", "flask/"),
    "JSON": ("json/",),
    "kiln_ops.emulator (the lock, moto patches)": ("kiln_ops/",),
    "WSGI bridge (a2wsgi, its worker threads)": ("a2wsgi/", "concurrent/futures/"),
    "HTTP server (uvicorn; werkzeug's development server before 400f7f0)": (
        "uvicorn/", "httptools", "h11/", "socketserver.py", "http/server.py"),
}


def _grouped(raw: str, *, gateway: bool = True) -> dict[str, float]:
    """Share of samples by part: in the gateway, a stack inside a storage call is the storage
    client's, one inside any other outgoing HTTP call the upstream client's; any other stack goes
    to what its leaf-most recognisable frame belongs to."""
    groups = GATEWAY_GROUPS if gateway else EMULATOR_GROUPS
    counts = {**({STORAGE: 0, UPSTREAM: 0} if gateway else {}), **{name: 0 for name in groups}}
    counts["other (event loop, interpreter)"] = 0
    total = 0
    for frames, n in _stacks(raw):
        total += n
        chosen = None
        if gateway:
            if any(needle in frame for frame in frames for needle in STORAGE_FRAMES):
                chosen = STORAGE
            elif any(needle in frame for frame in frames for needle in UPSTREAM_FRAMES):
                chosen = UPSTREAM
        for frame in reversed(frames):
            if chosen:
                break
            for name, needles in groups.items():
                if any(needle in frame for needle in needles):
                    chosen = name
                    break
        counts[chosen or "other (event loop, interpreter)"] += n
    return {name: round(n / total, 4) for name, n in counts.items()} if total else {}


def profile_gateway(stack: Stack, py_spy: str | None, work: Path, *, stream: bool, concurrency: int, count: int,
                    extra_pids: dict[str, int] | None = None, log: Callable[[str], None],
                    aws_url: str | None = None, label: str = "") -> dict[str, Any]:
    """py-spy (200 Hz, --gil: only the thread running Python, i.e. CPU) on the gateway and the emulator during
    one cell (`aws_url`: the gateway's storage, e.g. the stand-in)."""
    if not py_spy:
        return {"error": "py-spy is not installed in the bench's tool environment"}
    child, url = stack.start_function("kiln-profiled", aws_url=aws_url)
    work.mkdir(parents=True, exist_ok=True)
    headers = {"authorization": f"Bearer {stack.key}"}
    try:
        run_cell(f"{url}/v1/chat/completions", headers, _body(stream), stream=stream, concurrency=concurrency,
                 count=32, time_limit=30, warmup=0)
        pids = {"gateway": child.pid, **(extra_pids or {})}
        spies = {}
        for name, pid in pids.items():
            raw = work / f"{name}{label}-{'stream' if stream else 'buffered'}-c{concurrency}.txt"
            spies[name] = (raw, subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--output", str(raw),
                 "--nonblocking", "--gil", "--duration", "600"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True))
        time.sleep(1.0)
        load = run_cell(f"{url}/v1/chat/completions", headers, _body(stream), stream=stream, concurrency=concurrency,
                        count=count, time_limit=60, warmup=0)
        result: dict[str, Any] = {"load": {k: load[k] for k in ("requests", "errors", "latency_ms", "req_per_s")}}
        for name, (raw, spy) in spies.items():
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            try:
                _, err = spy.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
            if raw.exists():
                text = raw.read_text(errors="replace")
                result[name] = {"raw_file": str(raw), **_collapse(text), "groups": _grouped(text, gateway=name == "gateway")}
            else:
                result[name] = {"error": (err or b"").decode(errors="replace")[-800:]}
        return result
    finally:
        stack.procs.stop(child)


# -- chunk gaps ----------------------------------------------------------------------------

def chunk_gaps(targets: list[Target], *, requests: int, time_limit: float, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"upstream_token_delay_ms": GAP_DELAY_MS, "tokens": GAP_TOKENS, "targets": {}}
    body = _body(True, GAP_MODEL)
    for target in targets:
        if not target.gaps:
            continue
        target.start_fresh()
        if not target.check_alive():
            out["targets"][target.name] = {"skipped": target.problems[-1][:500]}
            continue
        if target.name == "direct":
            url = f"{target.gap_base}/chat/completions"
        else:
            url = f"{target.gap_base}/chat/completions"
        result = stream_gaps(url, target.gap_headers, body, requests=requests, time_limit=time_limit)
        out["targets"][target.name] = result
        log(f"  {target.name:8s} gaps p50={result['gap_ms']['p50']} p99={result['gap_ms']['p99']} "
            f"events/req={result['events_per_request']['p50']} coalesced={result['coalesced_share']} err={result['errors']}")
    return out


# -- SSE rewriting cost --------------------------------------------------------------------

def sse_cost(*, repeats: int) -> dict[str, Any]:
    """kiln.sse.SseRelay.feed on vLLM-shaped chat chunks: µs per chunk, three ways the bytes may arrive."""
    import timeit

    from kiln.sse import SseRelay

    header = {"id": "chatcmpl-8b3f0c7e2a9d4c1b", "object": "chat.completion.chunk", "created": 1764500000, "model": MODEL}
    words = ["Hello", "!", " How", " can", " I", " help", " you", " today", "?"] * 23  # 207 tokens

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    events = [event({**header, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                           "finish_reason": None}]})]
    events += [event({**header, "choices": [{"index": 0, "delta": {"content": w}, "logprobs": None, "finish_reason": None}]})
               for w in words]
    events.append(event({**header, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}))
    events.append(event({**header, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(words),
                                                            "total_tokens": 9 + len(words)}}))
    events.append(b"data: [DONE]\n\n")
    whole = b"".join(events)
    shapes = {
        "one event per read (vLLM)": events,
        "events split across reads (100-byte reads)": [whole[i:i + 100] for i in range(0, len(whole), 100)],
        "coalesced (8 events per read)": [b"".join(events[i:i + 8]) for i in range(0, len(events), 8)],
    }

    def relay_all(pieces: list[bytes], wants_usage: bool) -> None:
        relay = SseRelay(client_wants_usage=wants_usage)
        for piece in pieces:
            relay.feed(piece)
        assert relay.done

    out: dict[str, Any] = {"events_per_stream": len(events), "bytes_per_event": round(len(whole) / len(events), 1),
                           "shapes": {}}
    for name, pieces in shapes.items():
        per_stream = min(timeit.repeat(lambda pieces=pieces: relay_all(pieces, False), number=20, repeat=repeats)) / 20
        out["shapes"][name] = {"reads": len(pieces), "us_per_event": round(per_stream / len(events) * 1e6, 2),
                               "us_per_stream": round(per_stream * 1e6, 1)}
    baseline = min(timeit.repeat(lambda: [bytes(e) for e in events], number=20, repeat=repeats)) / 20
    out["baseline_copy_us_per_event"] = round(baseline / len(events) * 1e6, 3)
    return out


# -- memory --------------------------------------------------------------------------------

def memory(stack: Stack, start: Callable[[], tuple[Child, str]], *, buffered: int, streamed: int, concurrency: int,
           log: Callable[[str], None], label: str) -> dict[str, Any]:
    child, url = start()
    headers = {"authorization": f"Bearer {stack.key}"}
    try:
        baseline = rss_mb(child.pid)
        first = run_cell(f"{url}/v1/chat/completions", headers, _body(False), stream=False, concurrency=1, count=1,
                         time_limit=30, warmup=0)
        after_first = rss_mb(child.pid)
        b = run_cell(f"{url}/v1/chat/completions", headers, _body(False), stream=False, concurrency=concurrency,
                     count=buffered, time_limit=240, warmup=0)
        s = run_cell(f"{url}/v1/chat/completions", headers, _body(True), stream=True, concurrency=concurrency,
                     count=streamed, time_limit=240, warmup=0)
        result = {
            "process": label,
            "requests": 1 + b["requests"] + s["requests"],
            "buffered": {k: b[k] for k in ("requests", "ok", "errors", "error_samples")},
            "streamed": {k: s[k] for k in ("requests", "ok", "errors", "error_samples")},
            "rss_mb_idle": baseline,
            "rss_mb_after_first_request": after_first,
            "rss_mb_end": rss_mb(child.pid),
            "peak_rss_mb": peak_rss_mb(child.pid),
            "first_request_ok": first["ok"] == 1,
        }
        log(f"  {label}: idle {baseline} MB, after first request {after_first} MB, peak after "
            f"{result['requests']} requests {result['peak_rss_mb']} MB")
        return result
    finally:
        stack.procs.stop(child)
