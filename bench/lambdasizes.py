"""Lambda memory sizes: a function's process under the CPU share each size gets, and its price.

Lambda gives a function CPU in proportion to its memory, one full vCPU at 1 769 MB. Here the
chat/completions function (its run.sh, the built python3.13 layer where there is one) runs in a
cgroup of its own whose CFS quota is that share of one CPU (cgroup v2 `cpu.max`, or v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, whichever this kernel mounts), with the size as its
memory limit. Before measuring, a busy loop in each cgroup checks that the quota holds (CPU time
÷ wall time ≈ the share). Each size serves, one request at a time as one Lambda execution
environment does: buffered requests, short streams, then one long stream (the mock emitting a
token every 100 ms for 30 s; every size's long stream runs at once, which keeps the run bounded).
Storage is the stand-in (bench/standin.py, a fixed service time), so the figures are the
gateway's and the quota's, not the embedded AWS's.

Each size is then priced per million requests of each workload from list prices (`PRICES`):
Lambda duration (GB-s, arm64 as the template deploys) and requests, API Gateway REST requests,
DynamoDB on-demand write and read units (counted by the stand-in from the items' sizes, as
DynamoDB bills them) and SSM GetParameter calls.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["FULL_VCPU_MB", "PRICES", "SIZES_MB", "Cgroup", "choose_default", "cost_per_million", "quota_us",
           "vcpu_share"]

FULL_VCPU_MB = 1769
SIZES_MB = (128, 256, 512, 768, 1024, 1536, 2048)
PERIOD_US = 100_000  # the kernel's default CFS period
MIN_QUOTA_US = 1000  # the kernel refuses a quota under 1 ms

# us-east-1 list prices, as published by AWS in 2025 and recorded here on 2026-12-01 without
# fetching them (the bench runs offline): check them on the pricing pages before relying on them.
PRICES: dict[str, Any] = {
    "as_of": "2025 list prices, recorded 2026-12-01 (not fetched: check aws.amazon.com/lambda/pricing, "
             "/api-gateway/pricing, /dynamodb/pricing/on-demand, /systems-manager/pricing)",
    "region": "us-east-1",
    "lambda_gb_second_arm64": 0.0000133334,  # first 7.5 billion GB-s a month
    "lambda_gb_second_x86": 0.0000166667,
    "lambda_request": 0.20 / 1e6,
    "api_gateway_rest_request": 3.50 / 1e6,  # first 333 million a month
    "dynamodb_write_unit": 0.625 / 1e6,  # on-demand, since the November 2024 price cut
    "dynamodb_read_unit": 0.125 / 1e6,
    "ssm_get_parameter": 0.0,  # standard parameters, standard throughput: no charge per call
    "ssm_get_parameter_higher_throughput": 0.05 / 1e4,  # if the account turns higher throughput on
}


def vcpu_share(memory_mb: int) -> float:
    """The CPU Lambda gives a function of `memory_mb`: 1 vCPU at 1 769 MB, in proportion below and above."""
    return memory_mb / FULL_VCPU_MB


def quota_us(memory_mb: int, period_us: int = PERIOD_US) -> int:
    """The CFS quota (µs of CPU per `period_us`) matching `memory_mb`, never under the kernel's 1 ms."""
    return max(MIN_QUOTA_US, round(period_us * vcpu_share(memory_mb)))


def cost_per_million(memory_mb: int, *, duration_ms: float, write_units: float, read_units: float,
                     ssm_calls: float = 0.0, prices: dict[str, Any] = PRICES, arch: str = "arm64") -> dict[str, float]:
    """Dollars per million requests of one workload at one size, by part. Lambda bills each
    request's duration rounded up to the millisecond; `duration_ms` is the mean billed duration."""
    per_gb_s = prices[f"lambda_gb_second_{arch}"]
    parts = {
        "lambda_duration": memory_mb / 1024 * math.ceil(duration_ms) / 1000 * per_gb_s * 1e6,
        "lambda_requests": prices["lambda_request"] * 1e6,
        "api_gateway": prices["api_gateway_rest_request"] * 1e6,
        "dynamodb": (write_units * prices["dynamodb_write_unit"] + read_units * prices["dynamodb_read_unit"]) * 1e6,
        "ssm": ssm_calls * prices["ssm_get_parameter"] * 1e6,
    }
    parts["total"] = sum(parts.values())
    return {k: round(v, 4) for k, v in parts.items()}


