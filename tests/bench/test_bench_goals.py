"""Issue 16's goals from a run's results: figures, verdicts, and "not measured" rather than a pass."""

from __future__ import annotations

from bench import goals, sections


def matrix_cell(target: str, mode: str, concurrency: int, p50: float, p99: float | None = None, **extra) -> dict:
    return {"target": target, "mode": mode, "concurrency": concurrency, "ok": 10, "requests": 10, "errors": 0,
            "latency_ms": {"p50": p50, "p99": p99 if p99 is not None else p50 * 2}, **extra}


def results(cells: list[dict], concurrencies=(1,)) -> dict:
    return {"config": {"concurrencies": list(concurrencies)}, "matrix": cells}


def test_cpu_goal_needs_every_cell_at_half_of_portkeys():
    cells = []
    for mode, kiln in (("buffered", 1.0), ("stream", 1.3)):
        cells.append(matrix_cell(goals.CPU_TARGET, mode, 1, 10, cpu_ms_per_request={goals.CPU_TARGET: kiln, "storage stand-in": 1.0}))
        cells.append(matrix_cell("portkey", mode, 1, 3, cpu_ms_per_request={"portkey": 2.5}))
        cells.append(matrix_cell("kiln", mode, 1, 10, cpu_ms_per_request={"kiln": 0.1, "emulator": 8.0}))
    goal = goals.cpu_vs_portkey(results(cells))
    assert [r["ratio"] for r in goal["rows"]] == [0.4, 0.52]
    assert goal["pass"] is False
    assert goal["rows"][0]["kiln_emulated_cpu_ms"] == 0.1  # shown beside it, not compared
    cells[3]["cpu_ms_per_request"][goals.CPU_TARGET] = 1.2
    assert goals.cpu_vs_portkey(results(cells))["pass"] is True
    assert goals.cpu_vs_portkey(results(cells[:3]))["pass"] is None  # streamed cells missing: not measured


def test_standin_goal_subtracts_the_service_time_waited_for():
    cells = [matrix_cell("direct", "buffered", 1, 1.0, 2.0), matrix_cell("portkey", "buffered", 1, 4.0, 9.0),
             matrix_cell("kiln-standin", "buffered", 1, 14.0, 30.0,
                         storage_wait={"calls_per_request": 2.0, "storage_ms_per_request": {"p50": 11.9, "p99": 20.0}},
                         standin_cell={"calls": 40, "service_ms_mean": 4.25})]
    goal = goals.standin_overhead(results(cells))
    row = goal["rows"][0]
    assert (row["kiln_added_p50"], row["storage_wait"], row["kiln_net_p50"]) == (13.0, 8.5, 4.5)
    assert row["probe_storage_wall_p50"] == 11.9  # shown, not subtracted: it holds the gateway's own loop delays
    assert (row["kiln_net_p99"], row["portkey_added_p99"]) == (19.5, 7.0)
    assert row["pass"] is False  # 4.5 ms of its own against Portkey's 3.0
    cells[1]["latency_ms"]["p50"] = 6.0
    goal = goals.standin_overhead(results(cells))
    assert goal["rows"][0]["pass"] is True
    # a streamed row that was not measured makes the whole goal "not measured", never a pass
    assert goal["pass"] is None
    cells[2]["errors"] = 1
    assert goals.standin_overhead(results(cells))["rows"][0]["pass"] is False
    del cells[2]["standin_cell"]
    assert goals.standin_overhead(results(cells))["rows"][0]["pass"] is None


def test_samejob_goal_compares_added_latency_and_counts_the_peers_refusals():
    cells = []
    for c in (1, 8):
        for mode in ("buffered", "stream"):
            cells += [matrix_cell("direct", mode, c, 1.0), matrix_cell("kiln-standin", mode, c, 11.0),
                      matrix_cell("litellm-samejob", mode, c, 40.0, statuses={"200": 6, "429": 4})]
    goal = goals.samejob(results(cells, (1, 8)))
    assert {r["ratio"] for r in goal["rows"]} == {round(10 / 39, 3)}
    assert goal["rows"][0]["samejob_refused"] == 4
    assert goal["pass"] is True
    cells[1]["latency_ms"]["p50"] = 15.0  # Kiln +14 against LiteLLM +39: more than a third
    assert goals.samejob(results(cells, (1, 8)))["pass"] is False


