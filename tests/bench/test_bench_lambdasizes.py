"""Lambda sizes: CPU share and quota arithmetic, the price of a request, the default size, cgroup files."""

from __future__ import annotations

import pytest
from bench.lambdasizes import PRICES, Cgroup, choose_default, cost_per_million, quota_us, vcpu_share


def test_cpu_share_is_proportional_to_memory_with_one_vcpu_at_1769_mb():
    assert vcpu_share(1769) == 1.0
    assert vcpu_share(128) == pytest.approx(0.07236, abs=1e-5)
    assert quota_us(1769) == 100_000
    assert quota_us(128) == 7236
    assert quota_us(2048) == 115_772  # more than one CPU: a 2-core machine can give it
    assert quota_us(128, period_us=10_000) == 1000  # never under the kernel's 1 ms
    assert quota_us(1024, period_us=20_000) == 11_577


def test_a_30_s_stream_at_1024_mb_costs_400_dollars_per_million_in_lambda_duration():
    cost = cost_per_million(1024, duration_ms=30_000, write_units=5, read_units=0.5, ssm_calls=0.01)
    assert cost["lambda_duration"] == pytest.approx(30 * PRICES["lambda_gb_second_arm64"] * 1e6, rel=1e-6)
    assert cost["lambda_duration"] == pytest.approx(400.0, abs=0.01)
    assert cost["lambda_requests"] == 0.2 and cost["api_gateway"] == 3.5
    assert cost["dynamodb"] == pytest.approx(5 * 0.625 + 0.5 * 0.125)
    assert cost["ssm"] == 0.0
    assert cost["total"] == pytest.approx(sum(v for k, v in cost.items() if k != "total"), abs=1e-3)
    # billed per started millisecond, and x86 costs more per GB-s
    assert cost_per_million(1024, duration_ms=10.2, write_units=0, read_units=0)["lambda_duration"] == \
        cost_per_million(1024, duration_ms=11, write_units=0, read_units=0)["lambda_duration"]
    assert cost_per_million(1024, duration_ms=1000, write_units=0, read_units=0, arch="x86")["lambda_duration"] > \
        cost_per_million(1024, duration_ms=1000, write_units=0, read_units=0)["lambda_duration"]


def _row(ttfb_b: float, ttfb_s: float, long_ms: float, size: int, errors: int = 0) -> dict:
    def cost(ms: float) -> dict:
        return cost_per_million(size, duration_ms=ms, write_units=5, read_units=0)

    return {"buffered": {"ttfb_p50_ms": ttfb_b, "latency_mean_ms": ttfb_b, "errors": errors, "cost": cost(ttfb_b)},
            "short_stream": {"ttfb_p50_ms": ttfb_s, "latency_mean_ms": ttfb_s + 5, "errors": 0, "cost": cost(ttfb_s + 5)},
            "long_stream": {"ttfb_p50_ms": ttfb_s, "latency_mean_ms": long_ms, "errors": 0, "cost": cost(long_ms)}}


def test_the_default_is_the_cheapest_size_that_keeps_latency():
    # best TTFB 12 / 10 ms: the bounds are max(1.25×, +5 ms) = 17 / 15 ms
    rows = {128: _row(60, 70, 30_400, 128), 256: _row(16, 14, 30_050, 256), 512: _row(14, 12, 30_010, 512),
            1024: _row(12, 10, 30_000, 1024)}
    chosen = choose_default(rows)
    assert chosen["size_mb"] == 256
    assert chosen["eligible"] == [256, 512, 1024]
    assert any("TTFB" in why for why in chosen["rejected"][128])
    rows[256]["long_stream"]["latency_mean_ms"] = 31_000  # a stream that no longer keeps up with the model
    assert choose_default(rows)["size_mb"] == 512


def test_the_default_rejects_slow_sizes_and_errors():
    rows = {128: _row(60, 70, 30_400, 128), 256: _row(25, 22, 30_050, 256), 512: _row(14, 12, 30_010, 512),
            1024: _row(12, 10, 30_000, 1024)}
    rows[512]["buffered"]["errors"] = 1
    chosen = choose_default(rows, ttfb_slack=1.25, ttfb_floor_ms=5)
    assert chosen["size_mb"] == 1024
    assert any("errors" in why for why in chosen["rejected"][512])
    assert any("TTFB" in why for why in chosen["rejected"][256])
    assert choose_default({})["size_mb"] is None


def test_cgroup_v2_files_carry_the_quota_and_the_memory_limit(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids")
    (tmp_path / "cgroup.subtree_control").write_text("")
    group = Cgroup("kiln-test", 512, root=tmp_path)
    group.create()
    folder = tmp_path / "kiln-test"
    assert (folder / "cpu.max").read_text() == "28943 100000"
    assert (folder / "memory.max").read_text() == str(512 * 1024 * 1024)
    argv = group.wrap(["python", "-c", "pass"])
    assert argv[:2] == ["sh", "-c"] and f"echo $$ > {folder / 'cgroup.procs'}" not in argv[2]  # no procs file in a fake tree
    (folder / "cgroup.procs").write_text("")
    assert f"echo $$ > {folder / 'cgroup.procs'}" in group.wrap(["true"])[2]
    assert group.wrap(["python", "-c", "pass"])[-3:] == ["python", "-c", "pass"]


def test_cgroup_v1_writes_period_and_quota_apart(tmp_path):
    for controller in ("cpu", "memory"):
        (tmp_path / controller).mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    group = Cgroup("kiln-test", 128, root=tmp_path, period_us=50_000)
    assert Cgroup.version(tmp_path) == 1
    group.create()
    assert (tmp_path / "cpu" / "kiln-test" / "cpu.cfs_period_us").read_text() == "50000"
    assert (tmp_path / "cpu" / "kiln-test" / "cpu.cfs_quota_us").read_text() == "3618"
    assert (tmp_path / "memory" / "kiln-test" / "memory.limit_in_bytes").read_text() == str(128 * 1024 * 1024)


def test_the_default_rejects_a_slow_start_and_a_long_tail():
    rows = {256: _row(16, 14, 30_050, 256), 512: _row(14, 12, 30_010, 512), 1024: _row(12, 10, 30_000, 1024)}
    for size, ready in ((256, 4200), (512, 2100), (1024, 1100)):
        rows[size]["start"] = {"ready_ms": ready}
    assert choose_default(rows)["size_mb"] == 512
    assert choose_default(rows)["rejected"][256] == ["start 4.2 s > 3.0"]
    for size, p99 in ((512, 95.0), (1024, 30.0)):
        rows[size]["buffered"]["ttfb_p99_ms"] = p99
    rows[256]["buffered"]["ttfb_p99_ms"] = 40.0
    chosen = choose_default(rows)  # the best p99 is 30 ms: the bound is max(45, 50) = 50 ms
    assert chosen["size_mb"] == 1024
    assert chosen["rejected"][512] == ["buffered TTFB p99 95.0 ms > 50.0"]