def choose_default(rows: dict[int, dict[str, dict[str, Any]]], *, ttfb_slack: float = 1.25, ttfb_floor_ms: float = 5.0,
                   p99_slack: float = 1.5, p99_floor_ms: float = 20.0, long_slack: float = 1.02,
                   max_ready_ms: float = 3000.0) -> dict[str, Any]:
    """The template's default size: the cheapest per million long streams (where a stream's cost
    is made) among the sizes that
    - serve every workload without errors or OOM kills;
    - keep buffered and short-stream TTFB p50 within `ttfb_slack` × (or `ttfb_floor_ms` of) the best
      size's, and p99 within `p99_slack` × (or `p99_floor_ms` of) it;
    - finish the long stream within `long_slack` × the shortest (they keep up with the model);
    - start (process start → ready, under the quota) within `max_ready_ms`.
    `rows`: size → workload → figures (`ttfb_p50_ms`, `ttfb_p99_ms`, `latency_mean_ms`, `errors`,
    `oom_kills`, `cost`), plus an optional `ready_ms` per size under the key "start"."""
    if not rows:
        return {"size_mb": None, "why": "no size measured"}
    reasons: dict[int, list[str]] = {size: [] for size in rows}

    def bounded(workload: str, stat: str, slack: float, floor: float) -> None:
        measured = [r[workload][stat] for r in rows.values() if (r.get(workload) or {}).get(stat) is not None]
        if not measured:
            return
        best = min(measured)
        bound = max(best * slack, best + floor)
        for size, r in rows.items():
            value = (r.get(workload) or {}).get(stat)
            if value is None:
                reasons[size].append(f"{workload} {stat} not measured")
            elif value > bound:
                reasons[size].append(f"{workload} TTFB {stat[5:8]} {value:.1f} ms > {bound:.1f}")

    for workload in ("buffered", "short_stream"):
        bounded(workload, "ttfb_p50_ms", ttfb_slack, ttfb_floor_ms)
        bounded(workload, "ttfb_p99_ms", p99_slack, p99_floor_ms)
    longs = [r["long_stream"]["latency_mean_ms"] for r in rows.values()
             if (r.get("long_stream") or {}).get("latency_mean_ms") is not None]
    if longs:
        bound = min(longs) * long_slack
        for size, r in rows.items():
            value = (r.get("long_stream") or {}).get("latency_mean_ms")
            if value is None:
                reasons[size].append("long stream not measured")
            elif value > bound:
                reasons[size].append(f"long stream {value / 1000:.2f} s > {bound / 1000:.2f}")
    for size, r in rows.items():
        ready = (r.get("start") or {}).get("ready_ms")
        if ready is not None and ready > max_ready_ms:
            reasons[size].append(f"start {ready / 1000:.1f} s > {max_ready_ms / 1000:.1f}")
        for workload, figures in r.items():
            if figures.get("errors"):
                reasons[size].append(f"{figures['errors']} errors ({workload})")
            if figures.get("oom_kills"):
                reasons[size].append(f"OOM kills ({workload})")
    eligible = [size for size in rows if not reasons[size]]
    if not eligible:
        return {"size_mb": None, "why": "no size met every condition", "rejected": reasons}

    def long_cost(size: int) -> float:
        cost = (rows[size].get("long_stream") or {}).get("cost") or (rows[size].get("short_stream") or {}).get("cost") or {}
        return cost.get("total", math.inf)

    chosen = min(eligible, key=lambda size: (long_cost(size), size))
    return {"size_mb": chosen, "eligible": sorted(eligible), "rejected": {s: r for s, r in reasons.items() if r},
            "why": f"the cheapest per million long streams (${long_cost(chosen):.2f}) of the sizes that keep TTFB p50 "
                   f"within {ttfb_slack}× (or {ttfb_floor_ms:g} ms) and p99 within {p99_slack}× (or {p99_floor_ms:g} ms) "
                   f"of the best size's, finish the long stream within {long_slack}× of the shortest, start within "
                   f"{max_ready_ms / 1000:g} s under their quota, with no errors or OOM kills"}