def test_samejob_goal_compares_kiln_over_storage_as_near_as_the_peers_where_the_run_has_it():
    cells = []
    for c in (1, 8):
        for mode in ("buffered", "stream"):
            cells += [matrix_cell("direct", mode, c, 1.0), matrix_cell(goals.CPU_TARGET, mode, c, 16.0),
                      matrix_cell(goals.LOOPBACK_TARGET, mode, c, 6.0), matrix_cell("litellm-samejob", mode, c, 31.0)]
    goal = goals.samejob(results(cells, (1, 8)))
    row = goal["rows"][0]
    assert (row["kiln_source"], row["kiln_added"], row["ratio"]) == ("loopback", 5.0, round(5 / 30, 3))
    # Kiln with its storage at DynamoDB's latency: shown with its own ratio, not compared
    assert (row["kiln_dynamodb_latency_added"], row["dynamodb_latency_ratio"]) == (15.0, 0.5)
    assert goal["pass"] is True and goal["measured"].startswith("both with their storage on loopback")
    cells[2]["latency_ms"]["p50"] = 12.0  # +11 against +30: more than a third
    assert goals.samejob(results(cells, (1, 8)))["pass"] is False
    cells[2]["latency_ms"]["p50"] = 6.0
    cells[2]["errors"] = 3  # a fast cell that failed requests is no pass
    assert goals.samejob(results(cells, (1, 8)))["pass"] is False
    # a loopback cell that measured nothing (its process crashed) fails its row: no quiet fall-back
    cells[2] = {"target": goals.LOOPBACK_TARGET, "mode": "buffered", "concurrency": 1, "skipped": "crashed"}
    row = goals.samejob(results(cells, (1, 8)))["rows"][0]
    assert (row["kiln_source"], row["kiln_failed"], row["pass"]) == ("loopback", True, False)
    # a run without loopback cells (older results) compares Kiln at DynamoDB's latency, and says so
    older = goals.samejob(results([c for c in cells if c["target"] != goals.LOOPBACK_TARGET], (1, 8)))
    assert {r["kiln_source"] for r in older["rows"]} == {"dynamodb-latency"}
    assert older["rows"][0]["ratio"] == 0.5 and older["pass"] is False
    assert "loopback" not in older["measured"] and "loopback" not in older["goal"]


def test_coldstart_goal_reads_the_production_paths():
    def entry(ratio, errors=()):
        return {"path": "p", "first_answer_ms": 100 * ratio, "bare_ms": 100, "ratio_to_bare": ratio, "errors": list(errors)}

    run = {"coldstart": {"production": {"pyc": {"chat_completions": entry(1.1), "models": entry(1.19)}}}}
    assert goals.coldstart_production(run)["pass"] is True
    run["coldstart"]["production"]["pyc"]["models"] = entry(1.25)
    assert goals.coldstart_production(run)["pass"] is False
    run["coldstart"]["production"]["pyc"]["models"] = entry(1.0, ["HTTP 500"])
    assert goals.coldstart_production(run)["pass"] is False
    assert goals.coldstart_production({"coldstart": {"error": "python3.13 not found"}})["pass"] is None


def test_sizes_goal_needs_every_workload_priced_and_the_template_to_agree():
    priced = {w: {"cost": {"total": 1.0}} for w in ("buffered", "short_stream", "long_stream")}
    run = {"sizes": {"sizes": {"256": priced, "512": priced}, "default": {"size_mb": 256}}}
    assert goals.lambda_sizes(run)["pass"] is True
    assert goals.lambda_sizes(run, template_memory_mb=256)["pass"] is True
    assert goals.lambda_sizes(run, template_memory_mb=1024)["pass"] is False
    run["sizes"]["sizes"]["512"] = {"buffered": {"cost": {"total": 1.0}}}
    assert "not priced: 512 MB short_stream" in goals.lambda_sizes(run)["measured"]
    assert goals.lambda_sizes(run)["pass"] is False
    assert goals.lambda_sizes({})["pass"] is None


