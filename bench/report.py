"""Results → bench/results/<timestamp>.json + latest.json; goals; plots; docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from string import Template
from typing import Any

from . import sections
from .sections import fmt as _fmt

__all__ = ["evaluate_goals", "find_baseline", "find_baselines", "render", "save"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
PLOTS = DOCS / "performance"
TEMPLATE = ROOT / "bench" / "performance.md.tmpl"


QUICK = ROOT / ".bench" / "quick"


def save(results: dict) -> Path:
    """A full run: bench/results/<stamp>.json and latest.json. A --quick run: .bench/quick/ only."""
    folder = QUICK if results.get("quick") else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    results["goals"] = evaluate_goals(results)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"{stamp}{'-quick' if results.get('quick') else ''}.json"
    text = json.dumps(results, indent=1, default=str)
    tmp = folder / f"{name}.tmp"
    tmp.write_text(text)
    tmp.replace(folder / name)
    (folder / "latest.json").write_text(text)
    return folder / name


# -- goals ---------------------------------------------------------------------------------

def _cell(results: dict, target: str, mode: str, concurrency: int) -> dict | None:
    for cell in results.get("matrix", []):
        if cell["target"] == target and cell["mode"] == mode and cell["concurrency"] == concurrency:
            return cell
    return None


def _p50(cell: dict | None) -> float | None:
    if not cell or "latency_ms" not in cell or cell.get("ok", 0) == 0:
        return None
    return cell["latency_ms"]["p50"]


def added_latency(results: dict) -> list[dict]:
    rows = []
    for mode in ("buffered", "stream"):
        for concurrency in results.get("config", {}).get("concurrencies", []):
            direct = _p50(_cell(results, "direct", mode, concurrency))
            row: dict[str, Any] = {"mode": mode, "concurrency": concurrency, "direct_p50": direct}
            for target in ("kiln", "portkey", "litellm"):
                cell = _cell(results, target, mode, concurrency)
                p50 = _p50(cell)
                row[f"{target}_added"] = round(p50 - direct, 2) if p50 is not None and direct is not None else None
                row[f"{target}_errors"] = cell.get("errors") if cell else None
            k, p, lt = row["kiln_added"], row["portkey_added"], row["litellm_added"]
            row["vs_portkey"] = None if k is None or p is None else k <= p / 4
            row["vs_litellm"] = None if k is None or lt is None else k <= lt / 20
            rows.append(row)
    return rows


def template_memory_mb(path: Path = ROOT / "template.yaml") -> int | None:
    """The functions' default MemorySize (template.yaml's Globals)."""
    import re

    try:
        match = re.search(r"^Globals:.*?^\s+MemorySize:\s*(\d+)", path.read_text(), re.S | re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def evaluate_goals(results: dict) -> list[dict]:
    """Issue 16's goals first (bench/goals.py), then the earlier ones that still stand: storage round
    trips, chunk gaps, memory. (The earlier added-latency goal against the plain peers and the 1.3×
    cold start on run.sh alone are replaced by the same-job, stand-in and production-path goals.)"""
    from . import goals as g

    found: list[dict] = [g.cpu_vs_portkey(results), g.standin_overhead(results), g.samejob(results),
                         g.coldstart_production(results), g.lambda_sizes(results, template_memory_mb())]
    goals = [{k: v for k, v in goal.items() if k != "rows"} for goal in found]

    # 2. storage round trips
    b = results.get("breakdown") or {}
    if b.get("buffered_c1"):
        befores = [b[k]["steady"]["writes_before_first_byte_max"] for k in ("buffered_c1", "stream_c1", "buffered_c16") if k in b]
        # None: the probe did not see the upstream's first byte of some request (a hook missing)
        before = None if None in befores else max(befores)
        writes = max(b[k]["steady"]["writes_per_request"] or 0 for k in ("buffered_c1", "stream_c1", "buffered_c16") if k in b)
        window = b.get("steady_window") or b["buffered_c1"]["steady"]
        reads = (window["dynamodb_reads_per_request"] or 0) + (window["ssm_reads_per_request"] or 0)
        goals.append({
            "id": "storage",
            "goal": "≤ 1 storage write before the first upstream byte; ≤ 2 writes and ≤ 1 read per request (steady state)",
            "measured": f"writes before first upstream byte (max) "
                        f"{before if before is not None else 'unknown: the probe saw no upstream first byte'}; writes/request {writes}; "
                        f"reads/request {round(reads, 4)} (DynamoDB {window['dynamodb_reads_per_request']}, "
                        f"SSM {window['ssm_reads_per_request']}, over {window['window_s']} s)",
            "pass": None if before is None else (before <= 1 and writes <= 2 and reads <= 1),
        })
    else:
        goals.append({"id": "storage", "goal": "storage round trips", "measured": "not measured", "pass": None})

    # 3. chunk gaps
    g = (results.get("gaps") or {}).get("targets", {})
    if g.get("kiln", {}).get("gap_ms") and g.get("direct", {}).get("gap_ms"):
        k, d = g["kiln"]["gap_ms"]["p50"], g["direct"]["gap_ms"]["p50"]
        ok = k is not None and d is not None and abs(k - d) <= 2.0 and not g["kiln"].get("errors")
        goals.append({
            "id": "gaps",
            "goal": "client-observed chunk gaps within 2 ms of the upstream's (p50), upstream token every 20 ms",
            "measured": f"upstream (direct) p50 {d} ms, through Kiln p50 {k} ms (Δ {round(k - d, 2) if k is not None else '?'} ms), "
                        f"Kiln p99 {g['kiln']['gap_ms']['p99']} ms; coalesced gaps (<5 ms) {g['kiln']['coalesced_share']}",
            "pass": ok,
        })
    else:
        goals.append({"id": "gaps", "goal": "chunk gaps", "measured": "not measured", "pass": None})

    # 5. memory
    m = (results.get("memory") or {})
    main = m.get("layer_python313") or m.get("venv")
    if main:
        goals.append({
            "id": "memory",
            "goal": "peak RSS of a function process after 2 000 requests ≤ 120 MB",
            "measured": f"{main['peak_rss_mb']} MB after {main['requests']} requests ({main['process']})"
                        + (f"; venv process {m['venv']['peak_rss_mb']} MB" if "venv" in m and main is not m["venv"] else ""),
            "pass": main["peak_rss_mb"] is not None and main["peak_rss_mb"] <= 120,
        })
    else:
        goals.append({"id": "memory", "goal": "peak RSS", "measured": "not measured", "pass": None})
    return goals


# -- markdown ------------------------------------------------------------------------------

def _verdict(passed: bool | None) -> str:
    return {True: "**PASS**", False: "**FAIL**", None: "not measured"}[passed]


def _summary_table(results: dict) -> str:
    lines = ["| target | mode | conc. | requests | errors | p50 ms | p99 ms | TTFB p50 ms | req/s | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cell in results.get("matrix", []):
        if "skipped" in cell:
            lines.append(f"| {cell['target']} | {cell['mode']} | {cell['concurrency']} | – | – | – | – | – | – | "
                         f"skipped: {cell['skipped'][:80]} |")
            continue
        lat, ttfb = cell["latency_ms"], cell["ttfb_ms"]
        note = []
        if cell.get("errors"):
            note.append("; ".join(s[:90] for s in cell["error_samples"][:2]).replace("|", "/").replace("\n", " "))
        if cell.get("stopped_by") == "time":
            note.append("time cap reached")
        if cell["target"] == "kiln" and cell.get("upstream_sockets_open") is not None:
            note.append(f"{cell['upstream_sockets_open']} upstream connections open after the cell"
                        + (" (more than the concurrency: leaked)" if cell["upstream_sockets_open"] > cell["concurrency"] else ""))
        if cell.get("crashed"):
            note.append("CRASHED")
        lines.append(f"| {cell['target']} | {cell['mode']} | {cell['concurrency']} | {cell['requests']} | {cell['errors']} | "
                     f"{_fmt(lat['p50'])} | {_fmt(lat['p99'])} | {_fmt(ttfb['p50'])} | {_fmt(cell['req_per_s'])} | "
                     f"{' — '.join(note)} |")
    return "\n".join(lines)


def _added_table(results: dict) -> str:
    lines = ["| mode | conc. | direct p50 | Kiln added | Portkey added | LiteLLM added | Kiln ≤ ¼ Portkey | Kiln ≤ 1/20 LiteLLM |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in added_latency(results):
        yn = {True: "yes", False: "no", None: "–"}
        lines.append(f"| {r['mode']} | {r['concurrency']} | {_fmt(r['direct_p50'])} | {_fmt(r['kiln_added'])} | "
                     f"{_fmt(r['portkey_added'])} | {_fmt(r['litellm_added'])} | {yn[r['vs_portkey']]} | {yn[r['vs_litellm']]} |")
    return "\n".join(lines)


def _cpu_table(results: dict) -> str:
    lines = ["| target | mode | conc. | target's CPU ms/req | embedded AWS ms/req | mock upstream ms/req | load generator ms/req | total ms/req | "
             "2 cores ÷ total (req/s ceiling) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    cores = results.get("machine", {}).get("nproc") or 1
    for cell in results.get("matrix", []):
        cpu = cell.get("cpu_ms_per_request")
        if not cpu:
            continue
        own = cpu.get(cell["target"])
        total = sum(v for v in cpu.values() if v is not None)
        lines.append(f"| {cell['target']} | {cell['mode']} | {cell['concurrency']} | {_fmt(own, 2)} | {_fmt(cpu.get('emulator'), 2)} | "
                     f"{_fmt(cpu.get('mock upstream'), 2)} | {_fmt(cpu.get('load generator'), 2)} | {_fmt(total, 2)} | "
                     f"{_fmt(cores * 1000 / total if total else None, 0)} |")
    return "\n".join(lines)


def _goals_table(results: dict) -> str:
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    for goal in results.get("goals") or evaluate_goals(results):
        lines.append(f"| {goal['goal']} | {goal['measured']} | {_verdict(goal['pass'])} |")
    return "\n".join(lines)


def _peers(results: dict) -> str:
    lines = []
    for name, status in results.get("peers", {}).items():
        state = "ran" if status.get("started") else "DID NOT RUN"
        lines.append(f"- **{name}** {status.get('version') or ''}: {state}"
                     + (f", started in {status['start_seconds']} s" if status.get("start_seconds") else ""))
        for note in status.get("notes", []):
            lines.append(f"  - {note}")
        for problem in status.get("problems", []):
            lines.append(f"  - problem: `{problem[:600].replace('`', '')}`".replace("\n", " "))
    if not lines:
        lines.append("- no peer was measured in this run")
    return "\n".join(lines)


def _breakdown(results: dict) -> str:
    b = results.get("breakdown")
    if not b:
        return "_Not measured in this run._"
    lines = ["| load | requests | server time p50 ms | storage wall p50 ms/req | storage client CPU ms/req (p50) | "
             "gateway CPU ms/req without storage | process CPU ms/req | upstream first byte p50 ms | writes/req | "
             "writes before 1st upstream byte (max) | DynamoDB reads/req | SSM reads/req |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("buffered_c1", "stream_c1", "buffered_c16", "steady_window"):
        entry = b.get(name)
        if not entry:
            continue
        s = entry.get("steady", entry)
        lines.append(f"| {name} | {s['requests']} | {_fmt(s['server_ms']['p50'])} | {_fmt(s['storage_ms_per_request']['p50'])} | "
                     f"{_fmt(s['storage_client_cpu_ms_per_request']['p50'], 2)} | {_fmt(s['gateway_cpu_ms_per_request_without_storage'], 2)} | "
                     f"{_fmt(s['process_cpu_ms_per_request'], 2)} | {_fmt(s['upstream_first_byte_ms']['p50'])} | "
                     f"{s['writes_per_request']} | {s['writes_before_first_byte_max']} | {s['dynamodb_reads_per_request']} | "
                     f"{s['ssm_reads_per_request']} |")
    lines.append("")
    lines.append("Storage calls by operation (buffered, concurrency 1, steady state):")
    lines.append("")
    lines.append("| operation | per request | wall p50 ms | HTTP p50 ms (kiln.http1 request + read) | client CPU p50 ms | "
                 "TCP connects per call | answers that close the connection |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for op, entry in (b.get("buffered_c1", {}).get("steady", {}).get("by_operation") or {}).items():
        lines.append(f"| {op} | {entry['per_request']} | {_fmt(entry['ms']['p50'], 2)} | {_fmt(entry['wire_ms']['p50'], 2)} | "
                     f"{_fmt(entry['client_cpu_ms']['p50'], 2)} | {_fmt(entry.get('tcp_connects_per_call'), 2)} | "
                     f"{_fmt(entry.get('connection_close_share'), 2)} |")
    first = b.get("buffered_c1", {}).get("first_request")
    if first:
        ops = ", ".join(f"{op} ×{e['count']}" for op, e in first["by_operation"].items())
        union = first["storage_ms_per_request"]["p50"]
        summed = (first.get("storage_ms_sum_per_request") or {}).get("p50")
        lines.append("")
        lines.append(f"The first request of a fresh process (caches empty) made: {ops or 'no storage call'}; "
                     f"server time {_fmt(first['server_ms']['p50'])} ms, of which storage in flight {_fmt(union)} ms"
                     + (f"; its answer was out after {_fmt(first['answered_ms']['p50'])} ms, the rest is work done after it"
                        if (first.get("answered_ms") or {}).get("p50") is not None else "")
                     + (f" (the calls' own times add up to {_fmt(summed)} ms: some ran concurrently)"
                        if summed is not None and summed - union > 0.5 else "") + ".")
    conns = []
    for name in ("buffered_c1", "stream_c1", "buffered_c16"):
        s = (b.get(name) or {}).get("steady") or {}
        if s.get("upstream_connects_per_request") is None:
            continue
        clients = s.get("http_clients") or []
        idle: dict[str, int] = {}
        for c in clients:
            for origin, n in (c.get("idle") or {}).items():
                idle[_origin_name(origin, results)] = idle.get(_origin_name(origin, results), 0) + n
        conns.append(f"| {name} | {s.get('tcp_connects_per_storage_call')} | {s['upstream_connects_per_request']} | "
                     f"{'/'.join(str(c.get('open_connections')) for c in clients) or '–'} | "
                     f"{idle.get('the embedded AWS', '–')} | {idle.get('the mock upstream', '–')} |")
    if conns:
        lines += ["", "Connections of the gateway's one `kiln.http1.HttpClient` (shared by storage and the upstream), "
                  "counted by the probe over each window; open and idle at its end:", "",
                  "| load | new TCP connections per storage call | new upstream connections per request | open at the end | "
                  "idle to the embedded AWS | idle to the mock upstream |", "|---|---:|---:|---:|---:|---:|", *conns]
    hooks = (((b.get("buffered_c1") or {}).get("steady") or {}).get("probe_hooks"))
    if hooks is not None:
        lines += ["", f"Probe hooks installed: {', '.join(f'`{h}`' for h in hooks) or 'none'}."]
    background = sum((b.get(k) or {}).get("steady", b.get(k) or {}).get("background_calls") or 0 for k in b if k != "method")
    if background:
        lines.append(f"Off the request path (a key's `last_used_at`, its own task): {background} calls in the windows above, "
                     "not counted as the requests'.")
    return "\n".join(lines)


def _origin_name(origin: str, results: dict) -> str:
    """'the embedded AWS' or 'the mock upstream' for a probe origin, when the run knows the ports."""
    stack = results.get("stack") or {}
    if stack.get("aws_url") and origin.endswith(":" + stack["aws_url"].rsplit(":", 1)[-1]):
        return "the embedded AWS"
    if stack.get("mock_url") and origin.endswith(":" + stack["mock_url"].rsplit(":", 1)[-1]):
        return "the mock upstream"
    return origin


def _storage_client(results: dict) -> str:
    c = results.get("storage_client")
    if not c:
        return "_Not measured in this run._"
    if "error" in c:
        return f"_Not measured: {c['error'][:300]}_"
    lines = [f"One storage call in isolation (`python -m bench.storageclient`, the project venv on uvloop, {c['count']} "
             "sequential GetItem calls for the bench org after 20 warm-up ones; CPU of the calling process only). Two "
             "servers: the embedded AWS (uvicorn since 400f7f0: keeps connections alive) and a stub that answers `{}` at "
             "once on a kept-alive connection, as a pooled connection to DynamoDB would, TLS aside. First the gateway's "
             "whole call; then the transport alone with the same signed request: the gateway's own client "
             "(`kiln.http1`), httpx as the general-purpose reference (the gateway's client until 2e3c924), and a bare "
             "HTTP/1.1 exchange on asyncio streams, the floor of what a call needs in Python. Older versions that have "
             "a `kiln.aws` run their own `AwsClient.call` in their own process, their layer first on PYTHONPATH.", ""]
    servers = ("embedded AWS", "keep-alive stub")
    lines += ["| client | " + " | ".join(f"CPU ms/call, {s_} | wall ms/call, {s_} | TCP connects/call, {s_}" for s_ in servers)
              + " |", "|---|" + "---:|" * (3 * len(servers))]

    def row(name: str, entry: dict) -> str:
        cells = []
        for server in servers:
            e = entry.get(server) or {}
            cells += [_fmt(e.get("cpu_ms_per_call"), 3), _fmt(e.get("wall_ms_per_call"), 3), _fmt(e.get("tcp_connects_per_call"), 2)]
        return f"| {name} | " + " | ".join(cells) + " |"

    if "clients" in c:
        for name, entry in c["clients"].items():
            lines.append(row(f"{name} (this tree)" if name.startswith("kiln.aws") else name, entry))
        for label, v in (c.get("versions") or {}).items():
            if v.get("clients"):
                for name, entry in v["clients"].items():
                    lines.append(row(f"{name} at {label}", entry))
            else:
                lines.append(f"| `kiln.aws` at {label}: {v.get('skipped') or (v.get('error') or '')[-200:]} |" + " |" * (3 * len(servers)))
        lines += ["", f"SigV4 signing alone: {_fmt(c.get('signing_cpu_ms_per_call'), 3)} ms of CPU a call."]
    else:  # the shape of runs before 2e3c924
        lines = lines[:1] + ["", "| client, server | CPU ms/call | wall ms/call |", "|---|---:|---:|"]
        for name, entry in c.items():
            if isinstance(entry, dict):
                lines.append(f"| {name} | {_fmt(entry.get('cpu_ms_per_call'), 3)} | {_fmt(entry.get('wall_ms_per_call'), 3)} |")
    return "\n".join(lines)


def _profile(results: dict) -> str:
    p = results.get("profile")
    if not p:
        return "_No profile in this run._"
    if "error" in p:
        return f"_Profile failed: {p['error']}_"
    out = [f"py-spy (`--gil`: only the thread holding the GIL is sampled, i.e. where Python CPU goes; 200 Hz) on the "
           f"gateway function and on the embedded AWS during {p['load']['requests']} buffered requests at concurrency 16 "
           f"(p50 {p['load']['latency_ms']['p50']} ms, {p['load']['req_per_s']} req/s under the profiler). In the gateway, a "
           "stack inside a storage call (`kiln.aws`, the ledger) is the storage client's, whatever its leaf, and one inside "
           "any other outgoing HTTP call (`kiln.http1`, `kiln.upstream`) the upstream client's; any other stack goes to "
           "the part of its leaf-most known frame. In the embedded AWS, moto runs in a2wsgi's worker threads behind one "
           "lock, served by uvicorn. Raw stacks: `.bench/profiles/`."]
    for name in ("gateway", "emulator"):
        entry = p.get(name)
        if not entry or "error" in (entry or {}):
            out.append(f"\n{name}: {(entry or {}).get('error', 'no samples')[:300]}")
            continue
        out.append(f"\n**{name}** ({entry['samples']} samples holding the GIL)")
        if entry.get("groups"):
            out.append("")
            out.append("| share of busy samples | spent in |")
            out.append("|---:|---|")
            for group, share in sorted(entry["groups"].items(), key=lambda kv: -kv[1]):
                if share == 0:
                    continue
                out.append(f"| {share * 100:.1f} % | {group} |")
        out.append("")
        out.append("| self % | function (file:line) |")
        out.append("|---:|---|")
        for row in entry["self"][:12]:
            out.append(f"| {row['share'] * 100:.1f} | `{row['frame'][:110]}` |")
    return "\n".join(out)


def _gaps(results: dict) -> str:
    g = results.get("gaps")
    if not g:
        return "_Not measured in this run._"
    events = (g["targets"].get("direct") or {}).get("events_per_request", {}).get("p50")
    lines = [f"The mock upstream sends one token every {g['upstream_token_delay_ms']} ms ({_fmt(events, 0)} content events a "
             "stream: role chunk, `max_tokens` 32 tokens, finish chunk), reached through its `/x/token_delay_ms=20,…` path "
             "prefix (a catalog model for Kiln, a model with that `api_base` for LiteLLM, that custom host for Portkey); the "
             "client stamps each SSE content event when the read that completes it returns. Gaps include the role → first "
             "token gap.", "",
             "| target | streams | gap p50 ms | gap p90 ms | gap p99 ms | events/stream | gaps < 5 ms (coalesced) | TTFT p50 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, entry in g["targets"].items():
        if "skipped" in entry:
            lines.append(f"| {name} | – | – | – | – | – | – | – | skipped: {entry['skipped'][:80]} |")
            continue
        gap = entry["gap_ms"]
        lines.append(f"| {name} | {entry['requests']} | {_fmt(gap['p50'], 2)} | {_fmt(gap['p90'], 2)} | {_fmt(gap['p99'], 2)} | "
                     f"{_fmt(entry['events_per_request']['p50'], 0)} | {_fmt(entry['coalesced_share'], 3)} | "
                     f"{_fmt(entry['ttft_ms']['p50'])} | {entry['errors']} |")
    return "\n".join(lines)


def _sse(results: dict) -> str:
    s = results.get("sse")
    if not s:
        return "_Not measured in this run._"
    lines = [f"`kiln.sse.SseRelay.feed` over one {s['events_per_stream']}-event chat stream "
             f"({s['bytes_per_event']} bytes an event), best of the repeats:", "",
             "| how the bytes arrive | reads | µs per event | µs per stream |", "|---|---:|---:|---:|"]
    for name, entry in s["shapes"].items():
        lines.append(f"| {name} | {entry['reads']} | {entry['us_per_event']} | {entry['us_per_stream']} |")
    lines.append("")
    lines.append(f"(Copying the same events costs {s['baseline_copy_us_per_event']} µs an event.)")
    return "\n".join(lines)


def _coldstart(results: dict) -> str:
    c = results.get("coldstart")
    if not c:
        return "_Not measured in this run._"
    if "error" in c:
        return f"_Not measured: {c['error']}_"
    lines = [f"{c['python']}, median of {c['repeats']} starts each; 'ready' = /healthz answered (what the Web Adapter "
             "waits for; a function builds its gateway on that first request), 'first request' = from ready to the "
             "first real request answered (the function's own first request: its storage and upstream calls included; "
             "the bare app answers GET /), 'first answer' = process start to that answer."
             + (" Each round of starts turns the order of the apps by one place and alternates .pyc and no .pyc, after "
                "one start per variant that is not counted (until 35285c8 chat_completions always came first after a "
                "change of tree, which cost it 10–30 ms)." if c.get("order") == "rotated" else ""), "",
             "| app | ready, .pyc | first request, .pyc | first answer, .pyc | × bare | ready, no .pyc | first answer, no .pyc | × bare | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    pyc, nopyc = c["variants"]["pyc"], c["variants"]["nopyc"]
    for app in pyc:
        a, b = pyc[app], nopyc[app]
        errors = "; ".join((a["errors"] + b["errors"])[:2]).replace("|", "/").replace("\n", " ")[:160]
        lines.append(f"| {app} | {_fmt(a['ready_ms_median'])} | {_fmt(a.get('first_request_ms_median'))} | "
                     f"{_fmt(a['first_answer_ms_median'])} | {_fmt(a.get('ratio_to_bare'), 2)} | "
                     f"{_fmt(b['ready_ms_median'])} | {_fmt(b['first_answer_ms_median'])} | {_fmt(b.get('ratio_to_bare'), 2)} | {errors} |")
    top = c.get("importtime_top", {}).get("chat_completions") or []
    bare_top = c.get("importtime_top", {}).get("bare_fastapi") or []
    if top:
        lines += ["", "Slowest top-level imports of chat_completions (`-X importtime`, with .pyc, one start):", "",
                  "| module | cumulative ms |", "|---|---:|"]
        lines += [f"| `{row['module']}` | {row['cumulative_ms']} |" for row in top[:10]]
    if bare_top:
        lines += ["", "…and of the bare FastAPI app: " + ", ".join(f"`{r['module']}` {r['cumulative_ms']} ms" for r in bare_top[:5])]
    extra = (c.get("imports_beyond_bare") or {}).get("chat_completions") or {}
    if extra.get("by_package"):
        lines += ["", f"What chat_completions imports that the bare app does not (same `-X importtime` starts, self time "
                  f"summed by package, kiln by module; importtime slows imports down, so compare the parts, not the "
                  f"total with the table above): {extra['total_ms']} ms of {extra['app_total_ms']} ms "
                  f"(the bare app's whole import: {extra['bare_total_ms']} ms).", "",
                  "| package | self ms |", "|---|---:|"]
        lines += [f"| `{row['package']}` | {row['self_ms']} |" for row in extra["by_package"]]
        lines.append(f"| everything else | {extra['rest_ms']} |")
    prof = c.get("first_request_profile") or {}
    if prof.get("report"):
        lines += ["", "pyinstrument over one whole start of chat_completions (imports, readiness, first request), "
                  "condensed to the shallow frames and kiln's own, ≥ 12 ms. It samples the main thread, which is "
                  "now the only one serving (storage calls are coroutines on the event loop): time a call spends "
                  "waiting for the emulator shows as the event loop's wait, not under the call; the profiler "
                  "(0.5 ms interval) also slows the start down about 1.5–1.7×."
                  + (f" {prof['note']}" if prof.get("note") else ""), "", "```", prof["report"], "```"]
    elif prof.get("error"):
        lines += ["", f"_No pyinstrument profile of the start: {prof['error']}_"]
    return "\n".join(lines)


def _memory(results: dict) -> str:
    m = results.get("memory")
    if not m:
        return "_Not measured in this run._"
    lines = ["| process | requests | errors | RSS idle MB | after 1st request MB | at the end MB | peak (VmHWM) MB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for entry in m.values():
        errors = entry["buffered"]["errors"] + entry["streamed"]["errors"]
        lines.append(f"| {entry['process']} | {entry['requests']} | {errors} | {_fmt(entry['rss_mb_idle'])} | "
                     f"{_fmt(entry['rss_mb_after_first_request'])} | {_fmt(entry['rss_mb_end'])} | {_fmt(entry['peak_rss_mb'])} |")
    peers = results.get("peer_rss_mb") or {}
    if peers:
        lines += ["", "Peak RSS of the other servers after the latency matrix (process tree): "
                  + ", ".join(f"{k} {v} MB" for k, v in peers.items()) + "."]
    return "\n".join(lines)


# -- before / after ----------------------------------------------------------------------

def find_baseline(results: dict, results_file: Path | None = None) -> Path | None:
    """The latest full run started before this one, at another commit, with no uncommitted gateway
    changes: what this run is compared with when no --baseline is given."""
    commit = results.get("git", {}).get("commit")
    started = results.get("started_at", "")
    found = None
    for path in sorted(RESULTS.glob("2*.json")):
        if results_file is not None and path.resolve() == Path(results_file).resolve():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        git = data.get("git", {})
        if (data.get("quick") or not git.get("commit") or git.get("commit") == commit
                or git.get("gateway_files_changed_since_commit") or data.get("started_at", "") >= started):
            continue
        found = path
    return found


_SERVER = "HTTP server + framework (uvicorn/starlette/fastapi/anyio)"
FUNCTION_APPS = ("chat_completions", "completions", "models", "generations")


def _change(before: Any, after: Any) -> str:
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or not before:
        return "–"
    return f"{(after - before) / before * 100:+.0f} %"


def _get(data: dict, *keys: Any) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def find_baselines(results: dict, results_file: Path | None = None, depth: int = 2) -> list[Path]:
    """The runs this one is compared with, oldest first: its baseline (find_baseline), that run's
    baseline, … up to `depth` earlier commits."""
    chain: list[Path] = []
    current, current_file = results, results_file
    for _ in range(depth):
        found = find_baseline(current, current_file)
        if found is None:
            break
        chain.insert(0, found)
        current, current_file = json.loads(found.read_text()), found
    return chain


def _table(title: str, labels: list[str], rows: list[tuple[str, list[tuple[str, list[Any], int]]]],
           change: bool = False) -> list[str]:
    """One row per item; for each metric, one column per run (oldest first), optionally followed by
    the change from the previous run to the last one."""
    metrics = [name for name, _, _ in rows[0][1]] if rows else []
    head, rule = [title], ["---"]
    for name in metrics:
        head += [f"{name}: {labels[0]}", *labels[1:]]
        rule += ["---:"] * len(labels)
        if change:
            head.append("last change")
            rule.append("---:")
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for key, cells in rows:
        line = [key]
        for _, values, digits in cells:
            line += [_fmt(v, digits) for v in values]
            if change:
                line.append(_change(values[-2], values[-1]) if len(values) > 1 else "–")
        out.append("| " + " | ".join(line) + " |")
    return out


def _comparison(befores: list[tuple[Path | None, dict]], after: dict) -> str:
    """Every figure of the earlier runs (oldest first) side by side with this run's."""
    if not befores:
        return "_No earlier full run at another commit in `bench/results/` to compare with._"
    runs = [data for _, data in befores] + [after]
    labels = [data.get("git", {}).get("commit") or "?" for data in runs]
    goals = [f"{sum(1 for g in r.get('goals', []) if g['pass'])}/{len(r.get('goals', []))}" for r in runs]
    out = ["Runs compared, oldest first: " + "; ".join(
        f"`{path.stem if path else '?'}` (gateway at {data.get('git', {}).get('commit')}, started {data.get('started_at')})"
        for path, data in befores) + f"; this run (gateway at {labels[-1]}, started {after.get('started_at')}). "
        "Same machine and sizes. Drift of the machine between runs (a few ms at concurrency 1, tens of percent at 16, "
        "see *History*) is part of every difference between two runs, but not of the same-run tables (A/B, storage "
        "client, cold start), where every version runs on the same stack, alternating. Goals met: "
        + " → ".join(goals) + "."]

    # commits in between
    for older, newer in zip(labels, labels[1:], strict=False):
        try:
            changes = subprocess.run(["git", "log", "--reverse", "--format=%h %s", f"{older}..{newer}", "--", "layers",
                                      "functions", "infra/kiln_ops/emulator.py"],
                                     cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            changes = []
        if changes:
            out += ["", f"Commits from {older} to {newer} that change the gateway (`layers/`, `functions/`) or the "
                        "embedded AWS:", ""]
            out += [f"- {line}" for line in changes]
    changed = after.get("git", {}).get("gateway_files_changed_since_commit") or []
    if changed:
        out.append(f"- and uncommitted changes to {', '.join(changed)}")

    # latency matrix
    keys = [(r["mode"], r["concurrency"]) for r in added_latency(after)]
    added = [{(r["mode"], r["concurrency"]): r.get("kiln_added") for r in added_latency(run)} for run in runs]
    rows = []
    for key in keys:
        cells = [_cell(run, "kiln", *key) or {} for run in runs]
        rows.append((f"{key[0]} c={key[1]}", [
            ("added p50 ms", [a.get(key) for a in added], 1),
            ("TTFB p50 ms", [_get(c, "ttfb_ms", "p50") for c in cells], 1),
            ("req/s", [_get(c, "req_per_s") for c in cells], 1)]))
    out += ["", "**Kiln in the latency matrix** (added p50 = Kiln's p50 − direct's p50, same run; TTFB and req/s of "
            "Kiln itself):", ""] + _table("cell", labels, rows)
    rows = []
    for key in keys:
        cpu = [_get(_cell(run, "kiln", *key) or {}, "cpu_ms_per_request") or {} for run in runs]
        rows.append((f"{key[0]} c={key[1]}", [
            ("Kiln process", [c.get("kiln") for c in cpu], 2),
            ("embedded AWS", [c.get("emulator") for c in cpu], 2),
            ("all processes", [sum(v for v in c.values() if v is not None) if c else None for c in cpu], 2)]))
    out += ["", "CPU ms per Kiln request in the matrix (from /proc, warm-up included; storage included):", ""] \
        + _table("cell", labels, rows)

    # the same cells, every version, in this run
    ab_ = after.get("ab") or {}
    if ab_.get("error"):
        out += ["", f"_Same-run A/B not measured: {ab_['error']}_"]
    elif ab_.get("median"):
        versions = list(ab_["versions"])
        medians = [ab_["median"][v] for v in versions]
        out += ["", f"**The same cells in this run, every version back to back** ({' → '.join(versions)}: a fresh "
                f"process of each version's chat function per cell, no probe, on this run's stack — the keep-alive "
                f"embedded AWS for every version —, alternating; median of {ab_['rounds']} rounds of {ab_['count']} "
                "requests after 50 warm-up ones; CPU from /proc over the measured requests only). Drift between runs "
                "does not enter these; the emulator's change does not either (every version talks to the same one):", ""]
        rows = [(cell, [("p50 ms", [_get(m, cell, "p50") for m in medians], 1),
                        ("req/s", [_get(m, cell, "req_per_s") for m in medians], 1)])
                for cell in medians[-1]]
        out += _table("cell", versions, rows, change=True)
        rows = [(cell, [("Kiln CPU ms/req", [_get(m, cell, "cpu_ms_per_request") for m in medians], 2),
                        ("embedded AWS CPU ms/req", [_get(m, cell, "emulator_cpu_ms_per_request") for m in medians], 2),
                        ("threads", [_get(m, cell, "threads") for m in medians], 0)])
                for cell in medians[-1]]
        out += [""] + _table("cell", versions, rows)
        counted = [cell for cell in medians[-1] if any(_get(m, cell, "python_calls_per_request") for m in medians)]
        if counted:
            out += ["", f"Python function calls per request (cProfile's count on the loop thread, builtins included, "
                    f"{ab_.get('call_count_requests')} requests after 50 warm-up ones, one process per version and "
                    "cell after the timed rounds): a measure of the gateway's work that the machine's load does not "
                    "move, where CPU time does by tens of percent.", ""]
            rows = [(cell, [("calls/req", [_get(m, cell, "python_calls_per_request") for m in medians], 0)])
                    for cell in counted]
            out += _table("cell", versions, rows, change=True)
        failed = [f"{label} {cell}: {e}" for label in versions for cell, m in ab_["median"][label].items()
                  for e in m.get("failed_starts") or []]
        if failed:
            out += ["", "Failed starts: " + "; ".join(failed)[:600]]

    # the probe
    def steady(run: dict, name: str) -> dict:
        entry = (run.get("breakdown") or {}).get(name) or {}
        return entry.get("steady", entry)

    loads = [name for name in ("buffered_c1", "stream_c1", "buffered_c16", "steady_window")
             if any(steady(run, name) for run in runs)]
    out += ["", "**Per request, measured in the gateway by the probe.** The probe follows the client: before 3360189 "
            "botocore hooks (storage CPU = the storage thread's CPU in botocore calls); from 3360189 to 2e3c924 the "
            "`AwsClient.call` wrapper with httpx's `send` as the HTTP part; since 2e3c924 the same wrapper with "
            "`kiln.http1`'s `request` + `Response.read`. Storage CPU is then the loop thread's CPU over the calls' own "
            "steps.", ""]
    rows = [(name, [("gateway CPU w/o storage ms/req",
                     [steady(r, name).get("gateway_cpu_ms_per_request_without_storage") for r in runs], 2),
                    ("storage client CPU ms/req (p50)",
                     [_get(steady(r, name), "storage_client_cpu_ms_per_request", "p50") for r in runs], 2),
                    ("process CPU ms/req", [steady(r, name).get("process_cpu_ms_per_request") for r in runs], 2)])
            for name in loads]
    out += _table("load", labels, rows)

    def calls(s: dict) -> Any:
        if s.get("calls_per_request") is not None:
            return s["calls_per_request"]
        ops = s.get("by_operation") or {}
        return round(sum(e.get("per_request") or 0 for e in ops.values()), 4) if ops else None

    def reads(s: dict) -> Any:
        if s.get("dynamodb_reads_per_request") is None:
            return None
        return round((s.get("dynamodb_reads_per_request") or 0) + (s.get("ssm_reads_per_request") or 0), 4)

    rows = [(name, [("storage calls/req", [calls(steady(r, name)) for r in runs], 4),
                    ("writes/req", [steady(r, name).get("writes_per_request") for r in runs], 4),
                    ("reads/req (DynamoDB+SSM)", [reads(steady(r, name)) for r in runs], 4)])
            for name in loads]
    out += ["", "Storage round trips per request:", ""] + _table("load", labels, rows)
    rows = [(name, [("storage wall p50 ms/req", [_get(steady(r, name), "storage_ms_per_request", "p50") for r in runs], 1),
                    ("upstream first byte p50 ms", [_get(steady(r, name), "upstream_first_byte_ms", "p50") for r in runs], 1),
                    ("server time p50 ms", [_get(steady(r, name), "server_ms", "p50") for r in runs], 1)])
            for name in loads]
    out += ["", "Their time (storage wall = the time at least one storage call of the request was in flight):", ""] \
        + _table("load", labels, rows)
    ops = [steady(r, "buffered_c1").get("by_operation") or {} for r in runs]
    names = sorted(set().union(*ops))
    if names:
        rows = [(op, [("wall p50 ms", [_get(o, op, "ms", "p50") for o in ops], 2),
                      ("HTTP p50 ms", [_get(o, op, "wire_ms", "p50") for o in ops], 2),
                      ("client CPU p50 ms", [_get(o, op, "client_cpu_ms", "p50") for o in ops], 2),
                      ("TCP connects/call", [_get(o, op, "tcp_connects_per_call") for o in ops], 2)])
                for op in names]
        out += ["", "Each storage call (buffered, concurrency 1, steady state). \"HTTP\" before 3360189 is botocore's "
                "`before-call` → `after-call` (signing, HTTP and parsing); then the time inside httpx's `send`; since "
                "2e3c924 `kiln.http1`'s `request` + `Response.read`. TCP connects were not counted before 3360189; "
                "1.00 until 400f7f0 is the embedded AWS closing every connection:", ""] \
            + _table("operation", labels, rows)
    firsts = [_get(r, "breakdown", "buffered_c1", "first_request") or {} for r in runs]
    if any(firsts):
        out += ["", "The first request of a fresh process (caches empty), buffered:", "",
                "| run | storage calls | storage in flight ms | answer out ms | server time ms |", "|---|---|---:|---:|---:|"]
        for label, f in zip(labels, firsts, strict=True):
            ops_ = ", ".join(f"{op} ×{e['count']}" for op, e in (f.get("by_operation") or {}).items()) or "–"
            out.append(f"| {label} | {ops_} | {_fmt(_get(f, 'storage_ms_per_request', 'p50'))} | "
                       f"{_fmt(_get(f, 'answered_ms', 'p50'))} | {_fmt(_get(f, 'server_ms', 'p50'))} |")
        out += ["", "Server time runs until the app returns, work after the answer included (since b3c2d42 the first "
                "real request, not the readiness check, sets up telemetry once its answer is out); the answer is out "
                "when its last body byte is handed to the server (– where a run did not measure it)."]

    # cold start
    colds = [((r.get("coldstart") or {}).get("variants") or {}) for r in runs]
    if any(colds):
        apps = list((colds[-1].get("pyc") or next(c for c in colds if c).get("pyc") or {}))
        early = [label for label, c in zip(labels, colds, strict=True)
                 if c and not any("first_request_ms_median" in e for e in (c.get("pyc") or {}).values())]
        out += ["", "**Cold start**, each run on its own (median ms, process start → first answered request; × the bare "
                "FastAPI app's first answer in the same run)."
                + (f" The run at {', '.join(early)} made the harness's HTTP client (with a TLS context, ~17 ms here) "
                   "inside every start's window, the bare app's included; later runs make it before the clock starts."
                   if early else "")
                + " Run to run, the bare app moves by ±20 ms on this machine"
                + (": the same-run table below is the one to trust." if (after.get("coldstart") or {}).get("versions")
                   else ".")]
        for variant, title in (("pyc", "with .pyc"), ("nopyc", "without .pyc")):
            rows = [(app, [(f"first answer {title}", [_get(c, variant, app, "first_answer_ms_median") for c in colds], 1),
                           ("× bare", [_get(c, variant, app, "ratio_to_bare") for c in colds], 2)])
                    for app in apps]
            out += [""] + _table("app", labels, rows)
    same = (after.get("coldstart") or {}).get("versions") or {}
    if same:
        cold = after["coldstart"]
        vlabels = [*same, cold.get("label") or labels[-1]]
        variants = [same[v]["variants"] for v in same] + [cold["variants"]]
        out += ["", f"**Cold start, every version in this run** ({' → '.join(vlabels)}: each version's x86 layer and "
                f"functions built the same way with {cold.get('python')}, started interleaved — the same app and "
                f"variant of every version back to back — {cold['repeats']} times each; × the same run's bare app, "
                f"{_fmt(_get(cold, 'variants', 'pyc', 'bare_fastapi', 'first_answer_ms_median'))} ms with .pyc, "
                f"{_fmt(_get(cold, 'variants', 'nopyc', 'bare_fastapi', 'first_answer_ms_median'))} ms without):", ""]
        out = out[:-1] if out and out[-1] == "" and out[-2] == "" else out
        for variant, title in (("pyc", "with .pyc"), ("nopyc", "without .pyc")):
            rows = [(app, [(f"ready {title}", [_get(v, variant, app, "ready_ms_median") for v in variants], 1),
                           (f"first answer {title}", [_get(v, variant, app, "first_answer_ms_median") for v in variants], 1),
                           ("× bare", [_get(v, variant, app, "ratio_to_bare") for v in variants], 2)])
                    for app in FUNCTION_APPS]
            out += _table("app", vlabels, rows) + [""]

    # memory
    mems = [r.get("memory") or {} for r in runs]
    if any(mems):
        keys_ = list(mems[-1] or next(m for m in mems if m))
        rows = [((mems[-1].get(k) or {}).get("process") or k,
                 [("RSS idle MB", [_get(m, k, "rss_mb_idle") for m in mems], 1),
                  ("after 1st request MB", [_get(m, k, "rss_mb_after_first_request") for m in mems], 1),
                  ("peak (VmHWM) MB", [_get(m, k, "peak_rss_mb") for m in mems], 1)]) for k in keys_]
        out += ["", f"**Memory** of one chat/completions process after "
                f"{(mems[-1].get(keys_[0]) or {}).get('requests')} requests (MB):", ""] + _table("process", labels, rows)

    # where the gateway's CPU goes
    groups = [_get(r, "profile", "gateway", "groups") or {} for r in runs]
    if any(groups):
        def norm(name: str) -> str:
            for short in ("storage client", "upstream client", "thread pool hand-off", "client connections"):
                if name.startswith(short):
                    return short
            return name

        normed = [{norm(k): v for k, v in g.items()} for g in groups]
        names_ = sorted(set().union(*normed), key=lambda k: -max((n.get(k) or 0) for n in normed))
        rps = [_get(r, "profile", "load", "req_per_s") for r in runs]
        out += ["", "**Where the gateway's CPU goes** (py-spy `--gil` at 200 Hz, share of the samples holding the GIL, "
                f"buffered c=16; {' → '.join(_fmt(x) for x in rps)} req/s under the profiler). At 16e7385 a stack went "
                "to the part of its leaf-most known frame, so the socket calls under the HTTP clients counted as the "
                "HTTP server's; since 3360189 a stack inside a storage call is the storage client's and one inside "
                "any other outgoing HTTP call (httpx, then kiln.http1) the upstream client's. Compare upstream client "
                "+ HTTP server together across that change: "
                + " → ".join(f"{_fmt(((n.get('upstream client') or 0) + (n.get(_SERVER) or 0)) * 100)} %" for n in normed)
                + ".", ""]
        rows = [(name, [("share %", [n.get(name) * 100 if n.get(name) is not None else None for n in normed], 1)])
                for name in names_ if any(n.get(name) for n in normed)]
        out += _table("part", labels, rows)
    return "\n".join(out)


def _history() -> str:
    rows = []
    for path in sorted(RESULTS.glob("2*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("quick"):
            continue
        goals = {g["id"]: g for g in data.get("goals", [])}
        added = {(r["mode"], r["concurrency"]): r for r in added_latency(data)}
        b16 = added.get(("buffered", 16), {})
        b1 = added.get(("buffered", 1), {})
        gaps = (data.get("gaps") or {}).get("targets", {}).get("kiln", {}).get("gap_ms", {})
        cold = ((data.get("coldstart") or {}).get("variants") or {}).get("pyc", {}).get("chat_completions", {})
        mem = (data.get("memory") or {}).get("layer_python313") or (data.get("memory") or {}).get("venv") or {}
        stream_errors = sum(c.get("errors", 0) for c in data.get("matrix", []) if c["target"] == "kiln" and c["mode"] == "stream")
        probe = ((data.get("breakdown") or {}).get("buffered_c1") or {}).get("steady") or {}
        passed = sum(1 for g in goals.values() if g["pass"])
        changed = len(data.get("git", {}).get("gateway_files_changed_since_commit", []))
        rows.append(f"| {path.stem} | {data.get('git', {}).get('commit', '?')}{f' +{changed} changed' if changed else ''} | "
                    f"{_fmt(b1.get('kiln_added'))} | {_fmt(b16.get('kiln_added'))} | {_fmt(b16.get('portkey_added'))} | "
                    f"{_fmt(probe.get('gateway_cpu_ms_per_request_without_storage'), 2)} | "
                    f"{_fmt((probe.get('storage_ms_per_request') or {}).get('p50'))} | "
                    f"{stream_errors} | {_fmt(gaps.get('p50'), 2)} | {_fmt(cold.get('ratio_to_bare'), 2)} | "
                    f"{_fmt(mem.get('peak_rss_mb'))} | {passed}/{len(goals)} |")
    if not rows:
        return "_No full run recorded yet._"
    return "\n".join(["| run | gateway at | Kiln added p50 c=1 ms | Kiln added p50 c=16 ms | Portkey added c=16 ms | "
                      "gateway CPU w/o storage c=1 ms/req | storage wall c=1 ms/req | "
                      "Kiln stream errors | Kiln gap p50 ms | chat cold start × bare | peak RSS MB | goals met |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])


def _analysis(results: dict) -> str:
    """One line per goal missed, then the hand-written analysis (bench/analysis.md) if there is one."""
    lines = [f"- **{goal['id']}** missed: {goal['measured']}" for goal in results.get("goals") or [] if goal["pass"] is False]
    lines += [f"- **{goal['id']}** not measured: {goal['measured']}" for goal in results.get("goals") or [] if goal["pass"] is None]
    if not lines:
        lines.append("Every goal was met in this run.")
    written = ROOT / "bench" / "analysis.md"
    if written.exists():
        lines += ["", written.read_text().strip()]
    return "\n".join(lines)


def _machine(results: dict) -> str:
    m = results.get("machine", {})
    cold = (results.get("coldstart") or {}).get("python") or "–"
    return (f"{m.get('nproc')} CPUs ({m.get('cpu')}), {m.get('memory_gb')} GB, Linux {m.get('kernel')}; "
            f"gateway and bench on Python {m.get('python_gateway')}, cold starts and the memory run on {cold}; "
            f"Node {m.get('node')}; load average at the start {', '.join(m.get('loadavg_at_start', []))}. "
            f"Network: {'a private namespace with loopback only' if results.get('isolated_network') else 'host loopback'}. "
            f"Gateway code at commit {results.get('git', {}).get('commit')}"
            + (f" plus uncommitted changes to {', '.join(results['git']['gateway_files_changed_since_commit'])}"
               if results.get("git", {}).get("gateway_files_changed_since_commit") else "")
            + f". The run took {results.get('duration_s')} s.")


def render(results: dict, tools_python: Path, results_file: Path | None = None,
           baselines: list[Path] | None = None) -> Path:
    """docs/performance.md and docs/performance/*.png; a --quick run renders into .bench/quick/ instead.
    `baselines`: the runs to compare with, oldest first (default: find_baselines)."""
    results["goals"] = evaluate_goals(results)  # a re-render judges with today's goals
    docs = QUICK if results.get("quick") else DOCS
    plots = docs / "performance"
    plots.mkdir(parents=True, exist_ok=True)
    plots_note = ""
    latest = results_file or ((QUICK if results.get("quick") else RESULTS) / "latest.json")
    if tools_python.exists():
        done = subprocess.run([str(tools_python), "-m", "bench.plots", str(latest), str(plots)], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            plots_note = f"\n\n_Plots could not be drawn: {done.stderr[-400:]}_"
    else:
        plots_note = "\n\n_Plots not drawn: the bench's tool environment (.bench/tools) is missing._"
    failure = ""
    if results.get("failure"):
        failure = f"\n\n> **This run failed part-way:**\n>\n> ```\n> {results['failure'][-1200:]}\n> ```\n"
    if results.get("interrupted"):
        failure += "\n\n> **This run was interrupted; the figures are partial.**\n"
    if baselines is None:
        baselines = find_baselines(results, results_file)
    befores = [(Path(b), json.loads(Path(b).read_text())) for b in baselines]
    values = {
        "generated": results.get("started_at", "?"),
        "quick_warning": ("\n> **This is a `--quick` smoke run: a few requests per cell. Its figures mean nothing.**\n"
                          if results.get("quick") else ""),
        "failure": failure,
        "machine": _machine(results),
        "config": ", ".join(f"{k}={v}" for k, v in results.get("config", {}).items()),
        "goals": _goals_table(results),
        "cpu_vs_portkey": sections.cpu(results),
        "overhead": sections.overhead(results),
        "samejob": sections.samejob(results),
        "sizes": sections.lambda_sizes(results, template_memory_mb()),
        "coldstart_production": sections.coldstart_production(results),
        "summary": _summary_table(results),
        "added": _added_table(results),
        "cpu": _cpu_table(results),
        "peers": _peers(results),
        "breakdown": _breakdown(results),
        "storage_client": _storage_client(results),
        "profile": _profile(results),
        "profile_standin": sections.profile_standin(results),
        "gaps": _gaps(results),
        "sse": _sse(results),
        "coldstart": _coldstart(results),
        "memory": _memory(results),
        "history": _history(),
        "comparison": _comparison(befores, results),
        "analysis": _analysis(results),
        "plots_note": plots_note,
    }
    commit = results.get("git", {}).get("commit")
    changed = results.get("git", {}).get("gateway_files_changed_since_commit") or []
    values["describes"] = f"commit {commit}" + (f" plus uncommitted changes to {', '.join(changed)}" if changed
                                                else ", with no uncommitted change to layers/ or functions/")
    text = Template(TEMPLATE.read_text()).safe_substitute(values)
    (docs / "performance.md").write_text(text)
    return docs / "performance.md"
