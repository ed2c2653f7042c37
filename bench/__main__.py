"""`make bench` → `.venv/bin/python -m bench [--quick] [--skip SECTION,…] [--no-netns]`.

Two phases. Preparing (may use the network: the package registries) installs the peers and
the bench's tool environment under .bench/, Debian's redis-server with apt-get for the same-job
LiteLLM, tries LiteLLM's database layer (Prisma), and builds the x86 layer for cold starts and
the Lambda sizes; it is done once and reused. Measuring runs, where this user may create one (root), in a private
network namespace that has nothing but loopback (`unshare --net`): every process the bench
starts, the peers included, can only reach 127.0.0.1. Then bench/results/<timestamp>.json,
bench/results/latest.json, docs/performance/*.png and docs/performance.md are written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".bench"
SECTIONS = ("matrix", "cpu", "breakdown", "client", "ab", "profile", "gaps", "sse", "coldstart", "memory", "sizes")

FULL = dict(count=400, time_limit=60.0, warmup=16, concurrencies=(1, 8, 16), breakdown_count=300, steady_seconds=12.0,
            profile_count=400, gap_requests=10, sse_repeats=5, cold_repeats=5, memory_buffered=1750, memory_streamed=250,
            memory_concurrency=8, ab_count=300, ab_rounds=2, client_calls=1000, standin_service_ms=4.0,
            cpu_rounds=5, cpu_count=300, cpu_warmup=50, cpu_spaced={1: 20, 8: 96, 16: 160},
            sizes_mb=(128, 256, 512, 768, 1024, 1536, 2048), sizes_buffered=200, sizes_streams=200, long_tokens=300)
QUICK = dict(count=20, time_limit=10.0, warmup=2, concurrencies=(1, 8, 16), breakdown_count=30, steady_seconds=3.0,
             profile_count=60, gap_requests=1, sse_repeats=1, cold_repeats=1, memory_buffered=150, memory_streamed=50,
             memory_concurrency=8, ab_count=30, ab_rounds=1, client_calls=100, standin_service_ms=4.0,
             cpu_rounds=1, cpu_count=20, cpu_warmup=5, cpu_spaced={1: 2, 8: 8, 16: 16},
             sizes_mb=(128, 1024), sizes_buffered=5, sizes_streams=3, long_tokens=20)


def log(message: str) -> None:
    print(f"bench {time.strftime('%H:%M:%S')} {message}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a few requests per cell (figures meaningless); writes to .bench/quick/, "
                             "never to bench/results/ or docs/")
    parser.add_argument("--skip", default="", help=f"comma-separated sections to skip: {', '.join(SECTIONS)}")
    parser.add_argument("--skip-peers", action="store_true", help="measure without LiteLLM and Portkey")
    parser.add_argument("--no-netns", action="store_true", help="do not isolate the measuring phase in a loopback-only namespace")
    parser.add_argument("--no-report", action="store_true", help="write the JSON only")
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report-only", metavar="RESULTS_JSON", help="re-render docs/performance.md from a results file")
    parser.add_argument("--baseline", metavar="RESULTS_JSON[,RESULTS_JSON…]",
                        help="the runs the report compares with, oldest first, comma-separated (default: the latest "
                             "full run before this one at another commit with a clean gateway tree, and the same "
                             "again before that one: two earlier commits); their commits are also the older versions "
                             "of the same-run A/B, storage-client and cold-start comparisons")
    return parser.parse_args(argv)


# -- preparing ------------------------------------------------------------------------------

def tools_python() -> Path:
    return HOME / "tools" / "venv" / "bin" / "python"


def prepare_tools() -> dict:
    """matplotlib (plots), py-spy and pyinstrument (profiles): the bench's own venv, not the project's."""
    venv = HOME / "tools" / "venv"
    marker = HOME / "tools" / ".installed"
    wanted = "matplotlib py-spy pyinstrument"
    if not (marker.exists() and marker.read_text() == wanted):
        log(f"installing the bench's tools ({wanted}) into {venv} (first run only)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        uv = ROOT / ".venv" / "bin" / "uv"
        argv = ([str(uv), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python")] if uv.exists()
                else [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"])
        done = subprocess.run(argv + wanted.split())
        if done.returncode != 0:
            return {"error": "could not install the bench's tools"}
        marker.write_text(wanted)
    py_spy = venv / "bin" / "py-spy"
    return {"python": str(venv / "bin" / "python"), "py_spy": str(py_spy) if py_spy.exists() else None}


def baseline_files(args: argparse.Namespace, results: dict, results_file: Path | None = None) -> list[Path]:
    """The runs compared with, oldest first: --baseline, else the chain of earlier commits' runs."""
    from . import report

    if args.baseline:
        return [Path(p) for p in args.baseline.split(",") if p.strip()]
    return report.find_baselines(results, results_file)