def test_cpu_goal_compares_the_medians_of_rounds_side_by_side_where_the_run_has_them():
    cells = []
    for mode in ("buffered", "stream"):
        cells.append(matrix_cell(goals.CPU_TARGET, mode, 1, 10, cpu_ms_per_request={goals.CPU_TARGET: 3.0}))
        cells.append(matrix_cell("portkey", mode, 1, 3, cpu_ms_per_request={"portkey": 4.0}))  # one noisy cell: ×0.75
    run = results(cells)
    run["cpu_rounds"] = {"cells": {
        f"{mode}_c1": {goals.CPU_TARGET: {"values": [2.0, 2.2, 2.9], "median": 2.2, "min": 2.0, "max": 2.9},
                       "portkey": {"values": [4.0, 5.0, 6.0], "median": 5.0, "min": 4.0, "max": 6.0}}
        for mode in ("buffered", "stream")}}
    goal = goals.cpu_vs_portkey(run)
    row = goal["rows"][0]
    assert (row["source"], row["kiln_cpu_ms"], row["portkey_cpu_ms"], row["ratio"]) == ("rounds", 2.2, 5.0, 0.44)
    assert (row["kiln_matrix_cpu_ms"], row["portkey_matrix_cpu_ms"]) == (3.0, 4.0)  # kept beside, not compared
    assert row["kiln_range"] == [2.0, 2.9] and row["rounds"] == 3
    assert goal["pass"] is True and goal["measured"].startswith("medians of 3 rounds")
    run["cpu_rounds"]["cells"]["stream_c1"]["portkey"].update(median=4.0)  # ×0.55
    assert goals.cpu_vs_portkey(run)["pass"] is False
    del run["cpu_rounds"]["cells"]["stream_c1"]  # a cell without rounds falls back to the matrix (×0.75)
    assert goals.cpu_vs_portkey(run)["rows"][1]["source"] == "matrix"
    assert goals.cpu_vs_portkey(run)["pass"] is False


def test_cpu_goal_counts_the_spaced_token_streams_of_the_rounds_in_its_verdict():
    """The mock's instant streams barely hold a gateway's per-chunk work: streams of spaced tokens,
    measured in the rounds only, are rows of the goal of their own, and fail it like any other."""
    cells = []
    for mode in ("buffered", "stream"):
        cells.append(matrix_cell(goals.CPU_TARGET, mode, 1, 10, cpu_ms_per_request={goals.CPU_TARGET: 1.0}))
        cells.append(matrix_cell("portkey", mode, 1, 3, cpu_ms_per_request={"portkey": 4.0}))
    run = results(cells)

    def spread(kiln, portkey):
        return {goals.CPU_TARGET: {"values": [kiln], "median": kiln, "min": kiln, "max": kiln},
                "portkey": {"values": [portkey], "median": portkey, "min": portkey, "max": portkey}}

    run["cpu_rounds"] = {"cells": {"buffered_c1": spread(1.0, 4.0), "stream_c1": spread(1.0, 4.0)}}
    assert [row["mode"] for row in goals.cpu_vs_portkey(run)["rows"]] == ["buffered", "stream"]
    assert goals.cpu_vs_portkey(run)["pass"] is True
    run["cpu_rounds"]["cells"]["spaced_c1"] = spread(2.4, 4.0)  # ×0.6
    run["cpu_rounds"]["spaced"] = {"targets": [goals.CPU_TARGET, "portkey"], "counts": {"1": 20}}
    goal = goals.cpu_vs_portkey(run)
    spaced = goal["rows"][-1]
    assert (spaced["mode"], spaced["ratio"], spaced["pass"], spaced["source"]) == ("spaced", 0.6, False, "rounds")
    assert goal["pass"] is False and "stream, spaced tokens c=1: 2.4 vs 4.0 ms (×0.6)" in goal["measured"]
    table = sections.cpu(run)
    assert "| stream, spaced tokens | 1 | 2.40 |" in table and "20 at c=1" in table


def one_figure(median):
    """A cell of the CPU rounds whose rounds all measured `median`."""
    return {"values": [median], "median": median, "min": median, "max": median}


