"""The report's sections for issue 16: the gateway's own cost, the same-job peer, Lambda sizes and
prices, cold starts on the production paths. Markdown from the results JSON (bench/goals.py has
the figures and verdicts)."""

from __future__ import annotations

from typing import Any

from . import goals as g
from .stack import GAP_DELAY_MS, GAP_TOKENS

__all__ = ["coldstart_production", "cpu", "fmt", "lambda_sizes", "overhead", "profile_standin", "samejob"]


def fmt(value: Any, digits: int = 1) -> str:
    """A figure of the report: `digits` decimals for a float, – for none."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _yn(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "–"}[value]


def _range(values: list | None) -> str:
    return f"{fmt(values[0], 2)}–{fmt(values[1], 2)}" if values else "–"


def cpu(results: dict) -> str:
    goal = g.cpu_vs_portkey(results)
    if not any(r["kiln_cpu_ms"] for r in goal["rows"]):
        return "_Not measured in this run._"
    rounds = results.get("cpu_rounds") or {}
    lines = [f"CPU per request of each gateway's own process (user + system from /proc). Kiln's is measured on the "
             f"storage stand-in without the probe (`{g.CPU_TARGET}`), its storage client included: there the two CPUs "
             "are shared with a mock and a stand-in about as light as in Portkey's cells. On the embedded AWS (the last "
             "column, not compared), whose own CPU per request is 5-10 times the gateway's, Kiln's process spends more "
             "CPU time on the same calls wherever the two run at once (c=8 and 16)."]
    if rounds:
        lines[0] += (f" One cell of the matrix moves by tens of percent from run to run, for Portkey as for Kiln: the "
                     f"figures compared are the medians of {rounds.get('rounds')} rounds of {rounds.get('count')} "
                     f"requests, the two gateways side by side, with the floors below (their order reversed every other "
                     f"round; a fresh Kiln process each time, as in the matrix), each after {rounds.get('warmup')} requests not counted, "
                     "with their range; the matrix's cell (its warm-up included) is beside them.")
        spaced = rounds.get("spaced") or {}
        if spaced:
            counts = ", ".join(f"{n} at c={c}" for c, n in (spaced.get("counts") or {}).items())
            who = ("Kiln, Portkey and the floor of Kiln's exchanges" if g.FLOOR_KILN in (spaced.get("targets") or [])
                   else "Kiln and Portkey only")
            lines[0] += (" The mock sends those streams at once, in one or two reads, so what a gateway does per chunk, "
                         "most of a real stream's cost, is barely in them: the rows *stream, spaced tokens* are the same "
                         f"rounds of streams of {GAP_TOKENS} tokens {GAP_DELAY_MS} ms apart, each token its own read "
                         f"({who}; requests a round: {counts}, after one wave not counted). They count in the verdict.")
    lines += ["", "| mode | conc. | Kiln ms/req (stand-in) | range | Portkey ms/req | range | Kiln ÷ Portkey | ≤ 0.5 | "
              "matrix cell: Kiln | Portkey | Kiln ms/req on the embedded AWS |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in goal["rows"]:
        lines.append(f"| {g.SPACED_LABEL if r['mode'] == g.SPACED else r['mode']} | {r['concurrency']} | {fmt(r['kiln_cpu_ms'], 2)} | {_range(r.get('kiln_range'))} | "
                     f"{fmt(r['portkey_cpu_ms'], 2)} | {_range(r.get('portkey_range'))} | {fmt(r['ratio'], 2)} | "
                     f"{_yn(r['pass'])} | {fmt(r.get('kiln_matrix_cpu_ms'), 2)} | {fmt(r.get('portkey_matrix_cpu_ms'), 2)} | "
                     f"{fmt(r.get('kiln_emulated_cpu_ms'), 2)} |")
    floors = [r for r in goal["rows"] if "floor_kiln_ms" in r]
    if floors:
        lines += ["", f"**The floor.** In the same rounds, side by side with them: `{g.FLOOR_KILN}` makes the exchanges "
                  f"a Kiln request makes ({g.STORAGE_CALLS_PER_REQUEST} storage calls to the same stand-in, one before "
                  f"the upstream and one after, then the upstream call) and `{g.FLOOR_PROXY}` only the upstream call, "
                  "each with nothing else in the process: no validation, no signing, no JSON, no authentication, no log "
                  "(`bench/floor.py`, served by functions/run.sh as a function is: keep-alive connections on asyncio streams, one write "
                  "per request, httptools parsing the answers). Their CPU is what the exchanges take, made the plainest way "
                  "on the stack the functions run on (uvicorn, uvloop, asyncio streams, this machine's loopback): the part "
                  "of a gateway's CPU that work on its own code does not remove. Where Kiln's floor alone is above "
                  f"{g.CPU_RATIO:g} × Portkey's CPU, no code on this stack that makes those exchanges meets the goal."
                  + (f" The streams of spaced tokens have `{g.FLOOR_KILN}` beside them, the one of the two a Kiln "
                     "request's exchanges are held to." if any(r["mode"] == g.SPACED for r in floors) else ""), "",
                  f"| mode | conc. | {g.FLOOR_KILN} ms/req | range | ÷ Portkey | within {g.CPU_RATIO:g} × Portkey | "
                  f"Kiln above its floor, ms/req | {g.FLOOR_PROXY} ms/req | range | floors: failed requests, rounds not run |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        spreads = (results.get("cpu_rounds") or {}).get("cells") or {}
        for r in floors:
            spread = spreads.get(f"{r['mode']}_c{r['concurrency']}") or {}
            kiln_floor, proxy = spread.get(g.FLOOR_KILN) or {}, spread.get(g.FLOOR_PROXY) or {}
            lines.append(f"| {g.SPACED_LABEL if r['mode'] == g.SPACED else r['mode']} | {r['concurrency']} | "
                         f"{fmt(r['floor_kiln_ms'], 2)} | "
                         f"{_range([kiln_floor['min'], kiln_floor['max']] if kiln_floor.get('values') else None)} | "
                         f"{fmt(r['floor_ratio'], 2)} | {_yn(r['floor_reachable'])} | {fmt(r['kiln_above_floor_ms'], 2)} | "
                         f"{fmt(r['floor_proxy_ms'], 2)} | "
                         f"{_range([proxy['min'], proxy['max']] if proxy.get('values') else None)} | "
                         f"{r.get('floor_errors') or 0}, {r.get('floor_rounds_not_run') or 0} |")
    return "\n".join(lines)


def overhead(results: dict) -> str:
    goal = g.standin_overhead(results)
    stand = results.get("standin") or {}
    stats = stand.get("stats") or {}
    if not any(r["kiln_added_p50"] is not None for r in goal["rows"]):
        return "_Not measured in this run._"
    lines = [
        f"**kiln-standin** is the same chat/completions function, with the bench's probe, whose storage is the stand-in "
        f"(`bench/standin.py`): DynamoDB and SSM answered from memory after a fixed service time of "
        f"{fmt(stand.get('service_ms'))} ms per call, as DynamoDB in-region, any number of calls waiting at once (no "
        "lock), each operation applied at once and atomically on its event loop. Seeded from the embedded AWS, it holds "
        "the same org, key and catalog. "
        + (f"Over the matrix it served {stats.get('calls')} calls, {stats.get('errors')} of them refused (conditions), "
           f"with a measured mean wait of {fmt(stats.get('waited_ms_mean'), 2)} ms per call and up to "
           f"{stats.get('in_flight_max')} calls at once." if stats else ""),
        "",
        "Storage wait is the time the storage itself took: the stand-in's service time per call, as it measured it "
        "over the cell, × the storage calls per request, as the probe counted them (admission and settle, one after "
        "the other on the request path; the rare cached reads counted alike). \"Net\" is Kiln's added latency "
        "minus that wait, at p50 and at p99 (the wait is the same fixed time for every request). The probe's storage "
        "wall (the time at least one call of the request was in flight, as the gateway saw it) is shown beside it: "
        "what it holds beyond the wait is the gateway's own time around its calls (signing, JSON, its event loop "
        "busy with other requests). Kiln's added latency is the unprobed function's (`kiln-standin-bare`, same "
        "stand-in) where the run measured it; its storage calls per request are the probed cell's. Added = target − "
        "direct, same mode and concurrency, same run. The two p99s are of different requests: an added p99 below "
        "zero says the direct path's own slowest requests were slower (the mock's outliers), not that a gateway "
        "took time away.",
        "",
        "| mode | conc. | Kiln added p50 | storage calls/req × service ms | storage wait | **net p50** | Portkey added "
        "p50 | LiteLLM added p50 | Kiln added p99 | net p99 | Portkey added p99 | probe storage wall p50 | net p50 ≤ "
        "Portkey |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in goal["rows"]:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {fmt(r['kiln_added_p50'])} | "
                     f"{fmt(r['storage_calls_per_request'], 3)} × {fmt(r['service_ms'], 2)} | {fmt(r['storage_wait'])} | "
                     f"**{fmt(r['kiln_net_p50'])}** | {fmt(r['portkey_added_p50'])} | {fmt(r['litellm_added_p50'])} | "
                     f"{fmt(r['kiln_added_p99'])} | {fmt(r['kiln_net_p99'])} | {fmt(r['portkey_added_p99'])} | "
                     f"{fmt(r['probe_storage_wall_p50'])} | {_yn(r['pass'])} |")
    rows = []
    for mode in ("buffered", "stream"):
        for concurrency in (results.get("config") or {}).get("concurrencies") or []:
            a, b = g.cell(results, "kiln", mode, concurrency) or {}, g.cell(results, "kiln-standin", mode, concurrency) or {}
            c = g.cell(results, g.CPU_TARGET, mode, concurrency) or {}
            if not a or not b:
                continue
            rows.append(f"| {mode} | {concurrency} | {fmt(a.get('req_per_s'))} | {fmt(b.get('req_per_s'))} | "
                        f"{fmt((a.get('cpu_ms_per_request') or {}).get('kiln'), 2)} | "
                        f"{fmt((b.get('cpu_ms_per_request') or {}).get('kiln-standin'), 2)} | "
                        f"{fmt((c.get('cpu_ms_per_request') or {}).get(g.CPU_TARGET), 2)} | "
                        f"{fmt((a.get('cpu_ms_per_request') or {}).get('emulator'), 2)} | "
                        f"{fmt((b.get('cpu_ms_per_request') or {}).get('storage stand-in'), 2)} |")
    if rows:
        lines += ["", "The same function on the two storages (the probe adds a little CPU to kiln-standin):", "",
                  "| mode | conc. | req/s, embedded AWS | req/s, stand-in | Kiln CPU ms/req, embedded AWS | "
                  "Kiln CPU ms/req, stand-in (probed) | Kiln CPU ms/req, stand-in (no probe) | embedded AWS CPU ms/req | "
                  "stand-in CPU ms/req |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]
    return "\n".join(lines)


def samejob(results: dict) -> str:
    goal = g.samejob(results)
    status = (results.get("peers") or {}).get("litellm-samejob") or {}
    checks = results.get("samejob_checks") or {}
    probe = results.get("prisma_probe") or {}
    lines = ["**litellm-samejob** is LiteLLM configured to do what Kiln does, as far as it runs here (`bench/peers.py`, "
             "`samejob_config`):", "",
             "| Kiln does | LiteLLM here | runs? |", "|---|---|---|",
             "| API keys in DynamoDB, hashed, cached 10 s | `general_settings.custom_auth`: a Python function with the "
             "bench's one key (`UserAPIKeyAuth`) | yes, in-process key list: no key store |",
             "| per-org concurrency limit, leases in DynamoDB (conditional write), reclaimed after their TTL | "
             "`max_parallel_requests` 8 on the key, its parallel-request limiter shared through Redis "
             "(`general_settings.coordination_redis`, Debian's redis-server started by the bench) | yes; per key, not "
             "per org |",
             "| cost per request from the catalog's prices, debited from prepaid credits with the usage event, one "
             "transaction | `input_cost_per_token` / `output_cost_per_token` on the model: cost in "
             "`x-litellm-response-cost` and `usage.cost`; Prometheus callback's spend counter (in memory) | cost: yes; "
             "no credits, nothing stored |",
             "| usage events readable per generation (`/v1/generations/{id}`) | `/spend/logs`, `/key/info` (need the "
             "database) | **no** |",
             "| virtual keys, budgets | `/key/generate`, budgets (need the database: PostgreSQL through Prisma) | **no** |",
             ""]
    if probe:
        if probe.get("ran"):
            lines.append(f"Why the database mode cannot run here, tried at preparing time (`{probe.get('step')}`, exit "
                         f"{probe.get('exit')}, {fmt(probe.get('seconds'))} s): Prisma's client fetches its query engine "
                         "for this platform from Prisma's binaries host when it generates, and that host does not resolve "
                         "from this machine; no Debian or PyPI package ships the engine. Its last lines:")
            lines += ["", "```", (probe.get("output") or "").strip()[-700:], "```", "",
                      "With no engine LiteLLM cannot use any `database_url`, so PostgreSQL (Debian's package) is not "
                      "started: nothing could connect to it."]
        else:
            lines.append(f"The database mode was not tried: {probe.get('why')}.")
    if checks:
        lines += ["", f"Checked once before the matrix: an unknown key answered HTTP {checks.get('unknown_key_status')}; a "
                  f"buffered answer carried `x-litellm-response-cost: {checks.get('buffered_cost_header')}`; a streamed "
                  f"one `usage.cost` {checks.get('stream_usage_cost')}."
                  + (f" ({checks['error']})" if checks.get("error") else "")]
    if status.get("problems"):
        lines += [""] + [f"- problem: `{p[:500]}`".replace("\n", " ") for p in status["problems"]]
    on_loopback = any(r.get("kiln_source") == "loopback" for r in goal["rows"])
    service = fmt((results.get("standin") or {}).get("service_ms"))
    if on_loopback:
        loopback_stats = ((results.get("standin") or {}).get("loopback") or {}).get("stats") or {}
        lines += ["", "Same mock, same load generator, same run. The peer's limiter is Redis on loopback, a fraction of a "
                  f"millisecond a call; the figure compared is Kiln's with its storage on loopback too (`{g.LOOPBACK_TARGET}`: "
                  "a second stand-in with no service time), so that the ratio is mostly of the two gateways' own work, "
                  "not of two stores' latencies. The stand-in is Python, on the same two CPUs: its round trip is longer "
                  "than Redis's, which favours the peer"
                  + (f" (it served {loopback_stats.get('calls')} calls, {loopback_stats.get('errors')} refused, up to "
                     f"{loopback_stats.get('in_flight_max')} at once)" if loopback_stats else "")
                  + ". Beside it, Kiln with its storage at DynamoDB's latency (the stand-in at "
                  f"{service} ms a call, two calls on every request's path, nothing subtracted) with its own ratio, not "
                  "compared, and Kiln on the embedded AWS for reference."]
    else:
        lines += ["", "Same mock, same load generator, same run; Kiln with its storage at DynamoDB's latency (the stand-in "
                  f"at {service} ms a call, nothing subtracted: this run has no cells with Kiln's storage on loopback) "
                  "and, for reference, on the embedded AWS."]
    lines[-1] += (" LiteLLM runs at c=1 and 8 only (its key's limit is 8). Its 429 answers (the limiter refusing a client "
                  "that never has more than 8 requests open) are errors of the cell, outside its latency figures.")
    lines += ["", "| mode | conc. | Kiln added p50, storage on loopback | LiteLLM same job added p50 | Kiln ÷ LiteLLM | ≤ 1/3 | "
              "Kiln added p50, storage at DynamoDB's latency | ÷ LiteLLM | Kiln added p50 (embedded AWS) | "
              "LiteLLM 429 answers |", "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in goal["rows"]:
        compared = ("failed: not measured" if r.get("kiln_failed") else fmt(r["kiln_added"])) + (
            "" if r.get("kiln_source", "loopback") == "loopback" else " (DynamoDB latency)")
        lines.append(f"| {r['mode']} | {r['concurrency']} | {compared} | {fmt(r['samejob_added'])} | {fmt(r['ratio'], 2)} | "
                     f"{_yn(r['pass'])} | {fmt(r.get('kiln_dynamodb_latency_added'))} | "
                     f"{fmt(r.get('dynamodb_latency_ratio'), 2)} | {fmt(r['kiln_on_emulator_added'])} | "
                     f"{r['samejob_refused']}/{fmt(r['samejob_requests'])} |")
    rows = []
    for mode in ("buffered", "stream"):
        for concurrency in (1, 8):
            peer = g.cell(results, "litellm-samejob", mode, concurrency) or {}
            plain = g.cell(results, "litellm", mode, concurrency) or {}
            if peer or plain:
                rows.append(f"| {mode} | {concurrency} | {fmt((plain.get('cpu_ms_per_request') or {}).get('litellm'), 2)} | "
                            f"{fmt((peer.get('cpu_ms_per_request') or {}).get('litellm-samejob'), 2)} | "
                            f"{fmt(peer.get('target_peak_rss_mb'))} |")
    if rows:
        lines += ["", "LiteLLM's own CPU per request, plain proxy and same job (Redis's CPU not included):", "",
                  "| mode | conc. | plain LiteLLM ms/req | same-job LiteLLM ms/req | same-job peak RSS MB |",
                  "|---|---:|---:|---:|---:|", *rows]
    return "\n".join(lines)


def coldstart_production(results: dict) -> str:
    c = results.get("coldstart") or {}
    production = c.get("production")
    if not production:
        return "_Not measured in this run._"
    lines = ["Each function on the path it takes in production (template.yaml): chat/completions and completions through "
             "`run.sh` + uvicorn, as the Lambda Web Adapter starts them; models and generations as Mangum handlers "
             "(`Handler: app.handler`): a process that imports the function's module, as Lambda's runtime does at init, "
             "and calls the handler with an API Gateway REST event. Each against a bare FastAPI app on the same path, "
             f"same run, median of {c.get('repeats')} starts (process start → first answer; Lambda's own runtime start "
             "is not in either).", "",
             "| function | path | with .pyc ms | bare, same path | × bare | without .pyc ms | bare | × bare | ≤ 1.2 (.pyc) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for app, entry in (production.get("pyc") or {}).items():
        nopyc = (production.get("nopyc") or {}).get(app) or {}
        ok = None if entry.get("ratio_to_bare") is None else entry["ratio_to_bare"] <= g.COLD_RATIO
        lines.append(f"| {app} | {entry['path']} | {fmt(entry.get('first_answer_ms'))} | {fmt(entry.get('bare_ms'))} | "
                     f"{fmt(entry.get('ratio_to_bare'), 2)} | {fmt(nopyc.get('first_answer_ms'))} | "
                     f"{fmt(nopyc.get('bare_ms'))} | {fmt(nopyc.get('ratio_to_bare'), 2)} | {_yn(ok)} |")
    mangum = c.get("mangum") or {}
    rows = []
    for variant in ("pyc", "nopyc"):
        for app, entry in (mangum.get(variant) or {}).items():
            rows.append(f"| {app} | {variant} | {fmt(entry.get('ready_ms_median'))} | {fmt(entry.get('first_answer_ms_median'))} | "
                        f"{fmt(entry.get('second_invoke_ms_median'))} | "
                        f"{'; '.join(entry.get('errors') or []) or '–'} | {'; '.join(entry.get('second_invoke_errors') or []) or '–'} |")
    if rows:
        lines += ["", "The Mangum path in detail (import = Lambda's init; the second invocation is a warm one in the same "
                  "process):", "", "| app | variant | import ms | first answer ms | second invocation ms | errors | "
                  "second invocation errors |", "|---|---|---:|---:|---:|---|---|", *rows]
    return "\n".join(lines)


def lambda_sizes(results: dict, template_memory_mb: int | None) -> str:
    s = results.get("sizes")
    if not s:
        return "_Not measured in this run._"
    if "error" in s:
        return f"_Not measured: {s['error']}_"
    prices = s.get("prices") or {}
    sizes = sorted(s["sizes"].items(), key=lambda kv: int(kv[0]))
    long = s.get("long_stream") or {}
    lines = [f"The chat/completions function ({s.get('process')}) in a cgroup of its own per size (cgroup v"
             f"{s.get('cgroup_version')}): CFS quota = size ÷ {s.get('full_vcpu_mb')} MB of one CPU per "
             f"{s.get('period_us', 0) // 1000} ms period (the kernel's default period; Lambda does not publish its own), "
             "memory limit = the size. A busy loop checks each quota first (measured share of one CPU). Storage is the "
             "stand-in. One request at a time, as one execution environment serves them: buffered requests, short "
             f"streams (12 tokens, no delay), then one long stream per size, all sizes at once ({long.get('tokens')} "
             f"tokens 100 ms apart, {fmt(long.get('seconds'), 0)} s). CPU per request from the cgroup's own counter. "
             "p99 is the nearest rank of each size's requests (sizes_buffered and sizes_streams under *Sizes*): "
             "of fewer than 100 it would be the slowest one.", "",
             "| size MB | vCPU | quota µs/period | measured share | ready ms | buffered TTFB p50 / p99 ms | buffered CPU "
             "ms/req | short stream TTFB p50 / p99 ms | short stream total p50 ms | short stream CPU ms/req | long stream "
             "s | long stream CPU ms | peak RSS MB | throttled periods |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, e in sizes:
        if "error" in e:
            lines.append(f"| {size} | {fmt(e.get('vcpu'), 3)} | {e.get('quota_us')} | – | did not start: "
                         f"{e['error'][:120]} |" + " |" * 9)
            continue
        b, st, lg = e.get("buffered") or {}, e.get("short_stream") or {}, e.get("long_stream") or {}
        lines.append(f"| {size} | {fmt(e.get('vcpu'), 3)} | {e.get('quota_us')} | "
                     f"{fmt((e.get('quota_check') or {}).get('measured_share'), 3)} | {fmt(e.get('ready_ms'), 0)} | "
                     f"{fmt(b.get('ttfb_p50_ms'))} / {fmt(b.get('ttfb_p99_ms'))} | {fmt(b.get('cpu_ms_per_request'), 2)} | "
                     f"{fmt(st.get('ttfb_p50_ms'))} / {fmt(st.get('ttfb_p99_ms'))} | {fmt(st.get('latency_p50_ms'))} | "
                     f"{fmt(st.get('cpu_ms_per_request'), 2)} | "
                     f"{fmt((lg.get('latency_mean_ms') or 0) / 1000 if lg.get('latency_mean_ms') else None, 2)} | "
                     f"{fmt(lg.get('cpu_ms_per_request'), 1)} | {fmt(e.get('peak_rss_mb'))} | "
                     f"{(e.get('throttling') or {}).get('nr_throttled', '–')} |")
    lines += ["", f"**Prices** ({prices.get('region')}; {prices.get('as_of')}): Lambda arm64 "
              f"${prices.get('lambda_gb_second_arm64', 0):.10f}".rstrip("0") + f" per GB-s and ${round(prices.get('lambda_request', 0) * 1e6, 2)} per "
              f"million requests; API Gateway REST ${round(prices.get('api_gateway_rest_request', 0) * 1e6, 2)} per million; "
              f"DynamoDB on demand ${round(prices.get('dynamodb_write_unit', 0) * 1e6, 3)} per million write units and "
              f"${round(prices.get('dynamodb_read_unit', 0) * 1e6, 3)} per million read units; SSM GetParameter "
              f"${prices.get('ssm_get_parameter')} (standard throughput; "
              f"${round(prices.get('ssm_get_parameter_higher_throughput', 0) * 1e4, 2)} per 10 000 with higher throughput). "
              "Billed duration = the mean request latency at that size, rounded up to the ms (the client's view on "
              "loopback; the Web Adapter's own time and data transfer are not included). DynamoDB units are counted "
              "by the stand-in from the items' sizes as DynamoDB bills them (1 WRU per KB written, ×2 in a transaction; "
              "1 RRU per 4 KB read, ½ when eventually consistent); CloudWatch Logs and metrics are not included.", "",
              "**$ per million requests**:", "",
              "| size MB | workload | Lambda duration | Lambda requests | API Gateway | DynamoDB | SSM | **total** | "
              "WRU/req | RRU/req |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    names = {"buffered": "buffered", "short_stream": "short stream", "long_stream": f"{fmt(long.get('seconds'), 0)} s stream"}
    for size, e in sizes:
        for workload, name in names.items():
            w = e.get(workload) or {}
            cost = w.get("cost")
            if not cost:
                continue
            lines.append(f"| {size} | {name} | {fmt(cost['lambda_duration'], 2)} | {fmt(cost['lambda_requests'], 2)} | "
                         f"{fmt(cost['api_gateway'], 2)} | {fmt(cost['dynamodb'], 2)} | {fmt(cost['ssm'], 2)} | "
                         f"**{fmt(cost['total'], 2)}** | {fmt(w.get('write_units_per_request'), 2)} | "
                         f"{fmt(w.get('read_units_per_request'), 3)} |")
    default = s.get("default") or {}
    lines += ["", f"**Chosen default: {default.get('size_mb')} MB** — {default.get('why')}."
              + (f" Eligible: {', '.join(f'{x} MB' for x in default.get('eligible') or [])}." if default.get("eligible") else "")]
    for size, why in (default.get("rejected") or {}).items():
        lines.append(f"- {size} MB rejected: {'; '.join(why)}")
    if template_memory_mb is not None:
        lines.append("")
        lines.append(f"template.yaml's `Globals.Function.MemorySize` is {template_memory_mb} MB"
                     + (" — the chosen default." if default.get("size_mb") and int(default["size_mb"]) == template_memory_mb
                        else f", not the chosen {default.get('size_mb')} MB."))
    return "\n".join(lines)


def profile_standin(results: dict) -> str:
    p = results.get("profile_standin")
    if not p:
        return "_Not measured in this run._"
    if "error" in p:
        return f"_Profile failed: {p['error'][:300]}_"
    gateway = p.get("gateway") or {}
    if "error" in gateway or not gateway.get("samples"):
        return f"_No samples: {gateway.get('error', '')[:300]}_"
    load = p.get("load") or {}
    lines = [f"{load.get('requests')} buffered requests at concurrency 16, p50 {fmt((load.get('latency_ms') or {}).get('p50'))} "
             f"ms, {fmt(load.get('req_per_s'))} req/s under the profiler; {gateway['samples']} gateway samples holding "
             f"the GIL (the stand-in: {(p.get('stand-in') or {}).get('samples', '–')}). Grouped as above.", "",
             "| share of busy samples | spent in |", "|---:|---|"]
    for group, share in sorted((gateway.get("groups") or {}).items(), key=lambda kv: -kv[1]):
        if share:
            lines.append(f"| {share * 100:.1f} % | {group} |")
    lines += ["", "| self % | function (file:line) |", "|---:|---|"]
    for row in gateway.get("self", [])[:15]:
        lines.append(f"| {row['share'] * 100:.1f} | `{row['frame'][:110]}` |")
    return "\n".join(lines)
