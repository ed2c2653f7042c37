"""PNG plots for docs/performance.md. Run with the bench's tool environment (matplotlib):
`.bench/tools/venv/bin/python -m bench.plots bench/results/latest.json docs/performance`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"direct": "#7f7f7f", "kiln": "#d62728", "portkey": "#1f77b4", "litellm": "#2ca02c", "kiln-standin": "#ff9896", "kiln-standin-bare": "#8c564b",
          "litellm-samejob": "#98df8a"}


def _save(fig, path: Path) -> None:
    """Every plot at the same resolution, then freed (a run draws several)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _targets(results: dict) -> list[str]:
    seen = []
    for cell in results.get("matrix", []):
        if cell["target"] not in seen:
            seen.append(cell["target"])
    return seen


def latency(results: dict, out: Path) -> None:
    targets = _targets(results)
    concurrencies = results["config"]["concurrencies"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (mode, metric, title) in zip(axes, (("buffered", "latency_ms", "buffered: latency"),
                                                 ("stream", "latency_ms", "streamed: whole stream"),
                                                 ("stream", "ttfb_ms", "streamed: time to first byte")), strict=True):
        width = 0.8 / max(1, len(targets))
        for i, target in enumerate(targets):
            p50, p99, xs = [], [], []
            for j, c in enumerate(concurrencies):
                cell = next((x for x in results["matrix"] if x["target"] == target and x["mode"] == mode
                             and x["concurrency"] == c and metric in x and x.get("ok")), None)
                if cell is None:
                    continue
                xs.append(j + i * width)
                p50.append(cell[metric]["p50"])
                p99.append(cell[metric]["p99"])
            ax.bar(xs, p50, width, label=target, color=COLORS.get(target))
            ax.scatter(xs, p99, marker="_", s=120, color="black", zorder=3)
        ax.set_xticks([j + width * (len(targets) - 1) / 2 for j in range(len(concurrencies))])
        ax.set_xticklabels([f"c={c}" for c in concurrencies])
        ax.set_yscale("log")
        ax.set_ylabel("ms (bar p50, tick p99)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    _save(fig, out / "latency.png")


def throughput(results: dict, out: Path) -> None:
    targets = _targets(results)
    concurrencies = results["config"]["concurrencies"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, ("buffered", "stream"), strict=True):
        for target in targets:
            rows = [(c, x["req_per_s"]) for c in concurrencies for x in results["matrix"]
                    if x["target"] == target and x["mode"] == mode and x["concurrency"] == c and x.get("req_per_s")]
            if rows:
                ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=target, color=COLORS.get(target))
        ax.set_yscale("log")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("successful requests/s")
        ax.set_title(mode)
        ax.grid(alpha=0.3)
    axes[0].legend()
    _save(fig, out / "throughput.png")


def gaps(results: dict, out: Path) -> None:
    g = (results.get("gaps") or {}).get("targets") or {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, entry in g.items():
        values = sorted(entry.get("gaps_ms_all") or [])
        if not values:
            continue
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{name} (p50 {entry['gap_ms']['p50']} ms)",
                color=COLORS.get(name))
    ax.axvline(results["gaps"]["upstream_token_delay_ms"], color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("gap between consecutive SSE events seen by the client (ms)")
    ax.set_ylabel("cumulative share")
    ax.set_xlim(0, 3 * results["gaps"]["upstream_token_delay_ms"])
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, out / "gaps.png")


def coldstart(results: dict, out: Path) -> None:
    c = results.get("coldstart") or {}
    if not c.get("variants"):
        return
    apps = list(c["variants"]["pyc"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for k, (variant, color) in enumerate((("pyc", "#1f77b4"), ("nopyc", "#ff7f0e"))):
        values = [c["variants"][variant][a]["first_answer_ms_median"] or 0 for a in apps]
        ready = [c["variants"][variant][a]["ready_ms_median"] or 0 for a in apps]
        xs = [i + k * width for i in range(len(apps))]
        ax.bar(xs, values, width, color=color, alpha=0.85, label=f"first answer ({'with' if variant == 'pyc' else 'without'} .pyc)")
        ax.scatter(xs, ready, marker="_", s=200, color="black", zorder=3)
    bare = c["variants"]["pyc"]["bare_fastapi"]["first_answer_ms_median"]
    if bare:
        ax.axhline(bare * 1.3, color="red", linestyle="--", linewidth=1, label="goal: 1.3 × bare FastAPI (.pyc)")
    ax.set_xticks([i + width / 2 for i in range(len(apps))])
    ax.set_xticklabels(apps)
    ax.set_ylabel("ms from process start (tick: /healthz ready)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, out / "coldstart.png")


def breakdown(results: dict, out: Path) -> None:
    b = results.get("breakdown") or {}
    rows = [(name, b[name]["steady"]) for name in ("buffered_c1", "stream_c1", "buffered_c16") if name in b]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [name for name, _ in rows]
    storage = [s["storage_ms_per_request"]["p50"] or 0 for _, s in rows]
    cpu = [s["gateway_cpu_ms_per_request_without_storage"] or 0 for _, s in rows]
    server = [s["server_ms"]["p50"] or 0 for _, s in rows]
    rest = [max(0.0, sv - st - cp) for sv, st, cp in zip(server, storage, cpu, strict=True)]
    ax.barh(labels, storage, color="#9467bd", label="storage round trips (wall)")
    ax.barh(labels, cpu, left=storage, color="#d62728", label="gateway CPU without storage (mean)")
    ax.barh(labels, rest, left=[a + b for a, b in zip(storage, cpu, strict=True)], color="#c7c7c7",
            label="the rest: upstream, waiting for CPU/locks")
    ax.set_xlabel("ms per request (server side, p50)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, out / "breakdown.png")


def sizes(results: dict, out: Path) -> None:
    """TTFB and $ per million requests against the Lambda memory size."""
    entries = sorted(((int(k), v) for k, v in ((results.get("sizes") or {}).get("sizes") or {}).items() if "error" not in v))
    if not entries:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [size for size, _ in entries]
    for workload, color in (("buffered", "#1f77b4"), ("short_stream", "#d62728")):
        for stat, style in (("ttfb_p50_ms", "-"), ("ttfb_p99_ms", ":")):
            ys = [(e.get(workload) or {}).get(stat) for _, e in entries]
            left.plot(xs, ys, style, marker="o", color=color, label=f"{workload} {stat[5:8]}")
    left.set_xlabel("memory MB (CPU ∝ memory)")
    left.set_ylabel("TTFB ms, one request at a time")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    for workload, color in (("buffered", "#1f77b4"), ("short_stream", "#d62728"), ("long_stream", "#2ca02c")):
        ys = [((e.get(workload) or {}).get("cost") or {}).get("total") for _, e in entries]
        right.plot(xs, ys, marker="o", color=color, label=workload)
    chosen = ((results.get("sizes") or {}).get("default") or {}).get("size_mb")
    if chosen:
        right.axvline(int(chosen), color="#7f7f7f", linestyle="--", label=f"default {chosen} MB")
    right.set_xlabel("memory MB")
    right.set_ylabel("$ per million requests")
    right.set_yscale("log")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    _save(fig, out / "sizes.png")


def main(argv: list[str]) -> int:
    results = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if results.get("matrix"):
        latency(results, out)
        throughput(results, out)
    if results.get("gaps"):
        gaps(results, out)
    coldstart(results, out)
    breakdown(results, out)
    sizes(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
