"""The report's sections for the CPU and same-job goals, rendered from a run's results."""

from __future__ import annotations

import json
from pathlib import Path

from bench import goals, sections

# a full run from before the floors and the loopback cells existed
OLDER = Path(__file__).resolve().parents[2] / "bench" / "results" / "20261201T181139Z.json"


def cell(target: str, mode: str, concurrency: int, p50: float, **extra) -> dict:
    return {"target": target, "mode": mode, "concurrency": concurrency, "ok": 10, "requests": 10, "errors": 0,
            "latency_ms": {"p50": p50, "p99": p50 * 2}, **extra}


def spread(median, errors=0):
    return {"values": [median] if median is not None else [], "median": median, "min": median, "max": median,
            "errors": errors}


def run() -> dict:
    cells = []
    for mode in ("buffered", "stream"):
        cells += [cell("direct", mode, 1, 1.0), cell(goals.CPU_TARGET, mode, 1, 16.0),
                  cell(goals.LOOPBACK_TARGET, mode, 1, 4.0), cell("litellm-samejob", mode, 1, 31.0)]
    rounds = {f"{mode}_c1": {goals.CPU_TARGET: spread(2.5), "portkey": spread(2.4), goals.FLOOR_KILN: spread(1.5),
                             goals.FLOOR_PROXY: spread(0.7)} for mode in ("buffered", "stream")}
    rounds["stream_c1"][goals.FLOOR_KILN] = {**spread(None, errors=5), "rounds_not_run": 2}
    return {"config": {"concurrencies": [1]}, "matrix": cells, "cpu_rounds": {"rounds": 1, "count": 10, "warmup": 1,
                                                                             "cells": rounds},
            "standin": {"service_ms": 4.0, "loopback": {"service_ms": 0.0, "stats": {"calls": 40, "errors": 0,
                                                                                     "in_flight_max": 1}}}}


def rows_of(text: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith(f"| {first}")]


def test_the_cpu_section_shows_each_floor_beside_portkey_and_a_failed_floor_as_failed():
    text = sections.cpu(run())
    assert "**The floor.**" in text
    buffered, stream = rows_of(text, "buffered")[-1], rows_of(text, "stream")[-1]  # the floor table's rows
    assert buffered[2:7] == ["1.50", "1.50–1.50", "0.62", "**no**", "1.00"]
    assert stream[2] == "–" and stream[-1] == "5, 2"  # no figure: five failed requests, two rounds not run


def test_the_samejob_section_compares_storage_on_loopback_and_keeps_dynamodb_latency_beside():
    text = sections.samejob(run())
    assert "with its storage on loopback too" in text and "it served 40 calls" in text
    row = rows_of(text, "buffered")[0]
    assert row[:6] == ["buffered", "1", "3.0", "30.0", "0.10", "yes"]
    assert row[6:8] == ["15.0", "0.50"]


def test_both_sections_render_from_an_older_run_which_has_neither_floors_nor_loopback_cells():
    results = json.loads(OLDER.read_text())
    assert "**The floor.**" not in sections.cpu(results)
    text = sections.samejob(results)
    assert "this run has no cells with Kiln's storage on loopback" in text
    assert "(DynamoDB latency)" in text