# -- cgroups ------------------------------------------------------------------------------------

@dataclass
class Cgroup:
    """One cgroup with a CPU quota and a memory limit (v2 if its cpu controller is there, else v1)."""

    name: str
    memory_mb: int
    period_us: int = PERIOD_US
    root: Path = Path("/sys/fs/cgroup")

    @staticmethod
    def version(root: Path = Path("/sys/fs/cgroup")) -> int | None:
        """2 where the unified hierarchy has the cpu controller, 1 where v1's cpu controller is mounted."""
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return 2
        if (root / "cpu" / "cpu.cfs_quota_us").exists():
            return 1
        return None

    def dirs(self) -> dict[str, Path]:
        if self.version(self.root) == 2:
            return {"unified": self.root / self.name}
        dirs = {"cpu": self.root / "cpu" / self.name, "memory": self.root / "memory" / self.name}
        if (self.root / "cpuacct" / "cpuacct.usage").exists() and not (self.root / "cpu" / "cpuacct.usage").exists():
            dirs["cpuacct"] = self.root / "cpuacct" / self.name  # v1 with cpu and cpuacct mounted apart
        return dirs

    def create(self) -> None:
        version = self.version(self.root)
        if version is None:
            raise OSError("no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) is mounted")
        self.remove()
        limit = str(self.memory_mb * 1024 * 1024)
        if version == 2:
            top = self.root / "cgroup.subtree_control"
            if "cpu" not in top.read_text().split():
                top.write_text("+cpu +memory")
            d = self.dirs()["unified"]
            d.mkdir()
            (d / "cpu.max").write_text(f"{quota_us(self.memory_mb, self.period_us)} {self.period_us}")
            (d / "memory.max").write_text(limit)
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            return
        dirs = self.dirs()
        dirs["cpu"].mkdir()
        (dirs["cpu"] / "cpu.cfs_period_us").write_text(str(self.period_us))
        (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota_us(self.memory_mb, self.period_us)))
        if "cpuacct" in dirs:
            dirs["cpuacct"].mkdir()
        try:
            dirs["memory"].mkdir()
            (dirs["memory"] / "memory.limit_in_bytes").write_text(limit)
        except OSError:
            pass  # the CPU quota is what is measured; the memory limit is a bonus

    def cpu_seconds(self) -> float | None:
        """CPU time used by every process that was in this cgroup (nanosecond counters, not /proc's ticks)."""
        d = self.dirs()
        try:
            if "unified" in d:
                for line in (d["unified"] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return None
            usage = (d.get("cpuacct") or d["cpu"]) / "cpuacct.usage"
            return int(usage.read_text()) / 1e9 if usage.exists() else None
        except (OSError, ValueError):
            return None

    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs().values() if (d / "cgroup.procs").exists()]

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this cgroup: a shell joins it, then execs the command (children follow)."""
        joins = " && ".join(f"echo $$ > {path}" for path in self.procs_files())
        return ["sh", "-c", f'{joins} && exec "$@"', "sh", *argv]

    def oom_kills(self) -> int:
        d = self.dirs()
        try:
            if "unified" in d:
                for line in (d["unified"] / "memory.events").read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
                return 0
            control = (d["memory"] / "memory.oom_control").read_text()
            for line in control.splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError, KeyError):
            pass
        return 0

    def throttled(self) -> dict[str, int]:
        d = self.dirs()
        path = (d.get("unified") or d["cpu"]) / "cpu.stat"
        try:
            return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
        except (OSError, ValueError):
            return {}

    def remove(self) -> None:
        for d in self.dirs().values():
            if d.exists():
                for _ in range(50):
                    try:
                        d.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)  # its last process is still exiting


BURN = "import time\nc, w = time.process_time(), time.perf_counter()\nwhile time.perf_counter() - w < {seconds}: pass\n" \
       "print(time.process_time() - c, time.perf_counter() - w)"


def verify_quota(group: Cgroup, seconds: float = 0.6) -> dict[str, Any]:
    """A busy loop in the cgroup: the share of one CPU it got, against the quota's."""
    done = subprocess.run(group.wrap([sys.executable, "-c", BURN.format(seconds=seconds)]), capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        return {"error": done.stderr[-400:]}
    cpu, wall = (float(x) for x in done.stdout.split())
    expected = quota_us(group.memory_mb, group.period_us) / group.period_us
    return {"expected_share": round(expected, 4), "measured_share": round(cpu / wall, 4),
            "enforced": cpu / wall <= min(1.0, expected) * 1.15 + 0.01}


# -- the measurement ----------------------------------------------------------------------------

def measure(stack, start: Callable[[list[str] | None, str], tuple[Any, str]], standin_url: str, *, sizes: tuple[int, ...],
            buffered: int, short_streams: int, long_model: str, long_tokens: int, long_seconds: float,
            log: Callable[[str], None], label: str) -> dict[str, Any]:
    """Every size's function process under its quota: `start(wrap_prefix, name)` starts one and
    returns (child, url). Figures per size and workload, then prices and the chosen default."""
    import httpx

    from .load import run_cell
    from .procs import cpu_seconds, peak_rss_mb
    from .scenarios import _body

    version = Cgroup.version()
    if version is None or os.geteuid() != 0:
        return {"error": "needs root and a cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us)"}
    headers = {"authorization": f"Bearer {stack.key}"}
    out: dict[str, Any] = {"process": label, "cgroup_version": version, "period_us": PERIOD_US,
                           "full_vcpu_mb": FULL_VCPU_MB, "sizes": {}, "prices": PRICES,
                           "long_stream": {"tokens": long_tokens, "seconds": long_seconds}}
    running: dict[int, tuple[Cgroup, Any, str]] = {}

    def units() -> dict[str, float]:
        stats = httpx.get(f"{standin_url}/__standin/stats", timeout=10, trust_env=False).json()
        ops = stats.get("by_operation", {})
        return {"wru": stats.get("write_units", 0.0), "rru": stats.get("read_units", 0.0),
                "ssm": ops.get("AmazonSSM.GetParameter", 0)}

    def figures(size: int, result: dict, cpu_s: float | None, before: dict, after: dict) -> dict[str, Any]:
        n = result["requests"] or 1
        group = running[size][0]
        return {"requests": result["requests"], "errors": result["errors"], "error_samples": result["error_samples"][:2],
                "ttfb_p50_ms": result["ttfb_ms"]["p50"], "ttfb_p99_ms": result["ttfb_ms"]["p99"],
                "latency_p50_ms": result["latency_ms"]["p50"], "latency_p99_ms": result["latency_ms"]["p99"],
                "latency_mean_ms": result["latency_ms"]["mean"],
                "cpu_ms_per_request": round(cpu_s * 1000 / n, 3) if cpu_s is not None else None,
                "write_units_per_request": round((after["wru"] - before["wru"]) / n, 3),
                "read_units_per_request": round((after["rru"] - before["rru"]) / n, 4),
                "ssm_calls_per_request": round((after["ssm"] - before["ssm"]) / n, 4),
                "oom_kills": group.oom_kills()}

    def cell(size: int, stream: bool, count: int, body: dict) -> dict[str, Any]:
        group, child, url = running[size]

        def cpu() -> float | None:
            return group.cpu_seconds() if group.cpu_seconds() is not None else cpu_seconds(child.pid, tree=True)

        before, cpu0 = units(), cpu()
        result = run_cell(f"{url}/v1/chat/completions", headers, body, stream=stream, concurrency=1, count=count,
                          time_limit=120, warmup=0)
        cpu1, after = cpu(), units()
        return figures(size, result, None if None in (cpu0, cpu1) else cpu1 - cpu0, before, after)

    try:
        for size in sizes:
            group = Cgroup(f"kiln-bench-{size}mb", size)
            group.create()
            entry: dict[str, Any] = {"vcpu": round(vcpu_share(size), 4), "quota_us": quota_us(size),
                                     "quota_check": verify_quota(group)}
            started = time.perf_counter()
            try:
                child, url = start(group.wrap, f"size-{size}mb")
            except Exception as exc:  # noqa: BLE001 - e.g. killed for memory at start: recorded
                entry["error"] = f"{type(exc).__name__}: {exc}"[:600]
                entry["oom_kills"] = group.oom_kills()
                out["sizes"][size] = entry
                group.remove()
                log(f"  {size} MB: did not start: {entry['error'][:200]}")
                continue
            running[size] = (group, child, url)
            entry["ready_ms"] = round((time.perf_counter() - started) * 1000, 1)
            # one request first: caches filled, as in a warm environment
            run_cell(f"{url}/v1/chat/completions", headers, _body(False), stream=False, concurrency=1, count=2,
                     time_limit=60, warmup=0)
            entry["buffered"] = cell(size, False, buffered, _body(False))
            entry["short_stream"] = cell(size, True, short_streams, _body(True))
            entry["peak_rss_mb"] = peak_rss_mb(child.pid, tree=True)
            out["sizes"][size] = entry
            log(f"  {size:>4} MB ({entry['vcpu']:.3f} vCPU, measured {entry['quota_check'].get('measured_share')}): "
                f"ready {entry['ready_ms']} ms; buffered TTFB p50 {entry['buffered']['ttfb_p50_ms']} ms, "
                f"CPU {entry['buffered']['cpu_ms_per_request']} ms/req; short stream TTFB p50 "
                f"{entry['short_stream']['ttfb_p50_ms']} ms, total p50 {entry['short_stream']['latency_p50_ms']} ms")
        # the long streams: one per size, all at once
        if running:
            import concurrent.futures

            long_body = {**_body(True, long_model), "max_tokens": long_tokens}
            log(f"  long streams: {len(running)} at once (one per size), {long_seconds:.0f} s each")
            phase_before = units()
            with concurrent.futures.ThreadPoolExecutor(len(running)) as pool:
                futures = {}
                for size in running:
                    futures[size] = pool.submit(lambda s=size: cell(s, True, 1, long_body))
                for size, future in futures.items():
                    try:
                        out["sizes"][size]["long_stream"] = future.result(timeout=long_seconds * 3 + 60)
                    except Exception as exc:  # noqa: BLE001
                        out["sizes"][size]["long_stream"] = {"errors": 1, "error_samples": [f"{type(exc).__name__}: {exc}"[:300]]}
            # the streams ran at once: each one's storage units are the phase's, shared out
            phase_after = units()
            for size in running:
                long = out["sizes"][size]["long_stream"]
                if "requests" in long:
                    long["write_units_per_request"] = round((phase_after["wru"] - phase_before["wru"]) / len(running), 3)
                    long["read_units_per_request"] = round((phase_after["rru"] - phase_before["rru"]) / len(running), 4)
                    long["ssm_calls_per_request"] = round((phase_after["ssm"] - phase_before["ssm"]) / len(running), 4)
                    log(f"  {size:>4} MB long stream: {long['latency_mean_ms']} ms, CPU {long['cpu_ms_per_request']} ms, "
                        f"errors {long['errors']}")
    finally:
        for size, (group, child, _) in running.items():
            out["sizes"][size]["throttling"] = group.throttled()
            stack.procs.stop(child)
            group.remove()
    # prices
    for size, entry in out["sizes"].items():
        for workload in ("buffered", "short_stream", "long_stream"):
            figures_ = entry.get(workload)
            if not figures_ or figures_.get("latency_mean_ms") is None:
                continue
            figures_["cost"] = cost_per_million(size, duration_ms=figures_["latency_mean_ms"],
                                                write_units=figures_["write_units_per_request"],
                                                read_units=figures_["read_units_per_request"],
                                                ssm_calls=figures_["ssm_calls_per_request"])
    out["default"] = choose_default({size: {**{w: e[w] for w in ("buffered", "short_stream", "long_stream") if w in e},
                                            "start": {"ready_ms": e.get("ready_ms")}}
                                     for size, e in out["sizes"].items() if "error" not in e})
    return out