def baseline_versions(args: argparse.Namespace) -> dict[str, Path]:
    """The baselines' commits, oldest first, each with its layers/ and functions/ extracted."""
    results = {"git": git_state(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    versions: dict[str, Path] = {}
    for path in baseline_files(args, results):
        commit = json.loads(path.read_text()).get("git", {}).get("commit")
        if not commit or commit == results["git"]["commit"] or commit in versions:
            continue
        tree = version_tree(commit)
        if tree is not None:
            versions[commit] = tree
    return versions


def prepare(args: argparse.Namespace) -> dict:
    from . import coldstart, peers

    HOME.mkdir(exist_ok=True)
    prepared: dict = {"tools": prepare_tools()}
    versions = baseline_versions(args)
    prepared["versions"] = {commit: {"tree": str(tree)} for commit, tree in versions.items()}
    if args.skip_peers:
        prepared["litellm"] = peers.PeerStatus("litellm", problems=["skipped (--skip-peers)"]).as_dict()
        prepared["portkey"] = peers.PeerStatus("portkey", problems=["skipped (--skip-peers)"]).as_dict()
    else:
        prepared["litellm"] = peers.install_litellm(HOME).as_dict()
        prepared["portkey"] = peers.install_portkey(HOME).as_dict()
        prepared["redis"] = peers.install_redis(HOME)
        prepared["samejob_extras"] = peers.install_samejob_extras(HOME, peers.PeerStatus(**prepared["litellm"]))
        log("trying LiteLLM's database layer (prisma generate on its schema)")
        prepared["prisma_probe"] = peers.prisma_probe(HOME, peers.PeerStatus(**prepared["litellm"]))
        log(f"  exit {prepared['prisma_probe'].get('exit')}: {(prepared['prisma_probe'].get('output') or '')[-200:]}")
    if {"coldstart", "memory", "sizes"} <= skipped(args):
        prepared["coldstart_build"] = {"error": "skipped"}
    else:
        log("building the x86 layer and functions for cold starts (python3.13)")
        prepared["coldstart_build"] = coldstart.build(HOME / "coldstart", log)
        if "coldstart" not in skipped(args):
            for commit, tree in versions.items():
                log(f"  and the gateway at {commit}, for the same-run cold-start comparison")
                prepared["versions"][commit]["coldstart_build"] = coldstart.build(
                    HOME / "coldstart" / "versions" / commit, log, source=tree, deps_root=HOME / "coldstart")
    (HOME / "prepared.json").write_text(json.dumps(prepared, indent=1))
    return prepared


def skipped(args: argparse.Namespace) -> set[str]:
    return {s.strip() for s in args.skip.split(",") if s.strip()}


def netns_argv(argv: list[str]) -> list[str] | None:
    """The command that re-runs the bench inside a new, loopback-only network namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return None
    probe = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
            sys.executable, "-m", "bench", *argv, "--in-netns"]


# -- measuring ------------------------------------------------------------------------------

def machine() -> dict:
    import platform

    info = {"nproc": os.cpu_count(), "kernel": platform.release(), "python_gateway": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
        info["loadavg_at_start"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    for name, argv in (("node", ["node", "--version"]), ("python_peers", [sys.executable, "--version"])):
        try:
            info[name] = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info[name] = None
    return info


def git_state() -> dict:
    def run(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in run("status", "--porcelain", "--", "layers", "functions").splitlines() if len(line) > 3]
    return {"commit": run("rev-parse", "--short", "HEAD").strip(), "gateway_files_changed_since_commit": changed}


def measure(args: argparse.Namespace, prepared: dict) -> dict:
    from . import coldstart, peers, scenarios
    from .floor import GAPS_PREFIX
    from .goals import CPU_TARGET, FLOOR_KILN, FLOOR_PROXY, LOOPBACK_STANDIN, LOOPBACK_TARGET, STORAGE_CALLS_PER_REQUEST
    from .procs import Procs
    from .stack import Stack

    size = QUICK if args.quick else FULL
    skip = skipped(args)
    procs = Procs(HOME / "logs")
    results: dict = {
        "schema": 1,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
        "isolated_network": args.in_netns,
        "machine": machine(),
        "git": git_state(),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in size.items()},
        "peers": {},
        "skipped_sections": sorted(skip),
    }
    started = time.monotonic()
    try:
        log("starting the embedded AWS, the mock upstream, provisioning")
        stack = Stack(procs)
        stack.start()
        results["stack"] = {"aws_url": stack.aws_url, "mock_url": stack.mock_url}
        mock_port = int(stack.mock_url.rsplit(":", 1)[1])
        kiln_headers = {"authorization": f"Bearer {stack.key}"}

        def kiln_target() -> scenarios.Target:
            child, url = stack.start_function("kiln-chat_completions")
            return scenarios.Target("kiln", f"{url}/v1", kiln_headers, child, gap_base=f"{url}/v1")

        def restartable(start: Callable[[], scenarios.Target]) -> scenarios.Target:
            """A target started by `start`, which the matrix restarts for each cell (its
            process stopped, a fresh one started the same way)."""
            target = start()

            def restart() -> scenarios.Target:
                if target.child is not None:
                    procs.stop(target.child)
                return start()

            target.restart = restart
            return target

        direct = scenarios.Target("direct", f"{stack.mock_url}/v1", {}, None, gap_base=stack.gap_base)
        kiln = restartable(kiln_target)
        targets = [direct, kiln]
        standin_url = None
        if {"matrix", "sizes", "profile"} - skip:
            log(f"starting the storage stand-in ({size['standin_service_ms']} ms per call, no lock), seeded from the "
                f"embedded AWS")
            standin_url = stack.start_standin(size["standin_service_ms"])
            results["standin"] = {"url": standin_url, "service_ms": size["standin_service_ms"]}

        standin_before: dict = {}

        def standin_stats(url: str | None = None) -> dict:
            import httpx

            return httpx.get(f"{url or standin_url}/__standin/stats", timeout=10, trust_env=False).json()

        def standin_target() -> scenarios.Target:
            child, url = stack.start_function("kiln-standin", probe=True, aws_url=standin_url)
            standin_before.update(standin_stats())  # what the stand-in served before this cell
            return scenarios.Target("kiln-standin", f"{url}/v1", kiln_headers, child)

        def standin_after_cell(target: scenarios.Target) -> dict:
            """The probe's storage figures and the stand-in's own service time over this cell."""
            out = scenarios.storage_wait(target.base[:-len("/v1")])
            after = standin_stats()
            calls = after["calls"] - standin_before.get("calls", 0)
            waited = after["waited_s"] - standin_before.get("waited_s", 0.0)
            out["standin_cell"] = {"calls": calls, "service_ms_mean": round(waited * 1000 / calls, 3) if calls else None}
            return out

        def bare_target() -> scenarios.Target:
            child, url = stack.start_function(CPU_TARGET, aws_url=standin_url)
            return scenarios.Target(CPU_TARGET, f"{url}/v1", kiln_headers, child)

        def floor_target(name: str, storage_calls: int) -> scenarios.Target:
            def start() -> scenarios.Target:
                child, url = stack.start_floor(name, storage_calls=storage_calls, storage_url=standin_url or "")
                return scenarios.Target(name, f"{url}/v1", {}, child, gap_base=f"{url}{GAPS_PREFIX}v1")

            return restartable(start)

        if standin_url and "matrix" not in skip:
            standin = restartable(standin_target)
            standin.gaps, standin.after_cell = False, standin_after_cell
            targets.append(standin)
            # the same function over the same stand-in without the probe: its own CPU, for the CPU goal
            bare = restartable(bare_target)
            bare.gaps = False
            targets.append(bare)
        litellm_status = peers.PeerStatus(**prepared["litellm"])
        portkey_status = peers.PeerStatus(**prepared["portkey"])
        need_peers = bool({"matrix", "gaps"} - skip) and not args.skip_peers
        if need_peers:
            log("starting LiteLLM (its import takes a while) and Portkey")
            litellm_child = peers.start_litellm(procs, HOME, litellm_status, stack.mock_url, stack.gap_base)
            if litellm_child is not None:
                targets.append(scenarios.Target("litellm", litellm_status.url, peers.litellm_headers(), litellm_child))
            samejob_status = peers.PeerStatus("litellm-samejob", version=litellm_status.version,
                                              installed=litellm_status.installed)
            redis = peers.start_redis(procs, prepared.get("redis") or {})
            if prepared.get("samejob_extras"):
                samejob_status.problems.append(prepared["samejob_extras"])
            if redis is None:
                samejob_status.problems.append(f"Redis did not start: {(prepared.get('redis') or {}).get('error', '?')}")
            else:
                stack.redis = redis[0]
                samejob_status.notes.append(f"Redis: {(prepared.get('redis') or {}).get('version')}")
                samejob_child = peers.start_litellm_samejob(procs, HOME, samejob_status, stack.mock_url, redis[1])
                if samejob_child is not None:
                    try:
                        results["samejob_checks"] = peers.samejob_checks(samejob_status.url)
                    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                        results["samejob_checks"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    log(f"  LiteLLM same job: {results['samejob_checks']}")
                    targets.append(scenarios.Target("litellm-samejob", samejob_status.url, peers.samejob_headers(),
                                                    samejob_child, concurrencies=(1, 8), gaps=False))
                    if standin_url and "matrix" not in skip:
                        # Kiln over storage as near as the peer's Redis on loopback (a stand-in with no
                        # service time), for the same-job comparison at equal storage latency
                        loopback_url = stack.start_standin(0.0, name=LOOPBACK_STANDIN)
                        results["standin"]["loopback"] = {"url": loopback_url, "service_ms": 0.0}

                        def loopback_target() -> scenarios.Target:
                            child, url = stack.start_function(LOOPBACK_TARGET, aws_url=loopback_url)
                            return scenarios.Target(LOOPBACK_TARGET, f"{url}/v1", kiln_headers, child)

                        loopback = restartable(loopback_target)
                        loopback.concurrencies, loopback.gaps = (1, 8), False
                        targets.append(loopback)
            results["peers"]["litellm-samejob"] = samejob_status
            results["prisma_probe"] = prepared.get("prisma_probe")
            portkey_child = peers.start_portkey(procs, HOME, portkey_status)
            if portkey_child is not None:
                targets.append(scenarios.Target(
                    "portkey", portkey_status.url, peers.portkey_headers(f"{stack.mock_url}/v1"), portkey_child,
                    gap_headers=peers.portkey_headers(stack.gap_base)))
        by_name = {t.name: t for t in targets}

        if "matrix" not in skip:
            log(f"latency matrix: {len(targets)} targets × buffered/stream × c={size['concurrencies']}, "
                f"{size['count']} requests or {size['time_limit']:.0f} s per cell")
            results["matrix"] = scenarios.latency_matrix(
                targets, modes=(False, True), concurrencies=tuple(size["concurrencies"]), count=size["count"],
                time_limit=size["time_limit"], warmup=size["warmup"], mock_port=mock_port, log=log,
                others={"emulator": stack.emulator.pid, "mock upstream": stack.mock.pid,
                        **({"storage stand-in": stack.standin.pid} if standin_url else {})})
        if standin_url:
            results["standin"]["stats"] = standin_stats()  # over the matrix
        loopback_standin = stack.standins.get(LOOPBACK_STANDIN)
        if loopback_standin is not None:
            import httpx

            loopback = results["standin"]["loopback"]
            try:
                loopback["stats"] = standin_stats(loopback["url"])
            except httpx.HTTPError as exc:
                loopback["stats_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if LOOPBACK_TARGET in by_name and by_name[LOOPBACK_TARGET].child is not None:
                procs.stop(by_name[LOOPBACK_TARGET].child)
                by_name[LOOPBACK_TARGET].child = None  # stopped: nothing later stops it again
            procs.stop(loopback_standin)  # the matrix was its only use
        if "cpu" not in skip and CPU_TARGET in by_name and "portkey" in by_name:
            # beside them, the floors: the same exchanges with no gateway in the process (bench/floor.py)
            floors = [floor_target(FLOOR_KILN, STORAGE_CALLS_PER_REQUEST), floor_target(FLOOR_PROXY, 0)]
            log(f"CPU rounds: {CPU_TARGET}, portkey and the floors ({FLOOR_KILN}, {FLOOR_PROXY}) side by side, "
                f"{size['cpu_rounds']} rounds of {size['cpu_count']} requests after {size['cpu_warmup']} per mode and "
                "concurrency")
            results["cpu_rounds"] = scenarios.cpu_rounds(
                [by_name[CPU_TARGET], by_name["portkey"], *floors], modes=(False, True),
                concurrencies=tuple(size["concurrencies"]), rounds=size["cpu_rounds"], count=size["cpu_count"],
                warmup=size["cpu_warmup"], log=log, spaced=(by_name[CPU_TARGET], by_name["portkey"], floors[0]),
                spaced_counts={c: n for c, n in size["cpu_spaced"].items() if c in size["concurrencies"]})
            for floor in floors:
                if floor.child is not None:
                    procs.stop(floor.child)
        if "gaps" not in skip:
            log(f"chunk gaps: upstream emits a token every 20 ms, {size['gap_requests']} streams per target")
            results["gaps"] = scenarios.chunk_gaps(targets, requests=size["gap_requests"], time_limit=90, log=log)
        samejob = results["peers"].pop("litellm-samejob", None)
        peer_statuses = [("litellm", litellm_status), ("portkey", portkey_status)]
        if samejob is not None:
            peer_statuses.append(("litellm-samejob", samejob))
        for peer_name, status in peer_statuses:
            target = by_name.get(peer_name)
            if target is not None:
                target.check_alive()
                status.problems.extend(target.problems)
                if target.child is not None and target.child.alive():
                    from .procs import peak_rss_mb

                    status.notes.append(f"peak RSS (process tree) after the run: {peak_rss_mb(target.child.pid, tree=True)} MB")
                    results.setdefault("peer_rss_mb", {})[peer_name] = peak_rss_mb(target.child.pid, tree=True)
            results["peers"][peer_name] = status.as_dict()
        if kiln.child is not None and kiln.child.alive():
            from .procs import peak_rss_mb

            results.setdefault("peer_rss_mb", {})["kiln (venv python, last matrix process)"] = peak_rss_mb(kiln.child.pid)
        for target in targets:
            if target.child is not None and target.name != "kiln":
                procs.stop(target.child)
        if getattr(stack, "redis", None) is not None:
            procs.stop(stack.redis)
        if kiln.child is not None:
            procs.stop(kiln.child)

        if "breakdown" not in skip:
            log("where Kiln's time goes (probed gateway)")
            results["breakdown"] = scenarios.where_time_goes(stack, count=size["breakdown_count"],
                                                             steady_seconds=size["steady_seconds"], log=log)
        if "client" not in skip:
            from . import storageclient
            from .stack import FAKE_AWS, clean_env

            log(f"one storage call's cost: kiln.aws.AwsClient, kiln.http1, httpx and a bare exchange against the "
                f"embedded AWS and a keep-alive stub, {size['client_calls']} GetItem calls each")
            results["storage_client"] = storageclient.measure(
                sys.executable, stack.aws_url, stack.settings_env.get("KILN_ORGS_TABLE", "kiln-orgs"),
                count=size["client_calls"], env=clean_env(**FAKE_AWS),
                versions={c: Path(v["tree"]) for c, v in (prepared.get("versions") or {}).items()})
            for name, entry in (results["storage_client"].get("clients") or {}).items():
                log(f"  {name}: {entry}")
            for label, entry in (results["storage_client"].get("versions") or {}).items():
                log(f"  at {label}: {entry.get('clients') or entry}")
            if results["storage_client"].get("error"):
                log(f"  FAILED: {results['storage_client']['error'][-300:]}")
        if "ab" not in skip:
            results["ab"] = same_run_ab(prepared, results, stack, size)
        if "profile" not in skip:
            log("profiling the gateway and the embedded AWS under c=16 buffered load (py-spy)")
            results["profile"] = scenarios.profile_gateway(
                stack, prepared["tools"].get("py_spy"), HOME / "profiles", stream=False, concurrency=16,
                count=size["profile_count"], extra_pids={"emulator": stack.emulator.pid}, log=log)
            if standin_url:
                log("  and the gateway over the storage stand-in (no emulator queue in front of its storage calls)")
                results["profile_standin"] = scenarios.profile_gateway(
                    stack, prepared["tools"].get("py_spy"), HOME / "profiles", stream=False, concurrency=16,
                    count=size["profile_count"], extra_pids={"stand-in": stack.standin.pid}, log=log,
                    aws_url=standin_url, label="-standin")
        if "sse" not in skip:
            log("SSE rewriting cost (SseRelay.feed microbenchmark)")
            results["sse"] = scenarios.sse_cost(repeats=size["sse_repeats"])
            log("  " + ", ".join(f"{k}: {v['us_per_event']} µs/event" for k, v in results["sse"]["shapes"].items()))
        built = prepared.get("coldstart_build", {"error": "not built"})
        if "coldstart" not in skip:
            log(f"cold starts: 4 functions + bare FastAPI, with/without .pyc, {size['cold_repeats']} starts each")
            older = {c: v["coldstart_build"] for c, v in (prepared.get("versions") or {}).items()
                     if "error" not in (v.get("coldstart_build") or {"error": "not built"})}
            if older:
                log(f"  interleaved with the same starts of the gateway at {', '.join(older)}")
            results["coldstart"] = coldstart.measure(procs, stack, built, repeats=size["cold_repeats"], log=log,
                                                     versions=older, label=results["git"]["commit"])
            results["coldstart"]["build"] = built
        if "memory" not in skip:
            log(f"memory: {size['memory_buffered']} buffered + {size['memory_streamed']} streamed requests "
                f"at c={size['memory_concurrency']} to a fresh chat/completions function")
            results["memory"] = {}
            if "error" not in built:
                from .procs import free_port, wait_http

                def start_built():
                    port = free_port()
                    task_root = Path(built["pyc"]) / "functions" / "chat_completions"
                    env = stack.function_env(port, task_root, python_dir=str(Path(built["python"]).parent),
                                             pythonpath=str(Path(built["pyc"]) / "layer" / "python"),
                                             PYTHONDONTWRITEBYTECODE="1")
                    child = procs.start("memory-chat-py313", ["sh", str(task_root / "run.sh")], env=env, cwd=task_root)
                    wait_http(f"http://127.0.0.1:{port}/healthz", child=child, ok=lambda s: s == 200)
                    return child, f"http://127.0.0.1:{port}"

                results["memory"]["layer_python313"] = scenarios.memory(
                    stack, start_built, buffered=size["memory_buffered"], streamed=size["memory_streamed"],
                    concurrency=size["memory_concurrency"], log=log, label=f"built x86 layer, {built.get('python_version')}")
            results["memory"]["venv"] = scenarios.memory(
                stack, lambda: stack.start_function("memory-chat-venv"), buffered=size["memory_buffered"],
                streamed=size["memory_streamed"], concurrency=size["memory_concurrency"], log=log,
                label=f"project venv, Python {results['machine']['python_gateway']}")
        if "sizes" not in skip and standin_url:
            results["sizes"] = lambda_sizes(stack, procs, built, standin_url, size)
    except KeyboardInterrupt:
        results["interrupted"] = True
        log("interrupted: stopping everything")
    except Exception as exc:  # the JSON still records how far it got
        import traceback

        results["failure"] = traceback.format_exc()[-4000:]
        log(f"FAILED: {type(exc).__name__}: {exc}")
    finally:
        procs.stop_all()
    results["duration_s"] = round(time.monotonic() - started, 1)
    return results


def lambda_sizes(stack, procs, built: dict, standin_url: str, size: dict) -> dict:
    """The chat function under each Lambda size's CPU quota (bench/lambdasizes.py), on the stand-in."""
    from . import lambdasizes
    from .procs import free_port, wait_http
    from .stack import LONG_DELAY_MS, LONG_MODEL

    use_built = "error" not in built
    label = f"built x86 layer, {built.get('python_version')}" if use_built else "project venv (no python3.13 build)"

    def start(wrap, name):
        port = free_port()
        if use_built:
            task_root = Path(built["pyc"]) / "functions" / "chat_completions"
            env = stack.function_env(port, task_root, python_dir=str(Path(built["python"]).parent),
                                     pythonpath=str(Path(built["pyc"]) / "layer" / "python"),
                                     PYTHONDONTWRITEBYTECODE="1", KILN_AWS_ENDPOINT_URL=standin_url)
        else:
            task_root = ROOT / "functions" / "chat_completions"
            env = stack.function_env(port, task_root, KILN_AWS_ENDPOINT_URL=standin_url)
        child = procs.start(name, wrap(["sh", str(task_root / "run.sh")]), env=env, cwd=task_root)
        wait_http(f"http://127.0.0.1:{port}/healthz", child=child, ok=lambda s: s == 200, timeout=120)
        return child, f"http://127.0.0.1:{port}"

    log(f"Lambda sizes: {', '.join(f'{m} MB' for m in size['sizes_mb'])} under CPU quotas ({label}), "
        f"{size['sizes_buffered']} buffered + {size['sizes_streams']} short streams each, one request at a time")
    return lambdasizes.measure(stack, start, standin_url, sizes=tuple(size["sizes_mb"]), buffered=size["sizes_buffered"],
                               short_streams=size["sizes_streams"], long_model=LONG_MODEL, long_tokens=size["long_tokens"],
                               long_seconds=size["long_tokens"] * LONG_DELAY_MS / 1000, log=log, label=label)


def version_tree(commit: str) -> Path | None:
    """layers/ and functions/ of `commit`, extracted once under .bench/versions/ (git archive)."""
    tree = HOME / "versions" / commit
    if (tree / ".complete").exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "layers/gateway", "functions"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        return None
    untar = subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, capture_output=True)
    if untar.returncode != 0:
        return None
    (tree / ".complete").write_text(commit)
    return tree


def same_run_ab(prepared: dict, results: dict, stack, size: dict) -> dict:
    """The baseline runs' gateways (their commits, oldest first) and this tree's, cell by cell in this run."""
    from . import scenarios

    versions = {commit: Path(v["tree"]) for commit, v in (prepared.get("versions") or {}).items()}
    if not versions:
        return {"error": "no baseline run to take a commit from"}
    now = results["git"]["commit"] + (" + working tree" if results["git"].get("gateway_files_changed_since_commit") else "")
    log(f"same-run A/B: the gateway at {', '.join(versions)} and {now}, {size['ab_rounds']} rounds of "
        f"{size['ab_count']} requests per cell, alternating")
    return scenarios.ab_versions(stack, {**versions, results["git"]["commit"]: ROOT}, count=size["ab_count"],
                                 rounds=size["ab_rounds"], log=log)


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw_argv)
    from . import report

    if args.report_only:
        results = json.loads(Path(args.report_only).read_text())
        baselines = baseline_files(args, results, Path(args.report_only).resolve())
        log(f"report: {report.render(results, tools_python(), Path(args.report_only).resolve(), baselines)}")
        return 0
    if not args.in_netns:
        prepared = prepare(args)
        wrapped = None if args.no_netns else netns_argv(raw_argv)
        if wrapped is not None:
            log("measuring inside a new network namespace with loopback only (unshare --net)")
            return subprocess.call(wrapped, cwd=ROOT)
        if not args.no_netns:
            log("cannot create a private network namespace (needs root and unshare): measuring on the host's "
                "loopback; every target is still addressed at 127.0.0.1 only")
    else:
        prepared = json.loads((HOME / "prepared.json").read_text())
    results = measure(args, prepared)
    path = report.save(results)
    log(f"results: {path}")
    if not args.no_report:
        log(f"report: {report.render(results, tools_python(), path, baseline_files(args, results, path))}")
    return 1 if results.get("failure") else 0


if __name__ == "__main__":
    sys.exit(main())