def kiln_matrix() -> dict:
    """A run whose matrix has Kiln's buffered and streamed cells at c=1, for the rounds to go beside."""
    return results([matrix_cell(goals.CPU_TARGET, mode, 1, 10, cpu_ms_per_request={goals.CPU_TARGET: 3.0})
                    for mode in ("buffered", "stream")])


def test_cpu_goal_says_where_kilns_own_exchanges_already_cost_more_than_the_goal_allows():
    run = kiln_matrix()
    run["cpu_rounds"] = {"cells": {
        "buffered_c1": {goals.CPU_TARGET: one_figure(2.5), "portkey": one_figure(2.4), goals.FLOOR_KILN: one_figure(1.5),
                        goals.FLOOR_PROXY: one_figure(0.7)},
        "stream_c1": {goals.CPU_TARGET: one_figure(3.0), "portkey": one_figure(4.4), goals.FLOOR_KILN: one_figure(2.0),
                      goals.FLOOR_PROXY: one_figure(1.1)}}}
    goal = goals.cpu_vs_portkey(run)
    buffered, stream = goal["rows"]
    assert (buffered["floor_ratio"], buffered["floor_reachable"], buffered["kiln_above_floor_ms"]) == (0.625, False, 1.0)
    assert (stream["floor_ratio"], stream["floor_reachable"], stream["floor_proxy_ms"]) == (0.455, True, 1.1)
    assert goal["pass"] is False  # the verdict is Kiln's own, whatever the floor says
    assert "above 0.5 in 1 of 2 cells" in goal["measured"]
    # a floor that failed in every round has no figure, and says how many requests failed
    run["cpu_rounds"]["cells"]["stream_c1"][goals.FLOOR_KILN] = {"values": [], "median": None, "min": None,
                                                                  "max": None, "errors": 7}
    stream = goals.cpu_vs_portkey(run)["rows"][1]
    assert (stream["floor_kiln_ms"], stream["floor_reachable"], stream["floor_errors"]) == (None, None, 7)


def test_the_floor_beside_the_spaced_token_streams_counts_where_the_goal_is_out_of_reach():
    """Each read of a spaced stream wakes the process: the floor relaying the same streams says
    how much of the goal's allowance the exchanges alone take there, as in the other cells."""
    run = kiln_matrix()
    run["cpu_rounds"] = {"cells": {
        f"{mode}_c1": {goals.CPU_TARGET: one_figure(2.0), "portkey": one_figure(5.0), goals.FLOOR_KILN: one_figure(1.0),
                       goals.FLOOR_PROXY: one_figure(0.5)} for mode in ("buffered", "stream")}}
    run["cpu_rounds"]["cells"]["spaced_c1"] = {goals.CPU_TARGET: one_figure(9.0), "portkey": one_figure(12.0),
                                               goals.FLOOR_KILN: one_figure(7.2)}
    run["cpu_rounds"]["spaced"] = {"targets": [goals.CPU_TARGET, "portkey", goals.FLOOR_KILN], "counts": {"1": 20}}
    goal = goals.cpu_vs_portkey(run)
    spaced = goal["rows"][-1]
    assert (spaced["mode"], spaced["floor_ratio"], spaced["floor_reachable"], spaced["kiln_above_floor_ms"]) == (
        "spaced", 0.6, False, 1.8)
    assert spaced["floor_proxy_ms"] is None  # the one-exchange floor does not relay them
    assert "above 0.5 in 1 of 3 cells" in goal["measured"]
    table = sections.cpu(run)
    floor_row = [line for line in table.splitlines() if line.startswith("| stream, spaced tokens | 1 | 7.20 |")]
    assert floor_row and "| 0.60 | **no** | 1.80 | – |" in floor_row[0]
    assert "Kiln, Portkey and the floor of Kiln's exchanges" in table
    # a run from before the floor relayed them counts the other cells only
    del run["cpu_rounds"]["cells"]["spaced_c1"][goals.FLOOR_KILN]
    assert "above 0.5 in 0 of 2 cells" in goals.cpu_vs_portkey(run)["measured"]
