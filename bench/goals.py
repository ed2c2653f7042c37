"""The goals of issue 16, computed from a run's results: each a figure, the rows behind it, a verdict.

Pure functions of the results JSON (no process, no clock), so they are unit-tested and a report
re-rendered from an old results file says the same. A verdict is True (met), False (missed) or
None (not measured: a cell, a peer or a section is missing), never a pass by default.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CPU_RATIO", "CPU_TARGET", "COLD_RATIO", "FLOOR_KILN", "FLOOR_PROXY", "LOOPBACK_STANDIN", "LOOPBACK_TARGET", "SAMEJOB_RATIO", "STORAGE_CALLS_PER_REQUEST", "added", "cell", "coldstart_production", "cpu_vs_portkey",
           "lambda_sizes", "samejob", "standin_overhead"]

CPU_RATIO = 0.5  # Kiln's CPU per request ≤ 1/2 of Portkey's
CPU_TARGET = "kiln-standin-bare"  # the chat function over the storage stand-in, without the probe
LOOPBACK_TARGET = "kiln-standin-0ms"  # the same over a stand-in with no service time: storage as near as a peer's Redis
LOOPBACK_STANDIN = "standin-0ms"
# the floors (bench/floor.py): a request's exchanges with no gateway in the process
FLOOR_KILN = "floor-kiln-exchanges"  # Kiln's: admission and settle on the stand-in, and the upstream
FLOOR_PROXY = "floor-one-exchange"  # a proxy's: the upstream only
STORAGE_CALLS_PER_REQUEST = 2  # admission and settle (contract §2 step 5, §4)
SAMEJOB_RATIO = 1 / 3  # Kiln's added p50 ≤ 1/3 of the same-job peer's
COLD_RATIO = 1.2  # cold start ≤ 1.2 × a bare FastAPI app's on the same path, with .pyc


def cell(results: dict, target: str, mode: str, concurrency: int) -> dict | None:
    for entry in results.get("matrix") or []:
        if entry.get("target") == target and entry.get("mode") == mode and entry.get("concurrency") == concurrency:
            return entry
    return None


def _stat(entry: dict | None, stat: str) -> float | None:
    if not entry or not entry.get("ok") or "latency_ms" not in entry:
        return None
    return entry["latency_ms"].get(stat)


def added(results: dict, target: str, mode: str, concurrency: int, stat: str = "p50") -> float | None:
    """`target`'s latency statistic minus the mock's own (direct), same mode and concurrency, same run."""
    mine, direct = _stat(cell(results, target, mode, concurrency), stat), _stat(cell(results, "direct", mode, concurrency), stat)
    return None if mine is None or direct is None else round(mine - direct, 3)


def _concurrencies(results: dict) -> list[int]:
    return list((results.get("config") or {}).get("concurrencies") or [])


# streams whose tokens come one by one (the chunk-gap model: GAP_TOKENS, GAP_DELAY_MS apart), in the CPU rounds only
SPACED = "spaced"
SPACED_LABEL = "stream, spaced tokens"


def _verdict(checks: list[bool | None]) -> bool | None:
    """False if any check failed; None if none failed but one was not measured (or there were none)."""
    if any(c is False for c in checks):
        return False
    if not checks or any(c is None for c in checks):
        return None
    return True


def cpu_vs_portkey(results: dict, ratio: float = CPU_RATIO) -> dict[str, Any]:
    """Kiln's own process CPU per request against Portkey's, every mode and concurrency of the matrix.

    Kiln's is measured over the storage stand-in without the probe (CPU_TARGET; its storage
    client's CPU counts), where the machine's two CPUs are shared with a mock and a stand-in about
    as light as in Portkey's cells. Over the embedded AWS, whose own CPU per request is five to ten
    times the gateway's, Kiln's process spends more CPU time on the same calls wherever the two
    run at once (concurrency 8 and 16): that figure is kept beside it, not compared.

    Where the run has CPU rounds (the two side by side, several times per cell: `cpu_rounds`), the
    figures compared are their medians; the matrix's single cells are kept beside them. A run
    without rounds compares the matrix cells.

    Where the rounds have the floors (FLOOR_KILN: Kiln's exchanges, FLOOR_PROXY: one exchange, each
    with no gateway in the process), each row says what Kiln's exchanges alone cost against
    Portkey's CPU (`floor_ratio`), and whether the goal is within reach of any code making them
    (`floor_reachable`: the floor itself ≤ ratio × Portkey's). The verdict is Kiln's, not the floor's."""
    rounds = (results.get("cpu_rounds") or {}).get("cells") or {}
    rows = []
    for mode in ("buffered", "stream", SPACED):
        for concurrency in _concurrencies(results):
            if mode == SPACED and f"{mode}_c{concurrency}" not in rounds:
                continue  # measured in the rounds only, where the run has them
            k = ((cell(results, CPU_TARGET, mode, concurrency) or {}).get("cpu_ms_per_request") or {}).get(CPU_TARGET)
            e = ((cell(results, "kiln", mode, concurrency) or {}).get("cpu_ms_per_request") or {}).get("kiln")
            p = ((cell(results, "portkey", mode, concurrency) or {}).get("cpu_ms_per_request") or {}).get("portkey")
            row: dict[str, Any] = {"mode": mode, "concurrency": concurrency, "kiln_matrix_cpu_ms": k,
                                   "portkey_matrix_cpu_ms": p, "kiln_emulated_cpu_ms": e, "source": "matrix"}
            spread = rounds.get(f"{mode}_c{concurrency}") or {}
            kiln_rounds, portkey_rounds = spread.get(CPU_TARGET) or {}, spread.get("portkey") or {}
            if kiln_rounds.get("median") is not None and portkey_rounds.get("median") is not None:
                k, p = kiln_rounds["median"], portkey_rounds["median"]
                row.update(source="rounds", kiln_range=[kiln_rounds["min"], kiln_rounds["max"]],
                           portkey_range=[portkey_rounds["min"], portkey_rounds["max"]],
                           rounds=len(kiln_rounds.get("values") or []))
            floors = spread.get(FLOOR_KILN) or {}
            floor, proxy = floors.get("median"), (spread.get(FLOOR_PROXY) or {}).get("median")
            r = round(k / p, 3) if k is not None and p else None
            row.update(kiln_cpu_ms=k, portkey_cpu_ms=p, ratio=r, **{"pass": None if r is None else r <= ratio})
            if floors and row["source"] == "rounds":
                proxies = spread.get(FLOOR_PROXY) or {}
                row.update(floor_kiln_ms=floor, floor_proxy_ms=proxy,
                           floor_errors=floors.get("errors", 0) + proxies.get("errors", 0),
                           floor_rounds_not_run=floors.get("rounds_not_run", 0) + proxies.get("rounds_not_run", 0),
                           floor_ratio=round(floor / p, 3) if floor is not None and p else None,
                           floor_reachable=None if floor is None or not p else floor <= p * ratio,
                           kiln_above_floor_ms=round(k - floor, 3) if k is not None and floor is not None else None)
            rows.append(row)
    measured = "; ".join(f"{SPACED_LABEL if r['mode'] == SPACED else r['mode']} c={r['concurrency']}: {r['kiln_cpu_ms']} vs "
                         f"{r['portkey_cpu_ms']} ms (×{r['ratio']})" for r in rows)
    if rows and all(r["source"] == "rounds" for r in rows):
        measured = f"medians of {rows[0]['rounds']} rounds side by side; " + measured
    # the rows whose rounds had the floor beside them (the spaced streams' only in runs whose floor relays them)
    floored = [r for r in rows if "floor_kiln_ms" in r]
    if floored and all(r.get("floor_ratio") is not None for r in floored):
        out_of_reach = sum(1 for r in floored if r["floor_reachable"] is False)
        measured += (f"; the floor (Kiln's exchanges made plainly, nothing else in the process): ×{min(r['floor_ratio'] for r in floored)}–"
                     f"{max(r['floor_ratio'] for r in floored)} of Portkey's, above {ratio:g} in {out_of_reach} of "
                     f"{len(floored)} cells")
    return {"id": "cpu_vs_portkey", "goal": f"Kiln's CPU per request (on the storage stand-in) ≤ {ratio:g} × Portkey's, buffered and streamed, same run",
            "measured": measured or "not measured", "rows": rows, "pass": _verdict([r["pass"] for r in rows])}


def _kiln_on_standin(results: dict, mode: str, concurrency: int) -> str:
    """Which Kiln target's latency stands for Kiln on the stand-in: the unprobed one if measured."""
    timed = cell(results, CPU_TARGET, mode, concurrency)
    return CPU_TARGET if timed is not None and not timed.get("skipped") else "kiln-standin"


def standin_overhead(results: dict) -> dict[str, Any]:
    """On the fixed-latency stand-in: Kiln's added p50/p99 minus the storage time its requests waited
    for, i.e. the stand-in's service time (as it measured it over the cell) × the storage calls per
    request (as the probe counted them; all on the request path, one after another), against
    Portkey's added latency. Kiln's latency is the unprobed function's (CPU_TARGET, the same stand-in)
    when the run has it, else the probed one's; the probe's storage wall (calls in flight, as the
    gateway saw them: its own loop's delays included) is kept beside it, for reference."""
    rows = []
    for mode in ("buffered", "stream"):
        for concurrency in _concurrencies(results):
            entry = cell(results, "kiln-standin", mode, concurrency) or {}
            probe = entry.get("storage_wait") or {}
            service = (entry.get("standin_cell") or {}).get("service_ms_mean")
            calls = probe.get("calls_per_request")
            wait = round(service * calls, 3) if service is not None and calls is not None else None
            row: dict[str, Any] = {"mode": mode, "concurrency": concurrency, "storage_wait": wait,
                                   "storage_calls_per_request": calls, "service_ms": service,
                                   "probe_storage_wall_p50": (probe.get("storage_ms_per_request") or {}).get("p50")}
            timed = _kiln_on_standin(results, mode, concurrency)
            row["kiln_target"] = timed
            row["kiln_errors"] = (cell(results, timed, mode, concurrency) or {}).get("errors")
            for stat in ("p50", "p99"):
                a = added(results, timed, mode, concurrency, stat)
                row[f"kiln_added_{stat}"] = a
                row[f"kiln_net_{stat}"] = round(a - wait, 3) if a is not None and wait is not None else None
                row[f"portkey_added_{stat}"] = added(results, "portkey", mode, concurrency, stat)
                row[f"litellm_added_{stat}"] = added(results, "litellm", mode, concurrency, stat)
            net, portkey = row["kiln_net_p50"], row["portkey_added_p50"]
            row["pass"] = None if net is None or portkey is None else (net <= portkey and not row["kiln_errors"])
            rows.append(row)
    measured = "; ".join(f"{r['mode']} c={r['concurrency']}: {r['kiln_added_p50']} − {r['storage_wait']} = "
                         f"{r['kiln_net_p50']} ms vs Portkey {r['portkey_added_p50']} ms" for r in rows)
    return {"id": "standin_overhead",
            "goal": "on the fixed-latency storage stand-in, at c=1, 8 and 16: Kiln's added p50 minus its storage wait "
                    "≤ Portkey's added p50",
            "measured": measured or "not measured", "rows": rows, "pass": _verdict([r["pass"] for r in rows])}


def samejob(results: dict, ratio: float = SAMEJOB_RATIO, concurrencies: tuple[int, ...] = (1, 8)) -> dict[str, Any]:
    """Kiln against LiteLLM doing the same job, added p50, both with their storage on loopback.

    The peer keeps its limiter in Redis on loopback: a fraction of a millisecond a call. Kiln's
    figure compared is over the stand-in with no service time (LOOPBACK_TARGET: loopback, and
    nothing else, between it and its storage; the stand-in is Python, slower to answer than
    Redis, which favours the peer), so that the ratio is mostly of the two gateways' own work,
    not of two stores' latencies. A loopback cell that did not measure fails its row. Kiln over the stand-in at DynamoDB's latency is kept beside it with
    its own ratio, not compared; a run without the loopback cells compares that one instead."""
    rows = []
    for mode in ("buffered", "stream"):
        for concurrency in concurrencies:
            dynamo_target = _kiln_on_standin(results, mode, concurrency)
            dynamo = added(results, dynamo_target, mode, concurrency)
            # the loopback cell where the run has one (measured or not: a failed one fails the row)
            loopback_cell = cell(results, LOOPBACK_TARGET, mode, concurrency)
            if loopback_cell is not None:
                k, source, kiln_cell = added(results, LOOPBACK_TARGET, mode, concurrency), "loopback", loopback_cell
            else:
                k, source = dynamo, "dynamodb-latency"
                kiln_cell = cell(results, dynamo_target, mode, concurrency) or {}
            s = added(results, "litellm-samejob", mode, concurrency)
            peer = cell(results, "litellm-samejob", mode, concurrency) or {}
            failed = source == "loopback" and k is None and s is not None
            rows.append({"mode": mode, "concurrency": concurrency, "kiln_added": k, "kiln_source": source,
                         "kiln_errors": kiln_cell.get("errors"),
                         "kiln_dynamodb_latency_added": dynamo,
                         "dynamodb_latency_ratio": round(dynamo / s, 3) if dynamo is not None and s else None,
                         "kiln_on_emulator_added": added(results, "kiln", mode, concurrency), "samejob_added": s,
                         "ratio": round(k / s, 3) if k is not None and s else None,
                         "samejob_refused": (peer.get("statuses") or {}).get("429", 0),
                         "samejob_requests": peer.get("requests"),
                         "kiln_failed": failed,
                         "pass": False if failed else None if k is None or s is None
                         else (k <= s * ratio and not kiln_cell.get("errors"))})
    measured = "; ".join(f"{r['mode']} c={r['concurrency']}: Kiln +{r['kiln_added']} vs LiteLLM same job +{r['samejob_added']} "
                         f"ms (×{r['ratio']}; LiteLLM 429 {r['samejob_refused']}/{r['samejob_requests']})" for r in rows)
    on_loopback = bool(rows) and all(r["kiln_source"] == "loopback" for r in rows)
    if on_loopback:
        measured = ("both with their storage on loopback; " + measured + "; Kiln with storage at DynamoDB's latency "
                    "(not compared): " + ", ".join(f"{r['mode']} c={r['concurrency']} ×{r['dynamodb_latency_ratio']}"
                                                   for r in rows))
    return {"id": "samejob", "goal": f"Kiln's added p50 ≤ {ratio:.2g} × the same-job peer's (LiteLLM: per-key limit on "
                                      "Redis, cost tracking), c=1 and 8"
                                      + (", both with their storage on loopback" if on_loopback else ""),
            "measured": measured or "not measured", "rows": rows, "pass": _verdict([r["pass"] for r in rows])}


def coldstart_production(results: dict, ratio: float = COLD_RATIO) -> dict[str, Any]:
    """Every function on its production path against a bare FastAPI app on the same path, with .pyc."""
    production = ((results.get("coldstart") or {}).get("production") or {}).get("pyc") or {}
    rows = [{"app": app, **entry, "pass": None if entry.get("ratio_to_bare") is None
             else entry["ratio_to_bare"] <= ratio and not entry.get("errors")} for app, entry in production.items()]
    measured = "; ".join(f"{r['app']} ({r['path']}) {r['first_answer_ms']} ms vs bare {r['bare_ms']} ms (×{r['ratio_to_bare']})"
                         for r in rows)
    return {"id": "coldstart_production",
            "goal": f"cold start of every function on its production path ≤ {ratio:g} × a bare FastAPI app's on the same "
                    "path, with .pyc",
            "measured": measured or (results.get("coldstart") or {}).get("error", "not measured"), "rows": rows,
            "pass": _verdict([r["pass"] for r in rows])}


def lambda_sizes(results: dict, template_memory_mb: int | None = None) -> dict[str, Any]:
    """The $ per million requests table exists for every size and workload, and a default was chosen
    (and, when `template_memory_mb` is given, the template says the same)."""
    sizes = results.get("sizes") or {}
    if not sizes.get("sizes"):
        return {"id": "lambda_sizes", "goal": "$ per million requests per memory size and workload, and the chosen default",
                "measured": sizes.get("error", "not measured"), "pass": None}
    chosen = (sizes.get("default") or {}).get("size_mb")
    priced = {int(size): {w: (e.get(w) or {}).get("cost", {}).get("total") for w in ("buffered", "short_stream", "long_stream")}
              for size, e in sizes["sizes"].items()}
    missing = [f"{size} MB {w}" for size, costs in priced.items() for w, v in costs.items() if v is None]
    at = priced.get(int(chosen)) if chosen else None
    measured = (f"default {chosen} MB" if chosen else "no default chosen") + (
        f": ${at['buffered']} / ${at['short_stream']} / ${at['long_stream']} per million buffered / short-stream / "
        "30 s-stream requests" if at else "") + (f"; not priced: {', '.join(missing)}" if missing else "")
    ok: bool | None = bool(chosen) and not missing
    if template_memory_mb is not None and chosen:
        measured += f"; template.yaml MemorySize {template_memory_mb}"
        ok = ok and int(chosen) == template_memory_mb
    return {"id": "lambda_sizes", "goal": "$ per million requests per memory size and workload, and the chosen default "
                                          "(template.yaml's MemorySize)", "measured": measured, "pass": ok}
